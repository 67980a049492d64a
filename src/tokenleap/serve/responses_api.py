"""OpenAI's Responses API (``POST /v1/responses``) as a form of the chat path.

A request becomes a ``ChatRequest`` (``instructions`` as a system message before the ``input``
items; ``text.format`` as ``response_format``; function ``tools`` and ``tool_choice`` in the chat
forms; ``max_output_tokens`` as the reply's budget), so it runs through the same template, sampling,
structured output, tool calling and speculation as /v1/chat/completions. ``ResponseWriter`` writes
the reply as a Response object or, streamed, as the API's typed events (``response.created`` ...
``response.output_text.delta`` ... ``response.completed``, or ``response.incomplete`` when the
budget ran out); the calls a reply makes are ``function_call`` output items.

Supported: ``input`` as a string or a list of items -- messages (roles user, system, developer,
assistant; content a string or ``input_text`` / ``output_text`` parts), ``function_call`` and
``function_call_output`` items (an earlier turn's calls and their results) -- ``instructions``,
``max_output_tokens``, ``temperature``, ``top_p``, ``text.format`` (text, json_object,
json_schema), function ``tools`` with ``tool_choice``, ``stream``, ``metadata``,
``include: ["message.output_text.logprobs"]`` with ``top_logprobs``, and the chat endpoint's
sampling extras (``top_k``, ``seed``, ``stop``, penalties, ``logit_bias``), and ``previous_response_id``
(the app looks the earlier conversation up in its ``response_store`` and passes it in as
``earlier``), and ``truncation: "auto"`` (the routes drop the oldest turns that do not fit,
``context_window.drop_oldest``). This server hosts no tools and resolves no item references, so those get a 400 that
says so; ``reasoning`` items (this server writes none) are skipped.
"""
from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from tokenleap.config import MAX_LOGPROBS
from tokenleap.serve.jobs import Job
from tokenleap.serve.protocol import (ChatMessage, ChatRequest, FunctionCall, JsonSchemaFormat, NamedFunction,
                                      NamedToolChoice, ResponseFormat, ResponsesRequest, TextConfig, ToolCall, ToolDef,
                                      bad_request, failed, sampling_fields)
from tokenleap.serve.reasoning import Reasoning
from tokenleap.serve.responses import Scored, TokenText, chat_logprobs, new_id
from tokenleap.serve.reply_stream import ReplyStream
from tokenleap.serve.tool_stream import CallPart, merged
from tokenleap.serve.tools import ToolPlan, function_tool

_INPUT_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


def chat_request(req: ResponsesRequest, earlier: list[dict[str, Any]] = ()) -> ChatRequest:
    """The chat request that computes ``req``'s reply (``earlier``: the conversation of its
    ``previous_response_id``, as chat messages); a 400 for what this server cannot do."""
    if req.n != 1:
        raise bad_request("n is not a Responses API parameter: a request has one reply", "n")
    for name in ("conversation", "prompt"):  # (OpenAI keeps these server-side; this server does not)
        if getattr(req, name) is not None:
            raise bad_request(f"{name}: stored conversations and prompts are not kept by this server; send the "
                              "turns in input (or previous_response_id) and the instructions", name)
    if req.truncation not in (None, "auto", "disabled"):
        raise bad_request(f"truncation must be 'auto' or 'disabled', got {req.truncation!r}", "truncation")
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    messages += [ChatMessage.model_validate(m) for m in earlier]
    messages += _input_messages(req.input)
    common = sampling_fields(req)
    fmt = _response_format(req.text)
    if fmt is not None:
        if req.response_format is not None:
            raise bad_request("give text.format or response_format, not both", "text")
        common["response_format"] = fmt
    return ChatRequest.model_construct(**common, messages=messages, tools=_tools(req.tools),
                                       tool_choice=_tool_choice(req.tool_choice),
                                       parallel_tool_calls=req.parallel_tool_calls)


LOGPROBS = "message.output_text.logprobs"
# what OpenAI's include takes: the logprobs are given; the others name outputs of tools this server
# does not run (or encrypted reasoning, which clients ask for with store false) and add nothing
_INCLUDE = (LOGPROBS, "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
            "web_search_call.action.sources", "message.input_image.image_url", "computer_call_output.output.image_url",
            "code_interpreter_call.outputs")


def logprobs_wanted(req: ResponsesRequest) -> int | None:
    """Alternatives a token to report (``top_logprobs``) when ``include`` asks for logprobs, else None;
    a 400 for a value ``include`` does not take."""
    for i, value in enumerate(req.include or []):
        if value not in _INCLUDE:
            raise bad_request(f"include[{i}]: {value!r} is not one of the values include takes "
                              f"({', '.join(_INCLUDE)})", "include")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                          "top_logprobs")
    return (req.top_logprobs or 0) if LOGPROBS in (req.include or []) else None


def _tools(tools: list[dict[str, Any]] | None) -> list[ToolDef] | None:
    out = []
    for i, tool in enumerate(tools or []):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{i}]: only function tools (type function, with a name) run here; this "
                              "server hosts no built-in tools", "tools")
        out.append(function_tool(f"tools[{i}]", {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                                  if tool.get(k) is not None}))
    return out or None


def _tool_choice(choice: str | dict[str, Any] | None) -> str | NamedToolChoice | None:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return NamedToolChoice(type="function", function=NamedFunction(name=choice["name"]))
    raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                      "tool_choice")


def _input_messages(value: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """The input as chat messages: a function_call item joins the assistant turn before it (or opens
    one), a function_call_output item is a tool message."""
    if isinstance(value, str):
        return [ChatMessage(role="user", content=value)]
    if not value:
        raise bad_request("input must be a string or a non-empty list of items", "input")
    out: list[ChatMessage] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(i, item))
        elif kind == "function_call":
            call = ToolCall(id=_text(i, item, "call_id"), function=FunctionCall(
                name=_text(i, item, "name"), arguments=_text(i, item, "arguments")))
            if out and out[-1].role == "assistant":
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _joined(i, output, "output")
            out.append(ChatMessage(role="tool", content=content, tool_call_id=_text(i, item, "call_id")))
        elif kind != "reasoning":
            raise bad_request(f"input[{i}]: items of type {kind!r} are not supported here (messages, "
                              "function_call and function_call_output; for an earlier response's items, "
                              "give its id as previous_response_id)", "input")
    if not out:
        raise bad_request("input holds no message", "input")
    return out


def _message(i: int, item: dict[str, Any]) -> ChatMessage:
    role, content = item.get("role"), item.get("content")
    if role not in _INPUT_ROLES:
        raise bad_request(f"input[{i}].role must be one of {', '.join(_INPUT_ROLES)}", "input")
    if isinstance(content, list):
        content = _joined(i, content, "content")
    elif not isinstance(content, str):
        raise bad_request(f"input[{i}].content must be a string or a list of text parts", "input")
    return ChatMessage(role=role, content=content)


def _joined(i: int, parts: Any, field: str) -> str:
    """The text of a list of text parts."""
    texts = []
    for j, part in enumerate(parts if isinstance(parts, list) else [parts]):
        text = part.get("text") if isinstance(part, dict) and part.get("type") in _TEXT_PARTS else None
        if not isinstance(text, str):
            raise bad_request(f"input[{i}].{field}[{j}] must be a text part (input_text or output_text); "
                              "images, audio and files are not supported", "input")
        texts.append(text)
    return "".join(texts)


def _text(i: int, item: dict[str, Any], field: str) -> str:
    value = item.get(field)
    if not isinstance(value, str):
        raise bad_request(f"input[{i}].{field} must be a string", "input")
    return value


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
                # (text held back where a call may begin is sent later: its logprobs come with the done events)
                yield event("response.output_text.delta", **where(), delta=piece,
                            logprobs=lp if split.calling is None else [])
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
                "tool_choice": req.tool_choice or ("auto" if req.tools else "none"), "tools": req.tools or [],
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


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as the items ``GET /v1/responses/{id}/input_items`` lists: a string as a
    user message, message content as text parts, each item with an id of its own."""
    items = [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value
    out = []
    for item in items:
        item = {"type": "message", **item}
        if item["type"] == "message":
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            if isinstance(item.get("content"), str):
                item["content"] = [{"type": kind, "text": item["content"]}]
            item.setdefault("status", "completed")
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}.get(item["type"], "item")
        item.setdefault("id", new_id(prefix))
        out.append(item)
    return out


def reply_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A Response's output items as the chat turn they continue a conversation with: the message's
    text and the function calls, one assistant message."""
    text = "".join(part.get("text", "") for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
