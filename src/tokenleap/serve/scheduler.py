"""Continuous batching over a paged KV cache: one engine step per iteration for every running
sequence, with new requests admitted between steps.

An iteration: take new and cancelled requests -> admit waiting ones while slots and free blocks
allow -> prefill at most ``prefill_budget`` tokens in fixed-size chunks, each sequence on its own
(so a long prompt is spread over many iterations and never stalls decoding; a draft model is not
fed alongside: it catches up, a chunk a step, once the controller drafts for the batch the
sequence actually joined, and only if that pays back) -> reserve blocks for
the decode step (speculation is dropped first, then the newest running sequence is preempted:
its blocks are freed and it is recomputed later) -> ONE ``engine.step`` over every prefilled
sequence with the draft length the controller picks for the batch size about to run (ready,
prefilling, waiting and just-submitted sequences) -> hand out new text.

Other work on the model (``call``: embeddings) runs on the same thread, one call before each
iteration, so it never overlaps a step and a queue of calls does not hold decoding up.

A request that fails (an exception in its prefill, its draft or its verification) is finished with
an error; the others go on. The batch step that raised is retried one sequence at a time, which
is exact: every row of a step is computed as if alone.
"""
from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tokenleap.config import ConfigError
from tokenleap.cache.paged import PagedKVCache
from tokenleap.serve.request import QueueFullError, Request
from tokenleap.serve.results import Results
from tokenleap.serve.metrics import ServeSnapshot, ServeStats, log_line
from tokenleap.spec.proposers.base import begin_sequence

log = logging.getLogger("tokenleap.serve")


def _status(error: Exception) -> int:
    """400 for settings of the request's own that cannot be met together (found only while decoding,
    e.g. allowed tokens that a grammar rules out), else 500."""
    return 400 if isinstance(error, ConfigError) else 500


def _log_failure(error: Exception, what: str) -> None:
    if isinstance(error, ConfigError):  # the request's fault: no traceback
        log.warning("%s: %s", what, error)
    else:
        log.exception(what)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16  # sequences in the running batch
    max_waiting: int = 64  # sequences queued beyond the batch before requests are refused (see ``submit``)
    prefill_budget: int | None = None  # prompt tokens per iteration (default: the engine's chunk)
    log_interval: float = 10.0  # seconds between log lines while active; <= 0 disables

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_waiting < 0:
            raise ConfigError("max_num_seqs must be >= 1 and max_waiting >= 0")


class Scheduler(Results):
    def __init__(self, engine, config: SchedulerConfig = SchedulerConfig()) -> None:
        cache = engine.cache
        if not isinstance(cache, PagedKVCache):
            raise ConfigError("the scheduler needs an engine built on a PagedKVCache")
        if cache.num_blocks < cache.blocks_for(engine.max_len + 1):
            raise ConfigError(f"{cache.num_blocks} KV blocks of {cache.block_size} tokens cannot hold one "
                              f"sequence of {engine.max_len} tokens; add blocks or lower --max-model-len")
        self.engine, self.cfg, self.cache = engine, config, cache
        self.budget = config.prefill_budget or engine.prefill_chunk
        self.max_seqs = min(config.max_num_seqs, cache.num_slots)
        self.stats = ServeStats()
        self.running: list[Request] = []  # sorted by arrival
        self.waiting: list[Request] = []  # sorted by arrival
        self._inbox: list[Request] = []
        self._cancelled: list[Request] = []
        self._abort: str | None = None  # abort_all's message, until the next iteration ends every request
        self._closed: str | None = None  # abort_all's or shutdown's message: later submissions refused with it
        self._calls: list[tuple[Callable[[], Any], Future]] = []
        self._cond = threading.Condition()
        self._arrivals = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._last_log: ServeSnapshot | None = None
        self._short = False  # the KV pool held back a waiting sequence (or preempted one) last iteration

    @property
    def capacity(self) -> int:
        """The most sequences one submit can ever bring: the batch's places and the waiting ones."""
        return self.max_seqs + self.cfg.max_waiting

    # -- thread-safe API --------------------------------------------------------------------
    def submit(self, requests: list[Request]) -> None:
        """Queue ``requests`` (one per sequence: an HTTP request's n choices of each prompt), all or none.

        One admission rule, counted in sequences: after the submit, the sequences waiting (queued,
        just submitted, or preempted) may exceed ``max_waiting`` only by the places free in the running
        batch -- and by none while the KV pool is what holds sequences back, since a free place
        then admits nobody. ``QueueFullError`` otherwise."""
        with self._cond:
            if self._closed is not None:
                raise QueueFullError(self._closed)
            queued = len(self.waiting) + len(self._inbox)
            free = 0 if self._short else max(0, self.max_seqs - len(self.running))
            if queued + len(requests) > self.cfg.max_waiting + free:
                raise QueueFullError(f"{queued} sequences are waiting (at most {self.cfg.max_waiting} beyond "
                                     f"{free} free places in the batch) and this request adds {len(requests)} "
                                     f"(n times its prompts); retry later")
            now = time.monotonic()
            for r in requests:
                r.arrival, r.arrival_time = next(self._arrivals), now
            self._inbox.extend(requests)
            self._cond.notify()

    def cancel(self, request: Request) -> None:
        with self._cond:
            self._cancelled.append(request)
            self._cond.notify()

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the scheduler's thread before an iteration, one call per iteration (it may
        use the engine's model, never at the same time as a step); its result or exception arrives
        on the future. Split long work into several calls: steps go on between them."""
        future: Future = Future()
        with self._cond:
            if self._stopping:
                raise QueueFullError(self._closed or "the server is shutting down")
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def start(self) -> None:
        """Run the loop on a background thread (again after ``shutdown``: an app's lifespan restarts it)."""
        self._stopping, self._closed = False, None
        self._thread = threading.Thread(target=self._run, name="tokenleap-scheduler", daemon=True)
        self._thread.start()

    def shutdown(self, message: str = "the server is shutting down") -> None:
        """Stop the loop after its iteration in flight and fail what is left with ``message``; later
        submissions are refused with it (until ``start``). From the loop's own thread (a finalizer run by
        a collection inside a step), only ask it to stop."""
        with self._cond:
            self._stopping = True
            self._closed = message
            self._cond.notify()
        if self._thread is threading.current_thread():
            return
        if self._thread is not None:
            self._thread.join()
        for r in self.running + self.waiting + self._inbox:
            self._fail(r, message)
        calls, self._calls = self._calls, []
        for _, future in calls:
            future.set_exception(QueueFullError(message))

    def abort_all(self, message: str) -> None:
        """End every running and queued sequence with ``message`` (a 503; a stream gets an error event)
        at the next iteration, and refuse later submissions until ``start``; from any thread (a server
        shutting down whose grace period ran out)."""
        with self._cond:
            self._abort = self._closed = message
            self._cond.notify()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def idle(self) -> bool:
        return not (self.running or self.waiting or self._inbox or self._cancelled or self._calls
                    or self._abort is not None)

    def snapshot(self) -> ServeSnapshot:
        """The server's figures for ``/metrics``, read on the HTTP thread while the scheduler's thread
        goes on: what a step can grow is copied in one call (a dict the loop adds a proposer to while a
        Python loop walks it would raise)."""
        t = self.engine.totals
        by_proposer = dict(t.proposer_accepted)
        return ServeSnapshot(
            time=time.monotonic(), running=len(self.running), waiting=len(self.waiting) + len(self._inbox),
            blocks_used=self.cache.num_used_blocks, blocks_total=self.cache.num_blocks,
            prompt_tokens=self.stats.prompt_tokens, generation_tokens=t.new_tokens,
            preemptions=self.stats.preemptions, finished=dict(self.stats.finished), num_drafts=t.draft_steps,
            num_draft_tokens=t.draft_tokens, num_accepted_tokens=t.accepted_tokens,
            accepted_per_pos=tuple(t.position_accepted), prefix_cache_queries=self.cache.prefix_queries,
            prefix_cache_hits=self.cache.prefix_hits, tree_steps=t.tree_steps, tree_nodes=t.tree_nodes,
            accepted_per_rank=tuple(t.rank_accepted), histograms=self.stats.histograms.read(),
            accepted_by_proposer=tuple(sorted((n, a) for n, a in by_proposer.items() if n != "none")))

    # -- the loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and self.idle:
                    self._cond.wait(timeout=max(self.cfg.log_interval, 0.5))
                    self._maybe_log()
                if self._stopping:
                    return
            try:
                self.iterate()
            except Exception:  # a bug outside any one request: fail the batch, keep serving
                log.exception("scheduler iteration failed")
                for r in list(self.running):
                    self._fail(r, "internal error in the scheduler")

    def run_until_idle(self, max_iterations: int = 1_000_000, before: Callable[[], None] | None = None) -> None:
        """Drive the loop on the calling thread (tests, offline use); ``before`` runs before each iteration
        (it may raise to stop the run: a cancelled offline call)."""
        for _ in range(max_iterations):
            if self.idle:
                return
            if before is not None:
                before()
            self.iterate()
        raise RuntimeError("the scheduler did not become idle")

    def iterate(self) -> None:
        with self._cond:
            inbox, self._inbox = self._inbox, []
            cancelled, self._cancelled = self._cancelled, []
            calls, self._calls = self._calls[:1], self._calls[1:]  # one a step: the rest after it
            abort, self._abort = self._abort, None
        for fn, future in calls:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as e:  # the caller's to report
                    future.set_exception(e)
        for r in inbox:
            bisect.insort(self.waiting, r, key=lambda q: q.arrival)
        for r in cancelled:
            self._drop(r)
        for r in self.running + self.waiting if abort is not None else ():
            self._fail(r, abort, 503)  # (a client may retry elsewhere)
        self._admit()
        self._prefill()
        self._decode()
        self._maybe_log()

    # -- admission and preemption -----------------------------------------------------------
    def _admit(self) -> None:
        self._short = False
        while self.waiting and len(self.running) < self.max_seqs and self.cache.num_free_slots:
            req = self.waiting[0]
            need = self.cache.blocks_for(len(req.seq.tokens) + 1)
            spare = self.cache.num_free_blocks - self._promised() - len(self.running)  # 1 block each to grow
            if need > spare and self.running:
                self._short = True
                return
            self.waiting.pop(0)
            try:
                self.engine.attach(req.seq)
            except Exception as e:
                self._fail(req, f"could not start the request: {e}", _status(e))
                continue
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            bisect.insort(self.running, req, key=lambda q: q.arrival)

    def _promised(self) -> int:
        """Blocks the sequences still prefilling will take."""
        return sum(max(0, self.cache.blocks_needed(r.seq.slot, len(r.seq.tokens)))
                   for r in self.running if not self.engine.ready(r.seq))

    def _make_room(self, req: Request, length: int) -> bool:
        """Reserve blocks for ``req`` to hold ``length`` tokens, preempting newer sequences."""
        while not self.cache.can_reserve(req.seq.slot, length):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        self.cache.reserve(req.seq.slot, length)
        return True

    def _preempt(self, req: Request) -> None:
        self.engine.detach(req.seq)
        self.running.remove(req)
        bisect.insort(self.waiting, req, key=lambda q: q.arrival)
        self.stats.preemptions += 1
        self._short = True

    # -- prefill and decode -----------------------------------------------------------------
    def _prefill(self) -> None:
        budget = self.budget
        for req in [r for r in self.running if not self.engine.ready(r.seq)]:
            while budget > 0 and req in self.running and not self.engine.ready(req.seq):
                _, end, _ = self.engine.prefill_window(req.seq)
                if not self._make_room(req, end):
                    break
                try:
                    rows = self.engine.prefill_step(req.seq, draft_alongside=False)
                except Exception as e:
                    _log_failure(e, f"prefill failed for sequence {req.seq.seq_id}")
                    self._fail(req, f"prefill failed: {e}", _status(e))
                    break
                budget -= rows
                if rows == 0:
                    break
            if req in self.running and req.seq.num_generated > 0:
                self._count_prompt(req)
                self._emit(req)
            if budget <= 0:
                return

    def _decode(self) -> None:
        batch = [r for r in self.running if self.engine.ready(r.seq) and not r.seq.finished]
        if not batch:
            return
        # judged at the batch about to run: sequences still prefilling or waiting (or just submitted) join
        # within a few steps, so drafting (and a draft's catch-up) for the few ready now would not pay
        coming = len(self.running) + len(self.waiting) + len(self._inbox)  # len() of a list: no lock needed
        k = self.engine.choose_k([r.seq for r in batch], min(self.max_seqs, coming))
        batch, k = self._reserve_decode(batch, k)
        if not batch:
            return
        try:
            self.engine.step([r.seq for r in batch], k)
        except Exception as e:
            _log_failure(e, "a batched step failed; retrying its sequences one by one")
            self._step_alone(batch, k)
        for r in batch:
            if not r.done:
                self._emit(r)

    def _reserve_decode(self, batch: list[Request], k: int) -> tuple[list[Request], int]:
        """Blocks for every sequence's step; when short, first drop the draft, then preempt."""
        while True:
            need = sum(self.cache.blocks_needed(r.seq.slot, self._step_len(r, k)) for r in batch)
            if need <= self.cache.num_free_blocks:
                break
            if k > 0:
                k = 0
                continue
            victim = self.running[-1]
            self._preempt(victim)
            batch = [r for r in batch if r is not victim]
        for r in batch:
            self.cache.reserve(r.seq.slot, self._step_len(r, k))
        return batch, k

    def _step_len(self, req: Request, k: int) -> int:
        """Cache entries a step may write: the last token and k drafts -- a token tree's nodes when
        the engine drafts trees -- and the proposer's auxiliary rows (lookahead's window)."""
        rows = max(k, self.engine._tree_budget(req.seq)) if k > 0 and self.engine.tree_nodes else k
        rows += self.engine.aux_budget(req.seq, rows) if k > 0 else 0
        return min(len(req.seq.tokens) + rows, self.engine.max_len)

    def _step_alone(self, batch: list[Request], k: int) -> None:
        for r in batch:
            self._repair(r)
        for r in batch:
            if r.seq.finished or r not in self.running:
                continue
            alone, k1 = self._reserve_decode([r], k)
            if not alone:
                continue
            try:
                self.engine.step([r.seq], k1)
            except Exception as e:
                _log_failure(e, f"step failed for sequence {r.seq.seq_id}")
                self._repair(r)
                self._fail(r, f"decoding failed: {e}", _status(e))

    def _repair(self, req: Request) -> None:
        """Undo a failed step's partial effects: cache entries past the tokens, proposer state."""
        seq, eng = req.seq, self.engine
        if seq.slot < 0 or seq.finished:
            return
        self.cache.truncate(seq.slot, min(self.cache.lengths[seq.slot], len(seq.tokens) - 1))
        if eng.proposer is not None:
            eng.proposer.end(seq.seq_id)
            begin_sequence(eng.proposer, seq.seq_id, seq.prompt, seq.params.prediction)

    def _maybe_log(self) -> None:
        if self.cfg.log_interval <= 0:
            return
        now = self.snapshot()
        prev = self._last_log
        if prev is None:
            self._last_log = now
        elif now.time - prev.time >= self.cfg.log_interval:
            if now.running or now.waiting or now.generation_tokens != prev.generation_tokens:
                log.info(log_line(prev, now))
            self._last_log = now
