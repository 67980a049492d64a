"""What one decoding step did: the engine's account of a step, for whoever learns from it.

``Engine.step`` returns a :class:`StepReport`; the controller learns its cost and acceptance
figures from it (``DraftLengthController.observe_step_report``) and the speculation counters
(``SpecStats``) are recorded from it (:func:`record_stats`). Nothing here touches a cache, a model
or a sequence: a report is a record of facts measured once, so every consumer sees the same ones.

A token tree's step counts as a chain as deep as the tree (``proposed`` is its depth); a chain's
drafted shape, where it is needed as a tree, is ``parents = (-1, 0, 1, ..., k - 1)``.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenleap.spec.proposers.base import Draft
from tokenleap.spec.stats import SpecStats
from tokenleap.spec.tree_verify import TreeVerification
from tokenleap.spec.verify import Verification


@dataclass(frozen=True)
class SeqOutcome:
    """One sequence's share of a step."""

    seq_id: int
    proposer: str  # who drafted the step ("none": a plain step, no draft verified)
    drafted: bool  # a draft was verified (an empty one -- auxiliary rows only -- included)
    proposed: int  # drafted tokens (a tree: its depth): the most the step could accept
    accepted: int  # drafted tokens the verifier accepted
    kept: int  # tokens appended: the accepted ones and one more, cut short by a stop rule
    rows: int  # rows this sequence held in the step's forward (root, drafted nodes, auxiliary rows)
    # the drafted shape: a tree's parents (node 0 the root, parents[0] == -1), a chain's
    # (-1, 0, ..., k - 1); empty without a draft
    parents: tuple[int, ...] = ()
    path: tuple[int, ...] = ()  # the accepted nodes (a chain: 1..accepted), root excluded
    tree_nodes: int | None = None  # drafted nodes of a verified token tree (None: a chain or plain)
    ranks: tuple[int, ...] = ()  # a tree: the sibling rank of each accepted node


def outcome(seq_id: int, proposer: str, draft: Draft | None, result: Verification | TreeVerification,
            kept: int, rows: int) -> SeqOutcome:
    """The outcome of verifying ``draft`` (None: a plain step) as ``result``, of which ``kept``
    tokens were appended; ``rows``: the sequence's rows in the forward."""
    accepted = result.num_accepted
    if draft is None:
        return SeqOutcome(seq_id, "none", False, 0, accepted, kept, rows)
    tree = draft.tree
    if tree is None:
        k = len(draft.tokens)
        return SeqOutcome(seq_id, proposer, True, k, accepted, kept, rows,
                          parents=tuple(range(-1, k)), path=tuple(range(1, accepted + 1)))
    path = result.path  # type: ignore[union-attr]
    ranks = tuple(tree.children[tree.parent_list[c]].index(c) for c in path[:accepted])
    return SeqOutcome(seq_id, proposer, True, int(tree.depth.max()), accepted, kept, rows,
                      parents=tuple(tree.parent_list), path=tuple(path), tree_nodes=tree.size - 1, ranks=ranks)


@dataclass(frozen=True)
class DraftWork:
    """A step's drafting, over every sequence: what the controller's draft costs are measured on."""

    tokens: int = 0  # tokens drafted
    depth: int = 0  # the longest draft asked for (a tree's levels)
    batch: int = 0  # sequences a draft was asked of (0: none was)
    seconds: float = 0.0  # drafting, catch-up excluded (0.0 when nothing was drafted)
    catch_up_tokens: int = 0  # tokens the draft fed beyond drafting (a skipped prefill, a backlog)
    catch_up_seconds: float = 0.0
    catch_up_drafted: int = 0  # of ``tokens``, those drafted by the catch-up's forwards (Draft.catch_up_drafted)


@dataclass(frozen=True)
class StepReport:
    """One ``Engine.step``: every sequence's outcome and the step's measured costs."""

    outcomes: tuple[SeqOutcome, ...]  # in the order the step batched the sequences
    k: int  # the plan's draft length (a tree: its depth; 0: plain decoding)
    tree_budget: int  # the plan's tree budget in drafted nodes (0: chains)
    auto_tree: bool  # the plan is a tree "--spec-tree auto" chose: its figures are kept apart
    held_apart: bool  # ... and the forward really held a tree: its costs measured apart from chains'
    rows: int  # rows of the step's one target forward, over every sequence
    forward_seconds: float  # that forward
    draft: DraftWork
    # seconds the step spent outside its draft, catch-up and target forwards (verification,
    # bookkeeping); None for an engine without a proposer (nothing weighs plain against drafting)
    overhead_seconds: float | None

    @property
    def batch(self) -> int:
        return len(self.outcomes)

    @property
    def speculative(self) -> bool:
        """Some sequence verified a draft this step."""
        return any(o.drafted for o in self.outcomes)


def record_stats(outcome: SeqOutcome, *stats: SpecStats) -> None:
    """Count ``outcome`` in every ``stats`` (a sequence's own and the engine's totals). Acceptance is
    the verifier's: a draft token it accepted counts as accepted even where a stop rule then ended the
    output before it (as vLLM counts), so a stop string never reads as a rejection."""
    for s in stats:
        s.record_step(outcome.proposed, outcome.accepted, outcome.kept)
        s.record_proposer(outcome.proposer, outcome.accepted, outcome.kept)
        if outcome.tree_nodes is not None:
            s.record_tree(outcome.tree_nodes, list(outcome.ranks))


__all__ = ["DraftWork", "SeqOutcome", "StepReport", "outcome", "record_stats"]
