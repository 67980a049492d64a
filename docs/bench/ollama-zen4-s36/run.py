"""The same chat prompts through Ollama's /api/chat (the official ``ollama`` client) and through
/v1/chat/completions (the ``openai`` client) of one running ``tokenleap serve``, alternating, greedy:
are the replies the same, and at what speed? Ollama's repeat penalty is turned off (repeat_last_n 0)
so both routes sample from the same distribution.

    tokenleap serve --model qwen2.5-coder-1.5b-instruct --quant int4 \
        --draft-model qwen2.5-coder-0.5b-instruct --draft-quant int4 --port 8011 &
    python docs/bench/ollama-zen4-s36/run.py http://127.0.0.1:8011 > docs/bench/ollama-zen4-s36/results.json
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import ollama
import openai

from tokenleap.bench.datasets import load_dataset

url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8011"
model = openai.OpenAI(base_url=url + "/v1", api_key="none").models.list().data[0].id
ol, oa = ollama.Client(host=url, timeout=600), openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600)
rows = []
for p in load_dataset("mix", limit=8).prompts:
    messages = [{"role": "user", "content": p.prompt}]
    t = time.perf_counter()
    a = ol.chat(model=model, messages=messages, options={"temperature": 0, "num_predict": 128, "repeat_last_n": 0})
    ollama_s = time.perf_counter() - t
    t = time.perf_counter()
    b = oa.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=128)
    openai_s = time.perf_counter() - t
    rows.append({"id": p.id, "tokens": a.eval_count, "same": a.message.content == b.choices[0].message.content,
                 "ollama_tok_s": a.eval_count / ollama_s, "openai_tok_s": b.usage.completion_tokens / openai_s})
summary = {"model": model, "prompts": len(rows), "all_same": all(r["same"] for r in rows),
           "median_ollama_tok_s": statistics.median(r["ollama_tok_s"] for r in rows),
           "median_openai_tok_s": statistics.median(r["openai_tok_s"] for r in rows)}
print(json.dumps({"summary": summary, "rows": rows}, indent=1))
