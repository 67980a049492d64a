"""``SpecStats``' derived figures as ``docs/METRICS.md`` defines them: per-position acceptance is
P(first i drafts accepted) over the steps that drafted, so it never rises with i and adds up to the
acceptance length; acceptance at depth conditions on the steps that drafted that deep."""
from __future__ import annotations

import pytest

from tokenleap.spec.stats import SpecStats


def _stats(steps: list[tuple[int, int]]) -> SpecStats:
    st = SpecStats()
    for proposed, accepted in steps:
        st.record_step(proposed, accepted, accepted + 1)
    return st


def test_per_position_acceptance_is_over_the_steps_that_drafted_and_adds_up_to_the_acceptance_length():
    st = _stats([(4, 4), (2, 2), (4, 1), (1, 0), (0, 0)])  # (the plain step counts nowhere)
    assert st.per_position_acceptance == [0.75, 0.5, 0.25, 0.25]
    assert st.acceptance_length == pytest.approx(1 + sum(st.per_position_acceptance)) == 2.75
    assert st.per_position_acceptance_at_depth == pytest.approx([3 / 4, 2 / 3, 1 / 2, 1 / 2])
    figures = st.to_dict()
    assert figures["per_position_acceptance"] == [0.75, 0.5, 0.25, 0.25]
    assert figures["per_position_acceptance_at_depth"] == [0.75, 0.6667, 0.5, 0.5]


def test_an_adaptive_draft_length_cannot_make_it_rise_with_depth():
    st = _stats([(1, 0), (1, 0), (3, 3)])  # deep drafts only where the text was easy
    assert st.per_position_acceptance_at_depth == [1 / 3, 1.0, 1.0]  # rises: conditioned on the depth
    assert st.per_position_acceptance == pytest.approx([1 / 3, 1 / 3, 1 / 3])
    merged = _stats([(2, 1)])
    merged.merge(st)
    a = merged.per_position_acceptance
    assert all(x >= y for x, y in zip(a, a[1:])) and merged.acceptance_length == pytest.approx(1 + sum(a))


def test_nothing_drafted_gives_no_per_position_figures():
    st = _stats([(0, 0), (0, 0)])
    assert st.per_position_acceptance == [] and st.to_dict()["per_position_acceptance"] == []
    assert st.acceptance_length == 1.0
