"""The base of the server's own ASGI middlewares: each sees HTTP requests (``handle``), and anything else
(the lifespan, websockets) passes through untouched."""
from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class HTTPMiddleware:
    """An ASGI middleware that sees HTTP requests (``handle``) and passes anything else through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError
