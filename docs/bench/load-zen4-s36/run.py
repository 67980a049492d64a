"""Load times and decoding speed of the int4 1.5B quantized in the process and loaded from its packed
copy (``models/packed_cache.py``), on one machine, one process:

    python docs/bench/load-zen4-s36/run.py

Loads the model both ways (the packed copy is written on the first run: run it twice), then decodes
64 tokens greedily with each, alternating five times, and prints the load seconds, the decode
seconds and their medians, and whether the tokens are the same."""
from __future__ import annotations

import os
import statistics
import time

from tokenleap.config import SamplingParams
from tokenleap.models.pretrained import load_model
from tokenleap.spec.engine import Engine

MODEL = "qwen2.5-coder-1.5b-instruct"
loaded, seconds = {}, {}
for name, flag in (("quantized", "0"), ("packed", "1")):
    os.environ["TOKENLEAP_PACKED_CACHE"] = flag
    t = time.perf_counter()
    loaded[name] = load_model(MODEL, quant="int4")
    seconds[name] = time.perf_counter() - t
ids = loaded["quantized"].tokenizer.encode("def quicksort(arr):")
params = SamplingParams(max_tokens=64, ignore_eos=True)
decode: dict[str, list[float]] = {name: [] for name in loaded}
tokens = {}
for _ in range(5):
    for name, m in loaded.items():
        engine = Engine(m.model, m.tokenizer, max_len=256)
        t = time.perf_counter()
        *_, (seq, _) = engine.generate(ids, params)
        decode[name].append(time.perf_counter() - t)
        tokens[name] = seq.generated
print({"load_seconds": seconds, "decode_seconds": decode,
       "decode_medians": {k: statistics.median(v) for k, v in decode.items()},
       "same_tokens": tokens["quantized"] == tokens["packed"]})
