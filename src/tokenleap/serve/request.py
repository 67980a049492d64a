"""A request in the scheduler's hands and what its consumer receives: the records the scheduler,
the HTTP layer and the offline batch runner pass between them."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tokenleap.errors import TokenleapError
from tokenleap.spec.logprobs import TokenLogprob
from tokenleap.spec.sequence import Sequence


class QueueFullError(TokenleapError):
    """Too many requests are waiting; the client should retry later."""


@dataclass(frozen=True)
class Output:
    """What a request's consumer receives after an iteration that changed it."""

    text: str  # new text
    token_ids: list[int]  # new token ids
    num_generated: int
    finish_reason: str | None = None  # "stop" | "length" | "error" on the last output
    error: str | None = None
    error_status: int = 500  # 400: the request's own settings could not be met together
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the new tokens, if the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first output, if the request asked


@dataclass(eq=False)
class Request:
    """One sequence in the scheduler's hands: where its outputs go, how far they were handed out, and
    when it arrived, was first scheduled and produced its first token."""

    seq: Sequence
    on_output: Callable[[Output], None]  # called on the scheduler thread; must not block
    arrival: int = -1  # set by the scheduler: lower is older
    sent: int = 0  # generated tokens already handed out
    done: bool = False
    counted_prompt: bool = False
    error: str | None = field(default=None, repr=False)
    # time.monotonic() at submit, first admission into the batch, first and latest tokens (for the histograms)
    arrival_time: float = 0.0
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
