"""The OpenAI-compatible server, exercised with the official ``openai`` client against a real uvicorn
server on 127.0.0.1 (tiny random model, ToyTokenizer with a chat template)."""
from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tokenleap.config import SamplingParams
from tokenleap.serve.scheduler import SchedulerConfig
from tokenleap.serve.app import ServerConfig, create_app

from serving_helpers import (VOCAB, ChatToyTokenizer, FailingProposer, LiveServer, alone, paged_engine, wait_until,
                             workload)

KEY = "test-key"
NAME = "tiny-qwen2"


def start(kind=None, blocks=64, api_key=None, **sched) -> LiveServer:
    config = ServerConfig(model_name=NAME, model_aliases=("/models/tiny.gguf",), api_key=api_key,
                          scheduler=SchedulerConfig(log_interval=0, **sched))
    return LiveServer(create_app(paged_engine(kind, blocks=blocks), config))


def client(server: LiveServer, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def server():
    with start(api_key=KEY) as s:
        yield s


def expected(prompt_text: str, max_tokens: int, **kw):
    return alone(ChatToyTokenizer(VOCAB).encode(prompt_text), SamplingParams(max_tokens=max_tokens, **kw))


def chat_prompt(content: str) -> str:
    return ChatToyTokenizer(VOCAB).apply_chat_template([{"role": "user", "content": content}])


def test_completion_and_chat(server):
    c = client(server)
    r = c.completions.create(model=NAME, prompt="hello world", max_tokens=12, temperature=0)
    ref = expected("hello world", 12)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (11, ref.num_generated)
    assert r.object == "text_completion" and r.model == NAME
    r = c.chat.completions.create(model="/models/tiny.gguf", messages=[{"role": "user", "content": "hi there"}],
                                  max_completion_tokens=9, temperature=0)
    ref = expected(chat_prompt("hi there"), 9)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == ref.num_generated and r.object == "chat.completion"
    # a client given the server's root (no /v1), as llama.cpp also answers it: chat and models
    root = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    again = root.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi there"}],
                                         max_completion_tokens=9, temperature=0)
    assert again.choices[0].message.content == ref.text and [m.id for m in root.models.list()] == [NAME]


def test_streaming_with_usage(server):
    c = client(server)
    chunks = list(c.completions.create(model=NAME, prompt="stream me", max_tokens=15, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    ref = expected("stream me", 15)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.num_generated
    chunks = list(c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "abc"}],
                                            max_tokens=10, temperature=0, stream=True))
    ref = expected(chat_prompt("abc"), 10)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server):
    c = client(server)
    for make, kw in ((c.completions.create, {"prompt": "stream me"}),
                     (c.chat.completions.create, {"messages": [{"role": "user", "content": "abc"}]})):
        chunks = list(make(model=NAME, max_tokens=12, temperature=0, stream=True,
                           stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw))
        counts = [ch.usage.completion_tokens for ch in chunks]  # every chunk has one (AttributeError if not)
        assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.total_tokens - chunks[-1].usage.prompt_tokens
        assert counts[-1] > counts[0] and len({ch.usage.prompt_tokens for ch in chunks}) == 1
        plain = list(make(model=NAME, max_tokens=12, temperature=0, stream=True,
                          stream_options={"include_usage": True}, **kw))
        assert all(ch.usage is None for ch in plain[:-1]) and plain[-1].usage.completion_tokens == counts[-1]


def test_n_choices_stop_strings_and_seeds(server):
    c = client(server)
    r = c.completions.create(model=NAME, prompt="several", n=3, max_tokens=8, temperature=0.9, seed=7,
                             extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 24
    again = c.completions.create(model=NAME, prompt="several", n=3, max_tokens=8, temperature=0.9, seed=7,
                                 extra_body={"ignore_eos": True})
    assert [ch.text for ch in r.choices] == [ch.text for ch in again.choices]  # seeded: reproducible
    ref = expected("stop test", 20, ignore_eos=True).text
    stop = ref[7:10]
    r = c.completions.create(model=NAME, prompt="stop test", max_tokens=20, temperature=0, stop=[stop, "zzzz"],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref[: ref.index(stop)] and r.choices[0].finish_reason == "stop"
    assert r.choices[0].stop_reason == stop  # vLLM's field: the stop string matched
    chunks = list(c.completions.create(model=NAME, prompt="stop test", max_tokens=20, temperature=0, stream=True,
                                       stop=["zzzz", stop], extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == ref[: ref.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].stop_reason == stop


def test_auth_model_and_value_errors(server):
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").completions.create(model=NAME, prompt="x", max_tokens=2)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    c = client(server)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=NAME, prompt="x", temperature=-1)
    assert "temperature must be in [0, 100]" in e.value.body["message"] and e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=10**6)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:  # of several prompts, the one that does not fit is named
        c.completions.create(model=NAME, prompt=["x", "x " * 5000], max_tokens=2)
    assert e.value.body["message"].startswith("prompt 1 (of 2, counted from 0): this model's maximum context length")
    assert [m.id for m in c.models.list()] == [NAME]
    assert c.models.retrieve(NAME).id == c.models.retrieve("/models/tiny.gguf").id == NAME
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


FUZZ = [
    b"{", b"", b"\xff\xfe\xfa", b'{"prompt": "\xff\xfe"}', b"[]", b"null", b'"prompt"', b'{"prompt": NaN}',
    b'{"prompt": "a", "temperature": NaN}', b'{"prompt": 5}', b'{"prompt": []}', b'{"prompt": [[]]}',
    b'{"prompt": [-1]}', b'{"prompt": [100000]}', b'{"prompt": "a", "max_tokens": "10"}',
    b'{"prompt": "a", "max_tokens": 1000000000}', b'{"prompt": "a", "max_tokens": 0}',
    b'{"prompt": "a", "max_tokens": 2.5}', b'{"prompt": "a", "n": 1000}', b'{"prompt": "a", "n": 0}',
    b'{"prompt": "a", "temperature": -0.5}', b'{"prompt": "a", "top_p": 2}', b'{"prompt": "a", "top_k": -5}',
    b'{"prompt": "a", "min_p": 7}', b'{"prompt": "a", "stop": [""]}', b'{"prompt": "a", "stop": 5}',
    b'{"prompt": "a", "seed": "x"}', b'{"prompt": "a", "stream": "yes"}', b'{"prompt": "a", "logprobs": 21}',
    b'{"prompt": "a", "logprobs": -1}', b'{"prompt": "a", "logprobs": true}', b'{"prompt": "a", "echo": 1}',
    b'{"prompt": "a", "presence_penalty": 3.0}', b'{"prompt": "a", "frequency_penalty": "x"}',
    b'{"prompt": "a", "repetition_penalty": 0}', b'{"prompt": "a", "logit_bias": {"x": 1}}',
    b'{"prompt": "a", "logit_bias": {"5": 500}}', b'{"prompt": "a", "logit_bias": {"100000": 1}}', b'{"prompt": "a", "stream_options": 3}',
    b'{"prompt": "' + b"x" * 200 + b'"}', b'{"prompt": ["a", 3]}', b'{"prompt": "a", "model": 17}',
    b'{"prompt": "a", "seed": 100000000000000000000000}', b"[" * 100000 + b"]" * 100000,
]
CHAT_FUZZ = [
    b'{"messages": []}', b'{"messages": "hi"}', b'{"messages": [{"role": "x", "content": "a"}]}',
    b'{"messages": [{"content": "a"}]}', b'{"messages": [{"role": "user", "content": 5}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
    b'{"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": -1}',
    b'{"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}',
    b'{"messages": [{"role": "user", "content": "a"}], "logprobs": true, "top_logprobs": 50}',
    b'{"messages": [{"role": "user", "content": "a"}], "logprobs": 1}', b"{}",
]
RESPONSES_FUZZ = [
    b"{}", b'{"input": 5}', b'{"input": [5]}', b'{"input": ["a"]}', b'{"input": [{"type": "message"}]}',
    b'{"input": [{"role": "user"}]}', b'{"input": [{"role": "user", "content": [5]}]}',
    b'{"input": [{"type": "function_call", "call_id": 1, "name": "f", "arguments": "{}"}]}',
    b'{"input": [{"type": "function_call_output", "output": "x"}]}', b'{"input": "a", "max_output_tokens": "9"}',
    b'{"input": "a", "max_output_tokens": -3}', b'{"input": "a", "text": {"format": {"type": "xml"}}}',
    b'{"input": "a", "text": 5}', b'{"input": "a", "tools": [{"type": "function"}]}', b'{"input": "a", "tools": 3}',
    b'{"input": "a", "tool_choice": "sometimes"}', b'{"input": "a", "tools": [{"type": "function", "name": "f", "parameters": 5}]}',
    b'{"input": "a", "tools": [{"type": "function", "name": "f", "strict": "yes"}]}', b'{"input": "a", "metadata": {"k": 1}}',
    b'{"input": "a", "instructions": 7}', b'{"input": "a", "temperature": NaN}',
]


def test_malformed_and_hostile_bodies_get_4xx_and_the_server_keeps_serving(server):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for path, bodies in (("/v1/completions", FUZZ), ("/v1/chat/completions", CHAT_FUZZ),
                         ("/v1/responses", RESPONSES_FUZZ)):
        for body in bodies:
            r = httpx.post(server.url + path, content=body, headers=headers)
            assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], body
    r = httpx.get(server.url + "/v1/nothing", headers=headers)
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(server.url + "/v1/completions", headers=headers).status_code == 405
    ok = client(server).completions.create(model=NAME, prompt="still alive", max_tokens=4, temperature=0)
    assert ok.choices[0].text == expected("still alive", 4).text
    assert wait_until(lambda: server.scheduler.idle) and server.scheduler.cache.num_used_blocks == 0


def test_a_request_that_can_never_be_admitted_is_400():
    """(A busy server's 503 is in test_server_hardening's admission test.)"""
    with start(max_num_seqs=1, max_waiting=0) as s:
        with pytest.raises(openai.BadRequestError, match="at most 1 at once"):
            client(s).completions.create(model=NAME, prompt="x", n=2, max_tokens=2)
        assert client(s).completions.create(model=NAME, prompt="x", max_tokens=2).choices


def _sampling(i: int, seeded: bool) -> dict:
    return dict(temperature=0.8, top_p=0.95, seed=500 + i) if seeded else dict(temperature=0)


def _one_request(url: str, i: int, prompt: list[int], max_tokens: int, seeded: bool) -> str:
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    if i % 2:
        stream = c.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, stream=True,
                                      **_sampling(i, seeded))
        return "".join(ch.choices[0].text for ch in stream if ch.choices)
    out = c.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, **_sampling(i, seeded))
    return out.choices[0].text


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("kind", [None, "ngram", "draft"])
def test_concurrent_outputs_equal_alone(kind, seeded):
    """Greedy, and seeded sampling (drafter-invariant): under load, with preemption, each request's
    text is what the same request gets alone from a plain engine."""
    jobs = workload(16, seed=3)
    with start(kind, blocks=10) as s:  # a small pool: preemption is likely under this load
        with ThreadPoolExecutor(16) as pool:
            texts = list(pool.map(lambda a: _one_request(s.url, a[0], *a[1], seeded), enumerate(jobs)))
        assert wait_until(lambda: s.scheduler.idle)
        assert s.scheduler.cache.num_used_blocks == 0
        metrics = httpx.get(s.url + "/metrics").text
    for i, ((prompt, max_tokens), text) in enumerate(zip(jobs, texts)):
        assert text == alone(prompt, SamplingParams(max_tokens=max_tokens, **_sampling(i, seeded))).text, prompt
    assert "tokenleap:generation_tokens_total" in metrics
    if kind is not None:
        assert "tokenleap:spec_decode_num_draft_tokens_total" in metrics


def _read_then_leave(url: str, chunks: int) -> int:
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    stream = c.completions.create(model=NAME, prompt="leave early " * 3, max_tokens=80, temperature=0,
                                  stream=True, extra_body={"ignore_eos": True})
    seen = 0
    for _ in stream:
        seen += 1
        if seen == chunks:
            break
    stream.close()  # the client disconnects mid-stream
    return seen


def test_disconnected_clients_free_their_blocks():
    with start("draft", blocks=64) as s:
        with ThreadPoolExecutor(8) as pool:
            seen = list(pool.map(lambda i: _read_then_leave(s.url, 2 + i % 3), range(8)))
        assert all(n >= 2 for n in seen)
        assert wait_until(lambda: s.scheduler.idle)
        engine = s.scheduler.engine
        assert engine.cache.num_used_blocks == 0 and engine.proposer.cache.num_used_blocks == 0
        assert s.scheduler.stats.finished.get("abort", 0) == 8
        ok = client(s).completions.create(model=NAME, prompt="after", max_tokens=3, temperature=0)
        assert ok.choices[0].text == expected("after", 3).text


def test_a_failing_request_gets_an_error_and_the_others_their_output():
    eng = paged_engine("ngram", k=2)
    eng.proposer = FailingProposer(eng.proposer)
    with LiveServer(create_app(eng, ServerConfig(NAME, scheduler=SchedulerConfig(log_interval=0)))) as s:
        c = client(s)
        bad = chr(66 + 96)  # encodes to token 66: its proposer raises
        with ThreadPoolExecutor(3) as pool:
            good = pool.submit(c.completions.create, model=NAME, prompt="fine one", max_tokens=10, temperature=0)
            failed = pool.submit(c.completions.create, model=NAME, prompt=bad + "xy", max_tokens=10, temperature=0)
            streamed = pool.submit(lambda: list(c.completions.create(model=NAME, prompt=bad + "z", max_tokens=10,
                                                                     temperature=0, stream=True)))
        assert good.result().choices[0].text == expected("fine one", 10).text
        with pytest.raises(openai.InternalServerError, match="boom in propose"):
            failed.result()
        with pytest.raises(openai.APIError, match="boom in propose"):
            streamed.result()
        assert wait_until(lambda: s.scheduler.idle) and eng.cache.num_used_blocks == 0
        assert httpx.get(s.url + "/health").status_code == 200


class GateProposer:
    """An n-gram proposer whose proposals wait for ``gate``: holds the scheduler mid-request."""

    name = "gate"

    def __init__(self, inner) -> None:
        self.inner, self.gate, self.entered = inner, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose_many(self, requests):
        self.entered.set()  # (a request is held in its step from here)
        self.gate.wait(120)
        return self.inner.propose_many(requests)


def test_a_non_streaming_client_that_leaves_is_cancelled():
    # (ignore_eos: a sampled first token may be EOS, and the request would end before any draft)
    eng = paged_engine("ngram", k=2)
    eng.proposer = held = GateProposer(eng.proposer)
    with LiveServer(create_app(eng, ServerConfig(NAME, scheduler=SchedulerConfig(log_interval=0)))) as s:
        body = json.dumps({"prompt": "wait for me", "max_tokens": 60, "ignore_eos": True}).encode()
        host, port = s.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert held.entered.wait(60)  # prefilled and held in its step: the client leaves now
        assert wait_until(lambda: s.scheduler._cancelled, 30)  # noticed while the scheduler is held
        held.gate.set()
        assert wait_until(lambda: s.scheduler.idle)
        assert s.scheduler.stats.finished == {"abort": 1} and eng.cache.num_used_blocks == 0
        # its first token came (the prefill's), so it counts in the time to first token, as vLLM's;
        # the figures of a finished request do not take it
        counts = {name: sum(h.counts) for name, h in s.scheduler.stats.histograms.read().items()}
        assert counts["time_to_first_token_seconds"] == 1 and counts["e2e_request_latency_seconds"] == 0


def test_chat_echo_starts_the_reply_with_the_message_it_continues(server):
    """vLLM's chat echo: the last message's text starts the reply when it has the reply's role -- an
    assistant message the reply continues -- streamed or not; a last user message is not echoed."""
    auth = {"Authorization": f"Bearer {KEY}"}
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ab"}]
    body = {"messages": msgs, "max_tokens": 5, "temperature": 0, "add_generation_prompt": False}  # (no new turn)

    def content(**extra):
        r = httpx.post(server.url + "/v1/chat/completions", headers=auth, json={**body, **extra})
        return r.json()["choices"][0]["message"]["content"]
    plain = content()
    assert content(echo=True) == "ab" + plain
    chunks = client(server).chat.completions.create(model=NAME, messages=msgs, max_tokens=5, temperature=0, stream=True,
                                                    extra_body={"echo": True, "add_generation_prompt": False})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "ab" + plain
    new_turn = {"messages": msgs[:1], "add_generation_prompt": True}
    assert content(**new_turn, echo=True) == content(**new_turn)


def test_chat_template_options(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    tok = ChatToyTokenizer(VOCAB)
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + "/v1/chat/completions", headers=auth, json={
        "messages": msgs, "max_tokens": 5, "temperature": 0, "add_generation_prompt": False}).json()
    assert r["choices"][0]["message"]["content"] == alone(tok.encode("<user>hi"), SamplingParams(max_tokens=5)).text
    for body, needle in (({"chat_template_kwargs": {"messages": []}}, "may not set messages"),
                         ({"continue_final_message": True}, "final assistant message"),
                         ({"continue_final_message": True, "add_generation_prompt": True}, "cannot both be true"),
                         ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
                         ({"messages": [{"role": "user", "content": None}]}, "content is required in a user message")):
        r = httpx.post(server.url + "/v1/chat/completions", headers=auth, json={"messages": msgs, **body})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], body
    # integers sent as floats with no fraction (as Python clients may) are those integers; others a 400
    r = httpx.post(server.url + "/v1/chat/completions", headers=auth,
                   json={"messages": msgs, "max_tokens": 5.0, "seed": 7.0, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 5
    r = httpx.post(server.url + "/v1/chat/completions", headers=auth, json={"messages": msgs, "max_tokens": 5.5})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_vllm_stop_token_ids_and_min_tokens(server):
    c = client(server)
    ref = expected("hello world", 12, ignore_eos=True)
    stop = ref.generated[4]
    r = c.completions.create(model=NAME, prompt="hello world", max_tokens=12, temperature=0,
                             extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == ref.generated.index(stop) + 1
    assert r.choices[0].stop_reason == stop
    r = c.completions.create(model=NAME, prompt="hello world", max_tokens=12, temperature=0,
                             logit_bias={"2": 60}, extra_body={"min_tokens": 5})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "stop"  # 5 tokens, then EOS
    assert r.choices[0].stop_reason is None
    # include_stop_str_in_output: the stop string stays in the text; allowed_token_ids: the only choices
    stop_text = ref.text[3:5]
    for include in (False, True):
        r = c.completions.create(model=NAME, prompt="hello world", max_tokens=12, temperature=0,
                                 stop=[stop_text], extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
        cut = ref.text.index(stop_text) + (len(stop_text) if include else 0)
        assert r.choices[0].text == ref.text[:cut] and r.choices[0].finish_reason == "stop"
    allowed = sorted(set(ref.generated[::2]))
    want = expected("hello world", 12, ignore_eos=True, allowed_token_ids=tuple(allowed))
    r = c.completions.create(model=NAME, prompt="hello world", max_tokens=12, temperature=0,
                             extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert r.choices[0].text == want.text and set(want.generated) <= set(allowed)
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids or bad_words leave no token"):  # mid-decode
        c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                  response_format={"type": "json_object"},
                                  extra_body={"allowed_token_ids": ChatToyTokenizer(VOCAB).encode("z")})
    # bad_words: text the reply may not contain (the toy tokenizer reads chr(t + 192) as token t)
    pair = ref.generated[4:6]
    want = expected("hello world", 12, ignore_eos=True, bad_words=("".join(chr(t + 192) for t in pair),))
    r = c.completions.create(model=NAME, prompt="hello world", max_tokens=12, temperature=0,
                             extra_body={"ignore_eos": True, "bad_words": ["".join(chr(t + 192) for t in pair)]})
    assert r.choices[0].text == want.text != ref.text
    assert all(want.generated[i:i + 2] != pair for i in range(len(want.generated)))
    for body, needle in (({"stop_token_ids": [VOCAB]}, "stop_token_ids"), ({"min_tokens": -1}, "min_tokens"),
                         ({"allowed_token_ids": [VOCAB]}, "allowed_token_ids"), ({"bad_words": [""]}, "bad_words")):
        with pytest.raises(openai.BadRequestError, match=needle):
            c.completions.create(model=NAME, prompt="x", max_tokens=5, extra_body=body)


def test_vllm_truncate_prompt_tokens_keeps_the_prompts_end(server):
    c = client(server)
    tok = ChatToyTokenizer(VOCAB)
    long = "the start that goes " * 12 + "and the end"  # more than the tiny model's 128-token context
    ids = tok.encode(long)
    assert len(ids) > 128
    kept = ids[-20:]
    ref = alone(kept, SamplingParams(max_tokens=8))
    r = c.completions.create(model=NAME, prompt=long, max_tokens=8, temperature=0, echo=True,
                             extra_body={"truncate_prompt_tokens": 20})
    assert r.choices[0].text == tok.decode(kept) + ref.text and r.usage.prompt_tokens == 20
    chat_ids = tok.encode(chat_prompt(long))
    ref = alone(chat_ids[-30:], SamplingParams(max_tokens=6))
    r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": long}], max_tokens=6,
                                  temperature=0, extra_body={"truncate_prompt_tokens": 30})
    assert r.choices[0].message.content == ref.text and r.usage.prompt_tokens == 30
    # -1: as much of the prompt as the context holds (then max_tokens must fit beside it)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        c.completions.create(model=NAME, prompt=long, max_tokens=8, extra_body={"truncate_prompt_tokens": -1})
    for value in (0, -2, 129):
        with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
            c.completions.create(model=NAME, prompt="x", max_tokens=5, extra_body={"truncate_prompt_tokens": value})
    with pytest.raises(openai.BadRequestError, match="would cut a fill-in-the-middle"):
        c.completions.create(model=NAME, prompt="x", suffix="y", max_tokens=5, extra_body={"truncate_prompt_tokens": 3})


def test_a_requests_own_chat_template_is_refused(server):
    with pytest.raises(openai.BadRequestError, match="chat_template"):
        client(server).chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                               extra_body={"chat_template": "{{ messages }}"})


def test_tokenize_and_detokenize(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    tok = ChatToyTokenizer(VOCAB)
    r = httpx.post(server.url + "/tokenize", json={"model": NAME, "prompt": "hello"}, headers=auth).json()
    assert r["tokens"] == tok.encode("hello") and r["count"] == 5 and r["max_model_len"] > 0
    r = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, headers=auth).json()
    assert r["tokens"] == tok.encode(chat_prompt("hi"))
    # vLLM's chat options on /tokenize, as the chat endpoint renders them; each token's string on request
    r = httpx.post(server.url + "/tokenize", headers=auth, json={"messages": [{"role": "user", "content": "hi"}],
                                                                  "add_generation_prompt": False,
                                                                  "return_token_strs": True}).json()
    no_prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert r["tokens"] == tok.encode(no_prompt) and r["token_strs"] == [tok.id_to_token(t) for t in r["tokens"]]
    r = httpx.post(server.url + "/detokenize", json={"tokens": tok.encode("hello")}, headers=auth).json()
    assert r["prompt"] == r["content"] == tok.decode(tok.encode("hello"))  # (vLLM's name, llama.cpp's)
    r = httpx.post(server.url + "/tokenize", json={"content": "hello", "with_pieces": True}, headers=auth).json()
    assert r["tokens"] == [{"id": t, "piece": tok.decode([t])} for t in tok.encode("hello")]  # llama.cpp's form
    for path, body, status in (("/tokenize", {"prompt": "x", "messages": []}, 400), ("/tokenize", {}, 400),
                               ("/tokenize", {"prompt": "x", "content": "y"}, 400),
                               ("/detokenize", {"tokens": [VOCAB]}, 400), ("/detokenize", {"tokens": "ab"}, 400),
                               ("/tokenize", {"model": "other", "prompt": "x"}, 404)):
        r = httpx.post(server.url + path, json=body, headers=auth)
        assert r.status_code == status and "error" in r.json(), (path, body)
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401


def test_logprobs_completions_and_chat(server):
    c = client(server)
    ref = expected("score me", 10, temperature=0, logprobs=2)
    r = c.completions.create(model=NAME, prompt="score me", max_tokens=10, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    tok = ChatToyTokenizer(VOCAB)
    assert lp.tokens == [tok.piece(t) for t in ref.generated]
    assert lp.token_logprobs == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-6)
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v, abs=1e-6)  # greedy: the best token
               for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    # sampled: the chosen token is in its top_logprobs even where it is not among the 2 likeliest
    hot = c.completions.create(model=NAME, prompt="score me", max_tokens=10, temperature=5.0, seed=1,
                               logprobs=2).choices[0].logprobs
    assert all(top[t] == v and len(top) in (2, 3) for t, v, top in zip(hot.tokens, hot.token_logprobs,
                                                                        hot.top_logprobs))
    assert any(len(top) == 3 for top in hot.top_logprobs)  # (temperature 5 picks unlikely tokens)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # streamed: the same tokens and figures, chunk by chunk, offsets continuing across chunks
    chunks = list(c.completions.create(model=NAME, prompt="score me", max_tokens=10, temperature=0, logprobs=2,
                                       stream=True))
    streamed = [(t, v, o) for ch in chunks if ch.choices and ch.choices[0].logprobs
                for t, v, o in zip(ch.choices[0].logprobs.tokens, ch.choices[0].logprobs.token_logprobs,
                                   ch.choices[0].logprobs.text_offset)]
    assert streamed == list(zip(lp.tokens, lp.token_logprobs, lp.text_offset))
    # chat: content entries with bytes and top alternatives
    ref = expected(chat_prompt("hi"), 6, temperature=0, logprobs=3)
    r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                  temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == [tok.piece(t) for t in ref.generated]
    assert [e.logprob for e in content] == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-6)
    assert all(e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 3 for e in content)
    r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                  temperature=0)
    assert r.choices[0].logprobs is None
    # vLLM's return_tokens_as_token_ids: tokens named "token_id:ID" (offsets still count the text)
    ids = c.completions.create(model=NAME, prompt="score me", max_tokens=10, temperature=0, logprobs=2,
                               extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    names = [f"token_id:{t}" for t in expected("score me", 10, temperature=0).generated]
    assert ids.tokens == names and ids.text_offset == lp.text_offset
    assert all(set(top) <= {f"token_id:{i}" for i in range(VOCAB)} for top in ids.top_logprobs)
    r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                  temperature=0, logprobs=True, top_logprobs=3,
                                  extra_body={"return_tokens_as_token_ids": True})
    assert [e.token for e in r.choices[0].logprobs.content] == [f"token_id:{t}" for t in ref.generated]


def test_echo_with_prompt_logprobs(server):
    c = client(server)
    r = c.completions.create(model=NAME, prompt="echo this", max_tokens=5, temperature=0, echo=True, logprobs=1)
    ref = expected("echo this", 5, temperature=0)
    assert r.choices[0].text == "echo this" + ref.text
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    r = c.completions.create(model=NAME, prompt=["ab", "cd"], max_tokens=3, temperature=0, echo=True, n=2)
    assert [ch.text[:2] for ch in r.choices] == ["ab", "ab", "cd", "cd"] and r.choices[0].logprobs is None
    chunks = list(c.completions.create(model=NAME, prompt="echo", max_tokens=4, temperature=0, echo=True,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "echo" + expected("echo", 4).text


def test_penalties_reach_the_engine(server):
    c = client(server)
    kw = dict(presence_penalty=1.5, frequency_penalty=0.5)
    r = c.completions.create(model=NAME, prompt="again again", max_tokens=20, temperature=0,
                             extra_body={"repetition_penalty": 1.2, "ignore_eos": True}, **kw)
    ref = expected("again again", 20, temperature=0, repetition_penalty=1.2, ignore_eos=True, **kw)
    assert r.choices[0].text == ref.text
    assert ref.generated != expected("again again", 20, temperature=0, ignore_eos=True).generated
    banned = expected("again again", 5, temperature=0).generated[0]  # the first token, forbidden by a bias
    r = c.completions.create(model=NAME, prompt="again again", max_tokens=5, temperature=0,
                             logit_bias={str(banned): -100})
    ref = expected("again again", 5, temperature=0, logit_bias={banned: -100.0})
    assert r.choices[0].text == ref.text and ref.generated[0] != banned


def test_llamacpp_completion_endpoint(server):
    """llama.cpp's own /completion (and its alias /completions): the reply equals the prompt generated
    alone -- greedy, and seeded with llama.cpp's sampling defaults -- in llama.cpp's shape, streamed too."""
    auth = {"Authorization": f"Bearer {KEY}"}
    ids = ChatToyTokenizer(VOCAB).encode("hello there")
    ref = expected("hello there", 10, ignore_eos=True)
    for path, prompt in (("/completion", "hello there"), ("/completions", ids)):
        r = httpx.post(server.url + path, headers=auth, timeout=60,
                       json={"prompt": prompt, "n_predict": 10, "temperature": 0, "ignore_eos": True}).json()
        assert r["content"] == ref.text and (r["tokens_predicted"], r["tokens_evaluated"]) == (10, len(ids))
        assert (r["stop"], r["stop_type"], r["stopping_word"]) == (True, "limit", "")
        assert r["timings"]["predicted_n"] == 10
    body = {"prompt": "hello there", "n_predict": 10, "seed": 3, "ignore_eos": True}
    seeded = expected("hello there", 10, ignore_eos=True, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=3)
    assert httpx.post(server.url + "/completion", headers=auth, json=body, timeout=60).json()["content"] == seeded.text
    with httpx.stream("POST", server.url + "/completion", headers=auth, json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == seeded.text and events[-1]["stop"] is True
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["tokens_predicted"] == 10
    for bad in ({}, {"prompt": [["a"], 5]}, {"prompt": [VOCAB]}, {"prompt": ""}, {"prompt": "x", "n_predict": "many"}):
        r = httpx.post(server.url + "/completion", headers=auth, json=bad, timeout=60)
        assert r.status_code == 400, bad
    assert httpx.post(server.url + "/completion", json={"prompt": "x"}, timeout=60).status_code == 401


def test_return_token_ids(server):
    """vLLM's return_token_ids: each choice's token ids (and the prompt's) beside the text, streamed too."""
    auth = {"Authorization": f"Bearer {KEY}"}
    tok = ChatToyTokenizer(VOCAB)
    ref = expected("hello world", 8, temperature=0)
    body = {"prompt": "hello world", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    r = httpx.post(server.url + "/v1/completions", headers=auth, json=body).json()
    assert r["choices"][0]["token_ids"] == ref.generated
    assert r["choices"][0]["prompt_token_ids"] == tok.encode("hello world")
    with httpx.stream("POST", server.url + "/v1/completions", headers=auth, json={**body, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert sum((ch["choices"][0].get("token_ids", []) for ch in chunks if ch["choices"]), []) == ref.generated
    assert chunks[0]["choices"][0]["prompt_token_ids"] == tok.encode("hello world")
    ref = expected(chat_prompt("hi"), 6, temperature=0)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0,
            "return_token_ids": True}
    r = httpx.post(server.url + "/v1/chat/completions", headers=auth, json=chat).json()
    assert r["choices"][0]["token_ids"] == ref.generated and r["prompt_token_ids"] == tok.encode(chat_prompt("hi"))
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=auth, json={**chat, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert sum((ch["choices"][0].get("token_ids", []) for ch in chunks if ch["choices"]), []) == ref.generated
    assert chunks[0]["prompt_token_ids"] == tok.encode(chat_prompt("hi"))
    plain = httpx.post(server.url + "/v1/completions", headers=auth, json={**body, "return_token_ids": False}).json()
    assert "token_ids" not in plain["choices"][0]
    # the prompt echoed alone (max_tokens 0): its one decoded token stays unseen, in the ids too
    echo = httpx.post(server.url + "/v1/completions", headers=auth,
                      json={**body, "max_tokens": 0, "echo": True}).json()["choices"][0]
    assert echo["token_ids"] == [] and echo["prompt_token_ids"] == tok.encode("hello world")
