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
                while self._deferred:  # (still the owner: a close set off by these is deferred too)
                    self._deferred.pop().close()
                self._owner = None

    def close(self, steps: Generator) -> None:
        """Close a stream's engine generator, between steps."""
        if self._owner == threading.get_ident():
            self._deferred.append(steps)
            return
        with self.step():
            steps.close()


__all__ = ["StepGate"]
