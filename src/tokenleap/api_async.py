"""``LLM``'s coroutines for asyncio applications (a FastAPI handler, an async agent): ``astream``,
``agenerate``, ``achat``.

``astream`` requests join one scheduler of this LLM's, on a thread of its own: every stream open at
once is decoded together (continuous batching, as the server runs it, over a paged engine of its own
with ``max_num_seqs`` slots and ``tokenleap serve``'s default KV budget), those beyond it wait their
turn, and the event loop keeps answering meanwhile. Each output is token-identical to the request
decoded alone (row-exact batching, seeded noise by position). Cancelling the reading task, or leaving
its ``async for``, drops the request at the scheduler's next iteration and frees its slot
(``contextlib.aclosing`` makes a ``break`` do that at once, not when the generator is collected); when
the LLM is closed or collected, or the interpreter exits, the step in flight ends, then the scheduler's
thread, and its engine is freed. ``agenerate`` and ``achat`` run ``generate`` / ``chat`` on a worker thread:
cancelling them stops the generation before its next step (``cancellation.py``).
"""
from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any

from tokenleap.cancellation import cancel_scope
from tokenleap.config import ConfigError, SamplingParams
from tokenleap.errors import GenerationCancelled, TokenleapError
from tokenleap.outputs import RequestOutput, StreamChunk, request_output
from tokenleap.serve.request import QueueFullError

# requests queued beyond the running batch before astream refuses one: the API queues, it does not shed load
_MAX_WAITING = 1 << 16


class GenerationFailed(TokenleapError):
    """A streamed request the engine could not finish (the message says why)."""


class AsyncCalls:
    """The coroutine forms of ``LLM``'s calls (a base of ``LLM``, whose ``stream``, ``generate`` and
    ``chat`` they run)."""

    async def astream(self, prompt: Any, params: SamplingParams | None = None, chat: bool = False, *,
                      sampling_params: SamplingParams | None = None) -> AsyncIterator[StreamChunk]:
        """``stream``'s chunks, decoded together with every other ``astream`` open on this LLM; ending
        early (a break, a cancelled task) drops the request at the next iteration and frees its slot."""
        from tokenleap.api_inputs import _checked, _one_of, _shown, _unwrapped
        from tokenleap.serve.request import Request
        prompt, params = _unwrapped(prompt), _checked(_one_of(params, sampling_params))
        if params.n > 1:
            raise ConfigError(f"astream gives one completion (n is {params.n}): agenerate or achat give n")
        # off the event loop: a long prompt's tokens, the first call's engine, a grammar's compilation
        ids = await asyncio.to_thread(self.encode, prompt, chat)
        scheduler = await asyncio.to_thread(self._coroutine_scheduler)
        seq = await asyncio.to_thread(scheduler.engine.create, ids, params)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        request = Request(seq, lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out))
        t0 = time.perf_counter()
        try:
            scheduler.submit([request])
        except QueueFullError:
            self._check_open()  # (closed since: its scheduler refuses)
            raise
        generated: list[int] = []
        try:
            while True:
                out = await outputs.get()
                if out.error:
                    self._check_open()  # (failed by close())
                    raise (ConfigError if out.error_status == 400 else GenerationFailed)(out.error)
                generated += out.token_ids
                if out.finish_reason is None:
                    yield StreamChunk(out.text, list(generated), False)
                    continue
                seq.stats.total_seconds = time.perf_counter() - t0  # (the scheduler is done with seq)
                yield StreamChunk(out.text, list(generated), True,
                                  request_output(_shown(prompt, ids), seq, seq.stats.total_seconds))
                return
        finally:
            scheduler.cancel(request)  # (a finished request: nothing to drop)

    def _coroutine_scheduler(self):
        """The scheduler ``astream`` requests join, and its engine (``serve.batch.coroutine_engine``), built
        and started on first use; again if its thread has died."""
        with self._coroutines_lock:
            self._check_open()
            scheduler = self._coroutines
            if scheduler is None or not scheduler.alive:
                from tokenleap.serve.batch import coroutine_engine
                from tokenleap.serve.scheduler import Scheduler, SchedulerConfig
                if self._coroutines_stop is not None:  # (a dead thread's: let go of its engine)
                    self._coroutines_stop()
                engine = coroutine_engine(self)
                scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=engine.cache.num_slots,
                                                              max_waiting=_MAX_WAITING, log_interval=0))
                scheduler.start()
                # stops it when the LLM is collected, at exit, or at close()
                self._coroutines_stop = weakref.finalize(self, _stop, scheduler)
                self._coroutines = scheduler
        return scheduler

    async def agenerate(self, prompts: Any, params: Any = None, chat: bool = False,
                        **kwargs: Any) -> list[RequestOutput]:
        """``generate`` on a worker thread (the same arguments and outputs); cancelled, it stops before the
        next step and frees what it held."""
        return await _cancellable(self.generate, prompts, params, chat, **kwargs)

    async def achat(self, messages: Any, params: Any = None, **kwargs: Any) -> list[RequestOutput]:
        """``chat`` on a worker thread (the same arguments and outputs); cancelled, as ``agenerate``."""
        return await _cancellable(self.chat, messages, params, **kwargs)


def _stop(scheduler) -> None:
    """Stop a scheduler whose LLM is gone or whose interpreter is exiting: its step in flight ends, then its
    thread, and the engine it held (a KV cache of up to the serving budget) is freed with it. A daemon
    thread still inside a step when the interpreter finalizes aborts the process."""
    if scheduler.alive:
        scheduler.shutdown("this LLM was closed, or collected, or the interpreter is exiting")


async def _cancellable(call: Any, *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)`` on a worker thread, told to stop when the awaiting task is cancelled."""
    event = threading.Event()

    def run() -> Any:
        with cancel_scope(event):
            try:
                return call(*args, **kwargs)
            except GenerationCancelled:
                return None  # (nobody awaits it any more)
    try:
        return await asyncio.to_thread(run)
    except asyncio.CancelledError:
        event.set()
        raise


__all__ = ["AsyncCalls", "GenerationFailed"]
