"""Speculation counters, kept apart from how they are shown (JSON, log line, Prometheus).

Definitions follow ``docs/METRICS.md``: tau counts every target forward (the prefill that yields the
first token included), so plain decoding has tau == 1.00.

A token tree's step counts as a chain as deep as the tree (``draft_tokens`` and the per-position
figures are by depth: position i is depth i + 1); ``tree_nodes`` counts its drafted nodes and
``rank_accepted[r]`` the accepted nodes that were their parent's (r+1)-th child.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecStats:
    new_tokens: int = 0
    target_forwards: int = 0  # prefill + every decode/verify step
    draft_steps: int = 0  # steps whose draft was non-empty
    draft_tokens: int = 0  # proposed
    accepted_tokens: int = 0
    position_proposed: list[int] = field(default_factory=list)  # [i] steps that drafted > i tokens
    position_accepted: list[int] = field(default_factory=list)  # [i] steps whose first i+1 drafts passed
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # target forwards of decode steps (plain steps included)
    total_seconds: float = 0.0
    tree_steps: int = 0  # steps that verified a token tree
    tree_nodes: int = 0  # drafted nodes of those trees
    rank_accepted: list[int] = field(default_factory=list)  # [r] accepted nodes that were sibling rank r
    # by the proposer that drafted the step ("none": plain steps and the prefill's token): steps, draft
    # tokens accepted, tokens emitted -- a composite (--spec auto) names its arms
    proposer_steps: dict[str, int] = field(default_factory=dict)
    proposer_accepted: dict[str, int] = field(default_factory=dict)
    proposer_tokens: dict[str, int] = field(default_factory=dict)

    def record_step(self, proposed: int, accepted: int, emitted: int) -> None:
        self.target_forwards += 1
        self.new_tokens += emitted
        if proposed == 0:
            return
        self.draft_steps += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        _grow(self.position_proposed, proposed)
        _grow(self.position_accepted, proposed)
        for i in range(proposed):
            self.position_proposed[i] += 1
            if i < accepted:
                self.position_accepted[i] += 1

    def record_proposer(self, name: str, accepted: int, emitted: int) -> None:
        """The step just recorded was drafted by ``name`` (after ``record_step``)."""
        for table, value in ((self.proposer_steps, 1), (self.proposer_accepted, accepted),
                             (self.proposer_tokens, emitted)):
            table[name] = table.get(name, 0) + value

    def record_tree(self, nodes: int, ranks: list[int]) -> None:
        """A tree step's drafted nodes and the sibling ranks of its accepted path (after ``record_step``)."""
        self.tree_steps += 1
        self.tree_nodes += nodes
        _grow(self.rank_accepted, max(ranks, default=-1) + 1)
        for r in ranks:
            self.rank_accepted[r] += 1

    def merge(self, other: "SpecStats") -> None:
        for name in ("new_tokens", "target_forwards", "draft_steps", "draft_tokens", "accepted_tokens",
                     "prefill_seconds", "draft_seconds", "verify_seconds", "total_seconds", "tree_steps",
                     "tree_nodes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine_d, theirs_d in ((self.proposer_steps, other.proposer_steps),
                                 (self.proposer_accepted, other.proposer_accepted),
                                 (self.proposer_tokens, other.proposer_tokens)):
            for name, v in theirs_d.items():
                mine_d[name] = mine_d.get(name, 0) + v
        for mine, theirs in ((self.position_proposed, other.position_proposed),
                             (self.position_accepted, other.position_accepted),
                             (self.rank_accepted, other.rank_accepted)):
            _grow(mine, len(theirs))
            for i, v in enumerate(theirs):
                mine[i] += v

    # -- derived figures --------------------------------------------------------------------
    @property
    def tau(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_length(self) -> float:
        return 1 + self.accepted_tokens / self.draft_steps if self.draft_steps else 1.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """a_i = P(the first i drafts of a step are accepted), over the steps that drafted (vLLM's
        figure): non-increasing in i, and ``1 + sum(a_i)`` is the acceptance length. A step that drafted
        fewer than i tokens counts as not reaching i."""
        return [a / self.draft_steps for a in self.position_accepted] if self.draft_steps else []

    @property
    def per_position_acceptance_at_depth(self) -> list[float]:
        """Among the steps that drafted at least i tokens, the share whose first i were accepted: how
        good the drafts are at depth i, apart from how often the draft length reached it (with an
        adaptive length this may rise with i)."""
        return [a / p if p else 0.0 for a, p in zip(self.position_accepted, self.position_proposed)]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        spent = self.draft_seconds + self.verify_seconds
        return {
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "mean_accepted_tokens": round(self.tau, 4),
            "acceptance_length": round(self.acceptance_length, 4),
            "draft_acceptance_rate": round(self.draft_acceptance_rate, 4),
            "per_position_acceptance": [round(a, 4) for a in self.per_position_acceptance],
            "per_position_acceptance_at_depth": [round(a, 4) for a in self.per_position_acceptance_at_depth],
            "draft_steps": self.draft_steps,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "prefill_seconds": round(self.prefill_seconds, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "draft_time_share": round(self.draft_seconds / spent, 4) if spent else 0.0,
            "total_seconds": round(self.total_seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "tree_steps": self.tree_steps,
            "mean_tree_nodes": round(self.tree_nodes / self.tree_steps, 4) if self.tree_steps else 0.0,
            "accepted_by_sibling_rank": list(self.rank_accepted),
            # of the steps that drafted, the share that verified a token tree (--spec-tree auto's choice)
            "tree_step_share": round(self.tree_steps / self.draft_steps, 4) if self.draft_steps else 0.0,
            "proposers": self.proposers(),
        }

    def proposers(self) -> dict[str, dict[str, Any]]:
        """Per proposer: steps it drafted, its tokens accepted, tokens those steps emitted and their
        share of all new tokens ("none": plain steps and the prefill's first token)."""
        return {name: {"steps": self.proposer_steps[name], "accepted_tokens": self.proposer_accepted.get(name, 0),
                       "tokens": n, "share": round(n / self.new_tokens, 4) if self.new_tokens else 0.0}
                for name, n in sorted(self.proposer_tokens.items())}

    def summary_line(self) -> str:
        pos = " ".join(f"{a:.2f}" for a in self.per_position_acceptance) or "-"
        return (f"{self.new_tokens} tokens in {self.total_seconds:.2f}s ({self.tokens_per_second:.2f} tok/s); "
                f"tau {self.tau:.2f}, acceptance length {self.acceptance_length:.2f}, "
                f"draft acceptance {self.draft_acceptance_rate:.1%}, per position [{pos}], "
                f"draft {self.draft_seconds:.2f}s / verify {self.verify_seconds:.2f}s")


def _grow(values: list[int], n: int) -> None:
    values.extend([0] * (n - len(values)))
