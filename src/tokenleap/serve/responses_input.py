"""A Responses API request (``POST /v1/responses``) as the chat request that computes its reply, and
the conversation items it and its reply leave for a later ``previous_response_id``.

A request becomes a ``ChatRequest``: ``instructions`` as a system message before the ``input``
items, ``text.format`` as ``response_format``, function ``tools`` and ``tool_choice`` in the chat
forms, so it runs through the same template, sampling, structured output, tool calling and
speculation as /v1/chat/completions (``max_output_tokens`` is the reply's budget, set by the routes).

Supported: ``input`` as a string or a list of items -- messages (roles user, system, developer,
assistant; content a string or ``input_text`` / ``output_text`` parts), ``function_call`` and
``function_call_output`` items (an earlier turn's calls and their results; an output whose
``call_id`` no call before it has is a 400, as OpenAI's) -- ``instructions``,
``max_output_tokens``, ``temperature``, ``top_p``, ``text.format`` (text, json_object,
json_schema), function ``tools`` with ``tool_choice``, ``stream``, ``metadata``,
``include: ["message.output_text.logprobs"]`` with ``top_logprobs``, and the chat endpoint's
sampling extras (``top_k``, ``seed``, ``stop``, penalties, ``logit_bias``), ``previous_response_id``
(the routes look the earlier conversation up in the response store and pass it in as ``earlier``),
and ``truncation: "auto"`` (the routes drop the oldest turns that do not fit,
``context_window.fit_turns``). This server hosts no tools and resolves no item references, so
those get a 400 that says so; ``reasoning`` items (this server writes none) are skipped.
"""
from __future__ import annotations

from typing import Any

from tokenleap.config import MAX_LOGPROBS
from tokenleap.serve.protocol import (ChatMessage, ChatRequest, FunctionCall, JsonSchemaFormat, NamedFunction,
                                      NamedToolChoice, ResponseFormat, ResponsesRequest, TextConfig, ToolCall, ToolDef,
                                      bad_request, sampling_fields)
from tokenleap.serve.responses import new_id
from tokenleap.serve.tools import function_tool

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
    _check_outputs(messages)
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


def _check_outputs(messages: list[ChatMessage]) -> None:
    """A 400, as OpenAI's API answers, for a function_call_output whose call_id no function_call
    before it (in the input or the previous response's conversation) has."""
    made: set[str] = set()
    for m in messages:
        made.update(call.id for call in m.tool_calls or [])
        if m.role == "tool" and m.tool_call_id not in made:
            raise bad_request(f"No tool call found for function call output with call_id {m.tool_call_id}: a "
                              "function_call_output answers a function_call that comes before it", "input")


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
