"""The measured cost tables (``spec/costs.py``): a forward figure that nothing re-measures."""
from __future__ import annotations

import pytest

from tokenleap.spec.costs import STALE_FORWARDS, CostTables


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
