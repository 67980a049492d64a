"""Time the attention kernel alone (``attend_rows``) at a model's shapes (default: Qwen2.5 1.5B's 28
layers of 12 query heads over 2 kv heads of 128; the 0.5B: --layers 24 --heads 14 --head-dim 64):
R new rows over a cache of C keys, every layer's keys and values in their own buffers (so they
come from memory, as in a model), median ms for all layers together.

    python scripts/bench_attention.py --context 500 2000 --rows 1 4 8
    python scripts/bench_attention.py --compare-avx512   # the AVX-512 kernel vs the AVX2 one, alternating

Run it with ``PYTHONPATH=<another checkout>/src`` to time another version of the kernel on the same
shapes (the script uses only ``tokenleap.kernels.attend_rows``).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenleap import kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=12, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--context", type=int, nargs="+", default=[500, 2000])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--compare-avx512", action="store_true",
                    help="time the AVX-512 kernel and the AVX2 one, taking turns (a CPU with AVX-512)")
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit(f"kernels unavailable: {kernels.unavailable_reason()}")
    if args.compare_avx512 and not kernels.attention512_supported():
        raise SystemExit("--compare-avx512: this CPU has no AVX-512 (F / DQ / VL)")
    modes = (True, False) if args.compare_avx512 else (None,)
    heads, kv, hd, layers = args.heads, args.kv_heads, args.head_dim, args.layers
    g = torch.Generator().manual_seed(0)
    print(f"{layers} layers, {heads} query heads, {kv} kv heads, head dim {hd}; "
          f"{torch.get_num_threads()} threads; median ms for all layers")
    for ctx in args.context:
        L = ctx + max(args.rows)
        keys = [torch.randn(kv, L, hd, generator=g) for _ in range(layers)]
        values = [torch.randn(kv, L, hd, generator=g) for _ in range(layers)]
        for rows in args.rows:
            q = torch.randn(rows, heads, hd, generator=g)
            times = {m: [] for m in modes}
            for _ in range(args.repeats):
                for m in modes:
                    if m is not None:
                        kernels.set_attention512(m)
                    t = time.perf_counter()
                    for i in range(layers):
                        kernels.attend_rows(q, keys[i][:, : ctx + rows], values[i][:, : ctx + rows], ctx, hd ** -0.5)
                    times[m].append(time.perf_counter() - t)
            ms = {m: statistics.median(ts) * 1e3 for m, ts in times.items()}
            if args.compare_avx512:
                print(f"context {ctx}, rows {rows}: AVX-512 {ms[True]:.2f} ms, AVX2 {ms[False]:.2f} ms "
                      f"({ms[True] / ms[False]:.2f}x)")
            else:
                print(f"context {ctx}, rows {rows}: {ms[None]:.2f} ms")


if __name__ == "__main__":
    main()
