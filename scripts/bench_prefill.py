"""Time the prefill of a fresh prompt of N tokens, as the engine runs it: forwards of up to
``--chunk`` rows (the engine's prefill chunk), logits for the last row only. Prints prompt tokens
per second, the median over repeats after one warm-up. Compare builds by running the script from
each (``PYTHONPATH=WORKTREE/src``), alternating: this machine's speed drifts between processes.

    python scripts/bench_prefill.py --tokens 100 160 400
    python scripts/bench_prefill.py --model qwen2.5-coder-0.5b-instruct --gguf-other int4 --tokens 160
    python scripts/bench_prefill.py --compare-row-exact   # windows computed batched vs row-exact, taking turns
    python scripts/bench_prefill.py --random-like config.json --quant w8a8 --compare-row-exact
    python scripts/bench_prefill.py --compare-attention512 --tokens 1000 3000   # row-exact windows, AVX2 vs AVX-512 attention

``--random-like`` builds the model from a Hugging Face config.json with random weights (as
``bench_steps.py`` does), for machines that hold no checkpoint.

Token ids are random (a prefill's cost depends on its length, not on which tokens).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tokenleap import kernels
from tokenleap.cache.contiguous import KVCache
from tokenleap.models.pretrained import load_model
from tokenleap.models.transformer import Segment
from tokenleap.spec.engine import PREFILL_CHUNK

from bench_steps import random_model


def prefill_seconds(model, tokens: torch.Tensor, cache: KVCache, chunk: int, row_exact: bool = False) -> float:
    """Seconds to prefill ``tokens`` [n] into a fresh slot of ``cache`` in chunks, as the engine does
    (``row_exact``: as it does where that costs nothing, ``backend.exact_prefill_is_free``)."""
    slot = cache.allocate()
    n = tokens.numel()
    t0 = time.perf_counter()
    for start in range(0, n, chunk):
        rows = min(chunk, n - start)
        model(tokens[start:start + rows], [Segment(slot, start, rows)], cache, logit_rows=torch.tensor([rows - 1]),
              row_exact=row_exact)
    seconds = time.perf_counter() - t0
    cache.free(slot)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--gguf-other", default="int8", help="how a GGUF's non-4-bit tensors load (drafts: int4)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[100, 160, 400])
    ap.add_argument("--chunk", type=int, default=PREFILL_CHUNK)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--random-like", metavar="CONFIG_JSON", help="random weights in this HF config's shape")
    ap.add_argument("--json", action="store_true", help="one JSON line: prompt length -> tokens per second")
    ap.add_argument("--compare-row-exact", action="store_true",
                    help="time each length both ways, batched and row-exact windows, taking turns")
    ap.add_argument("--compare-attention512", action="store_true",
                    help="time row-exact windows with the AVX2 and the AVX-512 attention kernel, taking turns")
    args = ap.parse_args()
    # (label, row_exact, AVX-512 attention or None: as loaded) of each way timed
    if args.compare_attention512:
        if not kernels.attention512_supported():
            raise SystemExit("--compare-attention512: this CPU has no AVX-512")
        modes = [("row-exact AVX2 attention", True, False), ("row-exact AVX-512 attention", True, True)]
    elif args.compare_row_exact:
        modes = [("batched", False, None), ("row-exact", True, None)]
    else:
        modes = [("batched", False, None)]
    if args.random_like:
        model = random_model(args.random_like, "auto", args.quant)
        args.model = f"random weights shaped like {args.random_like}"
    else:
        model = load_model(args.model, quant=args.quant, gguf_other=args.gguf_other).model
    gen = torch.Generator().manual_seed(0)
    out = {}
    for n in args.tokens:
        cache = KVCache(model.config, 1, n + 1, model.dtype)
        tokens = torch.randint(0, 1000, (n,), generator=gen)
        times = {m: [] for m in modes}
        for _ in range(args.repeats + 1):
            for m in modes:
                if m[2] is not None:
                    kernels.set_attention512(m[2])
                times[m].append(prefill_seconds(model, tokens, cache, args.chunk, m[1]))
        rates = [round(n / statistics.median(times[m][1:]), 1) for m in modes]
        out[n] = rates if len(modes) > 1 else rates[0]
    if args.json:
        print(json.dumps(out))
        return
    print(f"{args.model} ({args.quant}, other {args.gguf_other}), {torch.get_num_threads()} threads, chunk {args.chunk}")
    for n, rate in out.items():
        if len(modes) > 1:
            print(f"{n} tokens: {modes[0][0]} {rate[0]} tokens/s, {modes[1][0]} {rate[1]} tokens/s "
                  f"({rate[1] / rate[0]:.3f}x)")
        else:
            print(f"{n} tokens: {rate} tokens/s")


if __name__ == "__main__":
    main()
