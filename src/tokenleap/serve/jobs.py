"""One HTTP request's share of the server: its sequences' ``scheduler.Request``s and the
``asyncio.Queue`` the scheduler thread delivers their outputs on (``loop.call_soon_threadsafe``)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from fastapi import Request as HTTPRequest

from tokenleap.serve.request_ids import CURRENT
from tokenleap.serve.protocol import failed
from tokenleap.serve.responses import Scored, prediction_tokens_kept, usage
from tokenleap.serve.request import Output, Request
from tokenleap.serve.scheduler import Scheduler
from tokenleap.serve.metrics import request_log_line

_GONE = -1  # the index a disconnect watcher puts on the queue


class ClientGone(Exception):
    """The client of a non-streaming request went away."""


@dataclass(frozen=True)
class PromptView:
    """What a job's replies show of their prompts."""

    # per choice, the text that starts it (completions' echo: the prompt; chat's: the last message)
    echo: list[str] | None = None
    echo_logprobs: int | None = None  # the echoed tokens' logprobs, with this many alternatives each
    echo_only: bool = False  # max_tokens 0: the echoed prompt is the whole reply (one token is decoded, unseen)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field: alternatives per prompt token

    @property
    def engine_logprobs(self) -> int | None:
        """The alternatives the engine computes per prompt token (None: no prompt logprobs)."""
        asked = [k for k in (self.echo_logprobs, self.prompt_logprobs) if k is not None]
        return max(asked) if asked else None


class Job:
    """One HTTP request's choices and the queue their outputs arrive on."""

    def __init__(self, scheduler: Scheduler, seqs: list, prompt_tokens: int, view: PromptView = PromptView()) -> None:
        loop = asyncio.get_running_loop()
        self.scheduler, self.prompt_tokens = scheduler, prompt_tokens
        self.queue: asyncio.Queue[tuple[int, Output]] = asyncio.Queue()
        self.requests = [Request(s, partial(self._deliver, loop, i)) for i, s in enumerate(seqs)]
        self.pending = set(range(len(seqs)))
        self.generated = [0] * len(seqs)
        self.view = view
        self.prompt_scored: list[list[Scored]] = [[] for _ in seqs]  # per choice, when the engine scores prompts
        self.started = [False] * len(seqs)
        self.reasons: list[str] = ["abort"] * len(seqs)  # until a choice finishes: abort (cancelled, client gone)
        self.t0 = time.monotonic()
        self.prompt_text: str | None = None  # logged with the request when set (the server's --log-prompts)

    def piece(self, i: int, out: Output) -> tuple[str, list[Scored]]:
        """Choice ``i``'s new text and scored tokens in ``out`` (the echoed prompt before the first)."""
        view = self.view
        text, scored = out.text, [(lp.token_id, lp) for lp in out.logprobs]
        if not self.started[i]:
            self.started[i] = True
            if out.prompt_logprobs is not None:
                self.prompt_scored[i] = list(zip(self.requests[i].seq.prompt, out.prompt_logprobs))
            if view.echo is not None:
                text = view.echo[i] + text
                if view.echo_logprobs is not None:
                    k = view.echo_logprobs
                    scored = [(t, lp if lp is None else replace(lp, top=lp.top[:k]))
                              for t, lp in self.prompt_scored[i]] + scored
        return text, scored

    def _deliver(self, loop: asyncio.AbstractEventLoop, index: int, out: Output) -> None:
        if self.view.echo_only:  # the one decoded token stays unseen: max_tokens (0) ended the reply
            out = replace(out, text="", token_ids=[], num_generated=0, logprobs=[],
                          finish_reason="length" if out.finish_reason in ("stop", "length") else out.finish_reason)
        loop.call_soon_threadsafe(self.queue.put_nowait, (index, out))  # runs on the scheduler thread

    def stop_reason(self, i: int) -> int | str | None:
        """What ended choice ``i`` with "stop" (vLLM's field): its stop token id or stop string, or None
        for an EOS token (and for any other end)."""
        return None if self.view.echo_only else self.requests[i].seq.stop_reason

    def usage(self) -> dict[str, Any]:
        out = usage(self.prompt_tokens, sum(self.generated), max(r.seq.cached_tokens for r in self.requests))
        prediction = self.requests[0].seq.params.prediction
        if prediction:  # OpenAI's: the predicted tokens the replies contain, and the rest
            kept = sum(prediction_tokens_kept(prediction, r.seq.generated) for r in self.requests)
            rejected = len(prediction) * len(self.requests) - kept
            out["completion_tokens_details"] = {"accepted_prediction_tokens": kept,
                                                "rejected_prediction_tokens": rejected}
        return out

    async def outputs(self) -> AsyncIterator[tuple[int, Output]]:
        while self.pending:
            i, out = await self.queue.get()
            yield self._record(i, out)

    def _record(self, i: int, out: Output) -> tuple[int, Output]:
        self.generated[i] = out.num_generated
        if out.finish_reason is not None:
            self.pending.discard(i)
            self.reasons[i] = out.finish_reason
        return i, out

    async def collect(self, http: HTTPRequest) -> tuple[list[str], list[str | None], list[list[Scored]]]:
        """Every choice's whole text, finish reason and scored tokens; ``ClientGone`` as soon as the
        client disconnects (a watcher awaits the ASGI disconnect message beside the outputs)."""
        n = len(self.requests)
        texts, reasons, scored = [""] * n, [None] * n, [[] for _ in range(n)]
        watcher = asyncio.ensure_future(self._watch(http))
        try:
            while self.pending:
                i, out = await self.queue.get()
                if i == _GONE:
                    raise ClientGone()
                self._record(i, out)
                if out.error:
                    raise failed(out.error, out.error_status)
                text, tokens = self.piece(i, out)
                texts[i] += text
                scored[i] += tokens
                reasons[i] = out.finish_reason
        finally:
            watcher.cancel()
        return texts, reasons, scored

    async def _watch(self, http: HTTPRequest) -> None:
        """Wait for the client to go away (the body is read: the next ASGI message is the disconnect)."""
        while (await http.receive())["type"] != "http.disconnect":
            await asyncio.sleep(0.05)  # (a server that answered with more body: never spin)
        self.queue.put_nowait((_GONE, None))

    def cancel(self) -> None:
        for i in self.pending:
            self.scheduler.cancel(self.requests[i])

    def log_line(self, request_id: str, proposer: str) -> str:
        """The request's one log line: id, tokens, seconds, speculation, finish reasons -- and the
        prompt only when ``prompt_text`` is set (``--log-prompts``)."""
        stats = [r.seq.stats for r in self.requests]
        first = [r.first_token_time for r in self.requests if r.first_token_time is not None]
        fields: dict[str, Any] = {
            "id": request_id, **({"x_request_id": CURRENT.get()} if CURRENT.get() else {}),
            "n": len(self.requests), "prompt_tokens": self.prompt_tokens,
            "generated_tokens": sum(self.generated), "seconds": time.monotonic() - self.t0,
            **({"ttft": min(first) - self.t0} if first else {}), "proposer": proposer,  # (no token: no ttft)
            "drafted_tokens": sum(s.draft_tokens for s in stats), "accepted_tokens": sum(s.accepted_tokens for s in stats),
            "finish": ",".join(self.reasons)}
        if self.prompt_text is not None:
            fields["prompt"] = self.prompt_text
        return request_log_line(fields)
