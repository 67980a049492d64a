"""Where a serving run's time goes: the scheduler driven in-process (no HTTP) for N requests arriving
together, each configuration in turn, with every phase timed -- target prefill chunks, the draft's
catch-up inside drafting, whole decode steps by batch size and draft length.

    python scripts/profile_serve.py --clients 1 2 4 --variants plain draft
    python scripts/profile_serve.py --clients 2 --variants plain draft:1 draft:2 draft:3 plain

A variant is ``plain``, ``draft`` (adaptive k) or ``draft:K`` (fixed k). Each engine serves one
unmeasured request first. The prompts are bench_serve.py's, sent as chat; greedy.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

from tokenleap.config import SamplingParams, SpecConfig
from tokenleap.serve.scheduler import Request, Scheduler, SchedulerConfig
from tokenleap.cli.serve import build_engine

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve import PROMPTS  # noqa: E402


def build(args, variant: str):
    spec = None
    if variant != "plain":
        k = int(variant.split(":")[1]) if ":" in variant else "auto"
        spec = SpecConfig(method="draft", draft_model=args.draft_model, draft_quant=args.draft_quant, num_tokens=k)
    return build_engine(args.model, spec=spec, dtype=args.dtype, quant=args.quant, max_model_len=1024)


def timed(log: list, obj, name: str, key) -> None:
    """Wrap ``obj.name`` so each call appends (phase key, seconds) to ``log``."""
    fn = getattr(obj, name)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        log.append((key(*a, **kw), time.perf_counter() - t))
        return out
    setattr(obj, name, wrapper)


def run(eng, clients: int, max_tokens: int) -> tuple[float, int, list]:
    log: list = []
    timed(log, eng, "prefill_step", lambda seq, **kw: "target prefill chunk")
    timed(log, eng, "step", lambda seqs, k=None: f"step: batch {len(seqs)}, k {k}")
    if eng.proposer is not None:
        timed(log, eng.proposer, "propose_many", lambda reqs: f"drafting (catch-up included): batch {len(reqs)}, "
                                                               f"k {max(r.k for r in reqs)}")
    sched = Scheduler(eng, SchedulerConfig(log_interval=0))
    reqs = []
    for i in range(clients):
        ids = eng.tokenizer.encode_chat([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        reqs.append(Request(eng.create(ids, SamplingParams(max_tokens=max_tokens)), lambda out: None))
    t0 = time.perf_counter()
    sched.submit(reqs)
    sched.run_until_idle()
    wall = time.perf_counter() - t0
    for obj, name in ((eng, "prefill_step"), (eng, "step"), (eng.proposer, "propose_many")):
        if obj is not None and name in vars(obj):
            delattr(obj, name)
    return wall, sum(r.seq.num_generated for r in reqs), log


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--dtype", default="auto", help="e.g. bfloat16 (with --quant none)")
    ap.add_argument("--draft-quant", default="int4")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--variants", nargs="+", default=["plain", "draft"])
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    for variant in args.variants:
        eng = build(args, variant)
        run(eng, 1, 8)  # warm-up
        for clients in args.clients:
            wall, tokens, log = run(eng, clients, args.max_tokens)
            print(f"== {variant}, {clients} clients: {tokens} tokens in {wall:.2f} s = {tokens / wall:.2f} tok/s")
            phases: dict[str, list[float]] = collections.defaultdict(list)
            for key, seconds in log:
                phases[key].append(seconds)
            for key in sorted(phases):
                s = phases[key]
                print(f"   {key:<48} n={len(s):<3} total {sum(s):6.2f} s  mean {1e3 * sum(s) / len(s):7.1f} ms")
            if eng.proposer is not None:
                c = eng.controller
                print("   controller: forward ms by rows", {r: round(v * 1e3, 1) for r, v in sorted(c.forward_cost.items())},
                      "draft ms/token by batch", {b: round(v * 1e3, 1) for b, v in sorted(c.draft_cost_at.items())})
            sys.stdout.flush()
        del eng


if __name__ == "__main__":
    main()
