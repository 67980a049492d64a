"""The one small interface every drafting method implements; the engine never asks which it has.

Lifecycle per sequence (llama.cpp's begin / draft / accept):
    begin(seq_id, prompt)           -- a new sequence with its prompt token ids
    prefill(seq_id, tokens)         -- the target prefilled ``tokens``: warm up alongside (may do nothing;
                                       the engine skips it while speculation is off, and a server always:
                                       propose catches up, a long backlog a chunk per call)
    propose(seq_id, tokens, k, ..)  -- up to k draft tokens to follow ``tokens`` (or None)
    propose_many(requests)          -- the same for several sequences of one step at once (a draft
                                       model batches them into one forward per draft position);
                                       a request with ``max_nodes`` may get a token tree instead
                                       of a chain (``Draft.tree``)
    backlog(seq_id, tokens)         -- how many of ``tokens`` it would have to catch up on (feed beyond
                                       a step's usual one or two) before drafting; 0 for stateless drafters
    accept(seq_id, num_accepted[, path])
                                    -- how many of the last proposal the target kept (a tree's
                                       accepted nodes as ``path``)
    end(seq_id)                     -- the sequence is finished; free what it held

A proposer that honours ``max_nodes`` declares ``drafts_trees = True``: with ``SpecConfig(tree="auto")``
the controller then chooses per step between plain decoding, a chain and a tree (budget and depth),
from measured costs (``spec/controller.py``); the engine asks any other proposer with the whole
budget, as with ``tree="on"``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tokenleap.config import SamplingParams
from tokenleap.spec.seeded import SeededNoise
from tokenleap.spec.tree import TokenTree


@dataclass(frozen=True)
class Draft:
    tokens: list[int]  # k proposed token ids (empty: a call that only caught up, see below)
    probs: torch.Tensor | None  # [k, vocab] draft distribution each token was drawn from; None = deterministic
    # seconds of this proposal spent catching up on tokens never fed before (a prefill skipped
    # while speculation was off): prefill work, kept out of the measured cost per draft token
    catch_up_seconds: float = 0.0
    catch_up_tokens: int = 0  # how many tokens that catch-up fed
    # a token tree (root: the sequence's last token) instead of a chain; ``tokens`` then lists its
    # drafted nodes in node order and ``probs`` is unused (the tree holds its draft distributions)
    tree: TokenTree | None = None


@dataclass(frozen=True)
class DraftRequest:
    """One sequence's share of a step's drafting (the arguments of ``propose``)."""

    seq_id: int
    tokens: list[int]
    k: int
    params: SamplingParams
    generator: torch.Generator | SeededNoise | None = None
    constraint: Any = None  # structured.Constraint: a draft model drafts inside the grammar too
    max_nodes: int = 0  # > 0: a tree of at most this many drafted nodes (k deep) may be proposed
    slot: int = -1  # the sequence's slot in the target's cache (a self-drafting proposer writes there)


class Proposer(Protocol):
    name: str

    def begin(self, seq_id: int, prompt: list[int]) -> None: ...

    def prefill(self, seq_id: int, tokens: list[int]) -> None: ...

    def propose(self, seq_id: int, tokens: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | SeededNoise | None) -> Draft | None: ...

    def propose_many(self, requests: list[DraftRequest]) -> list[Draft | None]: ...

    def backlog(self, seq_id: int, tokens: list[int]) -> int: ...

    def accept(self, seq_id: int, num_accepted: int, path: list[int] | None = None) -> None: ...

    def end(self, seq_id: int) -> None: ...
