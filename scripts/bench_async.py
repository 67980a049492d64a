#!/usr/bin/env python
"""``LLM.astream`` at several concurrency levels: total output tokens/s of N chat requests served by
an asyncio application, each level's requests open at once (``--concurrency``) against one after
another, plain decoding and speculation side by side in one run (levels take turns, ``--rounds``
times). Every output is checked against ``LLM.generate`` of its prompt alone (greedy). Every level
serves the same prompts again, so the n-gram pool of earlier outputs is off by default (``--ngram-pool``):
with it, later rounds draft whole replies from the first one's.

    python scripts/bench_async.py --model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct \\
        --quant int4 --draft-quant int4 --concurrency 1 2 4 --prompts 8 --max-tokens 96 --rounds 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from tokenleap import LLM, SamplingParams
from tokenleap.bench.datasets import load_dataset


async def _serve(llm: LLM, prompts: list[str], params: SamplingParams, concurrency: int) -> tuple[float, list]:
    """Seconds to serve every prompt, at most ``concurrency`` streams open at once; the outputs' ids."""
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: str) -> list[int]:
        async with gate:
            last = None
            async for chunk in llm.astream(prompt, params, chat=True):
                last = chunk
            return last.output.token_ids
    t0 = time.perf_counter()
    ids = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - t0, list(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--quant", default="none")
    ap.add_argument("--draft-quant", default=None)
    ap.add_argument("--dataset", default="chat")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--ngram-pool", type=int, default=0, help="tokens of earlier outputs drafted from (0: off)")
    args = ap.parse_args()
    prompts = [p.user_message for p in load_dataset(args.dataset, args.prompts).prompts]
    params = SamplingParams(max_tokens=args.max_tokens)
    spec = {"method": "auto", "draft_model": args.draft_model, "draft_quant": args.draft_quant,
            "ngram_pool": args.ngram_pool}
    engines = {"plain": LLM(args.model, quant=args.quant, max_model_len=args.max_model_len),
               "auto": LLM(args.model, quant=args.quant, speculative=spec, max_model_len=args.max_model_len)}
    want = [engines["plain"].generate(p, params, chat=True)[0].token_ids for p in prompts]
    for llm in engines.values():  # (builds each coroutine engine; warms the kernels)
        asyncio.run(_serve(llm, prompts[:1], SamplingParams(max_tokens=8), 1))
    rates: dict[tuple[str, int], list[float]] = {}
    equal = True
    for _ in range(args.rounds):
        for level in args.concurrency:
            for name, llm in engines.items():
                seconds, ids = asyncio.run(_serve(llm, prompts, params, level))
                equal &= ids == want
                rates.setdefault((name, level), []).append(sum(map(len, ids)) / seconds)
    median = {key: statistics.median(values) for key, values in rates.items()}
    rows = [{"concurrency": level, **{name: round(median[(name, level)], 2) for name in engines},
             "auto_over_plain": round(median[("auto", level)] / median[("plain", level)], 3)}
            for level in args.concurrency]
    print(json.dumps({"rows": rows, "outputs_equal_generate": equal, "rates": {f"{n}@{c}": [round(r, 2) for r in v]
                                                                              for (n, c), v in rates.items()}}))


if __name__ == "__main__":
    main()
