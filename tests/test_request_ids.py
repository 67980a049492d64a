"""Every answer carries ``x-request-id`` (OpenAI's header; its SDK reads it): the client's usable id
echoed, else a new one a request -- errors, streams and 404s alike."""
from __future__ import annotations

from test_server_hardening import AUTH, call, make_app, post


def test_every_answer_has_a_request_id_and_a_clients_usable_one_comes_back():
    body = {"model": "m", "prompt": "ab", "max_tokens": 2}
    given = ("POST", "/v1/completions", {"headers": {**AUTH, "X-Request-Id": "trace-42.a:b"}, "json": body})
    forged = ("POST", "/v1/completions", {"headers": {**AUTH, "X-Request-Id": "x" * 200}, "json": body})
    answers = call(make_app(), [post("/v1/completions", body), post("/v1/completions", body), given, forged,
                                post("/v1/completions", {"prompt": 3}), ("GET", "/nowhere", {}),
                                post("/v1/completions", {**body, "stream": True})])
    assert [r.status_code for r in answers] == [200, 200, 200, 200, 400, 404, 200]
    ids = [r.headers.get("x-request-id") for r in answers]
    assert all(ids) and all(len(r.headers.get_list("x-request-id")) == 1 for r in answers)
    assert ids[2] == "trace-42.a:b" and ids[3] != "x" * 200  # (an id too long to echo: a new one)
    fresh = [ids[i] for i in (0, 1, 3, 4, 5, 6)]
    assert len(set(fresh)) == len(fresh) and all(i.startswith("req_") for i in fresh)


def test_the_log_lines_carry_the_request_id(caplog):
    """The finished request's log line and a refused request's name the id the answer carried."""
    import logging
    body = {"model": "m", "prompt": "ab", "max_tokens": 2}
    headers = {**AUTH, "X-Request-Id": "trace-7"}
    with caplog.at_level(logging.INFO, logger="tokenleap.serve"):
        answers = call(make_app(), [("POST", "/v1/completions", {"headers": headers, "json": body}),
                                    ("POST", "/v1/completions", {"headers": headers, "json": {**body, "stream": True}}),
                                    ("POST", "/v1/completions", {"headers": headers, "json": {"prompt": 3}})])
    assert [r.status_code for r in answers] == [200, 200, 400]
    lines = [r.getMessage() for r in caplog.records]
    assert sum('x_request_id="trace-7"' in line for line in lines if line.startswith("request ")) == 2, lines
    assert any("-> 400" in line and "(x-request-id trace-7)" in line for line in lines), lines
