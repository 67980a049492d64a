"""The server's answer while its model loads: 503 "the model is loading" on every path (529, Anthropic's
status, on the Messages API).

``tokenleap serve`` listens before it builds the engine, so a busy port fails at once and a client (a
readiness probe, ``curl --retry``, a script polling ``/health``) gets an HTTP answer it can retry on
instead of "connection refused" -- as llama.cpp's server does. Each connection is read up to its
headers (and a declared body, unless the client waits for a 100 Continue first), answered with the
error object of the API its path belongs to and closed once the client has read it or a moment has
passed (closing with unread input resets a connection, which can lose the answer). A page the server
allows (CORS, as ``serve/origins.py`` decides) may read the answer, and its preflight is answered 204
so that it asks at all. Every answer carries an ``x-request-id``, as the running server's do. Once the
engine is built the responder stops and hands the listening socket, its queued connections included,
to the real server.
"""
from __future__ import annotations

import contextlib
import json
import selectors
import socket
import threading
import time
from urllib.parse import urlsplit

MESSAGE = "the model is loading; retry shortly"
_MAX_HEAD = 64 * 1024  # bytes of request line and headers read at most
_MAX_DRAIN = 1 << 20  # bytes of a declared body read before answering; a larger one is answered unread
_TIMEOUT = 5.0  # seconds a connection may take to send its whole request
_LINGER = 1.0  # seconds an answered connection's leftover input is read before closing
_METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"  # a preflight's answer, as the running server's
_MAX_ANSWERING = 64  # connections answered at once; one past them is closed unanswered (a client retries)


def loading_body(path: str) -> bytes:
    """The 503 body for a request to ``path``: the same error objects the running server sends."""
    from tokenleap.serve.error_handlers import error_body
    from tokenleap.serve.protocol import APIError
    return json.dumps(error_body(path, APIError(503, MESSAGE, "unavailable_error", None, "model_loading"))).encode()


def _answer(conn: socket.socket, done: threading.Semaphore, origins: tuple[str, ...] = ()) -> None:
    """Read one request's head (and its body up to ``_MAX_DRAIN``) and answer it 503 (a CORS preflight
    from an allowed page, 204); then release ``done``. ``origins``: serve's --allowed-origins."""
    deadline = time.monotonic() + _TIMEOUT  # for the whole request, not each read: a trickle ends too
    try:
        data = b""
        while b"\r\n\r\n" not in data and len(data) < _MAX_HEAD:
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
            chunk = conn.recv(4096)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        method, path = (parts[0], parts[1].split("?")[0]) if len(parts) >= 2 else ("GET", "/")
        headers = {name.strip().lower(): value.strip()
                   for name, _, value in (line.partition(":") for line in lines[1:])
                   if value.isprintable()}  # (a value with a bare line feed is never echoed into the answer)
        if "://" in path:  # (an absolute-form target, as a proxy sends: its path says which API)
            path = urlsplit(path).path or "/"
        length = int(headers["content-length"]) if headers.get("content-length", "").isdigit() else 0
        waits = headers.get("expect", "").lower() == "100-continue"  # the body comes only after a 100: answer now
        if length <= _MAX_DRAIN and not waits:
            while len(body) < length:
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                chunk = conn.recv(min(65536, length - len(body)))
                if not chunk:
                    break
                body += chunk
        conn.settimeout(_TIMEOUT)  # (not what the last read left of the request's time)
        conn.sendall(_response(method, path, headers, origins))
        conn.shutdown(socket.SHUT_WR)
        _drain(conn)
    except OSError:  # the client left or stalled: nothing to answer
        pass
    finally:
        conn.close()
        done.release()


def _response(method: str, path: str, headers: dict[str, str], origins: tuple[str, ...]) -> bytes:
    """The answer: 503 (529 on Anthropic's Messages API, as the running server's) with the path's error object;
    a page the server allows (CORS, as the running server decides) gets the headers that let it read that
    answer, and its preflight a 204 that lets it ask."""
    from tokenleap.serve.error_handlers import http_status
    from tokenleap.serve.request_ids import given_or_new
    rid = f"x-request-id: {given_or_new(headers.get('x-request-id', '').encode('latin-1'))}\r\n"
    cors = ""
    origin = headers.get("origin")
    if origin is not None:
        from tokenleap.serve.origins import origin_allowed
        if "*" in origins or origin_allowed(origin, origins):
            # (credentials as the running server allows them: with origins named, not with '*' or by default)
            cors = f"Access-Control-Allow-Origin: {origin}\r\nVary: Origin\r\n" + (
                "Access-Control-Allow-Credentials: true\r\n" if origins and "*" not in origins else "")
    if method == "OPTIONS" and cors and "access-control-request-method" in headers:
        asked = headers.get("access-control-request-headers")
        return ("HTTP/1.1 204 No Content\r\n" + rid + cors
                + f"Access-Control-Allow-Methods: {_METHODS}\r\n"
                + (f"Access-Control-Allow-Headers: {asked}\r\n" if asked else "")
                + "Content-Length: 0\r\nConnection: close\r\n\r\n").encode("latin-1")
    payload = loading_body(path)
    expose = "Access-Control-Expose-Headers: x-request-id\r\n" if cors else ""  # (a page may read the id)
    status = "529 Overloaded" if http_status(path, 503) == 529 else "503 Service Unavailable"  # (Anthropic's)
    header = (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n" + rid + cors + expose
              + f"Content-Length: {len(payload)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode("latin-1")
    return header if method == "HEAD" else header + payload


def _drain(conn: socket.socket) -> None:
    """Read, for a moment, what the client still sends (a body not read, a pipelined request): closing a
    socket with unread data resets the connection, and a reset can lose the answer before it is read."""
    deadline = time.monotonic() + _LINGER
    read = 0
    with contextlib.suppress(OSError):  # (the moment passed, or the client reset: done either way)
        while read < _MAX_DRAIN and (left := deadline - time.monotonic()) > 0:
            conn.settimeout(left)
            chunk = conn.recv(65536)
            if not chunk:  # the client read the answer and closed
                return
            read += len(chunk)


class LoadingResponder:
    """Answers connections on a listening socket with 503 from a background thread until ``stop``;
    the socket stays open (and listening) for the server that follows."""

    def __init__(self, sock: socket.socket, allowed_origins: tuple[str, ...] = ()) -> None:
        self.sock, self.origins = sock, tuple(allowed_origins)
        loading_body("/")  # import the error objects now, not at the first request
        self._stop = threading.Event()
        self._answering = threading.BoundedSemaphore(_MAX_ANSWERING)  # (a thread a connection: a bounded number)
        self._blocking = sock.getblocking()
        self._thread = threading.Thread(target=self._serve, name="tokenleap-loading", daemon=True)

    def start(self) -> LoadingResponder:
        self.sock.setblocking(False)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop answering (a connection already accepted is still answered) and restore the socket."""
        self._stop.set()
        self._thread.join()
        self.sock.setblocking(self._blocking)

    def _serve(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self.sock, selectors.EVENT_READ)
            while not self._stop.is_set():
                if not sel.select(timeout=0.1):
                    continue
                try:
                    conn, _ = self.sock.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:  # the socket was closed under it (a failed load)
                    return
                if not self._answering.acquire(blocking=False):  # many slow clients at once: no thread more
                    conn.close()
                    continue
                conn.setblocking(True)
                try:
                    threading.Thread(target=_answer, args=(conn, self._answering, self.origins),
                                     name="tokenleap-loading-answer", daemon=True).start()
                except RuntimeError:  # (no thread to be had: this connection goes unanswered)
                    conn.close()
                    self._answering.release()
