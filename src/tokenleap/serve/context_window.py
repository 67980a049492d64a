"""How a request's prompt and reply share the context window: the reply's token budget
(``check_max_tokens``), vLLM's ``truncate_prompt_tokens`` (``truncate_prompt``) and the Responses
API's ``truncation: "auto"`` (``drop_oldest``)."""
from __future__ import annotations

from typing import Any, Callable

from tokenleap.serve.protocol import bad_request


def check_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, default: int | None,
                     param: str = "max_tokens") -> int:
    """The completion budget: an explicit value (``param``: its name in the request) must be at least
    1 and fit the context; a default is cut to fit. A prompt that leaves no room is the prompt's 400."""
    room = max_model_len - prompt_len
    if room < 1:  # no budget fits: the prompt is what to change, whatever max_tokens says
        raise bad_request(f"this model's maximum context length is {max_model_len} tokens and the prompt has "
                          f"{prompt_len}: shorten the prompt (a reply needs at least one token of room)", "prompt",
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


def drop_oldest(messages: list[dict[str, Any]], encode: Callable[[list[dict[str, Any]]], list[int]],
                max_model_len: int, reply: int | None) -> tuple[list[dict[str, Any]], list[int]]:
    """OpenAI's ``truncation: "auto"``: the conversation without as few of its oldest turns as make its
    prompt (``encode``'s ids) leave room for ``reply`` tokens (None: one) -- leading system /
    developer messages kept, and a tool result whose call was dropped dropped with it. The prompt
    gets shorter as turns go, so the fewest to drop is found by bisection (a few renders for a
    long history). Unchanged when it fits; if only the last turn is left and it does not fit, the
    caller's budget check gives its 400."""
    need = max_model_len - (reply or 1)
    ids = encode(messages)
    if len(ids) <= need:
        return messages, ids
    head = 0
    while head < len(messages) - 1 and messages[head].get("role") in ("system", "developer"):
        head += 1

    def without(n: int) -> list[dict[str, Any]]:
        rest = messages[head + n:]
        while len(rest) > 1 and rest[0].get("role") == "tool":  # (its call went with the dropped turns)
            rest = rest[1:]
        return messages[:head] + rest

    low, high = 1, len(messages) - 1 - head  # drop at least one; at most all but the last turn
    if high < low:
        return messages, ids
    best = without(high)
    best_ids = encode(best)
    if len(best_ids) > need:
        return best, best_ids
    while low < high:
        mid = (low + high) // 2
        kept = without(mid)
        kept_ids = encode(kept)
        if len(kept_ids) <= need:
            high, best, best_ids = mid, kept, kept_ids
        else:
            low = mid + 1
    return best, best_ids
