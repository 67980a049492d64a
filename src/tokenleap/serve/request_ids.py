"""Every answer of the server carries an ``x-request-id`` header (the 503s sent while the model loads
too: ``loading.py`` asks ``given_or_new`` for theirs), as OpenAI's API sends one (its SDK reads it into
a response's ``_request_id``): the client's own ``X-Request-Id`` where it sent a usable
one (vLLM's ``--enable-request-id-headers`` echoes it likewise), else a new id. The request's log line
and a refused request's carry it too (``CURRENT``): one id to quote from a log or a bug report."""
from __future__ import annotations

import re
import uuid
from contextvars import ContextVar

from fastapi import FastAPI
from starlette.types import Message, Receive, Scope, Send

from tokenleap.serve.asgi import HTTPMiddleware

HEADER = b"x-request-id"
_USABLE = re.compile(rb"[A-Za-z0-9._:\-]{1,128}")  # (a client's id goes back as is only when it cannot forge headers)
CURRENT: ContextVar[str | None] = ContextVar("x_request_id", default=None)  # the id of the request being answered


def add_request_ids(app: FastAPI) -> None:
    app.add_middleware(_RequestIds)


def request_id(scope: Scope) -> str:
    """The id of the request ``scope`` describes: its client's, if usable, else a new one."""
    return given_or_new(dict(scope.get("headers") or []).get(HEADER, b""))


def given_or_new(given: bytes) -> str:
    """A client's ``X-Request-Id`` value ``given`` if usable (empty: none sent), else a new id."""
    return given.decode() if _USABLE.fullmatch(given) else f"req_{uuid.uuid4().hex}"


class _RequestIds(HTTPMiddleware):
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        text = request_id(scope)
        rid = text.encode()

        async def with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": headers + [(HEADER, rid)]}
            await send(message)

        token = CURRENT.set(text)  # (the tasks the request starts, a stream's among them, see it too)
        try:
            await self.app(scope, receive, with_id)
        finally:
            CURRENT.reset(token)
