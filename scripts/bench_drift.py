"""Do a draft model and its target slow down and speed up together? One-row steps of each, after a
300-token prompt, alternating for ``--seconds``; per window of ``--window`` steps the median of each,
then the range of both, their correlation across windows, and the range of draft / target.

    python scripts/bench_drift.py --seconds 90

``spec/costs.py`` reads a draft's cost figures at the drift of its target's forwards since the draft
last ran, which is right where the ratio stays put while both move.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenleap.cache.contiguous import KVCache
from tokenleap.models.pretrained import load_model
from tokenleap.models.transformer import Segment


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--window", type=int, default=20)
    args = ap.parse_args()
    models = [load_model(args.target, quant=args.quant).model,
              load_model(args.draft, quant=args.quant, gguf_other="int4").model]  # as the engine loads a draft
    slots = []
    for m in models:
        cache = KVCache(m.config, 1, args.prompt + 1, m.dtype)
        slot = cache.allocate()
        m(torch.randint(0, 1000, (args.prompt,), generator=torch.Generator().manual_seed(0)),
          [Segment(slot, 0, args.prompt)], cache)
        slots.append((cache, slot))

    def step(i: int) -> float:
        cache, slot = slots[i]
        t = time.perf_counter()
        models[i](torch.arange(1), [Segment(slot, args.prompt, 1)], cache, row_exact=True)
        return time.perf_counter() - t

    times: tuple[list[float], list[float]] = ([], [])
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        for i in (0, 1):
            times[i].append(step(i))
    w = args.window
    target, draft = ([statistics.median(t[j:j + w]) * 1e3 for j in range(0, len(t) - w + 1, w)] for t in times)
    ratios = [d / t for t, d in zip(target, draft)]
    print(f"{len(target)} windows of {w} steps, {torch.get_num_threads()} threads")
    print(f"target one-row step: {min(target):.1f} - {max(target):.1f} ms (median {statistics.median(target):.1f})")
    print(f"draft one-row step:  {min(draft):.2f} - {max(draft):.2f} ms (median {statistics.median(draft):.2f})")
    print(f"correlation across windows: {statistics.correlation(target, draft):.2f}")
    print(f"draft / target: {min(ratios):.3f} - {max(ratios):.3f}")


if __name__ == "__main__":
    main()
