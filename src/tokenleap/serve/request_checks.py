"""A request's values checked before it runs, each failure a 400 naming the field: what this server
cannot do (refused, not ignored), ``n``, seeds, temperatures and stops in range, vLLM's
``prompt_logprobs``, and token ids (logit_bias keys, stop / allowed ids) of the vocabulary."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenleap.config import MAX_LOGPROBS
from tokenleap.serve.protocol import (MAX_N, MAX_STOP, MAX_TEMPERATURE, ChatRequest, CompletionRequest, _Sampling,
                                      bad_request, logit_bias_by_id)

# a field a request may set that this server cannot honour: when its value (given) asks for something, and why not
_UNSERVED = {
    "use_beam_search": (bool, "beam search is not supported (n gives independent samples)"),
    "priority": (bool, "priority scheduling is not supported: requests are served in turn"),
    "cache_salt": (lambda v: True, "cache_salt is not supported: every request of this server shares "
                                            "its prefix cache (serve with --no-prefix-caching, or a server each)"),
    "logits_processors": (bool, "logits_processors are not supported"),
    "modalities": (lambda v: any(m != "text" for m in v), "only text output is supported"),
    "audio": (lambda v: True, "audio output is not supported"),
    "web_search_options": (lambda v: True, "web search is not supported"),
}


def refuse_unserved(req: Any, unserved: dict[str, tuple[Callable[[Any], bool], str]]) -> None:
    """A 400 naming the first field of ``req`` that is given and asks for what ``unserved`` says this
    server cannot do (field -> (whether a value asks for it, why not))."""
    for name, (asks, why) in unserved.items():
        value = getattr(req, name)
        if value is not None and asks(value):
            raise bad_request(f"{name}: {why}", name)


def check_common(req: _Sampling) -> None:
    refuse_unserved(req, _UNSERVED)
    if req.n is None or not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {req.n}", "n")
    # (choice j of a seeded request samples with seeded.choice_seed(seed, j), a 63-bit value)
    if req.seed is not None and not -2**63 <= req.seed < 2**63:
        raise bad_request(f"seed must be a 64-bit signed integer, got {req.seed}", "seed")
    if req.temperature is not None and not 0 <= req.temperature <= MAX_TEMPERATURE:
        raise bad_request(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {req.temperature!r}", "temperature")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP:
        raise bad_request(f"at most {MAX_STOP} stop strings", "stop")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options are allowed only when stream is true", "stream_options")
    if req.allowed_token_ids is not None and not req.allowed_token_ids:
        raise bad_request("allowed_token_ids is empty: give at least one token id, or leave it out",
                          "allowed_token_ids")


def check_prompt_logprobs(req: CompletionRequest | ChatRequest) -> int | None:
    """vLLM's ``prompt_logprobs``: alternatives per prompt token, in [0, MAX_LOGPROBS]; not on streams."""
    k = req.prompt_logprobs
    if k is None:
        return None
    if not 0 <= k <= MAX_LOGPROBS:
        raise bad_request(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {k}", "prompt_logprobs")
    if req.stream:
        raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
    return k


def check_logit_bias(bias: dict[str, float] | None, vocab: int) -> None:
    """Keys are token ids of the vocabulary (a longer digit string than any id: out of range too)."""
    if any(t >= vocab for t in logit_bias_by_id(bias)):
        raise bad_request(f"logit_bias token ids must be below the vocabulary size {vocab}", "logit_bias")


def check_token_ids(ids: list[int] | None, vocab: int, param: str) -> None:
    """Every id in ``ids`` (the request field ``param``) names a token of the vocabulary."""
    if ids and not all(0 <= t < vocab for t in ids):
        raise bad_request(f"{param} must be token ids in [0, {vocab})", param)
