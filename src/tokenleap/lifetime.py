"""``LLM.close()`` and ``with LLM(...) as llm:``: what an LLM holds freed at once, not when it is collected."""
from __future__ import annotations

import gc
import threading
from typing import Any, TypeVar

from tokenleap.errors import LLMClosedError

_Self = TypeVar("_Self", bound="Lifetime")
_CLOSED = "this LLM was closed: make a new one"


class _Released:
    """Stands in for a closed LLM's models and tokenizer: a call that got past the closed check just before
    ``close()`` reads one of them raises ``LLMClosedError``, not an AttributeError on None."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # (copy's, pickle's and hasattr's probes of special names: not there)
            raise AttributeError(name)
        raise LLMClosedError(_CLOSED)

    def __bool__(self) -> bool:
        return False


class Lifetime:
    """A base of ``LLM``: closing it, and the check every call makes first."""

    def close(self) -> None:
        """Free what this LLM holds now rather than when it is collected (as llama-cpp-python's
        ``Llama.close``): astream's scheduler thread and engine, the engine ``stream`` runs on (an engine
        being built waits for its build to end), and the models' weights, once nothing else refers to
        them. A step in flight ends first; a stream open on another thread then raises
        ``LLMClosedError`` instead of its next step, an ``astream`` likewise, and so does every later
        call. Closing again does nothing (a second close at the same time waits for the first);
        ``with LLM(...) as llm:`` closes at the block's end. Batches already running (``generate`` of
        several prompts on another thread) stop before their next iteration. It blocks until the
        scheduler's thread has ended: from a coroutine, ``await asyncio.to_thread(llm.close)``."""
        # (reentrant: a finalizer the collection below runs may close again on this thread)
        with self.__dict__.setdefault("_close_lock", threading.RLock()):
            if self.__dict__.get("_closed"):
                return
            self._closed = True  # (from here no engine is built and no stream takes another step)
            with self._coroutines_lock:
                stop, self._coroutines, self._coroutines_stop = self._coroutines_stop, None, None
            if stop is not None:
                stop()  # (the scheduler's thread ends after its iteration in flight; its requests fail)
            if self._steps.held_here():  # (closed inside a step: a finalizer, a signal handler)
                self._engine = None  # (that step's stream raises at its next check)
            else:
                with self._steps.step():  # after a step another thread has in flight
                    with self._engine_lock:  # (and after a build in progress)
                        self._engine = None
            self.target = self.draft = self.tokenizer = _Released()  # type: ignore[assignment]
            gc.collect()  # (a stream's frames may hold the engine in a cycle)

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return bool(self.__dict__.get("_closed"))

    def _check_open(self) -> None:
        if self.__dict__.get("_closed"):
            raise LLMClosedError(_CLOSED)
