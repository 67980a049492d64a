"""Time the verification part of one ``Engine.step``: B sequences, k drafted tokens each, over a
large vocabulary (random, peaked logits ``[B * (k + 1), vocab]``; no model).

Usage: python scripts/bench_verify.py [--vocab 151936] [--k 4] [--batches 1 4 8 16] [--reps 15]

Times, per step: the sequences verified one at a time (each its own argmax / filtering) and, where
``step_verify.share_rows`` exists, the step's way (one argmax over every greedy sequence's rows,
each walking its slice) and, for greedy steps, torch's argmax one sequence at a time (the way
before ``share_rows`` and ``sampling.argmax_rows``); the methods take turns, rep by rep. Run it single-threaded
(``OMP_NUM_THREADS=1``) for figures comparable across machines.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenleap.config import SamplingParams
from tokenleap.spec.proposers.base import Draft
from tokenleap.spec.sampling import request_randomness
from tokenleap.spec.sequence import Sequence

try:
    from tokenleap.spec import step_verify
except ImportError:  # an engine that verifies inside engine.py
    step_verify = None

KINDS = {"greedy": SamplingParams(max_tokens=100),
         "seeded T=0.8 top_p=0.95": SamplingParams(max_tokens=100, temperature=0.8, top_p=0.95, seed=1),
         "unseeded T=0.8": SamplingParams(max_tokens=100, temperature=0.8)}


def peaked_logits(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:  # [rows, vocab]
    """Noise with 30 favoured tokens a row (an LM's peaked distribution, not a flat one)."""
    x = torch.randn(rows, vocab, generator=gen) * 2.0
    top = torch.randint(0, vocab, (rows, 30), generator=gen)
    return x.scatter_(1, top, torch.linspace(16.0, 6.0, 30).expand(rows, 30).contiguous())


def batch(b: int, k: int, vocab: int, params: SamplingParams):
    logits = peaked_logits(b * (k + 1), vocab, torch.Generator().manual_seed(b))
    seqs, drafts = [], []
    for i in range(b):
        s = Sequence(seq_id=i, prompt=[5, 6, 7], params=params, eos_ids=frozenset({2}), detokenizer=None,
                     generator=None if params.greedy else request_randomness(params.seed), tokens=[5, 6, 7, 8])
        rows = logits[i * (k + 1):(i + 1) * (k + 1)]
        drafts.append(Draft(tokens=rows[:k].argmax(-1).tolist()[:2] + [9] * (k - 2), probs=None))
        seqs.append(s)
    return seqs, drafts, logits


def one_at_a_time(seqs, drafts, logits, k):
    for i, (s, d) in enumerate(zip(seqs, drafts)):
        rows = logits[i * (k + 1):(i + 1) * (k + 1)]
        if step_verify is None:
            from tokenleap.spec.engine import Engine
            Engine._verify(s, d, rows)
        else:
            step_verify.verify_chain(s, d, step_verify.TargetRows(rows))


def torch_argmax(seqs, drafts, logits, k):
    """Greedy only: each sequence's rows through ``verify.verify_greedy`` (torch's argmax kernel,
    one call per sequence) -- how greedy steps were verified before ``share_rows``."""
    from tokenleap.spec.verify import verify_greedy
    for i, d in enumerate(drafts):
        verify_greedy(torch.tensor(d.tokens, dtype=torch.long), logits[i * (k + 1):(i + 1) * (k + 1)])


def shared(seqs, drafts, logits, k):
    spans = [(i * (k + 1), k + 1) for i in range(len(seqs))]
    for s, d, rows in zip(seqs, drafts, step_verify.share_rows(seqs, logits, spans)):
        step_verify.verify_chain(s, d, rows)


def median_ms(fns, reps: int, *args) -> list[float]:
    """Each of ``fns``' median milliseconds over ``reps`` calls, the functions taking turns (so a
    load that comes and goes weighs on each alike)."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn(*args)
    for _ in range(reps):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            fn(*args)
            out.append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e3 for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS))
    args = ap.parse_args()
    for name in args.kinds:
        for b in args.batches:
            seqs, drafts, logits = batch(b, args.k, args.vocab, KINDS[name])
            both = step_verify is not None and hasattr(step_verify, "share_rows")
            fns = [one_at_a_time, shared] if both else [one_at_a_time]
            fns += [torch_argmax] if both and KINDS[name].greedy else []
            ms = median_ms(fns, args.reps, seqs, drafts, logits, args.k)
            line = f"{name:24s} B={b:2d}: one at a time {ms[0]:8.2f} ms"
            if both:
                line += f"   shared {ms[1]:8.2f} ms"
            if len(ms) > 2:
                line += f"   (torch argmax, one at a time {ms[2]:8.2f} ms)"
            print(line, flush=True)


if __name__ == "__main__":
    main()
