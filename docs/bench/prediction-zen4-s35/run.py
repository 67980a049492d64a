"""Predicted Outputs on a real model, against the same method without a prediction:

- regenerations: a reply regenerated after its request changed a little, the previous reply (not in
  the prompt) as the prediction -- the first request's greedy reply predicts the second's;
- code edits (OpenAI's own use of the feature): a small change to a file given in the prompt, the
  file as the prediction (so prompt lookup alone also finds it).

Each second request runs without and with the prediction, alternating, ``--repeats`` times; the
outputs must be token-identical. Prints tok/s per run, medians and the share of predicted tokens
the reply kept.

    python docs/bench/prediction-zen4-s35/run.py --spec ngram --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import time

from tokenleap.api import LLM
from tokenleap.config import SamplingParams, SpecConfig
from tokenleap.serve.responses import prediction_tokens_kept

TASKS = [
    ("Write a Python function is_prime(n) with a docstring and a short explanation.",
     "Write a Python function is_prime(n) with a docstring and a short explanation. It must also return False "
     "for negative numbers."),
    ("Explain what a Python list comprehension is, with two examples.",
     "Explain what a Python list comprehension is, with two examples. Keep the same structure but mention "
     "generator expressions at the end."),
    ("Write a bash script that counts the lines of every .py file in a directory, with comments.",
     "Write a bash script that counts the lines of every .py file in a directory, with comments. Print a total "
     "at the end too."),
    ("Describe the difference between a process and a thread in a few paragraphs.",
     "Describe the difference between a process and a thread in a few paragraphs, for a beginner."),
]
CODE = [
    '''import json
from pathlib import Path


def load_config(path):
    """Read a JSON config file and fill in defaults."""
    data = json.loads(Path(path).read_text())
    data.setdefault("host", "127.0.0.1")
    data.setdefault("port", 8000)
    data.setdefault("workers", 2)
    return data


def save_config(path, data):
    Path(path).write_text(json.dumps(data, indent=2))


def merge_configs(base, override):
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_configs(out[key], value)
        else:
            out[key] = value
    return out
''',
    '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        if not self.items:
            raise IndexError("peek at an empty stack")
        return self.items[-1]

    def __len__(self):
        return len(self.items)
''',
]
EDITS = ["Rename load_config to read_config everywhere in this file. Reply with the whole file only, no "
         "explanation.\n\n```python\n{code}```",
         "Add a method is_empty(self) that returns whether the stack is empty, after __len__. Reply with the "
         "whole class only, no explanation.\n\n```python\n{code}```"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--spec", default="ngram")
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, quant=args.quant, speculative=SpecConfig(method=args.spec))
    base = SamplingParams(max_tokens=args.max_tokens)
    ratios = []
    jobs = [(second, tuple(llm.generate(first, base, chat=True)[0].token_ids)) for first, second in TASKS]
    jobs += [(edit.format(code=code), tuple(llm.tokenizer.encode("```python\n" + code + "```")))
             for edit, code in zip(EDITS, CODE)]
    for second, prediction in jobs:
        predicted = SamplingParams(max_tokens=args.max_tokens, prediction=prediction)
        runs: dict[str, list[float]] = {"without": [], "with": []}
        outputs = {}
        for _ in range(args.repeats):
            for name, params in (("without", base), ("with", predicted)):
                t0 = time.perf_counter()
                out = llm.generate(second, params, chat=True)[0]
                runs[name].append(len(out.token_ids) / (time.perf_counter() - t0))
                outputs.setdefault(name, out.token_ids)
                assert out.token_ids == outputs[name], "a rerun changed the output"
        assert outputs["with"] == outputs["without"], "the prediction changed the output"
        med = {k: statistics.median(v) for k, v in runs.items()}
        ratios.append(med["with"] / med["without"])
        kept = prediction_tokens_kept(prediction, outputs["with"]) / len(prediction)
        spread = {k: ", ".join(f"{x:.1f}" for x in v) for k, v in runs.items()}
        print(f"{second[:60]!r}: {len(outputs['with'])} tokens, {kept:.0%} of the prediction kept; tok/s "
              f"without {med['without']:.2f} ({spread['without']}), with {med['with']:.2f} ({spread['with']}): "
              f"{ratios[-1]:.2f}x; outputs identical")
    print(f"spec {args.spec}: median ratio {statistics.median(ratios):.2f}x over {len(ratios[:4])} regenerations "
          f"and {len(ratios[4:])} code edits (regenerations {statistics.median(ratios[:4]):.2f}x)")


if __name__ == "__main__":
    main()
