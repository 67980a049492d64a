"""Cost tables and a two-arm bandit (a draft model and shadow-scored n-gram lookup) for tests of
``--spec auto``'s choices, with costs set directly instead of measured."""
from __future__ import annotations

from tokenleap.spec.bandit import Bandit, BanditConfig
from tokenleap.spec.controller import ControllerConfig, DraftLengthController

FLAT = {r: 0.010 + 0.001 * r for r in range(1, 20)}  # a forward costs little more for more rows


def costs(forward: dict[int, float]) -> DraftLengthController:
    """The target's costs: a forward over each row count measured at the given seconds."""
    ctl = DraftLengthController(ControllerConfig(max_k=4))
    for rows, s in forward.items():
        ctl.observe_forward(rows, s)
    return ctl


def bandit(draft_cost: float, ngram_cost: float = 1e-6, settle_steps: int = BanditConfig.settle_steps,
           **config) -> Bandit:
    """Arms "draft" (seconds per drafted token ``draft_cost``) and "ngram" (shadow-scored)."""
    b = Bandit([("draft", False), ("ngram", True)], BanditConfig(max_k=4, settle_steps=settle_steps, **config))
    b.observe_draft("draft", 4, 4 * draft_cost, 1)
    b.observe_draft("ngram", 4, 4 * ngram_cost, 1)
    return b
