"""What a request returns through the Python API: vLLM's ``RequestOutput`` / ``CompletionOutput``
shapes (each completion's text, ids, finish and stop reasons, logprobs), the stream's chunks, and how
a finished sequence becomes one."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any

from tokenleap.spec.logprobs import TokenLogprob
from tokenleap.spec.sequence import Sequence
from tokenleap.spec.stats import SpecStats


@dataclass
class CompletionOutput:
    """One completion of a prompt, as vLLM's: ``RequestOutput.outputs`` holds ``SamplingParams.n``."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None  # the sum of the tokens' logprobs (when logprobs were asked for)


@dataclass
class RequestOutput:
    """A prompt's output: its first completion's fields, and every completion in ``outputs`` (vLLM's
    ``output.outputs[0].text`` reads the same text as ``output.text``)."""

    prompt: str | list[int]
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str | None
    seconds: float
    stats: dict[str, Any] = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # per generated token, when SamplingParams.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (the first: None)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None: EOS, length)
    prompt_token_ids: list[int] = field(default_factory=list)  # the prompt as the model read it
    outputs: list[CompletionOutput] = field(default_factory=list)  # SamplingParams.n completions
    request_id: str = ""  # unique in the process, as vLLM's LLM numbers its requests ("0", "1", ...)
    finished: bool = True  # a RequestOutput is made once its request has ended (vLLM's field, always True here)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        """New tokens a second of the request's wall time (every completion's when ``n`` > 1)."""
        tokens = sum(len(c.token_ids) for c in self.outputs) if len(self.outputs) > 1 else self.num_tokens
        return tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "num_tokens": self.num_tokens,
                "prompt_tokens": self.prompt_tokens, "finish_reason": self.finish_reason,
                "stop_reason": self.stop_reason, "seconds": round(self.seconds, 4),
                "tokens_per_second": round(self.tokens_per_second, 3),
                "stats": self.stats, **self._logprob_fields(),
                **({"outputs": [completion_dict(c) for c in self.outputs]} if len(self.outputs) > 1 else {})}

    def _logprob_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.logprobs is not None:
            out["logprobs"] = [t.to_dict() for t in self.logprobs]
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = [None if t is None else t.to_dict() for t in self.prompt_logprobs]
        return out


@dataclass
class StreamChunk:
    text: str  # new text since the previous chunk
    token_ids: list[int]  # all generated token ids so far
    finished: bool
    output: RequestOutput | None = None  # set on the last chunk


def grouped(outputs: list[RequestOutput], stats: list[SpecStats], counts: list[int]) -> list[RequestOutput]:
    """Each prompt's ``counts[i]`` outputs in a row (``stats``: each one's counters) as one output: the
    first's fields, every completion in ``outputs``, the slowest one's seconds, and the counters of all
    of them (the request's, as in the server's usage: its completions ran side by side)."""
    out, at = [], 0
    for n in counts:
        first, rest = outputs[at], outputs[at + 1:at + n]
        first.outputs = [replace(o.outputs[0], index=j) for j, o in enumerate([first] + rest)]
        first.seconds = max(o.seconds for o in [first] + rest)
        if rest:
            total = SpecStats()
            for st in stats[at:at + n]:
                total.merge(st)
            total.total_seconds = first.seconds
            first.stats = total.to_dict()
        out.append(first)
        at += n
    return out


def completion_dict(c: CompletionOutput) -> dict[str, Any]:
    return {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            **({"logprobs": [t.to_dict() for t in c.logprobs], "cumulative_logprob": c.cumulative_logprob}
               if c.logprobs is not None else {})}


_request_ids = itertools.count()  # (next() on a count is atomic under the GIL: threads share it safely)


def request_output(prompt: str | list[int], seq: Sequence, seconds: float) -> RequestOutput:
    """A finished sequence's ``RequestOutput`` (``prompt``: as the caller gave it), with the next request id."""
    params = seq.params
    logprobs = list(seq.logprobs) if params.logprobs is not None else None
    return RequestOutput(prompt=prompt, text=seq.text, token_ids=seq.generated, prompt_tokens=len(seq.prompt),
                         finish_reason=seq.finish_reason, seconds=seconds, stats=seq.stats.to_dict(),
                         logprobs=logprobs,
                         prompt_logprobs=list(seq.prompt_logprobs) if params.prompt_logprobs is not None else None,
                         stop_reason=seq.stop_reason, prompt_token_ids=list(seq.prompt),
                         outputs=[CompletionOutput(0, seq.text, seq.generated, seq.finish_reason, seq.stop_reason,
                                                   logprobs, None if logprobs is None
                                                   else sum(t.logprob for t in logprobs))],
                         request_id=str(next(_request_ids)))
