"""A chat request as the chat template takes it: its messages (``chat_messages``) and the template's
options (``chat_options``)."""
from __future__ import annotations

import json
from typing import Any

from tokenleap.serve.protocol import ChatRequest, ToolCall, _ROLES, bad_request


def chat_messages(req: ChatRequest) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it: an assistant turn's tool calls with their
    arguments parsed (templates write them as JSON objects), a tool turn's ``tool_call_id``, a
    message's ``name`` and an assistant turn's ``reasoning_content`` where given."""
    if not req.messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in _ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(_ROLES)}", "messages")
        if m.content is None and m.role != "assistant":  # (an assistant turn may be its tool calls alone)
            raise bad_request(f"messages[{i}].content is required in a {m.role} message (null is for an "
                              "assistant message that calls tools)", "messages")
        # text parts joined by new lines, as vLLM renders them for templates that take a string
        content = m.content if isinstance(m.content, str) or m.content is None else \
            "\n".join(p.text for p in m.content)
        message: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(f"messages[{i}]: only assistant messages carry tool_calls", "messages")
            message["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        if m.role == "tool" and not m.tool_call_id:
            raise bad_request(f"messages[{i}]: a tool message needs the tool_call_id of the call it answers",
                              "messages")
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        for key in ("name", "reasoning_content"):  # (as vLLM passes them: templates may use them)
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        out.append(message)
    return out


_TEMPLATE_RESERVED = ("messages", "tools", "add_generation_prompt", "continue_final_message", "reply_prefix")


def chat_options(req: ChatRequest) -> dict[str, Any]:
    """How the chat template renders ``req``: its chat_template_kwargs (and ``documents`` and
    ``reasoning_effort``, as vLLM passes them), whether the reply starts a new assistant turn
    (add_generation_prompt) or continues the final assistant message. A request's
    own ``chat_template`` is refused: templates are code, and the model's renders the conversation."""
    if req.chat_template is not None:
        raise bad_request("a request's own chat_template is not run; the model's template renders the "
                          "conversation", "chat_template")
    kwargs = dict(req.chat_template_kwargs or {})
    clash = [k for k in kwargs if k in _TEMPLATE_RESERVED]
    # vLLM's documents and OpenAI's reasoning_effort are template variables too (chat_template_kwargs first)
    kwargs = {**{k: v for k in ("documents", "reasoning_effort") if (v := getattr(req, k, None)) is not None},
              **kwargs}
    if clash:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(clash)}", "chat_template_kwargs")
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                              "continue_final_message")
        if req.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs a final assistant message to continue",
                              "continue_final_message")
        return {**kwargs, "add_generation_prompt": False, "continue_final_message": True}
    return {**kwargs, "add_generation_prompt": req.add_generation_prompt is not False}


def _template_call(call: ToolCall) -> dict[str, Any]:
    """A call as templates take it: its arguments an object -- or, where an earlier reply's arguments
    were not valid JSON (OpenAI takes such history as sent), the text as it was."""
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except ValueError:
        arguments = call.function.arguments
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}
