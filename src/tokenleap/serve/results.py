"""Handing a request's new text and its end to its consumer, and recording what it cost in the
server's figures: ``Scheduler``'s base (``scheduler.py`` decides what runs; these calls report it)."""
from __future__ import annotations

import logging
import time

from tokenleap.serve.metrics import RequestTiming, ServeStats
from tokenleap.serve.request import Output, Request

log = logging.getLogger("tokenleap.serve")


class Results:
    """The scheduler's result calls; the attributes below are ``Scheduler``'s."""

    running: list[Request]
    waiting: list[Request]
    stats: ServeStats

    def _count_prompt(self, req: Request) -> None:
        if not req.counted_prompt:
            req.counted_prompt = True
            self.stats.prompt_tokens += len(req.seq.prompt)

    def _emit(self, req: Request) -> None:
        seq = req.seq
        text, new_ids = seq.take_text(), seq.generated[req.sent:]
        logprobs = seq.logprobs[req.sent:] if seq.params.logprobs is not None else []
        prompt_logprobs = list(seq.prompt_logprobs) if req.sent == 0 and seq.params.prompt_logprobs is not None \
            else None
        req.sent = seq.num_generated
        if new_ids:
            now = time.monotonic()
            if req.first_token_time is None:
                req.first_token_time = now
                self.stats.histograms.record_first_token(now - req.arrival_time)
            else:
                self.stats.histograms.record_gap(now - req.last_token_time)
            req.last_token_time = now
        finished = seq.finished
        out = Output(text, new_ids, seq.num_generated, seq.finish_reason if finished else None,
                     logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        if finished:  # recorded (metrics, freed blocks) before the consumer can see the end
            self._finish(req, seq.finish_reason or "stop")
        if text or new_ids or finished:
            self._send(req, out)

    def _finish(self, req: Request, reason: str) -> None:
        self.engine.release(req.seq)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.done = True
        self.stats.record_finish(reason)
        if reason in ("stop", "length") and req.first_token_time is not None:  # not aborted, not failed
            self.stats.histograms.record(RequestTiming(
                req.arrival_time, req.scheduled_time or req.arrival_time, req.first_token_time, req.last_token_time,
                len(req.seq.prompt), req.seq.num_generated))

    def _fail(self, req: Request, message: str, status: int = 500) -> None:
        if req.done:
            return
        req.error = message
        self._finish(req, "error")
        self._send(req, Output("", [], req.seq.num_generated, "error", message, error_status=status))

    def _drop(self, req: Request) -> None:
        """A cancelled request (client gone): free its slot and blocks now, send nothing."""
        if not req.done:
            self._finish(req, "abort")

    @staticmethod
    def _send(req: Request, out: Output) -> None:
        try:
            req.on_output(out)
        except Exception:  # a consumer that went away must not stop the loop
            log.debug("could not deliver an output", exc_info=True)
