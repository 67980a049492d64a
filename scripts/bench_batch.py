"""Offline batching (issue 20): LLM.generate of 16 chat prompts one at a time against one call with
all of them (the continuous-batching scheduler); prints both times, their ratio and whether every
output is token-identical.

    python scripts/bench_batch.py --model smollm2-135m-instruct --quant int4 --rounds 1
"""
from __future__ import annotations

import argparse
import time

from tokenleap import LLM, SamplingParams

TOPICS = ["hash tables", "binary search", "recursion", "TCP handshakes", "garbage collection", "unit tests",
          "git rebase", "HTTP caching", "SQL joins", "closures", "B-trees", "mutexes", "UTF-8", "floating point",
          "DNS", "regular expressions"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--quant", default="none")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    llm = LLM(args.model, max_model_len=1024, quant=args.quant)
    prompts = [llm.encode(f"Explain {t} in two sentences.", chat=True) for t in TOPICS]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params)  # warm-up, not timed
    for rnd in range(args.rounds):
        t0 = time.perf_counter()
        alone = [llm.generate([q], params)[0] for q in prompts]
        t_alone = time.perf_counter() - t0
        t0 = time.perf_counter()
        batch = llm.generate(prompts, params)
        t_batch = time.perf_counter() - t0
        same = all(a.token_ids == b.token_ids for a, b in zip(alone, batch))
        print(f"round {rnd}: one at a time {t_alone:.1f} s, batched {t_batch:.1f} s, "
              f"ratio {t_alone / t_batch:.2f}x, outputs equal: {same}", flush=True)


if __name__ == "__main__":
    main()
