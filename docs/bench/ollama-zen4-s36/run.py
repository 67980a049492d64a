"""The same chat prompts through Ollama's /api/chat (the official ``ollama`` client) and through
/v1/chat/completions (the ``openai`` client) of one running ``tokenleap serve``, greedy, each prompt
by both routes in turn (which goes first alternates):
are the replies the same, and at what speed? Ollama's repeat penalty is turned off (repeat_last_n 0)
so both routes sample from the same distribution, and the server runs without prefix caching so the
second route of a prompt does not find the first one's prompt computed.

    tokenleap serve --model qwen2.5-coder-1.5b-instruct --quant int4 \
        --draft-model qwen2.5-coder-0.5b-instruct --draft-quant int4 --no-prefix-caching --port 8011 &
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


def via_ollama(messages):
    t = time.perf_counter()
    r = ol.chat(model=model, messages=messages, options={"temperature": 0, "num_predict": 128, "repeat_last_n": 0})
    return r.message.content, r.eval_count, time.perf_counter() - t


def via_openai(messages):
    t = time.perf_counter()
    r = oa.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=128)
    return r.choices[0].message.content, r.usage.completion_tokens, time.perf_counter() - t


for i, p in enumerate(load_dataset("mix", limit=8).prompts):
    messages = [{"role": "user", "content": p.user_message}]
    # which route goes first alternates: a run teaches --spec auto's priors something the next one uses
    first, second = (via_ollama, via_openai) if i % 2 == 0 else (via_openai, via_ollama)
    got = {f.__name__: f(messages) for f in (first, second)}
    (a_text, a_n, a_s), (b_text, b_n, b_s) = got["via_ollama"], got["via_openai"]
    rows.append({"id": p.id, "tokens": a_n, "same": a_text == b_text, "ollama_first": i % 2 == 0,
                 "ollama_tok_s": a_n / a_s, "openai_tok_s": b_n / b_s})
summary = {"model": model, "prompts": len(rows), "all_same": all(r["same"] for r in rows),
           "median_ollama_tok_s": statistics.median(r["ollama_tok_s"] for r in rows),
           "median_openai_tok_s": statistics.median(r["openai_tok_s"] for r in rows)}
print(json.dumps({"summary": summary, "rows": rows}, indent=1))
