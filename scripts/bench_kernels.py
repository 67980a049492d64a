"""Microbenchmark of tokenleap's weight-product kernels: int4 (W4A8), int6 (W6A8, Q6_K), int8 and bf16, one layer shape,
1..8 rows, weights streamed from memory (a rotation of copies larger than the L3 cache).

    python scripts/bench_kernels.py [--n 1536 --k 8960]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenleap import kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1536, help="output features")
    ap.add_argument("--k", type=int, default=8960, help="input features")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8])
    ap.add_argument("--huge-pages", action="store_true", help="weights on huge pages, as a loaded model keeps them")
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit(f"kernels unavailable: {kernels.unavailable_reason()}")
    n, k = args.n, args.k
    copies = max(2, int(128e6 // (n * k)))  # > 64 MB of int8 weights: every call reads from memory
    g = torch.Generator().manual_seed(0)
    int4, int6, int8, bf16 = [], [], [], []
    for _ in range(copies):
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        scale = torch.rand(n, k // 32, generator=g) * 0.02
        int4.append(kernels.pack_int4(q, scale, -8 * scale))
        int8.append((kernels.pack_int8(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)),
                     torch.rand(n, generator=g)))
        if k % 16 == 0:
            bf16.append((kernels.pack_bf16(torch.randn(n, k, generator=g).to(torch.bfloat16)),))
        if k % 256 == 0:  # Q6_K's super-blocks
            sc = torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8)
            int6.append(kernels.pack_int6(torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=g), sc,
                                          torch.rand(n, k // 256, generator=g) * 0.01))
    if args.huge_pages:
        from tokenleap.models.hugepages import on_huge_pages
        int4, int6, int8, bf16 = ([tuple(on_huge_pages(t) for t in w) for w in ws] for ws in (int4, int6, int8, bf16))
    print(f"{n}x{k} layer, {torch.get_num_threads()} threads, {copies} weight copies"
          f"{' on huge pages' if args.huge_pages else ''}; median ms per call")
    for rows in args.rows:
        x = torch.randn(rows, k, generator=g)
        line = [f"rows {rows}:"]
        for name, fn, weights in (("int4", kernels.int4_linear, int4), ("int6", kernels.int6_linear, int6),
                                  ("int8", kernels.int8_linear, int8), ("bf16", kernels.bf16_linear, bf16)):
            if not weights:
                continue
            times = []
            for _ in range(7):
                t = time.perf_counter()
                for w in weights:
                    fn(x, *w)
                times.append((time.perf_counter() - t) / len(weights))
            line.append(f"{name} {statistics.median(times) * 1e3:.2f}")
        print("  ".join(line))


if __name__ == "__main__":
    main()
