"""Prompt lookup / n-gram drafting: find the latest earlier occurrence of the sequence's
longest recent suffix (n from ngram_max down to ngram_min) and propose what followed it.

An index from n-gram to the positions where it ends is kept per sequence and extended
incrementally, so a proposal costs O(ngram_max) dictionary look-ups, not a scan of the text.

A tree proposal (:meth:`NgramProposer.propose_tree`) merges *every* continuation the index holds
for the suffix -- each earlier occurrence of the longest matching n-gram, then of shorter ones --
into a trie, and keeps the nodes the most occurrences agree on (longer matches first) under a
node budget.

With an ``OutputPool`` (``output_pool.py``) the suffix is also looked up in the outputs of earlier
sequences, for n up to the pool's longest: at each n, longest first, the predicted output and the
text come before the pool, so a longer match in earlier outputs wins over a shorter one here.
"""
from __future__ import annotations

import heapq

import torch

from tokenleap.config import SamplingParams, default_ngram_min
from tokenleap.spec.tree import TokenTree
from tokenleap.spec.proposers.base import Draft, DraftRequest
from tokenleap.spec.proposers.output_pool import OutputPool

MAX_OCCURRENCES = 32  # most recent occurrences of an n-gram a tree proposal reads
POOL_LABEL = "ngram-pool"  # a chain drafted from earlier outputs, as SpecStats and /metrics count it


class _Index:
    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.indexed = 0  # tokens[:indexed] are in the tables
        # n -> n-gram -> positions right after its occurrences, oldest first
        self.tables: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(n_min, n_max + 1)}
        # a predicted output (OpenAI's prediction): its n-grams likewise, read in order (``ref_at``)
        self.reference: list[int] = []
        self.ref_tables: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in self.tables}
        self.ref_at = 0  # where in the reference the last continuation taken from it started
        self.from_pool = False  # whether the last continuation came from the output pool

    def set_reference(self, reference: list[int]) -> None:
        self.reference = list(reference)
        for end in range(len(self.reference) - 1):
            for n, table in self.ref_tables.items():
                if end + 1 >= n:
                    table.setdefault(tuple(self.reference[end + 1 - n : end + 1]), []).append(end + 1)

    def continuation(self, context: list[int], length: int, pool: OutputPool | None = None) -> list[int]:
        """What follows the longest suffix of ``context`` (n_max, or the ``pool``'s longest, down to
        n_min long) that occurred before: in the reference, at its first occurrence from where the last
        one taken started (else its last one before), or in the indexed text, at its latest occurrence
        (the reference first at equal n: the client said the reply will read so), or in the pool's
        outputs. Empty when nothing matches."""
        self.from_pool = False
        for n in range(min(self.top(pool), len(context) - 1), self.n_min - 1, -1):
            if n <= self.n_max:
                key = tuple(context[-n:])
                refs = self.ref_tables[n].get(key)
                if refs:
                    at = next((f for f in refs if f >= self.ref_at), refs[-1])
                    self.ref_at = at
                    return self.reference[at: at + length]
                follows = self.tables[n].get(key)
                if follows:
                    return context[follows[-1]: follows[-1] + length]
            if pool is not None:
                cont = pool.continuation(context, n, length)
                if cont:
                    self.from_pool = True
                    return cont
        return []

    def top(self, pool: OutputPool | None) -> int:
        """The longest suffix looked up: n_max, or the pool's longest n-gram if longer."""
        return max(self.n_max, pool.n_max) if pool is not None else self.n_max

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

    def __init__(self, ngram_max: int = 4, ngram_min: int | None = None, pool: OutputPool | None = None) -> None:
        # (by default SpecConfig's: a one-token match rarely predicts what follows; never above ngram_max)
        self.ngram_max = ngram_max
        self.ngram_min = default_ngram_min(ngram_max) if ngram_min is None else min(ngram_min, ngram_max)
        self.output_pool = pool  # earlier sequences' outputs, looked up after the text (``remember_output`` fills it)
        self._seqs: dict[int, _Index] = {}

    def begin(self, seq_id: int, prompt: list[int]) -> None:
        self._seqs[seq_id] = _Index(self.ngram_min, self.ngram_max)

    def predict(self, seq_id: int, prediction: list[int]) -> None:
        """The request's predicted output (OpenAI's ``prediction``): looked up beside the text."""
        self._seqs[seq_id].set_reference(prediction)

    def prefill(self, seq_id: int, tokens: list[int]) -> None:
        pass  # the index is built lazily from the tokens at the first proposal

    def backlog(self, seq_id: int, tokens: list[int]) -> int:
        return 0  # indexing the text costs nothing next to a forward pass

    def _index(self, seq_id: int, tokens: list[int]) -> _Index:
        index = self._seqs[seq_id]
        index.truncate(len(tokens))
        index.extend(tokens)
        return index

    def propose(self, seq_id: int, tokens: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft | None:
        index = self._index(seq_id, tokens)
        proposal = index.continuation(tokens, k, self.output_pool)
        if not proposal:
            return None
        return Draft(tokens=proposal, probs=None, proposer=POOL_LABEL if index.from_pool else None)

    def propose_tree(self, seq_id: int, tokens: list[int], max_nodes: int, max_depth: int) -> TokenTree | None:
        """A trie of what followed earlier occurrences of the suffix (root: ``tokens[-1]``), at most
        ``max_nodes`` drafted nodes and ``max_depth`` deep; None when nothing matches."""
        index = self._index(seq_id, tokens)
        support: dict[tuple[int, ...], tuple[int, int, int]] = {}  # path -> (longest n, occurrences, latest)
        for n in range(min(index.top(self.output_pool), len(tokens) - 1), self.ngram_min - 1, -1):
            key = tuple(tokens[-n:])
            # (follow, continuation): a reference occurrence ranks as more recent than any of the text's,
            # an earlier output's as older (negative, the latest closest to 0)
            occurrences = []
            if n <= self.ngram_max:
                occurrences += [(len(tokens) + f, index.reference[f: f + max_depth])
                                for f in index.ref_tables[n].get(key, ())[:MAX_OCCURRENCES]]
                occurrences += [(f, tokens[f: f + max_depth]) for f in (index.tables[n].get(key) or [])[-MAX_OCCURRENCES:]]
            if self.output_pool is not None:
                found = self.output_pool.occurrences(tokens, n)
                occurrences += [(i - len(found), self.output_pool.following(oid, f, max_depth))
                                for i, (oid, f) in enumerate(found)]
            for follow, cont in occurrences:
                cont = tuple(cont)
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
