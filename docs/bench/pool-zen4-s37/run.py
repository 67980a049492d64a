"""The output pool (``--ngram-pool``) on a real model: one engine without it and one with it, the
same requests through both, alternating which goes first; outputs must be token-identical.

1. fresh traffic: the bench's mix (HumanEval and chat prompts, each asked once) in order -- the
   pool holds only the replies to the earlier, different prompts;
2. regenerations: a request asked again a little changed (greedy), and a chat prompt sampled again
   with another seed (temperature 0.7) -- the pool holds the first reply, which the client does not
   send back (compare Predicted Outputs, where it does).

Prints tok/s per request, and per part the median and total-time ratios (pool / no pool).

    python docs/bench/pool-zen4-s37/run.py --spec ngram
    python docs/bench/pool-zen4-s37/run.py --spec auto
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

from tokenleap.api import LLM
from tokenleap.bench.datasets import load_dataset
from tokenleap.bench.suite import encode_prompts
from tokenleap.config import SamplingParams, SpecConfig
from tokenleap.spec.proposers.base import forget_outputs

def _prediction_tasks() -> list[tuple[str, str]]:
    """The regenerations of the Predicted Outputs run (its script, loaded by path)."""
    path = Path(__file__).parent.parent / "prediction-zen4-s35" / "run.py"
    spec = importlib.util.spec_from_file_location("prediction_run", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TASKS


TASKS = _prediction_tasks()

CHAT_AGAIN = 4  # chat prompts of the mix sampled a second time with another seed


def timed(llm: LLM, ids: list[int], params: SamplingParams) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    out = llm.generate([ids], params)[0]
    return list(out.token_ids), time.perf_counter() - t0


def pair(engines: dict[str, LLM], ids: list[int], params: SamplingParams, flip: bool, label: str,
         rows: list[tuple[str, int, float, float]]) -> None:
    """Both engines on one request (the order flipped with ``flip``); a row (label, tokens, seconds
    without, seconds with)."""
    seconds, outputs = {}, {}
    for name in (("pool", "none") if flip else ("none", "pool")):
        outputs[name], seconds[name] = timed(engines[name], ids, params)
    assert outputs["pool"] == outputs["none"], f"{label}: the pool changed the output"
    n = len(outputs["pool"])
    rows.append((label, n, seconds["none"], seconds["pool"]))
    print(f"  {label[:58]:58s} {n:4d} tokens  {n / seconds['none']:6.2f} -> {n / seconds['pool']:6.2f} tok/s "
          f"({seconds['none'] / seconds['pool']:.2f}x)", flush=True)


def summary(part: str, rows: list[tuple[str, int, float, float]]) -> None:
    ratios = [a / b for _, _, a, b in rows]
    total = sum(a for *_, a, _ in rows) / sum(b for *_, b in rows)
    print(f"{part}: median {statistics.median(ratios):.2f}x, total {total:.2f}x over {len(rows)} requests; "
          f"outputs identical", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--spec", default="ngram")
    ap.add_argument("--draft-quant", default="int4")
    ap.add_argument("--pool", type=int, default=1 << 15)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--regen-tokens", type=int, default=320)
    args = ap.parse_args()
    spec = SpecConfig(method=args.spec, draft_model="auto" if args.spec == "auto" else None,
                      draft_quant=args.draft_quant)
    engines = {"none": LLM(args.model, quant=args.quant, speculative=spec),
               "pool": LLM(args.model, quant=args.quant, speculative=SpecConfig(**{**spec.__dict__,
                                                                                   "ngram_pool": args.pool}))}
    tok = engines["none"].tokenizer
    for llm in engines.values():  # a warm-up each (first-call costs), its output then forgotten
        llm.generate([tok.encode("def add(a, b):")], SamplingParams(max_tokens=16))
        forget_outputs(llm.engine.proposer)
    prompts = load_dataset("mix", 16).prompts
    ids = encode_prompts(tok, prompts, chat=True)
    print(f"1. fresh traffic ({len(ids)} prompts, {args.max_tokens} tokens, greedy)")
    fresh: list = []
    for i, (p, x) in enumerate(zip(prompts, ids)):
        pair(engines, x, SamplingParams(max_tokens=args.max_tokens), i % 2 == 1, p.id, fresh)
    summary("fresh traffic", fresh)

    print(f"2. regenerations ({args.regen_tokens} tokens)")
    again: list = []
    greedy = SamplingParams(max_tokens=args.regen_tokens)
    for i, (first, second) in enumerate(TASKS):
        for text, label in ((first, None), (second, "changed: " + second[:40])):
            x = tok.encode_chat([{"role": "user", "content": text}])
            if label is None:  # the first ask, into both engines (the pool keeps its reply)
                for llm in engines.values():
                    llm.generate([x], greedy)
            else:
                pair(engines, x, greedy, i % 2 == 1, label, again)
    chats = [(p, x) for p, x in zip(prompts, ids) if p.id.startswith("chat")][:CHAT_AGAIN]
    for i, (p, x) in enumerate(chats):
        pair(engines, x, SamplingParams(max_tokens=args.regen_tokens, temperature=0.7, seed=1000 + i), i % 2 == 0,
             "sampled again: " + p.id, again)
    summary("regenerations", again)


if __name__ == "__main__":
    main()
