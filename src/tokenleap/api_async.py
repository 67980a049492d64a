"""``LLM``'s coroutines for asyncio applications (a FastAPI handler, an async agent): ``astream``,
``agenerate``, ``achat``.

The blocking calls run on worker threads, so the application's event loop keeps answering while
tokens are computed (the model's products release the GIL). ``astream`` steps its stream one chunk
per worker call: cancelling the task that reads it, or leaving its ``async for``, stops the generation
after the step in flight and frees its slot (wrap it in ``contextlib.aclosing`` to have that happen at
once rather than when the generator is collected). ``agenerate`` and ``achat`` run ``generate`` /
``chat`` on a thread: cancelling them stops the generation before its next step (``cancellation.py``).
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

from tokenleap.cancellation import cancel_scope
from tokenleap.config import SamplingParams
from tokenleap.errors import GenerationCancelled
from tokenleap.outputs import RequestOutput, StreamChunk

_DONE = object()


class AsyncCalls:
    """The coroutine forms of ``LLM``'s calls (a base of ``LLM``, whose ``stream``, ``generate`` and
    ``chat`` they run)."""

    async def astream(self, prompt: str | list[int], params: SamplingParams | None = None,
                      chat: bool = False) -> AsyncIterator[StreamChunk]:
        """``stream``'s chunks, each computed on a worker thread; ending early (a break, a cancelled
        task) stops the generation after the step in flight and frees its slot."""
        steps = self.stream(prompt, params, chat)
        lock = threading.Lock()  # the generator runs on one thread at a time: a step, or the close after it

        def step() -> Any:
            with lock:
                return next(steps, _DONE)

        def close() -> None:
            with lock:
                steps.close()

        loop = asyncio.get_running_loop()
        in_flight = None
        try:
            while True:
                in_flight = loop.run_in_executor(None, step)
                chunk = await in_flight
                in_flight = None
                if chunk is _DONE:
                    return
                yield chunk
        finally:
            if in_flight is not None:  # cancelled mid-step: a thread closes the stream once the step ends
                threading.Thread(target=close, name="tokenleap-astream-close", daemon=True).start()
            else:
                close()

    async def agenerate(self, prompts: Any, params: Any = None, chat: bool = False,
                        **kwargs: Any) -> list[RequestOutput]:
        """``generate`` on a worker thread (the same arguments and outputs); cancelled, it stops before the
        next step and frees what it held."""
        return await _cancellable(self.generate, prompts, params, chat, **kwargs)

    async def achat(self, messages: Any, params: Any = None, **kwargs: Any) -> list[RequestOutput]:
        """``chat`` on a worker thread (the same arguments and outputs); cancelled, as ``agenerate``."""
        return await _cancellable(self.chat, messages, params, **kwargs)


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


__all__ = ["AsyncCalls"]
