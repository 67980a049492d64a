"""One HTTP request's share of the server: its sequences' ``scheduler.Request``s and the
``asyncio.Queue`` the scheduler thread delivers their outputs on (``loop.call_soon_threadsafe``)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import Request as HTTPRequest

from .protocol import APIError
from .responses import Scored, usage
from .scheduler import Output, Request, Scheduler

_POLL_SECONDS = 0.5  # how often a non-streaming request checks that its client is still there


class ClientGone(Exception):
    """The client of a non-streaming request went away."""


class Job:
    """One HTTP request's choices and the queue their outputs arrive on."""

    def __init__(self, scheduler: Scheduler, seqs: list, prompt_tokens: int, echo: list[str] | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.scheduler, self.prompt_tokens = scheduler, prompt_tokens
        self.queue: asyncio.Queue[tuple[int, Output]] = asyncio.Queue()
        self.requests = [Request(s, partial(self._deliver, loop, i)) for i, s in enumerate(seqs)]
        self.pending = set(range(len(seqs)))
        self.generated = [0] * len(seqs)
        self.echo = echo  # per choice, the prompt text that starts it (completions' echo)
        self.started = [False] * len(seqs)

    def piece(self, i: int, out: Output) -> tuple[str, list[Scored]]:
        """Choice ``i``'s new text and scored tokens in ``out`` (the echoed prompt before the first)."""
        text, scored = out.text, [(lp.token_id, lp) for lp in out.logprobs]
        if not self.started[i]:
            self.started[i] = True
            if self.echo is not None:
                text = self.echo[i] + text
                if out.prompt_logprobs is not None:
                    scored = list(zip(self.requests[i].seq.prompt, out.prompt_logprobs)) + scored
        return text, scored

    def _deliver(self, loop: asyncio.AbstractEventLoop, index: int, out: Output) -> None:
        loop.call_soon_threadsafe(self.queue.put_nowait, (index, out))  # runs on the scheduler thread

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, sum(self.generated), max(r.seq.cached_tokens for r in self.requests))

    async def outputs(self) -> AsyncIterator[tuple[int, Output]]:
        while self.pending:
            i, out = await self.queue.get()
            yield self._record(i, out)

    def _record(self, i: int, out: Output) -> tuple[int, Output]:
        self.generated[i] = out.num_generated
        if out.finish_reason is not None:
            self.pending.discard(i)
        return i, out

    async def collect(self, http: HTTPRequest) -> tuple[list[str], list[str | None], list[list[Scored]]]:
        n = len(self.requests)
        texts, reasons, scored = [""] * n, [None] * n, [[] for _ in range(n)]
        while self.pending:
            try:
                i, out = self._record(*await asyncio.wait_for(self.queue.get(), _POLL_SECONDS))
            except TimeoutError:
                if await http.is_disconnected():
                    raise ClientGone() from None
                continue
            if out.error:
                raise APIError(500, f"the request failed: {out.error}", "server_error")
            text, tokens = self.piece(i, out)
            texts[i] += text
            scored[i] += tokens
            reasons[i] = out.finish_reason
        return texts, reasons, scored

    def cancel(self) -> None:
        for i in self.pending:
            self.scheduler.cancel(self.requests[i])
