"""One engine's steps taken one at a time by the threads that share it (``LLM.stream`` on several).

A stream's generator frees its sequence when closed, which steps the engine's state too, so the close
takes the gate as a step does. A close that runs on a thread inside a step -- an abandoned generator
collected by a garbage collection the step set off -- cannot wait for the gate its own thread holds:
it is deferred to the end of that step instead.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Generator, Iterator


class StepGate:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread inside a step
        self._deferred: list[Generator] = []  # closes asked for inside a step, run at its end

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Hold the gate for one step (then run the closes deferred during it)."""
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                try:
                    self._close_deferred()
                finally:
                    self._owner = None

    def _close_deferred(self) -> None:
        """Close every deferred generator (still the owner: a close one of them sets off is deferred too),
        each whatever the others do; the first failure is raised after all are closed."""
        error: BaseException | None = None
        while self._deferred:
            try:
                self._deferred.pop().close()
            except BaseException as e:  # (a KeyboardInterrupt too: the rest are closed first)
                error = error or e
        if error is not None:
            raise error

    def held_here(self) -> bool:
        """Whether the calling thread is inside a step."""
        return self._owner == threading.get_ident()

    def close(self, steps: Generator) -> None:
        """Close a stream's engine generator, between steps."""
        if self.held_here():
            self._deferred.append(steps)
            return
        with self.step():
            steps.close()


__all__ = ["StepGate"]
