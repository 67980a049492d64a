"""Spec-Bench-style benchmark: tokenleap's methods and peers side by side, with reports and plots.

    from tokenleap.bench import bench
    results = bench("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct",
                    dataset="humaneval", methods="plain,draft:k=auto,ngram,hf-plain", limit=20,
                    max_new_tokens=128, quant="int8", out="bench-out")

Lower level, for methods built in process (tests, custom proposers): ``parse_methods``,
``ModelPool`` + ``build_methods``, ``encode_prompts`` and ``run_bench(BenchSettings(...), ...)``.
Names are imported on first use, so ``tokenleap --help`` does not pay for torch here.
"""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "BenchError": "common", "BenchMethod": "common", "Generation": "common", "MethodInfo": "common",
    "FAMILIES": "common", "DATASETS": "datasets", "BenchPrompt": "datasets", "Dataset": "datasets",
    "load_dataset": "datasets", "read_jsonl": "datasets", "MethodSpec": "methods", "ModelOptions": "methods",
    "ModelPool": "methods", "TokenleapMethod": "methods", "build_methods": "methods",
    "parse_methods": "methods", "BenchSettings": "runner", "run_bench": "runner", "bench": "suite",
    "encode_prompts": "suite",
}
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'tokenleap.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
