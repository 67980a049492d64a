"""Sampling with and without a seed, plain and with draft-model speculation, on real models.

A seeded request samples drafter-invariantly (noise keyed by position: its speculative output must
equal its plain output), an unseeded one by rejection sampling. Per configuration: median tok/s
(prefill included) and the draft acceptance rate; and whether every seeded speculative output
equals the plain seeded output of the same prompt. Configurations take turns for each prompt.

    python scripts/bench_seeded.py --prompts 3 --rounds 2 --max-tokens 128 --temperature 0.7 --top-p 0.95
"""
from __future__ import annotations

import argparse
import json
import statistics

from tokenleap import LLM, SamplingParams, SpecConfig
from tokenleap.bench.datasets import load_dataset


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--out", default=None, help="write every request's figures here (JSON)")
    args = ap.parse_args()
    prompts = [p.user_message for p in load_dataset(args.dataset, limit=args.prompts).prompts]
    spec = LLM(args.target, quant=args.quant,
               speculative=SpecConfig(method="draft", draft_model=args.draft, draft_quant=args.quant))
    plain = LLM(args.target, quant=args.quant)
    rows = []
    for rnd in range(args.rounds):
        for i, prompt in enumerate(prompts):
            for name, llm, seed in (("spec seeded", spec, 100 * rnd + i), ("spec unseeded", spec, None),
                                    ("plain seeded", plain, 100 * rnd + i), ("plain unseeded", plain, None)):
                params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                        top_p=args.top_p, seed=seed, ignore_eos=True)
                out = llm.generate([prompt], params, chat=True)[0]
                rows.append(dict(round=rnd, prompt=i, config=name, tokens_per_second=out.tokens_per_second,
                                 acceptance=(out.stats or {}).get("draft_acceptance_rate"), token_ids=out.token_ids))
                print(f"round {rnd} prompt {i} {name:15s} {out.tokens_per_second:6.2f} tok/s", flush=True)
    print("\n| configuration | tok/s (median) | draft acceptance (median) |\n|---|---|---|")
    for name in ("plain unseeded", "plain seeded", "spec unseeded", "spec seeded"):
        mine = [r for r in rows if r["config"] == name]
        acc = [r["acceptance"] for r in mine if r["acceptance"] is not None]
        acc_text = f"{statistics.median(acc):.3f}" if name.startswith("spec") else "-"
        print(f"| {name} | {statistics.median(r['tokens_per_second'] for r in mine):.2f} | {acc_text} |")
    same = [a["token_ids"] == b["token_ids"] for a in rows if a["config"] == "spec seeded"
            for b in rows if b["config"] == "plain seeded" and (b["round"], b["prompt"]) == (a["round"], a["prompt"])]
    print(f"\nseeded speculative output == plain seeded output: {sum(same)}/{len(same)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
