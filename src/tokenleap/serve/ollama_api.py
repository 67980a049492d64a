"""Ollama's API (``POST /api/chat``, ``POST /api/generate``) as forms of the chat and completion paths,
for the many local clients written for Ollama's server (its Python and JavaScript libraries, editor
and notebook plugins, chat front ends). ``ollama_routes.py`` serves them and the model routes.

A chat request becomes a ``ChatRequest``: its messages (``content``; an assistant turn's
``tool_calls``, whose ``arguments`` are objects; a ``tool`` turn's reply, matched to the call it
answers by ``tool_name``), ``tools`` (OpenAI's function form), ``format`` (``"json"``: any JSON
object; a JSON schema: that schema), ``think`` (the chat template's ``enable_thinking``; a thinking
model's block comes back as ``message.thinking``; on for a model that does not think: a 400, as
Ollama's), ``logprobs`` / ``top_logprobs``. A generate request
renders its ``prompt`` (and ``system``) with the chat template unless ``raw`` is true or the model has
no template, continues the token ids of an earlier reply's ``context``, and with a ``suffix`` fills
the gap between the prompt and the suffix (``text/fim.py``'s prompt). Both run through the same
scheduler, sampling and speculation as ``/v1/chat/completions`` and ``/v1/completions``.

``options`` take Ollama's names and defaults where a field is absent: ``temperature`` 0.8,
``top_k`` 40, ``top_p`` 0.9, ``repeat_penalty`` 1.1 over the last ``repeat_last_n`` 64 tokens
(-1: the whole context, 0: none); ``num_predict`` (-1 or -2: up to the context's end), ``seed``
(negative: unseeded), ``stop``, ``min_p``, ``presence_penalty``, ``frequency_penalty``. Samplers
tokenleap does not have (``mirostat``, ``typical_p`` and ``tfs_z`` away from their neutral values)
get a 400; load-time options (``num_gpu``, ``num_thread`` ...) and ``keep_alive`` are accepted and
unused: the model is the server's. Images get a 400.

``num_ctx`` is the request's context window (at most the server's ``--max-model-len``; absent: that
length): a prompt that does not fit loses its oldest turns, as Ollama drops them -- system messages
and the last message stay, the rest kept from the latest user turn back as far as the window allows
(generate: the oldest tokens of ``context``); a prompt that still leaves no room (one long message)
keeps its first ``num_keep`` tokens (absent: 4, Ollama's default; negative: all) and its end, as
Ollama's runner cuts it, so that it fills half the window, or more where a ``num_predict`` needs less
room (``fit_window``). ``truncate: false`` makes a prompt over the window a 400, as a negative
``num_keep`` does. The reply may fill what the window leaves.

Replies stream by default (``stream`` absent or true), as Ollama's do: one JSON object a line, each
piece of the reply with ``done: false``, then a last object with ``done: true``, ``done_reason``
(``stop``, ``length``) and the timings (nanoseconds) and token counts; ``stream: false`` gives the
whole reply in one object of the same form.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from typing import Any, Literal

from tokenleap.config import MAX_LOGPROBS
from tokenleap.serve.context_window import keep_ends
from tokenleap.serve.jobs import Job
from tokenleap.serve.protocol import (ChatMessage, ChatRequest, CompletionRequest, FunctionCall, Int64,
                                      ResponseFormat, ToolCall, _Strict, bad_request, repeat_window)
from tokenleap.serve.reasoning import Reasoning
from tokenleap.serve.reply_stream import ReplyStream
from tokenleap.serve.responses import Scored, TokenText, token_logprob_entries
from tokenleap.serve.tools import ToolPlan, arguments_object, function_tool

# Ollama's defaults for the options a request leaves out
DEFAULT_OPTIONS: dict[str, Any] = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1,
                                   "repeat_last_n": 64}


class Options(_Strict):
    """The runtime options tokenleap honours or checks; others (load-time ones) are ignored."""

    num_ctx: Int64 | None = None
    num_keep: Int64 | None = None  # tokens a prompt over the window keeps from its start (absent: 4)
    num_predict: Int64 | None = None
    temperature: float | None = None
    top_k: Int64 | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    repeat_penalty: float | None = None
    repeat_last_n: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    mirostat: Int64 | None = None
    typical_p: float | None = None
    tfs_z: float | None = None


class _Body(_Strict):
    model: str
    options: Options | None = None
    format: str | dict[str, Any] | None = None
    stream: bool | None = None  # absent: true (Ollama streams by default)
    keep_alive: str | float | None = None  # accepted, unused: the model stays loaded
    think: bool | Literal["low", "medium", "high"] | None = None  # true / false, or an effort: thinking on
    logprobs: bool | None = None
    top_logprobs: Int64 | None = None
    truncate: bool | None = None  # absent: true (a prompt over the window loses its oldest turns / tokens)


class ChatBody(_Body):  # POST /api/chat
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


class GenerateBody(_Body):  # POST /api/generate
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None  # a Go template of Ollama's: not supported (400 when given)
    context: list[Int64] | None = None  # an earlier reply's context: the conversation so far, as token ids
    raw: bool | None = None
    images: list[str] | None = None


def sampling_fields(body: _Body) -> dict[str, Any]:
    """The ``_Sampling`` fields (and ``max_tokens``) of ``body``'s options, Ollama's defaults filled in."""
    o = body.options or Options()
    for name, neutral in (("mirostat", 0), ("typical_p", 1.0), ("tfs_z", 1.0)):
        if getattr(o, name) not in (None, neutral):
            raise bad_request(f"options.{name}: this server has no {name} sampling (leave it at {neutral})",
                              "options")

    def given(name: str) -> Any:
        value = getattr(o, name)
        return DEFAULT_OPTIONS[name] if value is None else value
    return {"temperature": given("temperature"), "top_k": given("top_k"), "top_p": given("top_p"),
            # (Ollama's sampler: top-k, temperature, top-p, then min-p)
            "min_p": o.min_p, "min_p_after_top_p": True, "seed": None if o.seed is None or o.seed < 0 else o.seed,
            "stop": o.stop, "presence_penalty": o.presence_penalty, "frequency_penalty": o.frequency_penalty,
            **repeat_window(given("repeat_penalty"), given("repeat_last_n"), "options.repeat_last_n"),
            "max_tokens": None if o.num_predict is None or o.num_predict < 0 else o.num_predict,
            "response_format": _response_format(body.format), "stream": body.stream is not False}


def _response_format(fmt: str | dict[str, Any] | None) -> ResponseFormat | None:
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return ResponseFormat(type="json_object")
    if isinstance(fmt, dict):
        return ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"schema": fmt}})
    raise bad_request("format must be \"json\" or a JSON schema object", "format")


def logprobs_wanted(body: _Body) -> int | None:
    """Alternatives per generated token when ``logprobs`` is true (``top_logprobs``, 0-20), else None."""
    if not body.logprobs:
        return None
    k = body.top_logprobs or 0
    if not 0 <= k <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {k}", "top_logprobs")
    return k


def thinking_kwargs(body: _Body) -> dict[str, Any]:
    """The chat template's thinking switch for ``think`` (absent: none, the template's own default)."""
    return {} if body.think is None else {"enable_thinking": body.think is not False}


def context_window(body: _Body, max_len: int) -> int:
    """The tokens prompt and reply may fill: ``options.num_ctx`` up to ``max_len`` (absent: ``max_len``)."""
    n = (body.options or Options()).num_ctx
    if n is None:
        return max_len
    if n < 1:
        raise bad_request(f"options.num_ctx must be >= 1, got {n}", "options")
    return min(n, max_len)


def fit_window(body: _Body, ids: list[int], window: int) -> list[int]:
    """``ids`` when they leave a reply room in ``window`` or ``truncate`` is false; else cut as Ollama
    cuts a prompt over ``num_ctx``: the first ``num_keep`` tokens and the end, filling half the window
    (after those kept) or, where a ``num_predict`` fits in less room, the window less that room."""
    o = body.options or Options()
    keep = 4 if o.num_keep is None else o.num_keep
    if len(ids) < window or body.truncate is False or keep < 0:
        return ids
    keep = min(keep, window - 1)  # (one token of the end at least: where a chat's reply opens)
    limit = keep + (window - keep) // 2
    if o.num_predict is not None and 0 < o.num_predict < window:
        limit = max(limit, window - o.num_predict)
    return keep_ends(ids, keep, max(1, limit))


def chat_request(body: ChatBody) -> ChatRequest:
    """The chat request that computes ``body``'s reply; a 400 for what this server cannot do."""
    messages, calls = [], []  # calls: (id, function name) of the conversation's tool calls, not yet answered
    for i, m in enumerate(body.messages or []):
        messages.append(_message(i, m, calls))
    tools = [function_tool(f"tools.{i}", _function(i, t)) for i, t in enumerate(body.tools or [])]
    return ChatRequest.model_construct(model=body.model, messages=messages, n=1, tools=tools or None,
                                       logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs,
                                       add_generation_prompt=True, continue_final_message=False,
                                       chat_template_kwargs=thinking_kwargs(body) or None, **sampling_fields(body))


def _message(i: int, m: dict[str, Any], calls: list[tuple[str, str]]) -> ChatMessage:
    role, content = m.get("role"), m.get("content")
    if role not in ("system", "user", "assistant", "tool"):
        raise bad_request(f"messages[{i}].role must be system, user, assistant or tool", "messages")
    if content is not None and not isinstance(content, str):
        raise bad_request(f"messages[{i}].content must be a string", "messages")
    if m.get("images"):
        raise bad_request(f"messages[{i}].images: this server's model reads text only", "messages")
    if role == "tool":  # the reply to the earliest unanswered call of that function (else the earliest unanswered)
        name = m.get("tool_name") or m.get("name")
        at = next((j for j, (_, fn) in enumerate(calls) if fn == name), 0 if calls else None)
        call_id = calls.pop(at)[0] if at is not None else f"call_{i}"
        return ChatMessage(role="tool", content=content or "", tool_call_id=call_id, name=name)
    made = []
    for j, call in enumerate(m.get("tool_calls") or []):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"messages[{i}].tool_calls[{j}] must be {{\"function\": {{\"name\", \"arguments\"}}}}",
                              "messages")
        arguments = fn.get("arguments") or {}
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        made.append(ToolCall(id=f"call_{i}_{j}", function=FunctionCall(name=fn["name"], arguments=text)))
        calls.append((f"call_{i}_{j}", fn["name"]))
    if made and role != "assistant":
        raise bad_request(f"messages[{i}]: only assistant messages carry tool_calls", "messages")
    return ChatMessage(role=role, content=content or "", tool_calls=made or None)


def _function(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function")
    if not isinstance(fn, dict) or tool.get("type", "function") != "function":
        raise bad_request(f"tools.{i} must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
    return {"name": fn.get("name"), "description": fn.get("description"), "parameters": fn.get("parameters")}


def generate_request(body: GenerateBody) -> CompletionRequest:
    """The completion request whose sampling ``body`` asks for (its prompt is encoded by the caller)."""
    if body.images:
        raise bad_request("images: this server's model reads text only", "images")
    if body.template:
        raise bad_request("template: Ollama's Go templates are not supported; the model's own chat template "
                          "is used (or none, with raw)", "template")
    return CompletionRequest.model_construct(**{
        **{name: field.default for name, field in CompletionRequest.model_fields.items()},
        "model": body.model, "prompt": body.prompt or "", **sampling_fields(body)})


def created_at() -> str:
    """Ollama's timestamp: RFC 3339 in UTC."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


class ReplyWriter:
    """One ``/api/chat`` (``chat``) or ``/api/generate`` reply as Ollama's objects: pieces as they
    come (``lines``) and the whole reply (``final``). ``tools``: the chat's tool plan, whose calls
    become ``message.tool_calls``; ``reasoning``: how a thinking model's block is split off, into
    ``thinking``; ``tokens``: token texts for logprobs (None: none asked for); ``context``: the
    prompt's ids, which a generate reply's ``context`` continues with the reply's; ``encode``: the
    text's ids, for a reply a stop string cut (its context holds the returned text, as Ollama's)."""

    def __init__(self, model: str, chat: bool, job: Job, tools: ToolPlan = ToolPlan(),
                 reasoning: Reasoning | None = None, tokens: TokenText | None = None,
                 context: list[int] | None = None, encode: Callable[[str], list[int]] | None = None) -> None:
        self.model, self.chat, self.job, self.tools, self.reasoning = model, chat, job, tools, reasoning
        self.tokens, self.context, self.encode = tokens, context, encode

    def final(self, text: str, reason: str | None, scored: list[Scored]) -> dict[str, Any]:
        thought = None
        if self.reasoning is not None:
            thought, text = self.reasoning.split(text)
        content, calls = (self.tools.calls(text) if self.tools.parse
                          else (text, []))
        obj = self._piece(content or "", thought if self.reasoning is not None and self.reasoning.include else None,
                          calls, scored)
        return {**obj, **self._done(reason, text)}

    async def lines(self) -> AsyncIterator[str]:
        """The stream: a line a piece of text (thinking and content apart), a line for the tool calls,
        then the last line; an ``{"error"}`` line if the request fails."""
        split = ReplyStream(self.reasoning, self.tools)
        reason, text = None, ""
        async for i, out in self.job.outputs():
            if out.error:
                yield _line({"error": f"the request failed: {out.error}"})
                return
            piece, scored = self.job.piece(i, out)
            reason, text = out.finish_reason or reason, text + piece
            thought, piece, _, calls = split.feed(piece, out.finish_reason is not None)  # (calls whole, as Ollama's)
            if thought or piece or (scored and self.tokens is not None):
                yield _line(self._piece(piece, thought or None, [], scored))
            if calls:
                yield _line(self._piece("", None, calls, []))
        yield _line({**self._piece("", None, [], []), **self._done(reason, text)})

    def _piece(self, text: str, thought: str | None, calls: list[dict], scored: list[Scored]) -> dict[str, Any]:
        obj: dict[str, Any] = {"model": self.model, "created_at": created_at()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thought is not None:
                message["thinking"] = thought
            if calls:
                message["tool_calls"] = [_tool_call(j, c) for j, c in enumerate(calls)]
            obj["message"] = message
        else:
            obj["response"] = text
            if thought is not None:
                obj["thinking"] = thought
        if self.tokens is not None and scored:
            obj["logprobs"] = token_logprob_entries(scored, self.tokens)
        obj["done"] = False
        return obj

    def _done(self, reason: str | None, text: str = "") -> dict[str, Any]:
        """The last object's fields: why the reply ended, the counts and timings (nanoseconds); ``text``:
        the whole reply as generated (its thinking included)."""
        job = self.job
        request = job.requests[0]
        end = time.monotonic()
        first = request.first_token_time if request.first_token_time is not None else end
        out: dict[str, Any] = {
            "done": True, "done_reason": "length" if reason == "length" else "stop",
            "total_duration": _ns(end - job.t0), "load_duration": 0, "prompt_eval_count": job.prompt_tokens,
            "prompt_eval_duration": _ns(first - job.t0), "eval_count": job.generated[0],
            "eval_duration": _ns(end - first)}
        if self.context is not None:
            cut = isinstance(job.stop_reason(0), str) and self.encode is not None  # a stop string's tokens dropped
            out["context"] = self.context + (self.encode(text) if cut else list(request.seq.generated))
        return out


def load_reply(model: str, chat: bool, keep_alive: str | float | None) -> dict[str, Any]:
    """Ollama's answer to a request with nothing to generate from (no prompt, no messages): the model
    is loaded, or with ``keep_alive`` 0 unloaded (here it stays loaded: the server serves it)."""
    obj: dict[str, Any] = {"model": model, "created_at": created_at()}
    obj.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    unload = keep_alive in (0, "0", "0s", "0m")
    return {**obj, "done": True, "done_reason": "unload" if unload else "load"}


def _tool_call(j: int, call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call (``tools.parse_tool_calls``) in Ollama's form: the arguments as an object."""
    return {"function": {"index": j, "name": call["function"]["name"], "arguments": arguments_object(call)}}


def _ns(seconds: float) -> int:
    return int(max(seconds, 0.0) * 1e9)


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"
