"""How a request's prompt and reply share the context window: the reply's token budget
(``check_max_tokens``), vLLM's ``truncate_prompt_tokens`` (``truncate_prompt``) and the Responses
API's ``truncation: "auto"`` and Ollama's ``num_ctx`` (``fit_turns``, then ``keep_ends``)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from tokenleap.serve.protocol import APIError, bad_request


def check_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, default: int | None,
                     param: str = "max_tokens", prompt_param: str = "prompt") -> int:
    """The completion budget: an explicit value (``param``: its name in the request) must be at least
    1 and fit the context; a default is cut to fit. A prompt that leaves no room is the prompt's 400
    (``prompt_param``: the prompt's name in the request, "messages" for a chat's, as OpenAI's)."""
    room = max_model_len - prompt_len
    if room < 1:  # no budget fits: the prompt is what to change, whatever max_tokens says
        raise bad_request(f"this model's maximum context length is {max_model_len} tokens and the prompt has "
                          f"{prompt_len}: shorten the prompt (a reply needs at least one token of room)", prompt_param,
                          "context_length_exceeded")
    if requested is None:
        return min(default or room, room)
    if requested < 1:
        raise bad_request(f"{param} must be an integer >= 1, got {requested}", param)
    if prompt_len + requested > max_model_len:
        raise bad_request(f"this model's maximum context length is {max_model_len} tokens; you requested "
                          f"{prompt_len + requested} ({prompt_len} in the prompt, {requested} for the "
                          f"completion): lower {param} or shorten the prompt", param,
                          "context_length_exceeded")
    return requested


def check_each_max_tokens(requested: int | None, prompts: list[list[int]], max_model_len: int,
                          default: int | None, param: str = "max_tokens") -> list[int]:
    """``check_max_tokens`` for each of a request's prompts; with several, a prompt that does not fit is
    named (a bad ``requested`` is the whole request's, and refused as it is)."""
    budgets = []
    for i, p in enumerate(prompts):
        try:
            budgets.append(check_max_tokens(requested, len(p), max_model_len, default, param))
        except APIError as e:
            if len(prompts) > 1 and e.code == "context_length_exceeded":
                raise replace(e, message=f"prompt {i} (of {len(prompts)}, counted from 0): {e.message}") from None
            raise
    return budgets


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int,
                    param: str = "truncate_prompt_tokens") -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: as many as the context
    holds; None: the whole prompt). Left truncation, as vLLM does it: a chat's rendered prompt loses
    its start first."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    if not 1 <= keep <= max_model_len:
        raise bad_request(f"{param} must be -1 or in [1, {max_model_len}] (this model's context length), "
                          f"got {keep}", param)
    return ids[-keep:]


def fit_turns(messages: list[dict[str, Any]], encode: Callable[[list[dict[str, Any]]], list[int]],
              limit: int) -> tuple[list[dict[str, Any]], list[int]]:
    """The most of the conversation whose prompt (``encode``'s ids) has at most ``limit`` tokens, and
    those ids: every system / developer message and the last message, and the other messages from
    the latest user turn (or the last message) that fits back; all of them when they fit. Ollama
    drops the oldest turns this way past ``num_ctx``, and the Responses API's ``truncation: "auto"``
    drops the oldest items; cutting at a user turn leaves no tool result without its call and no
    conversation that opens with an assistant turn (which some templates refuse). Fewer kept
    messages never render longer, so the cut is found by bisection (a few renders for a long
    history). When nothing fits: the shortest, for the caller's budget check to refuse."""
    ids = encode(messages)
    if len(ids) <= limit:
        return messages, ids
    last = len(messages) - 1
    starts = [i for i, m in enumerate(messages) if 0 < i < last and m.get("role") == "user"] + [last]
    best, lo, hi = None, 0, len(starts) - 1
    while lo <= hi:  # the earliest start whose rendering fits
        mid = (lo + hi) // 2
        kept = [m for i, m in enumerate(messages) if i >= starts[mid] or m.get("role") in ("system", "developer")]
        got = encode(kept)
        if len(got) <= limit:
            best, hi = (kept, got), mid - 1
        else:
            lo = mid + 1
    return best if best is not None else (kept, got)  # none fits: the last tried, the shortest


def keep_ends(ids: list[int], keep: int, limit: int) -> list[int]:
    """The prompt cut to ``limit`` tokens as Ollama's runner cuts one over its window: its first ``keep``
    tokens (at most ``limit - 1``, so the prompt's end, where a chat's reply opens, stays) and its
    last ones; unchanged when it fits."""
    if len(ids) <= limit:
        return ids
    keep = max(0, min(keep, limit - 1))
    return ids[:keep] + ids[len(ids) - (limit - keep):]
