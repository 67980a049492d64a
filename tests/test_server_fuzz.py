"""A bounded fuzz of the HTTP API, in-process (httpx's ASGI transport: no socket): a few hundred
generated bodies -- random types, integers past int64, NaN / Infinity / 1e999, missing, extra and
misnested fields -- and not one 5xx; every 4xx carries an OpenAI error object, every streamed 200 ends
without an error event, and the server still answers a plain request identically afterwards."""
from __future__ import annotations

import json
import random

from tokenleap.serve.llamacpp import PATHS as LLAMACPP_PATHS

from serving_helpers import paged_engine
from test_server_hardening import AUTH, call, make_app

ROUNDS = 300
HUGE = [10**30, 2**63, -2**63 - 1, 2**64, 2**63 - 1, -2**63]
RAW = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-999"]  # JSON tokens json.dumps cannot write
# (no response_format / guided_*: the toy tokenizer's two-letter tokens cannot spell a grammar's JSON, and
# an accepted schema then fails mid-generation; structured output has its own tests, test_structured.py)
FIELDS = ["model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n", "stream", "stream_options",
          "ignore_eos", "min_tokens", "stop_token_ids", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "user", "max_tokens", "logprobs", "echo", "prompt", "messages",
          "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "chat_template_kwargs",
          "add_generation_prompt", "continue_final_message", "tokens", "unknown_field",
          # /v1/responses
          "input", "instructions", "max_output_tokens", "text", "metadata", "previous_response_id",
          "parallel_tool_calls", "store", "suffix", "background",
          # /infill (llama.cpp's names)
          "input_prefix", "input_suffix", "input_extra", "n_predict", "repeat_penalty",
          # /completion and /tokenize (llama.cpp's)
          "n_probs", "post_sampling_probs", "return_tokens", "add_special", "add_special_tokens", "content"]


def value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(12 if depth < 2 else 9)
    if kind == 0:
        return rng.choice(HUGE)
    if kind == 1:
        return rng.choice([0, 1, -1, 2, 5, 16, 17, 100, 10**6])
    if kind == 2:
        return rng.choice([0.0, -0.5, 0.5, 1.5, 2.0, 1e30, -1e30, 1e308, 5e-324])
    if kind == 3:
        return rng.choice(["", "a", "hello", "\x00", "\ud7ff\u00b2", "x" * 300, "[", "{\"a\": 1}", "-1"])
    if kind == 4:
        return rng.choice([True, False, None])
    if kind == 5:
        return rng.randrange(0, 96)
    if kind == 6:
        return "RAW:" + rng.choice(RAW)
    if kind == 7:
        return [rng.randrange(0, 100) for _ in range(rng.randrange(0, 4))]
    if kind == 8:
        return {"type": rng.choice(["text", "json_object", "json_schema", "x"])}
    if kind == 9:
        return [value(rng, depth + 1) for _ in range(rng.randrange(0, 3))]
    if kind == 10:
        return {rng.choice(FIELDS + ["role", "content", "9" * 25, "\u00b3"]): value(rng, depth + 1)
                for _ in range(rng.randrange(0, 3))}
    return [{"role": rng.choice(["user", "assistant", "tool", "system", "x"]), "content": value(rng, depth + 1)}]


def encode(body) -> bytes:
    """JSON text with the RAW: markers written as bare tokens (NaN, 1e999, ...)."""
    text = json.dumps(body)
    for raw in RAW:
        text = text.replace(json.dumps("RAW:" + raw), raw)
    return text.encode()


def bodies(seed: int = 0):
    rng = random.Random(seed)
    for i in range(ROUNDS):
        path = rng.choice(["/v1/completions", "/v1/completions", "/v1/chat/completions", "/v1/chat/completions",
                           "/v1/responses", "/v1/responses", "/tokenize", "/detokenize", "/infill",
                           "/completion", "/apply-template"])
        if path == "/v1/completions":
            body = {"prompt": "fuzz me", "max_tokens": 3}
        elif path == "/v1/chat/completions":
            body = {"messages": [{"role": "user", "content": "fuzz"}], "max_tokens": 3}
        elif path == "/v1/responses":
            body = {"input": "fuzz", "max_output_tokens": 3}
        elif path == "/tokenize":
            body = {"prompt": "fuzz"}
        elif path == "/infill":  # (the toy vocabulary has no FIM tokens: a 400 once the body is valid)
            body = {"input_prefix": "fu", "input_suffix": "zz", "n_predict": 3}
        elif path == "/completion":  # llama.cpp's
            body = {"prompt": "fuzz me", "n_predict": 3}
        elif path == "/apply-template":
            body = {"messages": [{"role": "user", "content": "fuzz"}]}
        else:
            body = {"tokens": [3, 4]}
        for _ in range(rng.randrange(1, 4)):
            action = rng.randrange(10)
            if action == 0 and body:
                body.pop(rng.choice(list(body)))  # missing field
            elif action == 1:
                body = rng.choice([[], "x", 3, None, [body]])  # not an object
                break
            else:
                body[rng.choice(FIELDS)] = value(rng)
        for budget in ("max_tokens", "max_output_tokens", "n_predict"):
            if isinstance(body, dict) and isinstance(body.get(budget), int) and body[budget] > 20:
                body[budget] = rng.choice([body[budget], 8])  # valid bodies stay quick to serve
        yield path, encode(body)


def test_fuzzed_bodies_never_get_5xx():
    cases = list(bodies())
    app = make_app(paged_engine("ngram", blocks=64))
    final = ("POST", "/v1/completions", {"headers": AUTH, "json": {"prompt": "after", "max_tokens": 4,
                                                                    "temperature": 0}})
    responses = call(app, [("POST", path, {"headers": {**AUTH, "Content-Type": "application/json"},
                                           "content": body}) for path, body in cases] + [final] * 2)
    statuses = {}
    for (path, body), r in zip(cases, responses):
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, body, r.status_code, r.text[:300])
        if r.status_code >= 400:
            err = r.json()["error"]
            if path in LLAMACPP_PATHS:  # (llama.cpp's form: code the HTTP status)
                assert set(err) == {"message", "type", "code"} and err["code"] == r.status_code, (body, r.text)
            else:
                assert set(err) == {"message", "type", "param", "code"}, (body, r.text)
            assert err["message"], (body, r.text)
        elif r.headers["content-type"].startswith("text/event-stream"):
            end = ("event: response.completed", "event: response.incomplete") if path == "/v1/responses" else (
                "data: [DONE]",)
            last = r.text.rstrip().rsplit("\n\n", 1)[-1]
            assert last.startswith(end) or last.endswith(end), (body, r.text[-300:])
            assert "server_error" not in r.text, (body, r.text[-300:])
    assert statuses.get(200, 0) > 10 and statuses.get(400, 0) > 100, statuses  # both paths exercised
    assert responses[-1].status_code == 200 and responses[-1].json() == {**responses[-2].json(),
                                                                         "id": responses[-1].json()["id"],
                                                                         "created": responses[-1].json()["created"]}
    sched = app.state.server.scheduler
    assert sched.idle and sched.cache.num_used_blocks == 0
