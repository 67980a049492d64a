"""The server's error bodies: every failure answers with OpenAI's error object -- an ``APIError``
as raised, Starlette's own HTTP errors (404, 405) in the same form, a client that left before
sending its whole body as 499 (logged, nothing sent), anything else as a logged 500."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tokenleap.serve.protocol import APIError

log = logging.getLogger("tokenleap.serve")


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientDisconnect, _client_disconnect)
    app.add_exception_handler(Exception, _internal_error)


async def _api_error(_: HTTPRequest, exc: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status == 503 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _http_error(_: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(APIError(exc.status_code, str(exc.detail), kind).body(), status_code=exc.status_code)


async def _client_disconnect(request: HTTPRequest, _: ClientDisconnect) -> Response:
    log.info("client disconnected before sending its whole request (%s %s)", request.method, request.url.path)
    return Response(status_code=499)


async def _internal_error(_: HTTPRequest, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return JSONResponse(APIError(500, "internal server error", "server_error").body(), status_code=500)
