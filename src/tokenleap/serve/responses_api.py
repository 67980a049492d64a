"""OpenAI's Responses API (``POST /v1/responses``): the reply as a Response object or its stream.

The request runs as a chat request (``responses_input.chat_request``). ``ResponseWriter`` writes
the reply as a Response object or, streamed, as the API's typed events (``response.created`` ...
``response.output_text.delta`` ... ``response.completed``, or ``response.incomplete`` when the
budget ran out); the calls a reply makes are ``function_call`` output items.
"""
from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from tokenleap.serve.jobs import Job
from tokenleap.serve.protocol import ResponsesRequest, failed
from tokenleap.serve.reasoning import Reasoning
from tokenleap.serve.responses import Scored, TokenText, chat_logprobs, new_id
from tokenleap.serve.reply_stream import ReplyStream
from tokenleap.serve.tool_stream import CallPart, merged
from tokenleap.serve.tools import ToolPlan



class ResponseWriter:
    """One reply's Response object and stream events (``id``: the response's, ``created``: seconds;
    ``tools``: the request's tool plan, whose calls become ``function_call`` items; ``tokens``: set
    when the request asked for logprobs; ``keep``: awaited with the finished Response object before
    a stream's last event, when the response is stored)."""

    def __init__(self, rid: str, model: str, created: int, req: ResponsesRequest, tools: ToolPlan,
                 tokens: TokenText | None = None,
                 keep: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
                 reasoning: Reasoning | None = None) -> None:
        self.id, self.model, self.created, self.req, self.tools = rid, model, created, req, tools
        self.tokens, self.keep, self.reasoning = tokens, keep, reasoning
        self.message_id, self.reasoning_id = new_id("msg"), new_id("rs")

    def final(self, text: str, finish_reason: str | None, usage: dict[str, Any],
              scored: list[Scored]) -> dict[str, Any]:
        status = _status(finish_reason)
        thought = None
        if self.reasoning is not None:
            thought, text = self.reasoning.split(text)
        content, calls = (self.tools.calls(text) if self.tools.parse
                          else (text, []))
        items = [self._reasoning_item(thought, "completed")] if thought and self.reasoning.include else []
        if content or not (calls or items):
            items.append(self._message(content or "", status, self._logprobs(scored)))
        return self._obj(status, items + [_call_item(c, "completed") for c in calls], _usage(usage))

    def pending(self) -> dict[str, Any]:
        """The response while it runs in the background: ``in_progress``, no output yet."""
        return self._obj("in_progress", [], None)

    def ended(self, status: str, text: str, error: dict[str, str] | None = None) -> dict[str, Any]:
        """A background response stopped before its end (``cancelled``, or ``failed`` with ``error``):
        the text generated so far, as an incomplete message."""
        obj = self._obj(status, [self._message(text, "incomplete")] if text else [], None)
        obj["error"] = error
        return obj

    def _logprobs(self, scored: list[Scored]) -> list[dict[str, Any]]:
        return chat_logprobs(scored, self.tokens)["content"] if self.tokens else []

    async def events(self, job: Job) -> AsyncIterator[str]:
        """The stream of ``job``'s reply: a thinking model's reasoning item, the message's text as it
        comes (held back from where a tool call may begin), then its calls; ``response.failed`` after
        an ``error`` event if it fails."""
        counter = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            data = {"type": kind, "sequence_number": next(counter), **fields}
            return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

        split = ReplyStream(self.reasoning, self.tools)
        text, thought, reason, calls, logprobs, items = "", "", None, [], [], []
        sent = 0  # logprobs[:sent] have gone out in deltas (or are left to the done events)
        opened = None  # the item being written: "reasoning", "message" (or None)

        def where() -> dict[str, Any]:
            item_id = self.message_id if opened == "message" else self.reasoning_id
            return {"item_id": item_id, "output_index": len(items), "content_index": 0}

        def open_message() -> str:  # the message item, opened when its first text is sent
            return (event("response.output_item.added", output_index=len(items),
                          item={**self._message("", "in_progress"), "content": []})
                    + event("response.content_part.added", **where(), part=_part("")))

        def close_reasoning() -> str:
            at = where()
            items.append(self._reasoning_item(thought, "completed"))
            return (event("response.reasoning_text.done", **at, text=thought)
                    + event("response.output_item.done", output_index=len(items) - 1, item=items[-1]))

        def close_message(status: str) -> str:
            at = where()
            items.append(self._message(text, status, logprobs))
            return (event("response.output_text.done", **at, text=text, logprobs=logprobs)
                    + event("response.content_part.done", **at, part=_part(text, logprobs))
                    + event("response.output_item.done", output_index=len(items) - 1, item=items[-1]))

        writing: list[Any] = []  # the function_call item being written and its arguments so far

        def call_events(part: CallPart) -> str:
            out = ""
            if part.name is not None:
                out = close_call()
                writing[:] = [_call_item({"id": part.id, "function": {"name": part.name}}, "in_progress", ""), ""]
                out += event("response.output_item.added", output_index=len(items), item=writing[0])
            if part.arguments:
                writing[1] += part.arguments
                out += event("response.function_call_arguments.delta", item_id=writing[0]["id"],
                             output_index=len(items), delta=part.arguments)
            return out

        def close_call(status: str = "completed") -> str:
            if not writing:
                return ""
            (item, arguments), at = writing, {"item_id": writing[0]["id"], "output_index": len(items)}
            writing.clear()
            items.append({**item, "status": status, "arguments": arguments})
            return (event("response.function_call_arguments.done", **at, arguments=arguments)
                    + event("response.output_item.done", output_index=len(items) - 1, item=items[-1]))

        yield event("response.created", response=self._obj("in_progress", [], None))
        yield event("response.in_progress", response=self._obj("in_progress", [], None))
        async for i, out in job.outputs():
            if out.error:
                err = failed(out.error, out.error_status)
                yield event("error", code=err.type, message=err.message, param=None)
                error = {"code": err.type, "message": err.message}
                ended = {**self._obj("failed", [], _usage(job.usage())), "error": error}
                yield event("response.failed", response=ended)
                return
            piece, scored = job.piece(i, out)
            reason = out.finish_reason or reason
            lp = self._logprobs(scored)
            logprobs += lp
            more, piece, parts, calls = split.feed(piece, out.finish_reason is not None)
            if more:
                if opened is None:
                    yield event("response.output_item.added", output_index=0,
                                item={**self._reasoning_item("", "in_progress"), "content": []})
                    opened = "reasoning"
                thought += more
                yield event("response.reasoning_text.delta", **where(), delta=more)
            if piece:
                if opened != "message":
                    if opened == "reasoning":
                        yield close_reasoning()
                    opened = "message"
                    yield open_message()
                text += piece
                # a token adding no text (part of a character, the end token) sends its logprobs with the
                # next delta; text held back where a call may begin: its logprobs come with the done events
                unsent, sent = (logprobs[sent:] if split.calling is None else []), len(logprobs)
                yield event("response.output_text.delta", **where(), delta=piece, logprobs=unsent)
            if parts and opened is not None:  # the reasoning or the message ends where the first call begins
                yield close_reasoning() if opened == "reasoning" else close_message("completed")
                opened = None
            for part in merged(parts):
                yield call_events(part)
        status = _status(reason)
        if opened == "reasoning":
            yield close_reasoning()
            opened = None
        if opened == "message" or not (items or writing):
            if opened != "message":
                opened = "message"
                yield open_message()
            if sent < len(logprobs) and split.calling is None:  # the last tokens added no text (the end token)
                yield event("response.output_text.delta", **where(), delta="", logprobs=logprobs[sent:])
            yield close_message(status)
        # a call the reply broke off in (or that did not parse in the end) is incomplete
        yield close_call("completed" if writing and writing[0]["call_id"] in {c["id"] for c in calls}
                         else "incomplete")
        done = self._obj(status, items, _usage(job.usage()))
        if self.keep is not None:
            await self.keep(done)
        yield event(f"response.{status}", response=done)

    def _reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        return {"id": self.reasoning_id, "type": "reasoning", "status": status, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}

    def _message(self, text: str, status: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status,
                "content": [_part(text, logprobs)]}

    def _obj(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id, "store": self.keep is not None,
                "background": bool(req.background), "truncation": req.truncation or "disabled",
                "temperature": 1.0 if req.temperature is None else req.temperature,
                "top_p": 1.0 if req.top_p is None else req.top_p,
                "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
                "usage": usage}


def _call_item(call: dict[str, Any], status: str, arguments: str | None = None) -> dict[str, Any]:
    """A chat tool call (``tools.parse_tool_calls``) as a function_call output item."""
    fn = call["function"]
    return {"id": "fc_" + call["id"].removeprefix("call_"), "type": "function_call", "status": status,
            "call_id": call["id"], "name": fn["name"], "arguments": fn["arguments"] if arguments is None else arguments}


def _status(finish_reason: str | None) -> str:
    """A chat finish reason as a Response status: the budget (or the context) running out is incomplete."""
    return "incomplete" if finish_reason == "length" else "completed"


def _part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """The chat usage object in the Responses API's names."""
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}
