"""How many more tokens a running sequence is likely to generate, from the lengths of the sequences
that finished recently: what a draft model's catch-up on a prompt is weighed against."""
from __future__ import annotations

import statistics
from collections import deque

from tokenleap.spec.sequence import Sequence


class LengthHistory:
    """The last ``keep`` finished sequences: (tokens generated, stopped by itself?). One cut off by
    its max_tokens or the context only says it would have run at least that long."""

    def __init__(self, keep: int = 64) -> None:
        self._lengths: deque[tuple[int, bool]] = deque(maxlen=keep)

    def finished(self, seq: Sequence) -> None:
        self._lengths.append((seq.num_generated, seq.finish_reason != "length"))

    def expected_remaining(self, seq: Sequence) -> float:
        """Tokens ``seq`` may still generate: at most ``max_tokens`` left (a chat request without
        max_tokens: the whole context); with recently finished sequences, the median length (of an
        even count, the lower middle) of those that ran longer than ``seq`` so far and of one more
        guess, twice what ``seq`` generated, less what it generated (none ran longer: as many
        again). A sequence cut off by its max_tokens ran at least that long: past ``seq``'s tokens
        it counts as running to ``seq``'s limit, short of them it says nothing (a warm-up of 8
        tokens must not cap a long request's prediction at 8). The guess and the lower middle keep a
        lone cut-off answer from predicting the whole limit: a short code completion after one long
        answer is not judged worth a draft model's catch-up on its prompt."""
        done, cap = seq.num_generated, seq.params.max_tokens - seq.num_generated
        longer = [n if stopped else float("inf") for n, stopped in self._lengths if n > done]
        if longer:
            return min(cap, statistics.median_low(longer + ([2 * done] if done else [])) - done)
        if any(stopped for _, stopped in self._lengths):
            return min(cap, max(done, 1))
        return cap
