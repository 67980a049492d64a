"""Stopping a blocking generation between steps when its caller gives up.

``agenerate`` / ``achat`` run ``generate`` / ``chat`` on a worker thread; a cancelled coroutine sets
the event of the scope that thread runs in, and the decoding loops (``LLM.stream``'s, the offline
batch's) check it before each step and raise ``GenerationCancelled``, freeing the slots and blocks
the call held. A thread outside any scope is never cancelled: the blocking calls pay one attribute
lookup a step.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from tokenleap.errors import GenerationCancelled

_scope = threading.local()


@contextlib.contextmanager
def cancel_scope(event: threading.Event) -> Iterator[None]:
    """Calls on this thread inside the block stop at their next step once ``event`` is set."""
    outer = getattr(_scope, "event", None)
    _scope.event = event
    try:
        yield
    finally:
        _scope.event = outer


def check_cancelled() -> None:
    """Raise ``GenerationCancelled`` where this thread's scope was cancelled."""
    event = getattr(_scope, "event", None)
    if event is not None and event.is_set():
        raise GenerationCancelled("the call was cancelled")


__all__ = ["cancel_scope", "check_cancelled"]
