"""Prompt lookup / n-gram drafting: find the latest earlier occurrence of the sequence's
longest recent suffix (n from ngram_max down to ngram_min) and propose what followed it.

An index from n-gram to the positions where it ends is kept per sequence and extended
incrementally, so a proposal costs O(ngram_max) dictionary look-ups, not a scan of the text.

A tree proposal (:meth:`NgramProposer.propose_tree`) merges *every* continuation the index holds
for the suffix -- each earlier occurrence of the longest matching n-gram, then of shorter ones --
into a trie, and keeps the nodes the most occurrences agree on (longer matches first) under a
node budget.
"""
from __future__ import annotations

import heapq

import torch

from tokenleap.config import SamplingParams, default_ngram_min
from tokenleap.spec.tree import TokenTree
from tokenleap.spec.proposers.base import Draft, DraftRequest

MAX_OCCURRENCES = 32  # most recent occurrences of an n-gram a tree proposal reads


class _Index:
    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.indexed = 0  # tokens[:indexed] are in the tables
        # n -> n-gram -> positions right after its occurrences, oldest first
        self.tables: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(n_min, n_max + 1)}

    def extend(self, tokens: list[int]) -> None:
        """Index every n-gram ending before the last token (the suffix itself must not match itself)."""
        stop = len(tokens) - 1
        for end in range(self.indexed, stop):
            for n, table in self.tables.items():
                if end + 1 >= n:
                    table.setdefault(tuple(tokens[end + 1 - n : end + 1]), []).append(end + 1)
        self.indexed = max(self.indexed, stop)

    def truncate(self, length: int) -> None:
        if length < self.indexed:  # rare: only when tokens are rewritten; rebuild lazily
            self.indexed = 0
            for table in self.tables.values():
                table.clear()


class NgramProposer:
    name = "ngram"
    drafts_trees = True  # a request with max_nodes gets a trie (the controller may choose it)
    # deterministic and nearly free: a composite proposer (--spec auto) may ask for a proposal it
    # does not verify and score it against the tokens the step emitted
    shadow = True

    def __init__(self, ngram_max: int = 4, ngram_min: int | None = None) -> None:
        # (by default SpecConfig's: a one-token match rarely predicts what follows; never above ngram_max)
        self.ngram_max = ngram_max
        self.ngram_min = default_ngram_min(ngram_max) if ngram_min is None else min(ngram_min, ngram_max)
        self._seqs: dict[int, _Index] = {}

    def begin(self, seq_id: int, prompt: list[int]) -> None:
        self._seqs[seq_id] = _Index(self.ngram_min, self.ngram_max)

    def prefill(self, seq_id: int, tokens: list[int]) -> None:
        pass  # the index is built lazily from the tokens at the first proposal

    def backlog(self, seq_id: int, tokens: list[int]) -> int:
        return 0  # indexing the text costs nothing next to a forward pass

    def _index(self, seq_id: int, tokens: list[int]) -> _Index:
        index = self._seqs[seq_id]
        index.truncate(len(tokens))
        index.extend(tokens)
        return index

    def match(self, seq_id: int, tokens: list[int]) -> tuple[int, int] | None:
        """The longest suffix of ``tokens`` (ngram_max down to ngram_min long) that occurred before:
        (its length n, the position right after its latest earlier occurrence); None if none did."""
        index = self._index(seq_id, tokens)
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            follows = index.tables[n].get(tuple(tokens[-n:]))
            if follows:
                return n, follows[-1]
        return None

    def propose(self, seq_id: int, tokens: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft | None:
        found = self.match(seq_id, tokens)
        proposal = tokens[found[1] : found[1] + k] if found else []
        return Draft(tokens=proposal, probs=None) if proposal else None

    def propose_tree(self, seq_id: int, tokens: list[int], max_nodes: int, max_depth: int) -> TokenTree | None:
        """A trie of what followed earlier occurrences of the suffix (root: ``tokens[-1]``), at most
        ``max_nodes`` drafted nodes and ``max_depth`` deep; None when nothing matches."""
        index = self._index(seq_id, tokens)
        support: dict[tuple[int, ...], tuple[int, int, int]] = {}  # path -> (longest n, occurrences, latest)
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            for follow in (index.tables[n].get(tuple(tokens[-n:])) or [])[-MAX_OCCURRENCES:]:
                cont = tuple(tokens[follow : follow + max_depth])
                for d in range(1, len(cont) + 1):
                    best_n, count, latest = support.get(cont[:d], (n, 0, follow))
                    support[cont[:d]] = (best_n, count + 1, max(latest, follow))
        if not support:
            return None
        return TokenTree.from_paths(tokens[-1], _best_paths(support, max_nodes))

    def propose_many(self, requests: list[DraftRequest]) -> list[Draft | None]:
        return [self._tree_draft(r) if r.max_nodes > 0 else self.propose(r.seq_id, r.tokens, r.k, r.params, r.generator)
                for r in requests]

    def _tree_draft(self, r: DraftRequest) -> Draft | None:
        tree = self.propose_tree(r.seq_id, r.tokens, r.max_nodes, r.k)
        if tree is None:
            return None
        drafted = tree.tokens[1:].tolist()
        return Draft(tokens=drafted, probs=None, tree=None if tree.is_chain else tree)

    def accept(self, seq_id: int, num_accepted: int, path: list[int] | None = None) -> None:
        pass

    def end(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)


def _best_paths(support: dict[tuple[int, ...], tuple[int, int, int]], budget: int) -> list[list[int]]:
    """Up to ``budget`` trie nodes, best first by (longest matching n, occurrences, recency); a
    node's score never beats its parent's, so growing from the root keeps the trie connected."""
    children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for path in support:
        children.setdefault(path[:-1], []).append(path)

    def key(path: tuple[int, ...]) -> tuple[int, int, int]:
        n, count, latest = support[path]
        return (-n, -count, -latest)

    heap = [(key(p), p) for p in children.get((), [])]
    heapq.heapify(heap)
    chosen = []
    while heap and len(chosen) < budget:
        _, path = heapq.heappop(heap)
        chosen.append(list(path))
        for child in children.get(path, []):
            heapq.heappush(heap, (key(child), child))
    return chosen
