"""``LLM.close()`` and ``with LLM(...) as llm:``: what an LLM holds freed at once, not when it is collected."""
from __future__ import annotations

import gc

from tokenleap.errors import LLMClosedError


class Lifetime:
    """A base of ``LLM``: closing it, and the check every call makes first."""

    def close(self) -> None:
        """Free what this LLM holds now rather than when it is collected (as llama-cpp-python's
        ``Llama.close``): astream's scheduler thread and engine, the engine ``stream`` runs on, and the
        models' weights, once nothing else refers to them. A step in flight ends first; a stream open
        on another thread then raises ``LLMClosedError`` before its next step, an ``astream``
        likewise, and so does every later call. Closing again does nothing; ``with LLM(...) as llm:``
        closes at the block's end. Batches already running (``generate`` of several prompts on another
        thread) stop before their next iteration."""
        if self._closed:
            return
        self._closed = True
        with self._coroutines_lock:
            stop, self._coroutines, self._coroutines_stop = self._coroutines_stop, None, None
        if stop is not None:
            stop()  # (the scheduler's thread ends after its iteration in flight; its requests fail)
        with self._steps.step():  # after a step another thread has in flight
            self._engine = None
        self.target = self.draft = self.tokenizer = None  # type: ignore[assignment]
        gc.collect()  # (a stream's frames may hold the engine in a cycle)

    def __enter__(self) -> "Lifetime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self.__dict__.get("_closed"):
            raise LLMClosedError("this LLM was closed: make a new one")
