"""The measured cost tables (``spec/costs.py``): a forward figure that nothing re-measures, and draft
figures read at the target's drift since they were measured."""
from __future__ import annotations

import pytest

from tokenleap.spec.bandit import Bandit, BanditConfig
from tokenleap.spec.controller import ControllerConfig, DraftLengthController
from tokenleap.spec.costs import MAX_DRIFT, STALE_FORWARDS, CostTables


def test_a_figure_caught_in_a_slow_spell_is_bounded_by_fresher_neighbours_until_measured_again():
    t = CostTables()
    for rows, s in ((1, 0.025), (2, 0.030), (3, 0.040)):
        t.observe_forward_seconds(rows, s)
    for _ in range(3):  # two-row steps in a slow spell: the figure's median moves up
        t.observe_forward_seconds(2, 0.036)
    assert t.predict_forward(2) == pytest.approx(0.036)  # fresh: taken as measured
    for _ in range(STALE_FORWARDS + 1):  # plain steps and three-row steps at the usual speed
        t.observe_forward_seconds(1, 0.025)
        t.observe_forward_seconds(3, 0.040)
    assert t.predict_forward(2) == pytest.approx(0.0325)  # stale: the line through 1 and 3 rows
    assert t.predict_forward(1) == pytest.approx(0.025) and t.predict_forward(3) == pytest.approx(0.040)
    for _ in range(3):  # tried again, and measured as slow as before: taken as measured
        t.observe_forward_seconds(2, 0.036)
    assert t.predict_forward(2) == pytest.approx(0.036)


def test_a_stale_figure_below_its_neighbours_line_or_without_fresh_neighbours_on_both_sides_stands():
    t = CostTables()
    t.observe_forward_seconds(2, 0.026)  # cheaper than the line through 1 and 3 rows: never raised
    for _ in range(STALE_FORWARDS + 1):
        t.observe_forward_seconds(1, 0.025)
        t.observe_forward_seconds(3, 0.040)
    assert t.predict_forward(2) == pytest.approx(0.026)
    t = CostTables()
    t.observe_forward_seconds(8, 0.080)  # the largest block measured: no fresh block above it
    for _ in range(STALE_FORWARDS + 1):
        t.observe_forward_seconds(1, 0.025)
    assert t.predict_forward(8) == pytest.approx(0.080)


def _slow_spell_then_fast(t: CostTables, fast: float, times: int) -> None:
    """A draft figure and a catch-up figure measured while the target's one- and four-row forwards
    took 30 / 36 ms, then ``times`` plain one-row steps at ``fast`` seconds."""
    for _ in range(5):
        t.observe_forward_seconds(1, 0.030)
        t.observe_forward_seconds(4, 0.036)
    t.observe_draft(3, 0.030)  # 10 ms a drafted token
    t.observe_catch_up(100, 0.200)  # 2 ms a token caught up
    for _ in range(times):
        t.observe_forward_seconds(1, fast)


def test_draft_figures_follow_the_targets_drift_once_its_forwards_are_measured_afresh():
    t = CostTables()
    _slow_spell_then_fast(t, 0.024, t.cost_window)  # the machine got 20% faster; the draft did not run
    assert t.drift(t._draft_mark) == pytest.approx(0.8)
    assert t.predict_draft(1) == pytest.approx(0.008)
    assert t.predict_draft(2) == pytest.approx(0.008)  # a batch never measured: the smaller batch's figure
    assert t.catch_up_per_token() == pytest.approx(0.0016)
    assert t.catch_up_seconds(100) == pytest.approx(0.16)
    assert t.predict_forward(4) == pytest.approx(0.036)  # the target's own figures are taken as measured
    t.observe_draft(3, 0.024)  # the draft measured again, at the new speed: nothing left to scale
    assert t.drift(t._draft_mark) == 1.0
    assert t.predict_draft(1) == pytest.approx(0.009)  # the median of 10 and 8 ms


def test_no_drift_until_a_row_count_is_measured_afresh_and_never_past_the_bound():
    t = CostTables()
    _slow_spell_then_fast(t, 0.024, t.cost_window - 1)  # the median still holds a figure from before
    assert t.predict_draft(1) == pytest.approx(0.010) and t.catch_up_per_token() == pytest.approx(0.002)
    t = CostTables()
    _slow_spell_then_fast(t, 0.120, t.cost_window)  # four times slower (a stall): at most MAX_DRIFT
    assert t.predict_draft(1) == pytest.approx(0.010 * MAX_DRIFT)
    t = CostTables()
    t.follow_drift = False  # figures taken as measured
    _slow_spell_then_fast(t, 0.024, t.cost_window)
    assert t.predict_draft(1) == pytest.approx(0.010)


def test_an_auto_arm_reads_its_draft_figure_at_the_engines_drift():
    target = DraftLengthController(ControllerConfig())
    bandit = Bandit([("draft", False), ("ngram", True)], BanditConfig())
    bandit.bind_target(target)
    for _ in range(5):
        target.observe_forward_seconds(1, 0.030)
        target.observe_forward_seconds(3, 0.036)
    bandit.observe_draft("draft", 2, 0.020, batch=1)  # 10 ms a token, in the slow spell
    seq = bandit.new_sequence()
    before = bandit.rate(seq, "draft", 2, 1, target)
    for _ in range(5):  # plain steps only, 25% faster: the arm did not draft meanwhile
        target.observe_forward_seconds(1, 0.0225)
    assert bandit.arms["draft"].costs.predict_draft(1) == pytest.approx(0.0075)
    # the step's three-row forward is still the slow spell's figure (not measured again); only the
    # draft's part of the step got cheaper
    after = bandit.rate(seq, "draft", 2, 1, target)
    expected_tokens = seq.arms["draft"].acceptance.expected_tokens(2, bandit.arms["draft"].prior())
    assert 1 / after == pytest.approx(1 / before - 2 * 0.0025 / expected_tokens)


def test_a_forward_figure_stale_when_the_draft_was_measured_gives_no_drift():
    t = CostTables()
    for _ in range(5):  # plain steps in a slow spell
        t.observe_forward_seconds(1, 0.034)
    for _ in range(STALE_FORWARDS + 1):  # a long stretch of drafting in a fast spell: 4-row steps
        t.observe_forward_seconds(4, 0.030)
    t.observe_draft(3, 0.024)  # the draft, measured in the fast spell
    for _ in range(t.cost_window):  # plain steps, still fast
        t.observe_forward_seconds(1, 0.025)
    # the one-row figure was the slow spell's when the draft was measured: it says nothing of the
    # draft's figure, which is as fast as the machine is now
    assert t.drift(t._draft_mark) == 1.0 and t.predict_draft(1) == pytest.approx(0.008)
