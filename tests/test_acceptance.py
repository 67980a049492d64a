"""The acceptance-count test (``spec/acceptance.py``): which drafts count as trials, the count's
statistic, and what it can see -- pure functions, checked by hand and against simulated verifiers."""
from __future__ import annotations

import math

import pytest
import torch

from tokenleap.spec.acceptance import (Trial, acceptance_count, acceptance_mean, acceptance_verdict,
                                       chain_trials, detectable_factor, tree_trials)
from tokenleap.spec.tree import TokenTree


def test_a_chain_tests_each_draft_up_to_the_first_rejection():
    q = torch.full((3, 8), 0.125)  # [k, vocab]
    q[1, 6] = 0.5
    assert chain_trials(4, [5, 6, 7], q, 1) == [Trial(4, 5, 0.125, True), Trial(5, 6, 0.5, False)]
    assert chain_trials(0, [5, 6, 7], None, 3) == [Trial(0, 5, 1.0, True), Trial(1, 6, 1.0, True),
                                                  Trial(2, 7, 1.0, True)]  # all kept: no rejected trial
    assert chain_trials(2, [], None, 0) == []  # a plain step


def test_a_tree_tests_the_first_child_of_each_node_on_the_walk():
    # root 0 -> children 1 (token 10), 2 (token 11); node 2 -> child 3 (token 12); node 1 -> child 4 (token 13)
    tree = TokenTree(torch.tensor([9, 10, 11, 12, 13]), torch.tensor([-1, 0, 0, 2, 1]))
    # the walk took the second child (the first was rejected), then node 2's only child, then stopped
    assert tree_trials(3, tree, [2, 3]) == [Trial(3, 10, 1.0, False), Trial(4, 12, 1.0, True)]
    assert tree_trials(3, tree, [1, 4]) == [Trial(3, 10, 1.0, True), Trial(4, 13, 1.0, True)]
    assert tree_trials(3, tree, []) == [Trial(3, 10, 1.0, False)]


def test_acceptance_mean_is_min_one_p_over_q():
    assert acceptance_mean(0.3, 1.0) == pytest.approx(0.3)
    assert acceptance_mean(0.3, 0.6) == pytest.approx(0.5)
    assert acceptance_mean(0.9, 0.3) == 1.0
    assert acceptance_mean(0.2, 0.0) == 1.0 and acceptance_mean(0.0, 0.0) == 0.0  # q(x) = 0 never divides


def test_the_count_against_a_hand_computation():
    trials = [Trial(i, 1, 1.0, ok) for i, ok in enumerate([True, True, False, True])]
    count = acceptance_count(trials, [0.5, 0.5, 0.5, 0.5])
    assert (count.accepted, count.expected, count.variance) == (3, 2.0, 1.0)
    # so little spread is tested exactly: P(X >= 3) = 5 / 16 for four fair coins, two-sided twice that
    assert count.z == pytest.approx(1.0) and count.p_value == pytest.approx(0.625)
    wide = acceptance_count([Trial(i, 1, 1.0, i < 60) for i in range(100)], [0.5] * 100)  # variance 25
    assert wide.z == pytest.approx(2.0) and wide.p_value == pytest.approx(0.0455003, rel=1e-5)  # normal
    # means piled near 1: one ordinary rejection among 100 is no evidence (z -2.85: the normal rule fails it)
    peaked = acceptance_count([Trial(i, 1, 1.0, i > 0) for i in range(100)], [0.999] * 100)
    assert peaked.z < -2.8 and peaked.p_value == pytest.approx(2 * (1 - 0.999 ** 100), rel=1e-6)  # 0.19
    assert not peaked.rejects(0.01)
    certain = acceptance_count([Trial(0, 1, 1.0, False)], [1.0])  # a draft certain to be kept, rejected
    assert certain.z == -math.inf and certain.rejects(0.01)
    # trials certain either way only shift the count: fifty sure ones beside the four fair coins
    shifted = acceptance_count(trials + [Trial(9, 1, 1.0, True)] * 50 + [Trial(9, 1, 1.0, False)] * 50,
                               [0.5] * 4 + [1.0] * 50 + [0.0] * 50)
    assert shifted.p_value == pytest.approx(0.625)
    broken = acceptance_count(trials + [Trial(9, 1, 1.0, False)], [0.5] * 4 + [1.0])  # a sure one rejected
    assert broken.impossible == 1 and broken.p_value == 0.0 and broken.rejects(0.01)
    failed, summary, figures = acceptance_verdict(broken, 0.01)
    assert not failed and "1 drafts went the way min(1, p/q) made impossible" in summary and figures["impossible"] == 1


def _simulated(factor: float, n: int, seed: int) -> tuple[list[Trial], list[float]]:
    """``n`` trials of a verifier that keeps drafts with ``min(1, factor * p / q)``."""
    gen = torch.Generator().manual_seed(seed)
    means = (0.05 + 0.9 * torch.rand(n, generator=gen, dtype=torch.float64)).tolist()
    u = torch.rand(n, generator=gen, dtype=torch.float64).tolist()
    return [Trial(i, 0, 1.0, u[i] < min(1.0, factor * m)) for i, m in enumerate(means)], means


def test_a_right_verifier_passes_at_about_the_level_and_an_over_accepting_one_fails():
    alpha = 0.05
    right = [acceptance_count(*_simulated(1.0, 2000, s)).rejects(alpha) for s in range(200)]
    assert 0.015 <= sum(right) / len(right) <= 0.10  # the false-alarm rate is the level
    wrong = [acceptance_count(*_simulated(1.1, 2000, s)).rejects(alpha) for s in range(40)]
    assert sum(wrong) >= 38  # a 10% over-acceptance moves 2,000 trials of these means by ~5 sd
    under = acceptance_count(*_simulated(0.8, 2000, 7))
    assert under.rejects(alpha) and under.z < 0  # two-sided: too few kept fails as well


def test_detectable_factor_is_where_the_shift_reaches_the_critical_value():
    count = acceptance_count(*_simulated(1.0, 2000, 3))
    seen = detectable_factor(count, 0.01)
    assert 1.0 < seen < 1.1 and count.shift(seen) == pytest.approx(2.5758, abs=1e-3)
    assert detectable_factor(acceptance_count(*_simulated(1.0, 200, 3)), 0.01) > seen  # fewer trials see less
    certain = acceptance_count([Trial(0, 1, 1.0, True)], [1.0])
    assert detectable_factor(certain, 0.01) == math.inf


def test_the_verdict_says_what_failed_and_what_a_pass_could_see():
    ok, summary, figures = acceptance_verdict(acceptance_count(*_simulated(1.0, 2000, 5)), 0.01)
    assert ok and "would be seen" in summary and figures["trials"] == 2000 and figures["detectable_factor"] > 1
    bad, summary, _ = acceptance_verdict(acceptance_count(*_simulated(1.3, 2000, 5)), 0.01)
    assert not bad and "not kept as often as min(1, p/q) says" in summary
    none, summary, _ = acceptance_verdict(acceptance_count([], []), 0.01)
    assert not none and "no draft was tested" in summary
    sure, summary, figures = acceptance_verdict(acceptance_count([Trial(1, 0, 1.0, True)] * 30, [1.0] * 30), 0.01)
    assert sure and "outcome was certain" in summary and figures["detectable_factor"] is None
    # little spread, one ordinary rejection: passes, and says no factor can be stated (not "certain")
    flat = acceptance_count([Trial(1, 0, 1.0, i > 0) for i in range(150)], [0.97] * 150)
    ok, summary, _ = acceptance_verdict(flat, 0.01)
    assert ok and "too little spread (sum pi(1 - pi) = 4.37)" in summary and "certain" not in summary
