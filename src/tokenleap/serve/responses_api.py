"""OpenAI's Responses API (``POST /v1/responses``) as a form of the chat path.

A request becomes a ``ChatRequest`` (``instructions`` as a system message before the ``input``
messages; ``text.format`` as ``response_format``; ``max_output_tokens`` as the reply's budget), so it
runs through the same template, sampling, structured output and speculation as
/v1/chat/completions. ``ResponseWriter`` writes the reply as a Response object or, streamed, as the
API's typed events (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``, or ``response.incomplete`` when the budget ran out).

Supported: ``input`` as a string or a list of messages (roles user, system, developer, assistant;
content a string or a list of ``input_text`` / ``output_text`` parts), ``instructions``,
``max_output_tokens``, ``temperature``, ``top_p``, ``text.format`` (text, json_object,
json_schema), ``stream``, ``metadata``, and the chat endpoint's sampling extras (``top_k``,
``seed``, ``stop``, penalties, ``logit_bias``). This server stores nothing and runs no tools, so
``previous_response_id``, ``tools`` and input items other than messages get a 400 that says so.
"""
from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

from tokenleap.serve.jobs import Job
from tokenleap.serve.protocol import (ChatMessage, ChatRequest, JsonSchemaFormat, ResponseFormat, ResponsesRequest,
                                      TextConfig, bad_request, sampling_fields)

_INPUT_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


def chat_request(req: ResponsesRequest) -> ChatRequest:
    """The chat request that computes ``req``'s reply; a 400 for what this server cannot do."""
    if req.previous_response_id is not None:
        raise bad_request("this server stores no responses: send the whole conversation in input",
                          "previous_response_id")
    if req.tools:
        raise bad_request("tools are not supported on /v1/responses here; use /v1/chat/completions "
                          "for tool calls", "tools")
    if req.n != 1:
        raise bad_request("n is not a Responses API parameter: a request has one reply", "n")
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    messages += _input_messages(req.input)
    common = sampling_fields(req)
    fmt = _response_format(req.text)
    if fmt is not None:
        if req.response_format is not None:
            raise bad_request("give text.format or response_format, not both", "text")
        common["response_format"] = fmt
    return ChatRequest.model_construct(**common, messages=messages)


def _input_messages(value: str | list[dict[str, Any]]) -> list[ChatMessage]:
    if isinstance(value, str):
        return [ChatMessage(role="user", content=value)]
    if not value:
        raise bad_request("input must be a string or a non-empty list of messages", "input")
    out = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind != "message":
            raise bad_request(f"input[{i}]: items of type {kind!r} are not supported here (messages only: "
                              "this server runs no tools and stores no responses)", "input")
        role, content = item.get("role"), item.get("content")
        if role not in _INPUT_ROLES:
            raise bad_request(f"input[{i}].role must be one of {', '.join(_INPUT_ROLES)}", "input")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                text = part.get("text") if isinstance(part, dict) and part.get("type") in _TEXT_PARTS else None
                if not isinstance(text, str):
                    raise bad_request(f"input[{i}].content[{j}] must be a text part (input_text or output_text); "
                                      "images, audio and files are not supported", "input")
                texts.append(text)
            content = "".join(texts)
        elif not isinstance(content, str):
            raise bad_request(f"input[{i}].content must be a string or a list of text parts", "input")
        out.append(ChatMessage(role=role, content=content))
    return out


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.schema_ is None:
        raise bad_request("text.format of type json_schema needs a schema", "text")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat.model_validate(
        {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}))


class ResponseWriter:
    """One reply's Response object and stream events (``id``: the response's, ``created``: seconds)."""

    def __init__(self, rid: str, model: str, created: int, req: ResponsesRequest, message_id: str) -> None:
        self.id, self.model, self.created, self.req, self.message_id = rid, model, created, req, message_id

    def final(self, text: str, finish_reason: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        status = _status(finish_reason)
        return self._obj(status, [self._message(text, status)], _usage(usage))

    async def events(self, job: Job) -> AsyncIterator[str]:
        """The stream of ``job``'s reply; ``response.failed`` after an ``error`` event if it fails."""
        counter = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            data = {"type": kind, "sequence_number": next(counter), **fields}
            return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        yield event("response.created", response=self._obj("in_progress", [], None))
        yield event("response.in_progress", response=self._obj("in_progress", [], None))
        yield event("response.output_item.added", output_index=0,
                    item={**self._message("", "in_progress"), "content": []})
        yield event("response.content_part.added", **where, part=_part(""))
        text, reason = "", None
        async for i, out in job.outputs():
            if out.error:
                message = f"the request failed: {out.error}"
                yield event("error", code="server_error", message=message, param=None)
                error = {"code": "server_error", "message": message}
                failed = {**self._obj("failed", [], _usage(job.usage())), "error": error}
                yield event("response.failed", response=failed)
                return
            piece, _ = job.piece(i, out)
            if piece:
                text += piece
                yield event("response.output_text.delta", **where, delta=piece, logprobs=[])
            reason = out.finish_reason or reason
        status = _status(reason)
        yield event("response.output_text.done", **where, text=text, logprobs=[])
        yield event("response.content_part.done", **where, part=_part(text))
        item = self._message(text, status)
        yield event("response.output_item.done", output_index=0, item=item)
        yield event(f"response.{status}", response=self._obj(status, [item], _usage(job.usage())))

    def _message(self, text: str, status: str) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status,
                "content": [_part(text)]}

    def _obj(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "metadata": req.metadata or {}, "parallel_tool_calls": False, "previous_response_id": None,
                "store": False, "temperature": 1.0 if req.temperature is None else req.temperature,
                "top_p": 1.0 if req.top_p is None else req.top_p, "tool_choice": "none", "tools": [],
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
                "usage": usage}


def _status(finish_reason: str | None) -> str:
    """A chat finish reason as a Response status: the budget (or the context) running out is incomplete."""
    return "incomplete" if finish_reason == "length" else "completed"


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """The chat usage object in the Responses API's names."""
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}
