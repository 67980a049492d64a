"""Structured output (JSON schemas) on real models: plain, draft-model and n-gram speculation.

Each prompt asks for facts from a short text as JSON following a schema; every configuration
decodes it greedily with the schema enforced, and plain decoding also without it (what the
constraint costs). Per configuration: median tok/s (prefill included), mean accepted tokens τ,
whether every output parses and follows the schema's required keys, and whether speculative
output equals plain constrained output. Configurations take turns for each prompt.

    python scripts/bench_structured.py --rounds 2 --max-tokens 128
"""
from __future__ import annotations

import argparse
import json
import statistics

from tokenleap import LLM, SamplingParams, SpecConfig
from tokenleap.config import StructuredOutput

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}, "skills": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "city", "skills"]}
PRODUCT = {"type": "object", "properties": {"product": {"type": "string"}, "price": {"type": "number"},
                                            "currency": {"type": "string"}, "in_stock": {"type": "boolean"}},
           "required": ["product", "price", "currency", "in_stock"]}
EVENT = {"type": "object", "properties": {"title": {"type": "string"}, "date": {"type": "string"},
                                          "attendees": {"type": "array", "items": {"type": "string"}}},
         "required": ["title", "date", "attendees"]}
FUNC = {"type": "object", "properties": {"function": {"type": "string"}, "parameters": {
    "type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}, "type": {"type": "string"}},
                               "required": ["name", "type"]}}, "returns": {"type": "string"}},
        "required": ["function", "parameters", "returns"]}
PROMPTS = [
    ("Extract the person as JSON: Maria Lopez, 34, lives in Valencia and works with Python, SQL and Kubernetes.", PERSON),
    ("Extract the person as JSON: Kenji Watanabe is a 51-year-old engineer from Osaka; he knows C++, Rust and CUDA.", PERSON),
    ("Extract the product as JSON: The UltraQuiet 3000 blender costs 89.99 euros and is currently out of stock.", PRODUCT),
    ("Extract the product as JSON: Our TrailMaster hiking boots are available now for $149.50.", PRODUCT),
    ("Extract the event as JSON: The quarterly planning meeting is on 2026-03-14 with Ana, Bruno, Chen and Dara.", EVENT),
    ("Describe this function as JSON:\ndef moving_average(values: list[float], window: int) -> list[float]:\n"
     "    return [sum(values[i:i + window]) / window for i in range(len(values) - window + 1)]", FUNC),
]


def follows(text: str, schema: dict) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return isinstance(obj, dict) and all(k in obj for k in schema["required"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="write every request's figures here (JSON)")
    args = ap.parse_args()
    plain = LLM(args.target, quant=args.quant)
    draft = LLM(args.target, quant=args.quant,
                speculative=SpecConfig(method="draft", draft_model=args.draft, draft_quant=args.quant))
    ngram = LLM(args.target, quant=args.quant, speculative=SpecConfig(method="ngram"))
    configs = [("plain, no schema", plain, False), ("plain", plain, True), ("draft", draft, True), ("ngram", ngram, True)]
    rows = []
    for rnd in range(args.rounds):
        for i, (prompt, schema) in enumerate(PROMPTS):
            order = configs if (rnd + i) % 2 == 0 else configs[::-1]
            for name, llm, constrained in order:
                params = SamplingParams(max_tokens=args.max_tokens,
                                        structured=StructuredOutput(json=schema) if constrained else None)
                out = llm.generate([prompt], params, chat=True)[0]
                stats = out.stats or {}
                rows.append(dict(round=rnd, prompt=i, config=name, tokens=out.num_tokens,
                                 tokens_per_second=out.tokens_per_second, tau=stats.get("mean_accepted_tokens", 1.0),
                                 follows=follows(out.text, schema), token_ids=out.token_ids, text=out.text))
                print(f"round {rnd} prompt {i} {name:16s} {out.tokens_per_second:6.2f} tok/s "
                      f"{out.num_tokens:4d} tokens  {out.text[:60]!r}", flush=True)
    print("\n| configuration | tok/s (median) | vs plain (schema) | τ (median) | valid JSON with the required keys | = plain (schema) |")
    print("|---|---|---|---|---|---|")
    base = statistics.median(r["tokens_per_second"] for r in rows if r["config"] == "plain")
    for name, _, constrained in configs:
        mine = [r for r in rows if r["config"] == name]
        tps = statistics.median(r["tokens_per_second"] for r in mine)
        same = [r["token_ids"] == p["token_ids"] for r in mine for p in rows
                if p["config"] == "plain" and (p["round"], p["prompt"]) == (r["round"], r["prompt"])]
        valid = f"{sum(r['follows'] for r in mine)}/{len(mine)}"
        print(f"| {name} | {tps:.2f} | {tps / base:.2f}× | {statistics.median(r['tau'] for r in mine):.2f} | "
              f"{valid} | {f'{sum(same)}/{len(same)}' if constrained else '-'} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
