"""Cutting a model's draft short where the draft itself is unsure.

A draft model's probability for the token it drafts predicts whether the target accepts it: on the
README's pair (int4 Qwen2.5-Coder 0.5B drafting for the 1.5B, greedy, chat answers) drafts whose
top probability was above 0.9 were accepted 98% of the time, 0.5-0.6 65%, 0.2-0.3 33%
(BENCHMARKS.md, "A draft model's chain cut short where the draft is unsure"). A chain's fixed length k spends
a draft forward and a verification row on every position whatever the draft thought of it; cutting
the chain once its running confidence is low saves both where they are likely wasted, and lets a
confident draft run deep.

How well a draft's probability predicts acceptance depends on the pair (a draft that is the target
itself is always accepted, however flat its distribution), so the proposer learns the mapping while
it runs (``Calibration``): the acceptance of its drafted tokens by confidence band, starting from
the confidence itself.

The rule is the controller's own cost model applied one token at a time. After drafting i tokens
whose confidences multiply to c (the draft's estimate that all i are accepted), drafting token i+1
is expected to add c * a tokens (a: the measured acceptance of a drafted token) for the cost of one
more draft token and one more verification row. That raises the step's yield per second exactly
when c * a / (draft + extra row) exceeds the rate the step is predicted to reach, so the draft
stops once c falls below

    threshold_i = (draft seconds per token + forward(rows + 1) - forward(rows)) * rate / a

(``thresholds``), without the draft's part where the next token is already computed (a cascade's
n-gram guess the draft agreed with). The token that crossed the threshold stays in the draft: its
forward is paid.

Verification is unchanged -- where a draft stops is decided from the draft's own distribution, never
from the target's -- so greedy and seeded output stay token-identical to plain decoding and
sampling stays exact (a rejection sampler is exact for any draft length chosen independently of
the target's draw).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# an acceptance below this is taken at this value: a floor past 2 * (draft + row) * rate would end
# every chain at one token, and so never measure what a longer one gets
_MIN_ACCEPTANCE = 0.5


class Calibration:
    """The measured acceptance of drafted tokens by the draft's confidence in them, in ``bands``
    equal bands of [0, 1]: exponentially forgotten hit / trial counts with the band's middle as a
    prior worth ``prior_weight`` observations. Only tokens whose predecessors were all accepted
    count (a later one is never judged)."""

    def __init__(self, bands: int = 10, prior_weight: float = 4.0, ema: float = 0.02) -> None:
        self.bands, self.prior_weight, self.keep = bands, prior_weight, 1.0 - ema
        self.hits, self.trials = [0.0] * bands, [0.0] * bands

    def _band(self, confidence: float) -> int:
        return min(self.bands - 1, max(0, int(confidence * self.bands)))

    def __call__(self, confidence: float) -> float:
        """The probability that a token drafted with this confidence is accepted."""
        b = self._band(confidence)
        middle = (b + 0.5) / self.bands
        return (self.hits[b] + self.prior_weight * middle) / (self.trials[b] + self.prior_weight)

    def observe(self, confidences: Sequence[float], accepted: int) -> None:
        """A verified chain drafted with these confidences, of which the first ``accepted`` passed."""
        for i, c in enumerate(confidences[:accepted + 1]):
            b = self._band(c)
            self.hits[b] = self.hits[b] * self.keep + (1.0 if i < accepted else 0.0)
            self.trials[b] = self.trials[b] * self.keep + 1.0


class ConfidenceLog:
    """A proposer's ``Calibration`` and, per sequence, the confidences of its last chain until the
    chain is verified (``verified``) or the sequence ends."""

    def __init__(self) -> None:
        self.calibration = Calibration()
        self._last: dict[int, list[float]] = {}

    def drafted(self, seq_id: int, confidences: list[float]) -> None:
        if confidences:
            self._last[seq_id] = confidences
        else:
            self._last.pop(seq_id, None)

    def verified(self, seq_id: int, accepted: int) -> None:
        confidences = self._last.pop(seq_id, None)
        if confidences:
            self.calibration.observe(confidences, accepted)

    def end(self, seq_id: int) -> None:
        self._last.pop(seq_id, None)


def token_confidence(dist: torch.Tensor, is_probs: bool) -> float:
    """The draft's probability of its most likely token: ``dist`` [1, vocab] logits (greedy
    drafting; -inf outside a reduced head's subset or a grammar's mask) or probabilities (sampling:
    the filtered distribution the token was drawn from)."""
    if is_probs:
        return float(dist.amax())
    return float(torch.softmax(dist.float(), dim=-1).amax())


def thresholds(k: int, draft_seconds: float, forward: Callable[[int], float], rate: float, acceptance: float,
               others: int = 0) -> tuple[tuple[float, ...], float]:
    """The running-confidence floors below which a draft of at most ``k`` tokens stops: per decision
    (entry i - 1: drafting token i + 1 after i tokens) the part its verification row costs, and the
    part a draft forward adds when the next token needs one -- a cascade's next token may come out
    of the forward already run, at no draft cost (module docstring).

    ``draft_seconds``: a drafted token's cost for this sequence; ``forward(rows)``: the target
    forward's predicted seconds; ``rate``: the step's predicted tokens per second (all its
    sequences); ``acceptance``: the next token's expected acceptance (``decision_acceptance``);
    ``others``: rows the step's other sequences add to the forward."""
    if k <= 1 or rate <= 0.0:
        return (), 0.0
    scale = rate / max(_MIN_ACCEPTANCE, min(1.0, acceptance))
    rows = [max(0.0, forward(others + i + 2) - forward(others + i + 1)) * scale for i in range(1, k)]
    return tuple(rows), draft_seconds * scale


def chain_floors(k: int, max_k: int, batch: int, draft_seconds: float, forward: Callable[[int], float],
                 rate: float, acceptance: Sequence[float]) -> tuple[int, tuple[float, ...], float]:
    """For a chain planned at ``k`` tokens: the longest it may run -- alone on the engine ``max_k``,
    in a batch k (the scheduler reserves cache blocks for k, and deeper chains of several sequences
    have not been measured) -- and its ``thresholds``, the rest of the batch taken at k tokens each.
    ``acceptance``: the conditional acceptance by position measured for these chains; a decision
    is priced with the second position's, never below the first's (``decision_acceptance``)."""
    cap = max(k, max_k) if batch == 1 else k
    floors, draft_floor = thresholds(cap, draft_seconds, forward, rate, decision_acceptance(acceptance),
                                     others=(batch - 1) * (k + 1))
    return cap, floors, draft_floor


def decision_acceptance(acceptance: Sequence[float]) -> float:
    """The acceptance a chain's decision to draft one more token expects of that token: the
    measured acceptance of position 2 -- the first position a chain decides about, measured on the
    chains that went on to it, so on the drafts confident enough to -- but never below position 1's,
    which every chain drafts: a position-2 estimate starved by chains that stopped before it must
    not lock it out."""
    first = acceptance[0]
    return max(first, acceptance[1]) if len(acceptance) > 1 else first


def should_stop(confidence: float, drafted: int, floors: Sequence[float], draft_floor: float = 0.0) -> bool:
    """After ``drafted`` tokens of running confidence ``confidence``: stop before the next one?
    ``draft_floor``: added where the next token needs a draft forward (``thresholds``)."""
    return 0 < drafted <= len(floors) and confidence < floors[drafted - 1] + draft_floor


__all__ = ["Calibration", "ConfidenceLog", "chain_floors", "decision_acceptance", "should_stop", "thresholds",
           "token_confidence"]
