"""A lookup source that keeps adapting to the target: the outputs of the sequences it finished.

Prompt lookup (``ngram.py``) finds a sequence's recent tokens earlier in its own text. Across
requests the target also repeats itself -- the same idioms in answers to similar questions, the
same reply regenerated with another seed, tool calls and boilerplate an agent asks for again and
again -- so the n-gram drafters also look the suffix up in this pool of earlier outputs (the idea of
SuffixDecoding, Oliaro et al. 2024, with n-gram tables instead of suffix trees). Every output is
the target's own verified text, so the pool follows what this target writes on this traffic,
without training anything.

The pool holds up to ``max_tokens`` tokens of the latest outputs (the oldest leave first, their
entries with them). For each n in ``n_min .. n_max`` it maps an n-gram to where its latest
``PER_KEY`` occurrences end. Lookups are dictionary reads, as cheap as prompt lookup's; adding or
dropping an output costs a few milliseconds a thousand tokens, once per finished sequence. About
0.7 KB a token held (32768 tokens: about 22 MiB).
"""
from __future__ import annotations

from collections import OrderedDict

PER_KEY = 4  # latest occurrences kept per n-gram


class OutputPool:
    def __init__(self, max_tokens: int = 1 << 15, n_min: int = 3, n_max: int = 8, min_output: int = 4) -> None:
        if max_tokens < 1 or not 1 <= n_min <= n_max:
            raise ValueError(f"need max_tokens >= 1 and 1 <= n_min <= n_max, got {max_tokens}, {n_min}, {n_max}")
        self.max_tokens, self.n_min, self.n_max, self.min_output = max_tokens, n_min, n_max, min_output
        self._outputs: OrderedDict[int, list[int]] = OrderedDict()  # output id -> its tokens, oldest first
        self._next_id = 0
        self._size = 0  # tokens held
        # n -> n-gram -> (output id, position right after the occurrence), latest last
        self._tables: dict[int, dict[tuple[int, ...], list[tuple[int, int]]]] = {n: {} for n in range(n_min, n_max + 1)}

    def __len__(self) -> int:
        return self._size

    @property
    def outputs(self) -> int:
        return len(self._outputs)

    def add(self, tokens: list[int]) -> None:
        """Keep a finished sequence's output (its generated tokens; shorter than ``min_output``: not kept)."""
        tokens = list(tokens[-self.max_tokens:])
        if len(tokens) < max(self.min_output, self.n_min + 1):
            return
        oid = self._next_id
        self._next_id += 1
        self._outputs[oid] = tokens
        self._size += len(tokens)
        self._index(oid, tokens)
        while self._size > self.max_tokens:
            gone, gone_tokens = self._outputs.popitem(last=False)
            self._size -= len(gone_tokens)
            self._unindex(gone, gone_tokens)

    def clear(self) -> None:
        self._outputs.clear()
        self._size = 0
        for table in self._tables.values():
            table.clear()

    def continuation(self, context: list[int], n: int, length: int) -> list[int]:
        """Up to ``length`` tokens that followed the latest kept occurrence of ``context``'s last ``n``
        tokens in an earlier output; empty when none did (or n is outside the pool's range)."""
        for oid, follow in reversed(self.occurrences(context, n)):
            cont = self.following(oid, follow, length)
            if cont:
                return cont
        return []

    def occurrences(self, context: list[int], n: int) -> list[tuple[int, int]]:
        """(output id, position after the match) of the kept occurrences of ``context``'s last ``n``
        tokens, oldest first."""
        table = self._tables.get(n)
        if table is None or len(context) < n:
            return []
        return list(table.get(tuple(context[-n:]), ()))

    def following(self, oid: int, follow: int, length: int) -> list[int]:
        """The tokens of output ``oid`` from ``follow``, at most ``length``."""
        return self._outputs[oid][follow: follow + length]

    def _ngrams(self, tokens: list[int]):
        """(table, n-gram, position right after it) for every n-gram of ``tokens`` with a token after it."""
        for end in range(len(tokens) - 1):
            for n, table in self._tables.items():
                if end + 1 >= n:
                    yield table, tuple(tokens[end + 1 - n: end + 1]), end + 1

    def _index(self, oid: int, tokens: list[int]) -> None:
        for table, key, follow in self._ngrams(tokens):
            at = table.setdefault(key, [])
            at.append((oid, follow))
            if len(at) > PER_KEY:
                del at[0]

    def _unindex(self, oid: int, tokens: list[int]) -> None:
        for table, key, _ in self._ngrams(tokens):
            at = table.get(key)
            if at is not None:
                kept = [e for e in at if e[0] != oid]
                if kept:
                    table[key] = kept
                else:
                    del table[key]
