"""The server's answer while its model loads: 503 "the model is loading" on every path.

``tokenleap serve`` listens before it builds the engine, so a busy port fails at once and a client (a
readiness probe, ``curl --retry``, a script polling ``/health``) gets an HTTP answer it can retry on
instead of "connection refused" -- as llama.cpp's server does. Each connection is read up to its
headers (and a declared body, unless the client waits for a 100 Continue first), answered with the
error object of the API its path belongs to and closed once the client has read it or a moment has
passed (closing with unread input resets a connection, which can lose the answer). Once the engine
is built the responder stops and hands the listening socket, its queued connections included, to
the real server.
"""
from __future__ import annotations

import contextlib
import json
import selectors
import socket
import threading
import time

MESSAGE = "the model is loading; retry shortly"
_MAX_HEAD = 64 * 1024  # bytes of request line and headers read at most
_MAX_DRAIN = 1 << 20  # bytes of a declared body read before answering; a larger one is answered unread
_TIMEOUT = 5.0  # seconds a connection may take to send its request
_LINGER = 1.0  # seconds an answered connection's leftover input is read before closing
_MAX_ANSWERING = 64  # connections answered at once; one past them is closed unanswered (a client retries)


def loading_body(path: str) -> bytes:
    """The 503 body for a request to ``path``: the same error objects the running server sends."""
    from tokenleap.serve.error_handlers import error_body
    from tokenleap.serve.protocol import APIError
    return json.dumps(error_body(path, APIError(503, MESSAGE, "unavailable_error", None, "model_loading"))).encode()


def _answer(conn: socket.socket, done: threading.Semaphore) -> None:
    """Read one request's head (and its body up to ``_MAX_DRAIN``) and answer it 503; then release ``done``."""
    try:
        conn.settimeout(_TIMEOUT)
        data = b""
        while b"\r\n\r\n" not in data and len(data) < _MAX_HEAD:
            chunk = conn.recv(4096)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        method, path = (parts[0], parts[1].split("?")[0]) if len(parts) >= 2 else ("GET", "/")
        length, waits = 0, False
        for line in lines[1:]:
            name, _, value = (part.strip().lower() for part in line.partition(":"))
            if name == "content-length" and value.isdigit():
                length = int(value)
            waits |= name == "expect" and value == "100-continue"  # the body comes only after a 100: answer now
        if length <= _MAX_DRAIN and not waits:
            while len(body) < length:
                chunk = conn.recv(min(65536, length - len(body)))
                if not chunk:
                    break
                body += chunk
        payload = loading_body(path)
        header = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(payload)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
        conn.sendall(header if method == "HEAD" else header + payload)
        conn.shutdown(socket.SHUT_WR)
        _drain(conn)
    except OSError:  # the client left or stalled: nothing to answer
        pass
    finally:
        conn.close()
        done.release()


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

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
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
                threading.Thread(target=_answer, args=(conn, self._answering), name="tokenleap-loading-answer",
                                 daemon=True).start()
