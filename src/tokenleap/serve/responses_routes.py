"""The Responses API's routes: ``POST /v1/responses`` (a reply, over the chat path; stored unless
``store`` is false; ``background``: answered at once, see ``responses_background.py``), ``GET`` and
``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items`` and
``POST /v1/responses/{id}/cancel`` (a background response still running).

A request with ``previous_response_id`` continues the stored response's conversation: its earlier
turns, its input and its reply come before the new input (the earlier ``instructions`` do not, as
with OpenAI). An id the store does not hold (never stored, deleted, or dropped as the least recently
used past ``--responses-store``) is a 404 that says so.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from tokenleap.serve.context_window import check_max_tokens, fit_turns, truncate_prompt
from tokenleap.serve.chat_render import chat_messages, chat_options
from tokenleap.serve.protocol import APIError, ResponsesRequest, bad_request
from tokenleap.serve.body import parse_body
from tokenleap.serve.response_store import ResponseStore, StoredResponse, page
from tokenleap.serve.responses_background import BackgroundResponses
from tokenleap.serve.responses import Format, new_id, now
from tokenleap.serve.responses_api import ResponseWriter
from tokenleap.serve.responses_input import chat_request, input_items, logprobs_wanted, reply_messages
from tokenleap.serve.tools import reply_grammar


class ResponsesRoutes:
    """The routes above for ``server`` (an ``app.OpenAIServer``: its checks, encoding, jobs and
    ``response_store``, read at each request: replicas swap in one they share)."""

    def __init__(self, server) -> None:
        self.server = server
        self.background = BackgroundResponses()

    @property
    def store(self) -> ResponseStore:
        return self.server.response_store

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route("/v1/responses", self.create, methods=["POST"])
        app.add_api_route("/v1/responses/{response_id}", self.retrieve, methods=["GET"])
        app.add_api_route("/v1/responses/{response_id}", self.delete, methods=["DELETE"])
        app.add_api_route("/v1/responses/{response_id}/input_items", self.list_input_items, methods=["GET"])
        app.add_api_route("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"])

    async def create(self, request: HTTPRequest) -> Response:
        """One reply to the request's input, after its ``previous_response_id``'s conversation."""
        server = self.server
        server._auth(request)
        req = parse_body(await request.body(), ResponsesRequest)
        earlier = []
        if req.previous_response_id is not None:
            before = await self._stored(req.previous_response_id, "previous_response_id")
            if before.response.get("status") == "in_progress":
                raise bad_request("previous_response_id names a background response still running: wait for "
                                  "it to end", "previous_response_id")
            earlier = before.messages
        chat = chat_request(req, earlier)
        server._check(chat)
        tools = server._plan_tools(chat)
        options = chat_options(chat)

        def encode() -> list[int]:
            messages, ids = chat_messages(chat), None
            if req.truncation == "auto":  # the oldest turns go first (as OpenAI's), then any token cut asked for
                messages, ids = fit_turns(messages, lambda ms: server.prompts.encode_chat(ms, tools, options),
                                          server.engine.max_len - (req.max_output_tokens or 1))
            ids = ids if ids is not None else server.prompts.encode_chat(messages, tools, options)
            return truncate_prompt(ids, req.truncate_prompt_tokens, server.engine.max_len)
        prompt = await server.off_loop(encode)
        budget = check_max_tokens(req.max_output_tokens, len(prompt), server.engine.max_len, None,
                                  "max_output_tokens", "input")
        logprobs = logprobs_wanted(req)
        rid = new_id("resp")
        keep = None
        if req.background and (req.store is False or self.store.capacity == 0):
            raise bad_request("a background response must be stored: leave store unset or true (and run the "
                              "server with --responses-store above 0)", "background")
        if req.background and req.stream:
            raise bad_request("background responses are not streamed here: send stream false and poll "
                              "GET /v1/responses/{id}", "stream")
        if req.store is not False and self.store.capacity > 0:
            items = input_items(req.input)
            # the earlier turns' messages are the stored ones themselves, shared with the entries before
            # (a copy each would grow a long chain's store with the square of its turns)
            new_turns = chat.messages[(1 if req.instructions else 0) + len(earlier):]
            history = list(earlier) + [m.model_dump(exclude_none=True) for m in new_turns]

            async def keep(obj: dict[str, Any]) -> None:
                await self.store.put(rid, StoredResponse(obj, items, history + reply_messages(obj["output"])))

        writer = ResponseWriter(rid, server.cfg.model_name, now(), req, tools,
                                server._token_text(logprobs is not None), keep, server._reasoning(chat, prompt))
        job = await server._start(chat, [prompt], [budget], reply_grammar(tools, chat), logprobs)
        fmt = Format(writer.id, "response", server.cfg.model_name, writer.created, chat=True)
        if req.background:
            pending = writer.pending()
            await keep(pending)

            async def keep_unless_deleted(obj: dict[str, Any]) -> None:
                # deleted while it ran -- by another replica, which cannot stop it here -- it stays deleted
                if await self.store.get(rid) is not None:
                    await keep(obj)
            self.background.start(job, writer, keep_unless_deleted, lambda: server._log(job, fmt))
            return JSONResponse(pending)

        async def final(texts, reasons, scored) -> dict[str, Any]:
            obj = writer.final(texts[0], reasons[0], job.usage(), scored[0])
            if keep is not None:
                await keep(obj)
            return obj
        return await server._answer(request, job, fmt, bool(req.stream), writer.events(job), final)

    async def retrieve(self, response_id: str, request: HTTPRequest) -> dict[str, Any]:
        self.server._auth(request)
        return (await self._stored(response_id)).response

    async def delete(self, response_id: str, request: HTTPRequest) -> dict[str, Any]:
        self.server._auth(request)
        await self.background.cancel(response_id)  # a background response still running stops first
        if not await self.store.delete(response_id):
            raise self._missing(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def list_input_items(self, response_id: str, request: HTTPRequest) -> dict[str, Any]:
        """The response's input items, newest first by default, as OpenAI pages them (query: ``limit``,
        ``order``, ``after``)."""
        self.server._auth(request)
        query = request.query_params
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            raise bad_request(f"limit must be an integer in [1, 100], got {query['limit']!r}", "limit") from None
        return page((await self._stored(response_id)).input_items, limit, query.get("order", "desc"),
                    query.get("after"))

    async def cancel(self, response_id: str, request: HTTPRequest) -> dict[str, Any]:
        """Stop a background response still running here (it is stored ``cancelled``)."""
        self.server._auth(request)
        if await self.background.cancel(response_id):
            return (await self._stored(response_id)).response
        entry = await self._stored(response_id)
        if entry.response.get("status") == "in_progress":
            raise APIError(409, "this background response runs in another process of this server (a replica); "
                                "send the cancel again to reach it", "invalid_request_error", "response_id")
        raise bad_request("only a background response still running can be cancelled; this one has ended "
                          f"({entry.response.get('status')})", "response_id")

    async def _stored(self, response_id: str, param: str = "response_id") -> StoredResponse:
        entry = await self.store.get(response_id)
        if entry is None:
            raise self._missing(response_id, param)
        return entry

    def _missing(self, response_id: str, param: str = "response_id") -> APIError:
        return APIError(404, f"no stored response has the id {response_id!r} (this server keeps the last "
                             f"{self.store.capacity} responses in memory, those sent with store not false)",
                        "invalid_request_error", param, "response_not_found")
