"""One HTTP request, carried as plain data, run through an ASGI app in-process.

The replicas of ``tokenleap serve --replicas`` run the single-process server's FastAPI app
unchanged; the ingress forwards each HTTP request to a replica as an ``HTTPCall`` and relays
what ``run_asgi`` yields (the response's status and headers, then its body pieces as the app
sends them, so a streamed response stays streamed). Nothing here depends on Ray.

Disconnects map both ways: when the consumer stops iterating (the client went away, the
ingress cancelled the call), the app's ``receive`` returns ``http.disconnect``, which is how the
server notices a gone client and cancels its sequences.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

# headers that describe one hop's connection, not the request or the response
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                         "upgrade", "host", "content-length"})


@dataclass(frozen=True)
class HTTPCall:
    """An HTTP request as data: what a replica needs to run it through its app."""

    method: str
    path: str  # starts with "/"
    query: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()  # lower-case names, hop-by-hop headers left out
    body: bytes = b""


@dataclass(frozen=True)
class ResponseStart:
    """The first thing ``run_asgi`` yields; ``replica``: who answers (set by the replica)."""

    status: int
    headers: tuple[tuple[str, str], ...]
    replica: str = ""

    @property
    def streamed(self) -> bool:
        """A body sent as it is made: server-sent events, or Ollama's stream of JSON lines."""
        return any(k == "content-type" and v.startswith(("text/event-stream", "application/x-ndjson"))
                   for k, v in self.headers)


def forwarded_headers(raw: list[tuple[bytes, bytes]] | tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """Headers worth carrying across a hop (names lower-cased, hop-by-hop ones dropped)."""
    out = []
    for k, v in raw:
        k = (k.decode("latin-1") if isinstance(k, bytes) else k).lower()
        if k not in HOP_HEADERS:
            out.append((k, v.decode("latin-1") if isinstance(v, bytes) else v))
    return tuple(out)


def _scope(call: HTTPCall) -> dict[str, Any]:
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in call.headers]
    headers.append((b"content-length", str(len(call.body)).encode()))
    # spec_version 2.3: Starlette's StreamingResponse then watches receive() for the disconnect
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": call.method, "scheme": "http", "path": call.path, "raw_path": call.path.encode(),
            "root_path": "", "query_string": call.query, "headers": headers, "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 80), "state": {}}


async def run_asgi(app, call: HTTPCall) -> AsyncIterator[ResponseStart | bytes]:
    """Run ``call`` through the ASGI ``app``: yields a ``ResponseStart``, then the body's non-empty
    pieces. Stopping the iteration (``aclose``, cancellation) tells the app the client left."""
    sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict[str, Any]:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if gone.is_set():
            raise OSError("the client went away")
        await sent.put(message)

    task = asyncio.ensure_future(app(_scope(call), receive, send))
    started, get = False, None
    try:
        while True:
            get = asyncio.ensure_future(sent.get())
            await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():  # the app returned (or raised) with nothing more to send
                get.cancel()
                task.result()  # re-raises the app's error
                if not started:
                    raise RuntimeError("the app returned without a response")
                return
            message = get.result()
            if message["type"] == "http.response.start":
                started = True
                yield ResponseStart(message["status"], forwarded_headers(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        if get is not None and not get.done():  # (closed while waiting: the queue read would be left pending)
            get.cancel()
        if not task.done():  # give the app a moment to see the disconnect and clean up, then stop it
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), 1.0)
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
