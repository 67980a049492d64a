"""Every speculative method's outputs against plain decoding, over varied prompts and request parameters.

`tokenleap verify` certifies one method on one pair in depth (greedy, seeded and unseeded sampling,
statistical tests). This sweep is broad instead: 20 prompts (chat and raw, code and prose, four
languages, emoji) each with one of ten parameter sets (max_tokens 1 and 3, stop strings with and
without the stop in the output, presence / frequency / repetition penalties and llama.cpp's window,
min_tokens, logit_bias, a JSON schema), greedy and seeded (temperature 0.9, top-p 0.95, top-k 50):
40 requests a method, each run alone and all together through the scheduler (`LLM.generate` of
them all, 16 decoded at once). Every output must be token-identical to plain decoding's alone.

    python scripts/lossless_sweep.py --methods draft,cascade,ngram,lookahead,layerskip,auto,cross-tokenizer
    python scripts/lossless_sweep.py --methods eagle --draft-head PATH   # a head train-head made

Prints one line a method and mode (alone / batched) with the share of identical outputs and, where
one differs, where; exits 1 if any differs or fails.
"""
from __future__ import annotations

import argparse
import sys
import time

from tokenleap.api import LLM
from tokenleap.config import SamplingParams, SpecConfig, StructuredOutput

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that merges two sorted lists, then explain its complexity.",
    "Traduis en français : 'The quick brown fox jumps over the lazy dog.'",
    "List the first ten prime numbers, separated by commas.",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Rewrite this code to use a list comprehension:\nresult = []\nfor x in range(10):\n    if x % 2 == 0:\n"
    "        result.append(x * x)\n",
    "What is 17 * 23? Show your work.",
    "Write a haiku about a compiler error. 🐛",
    "Give me a JSON object describing a book with title, author and year.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "repeat after me: abc abc abc abc abc abc abc abc",
    "日本の首都はどこですか？一文で答えてください。",
    "Fix the bug:\n```js\nfunction sum(a) { let s = 0; for (let i = 0; i <= a.length; i++) s += a[i]; return s; }\n```",
    "Write a SQL query that returns the five customers with the highest total order value.",
    "Describe the difference between TCP and UDP as a table in markdown.",
    "Continue the story: The lighthouse keeper found a letter that was addressed to himself, dated fifty "
    "years in the future.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "Name three uses of the Rust `?` operator, with a short example each.",
    "¿Cuál es la diferencia entre 'ser' y 'estar'? Da ejemplos.",
    "Convert this YAML to JSON:\nname: demo\nversion: 3\ntags:\n  - a\n  - b\n",
]
PARAMS = [  # cycled over the prompts
    ("max64", dict(max_tokens=64)),
    ("max1", dict(max_tokens=1)),
    ("max3", dict(max_tokens=3)),
    ("stop-blank-line", dict(max_tokens=64, stop=("\n\n",))),
    ("penalties", dict(max_tokens=48, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)),
    ("min-tokens", dict(max_tokens=40, min_tokens=20)),
    ("logit-bias", dict(max_tokens=40, logit_bias=((13, -5.0), (11, 3.0)))),
    ("json-schema", dict(max_tokens=48, structured=StructuredOutput(
        json={"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}))),
    ("stop-kept", dict(max_tokens=64, stop=(" the ",), include_stop_str_in_output=True)),
    ("repeat-window", dict(max_tokens=48, repetition_penalty=1.3, repetition_last_n=16)),
]
SAMPLED = dict(temperature=0.9, top_p=0.95, top_k=50)


def methods(draft: str, other_draft: str, quant: str, head: str | None) -> dict[str, dict]:
    d = dict(draft_model=draft, draft_quant=quant)
    out = {"draft": dict(method="draft", **d), "draft-tree": dict(method="draft", tree="on", **d),
           "cascade": dict(method="draft", draft_spec="ngram", **d), "ngram": dict(method="ngram"),
           "ngram-tree": dict(method="ngram", tree="on"), "lookahead": dict(method="lookahead"),
           "layerskip": dict(method="layerskip"), "auto": dict(method="auto", **d),
           "cross-tokenizer": dict(method="draft", draft_model=other_draft, draft_quant=quant)}
    if head:
        out["eagle"] = dict(method="eagle", draft_head=head)
    return out


def requests(llm: LLM) -> list[tuple[str, list[int], SamplingParams]]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        name, kw = PARAMS[i % len(PARAMS)]
        ids = llm.encode(prompt, chat=i % 3 != 1)  # every third prompt raw, the rest in the chat template
        out.append((f"{i}:{name}", ids, SamplingParams(**kw)))
        out.append((f"{i}:{name}+sampled", ids, SamplingParams(**kw, **SAMPLED, seed=1000 + i)))
    return out


def run(llm: LLM, batched: bool) -> dict[str, list[int]]:
    reqs = requests(llm)
    if batched:  # all at once through the scheduler, each with its own parameters
        outs = llm.generate([ids for _, ids, _ in reqs], [sp for _, _, sp in reqs])
        return {key: o.token_ids for (key, _, _), o in zip(reqs, outs)}
    return {key: llm.generate([ids], sp)[0].token_ids for key, ids, sp in reqs}


def compare(label: str, ref: dict[str, list[int]], got: dict[str, list[int]], seconds: float) -> bool:
    bad = [k for k in ref if ref[k] != got[k]]
    print(f"{label}: {len(ref) - len(bad)} / {len(ref)} identical ({seconds:.0f} s)", flush=True)
    for k in bad[:5]:
        a, b = ref[k], got[k]
        j = next((x for x in range(min(len(a), len(b))) if a[x] != b[x]), min(len(a), len(b)))
        print(f"    {k}: first difference at token {j} of {len(a)} / {len(b)}: {a[j:j + 4]} vs {b[j:j + 4]}")
    return not bad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--other-draft", default="smollm2-135m-instruct", help="a draft of another tokenizer")
    p.add_argument("--quant", default="int4", help="the target's and the drafts' quantization")
    p.add_argument("--draft-head", help="a trained draft head (adds the eagle method)")
    p.add_argument("--methods", default="draft,cascade,ngram,lookahead,layerskip,auto,cross-tokenizer")
    args = p.parse_args()
    table = methods(args.draft_model, args.other_draft, args.quant, args.draft_head)
    chosen = args.methods.split(",")
    unknown = [m for m in chosen if m not in table]
    if unknown:
        sys.exit(f"unknown methods {unknown}; choose among {', '.join(table)}")
    llm = LLM(args.model, quant=args.quant)
    t = time.perf_counter()
    ref = run(llm, batched=False)
    print(f"plain alone: {len(ref)} requests ({time.perf_counter() - t:.0f} s)", flush=True)
    t = time.perf_counter()
    ok = compare("plain batched", ref, run(llm, batched=True), time.perf_counter() - t)
    del llm
    for name in chosen:
        try:
            llm = LLM(args.model, quant=args.quant, speculative=SpecConfig(**table[name]))
            for batched in (False, True):
                t = time.perf_counter()
                got = run(llm, batched)
                ok &= compare(f"{name} {'batched' if batched else 'alone'}", ref, got, time.perf_counter() - t)
        except Exception as e:  # report it and go on to the next method
            print(f"{name}: FAILED: {type(e).__name__}: {e}", flush=True)
            ok = False
        llm = None
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
