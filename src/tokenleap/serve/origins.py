"""Which web pages may call the server: CORS headers for the answers they may read, and a refusal
for the requests they may not make.

CORS alone only keeps a page from *reading* an answer. A browser sends a "simple" cross-site
request -- a POST with a ``text/plain`` or form body -- without asking the server first, and the
server parses JSON from any body, so without more every page a user visits could make the server
generate (and fill its queue). A request that can start work (any method but GET, HEAD, OPTIONS)
and carries an ``Origin`` header that is not allowed is therefore refused with a 403 before it
reaches a route, as Ollama does. Clients that are not browsers send no ``Origin`` and are not
affected; ``--allowed-origins '*'`` turns the refusal off, as it opens CORS to every page.
"""
from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenleap.serve.error_handlers import error_body
from tokenleap.serve.protocol import APIError

# pages served from this machine, and desktop apps' own pages (Electron / Tauri apps, VS Code webviews),
# which Ollama allows by default too
LOCAL_ORIGINS = (r"https?://(localhost|127\.0\.0\.1|0\.0\.0\.0|\[::1\])(:[0-9]+)?"
                 r"|(app|file|tauri|vscode-webview|vscode-file)://[^\s]*")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})  # (OPTIONS: CORS preflights, answered by CORS)


def add_origin_checks(app: FastAPI, allowed: tuple[str, ...]) -> None:
    """CORS for ``allowed`` origins ("*": any; none: this machine's pages and desktop apps' only), and
    the refusal of other pages' requests that can start work."""
    if allowed:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed), allow_methods=["*"], allow_headers=["*"],
                           allow_credentials="*" not in allowed, expose_headers=["x-request-id"])
    else:  # a chat page on this machine works out of the box; other sites' pages may not call in
        app.add_middleware(CORSMiddleware, allow_origin_regex=LOCAL_ORIGINS, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id"])
    if "*" not in allowed:
        app.add_middleware(_RefuseForeignOrigins, allowed=allowed)


def origin_allowed(origin: str, allowed: tuple[str, ...]) -> bool:
    """Whether a page at ``origin`` may call (as CORS decides: exact origins, or this machine's pages
    and desktop apps')."""
    return origin in allowed if allowed else re.fullmatch(LOCAL_ORIGINS, origin) is not None


def _own_page(origin: str, host: str) -> bool:
    """Whether ``origin`` is the server itself reached by an IP address (its /docs page on a LAN
    address). A name is not enough: a page whose name was re-pointed at this machine (DNS rebinding)
    would be of the same origin too; such deployments name their origin with --allowed-origins."""
    try:
        parts = urlsplit(origin)
        ipaddress.ip_address(parts.hostname or "")
    except ValueError:  # (a malformed origin, or a name)
        return False
    return parts.netloc == host


class _RefuseForeignOrigins:
    """A 403, in the error form of the API the path belongs to, for a request that can start work
    from a page whose origin is not allowed (the server's own pages reached by an IP address are)."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in SAFE_METHODS:
            headers = {k: v.decode("latin-1") for k, v in scope["headers"] if k in (b"origin", b"host")}
            origin = headers.get(b"origin")
            if origin is not None and not (_own_page(origin, headers.get(b"host", ""))
                                           or origin_allowed(origin, self.allowed)):
                exc = APIError(403, f"requests from pages at {origin} are not allowed here: start the server with "
                                    f"--allowed-origins {origin} (or '*') to allow them", "permission_error")
                await JSONResponse(error_body(scope["path"], exc), status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)
