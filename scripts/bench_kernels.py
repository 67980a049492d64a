"""Microbenchmark of tokenleap's weight-product kernels: int4 (W4A8), int6 (W6A8, Q6_K), int8 and bf16, one layer shape,
1..8 rows, weights streamed from memory (a rotation of copies larger than the L3 cache); bf16 on AMX
tiles too where the CPU has them, and int4 / int6 on AMX-INT8 tiles (columns int4-amx, int6-amx) beside the AVX2 kernels, and int4 / int6 on
the AVX-512 VNNI tiles (int4-vnni, int6-vnni) where the CPU has them (an AMX CPU too: there the
int4 / int6 columns are the AVX2 tiles its calls of fewer rows take). The AVX2 columns read the
blocked layout an AVX2 machine packs, the VNNI and AMX ones the paired layout (``pack_int4``); with
``--vnni-tiles``, int6 on the blocked layout's VNNI one-block tiles at every row count (int6-1blk)
and two-block tiles at every row count (int6-2blk) too.

    python scripts/bench_kernels.py [--n 1536 --k 8960]
    python scripts/bench_kernels.py --n 151936 --k 1536 --rows 1 3 4 --vnni-tiles --huge-pages   # a Qwen output head
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenleap import kernels


def _with_amx_int8_rows(rows: int, fn, vnni: bool = False):
    def product(x, *w):
        kernels.set_amx_int8_rows(rows)
        kernels.set_vnni(vnni)
        return fn(x, *w)
    return product


def _with_vnni(on: bool, fn, pair_rows: int = 0):
    def product(x, *w):
        kernels.set_vnni(on)
        if on:
            kernels.set_vnni_pair_rows(pair_rows)
        return fn(x, *w)
    return product


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1536, help="output features")
    ap.add_argument("--k", type=int, default=8960, help="input features")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8])
    ap.add_argument("--vnni-tiles", action="store_true",
                    help="int6 on the blocked layout's VNNI one-block and two-block tiles at every row count too")
    ap.add_argument("--huge-pages", action="store_true", help="weights on huge pages, as a loaded model keeps them")
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit(f"kernels unavailable: {kernels.unavailable_reason()}")
    n, k = args.n, args.k
    g = torch.Generator().manual_seed(0)
    kinds: dict[str, tuple[object, tuple[torch.Tensor, ...]]] = {}
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // 32, generator=g) * 0.02
    int4 = kernels.pack_int4(q, scale, -8 * scale)  # this CPU's layout
    int4_blocked = kernels.pack_int4(q, scale, -8 * scale, paired=False)  # an AVX2 machine's
    amx_int8 = "amx_int8" in kernels.cpu_flags() and kernels.amx_available()
    vnni = not amx_int8 and kernels.vnni_supported()
    if amx_int8:  # the AVX2 kernel, the VNNI and the AMX-INT8 ones (bitwise the same results) side by side
        kinds["int4"] = (_with_amx_int8_rows(0, kernels.int4_linear), int4_blocked)
        if kernels.vnni_supported():
            kinds["int4-vnni"] = (_with_amx_int8_rows(0, kernels.int4_linear, vnni=True), int4)
        kinds["int4-amx"] = (_with_amx_int8_rows(1, kernels.int4_linear), int4)
    elif vnni:  # the AVX2 tile and the AVX-512 VNNI one (bitwise the same results)
        kinds["int4"] = (_with_vnni(False, kernels.int4_linear), int4_blocked)
        kinds["int4-vnni"] = (_with_vnni(True, kernels.int4_linear), int4)
    else:
        kinds["int4"] = (kernels.int4_linear, int4)
    if k % 256 == 0:  # Q6_K's super-blocks
        sc = torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8)
        q6, d6 = torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=g), torch.rand(n, k // 256, generator=g) * 0.01
        int6 = kernels.pack_int6(q6, sc, d6)  # this CPU's layout
        int6_blocked = kernels.pack_int6(q6, sc, d6, paired=False)
        kinds["int6"] = (_with_amx_int8_rows(0, kernels.int6_linear) if amx_int8 else
                         _with_vnni(False, kernels.int6_linear) if vnni else kernels.int6_linear, int6_blocked)
        if amx_int8:
            if kernels.vnni_supported():
                kinds["int6-vnni"] = (_with_amx_int8_rows(0, kernels.int6_linear, vnni=True), int6)
            kinds["int6-amx"] = (_with_amx_int8_rows(1, kernels.int6_linear), int6)
        elif vnni:
            kinds["int6-vnni"] = (_with_vnni(True, kernels.int6_linear), int6)
            if args.vnni_tiles:
                kinds["int6-1blk"] = (_with_vnni(True, kernels.int6_linear, 1 << 20), int6_blocked)
                kinds["int6-2blk"] = (_with_vnni(True, kernels.int6_linear, 1), int6_blocked)
    kinds["int8"] = (kernels.int8_linear, (kernels.pack_int8(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)),
                                           torch.rand(n, generator=g)))
    w16 = torch.randn(n, k, generator=g).to(torch.bfloat16)
    if k % 16 == 0:
        kinds["bf16"] = (kernels.bf16_linear, (kernels.pack_bf16(w16),))
    if k % 32 == 0 and n % 16 == 0 and kernels.amx_available():  # bf16 on AMX tiles
        kinds["bf16-amx"] = (lambda x, p: torch.ops.tokenleap.bf16_amx_linear(x, p), (kernels.pack_bf16_amx(w16),))
    # copies of each kind's weights, together larger than the biggest L3 caches (320 MB on some
    # Xeons): every call reads its weights from memory
    weights: dict[str, list[tuple[torch.Tensor, ...]]] = {}
    for name, (_, w) in kinds.items():
        nbytes = sum(t.numel() * t.element_size() for t in w)
        copies = max(2, -(-640_000_000 // nbytes))
        weights[name] = [tuple(t.clone() for t in w) for _ in range(copies)]
    if args.huge_pages:
        from tokenleap.models.hugepages import on_huge_pages
        weights = {name: [tuple(on_huge_pages(t) for t in w) for w in ws] for name, ws in weights.items()}
    print(f"{n}x{k} layer, {torch.get_num_threads()} threads, > 640 MB of weight copies a kind"
          f"{' on huge pages' if args.huge_pages else ''}; median ms per call")
    for rows in args.rows:
        x = torch.randn(rows, k, generator=g)
        line = [f"rows {rows}:"]
        for name, (fn, _) in kinds.items():
            times = []
            for _ in range(7):
                t = time.perf_counter()
                for w in weights[name]:
                    fn(x, *w)
                times.append((time.perf_counter() - t) / len(weights[name]))
            line.append(f"{name} {statistics.median(times) * 1e3:.2f}")
        print("  ".join(line))


if __name__ == "__main__":
    main()
