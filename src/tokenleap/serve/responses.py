"""OpenAI response objects: ids, usage, completion and chat choices and stream deltas, the
completions and chat forms of ``logprobs``, and ``Format``, one request's response envelope."""
from __future__ import annotations

import difflib
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenleap.spec.logprobs import TokenLogprob
from tokenleap.serve.reasoning import Reasoning
from tokenleap.serve.tools import ToolPlan


def new_id(prefix: str) -> str:
    """A fresh id in OpenAI's form: ``chatcmpl-...`` / ``cmpl-...``, and the Responses API's ``resp_...``,
    ``msg_...``, ``rs_...`` (an underscore there)."""
    return f"{prefix}{'_' if prefix in ('resp', 'msg', 'rs') else '-'}{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object, ``prompt_tokens_details.cached_tokens`` (the prompt tokens the prefix cache
    served) always present, 0 included, as OpenAI sends it."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def prediction_tokens_kept(prediction: tuple[int, ...], generated: list[int]) -> int:
    """How many of a predicted output's tokens the reply contains, in order (the matching blocks of
    a diff of the two token lists)."""
    matcher = difflib.SequenceMatcher(None, prediction, generated, autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks())


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, text: str | None, finish_reason: str | None,
                logprobs: dict[str, Any] | None = None, tool_calls: list[dict[str, Any]] | None = None,
                reasoning: tuple[str | None] = ()) -> dict[str, Any]:
    """``reasoning``: (the reply's thinking or None,) where the request's replies are split, else ()."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        message["reasoning_content"] = reasoning[0]
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_delta(index: int, delta: dict[str, Any], finish_reason: str | None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


# -- logprobs ---------------------------------------------------------------------------------
class TokenText:
    """Each token's own text (special tokens spelled out) and its UTF-8 bytes, cached. A token that
    holds part of a multi-byte character shows U+FFFD in its text; its bytes are exact where the
    tokenizer can say (``token_bytes``). ``label`` is how logprobs name a token: its text, or with
    ``as_ids`` (vLLM's ``return_tokens_as_token_ids``) ``"token_id:ID"``, which no partial character
    garbles."""

    def __init__(self, tokenizer: Any, as_ids: bool = False) -> None:
        self.tokenizer, self.as_ids = tokenizer, as_ids
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def label(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.text(token_id)

    def with_ids(self) -> "TokenText":
        """The same tokenizer's texts (this cache), labelled by id."""
        other = TokenText(self.tokenizer, as_ids=True)
        other._text, other._bytes = self._text, self._bytes
        return other

    def text(self, token_id: int) -> str:
        if token_id not in self._text:
            self._text[token_id] = self.joined([token_id])
        return self._text[token_id]

    def joined(self, token_ids: list[int]) -> str:
        """Several tokens' text together, special tokens spelled out."""
        try:
            return self.tokenizer.decode(token_ids, skip_special_tokens=False)
        except TypeError:  # a tokenizer without the option
            return self.tokenizer.decode(token_ids)

    def bytes(self, token_id: int) -> list[int]:
        if token_id not in self._bytes:
            exact = getattr(self.tokenizer, "token_bytes", None)
            raw = exact(token_id) if exact is not None else self.text(token_id).encode("utf-8")
            self._bytes[token_id] = list(raw)
        return self._bytes[token_id]


Scored = tuple[int, TokenLogprob | None]  # a token id and its logprob (None: the prompt's first token)


def completion_logprobs(scored: list[Scored], tt: TokenText, offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; ``offset``: characters of text before these tokens.
    Each ``top_logprobs`` holds the token itself and its ``logprobs`` alternatives."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, lp in scored:
        label = tt.label(token_id)
        out["tokens"].append(label)
        out["token_logprobs"].append(None if lp is None else lp.logprob)
        # the token itself first, then the alternatives: OpenAI's "up to logprobs + 1" (as vLLM's), so the
        # chosen token's entry is there however unlikely it was
        out["top_logprobs"].append(None if lp is None else {label: lp.logprob, **{tt.label(t): v for t, v in lp.top}})
        out["text_offset"].append(offset)
        offset += len(tt.text(token_id))
    return out


def token_logprob_entries(scored: list[Scored], tt: TokenText, ids: bool = False) -> list[dict[str, Any]]:
    """One entry per scored token: its text, logprob and bytes, and its ``top_logprobs`` alike
    (``ids``: each with its token id too, as llama.cpp's ``completion_probabilities`` has them)."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        out = {"id": token_id} if ids else {}
        return {**out, "token": tt.label(token_id), "logprob": logprob, "bytes": tt.bytes(token_id)}
    return [{**entry(t, lp.logprob), "top_logprobs": [entry(a, v) for a, v in lp.top]}
            for t, lp in scored if lp is not None]


def prompt_logprob_dicts(scored: list[Scored], k: int, tt: TokenText) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (the first: None), the token and its ``k`` likeliest
    alternatives by id, each with its logprob, rank and text."""
    def entry(logprob: float, rank: int, token_id: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": tt.label(token_id)}
    out: list[dict[str, Any] | None] = []
    for token_id, lp in scored:
        if lp is None:
            out.append(None)
            continue
        entries = {str(token_id): entry(lp.logprob, lp.rank, token_id)}
        for r, (alt, v) in enumerate(lp.top[:k], 1):
            entries.setdefault(str(alt), entry(v, r, alt))
        out.append(entries)
    return out


def add_prompt_logprobs(body: dict[str, Any], prompts: list[list[Scored]], k: int, tt: TokenText,
                        chat: bool) -> None:
    """vLLM's ``prompt_logprobs`` put where vLLM puts them: beside a chat reply's choices (its one
    conversation), in each completion choice (``prompts``: choice i's scored prompt)."""
    if chat:
        body["prompt_logprobs"] = prompt_logprob_dicts(prompts[0], k, tt)
    else:
        for choice, scored in zip(body["choices"], prompts):
            choice["prompt_logprobs"] = prompt_logprob_dicts(scored, k, tt)


def chat_logprobs(scored: list[Scored], tt: TokenText) -> dict[str, Any]:
    """The chat completions ``logprobs`` object (``content``: one entry per generated token)."""
    return {"content": token_logprob_entries(scored, tt), "refusal": None}


@dataclass(frozen=True)
class Format:
    """Response envelope shared by the chunks and the final object of one request."""

    id: str
    object: str
    model: str
    created: int
    chat: bool
    include_usage: bool = False
    continuous_usage: bool = False  # the usage so far in every chunk (vLLM's continuous_usage_stats)
    tokens: TokenText | None = None  # set when the request asked for logprobs
    tools: ToolPlan = ToolPlan()  # a chat request's tool calling
    reasoning: Reasoning | None = None  # a chat reply's thinking split from its content (reasoning.py)
    token_ids: bool = False  # vLLM's return_token_ids: each choice's token ids and the prompt's beside the text

    def obj(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def choice(self, i: int, text: str, reason: str | None, scored: list[Scored], offset: int = 0,
               delta: bool = False) -> dict[str, Any]:
        """Choice ``i`` of a response (``delta``: of a streamed chat chunk); ``offset``: text before it."""
        if self.chat:
            lp = chat_logprobs(scored, self.tokens) if self.tokens else None
            if delta:
                return chat_delta(i, {"content": text} if text else {}, reason, lp)
            thought: tuple[str | None] = ()
            if self.reasoning is not None:
                found, text = self.reasoning.split(text)
                thought = ((found or None) if self.reasoning.include else None,)
            content: str | None = text if text or not thought or thought[0] is None else None
            if self.tools.parse:
                # (a call cut off by max_tokens is kept as far as it was written, with finish_reason "length")
                content, calls = self.tools.calls(text, reason == "length")
                return chat_choice(i, content, "tool_calls" if calls and reason != "length" else reason, lp, calls,
                                   thought)
            return chat_choice(i, content, reason, lp, reasoning=thought)
        return completion_choice(i, text, reason, completion_logprobs(scored, self.tokens, offset)
                                 if self.tokens else None)

    def with_usage(self, so_far: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
        """A streamed chunk's usage field: none without include_usage, else null (the last chunk
        carries it) or, with continuous usage, ``so_far()`` (counted only then)."""
        if not self.include_usage:
            return {}
        return {"usage": so_far() if self.continuous_usage and so_far is not None else None}


def usage_options(req) -> dict[str, bool]:
    """``Format``'s usage fields from a request's ``stream_options`` (they apply to streams only)."""
    opts = req.stream_options if req.stream else None
    include = bool(opts and opts.include_usage)
    return {"include_usage": include, "continuous_usage": include and bool(opts.continuous_usage_stats)}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event carrying ``data`` (a JSON object, or text such as ``[DONE]``)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"
