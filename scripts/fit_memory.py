"""Peak memory and time of ``certify.fit_of`` (the certificate's fit test) on a certificate's shape: 300
samples of 2 tokens, a 151,936-token vocabulary, 60 distinct first tokens, random rows.

Usage: PYTHONPATH=CHECKOUT/src python scripts/fit_memory.py   (one process per checkout compared)
"""
from __future__ import annotations

import resource
import time

import torch

from tokenleap.spec.certify import fit_of

VOCAB = 151936


def main() -> None:
    g = torch.Generator().manual_seed(0)
    firsts = torch.randint(0, VOCAB, (60,), generator=g).tolist()
    probs = {(): torch.softmax(torch.randn(VOCAB, generator=g) * 4, -1)}
    for f in firsts:
        probs[(f,)] = torch.softmax(torch.randn(VOCAB, generator=g) * 4, -1)
    counts: dict[tuple[int, ...], int] = {}
    for i in range(300):
        key = (firsts[i % 60], int(torch.randint(0, VOCAB, (1,), generator=g)))
        counts[key] = counts.get(key, 0) + 1
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    fit = fit_of(counts, probs, torch.Generator().manual_seed(1))
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux
    print(f"fit: KS {fit.ks.statistic:.6g}, score z {fit.score.z:.6g}; peak resident {peak / 2**20:.2f} GB "
          f"({before / 2**20:.2f} GB before the fit), {seconds:.1f} s")


if __name__ == "__main__":
    main()
