"""``tokenleap serve``'s answer while its model loads (``serve/loading.py``), through real sockets: what a
client gets however it sends its request, the bound on answering threads, CORS for allowed pages, and
the hand-over of the listening socket to the real server."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import pytest


def test_the_loading_responder_answers_a_client_waiting_to_send_its_body_and_one_sending_too_much():
    """A request that waits for "100 Continue" before its body (curl does, past 1 MB) is answered at
    once, not after the read times out; one whose body is past what is read still gets its answer."""
    from tokenleap.cli.serve import listening_socket
    from tokenleap.serve.loading import LoadingResponder
    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    responder = LoadingResponder(sock).start()
    try:
        for head, body in ((b"Expect: 100-continue\r\nContent-Length: 1000\r\n", b""),
                           (b"Content-Length: 3000000\r\n", b"x" * 3_000_000)):
            with socket.create_connection(("127.0.0.1", port), timeout=3) as client:
                client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
                if body:
                    with contextlib.suppress(OSError):  # (answered unread: the send may meet a closed socket)
                        client.sendall(body)
                reply = b""
                while chunk := client.recv(65536):  # (a stalled answer: socket.timeout fails the test)
                    reply += chunk
            assert reply.startswith(b"HTTP/1.1 503") and b"model_loading" in reply
    finally:
        responder.stop()
        sock.close()


def test_an_answered_connections_leftover_input_is_read_before_it_closes(monkeypatch):
    """After its answer the responder reads what the client still sends (a body it did not read, a
    pipelined request) until the client closes, or for a moment at most: closing a TCP socket with
    unread input sends a reset, which can destroy the answer before the client reads it."""
    from tokenleap.serve import loading
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"x" * 50_000)
        theirs.shutdown(socket.SHUT_WR)  # (sent everything, then closed its side)
        loading._drain(ours)
        ours.setblocking(False)
        assert ours.recv(1) == b""  # nothing left unread: the client's close comes next
    monkeypatch.setattr(loading, "_LINGER", 0.2)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"GET / HTTP/1.1\r\n\r\n")  # (a client that keeps its side open)
        start = time.monotonic()
        loading._drain(ours)
        assert 0.15 < time.monotonic() - start < 5
    drained = []  # and an answer does it
    monkeypatch.setattr(loading, "_drain", drained.append)
    ours, theirs = socket.socketpair()
    with theirs:
        theirs.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answering = threading.BoundedSemaphore(1)
        answering.acquire()  # (as the responder does before it hands a connection over)
        loading._answer(ours, answering)
        assert drained == [ours] and theirs.recv(65536).startswith(b"HTTP/1.1 503")


def test_a_client_trickling_its_request_is_let_go_at_the_requests_deadline(monkeypatch):
    """The time to send a request is for the whole request, not each read: a byte every 0.1 s does not
    hold an answering thread past it."""
    from tokenleap.serve import loading
    monkeypatch.setattr(loading, "_TIMEOUT", 0.5)
    ours, theirs = socket.socketpair()
    answering = threading.BoundedSemaphore(1)
    answering.acquire()
    answered = threading.Thread(target=loading._answer, args=(ours, answering), daemon=True)
    start = time.monotonic()
    answered.start()
    with theirs:
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n":  # (never the blank line that ends a head)
            if not answered.is_alive():
                break
            with contextlib.suppress(OSError):
                theirs.sendall(bytes([byte]))
            time.sleep(0.1)
    answered.join(10)
    assert not answered.is_alive() and time.monotonic() - start < 2.5


def test_the_loading_responder_answers_a_bounded_number_of_connections_at_once(monkeypatch):
    """Connections that send nothing hold their answering threads; past the bound a connection is
    closed at once (no thread more), and once they are answered the next one is answered again."""
    from tokenleap.cli.serve import listening_socket
    from tokenleap.serve import loading
    monkeypatch.setattr(loading, "_MAX_ANSWERING", 2)
    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    responder = loading.LoadingResponder(sock).start()
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"

    def answer(client) -> bytes:
        reply = b""
        while chunk := client.recv(65536):
            reply += chunk
        return reply
    try:
        slow = [socket.create_connection(("127.0.0.1", port), timeout=4) for _ in range(2)]
        time.sleep(0.3)  # (both accepted, each thread waiting for its request)
        with socket.create_connection(("127.0.0.1", port), timeout=4) as extra:
            assert answer(extra) == b""  # closed unanswered
        for client in slow:
            client.sendall(request)
            assert answer(client).startswith(b"HTTP/1.1 503")
            client.close()
        time.sleep(loading._LINGER + 0.5)  # (their threads end once the clients close, or after the linger)
        with socket.create_connection(("127.0.0.1", port), timeout=4) as again:
            again.sendall(request)
            assert answer(again).startswith(b"HTTP/1.1 503")
    finally:
        responder.stop()
        sock.close()


def test_while_loading_an_allowed_page_can_read_the_503_and_a_proxy_gets_its_apis_form():
    """A page the server allows (--allowed-origins, or this machine's pages by default) gets its CORS
    preflight answered 204 and the 503 with the header that lets it read it; another page's request gets
    the 503 without it. An absolute-form target (a proxy's) is answered in its path's error form."""
    from tokenleap.cli.serve import listening_socket
    from tokenleap.serve.loading import LoadingResponder
    for allowed, page, foreign in (((), "http://localhost:3000", "https://evil.example"),
                                   (("https://app.example",), "https://app.example", "http://localhost:3000")):
        sock = listening_socket("127.0.0.1", 0)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        responder = LoadingResponder(sock, allowed).start()
        try:
            with httpx.Client(timeout=10) as c:
                pre = c.options(url + "/v1/chat/completions", headers={
                    "Origin": page, "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "content-type, authorization"})
                assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == page
                assert "POST" in pre.headers["access-control-allow-methods"].split(", ")
                assert pre.headers["access-control-allow-headers"] == "content-type, authorization"
                read = c.post(url + "/v1/chat/completions", json={}, headers={"Origin": page,
                                                                                 "X-Request-Id": "r-1"})
                assert read.status_code == 503 and read.headers["access-control-allow-origin"] == page
                # the request's id, the client's own, and a page may read it (as the running server's answers)
                assert read.headers["x-request-id"] == "r-1"
                assert read.headers["access-control-expose-headers"] == "x-request-id"
                # (credentials as the running server allows them: with origins named)
                assert read.headers.get("access-control-allow-credentials") == ("true" if allowed else None)
                other = c.post(url + "/v1/chat/completions", json={}, headers={"Origin": foreign})
                assert other.status_code == 503 and "access-control-allow-origin" not in other.headers
                assert other.headers["x-request-id"].startswith("req_")
                assert pre.headers["x-request-id"] != other.headers["x-request-id"]  # (a new one each)
                refused = c.options(url + "/v1/models", headers={"Origin": foreign,
                                                                   "Access-Control-Request-Method": "GET"})
                assert refused.status_code == 503 and "access-control-allow-origin" not in refused.headers
        finally:
            responder.stop()
            sock.close()
    sock = listening_socket("127.0.0.1", 0)
    responder = LoadingResponder(sock).start()
    try:
        with socket.create_connection(sock.getsockname(), timeout=5) as client:
            client.sendall(b"POST http://example.com/api/generate HTTP/1.1\r\nHost: example.com\r\n"
                           b"Content-Length: 2\r\n\r\n{}")
            reply = b""
            while chunk := client.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 503") and reply.endswith(b'{"error": "the model is loading; retry shortly"}')
        import anthropic  # Anthropic's API: its overloaded status, as the running server's busy answer
        url = "http://%s:%d" % sock.getsockname()
        with pytest.raises(anthropic.OverloadedError) as e:
            anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=10).messages.create(
                model="m", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"
        with socket.create_connection(sock.getsockname(), timeout=5) as client:  # a bare line feed in a value
            client.sendall(b"OPTIONS /v1/models HTTP/1.1\r\nOrigin: http://localhost:3000\r\n"
                           b"Access-Control-Request-Method: GET\r\n"
                           b"Access-Control-Request-Headers: content-type\nX-Injected: 1\r\n\r\n")
            reply = b""
            while chunk := client.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 204") and b"X-Injected" not in reply
    finally:
        responder.stop()
        sock.close()


def test_the_loading_responder_hands_its_socket_on_listening():
    """Stopped, the responder leaves the socket listening and in its blocking mode: a connection made
    after ``stop`` waits in the backlog for the real server's accept."""
    from tokenleap.cli.serve import listening_socket
    from tokenleap.serve.loading import LoadingResponder
    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    try:
        responder = LoadingResponder(sock).start()
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 503
        responder.stop()
        assert sock.getblocking()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            conn, _ = sock.accept()
            client.sendall(b"ping")
            assert conn.recv(4) == b"ping"
            conn.close()
    finally:
        sock.close()
