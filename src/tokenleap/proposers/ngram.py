"""Prompt lookup / n-gram drafting: find the latest earlier occurrence of the sequence's
longest recent suffix (n from ngram_max down to ngram_min) and propose what followed it.

An index from n-gram to the positions where it ends is kept per sequence and extended
incrementally, so a proposal costs O(ngram_max) dictionary look-ups, not a scan of the text.
"""
from __future__ import annotations

import torch

from ..config import SamplingParams
from .base import Draft, DraftRequest


class _Index:
    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.indexed = 0  # tokens[:indexed] are in the tables
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}

    def extend(self, tokens: list[int]) -> None:
        """Index every n-gram ending before the last token (the suffix itself must not match itself)."""
        stop = len(tokens) - 1
        for end in range(self.indexed, stop):
            for n, table in self.tables.items():
                if end + 1 >= n:
                    table[tuple(tokens[end + 1 - n : end + 1])] = end + 1  # latest occurrence wins
        self.indexed = max(self.indexed, stop)

    def truncate(self, length: int) -> None:
        if length < self.indexed:  # rare: only when tokens are rewritten; rebuild lazily
            self.indexed = 0
            for table in self.tables.values():
                table.clear()


class NgramProposer:
    name = "ngram"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1) -> None:
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self._seqs: dict[int, _Index] = {}

    def begin(self, seq_id: int, prompt: list[int]) -> None:
        self._seqs[seq_id] = _Index(self.ngram_min, self.ngram_max)

    def prefill(self, seq_id: int, tokens: list[int]) -> None:
        pass  # the index is built lazily from the tokens at the first proposal

    def backlog(self, seq_id: int, tokens: list[int]) -> int:
        return 0  # indexing the text costs nothing next to a forward pass

    def propose(self, seq_id: int, tokens: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft | None:
        index = self._seqs[seq_id]
        index.truncate(len(tokens))
        index.extend(tokens)
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            follow = index.tables[n].get(tuple(tokens[-n:]))
            if follow is not None and follow < len(tokens):
                proposal = tokens[follow : follow + k]
                return Draft(tokens=proposal, probs=None) if proposal else None
        return None

    def propose_many(self, requests: list[DraftRequest]) -> list[Draft | None]:
        return [self.propose(r.seq_id, r.tokens, r.k, r.params, r.generator) for r in requests]

    def accept(self, seq_id: int, num_accepted: int) -> None:
        pass

    def end(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
