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

A request may carry a **predicted output** (``SamplingParams.prediction``, OpenAI's Predicted
Outputs): ``begin_sequence`` hands it to every proposer in the engine's (composites list theirs as
``parts``) that has a ``predict(seq_id, tokens)`` -- the lookup drafters, which then propose from it
as from the text itself. Output is unchanged; only what gets drafted.

A proposer may also attach **auxiliary rows** to its proposal (``Draft.aux``, see :class:`AuxRows`):
rows of the same target forward that are no verification candidates -- lookahead decoding's Jacobi
window. It then declares ``aux_rows`` (the most it attaches a step) so a scheduler can reserve the
cache entries they occupy during the forward; the engine never keeps them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tokenleap.config import SamplingParams
from tokenleap.spec.seeded import SeededNoise
from tokenleap.spec.tree import TokenTree


@dataclass(frozen=True)
class AuxRows:
    """Rows a proposal adds to the step's forward that are *not* candidates: computed beside the
    drafted nodes (each sees the committed cache plus its own ancestors, as a tree node does), their
    logits handed to ``observe`` before the proposer's ``accept``, then dropped -- never verified,
    emitted or kept in the cache. Verification, and so the output, cannot depend on them.

    ``parents[j]`` indexes the step's layout: the proposal's nodes (0: the root, then the drafted
    tokens in node order), followed by these rows; it is below ``1 + len(Draft.tokens) + j``."""

    tokens: list[int]
    parents: list[int]
    observe: Callable[[torch.Tensor], None]  # called with the rows' logits [len(tokens), vocab]


@dataclass(frozen=True)
class Draft:
    tokens: list[int]  # k proposed token ids (empty: a call that only caught up, see below)
    probs: torch.Tensor | None  # [k, vocab] draft distribution each token was drawn from; None = deterministic
    # seconds of this proposal spent catching up on tokens never fed before (a prefill skipped
    # while speculation was off): prefill work, kept out of the measured cost per draft token
    catch_up_seconds: float = 0.0
    catch_up_tokens: int = 0  # how many tokens that catch-up fed
    # drafted tokens that came out of the catch-up's forwards (their time is in catch_up_seconds):
    # the rest were drafted in ``seconds - catch_up_seconds`` and price a draft token even on a
    # step that caught up (a probe after plain steps); 0 where the proposer does not say
    catch_up_drafted: int = 0
    # a token tree (root: the sequence's last token) instead of a chain; ``tokens`` then lists its
    # drafted nodes in node order and ``probs`` is unused (the tree holds its draft distributions)
    tree: TokenTree | None = None
    # which proposer drafted this (a composite such as --spec auto labels its arms' drafts; None:
    # the engine's proposer itself), for the per-proposer token counts of SpecStats and /metrics
    proposer: str | None = None
    # rows computed in the same forward for the proposer's own use (lookahead's Jacobi window); a
    # draft with aux rows but no tokens still runs them
    aux: AuxRows | None = None
    # the proposer ended the chain before k because its own confidence fell (``DraftRequest.stop_below``),
    # not for want of a continuation: a short draft accepted whole is then no miss past its end
    cut: bool = False


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
    max_aux: int = 0  # auxiliary rows (Draft.aux) the step has room for beside max(k, max_nodes) nodes
    slot: int = -1  # the sequence's slot in the target's cache (a self-drafting proposer writes there)
    # a model drafting a chain stops after i tokens whose confidences multiply to less than
    # stop_below[i - 1], plus stop_draft where the next token needs a draft forward
    # (``spec/confidence.py``); empty: always k tokens
    stop_below: tuple[float, ...] = ()
    stop_draft: float = 0.0
    # with stop_below: the length the cost model planned, which a confident chain may run past (work
    # sized ahead of the draft's confidence -- the cascade's n-gram guesses -- is sized by it; 0: k)
    planned: int = 0


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


def begin_sequence(proposer: Proposer, seq_id: int, prompt: list[int], prediction: tuple[int, ...] = ()) -> None:
    """``proposer.begin``, then the predicted output to each part of it that looks text up."""
    proposer.begin(seq_id, prompt)
    if prediction:
        for part in _parts(proposer):
            predict = getattr(part, "predict", None)
            if predict is not None:
                predict(seq_id, list(prediction))


def remember_output(proposer: Proposer, output: list[int]) -> None:
    """A finished sequence's output to the output pool (``output_pool.py``) of each part of the
    proposer that looks text up in one -- once per pool, however many parts share it."""
    for pool in output_pools(proposer):
        pool.add(output)


def forget_outputs(proposer: Proposer) -> None:
    """Empty every output pool the proposer's parts look text up in."""
    for pool in output_pools(proposer):
        pool.clear()


def output_pool_note(proposer) -> str | None:
    """A startup line's words for the earlier outputs n-gram lookup reads (None: it reads none)."""
    pools = output_pools(proposer)
    return f"n-gram lookup in the last {pools[0].max_tokens} tokens of earlier outputs too" if pools else None


def draft_model_note(proposer) -> str | None:
    """A startup line's words for the draft model the proposer (or one of its parts) drafts with:
    which model, at which precision, and whether it drafts through text (None: no draft model)."""
    return next((note for part in _parts(proposer) if (note := getattr(part, "draft_note", None))), None)


def output_pools(proposer) -> list:
    """The distinct output pools the proposer's parts look text up in."""
    pools = {id(pool): pool for part in _parts(proposer) if (pool := getattr(part, "output_pool", None)) is not None}
    return list(pools.values())


def feature_takers(proposer) -> list:
    """The parts of the proposer that draft from the target's features (``wants_features``): the engine
    hands them the final normed hidden state of each position it computes (``take_features``)."""
    return [p for p in _parts(proposer) if getattr(p, "wants_features", False)] if proposer is not None else []


def _parts(proposer) -> list:
    """The proposer and, recursively, the proposers it is made of (``parts``)."""
    return [proposer] + [q for p in getattr(proposer, "parts", ()) for q in _parts(p)]
