"""The server's error bodies: every failure answers with OpenAI's error object (Anthropic's on the
Messages API's routes, Ollama's ``{"error": message}`` on its ``/api/`` routes, llama.cpp's -- ``code`` the
HTTP status -- on its ``/completion`` and ``/infill``) -- an ``APIError`` as raised, Starlette's own HTTP
errors (404, 405) in the same form, a client that left before sending its whole body as 499 (logged,
nothing sent), anything else as a logged 500 -- answered by a middleware rather than an exception handler,
because Starlette re-raises after its handler for ``Exception`` answers, and the server then closes the
client's keep-alive connection."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive, Scope, Send

from tokenleap.serve.asgi import HTTPMiddleware
from tokenleap.serve.body import MAX_BODY_BYTES
from tokenleap.serve.llamacpp import PATHS as LLAMACPP_PATHS
from tokenleap.serve.messages_api import anthropic_error
from tokenleap.serve.messages_routes import PATH as MESSAGES_PATH
from tokenleap.serve.ollama_routes import PREFIX as OLLAMA_PREFIX
from tokenleap.serve.protocol import APIError
from tokenleap.serve.request_ids import CURRENT

log = logging.getLogger("tokenleap.serve")
refused_log = logging.getLogger("tokenleap.serve.requests")  # beside the finished requests' lines


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _client_disconnect)
    app.add_middleware(_AnswerUnhandled)
    app.add_middleware(_BodyLimit)


def error_body(path: str, exc: APIError) -> dict:
    """``exc`` as the error object of the API that ``path`` belongs to."""
    if path.startswith(OLLAMA_PREFIX):
        return {"error": exc.message}
    if path.startswith(MESSAGES_PATH):
        return anthropic_error(exc.status, exc.message)
    if path in LLAMACPP_PATHS:
        return exc.llamacpp_body()
    return exc.body()


def _one_line(text: str) -> str:
    """``text`` with its line breaks escaped: a client's words (a model name, a path) cannot forge log lines."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def _response(request: HTTPRequest, exc: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The error answer, and one log line saying what was refused and why (an operator otherwise sees
    nothing of requests that never started: uvicorn's access log is off)."""
    client = request.client
    status = http_status(request.url.path, exc.status)
    refused_log.info("%s %s -> %d (%s) from %s%s: %s", request.method, _one_line(request.url.path), status,
                     exc.code or exc.type, f"{client.host}:{client.port}" if client else "?",
                     f" (x-request-id {CURRENT.get()})" if CURRENT.get() else "", _one_line(exc.message))
    return JSONResponse(error_body(request.url.path, exc), status_code=status, headers=headers)


def http_status(path: str, status: int) -> int:
    """The HTTP status an error of ``status`` is sent with on ``path``: a busy server's 503 is Anthropic's 529
    (``overloaded_error``, which its SDKs raise as ``OverloadedError`` and retry) on the Messages API's routes."""
    return 529 if status == 503 and path.startswith(MESSAGES_PATH) else status


async def _api_error(request: HTTPRequest, exc: APIError) -> JSONResponse:
    return _response(request, exc, {"Retry-After": "1"} if exc.status == 503 else None)


async def _http_error(request: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    return _response(request, APIError(exc.status_code, str(exc.detail), kind))


async def _client_disconnect(request: HTTPRequest, _: ClientDisconnect) -> Response:
    log.info("client disconnected before sending its whole request (%s %s)", request.method, request.url.path)
    return Response(status_code=499)


class _AnswerUnhandled(HTTPMiddleware):
    """An error no handler took: logged, and a 500 sent if the response has not started (a stream
    cut mid-way has nothing left to answer with, so the error goes on to close the connection)."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            log.exception("unhandled error", exc_info=exc)
            request = HTTPRequest(scope)
            await _response(request, APIError(500, "internal server error", "server_error"))(scope, receive, send)


def _too_large() -> APIError:
    return APIError(413, f"request body over {MAX_BODY_BYTES} bytes", "invalid_request_error")


class _BodyLimit(HTTPMiddleware):
    """A request body over ``MAX_BODY_BYTES`` is refused (413) as soon as that is known: by its
    Content-Length before any of it is read, else as its chunks arrive -- never after holding it all."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            await _response(HTTPRequest(scope), _too_large())(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > MAX_BODY_BYTES:
                    raise _too_large()  # (out of the route's body read: answered by the APIError handler)
            return message

        await self.app(scope, counted, send)
