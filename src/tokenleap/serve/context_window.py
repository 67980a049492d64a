"""How a request's prompt and reply share the context window: the reply's token budget
(``check_max_tokens``) and vLLM's ``truncate_prompt_tokens`` (``truncate_prompt``)."""
from __future__ import annotations

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
