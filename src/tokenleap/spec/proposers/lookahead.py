"""Lookahead decoding (Fu et al., 2024): Jacobi iterations fill an n-gram pool in the same target
forward that verifies n-gram guesses from it -- no draft model, no training.

Each step's forward holds, below the root (the sequence's last token):

* the **verification branch**: up to G guesses, merged into a trie (``Draft.tree``) and verified
  losslessly like any deterministic draft. The first guess is the text's own continuation (what
  followed the latest earlier occurrence of the longest matching suffix, as prompt lookup drafts
  it: this is how the prompt's n-grams seed the pool, matched on up to ``lookup_max`` tokens rather
  than one); the others are the pool's most recent n-grams starting with the root token, each N - 1
  tokens after it.
* the **lookahead branch** (``Draft.aux``, rows no verifier sees; left out of a step whose lookup
  guess already fills the k tokens asked for -- copied text -- so such steps cost what prompt
  lookup's do): a window of W future positions
  over N - 1 Jacobi levels. Level 0 is a chain below the root (column i at depth i + 1); column i of
  level l hangs below column i of level l - 1 (depth i + l + 1), so each row sees the committed text,
  level 0 up to its column, then its own column's levels -- the paper's attention mask, which is a
  tree's ancestor mask. The last level's argmax outputs become the next step's last level (one Jacobi
  iteration), the oldest level is dropped, and each column's N tokens -- its levels and its output --
  enter the pool as an n-gram keyed by its first token.

The window keeps each column at a fixed position of the text: after a step that emitted a + 1
tokens, the first a columns (positions now decided) are dropped and new columns, tokens drawn from
the text, fill the end. Greedy, seeded and unseeded sampling are all exact: the guesses are
deterministic (a one-hot q), fixed before the step's forward, and the window's rows never reach
verification.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from tokenleap.config import SamplingParams
from tokenleap.spec.proposers.base import AuxRows, Draft, DraftRequest
from tokenleap.spec.proposers.ngram import NgramProposer
from tokenleap.spec.tree import TokenTree


@dataclass
class _Window:
    """One sequence's Jacobi window and n-gram pool."""

    rng: random.Random
    levels: list[list[int]] = field(default_factory=list)  # [level][column]: oldest level first
    base: int = -1  # index in the text of level 0's column 0 (columns of level l sit l further on)
    outputs: list[int] | None = None  # the last level's argmax from this step's forward
    # first token -> its continuations (N - 1 tokens each), most recent last
    pool: dict[int, OrderedDict[tuple[int, ...], None]] = field(default_factory=dict)


def window_rows(window: int, ngram: int) -> int:
    """Auxiliary rows a lookahead step attaches at most: the Jacobi window's ``ngram - 1`` levels."""
    return window * (ngram - 1)


class LookaheadProposer:
    name = "lookahead"

    def __init__(self, window: int = 3, ngram: int = 3, guesses: int = 3, lookup_max: int = 4,
                 pool_per_key: int = 16) -> None:
        assert window >= 1 and ngram >= 2 and guesses >= 1, (window, ngram, guesses)
        self.window, self.ngram, self.guesses = window, ngram, guesses
        self.pool_per_key = pool_per_key
        self.aux_rows = window_rows(window, ngram)  # the most auxiliary rows a step attaches (Draft.aux)
        self._lookup = NgramProposer(lookup_max, 1)  # the text's own continuation: the first guess
        self._seqs: dict[int, _Window] = {}

    @property
    def parts(self) -> list:
        return [self._lookup]

    # -- lifecycle --------------------------------------------------------------------------
    def begin(self, seq_id: int, prompt: list[int]) -> None:
        self._lookup.begin(seq_id, prompt)
        self._seqs[seq_id] = _Window(random.Random(len(prompt)))

    def prefill(self, seq_id: int, tokens: list[int]) -> None:
        pass  # the lookup index is built at the first proposal; the window starts there

    def backlog(self, seq_id: int, tokens: list[int]) -> int:
        return 0

    def end(self, seq_id: int) -> None:
        self._lookup.end(seq_id)
        self._seqs.pop(seq_id, None)

    # -- proposing --------------------------------------------------------------------------
    def propose(self, seq_id: int, tokens: list[int], k: int, params: SamplingParams, generator) -> Draft | None:
        """A chain (the best guess) without the window: the protocol's one-sequence call."""
        return self._propose(DraftRequest(seq_id, tokens, k, params, generator))

    def propose_many(self, requests: list[DraftRequest]) -> list[Draft | None]:
        return [self._propose(r) for r in requests]

    def _propose(self, r: DraftRequest) -> Draft | None:
        state = self._seqs[r.seq_id]
        paths, copying = self._guesses(r, state)
        if r.max_nodes > 0 and paths:
            tree = _trie_within(r.tokens[-1], paths, r.max_nodes)
            drafted = tree.tokens[1:].tolist()
            tree = None if tree.is_chain else tree
        else:
            drafted, tree = (paths[0] if paths else []), None
        # the window only where the text is not being copied: when the lookup alone fills the draft,
        # the window's rows would cost the forward and add no guess this step
        aux = self._window_rows(r, state, 1 + len(drafted)) if r.max_aux >= self.aux_rows and not copying else None
        if not drafted and aux is None:
            return None
        return Draft(tokens=drafted, probs=None, tree=tree, aux=aux)

    def _guesses(self, r: DraftRequest, state: _Window) -> tuple[list[list[int]], bool]:
        """Up to G distinct token paths to follow the root, best first, each at most k long, and
        whether the text's own continuation (the lookup) was k long."""
        paths: list[list[int]] = []
        found = self._lookup.propose(r.seq_id, r.tokens, r.k, r.params, r.generator)
        if found is not None:
            paths.append(found.tokens)
        for cont in reversed(state.pool.get(r.tokens[-1], {})):  # most recent first
            if len(paths) >= self.guesses:
                break
            guess = list(cont[: r.k])
            if not any(p[: len(guess)] == guess for p in paths):  # not already in the trie
                paths.append(guess)
        return paths, found is not None and len(found.tokens) >= r.k

    # -- the Jacobi window ------------------------------------------------------------------
    def _window_rows(self, r: DraftRequest, state: _Window, n_nodes: int) -> AuxRows:
        """The window's rows for this step (aligned to the text first), placed after ``n_nodes``."""
        self._align(state, r.tokens)
        w = self.window
        tokens, parents = [], []
        for level, row in enumerate(state.levels):
            for i, token in enumerate(row):
                tokens.append(token)
                if level == 0:  # a chain below the root
                    parents.append(0 if i == 0 else n_nodes + i - 1)
                else:  # below the same column one level up
                    parents.append(n_nodes + (level - 1) * w + i)

        def observe(logits: torch.Tensor) -> None:  # [rows, vocab]: the last level's rows are the last w
            state.outputs = logits[-w:].argmax(dim=-1).tolist()

        return AuxRows(tokens, parents, observe)

    def _align(self, state: _Window, tokens: list[int]) -> None:
        """Move the window so level 0's column 0 is the token after ``tokens``: drop the columns of
        positions decided since, fill new ones at the end (a fresh window: one level of them)."""
        shift = len(tokens) - state.base
        if state.base < 0 or shift < 0 or shift >= self.window:
            state.levels = [[self._filler(state, tokens) for _ in range(self.window)]]
        elif shift > 0:
            state.levels = [row[shift:] + [self._filler(state, tokens) for _ in range(shift)] for row in state.levels]
        state.base = len(tokens)

    @staticmethod
    def _filler(state: _Window, tokens: list[int]) -> int:
        """A token for a window cell nothing has computed yet: one drawn from the text (as the paper
        initializes its window from the prompt)."""
        return tokens[state.rng.randrange(len(tokens))]

    def accept(self, seq_id: int, num_accepted: int, path: list[int] | None = None) -> None:
        """One Jacobi iteration: the last level's outputs become a new level (the oldest dropped
        once there are N - 1), and every full column enters the pool as an n-gram."""
        state = self._seqs.get(seq_id)
        if state is None or state.outputs is None:
            return
        outputs, state.outputs = state.outputs, None
        if len(state.levels) == self.ngram - 1:
            for column in zip(*state.levels, outputs):
                self._remember(state, column)
            state.levels = state.levels[1:] + [outputs]
            state.base += 1  # level l + 1's columns, one position further on, are now level l's
        else:  # warming up: the outputs sit one position after the last level's columns
            state.levels = state.levels + [outputs]

    def _remember(self, state: _Window, ngram: tuple[int, ...]) -> None:
        conts = state.pool.setdefault(ngram[0], OrderedDict())
        conts.pop(ngram[1:], None)
        conts[ngram[1:]] = None  # the most recent last
        if len(conts) > self.pool_per_key:
            conts.popitem(last=False)


def _trie_within(root: int, paths: list[list[int]], max_nodes: int) -> TokenTree:
    """The trie of ``paths`` (best first) with at most ``max_nodes`` drafted nodes: a path that would
    overflow the budget is cut to the nodes that still fit."""
    kept, seen = [], set()
    for path in paths:
        new = [tuple(path[: d + 1]) for d in range(len(path)) if tuple(path[: d + 1]) not in seen]
        room = max_nodes - len(seen)
        if room <= 0:
            break
        new = new[:room]
        seen.update(new)
        if new:
            kept.append(list(new[-1]))
    return TokenTree.from_paths(root, kept)


__all__ = ["LookaheadProposer"]
