"""Anthropic's Messages API routes (``messages_api.py``): ``POST /v1/messages`` (a reply, streamed or
not) and ``POST /v1/messages/count_tokens`` (the prompt's length, the conversation rendered with its
tools as a reply would see it). The API key comes as ``x-api-key`` (Anthropic's clients) or as a
bearer token."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import Response

from tokenleap.serve.messages_api import CountTokensRequest, MessagesRequest, MessageWriter, chat_request
from tokenleap.serve.context_window import check_max_tokens
from tokenleap.serve.chat_render import chat_messages, chat_options
from tokenleap.serve.body import parse_body
from tokenleap.serve.responses import Format, now
from tokenleap.serve.tools import reply_grammar

PATH = "/v1/messages"


class MessagesRoutes:
    """The routes above for ``server`` (an ``app.OpenAIServer``: its checks, encoding and jobs)."""

    def __init__(self, server) -> None:
        self.server = server

    def add_to(self, app: FastAPI) -> None:
        app.add_api_route(PATH, self.create, methods=["POST"])
        app.add_api_route(PATH + "/count_tokens", self.count_tokens, methods=["POST"])

    async def create(self, request: HTTPRequest) -> Response:
        server = self.server
        server._auth(request)
        req = parse_body(await request.body(), MessagesRequest)
        chat, tools, prompt = await server.off_loop(lambda: self._prompt(req))
        budget = check_max_tokens(req.max_tokens, len(prompt), server.engine.max_len, None, "max_tokens", "messages")
        writer = MessageWriter(server.cfg.model_name, tools, server._reasoning(chat, prompt))
        job = await server._start(chat, [prompt], [budget], reply_grammar(tools, chat))
        fmt = Format(writer.id, "message", server.cfg.model_name, now(), chat=True)

        async def final(texts, reasons, scored) -> dict[str, Any]:
            return writer.final(texts[0], reasons[0], job.stop_reason(0), job.usage())
        return await server._answer(request, job, fmt, bool(req.stream), writer.events(job), final)

    async def count_tokens(self, request: HTTPRequest) -> dict[str, int]:
        self.server._auth(request)
        req = parse_body(await request.body(), CountTokensRequest)
        _, _, prompt = await self.server.off_loop(lambda: self._prompt(req))
        return {"input_tokens": len(prompt)}

    def _prompt(self, req: CountTokensRequest):
        """(the chat request, its tool plan, the prompt's token ids)."""
        server = self.server
        chat = chat_request(req)
        server._check(chat)
        tools = server._plan_tools(chat)
        return chat, tools, server.prompts.encode_chat(chat_messages(chat), tools, chat_options(chat))
