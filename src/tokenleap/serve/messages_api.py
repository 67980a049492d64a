"""Anthropic's Messages API (``POST /v1/messages``, as vLLM and llama.cpp serve it) as a form of the
chat path.

A request becomes a ``ChatRequest``: ``system`` (a string or text blocks) as a system message, each
turn's content blocks as chat messages -- ``text`` blocks joined, an assistant turn's ``tool_use``
blocks as its tool calls, a user turn's ``tool_result`` blocks as tool messages before its text (each
must answer a ``tool_use`` of the turn before, as Anthropic's API checks) -- ``tools`` (``name``,
``description`` and the required ``input_schema``) and ``tool_choice`` (auto, any, tool, none) in the
chat forms, ``stop_sequences`` as stop strings, ``output_config.format`` (a JSON schema; the
beta's ``output_format`` too) as ``response_format``; the sampling fields the chat endpoint takes
(``temperature``, ``top_p``, ``top_k``, ``seed``, penalties) may come as extra body fields. A
conversation that ends with an assistant turn is continued (the reply goes on from that text, as
Anthropic's prefill does). So it runs through the same template, sampling, tool calling and
speculation as /v1/chat/completions.

``MessageWriter`` writes the reply as a Message (``content``: a text block and ``tool_use`` blocks;
``stop_reason``: end_turn, max_tokens, stop_sequence or tool_use) or, streamed, as the API's events
(``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``,
``message_stop``). A thinking model's ``<think>`` block (``reasoning.py``) is a ``thinking`` block
before the text; the request's ``thinking`` (enabled / disabled) reaches the chat template as its
``enable_thinking`` (Qwen3's switch). ``model`` is required, as in Anthropic's API; ``metadata`` is
accepted and unused; images, documents and server tools get a 400 that says so. Consecutive turns of
one role are one turn, as Anthropic's API joins them. Errors on these routes take Anthropic's form
(``anthropic_error``).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from tokenleap.serve.jobs import Job
from tokenleap.serve.protocol import (ChatMessage, ChatRequest, FunctionCall, Int64, JsonSchemaFormat, NamedFunction,
                                      NamedToolChoice, ResponseFormat, ToolCall, ToolDef, _Strict, bad_request)
from tokenleap.serve.reasoning import Reasoning
from tokenleap.serve.reply_stream import ReplyStream
from tokenleap.serve.tool_stream import merged
from tokenleap.serve.tools import ToolPlan, arguments_object, function_tool


class CountTokensRequest(_Strict):  # POST /v1/messages/count_tokens
    model: str  # required, as Anthropic's API has it
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # {"type": "enabled" | "disabled"}: the template's enable_thinking
    # Anthropic's server-side tools and context editing: not run here (refused, as server tools are)
    mcp_servers: list[Any] | None = None
    container: Any = None
    context_management: Any = None


class MessagesRequest(CountTokensRequest):  # POST /v1/messages
    max_tokens: Int64
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    output_config: dict[str, Any] | None = None  # format: {"type": "json_schema", "schema": ...}; effort unused
    output_format: dict[str, Any] | None = None  # the same format, as the structured-outputs beta spelled it
    metadata: dict[str, Any] | None = None  # accepted, unused
    # sampling, as the chat endpoint takes it (Anthropic's clients send these as extra body fields)
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False


_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "ignore_eos", "stream")


def chat_request(req: CountTokensRequest) -> ChatRequest:
    """The chat request that computes ``req``'s reply; a 400 for what this server cannot do."""
    for name in ("mcp_servers", "container", "context_management"):
        if getattr(req, name):
            raise bad_request(f"{name}: this server runs no server-side tools or context editing", name)
    messages = [ChatMessage(role="system", content=_joined(req.system, "system"))] if req.system else []
    if not req.messages:
        raise bad_request("messages: at least one message is required", "messages")
    made: set[str] = set()  # the tool_use ids of the assistant turn before
    for i, turn in _joined_runs(req.messages):
        added = _turn(i, turn)
        if added[-1].role == "assistant":
            made = {call.id for call in added[-1].tool_calls or []}
        else:
            _check_results(i, added, made)
        messages += added
    last = messages[-1]
    prefill = last.role == "assistant" and not last.tool_calls
    fields: dict[str, Any] = {}
    if isinstance(req, MessagesRequest):
        if req.temperature is not None and not 0 <= req.temperature <= 1:  # Anthropic's range
            raise bad_request(f"temperature: range: 0 <= temperature <= 1, got {req.temperature}", "temperature")
        fields = {name: getattr(req, name) for name in _SAMPLING}
        fields.update(max_tokens=req.max_tokens, stop=req.stop_sequences,
                      response_format=_response_format(req))
    kind = (req.thinking or {}).get("type")
    if kind in ("enabled", "disabled"):
        fields["chat_template_kwargs"] = {"enable_thinking": kind == "enabled"}
    single = bool((req.tool_choice or {}).get("disable_parallel_tool_use"))  # at most one call
    return ChatRequest.model_construct(model=req.model, messages=messages, n=1, tools=_tools(req.tools),
                                       tool_choice=_tool_choice(req.tool_choice, req.tools),
                                       continue_final_message=prefill,
                                       parallel_tool_calls=False if single else None,
                                       add_generation_prompt=not prefill, **fields)


def _turn(i: int, turn: dict[str, Any]) -> list[ChatMessage]:
    """One Messages turn as chat messages."""
    role, content = turn.get("role"), turn.get("content")
    if role not in ("user", "assistant"):
        raise bad_request(f"messages.{i}.role must be user or assistant (the system prompt is the system "
                          "parameter)", "messages")
    if role == "user" and not content:  # ("" or no blocks: Anthropic's API refuses both)
        raise bad_request(f"messages.{i}: user messages must have non-empty content", "messages")
    if isinstance(content, str):
        return [ChatMessage(role=role, content=content)]
    if not isinstance(content, list):
        raise bad_request(f"messages.{i}.content must be a string or a list of content blocks", "messages")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"messages.{i}.content.{j}"
        if kind == "text":
            texts.append(_string(block, "text", where))
        elif kind == "tool_use" and role == "assistant":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise bad_request(f"{where}.input must be an object", "messages")
            calls.append(ToolCall(id=_string(block, "id", where), function=FunctionCall(
                name=_string(block, "name", where), arguments=json.dumps(arguments, ensure_ascii=False))))
        elif kind == "tool_result" and role == "user":
            value = block.get("content", "")
            text = value if isinstance(value, str) else _joined(value, f"{where}.content")
            results.append(ChatMessage(role="tool", content=text, tool_call_id=_string(block, "tool_use_id", where)))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # an earlier reply's reasoning: not shown to the model again
        else:
            raise bad_request(f"{where}: blocks of type {kind!r} are not supported in a {role} turn here (text, "
                              "tool_use in assistant turns, tool_result in user turns; images and documents "
                              "cannot be read by this server's models)", "messages")
    if role == "assistant":
        return [ChatMessage(role="assistant", content="".join(texts), tool_calls=calls or None)]
    return results + ([ChatMessage(role="user", content="".join(texts))] if texts or not results else [])


def _joined_runs(turns: list[Any]) -> list[tuple[int, Any]]:
    """(index of its first turn, the turn) for each run of consecutive turns of one role, joined into one
    turn of their content blocks in order, as Anthropic's API joins them (a split assistant reply is one
    turn; tool results may come over several user turns). Turns that do not read as such stay apart, for
    ``_turn`` to refuse."""
    out: list[tuple[int, Any]] = []
    for i, turn in enumerate(turns):
        before = out[-1][1] if out else None
        if (isinstance(turn, dict) and isinstance(before, dict) and turn.get("role") == before.get("role")
                and all(isinstance(t.get("content"), (str, list)) for t in (turn, before))):
            out[-1] = (out[-1][0], {**before, "content": _as_blocks(before["content"]) + _as_blocks(turn["content"])})
        else:
            out.append((i, turn))
    return out


def _as_blocks(content: str | list[Any]) -> list[Any]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _check_results(i: int, added: list[ChatMessage], made: set[str]) -> None:
    """A 400, as Anthropic's API answers, where user turn ``i``'s ``tool_result`` blocks (its ``tool``
    messages, ``added``) answer a ``tool_use`` that the assistant turn just before did not make (``made``:
    its ids)."""
    for message in added:
        if message.role == "tool" and message.tool_call_id not in made:
            raise bad_request(f"messages.{i}: tool_result for tool_use_id {message.tool_call_id!r}, which no "
                              "tool_use block in the previous message has: each tool_result answers a tool_use "
                              "of the assistant turn just before it", "messages")


def _joined(value: Any, where: str) -> str:
    """The text of a string or a list of text blocks."""
    if isinstance(value, str):
        return value
    texts = []
    for j, block in enumerate(value if isinstance(value, list) else [value]):
        if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
            raise bad_request(f"{where}.{j} must be a text block (images and documents are not supported)",
                              where.split(".")[0])
        texts.append(block["text"])
    return "".join(texts)


def _string(block: dict[str, Any], field: str, where: str) -> str:
    value = block.get(field)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{field} must be a string", "messages")
    return value


def _tools(tools: list[dict[str, Any]] | None) -> list[ToolDef] | None:
    out = []
    for i, tool in enumerate(tools or []):
        if tool.get("type", "custom") != "custom" or not isinstance(tool.get("name"), str):
            raise bad_request(f"tools.{i}: only client tools (a name and an input_schema) run here; this server "
                              "hosts no server tools", "tools")
        if not isinstance(tool.get("input_schema"), dict):  # (required by Anthropic's API, an object schema)
            raise bad_request(f"tools.{i}.input_schema: a JSON schema object is required", "tools")
        out.append(function_tool(f"tools.{i}", {"name": tool["name"], "description": tool.get("description"),
                                                 "parameters": tool.get("input_schema")}))
    return out or None


def _tool_choice(choice: dict[str, Any] | None, tools: list[dict[str, Any]] | None) -> str | NamedToolChoice | None:
    kind = None if choice is None else choice.get("type")
    if kind in (None, "auto", "none"):
        return kind
    if kind in ("any", "tool") and not tools:  # (said in this API's terms, not the chat endpoint's)
        raise bad_request(f"tool_choice {{\"type\": \"{kind}\"}} needs tools", "tool_choice")
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return NamedToolChoice(type="function", function=NamedFunction(name=choice["name"]))
    raise bad_request("tool_choice must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or "
                      "{\"type\": \"tool\", \"name\": ...}", "tool_choice")


def _response_format(req: MessagesRequest) -> ResponseFormat | None:
    """``output_config.format`` (a JSON schema the reply must follow; ``output_format`` in the beta that
    introduced it) as the chat's response_format."""
    fmt = (req.output_config or {}).get("format")
    if req.output_format is not None:
        if fmt is not None:
            raise bad_request("give the format once: output_config.format or output_format, not both", "output_format")
        fmt = req.output_format
    if fmt is None:
        return None
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict)):
        name = "output_format" if req.output_format is not None else "output_config.format"
        raise bad_request(f"{name} must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}", name.split(".")[0])
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat.model_validate({"schema": fmt["schema"]}))


class MessageWriter:
    """One reply's Message object and stream events (``tools``: the request's tool plan, whose calls
    become ``tool_use`` blocks; ``reasoning``: how a thinking model's block is split off, as a
    ``thinking`` block before the text)."""

    def __init__(self, model: str, tools: ToolPlan, reasoning: Reasoning | None = None) -> None:
        self.id, self.model, self.tools, self.reasoning = "msg_" + uuid.uuid4().hex, model, tools, reasoning

    def final(self, text: str, finish_reason: str | None, stop: int | str | None,
              usage: dict[str, Any]) -> dict[str, Any]:
        thought = None
        if self.reasoning is not None:
            thought, text = self.reasoning.split(text)
        content, calls = (self.tools.calls(text) if self.tools.parse
                          else (text, []))
        blocks = [_thinking_block(thought)] if thought and self.reasoning.include else []
        blocks += [_text_block(content or "")] if content or not (calls or blocks) else []
        return self._obj(blocks + [_tool_use(c) for c in calls], *_stop(finish_reason, stop, calls),
                         _usage(usage))

    async def events(self, job: Job) -> AsyncIterator[str]:
        """The stream of ``job``'s reply: its thinking block and its text block as the text comes (held
        back from where a tool call may begin), then a block a call, its input's JSON as the model
        writes it; an ``error`` event if it fails.
        ``message_start`` waits for the first output: the prompt tokens read from the prefix cache are
        known once the request has started, so its usage says what the final one says."""
        split = ReplyStream(self.reasoning, self.tools)
        blocks, calls, reason, started = _Blocks(), [], None, False
        async for i, out in job.outputs():
            if not started:
                started = True
                yield _event("message_start", message=self._obj([], None, None,
                                                                {**_usage(job.usage()), "output_tokens": 0}))
                yield _event("ping")
            if out.error:
                body = anthropic_error(out.error_status, f"the request failed: {out.error}")
                yield _event("error", error=body["error"])
                return
            piece, _ = job.piece(i, out)
            reason = out.finish_reason or reason
            thought, piece, parts, calls = split.feed(piece, out.finish_reason is not None)
            if thought:
                yield blocks.delta(_thinking_block(""), {"type": "thinking_delta", "thinking": thought})
            if piece:
                yield blocks.delta(_text_block(""), {"type": "text_delta", "text": piece})
            for part in merged(parts):  # a call's block opens with its name; its input's JSON follows as written
                text = part.arguments
                if part.whole:  # (the call came whole at the end: its input as the object the block has)
                    text = json.dumps(arguments_object({"function": {"arguments": text}}), ensure_ascii=False)
                delta = {"type": "input_json_delta", "partial_json": text} if text else None
                if part.name is not None:
                    yield blocks.delta({"type": "tool_use", "id": _tool_use_id(part.id), "name": part.name,
                                        "input": {}}, delta)
                elif delta is not None:
                    yield blocks.more(delta)
        if not blocks.count and not calls:  # an empty reply still has its (empty) text block
            yield blocks.delta(_text_block(""), None)
        yield blocks.close()
        stop_reason, stop_sequence = _stop(reason, job.stop_reason(0), calls)
        yield _event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                     usage=_usage(job.usage()))
        yield _event("message_stop")

    def _obj(self, content: list[dict[str, Any]], stop_reason: str | None, stop_sequence: str | None,
             usage: dict[str, Any] | None) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


class _Blocks:
    """A streamed message's content blocks: a delta goes to the open block of its kind, or opens the
    next one (closing the one before)."""

    def __init__(self) -> None:
        self.count, self.open = 0, None  # blocks opened; the open block's type

    def delta(self, start: dict[str, Any], delta: dict[str, Any] | None) -> str:
        events = ""
        if self.open != start["type"] or start["type"] == "tool_use":
            events = self.close() + _event("content_block_start", index=self.count, content_block=start)
            self.count, self.open = self.count + 1, start["type"]
        if delta is not None:
            events += self.more(delta)
        return events

    def more(self, delta: dict[str, Any]) -> str:
        """A delta for the open block."""
        return _event("content_block_delta", index=self.count - 1, delta=delta)

    def close(self) -> str:
        if self.open is None:
            return ""
        self.open = None
        return _event("content_block_stop", index=self.count - 1)


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


def _text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _thinking_block(thinking: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": thinking, "signature": ""}  # (no signature: nothing to verify here)


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call (``tools.parse_tool_calls``) as a tool_use block."""
    return {"type": "tool_use", "id": _tool_use_id(call["id"]), "name": call["function"]["name"],
            "input": arguments_object(call)}


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _stop(finish_reason: str | None, stop: int | str | None, calls: list) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a reply that ended with ``finish_reason``; ``stop``: the stop
    string or token that ended it (``Job.stop_reason``)."""
    if calls:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """The chat usage in Anthropic's names: input tokens not read from the prefix cache, and those read."""
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"] - cached, "output_tokens": chat_usage["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for an HTTP status."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "invalid_request_error" if status < 500
                                                                 else "api_error"), "message": message}}
