"""Hostile input, disconnects and operator features of the HTTP server: int64 overflow and non-finite
numbers are 400s naming the field, a client that leaves (streamed or not) stops its generation, the
OpenAPI docs sit behind the API key, CORS for the origins asked (by default this machine's pages),
latency histograms under vLLM's names and one log line per request. Most run in-process over
httpx's ASGI transport (no socket)."""
from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tokenleap.serve.scheduler import SchedulerConfig
from tokenleap.serve.app import ServerConfig, create_app

from serving_helpers import VOCAB, BosToyTokenizer, LiveServer, paged_engine, wait_until

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}


def make_app(engine=None, **config):
    cfg = ServerConfig("m", api_key=config.pop("api_key", KEY), scheduler=SchedulerConfig(log_interval=0), **config)
    return create_app(engine if engine is not None else paged_engine(), cfg)


def call(app, requests):
    """Run ``requests`` (method, path, kwargs) against ``app`` in-process; the responses, in order."""
    async def go():
        sched = app.state.server.scheduler
        sched.start()
        try:
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
                return [await c.request(method, path, **kw) for method, path, kw in requests]
        finally:
            sched.shutdown()
    return asyncio.run(go())


def post(path, body=None, content=None):
    kw = {"headers": AUTH, **({"json": body} if content is None else {"content": content})}
    return "POST", path, kw


@pytest.fixture(scope="module")
def app():
    return make_app()


OVERFLOW = (10**30, 2**63, -2**63 - 1)


def test_integers_past_int64_are_400_naming_the_field_streamed_or_not(app):
    cases = []
    for value in OVERFLOW:
        for stream in (False, True):
            for field in ("top_k", "seed", "n", "max_tokens", "min_tokens", "logprobs"):
                cases.append(("/v1/completions", {"prompt": "ab", field: value, "stream": stream}, field))
            cases.append(("/v1/completions", {"prompt": "ab", "stop_token_ids": [3, value], "stream": stream},
                          "stop_token_ids"))
            cases.append(("/v1/completions", {"prompt": [3, value], "stream": stream}, "prompt"))
            for field in ("max_completion_tokens", "max_tokens", "top_k", "top_logprobs"):
                cases.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                       "logprobs": True, field: value, "stream": stream}, field))
        cases.append(("/detokenize", {"tokens": [1, value]}, "tokens"))
    cases.append(("/v1/completions", {"prompt": "ab", "logit_bias": {"9" * 30: 1}}, "logit_bias"))
    cases.append(("/v1/completions", {"prompt": "ab", "logit_bias": {"\u00b2": 1}}, "logit_bias"))  # "²".isdigit()
    responses = call(app, [post(path, body) for path, body, _ in cases])
    for (path, body, field), r in zip(cases, responses):
        assert r.status_code == 400, (path, body, r.status_code, r.text)
        assert r.json()["error"]["param"] == field, (body, r.text)
        if isinstance(body.get(field), int):  # the field itself, and what is wrong with it
            assert r.json()["error"]["message"].startswith(f"invalid value for {field}: Input should be "), r.text
    prompt = responses[[body for _, body, _ in cases].index({"prompt": [3, 10**30], "stream": False})]
    assert prompt.json()["error"]["message"].startswith("invalid value for prompt.1: Input should be less than")
    # the edge of the range is a valid top_k (it keeps every token), not an overflow deeper down
    ok = call(app, [post("/v1/completions", {"prompt": "ab", "max_tokens": 3, "top_k": 2**63 - 1,
                                             "temperature": 0.7, "seed": -2**63})])[0]
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    # so is the top of the seed's range, with n choices (seeds hashed from it)
    top = call(app, [post("/v1/completions", {"prompt": "ab", "max_tokens": 3, "temperature": 0.7,
                                              "seed": 2**63 - 1, "n": 3})])[0]
    assert top.status_code == 200 and len(top.json()["choices"]) == 3, top.text


def test_non_finite_and_absurd_values_are_refused(app):
    chat = {"messages": [{"role": "user", "content": "x"}]}
    cases = [
        (b'{"prompt": "a", "temperature": 1e999}', None), (b'{"prompt": "a", "top_p": -1e999}', None),
        (b'{"prompt": "a", "temperature": NaN}', None), (b'{"prompt": "a", "temperature": Infinity}', None),
        (b'{"prompt": "a", "temperature": 1e30}', "temperature"), (b'{"prompt": "a", "temperature": 101}', "temperature"),
        (b'{"prompt": "a", "temperature": -1}', "temperature"),
        (b'{"prompt": "a", "top_p": 0}', "top_p"), (b'{"prompt": "a", "top_p": 1.5}', "top_p"),
        (b'{"prompt": "a", "presence_penalty": 1e300}', "presence_penalty"),
        (b'{"prompt": "a", "logit_bias": {"3": 1e300}}', "logit_bias"),
    ]
    responses = call(app, [post("/v1/completions", content=body) for body, _ in cases] + [
        post("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "x"},
                                                           {"role": "tool", "content": "42"}]})])
    for (body, param), r in zip(cases, responses):
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    tool = responses[-1]
    assert tool.status_code == 400 and "tool_call_id" in tool.json()["error"]["message"]
    negative = responses[[body for body, _ in cases].index(b'{"prompt": "a", "temperature": -1}')]
    assert "temperature must be in [0, 100]" in negative.json()["error"]["message"]


def test_docs_behind_the_api_key_or_off():
    requests = [("GET", "/openapi.json", {}), ("GET", "/docs", {}), ("GET", "/openapi.json", {"headers": AUTH}),
                ("GET", "/docs", {"headers": AUTH})]
    locked = call(make_app(), requests)
    assert [r.status_code for r in locked] == [401, 401, 200, 200]
    assert "/v1/completions" in locked[2].json()["paths"] and "swagger" in locked[3].text.lower()
    assert [r.status_code for r in call(make_app(api_key=None), requests[:2])] == [200, 200]
    off = call(make_app(docs=False), requests)
    assert [r.status_code for r in off] == [404] * 4 and all("error" in r.json() for r in off)


def test_probes_answer_without_the_api_key_and_the_model_routes_do_not():
    """/health and Ollama's /api/version (what clients check before they call) need no key; the
    routes that tell of the model do."""
    got = call(make_app(), [("GET", "/health", {}), ("GET", "/api/version", {}), ("GET", "/api/tags", {}),
                            ("GET", "/v1/models", {}), ("GET", "/api/tags", {"headers": AUTH})])
    assert [r.status_code for r in got] == [200, 200, 401, 401, 200], [r.text for r in got]
    assert got[1].json()["version"]


def test_cors_for_allowed_origins_and_by_default_this_machines_pages():
    preflight = ("OPTIONS", "/v1/completions", {"headers": {"Origin": "https://app.example",
                                                              "Access-Control-Request-Method": "POST"}})
    models = ("GET", "/v1/models", {"headers": {**AUTH, "Origin": "https://app.example"}})
    plain = call(make_app(), [preflight, models])
    assert all("access-control-allow-origin" not in r.headers for r in plain)
    local = [("OPTIONS", "/v1/completions", {"headers": {"Origin": origin, "Access-Control-Request-Method": "POST"}})
             for origin in ("http://localhost:3000", "http://127.0.0.1:8080", "http://localhost.example.com",
                            "vscode-webview://1a2b", "tauri://localhost", "app://obsidian.md", "http://0.0.0.0:3000",
                            "https://vscode-webview.example")]
    got = [r.headers.get("access-control-allow-origin") for r in call(make_app(), local)]
    # pages on this machine and desktop apps' pages (as Ollama's defaults), by default
    assert got == ["http://localhost:3000", "http://127.0.0.1:8080", None, "vscode-webview://1a2b", "tauri://localhost",
                   "app://obsidian.md", "http://0.0.0.0:3000", None]
    allowed = call(make_app(allowed_origins=("https://app.example",)), [preflight, models])
    assert [r.headers.get("access-control-allow-origin") for r in allowed] == ["https://app.example"] * 2
    other = call(make_app(allowed_origins=("https://other.example",)), [models])[0]
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


def test_other_pages_cannot_start_work_by_a_simple_cross_site_post():
    """A browser sends a text/plain POST across sites without a preflight: CORS would only hide the
    answer, so a request from a page not allowed is refused before it runs (403, each API's error
    form); this machine's pages, allowed origins and clients without an Origin header go through."""
    body = json.dumps({"prompt": "hi", "max_tokens": 2})
    simple = {"Content-Type": "text/plain", **AUTH}

    def from_page(origin, path="/v1/completions", content=body):
        return "POST", path, {"headers": {**simple, **({"Origin": origin} if origin else {})}, "content": content}

    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False})
    got = call(make_app(), [from_page("https://evil.example"), from_page("null"),
                            from_page("https://evil.example", "/api/chat", chat),
                            from_page("https://evil.example", "/v1/messages", chat),
                            ("DELETE", "/v1/responses/x", {"headers": {**AUTH, "Origin": "https://evil.example"}}),
                            ("GET", "/v1/models", {"headers": {**AUTH, "Origin": "https://evil.example"}}),
                            from_page("http://localhost:3000"), from_page(None), from_page("vscode-webview://1a2b")])
    assert [r.status_code for r in got] == [403, 403, 403, 403, 403, 200, 200, 200, 200]
    refused = got[0].json()["error"]
    assert refused["type"] == "permission_error" and "--allowed-origins" in refused["message"]
    assert "error" in got[2].json() and isinstance(got[2].json()["error"], str)  # Ollama's form
    assert got[3].json()["type"] == "error"  # Anthropic's form
    assert got[6].json()["choices"] and got[7].json()["choices"]
    named = call(make_app(allowed_origins=("https://app.example",)),
                 [from_page("https://app.example"), from_page("http://localhost:3000")])
    assert [r.status_code for r in named] == [200, 403]  # named origins replace this machine's pages
    anyone = call(make_app(allowed_origins=("*",)), [from_page("https://evil.example")])
    assert anyone[0].status_code == 200
    own = ("POST", "/v1/completions", {"headers": {**simple, "Origin": "http://192.168.1.5:8000",
                                                   "Host": "192.168.1.5:8000"}, "content": body})
    named = ("POST", "/v1/completions", {"headers": {**simple, "Origin": "http://evil.example:8000",
                                                     "Host": "evil.example:8000"}, "content": body})
    # the server's own /docs page reached by its IP address; a name re-pointed here (DNS rebinding) is not enough
    assert [r.status_code for r in call(make_app(), [own, named])] == [200, 403]


def _metric(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name))
    return float(line.rsplit(" ", 1)[1])


def test_latency_histograms_under_vllm_names_and_one_log_line_per_request(caplog):
    body = {"prompt": "secret prompt", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with caplog.at_level(logging.INFO, logger="tokenleap.serve.requests"):
        r = call(make_app(paged_engine("ngram")), [post("/v1/completions", body), post("/v1/completions",
                 {**body, "stream": True, "n": 2}), ("GET", "/metrics", {})])
    assert [x.status_code for x in r] == [200, 200, 200]
    metrics = r[2].text
    for prefix in ("vllm", "tokenleap"):  # vLLM's names, and tokenleap's, for every family
        for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                     "request_time_per_output_token_seconds"):
            assert _metric(metrics, f"{prefix}:{name}_count") == 3, name
        # inter-token latency: one gap a step that handed a request tokens after its first (vLLM V1's
        # two names for it), so at least one and at most 5 gaps for each of the 3 six-token completions
        gaps = _metric(metrics, f"{prefix}:inter_token_latency_seconds_count")
        assert 3 <= gaps <= 15 and _metric(metrics, f"{prefix}:time_per_output_token_seconds_count") == gaps
        assert _metric(metrics, f"{prefix}:inter_token_latency_seconds_sum") == pytest.approx(
            _metric(metrics, f"{prefix}:time_per_output_token_seconds_sum"))
        assert _metric(metrics, f"{prefix}:request_generation_tokens_sum") == 18
        assert _metric(metrics, f"{prefix}:request_prompt_tokens_sum") == 3 * len("secret prompt")
        assert _metric(metrics, f"{prefix}:generation_tokens_total") == 18
    assert _metric(metrics, 'vllm:request_generation_tokens_bucket{le="5.0"') == 0
    assert _metric(metrics, 'vllm:request_generation_tokens_bucket{le="10.0"') == 3
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "tokenleap.serve.requests"]
    assert len(lines) == 2 and all(line.startswith("request id=") for line in lines)
    fields = dict(part.split("=", 1) for part in lines[1].split()[1:])
    assert fields["prompt_tokens"] == "13" and fields["generated_tokens"] == "12" and fields["n"] == "2"
    assert fields["proposer"] == '"ngram"' and fields["finish"] == '"length,length"'
    assert int(fields["accepted_tokens"]) <= int(fields["drafted_tokens"]) and float(fields["seconds"]) > 0
    assert not any("secret" in line for line in lines)
    # plain decoding hands out one token a step: 5 gaps after the first token
    plain = call(make_app(), [post("/v1/completions", body), ("GET", "/metrics", {})])[1].text
    assert _metric(plain, "vllm:inter_token_latency_seconds_count") == 5
    assert _metric(plain, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(
        _metric(plain, "vllm:inter_token_latency_seconds_sum") / 5)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tokenleap.serve.requests"):
        call(make_app(log_prompts=True), [post("/v1/completions", body)])
    assert 'prompt="secret prompt"' in caplog.records[-1].getMessage()


def slowed(engine, seconds: float):
    """``engine`` whose every step takes at least ``seconds``: a request generates steadily and long."""
    step = engine.step

    def slow_step(*a, **kw):
        time.sleep(seconds)
        return step(*a, **kw)
    engine.step = slow_step
    return engine


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_stops_its_generation(stream):
    """Outputs keep arriving (no pause for a poll to notice): the disconnect itself cancels the request."""
    eng = slowed(paged_engine("ngram", k=2), 0.05)  # at most 3 tokens a step: 110 tokens take 1.8 s or more
    with LiveServer(make_app(eng, api_key=None)) as s:
        body = {"prompt": "leave me", "max_tokens": 110, "ignore_eos": True, "temperature": 0, "stream": stream}
        with httpx.Client(timeout=0.6) as c:
            if stream:
                with c.stream("POST", s.url + "/v1/completions", json=body) as r:
                    next(r.iter_bytes())  # the first chunk; leaving the block closes the connection
                    time.sleep(0.3)
            else:
                with pytest.raises(httpx.TimeoutException):
                    c.post(s.url + "/v1/completions", json=body)
        left = time.monotonic()
        assert wait_until(lambda: s.scheduler.idle, 30)
        assert time.monotonic() - left < 5 and s.scheduler.stats.finished == {"abort": 1}
        assert eng.totals.new_tokens < 100 and eng.cache.num_used_blocks == 0


def test_a_client_closing_mid_body_logs_one_line(caplog):
    with caplog.at_level(logging.INFO, logger="tokenleap.serve"), LiveServer(make_app(api_key=None)) as s:
        with socket.create_connection(("127.0.0.1", s.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
            time.sleep(0.2)
        assert wait_until(lambda: any("disconnected" in r.getMessage() for r in caplog.records), 10)
        assert httpx.get(s.url + "/health").status_code == 200
    assert not any(r.exc_info or "unhandled" in r.getMessage() for r in caplog.records)


def test_a_body_over_the_limit_is_refused_before_it_is_held_whole():
    """413 at once for a Content-Length over the limit (nothing of the body read), and for a chunked
    body as soon as its chunks pass the limit -- in each API's error form."""
    from tokenleap.serve.body import MAX_BODY_BYTES
    with LiveServer(make_app(api_key=None)) as s:
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {50 * MAX_BODY_BYTES}\r\n\r\n".encode())
            head = sock.recv(65536).decode(errors="replace")  # (no byte of the body sent)
        assert head.startswith("HTTP/1.1 413") and "request body over" in head

        def chunks():
            yield b'{"prompt": "'
            for _ in range(MAX_BODY_BYTES // (1 << 20) + 2):
                yield b"a" * (1 << 20)
            yield b'"}'
        r = httpx.post(s.url + "/api/generate", content=chunks(), timeout=30)
        assert r.status_code == 413 and "request body over" in r.json()["error"]  # (Ollama's error form)
        assert httpx.get(s.url + "/health").status_code == 200


def test_admission_counts_a_requests_choices():
    """max_num_seqs 2 + max_waiting 4: a request of n=6 fills the batch and the queue; while it runs,
    one more sequence is a 503 saying what it adds; once it is done, requests are taken again; one
    of n=7 never fits, a 400."""
    eng = slowed(paged_engine(), 0.02)
    cfg = ServerConfig("m", scheduler=SchedulerConfig(max_num_seqs=2, max_waiting=4, log_interval=0))
    app = create_app(eng, cfg)
    sched = app.state.server.scheduler

    async def go():
        sched.start()
        try:
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
                big = asyncio.ensure_future(c.post("/v1/completions", json={
                    "prompt": "many", "n": 6, "max_tokens": 12, "ignore_eos": True}))
                while sched.idle:
                    await asyncio.sleep(0.01)
                extra = await c.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2})
                big = await big
                after = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                return big, extra, after, await c.post("/v1/completions", json={"prompt": "x", "n": 7})
        finally:
            sched.shutdown()
    big, extra, after, never = asyncio.run(go())
    assert never.status_code == 400 and never.json()["error"]["param"] == "n", never.text  # 7 > 2 + 4, idle or not
    assert big.status_code == 200 and len(big.json()["choices"]) == 6
    assert extra.status_code == 503 and "adds 1" in extra.json()["error"]["message"], extra.text
    assert after.status_code == 200


def test_an_unhandled_error_is_a_500_on_a_connection_that_stays_open(caplog):
    """Starlette's handler for Exception re-raises after answering, and uvicorn then closes the
    keep-alive connection under the client; the server answers such errors itself instead."""
    eng = paged_engine()
    encode = eng.tokenizer.encode

    def failing(text, *a, **kw):
        if "boom" in text:
            raise RuntimeError("a bug")
        return encode(text, *a, **kw)
    eng.tokenizer.encode = failing
    with caplog.at_level(logging.ERROR, logger="tokenleap.serve"), LiveServer(make_app(eng, api_key=None)) as s:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        replies = []
        for prompt in ("boom", "fine", "boom"):
            conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 2}),
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            replies.append((r.status, json.loads(r.read()), conn.sock))
        conn.close()
    assert [status for status, _, _ in replies] == [500, 200, 500]
    assert replies[0][1]["error"]["type"] == "server_error" and replies[1][1]["choices"]
    assert replies[0][2] is replies[1][2] is replies[2][2]  # one connection throughout
    assert sum("unhandled" in r.getMessage() for r in caplog.records) == 2


def test_empty_constraints_and_null_n():
    """An empty choice list, regex or grammar is a 400 naming the field; llama.cpp's defaults (an
    empty grammar, an empty schema) mean no constraint; ``n: null`` is OpenAI's default of 1."""
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    bad = [{"guided_choice": []}, {"guided_choice": [""]}, {"guided_regex": ""}, {"guided_grammar": " "}]
    responses = call(make_app(), [post("/v1/chat/completions", {**chat, **b}) for b in bad] + [
        post("/v1/completions", {"prompt": "x", "max_tokens": 2, **bad[0]}),
        post("/completion", {"prompt": "x", "n_predict": 2, "grammar": "", "json_schema": {}}),
        post("/v1/chat/completions", {**chat, "n": None}), post("/v1/completions", {"prompt": "x", "n": None})])
    for b, r in zip(bad + [bad[0]], responses):
        assert r.status_code == 400 and r.json()["error"]["param"] == next(f for f in b), (b, r.text)
    assert [r.status_code for r in responses[-3:]] == [200, 200, 200], [r.text for r in responses[-3:]]
    assert len(responses[-1].json()["choices"]) == 1


def test_fields_that_cannot_be_honoured_are_400s_naming_them():
    """As OpenAI / vLLM answer: stream_options without stream, an empty allowed_token_ids, min_tokens
    over max_tokens (given, or its default), best_of other than n (choices are not ranked), top_logprobs past 20, allowed
    tokens that all end the reply under min_tokens (EOS is token 2 here)."""
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    cases = [("/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}}, "stream_options"),
             ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
             ("/v1/completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 5}, "min_tokens"),
             ("/v1/chat/completions", {**chat, "max_completion_tokens": 2, "min_tokens": 3}, "min_tokens"),
             # over the default budget: completions' 16 tokens, or what the context leaves a chat reply
             ("/v1/completions", {"prompt": "x", "min_tokens": 17}, "min_tokens"),
             ("/v1/chat/completions", {"messages": chat["messages"], "min_tokens": 10**6}, "min_tokens"),
             ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
             ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
             ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
             ("/v1/chat/completions", {**chat, "allowed_token_ids": [2], "min_tokens": 2}, "allowed_token_ids"),
             ("/v1/completions", {"prompt": "x", "allowed_token_ids": [2, 7], "stop_token_ids": [7],
                                  "min_tokens": 1}, "allowed_token_ids"),
             # what vLLM / OpenAI define and this server cannot do: refused rather than ignored
             ("/v1/completions", {"prompt": "x", "use_beam_search": True, "n": 2}, "use_beam_search"),
             ("/v1/chat/completions", {**chat, "priority": 5}, "priority"),
             ("/v1/chat/completions", {**chat, "cache_salt": "tenant-1"}, "cache_salt"),
             ("/v1/completions", {"prompt": "x", "logits_processors": ["x.y"]}, "logits_processors"),
             ("/v1/chat/completions", {**chat, "modalities": ["text", "audio"]}, "modalities"),
             ("/v1/chat/completions", {**chat, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
             ("/v1/chat/completions", {**chat, "web_search_options": {}}, "web_search_options")]
    fine = [("/v1/completions", {"prompt": "x", "max_tokens": 2, "best_of": 2, "n": 2}),
            ("/v1/completions", {"prompt": "x", "max_tokens": 3, "allowed_token_ids": [2, 7], "min_tokens": 2}),
            ("/v1/chat/completions", {**chat, "model": "m:latest"}),  # Ollama's tag for the served name
            # their neutral values ask for nothing
            ("/v1/chat/completions", {**chat, "use_beam_search": False, "priority": 0, "modalities": ["text"],
                                      "logits_processors": []})]
    responses = call(make_app(), [post(path, body) for path, body, _ in cases] + [post(p, b) for p, b in fine]
                     + [("HEAD", path, {"headers": AUTH})
                        for path in ("/health", "/v1/models", "/models", "/v1/models/m")])
    for (path, body, param), r in zip(cases, responses):
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert [r.status_code for r in responses[len(cases):]] == [200] * (len(fine) + 4), [r.text for r in responses]


def test_an_assistant_refusal_part_reads_as_its_text_and_an_empty_prompt_is_not_a_length_error():
    turns = [{"role": "user", "content": "x"}, None, {"role": "user", "content": "y"}]
    bodies = [{"messages": [turns[0], {"role": "assistant", "content": content}, turns[2]], "max_tokens": 4,
               "temperature": 0} for content in ([{"type": "refusal", "refusal": "no"}], "no")]
    lines = [{"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
             for content in ([{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}], "ab\ncd")]
    parts, text, two_parts, two_lines, empty = call(
        make_app(), [post("/v1/chat/completions", b) for b in bodies + lines]
        + [post("/completion", {"prompt": "", "n_predict": 2})])
    assert parts.status_code == text.status_code == 200, parts.text
    assert parts.json()["choices"][0]["message"] == text.json()["choices"][0]["message"]
    # text parts are joined a part a line, as vLLM renders them
    assert two_parts.json()["choices"][0]["message"] == two_lines.json()["choices"][0]["message"], two_parts.text
    assert empty.status_code == 400 and empty.json()["error"]["code"] != "context_length_exceeded", empty.text


def test_validation_messages_name_fields_not_union_members():
    """A 400's location is the request's own fields and indices: no type tags (str, list[int]) or model
    class names; an image part in a chat message is named as such."""
    image = {"type": "image_url", "image_url": {"url": "http://x/a.png"}}
    bodies = [("/v1/completions", {"prompt": [1, "a", 3]}), ("/v1/completions", {"prompt": "x", "stop": [1]}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": [image]}]}),
              ("/v1/messages", {"model": "m", "max_tokens": 3, "system": 5,
                                "messages": [{"role": "user", "content": "x"}]}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]})]
    got = [r.json() for r in call(make_app(), [post(path, body) for path, body in bodies])]
    messages = [g["error"]["message"] for g in got]
    assert messages[0].startswith("invalid value for prompt.1: ") and "integer" in messages[0]
    assert messages[1].startswith("invalid value for stop.0: ")
    assert "type 'image_url'" in messages[2] and "text parts only" in messages[2]
    assert messages[3].startswith("invalid value for system: ")
    assert messages[4].startswith("invalid value for messages.0.content.0.text: ")  # the text part's own field
    for m in messages:
        assert not any(tag in m.split(":")[0] for tag in (".str", "list[", "TextPart", "RefusalPart")), m


def test_a_prompt_that_fills_the_context_is_the_prompts_400_whatever_max_tokens_says():
    """No budget fits a prompt as long as the context: the 400 names the prompt (echoed with
    max_tokens 0, with a max_tokens given, or none); a budget that is too long names max_tokens."""
    full = [3 + i % 90 for i in range(128)]  # MAX_LEN tokens
    bodies = [{"prompt": full, "echo": True, "max_tokens": 0, "logprobs": 1}, {"prompt": full, "max_tokens": 4},
              {"prompt": full}, {"prompt": full[:100], "max_tokens": 40}]
    got = call(make_app(), [post("/v1/completions", b) for b in bodies])
    assert [r.status_code for r in got] == [400] * 4
    assert [r.json()["error"]["param"] for r in got] == ["prompt", "prompt", "prompt", "max_tokens"]
    assert all(r.json()["error"]["code"] == "context_length_exceeded" for r in got)
    assert "shorten the prompt" in got[0].json()["error"]["message"]
    # a chat's prompt is its messages (OpenAI's param), whichever check finds it too long
    chat = {"messages": [{"role": "user", "content": "a" * 200}]}
    got = call(make_app(), [post("/v1/chat/completions", b) for b in (chat, {**chat, "max_tokens": 4})])
    assert [(r.status_code, r.json()["error"]["param"], r.json()["error"]["code"]) for r in got] == [
        (400, "messages", "context_length_exceeded")] * 2



def test_completions_add_special_tokens_false_leaves_the_bos_out():
    """vLLM's add_special_tokens on completions: the tokenizer's BOS by default, none with false."""
    engine = paged_engine()
    engine.tokenizer = BosToyTokenizer(VOCAB)
    body = {"prompt": "hello", "max_tokens": 1, "temperature": 0}
    with_bos, without = call(make_app(engine), [post("/v1/completions", body),
                                                post("/v1/completions", {**body, "add_special_tokens": False})])
    assert with_bos.json()["usage"]["prompt_tokens"] == len("hello") + 1
    assert without.json()["usage"]["prompt_tokens"] == len("hello")


HELD_ROUTES = [  # (path, body): each asks for the text "hold" to be tokenized
    ("/v1/completions", {"prompt": "hold", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hold"}], "max_tokens": 2}),
    ("/v1/responses", {"input": "hold", "max_output_tokens": 2}),
    ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "hold"}], "max_tokens": 2}),
    ("/completion", {"prompt": "hold", "n_predict": 2}),
    ("/api/generate", {"model": "m", "prompt": "hold", "raw": True, "stream": False, "options": {"num_predict": 2}}),
    ("/api/chat", {"model": "m", "messages": [{"role": "user", "content": "hold"}], "stream": False,
                   "options": {"num_predict": 2}}),
    ("/tokenize", {"prompt": "hold"}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "bad_words": ["hold"]}),  # tokenized as the sequence is made
]


def test_a_prompt_being_tokenized_does_not_hold_up_the_event_loop():
    """Each API's prompt work runs off the event loop: while one request's tokenization is held up,
    /health and a streamed reply to another client go on (were it on the loop, both would wait)."""
    eng = paged_engine()
    tokenizer = eng.tokenizer
    encode, gate, entered = tokenizer.encode, threading.Event(), threading.Event()

    def held(text, *args, **kwargs):
        if isinstance(text, str) and "hold" in text:
            entered.set()
            gate.wait(20)
        return encode(text, *args, **kwargs)
    tokenizer.encode = held
    with LiveServer(make_app(eng, api_key=None)) as s, ThreadPoolExecutor(1) as pool:
        for path, body in HELD_ROUTES:
            entered.clear()
            gate.clear()
            slow = pool.submit(httpx.post, s.url + path, json=body, timeout=60)
            try:
                assert entered.wait(20), path
                assert httpx.get(s.url + "/health", timeout=5).status_code == 200, path
                other = {"prompt": "other", "max_tokens": 3, "ignore_eos": True, "stream": True}
                with httpx.stream("POST", s.url + "/v1/completions", json=other, timeout=5) as r:
                    assert r.status_code == 200 and "[DONE]" in r.read().decode(), path
            finally:
                gate.set()
            assert slow.result().status_code == 200, (path, slow.result().text)
    assert s.app.state.server._prompt_threads is None  # (let go with the app's lifespan)


def test_refused_requests_are_logged_once_each_without_the_key(app, caplog):
    """A request refused before it started (a bad parameter, a wrong key, an unknown model or route)
    leaves one log line naming the route, the status and why; the key sent is never in it."""
    caplog.set_level(logging.INFO, logger="tokenleap.serve.requests")
    bad_key = {"headers": {"Authorization": "Bearer not-the-key-123"}, "json": {"prompt": "a", "max_tokens": 1}}
    answers = call(app, [post("/v1/completions", {"prompt": "a", "max_tokens": 1, "temperature": -1}),
                         ("POST", "/v1/completions", bad_key),
                         post("/v1/completions", {"model": "other\n2026 INFO forged line", "prompt": "a"}),
                         ("GET", "/v1/nothing-here", {"headers": AUTH})])
    assert [a.status_code for a in answers] == [400, 401, 404, 404]
    lines = [r.getMessage() for r in caplog.records if r.name == "tokenleap.serve.requests"]
    assert len(lines) == 4, lines
    for line, status in zip(lines, (400, 401, 404, 404)):
        assert f"-> {status} (" in line and " from " in line
    assert "POST /v1/completions -> 400" in lines[0] and "temperature" in lines[0]
    assert "GET /v1/nothing-here -> 404" in lines[3]
    assert not any("not-the-key-123" in line for line in lines)
    assert all("\n" not in line for line in lines) and "other\\n2026 INFO forged line" in lines[2]
