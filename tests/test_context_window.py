"""``drop_oldest`` (the Responses API's ``truncation: "auto"``): the fewest oldest turns dropped, found by
bisection, equal to dropping one turn at a time; system messages kept, orphaned tool results dropped."""
from __future__ import annotations

import pytest

from tokenleap.serve.context_window import drop_oldest


def encode(messages):
    return [0] * sum(2 + len(m["content"]) for m in messages)  # a length only: 2 a turn and its characters


def linear(messages, limit):
    """The reference: drop the oldest non-system turn (and tool results it leaves first) until it fits."""
    head = next(i for i, m in enumerate(messages) if m["role"] != "system")
    rest = messages[head:]
    while len(encode(messages[:head] + rest)) > limit and len(rest) > 1:
        rest = rest[1:]
        while len(rest) > 1 and rest[0]["role"] == "tool":
            rest = rest[1:]
    return messages[:head] + rest


@pytest.mark.parametrize("limit", [10, 25, 40, 60, 90, 200])
def test_fewest_oldest_turns_dropped(limit):
    msgs = [{"role": "system", "content": "s" * 5}]
    for i in range(6):
        msgs += [{"role": "user", "content": "u" * (3 + i)}, {"role": "assistant", "content": "call"},
                 {"role": "tool", "content": "r" * 4}, {"role": "assistant", "content": "a" * 6}]
    msgs.append({"role": "user", "content": "last"})
    kept, ids = drop_oldest(msgs, encode, limit + 3, 3)  # room for a 3-token reply
    assert kept == linear(msgs, limit) and ids == encode(kept)
    assert kept[0]["role"] == "system" and kept[-1]["content"] == "last"
    assert kept[1]["role"] != "tool"  # no tool result without its call
    if len(encode(msgs)) <= limit:
        assert kept is msgs


def test_a_last_turn_too_long_is_left_to_the_budget_check():
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b" * 50}]
    kept, ids = drop_oldest(msgs, encode, 20, None)
    assert kept == msgs[1:] and len(ids) > 20  # (check_max_tokens then gives the prompt's 400)
