"""How much of a reply's end could still become a stop string, kept up to date as text arrives.

A stream holds back the text's longest ending that begins some stop string, until the stop string
completes or can no longer. Re-testing every prefix of every stop string against the text's end
after each token costs the square of a stop string's length a token (a 4,000-character stop string:
~0.07 s a token, on the scheduler's thread); a Knuth-Morris-Pratt automaton per stop string reads
each new character once instead.
"""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1024)
def _failure(stop: str) -> tuple[int, ...]:
    """KMP's prefix function: entry i is the length of the longest proper prefix of stop[:i + 1]
    that is also its suffix."""
    fail = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return tuple(fail)


class OpenStops:
    """For one growing text: the length of its longest ending that is a proper prefix of a stop
    string (what a stream holds back). ``open_length(text)`` reads only what was added to ``text``
    since the last call."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.fails = [_failure(s) for s in self.stops]
        self.states = [0] * len(self.stops)  # per stop string: its longest prefix ending the text read
        self.read = 0  # characters of the text read so far

    def open_length(self, text: str) -> int:
        new = text[self.read:]
        self.read = len(text)
        longest = 0
        for j, (stop, fail) in enumerate(zip(self.stops, self.fails)):
            state = self.states[j]
            for ch in new:
                if state == len(stop):  # a whole match (inside min_tokens): go on from its border
                    state = fail[state - 1]
                while state and ch != stop[state]:
                    state = fail[state - 1]
                if ch == stop[state]:
                    state += 1
            self.states[j] = state
            open_now = state if state < len(stop) else fail[state - 1]
            longest = max(longest, open_now)
        return longest
