"""Time to first token with and without prefix caching: a chat whose system prompt is a document
(this repository's README), two users asking about it, then a follow-up turn of the first user.

Each configuration is a serving engine (paged cache, scheduler) in this process; requests run one
at a time, the configurations take turns for each request. Prints the time to the first token and
to the last of each request, and whether the outputs of the two configurations are equal.

    python scripts/bench_prefix.py --model qwen2.5-coder-1.5b-instruct --quant int4 --rounds 2
    python scripts/bench_prefix.py ... --draft qwen2.5-coder-0.5b-instruct   # draft-model speculation
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from tokenleap.config import SamplingParams, SpecConfig
from tokenleap.serve.scheduler import Request, Scheduler, SchedulerConfig
from tokenleap.cli.serve import build_engine


def ask(sched: Scheduler, prompt: list[int], max_tokens: int) -> tuple[float, float, list[int]]:
    """(seconds to the first token, to the last, generated token ids) of one request run alone."""
    first: list[float] = []
    ids: list[int] = []

    def sink(out) -> None:
        if not first and out.token_ids:
            first.append(time.perf_counter())
        ids.extend(out.token_ids)

    t0 = time.perf_counter()
    sched.submit([Request(sched.engine.create(prompt, SamplingParams(max_tokens=max_tokens)), sink)])
    sched.run_until_idle()
    return first[0] - t0, time.perf_counter() - t0, ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--doc-chars", type=int, default=2400, help="characters of the README used as system prompt")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--draft", default=None, help="draft model for speculation (default: plain decoding)")
    args = ap.parse_args()
    spec = SpecConfig(method="draft", draft_model=args.draft, draft_quant=args.quant) if args.draft else None
    doc = (Path(__file__).resolve().parents[1] / "README.md").read_text()[: args.doc_chars]
    system = {"role": "system", "content": "Answer questions about this document.\n\n" + doc}
    engines = {name: build_engine(args.model, spec=spec, quant=args.quant, max_model_len=4096, max_num_seqs=4,
                                  prefix_caching=(name == "prefix cache"))
               for name in ("no prefix cache", "prefix cache")}
    scheds = {name: Scheduler(e, SchedulerConfig(max_num_seqs=4, log_interval=0)) for name, e in engines.items()}
    tok = engines["prefix cache"].tokenizer
    times: dict[tuple[str, str], list[float]] = {}  # to the first token
    totals: dict[tuple[str, str], list[float]] = {}  # to the last
    for rnd in range(args.rounds):
        outs: dict[str, dict[str, list[int]]] = {name: {} for name in scheds}
        for sched in scheds.values():  # each round starts from an empty prefix cache
            sched.engine.cache.clear_prefix_cache()
            if sched.engine.proposer is not None and hasattr(sched.engine.proposer, "cache"):
                sched.engine.proposer.cache.clear_prefix_cache()
        hits, queries = engines["prefix cache"].cache.prefix_hits, engines["prefix cache"].cache.prefix_queries
        first_user = [system, {"role": "user", "content": "What are the two commands a newcomer needs?"}]
        steps = [("user 1", first_user),
                 ("user 2", [system, {"role": "user", "content": "How does tokenleap stay lossless?"}])]
        for label, messages in steps:
            for name, sched in scheds.items():
                prompt = tok.encode_chat(messages)
                first, total, ids = ask(sched, prompt, args.max_tokens)
                times.setdefault((label, name), []).append(first)
                totals.setdefault((label, name), []).append(total)
                outs[name][label] = ids
        reply = tok.decode(outs["prefix cache"]["user 1"])
        follow = first_user + [{"role": "assistant", "content": reply},
                               {"role": "user", "content": "And which one runs the tests?"}]
        for name, sched in scheds.items():
            prompt = tok.encode_chat(follow)
            first, total, ids = ask(sched, prompt, args.max_tokens)
            times.setdefault(("user 1, turn 2", name), []).append(first)
            totals.setdefault(("user 1, turn 2", name), []).append(total)
            outs[name]["user 1, turn 2"] = ids
        print(f"round {rnd}: prompt tokens {len(tok.encode_chat(first_user))} / {len(tok.encode_chat(follow))} "
              f"(turn 2); outputs equal: {outs['prefix cache'] == outs['no prefix cache']}", flush=True)
    print("\n| request | first token, no prefix cache (s) | with prefix cache (s) | whole request, no prefix cache (s) "
          "| with prefix cache (s) |\n|---|---|---|---|---|")
    for label in ("user 1", "user 2", "user 1, turn 2"):
        a, b = (statistics.median(times[(label, n)]) for n in ("no prefix cache", "prefix cache"))
        c, d = (statistics.median(totals[(label, n)]) for n in ("no prefix cache", "prefix cache"))
        print(f"| {label} | {a:.2f} | {b:.2f} | {c:.2f} | {d:.2f} |")
    cache = engines["prefix cache"].cache
    print(f"\nlast round: {cache.prefix_hits - hits} of {cache.prefix_queries - queries} "
          "looked-up prompt tokens reused")


if __name__ == "__main__":
    main()
