"""The acceptance-count test of ``tokenleap verify``: does rejection sampling keep drafts exactly as
often as it should?

Each time the verifier of an unseeded sampled request tests a drafted token ``x`` against the
target's unmodified row ``p`` for its prefix -- the first draft of a step, each later draft of a
chain once the ones before it were kept, the first child at each node a tree walk reaches -- it keeps
``x`` with probability ``min(1, p(x) / q(x))``, where ``q`` is the distribution ``x`` was drawn
from (one-hot for a deterministic proposer: ``p(x)``). That **trial** draws a uniform of its own,
independent of everything decided before it, so given the history its outcome is a Bernoulli of
known mean. Later siblings of a tree node are tested against a residual, not ``p``, and are not
trials here.

The test sums the outcomes of every trial of a sample of requests and compares the sum with the
sum of those means, computed from the target's exact probabilities (not the engine's): by the
martingale central limit theorem ``z = (accepted - expected) / sqrt(sum pi (1 - pi))`` is standard
normal when the verifier is right. A verifier that keeps drafts with ``min(1, c p / q)`` moves the
sum by ``sum(min(1, c pi) - pi)`` -- a bias the distribution tests see only diluted over the whole
vocabulary, since it sits on the drafted tokens alone. :func:`detectable_factor` says how large
such a ``c`` has to be before a run of this size would see it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from statistics import NormalDist

import torch

from tokenleap.spec.tree import TokenTree

EXACT_BELOW = 25.0  # sum pi (1 - pi) under which the count is tested exactly, not by z


@dataclass(frozen=True)
class Trial:
    """One drafted token tested against the target's unmodified row."""

    position: int  # index among the generated tokens of the position it was drafted for
    token: int
    q: float  # probability the draft drew it with (1.0: a deterministic proposer)
    accepted: bool


def chain_trials(start: int, drafted: list[int], draft_probs: torch.Tensor | None, num_accepted: int
                 ) -> list[Trial]:
    """The trials of a chain verified from generated position ``start``: draft i was tested when
    every draft before it was kept (``draft_probs`` [k, vocab] or None: one-hot)."""
    tested = min(num_accepted + 1, len(drafted))
    return [Trial(start + i, x, 1.0 if draft_probs is None else float(draft_probs[i, x]), i < num_accepted)
            for i, x in enumerate(drafted[:tested])]


def tree_trials(start: int, tree: TokenTree, path: list[int]) -> list[Trial]:
    """The trials of a tree walk from generated position ``start`` along the accepted ``path``: the
    first child of the root and of every node on the path that has children."""
    out, tokens = [], tree.tokens.tolist()
    walk = [0] + path
    for depth, node in enumerate(walk):
        kids = tree.children[node]
        if not kids:
            continue
        first = kids[0]
        q = 1.0 if tree.draft_probs is None else float(tree.draft_probs[node, tokens[first]])
        taken = depth + 1 < len(walk) and walk[depth + 1] == first
        out.append(Trial(start + depth, tokens[first], q, taken))
    return out


@dataclass(frozen=True)
class AcceptanceCount:
    """Observed against expected kept drafts over a run's trials."""

    trials: int
    accepted: int
    expected: float
    variance: float
    means: tuple[float, ...]  # each trial's acceptance probability, for detectable_factor
    impossible: int = 0  # trials whose outcome had probability 0 (a mean of 1 rejected, of 0 kept)

    @property
    def z(self) -> float:
        diff = self.accepted - self.expected
        if self.variance > 0:
            return diff / math.sqrt(self.variance)
        return 0.0 if abs(diff) < 1e-9 else math.copysign(math.inf, diff)  # every trial was certain

    @cached_property
    def p_value(self) -> float:
        """Two-sided. The normal approximation only where the count has spread enough for it; below
        that (means piled near 0 or 1: a peaked target, few trials) the exact Poisson-binomial tail,
        since there one unexpected outcome moves z by several units (100 trials at 0.999: the normal
        rule fails a right verifier 9.5% of the time at alpha 0.01). Trials certain either way (a mean
        of 0 or 1) only shift the count; the rest are convolved, O(n^2) in their number."""
        if self.impossible:  # one outcome a right verifier never gives is proof enough
            return 0.0
        if self.variance >= EXACT_BELOW or not self.means:
            return math.erfc(abs(self.z) / math.sqrt(2))
        unsure = [m for m in self.means if 0 < m < 1]
        k = self.accepted - sum(m >= 1 for m in self.means)  # kept among the unsure ones
        dist = torch.zeros(len(unsure) + 1, dtype=torch.float64)  # [n + 1]: P(count == j)
        dist[0] = 1.0
        for i, m in enumerate(unsure):
            dist[1:i + 2] = dist[1:i + 2] * (1 - m) + dist[0:i + 1] * m
            dist[0] *= 1 - m
        low, high = float(dist[:k + 1].sum()), float(dist[k:].sum())
        return min(1.0, 2 * min(low, high))

    def rejects(self, alpha: float) -> bool:
        return self.p_value < alpha

    def shift(self, factor: float) -> float:
        """How many standard deviations a verifier keeping drafts with ``min(1, factor * p / q)`` would
        move the count, on these trials' means (0 when the run has no spread at all)."""
        moved = sum(min(1.0, factor * m) - m for m in self.means)
        return moved / math.sqrt(self.variance) if self.variance > 0 else 0.0


def acceptance_count(trials: list[Trial], means: list[float]) -> AcceptanceCount:
    """The count of ``trials`` against their acceptance probabilities ``means`` (one each)."""
    assert len(trials) == len(means), f"one mean per trial: {len(trials)} trials, {len(means)} means"
    impossible = sum((m >= 1 and not t.accepted) or (m <= 0 and t.accepted) for t, m in zip(trials, means))
    return AcceptanceCount(len(trials), sum(t.accepted for t in trials), sum(means),
                           sum(m * (1 - m) for m in means), tuple(means), impossible)


def acceptance_mean(p_token: float, q: float) -> float:
    """``min(1, p(x) / q(x))``; a token the draft drew with probability 0 is kept iff ``p(x) > 0``."""
    if q <= 0:
        return 1.0 if p_token > 0 else 0.0
    return min(1.0, p_token / q)


def detectable_factor(count: AcceptanceCount, alpha: float) -> float:
    """The smallest over-acceptance factor ``c`` (a verifier keeping drafts with ``min(1, c p / q)``)
    whose expected shift reaches the test's two-sided critical value -- seen about half the time;
    ``inf`` when no factor would (every trial certain to be kept, or none at all)."""
    crit = NormalDist().inv_cdf(1 - alpha / 2)
    if count.shift(1e6) < crit:
        return math.inf
    lo, hi = 1.0, 2.0
    while count.shift(hi) < crit:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if count.shift(mid) < crit else (lo, mid)
    return hi


def acceptance_verdict(count: AcceptanceCount, alpha: float, trials: list[Trial] | None = None
                       ) -> tuple[bool, str, dict]:
    """The certificate's verdict on a count at level ``alpha``: passed, a one-line summary (with the
    positions ``trials`` reached, if given), figures."""
    trials = trials or []
    seen = detectable_factor(count, alpha)
    figures = {"trials": count.trials, "accepted": count.accepted, "expected": round(count.expected, 3),
               "z": round(count.z, 4), "p_value": count.p_value, "alpha": alpha, "impossible": count.impossible,
               "detectable_factor": round(seen, 4) if math.isfinite(seen) else None,
               "shift_sd_at_1_1": round(count.shift(1.1), 3)}
    where = f" (positions {min(t.position for t in trials)}-{max(t.position for t in trials)})" if trials else ""
    summary = (f"{count.trials} drafts tested against the target's own row{where}: {count.accepted} kept, "
               f"{count.expected:.1f} expected, z {count.z:+.2f}, p {count.p_value:.3g} (alpha {alpha:g}); ")
    if count.trials == 0:
        return False, summary + "no draft was tested, so nothing is counted", figures
    if count.impossible:
        return False, summary + (f"{count.impossible} drafts went the way min(1, p/q) made impossible (a draft "
                                 "certain to be kept was rejected, or one never to be kept was kept)"), figures
    if count.rejects(alpha):
        return False, summary + "drafts are not kept as often as min(1, p/q) says", figures
    if math.isfinite(seen):
        return True, summary + f"a verifier accepting with min(1, {seen:.2f} p/q) would be seen (half the time)", \
            figures
    if count.variance == 0:
        return True, summary + "every draft's outcome was certain (min(1, p/q) of 0 or 1): no over-acceptance " \
            "could be seen", figures
    return True, summary + (f"the count has too little spread (sum pi(1 - pi) = {count.variance:.3g}) to state "
                            "an over-acceptance it would see"), figures


__all__ = ["Trial", "chain_trials", "tree_trials", "AcceptanceCount", "acceptance_count", "acceptance_mean",
           "detectable_factor", "acceptance_verdict"]
