"""The fit test's reference end to end on SmolLM2 (vocabulary 49,152): the rows (or, from 7d0b26b on, each row's
figures) for three sets of N samples of P tokens, then ``fit_of`` on each set; prints the time and peak memory.

    python pipe.py new 300 8                                # this checkout
    PYTHONPATH=OLD/src python pipe.py old 300 8             # OLD: a checkout of 54c7283 (whole rows kept)
"""
import resource
import sys
import time

import torch

from tokenleap.models.pretrained import load_model
from tokenleap.spec import exact_probs
from tokenleap.spec.certify import fit_of

which, n, positions = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
m = load_model("smollm2-135m-instruct")
prompt = m.tokenizer.encode("Once upon a time, in a small village by the sea,")
sets = []
for _ in range(3):
    counts: dict = {}
    for _ in range(n):  # a shared start, as sampled text has: the first two tokens from a few
        s = tuple([int(t) for t in torch.randint(0, 4, (2,))] + [int(t) for t in torch.randint(0, 2000, (positions - 2,))])
        counts[s] = counts.get(s, 0) + 1
    sets.append(counts)
t0 = time.perf_counter()
fn = exact_probs.plain_next_figures if which == "new" else exact_probs.plain_next_probs
table = fn(m.model, prompt, set().union(*sets), 0.8)
t1 = time.perf_counter()
fits = [fit_of(c, table, torch.Generator().manual_seed(4)) for c in sets]
t2 = time.perf_counter()
print({"which": which, "reference_s": round(t1 - t0, 1), "fits_s": round(t2 - t1, 1), "total_s": round(t2 - t0, 1),
       "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
       "fits": [(round(f.ks.statistic, 6), round(f.score.z, 6)) for f in fits]})
