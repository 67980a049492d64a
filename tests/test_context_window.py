"""``fit_turns`` (Ollama's ``num_ctx``, the Responses API's ``truncation: "auto"``): the fewest oldest
turns dropped, found by bisection, equal to trying every cut at a user turn in order; system and
developer messages and the last message kept; no tool result left without its call."""
from __future__ import annotations

import pytest

from tokenleap.serve.context_window import fit_turns


def encode(messages):
    return [0] * sum(2 + len(m["content"]) for m in messages)  # a length only: 2 a turn and its characters


def linear(messages, limit):
    """The reference: cut before the earliest user turn (or the last message) that makes the rest fit."""
    def keep(cut):
        return [m for i, m in enumerate(messages) if i >= cut or m["role"] in ("system", "developer")]
    cuts = [i for i, m in enumerate(messages) if 0 < i < len(messages) - 1 and m["role"] == "user"]
    for cut in [0] + cuts + [len(messages) - 1]:
        if len(encode(keep(cut))) <= limit:
            return keep(cut)
    return keep(len(messages) - 1)


@pytest.mark.parametrize("limit", [10, 25, 40, 60, 90, 200])
def test_fewest_oldest_turns_dropped(limit):
    msgs = [{"role": "system", "content": "s" * 5}]
    for i in range(6):
        msgs += [{"role": "user", "content": "u" * (3 + i)}, {"role": "assistant", "content": "call"},
                 {"role": "tool", "content": "r" * 4}, {"role": "assistant", "content": "a" * 6}]
        if i == 2:
            msgs.append({"role": "developer", "content": "d" * 3})
    msgs.append({"role": "user", "content": "last"})
    kept, ids = fit_turns(msgs, encode, limit)
    assert kept == linear(msgs, limit) and ids == encode(kept)
    assert kept[0]["role"] == "system" and kept[-1]["content"] == "last"
    assert any(m["role"] == "developer" for m in kept)
    rest = [m for m in kept if m["role"] not in ("system", "developer")]
    assert rest[0]["role"] == "user"  # no assistant turn or tool result first
    if len(encode(msgs)) <= limit:
        assert kept is msgs
