"""``StepGate``: steps one at a time; a close asked for inside a step on the same thread waits for the
step's end; a deferred close that fails neither stops the others nor leaves the gate held."""
from __future__ import annotations

import pytest

from tokenleap.step_gate import StepGate


def _stream(log: list, name: str, fail: bool = False):
    try:
        yield name
    finally:
        log.append(name)
        if fail:
            raise RuntimeError(f"{name} failed to close")


def test_closes_inside_a_step_wait_for_its_end_and_a_failing_one_leaves_the_gate_usable():
    gate, log = StepGate(), []
    streams = [_stream(log, "a"), _stream(log, "b", fail=True), _stream(log, "c")]
    for s in streams:
        next(s)
    with pytest.raises(RuntimeError, match="b failed to close"):
        with gate.step():
            for s in streams:
                gate.close(s)  # (inside the step: deferred)
            assert log == []
    assert sorted(log) == ["a", "b", "c"]  # every one closed, the failure raised after
    late = _stream(log, "d")
    next(late)
    gate.close(late)  # outside a step: at once (the gate is not left with this thread as its owner)
    assert log[-1] == "d"
    with gate.step():  # and the next step takes the gate
        pass
