"""The adaptive draft length follows measured acceptance and cost."""
from __future__ import annotations

import pytest

from tokenleap.spec.controller import ControllerConfig, DraftLengthController
from tokenleap.errors import TokenleapError
from tokenleap.spec.proposers.draft_model import DraftModelProposer

from conftest import tiny_model


def controller(acceptance: float, steps: int = 200, draft_cost: float = 0.05, probe_every: int = 16):
    c = DraftLengthController(ControllerConfig(max_k=8, probe_every=probe_every))
    for rows in range(1, 10):  # verification nearly free up to 9 rows (memory-bound target)
        c.observe_forward(rows, 1.0 + 0.02 * (rows - 1))
    c.observe_draft(1, draft_cost)
    # feed per-position outcomes with conditional acceptance `acceptance` at every position
    import random
    rng = random.Random(0)
    for _ in range(steps):
        accepted = 0
        while accepted < 8 and rng.random() < acceptance:
            accepted += 1
        c.observe_acceptance(8, accepted)
    return c


def test_k_shrinks_as_acceptance_falls():
    ks = [controller(a).choose() for a in (0.95, 0.8, 0.6, 0.4)]
    assert ks == sorted(ks, reverse=True)
    assert ks[0] >= 6 and ks[-1] <= 2


def test_never_matching_draft_switches_to_plain_and_probes():
    c = controller(0.0, probe_every=5)
    picks = [c.choose() for _ in range(10)]
    assert picks.count(0) == 8  # plain decoding ...
    assert picks[4] > 0 and picks[9] > 0  # ... with a short probe every 5 steps


def test_expensive_verification_means_plain():
    c = DraftLengthController(ControllerConfig(max_k=8))
    for rows in range(1, 10):  # fp32 row-exact: every row costs a full matrix-vector pass
        c.observe_forward(rows, float(rows))
    c.observe_draft(1, 0.1)
    for _ in range(50):
        c.observe_acceptance(8, 5)
    assert c.choose() == 0


def test_load_turns_speculation_off_and_back_on():
    c = DraftLengthController(ControllerConfig(max_k=8))
    for rows in range(1, 160):  # memory-bound up to ~8 rows, then compute-bound: linear in rows
        c.observe_forward(rows, max(1.0, rows / 8))
    c.observe_draft(1, 0.02)
    for _ in range(100):
        c.observe_acceptance(8, 6)
    assert c.choose(batch=1) > 0
    assert c.choose(batch=16) == 0
    assert c.choose(batch=1) > 0


def test_fixed_k_is_kept():
    c = DraftLengthController(ControllerConfig(max_k=8, fixed_k=3))
    assert c.choose() == 3


def test_draft_with_other_vocabulary_is_refused():
    draft = tiny_model("llama", vocab=50)
    with pytest.raises(TokenleapError, match="vocabulary"):
        DraftModelProposer(draft, target_vocab_size=96, max_len=64)


def test_no_probe_when_even_full_acceptance_cannot_pay():
    c = DraftLengthController(ControllerConfig(max_k=8, probe_every=3))
    for rows in range(1, 160):  # compute-bound: cost grows with rows
        c.observe_forward(rows, max(1.0, rows / 8))
    c.observe_draft(1, 0.2)
    for _ in range(50):
        c.observe_acceptance(8, 0)  # drafts never match
    assert [c.choose(batch=16) for _ in range(9)] == [0] * 9  # heavy load: probing is pointless
    assert any(c.choose(batch=1) > 0 for _ in range(9))  # alone: probes go on


def test_unmeasured_large_blocks_are_predicted_compute_bound():
    c = DraftLengthController(ControllerConfig(max_k=8))
    c.observe_forward(16, 2.0)
    assert c.predict_forward(8) == 2.0 and c.predict_forward(12) == 2.0
    assert c.predict_forward(48) == 6.0


def test_unmeasured_larger_blocks_follow_the_slope_of_the_two_largest_measured():
    """A batch never measured is judged by the row costs smaller batches measured, not tried blind:
    past the largest measured block the cost grows along the last measured slope, or the slope
    from the smallest block if that is steeper. One sequence still explores a longer draft as if
    it cost no more than the largest measured block."""
    c = DraftLengthController(ControllerConfig(max_k=4))
    c.observe_forward(1, 1.0)
    c.observe_forward(4, 1.6)  # 0.2 s a row from 1 to 4 rows
    assert c.predict_forward(8) == pytest.approx(2.4)
    assert c.predict_forward(8, explore=True) == pytest.approx(1.6)  # one sequence: try it once
    assert c.predict_forward(40) == pytest.approx(1.6 * 40 / 4)  # beyond 16 rows: at least ~ rows
    assert c.predict_forward(40, explore=True) == pytest.approx(1.6 * 40 / 4)
    c.observe_forward(6, 1.5)  # a noisy dip flattens the last slope; the one from the smallest
    assert c.predict_forward(8) == pytest.approx(1.5 + 2 * 0.1)  # block (0.1 s a row) carries on
    c = DraftLengthController(ControllerConfig(max_k=4))
    for rows in range(1, 7):  # measured alone with drafts of up to 5 tokens: 2 rows as cheap as
        c.observe_forward(rows, 1.0 + 0.5 * max(0, rows - 2))  # one, then compute-bound
    c.observe_draft(1, 0.05)
    for i in range(100):
        c.observe_acceptance(4, 0 if i % 10 == 0 else 4)  # b_1 ~ 0.9
    assert c.choose(batch=1) > 0
    assert not c.would_speculate(batch=4) and c.choose(batch=4) == 0  # 4 * (k + 1) rows: too costly


def test_a_catch_up_is_made_only_when_it_pays_back():
    """Drafting for sequences the draft has not followed first costs a catch-up; speculation turns
    on only when the time it saves over the tokens still to generate exceeds that cost, and no
    probe pays for a large catch-up."""
    c = DraftLengthController(ControllerConfig(max_k=4, probe_every=2))
    for rows in range(1, 6):
        c.observe_forward(rows, 1.0)
    c.observe_draft(1, 0.05)
    for _ in range(100):
        c.observe_acceptance(4, 4)
    assert c.choose(backlog=200, remaining=10) > 0  # catch-up cost not measured yet: optimistic
    c.observe_catch_up(100, 10.0)  # 0.1 s a token
    k = c.choose(backlog=0, remaining=10)
    saved = 10 * (1 / c.rate(0) - 1 / c.rate(k))  # ~7.6 s over 10 tokens
    assert k > 0 and 2.0 < saved < 20.0
    assert c.would_speculate(1, backlog=int(saved / 0.1) - 5, remaining=10)
    assert not c.would_speculate(1, backlog=int(saved / 0.1) + 5, remaining=10)
    assert [c.choose(backlog=200, remaining=10) for _ in range(6)] == [0] * 6  # no probe either
    assert c.choose(backlog=200, remaining=1000) > 0


def test_a_batch_catch_up_is_paid_only_from_the_gain_beyond_the_margin():
    """Several sequences: the catch-up must be repaid by what speculation is predicted to save
    beyond ``batch_margin`` -- the part of the prediction the choice itself trusts."""
    def controller(margin: float) -> DraftLengthController:
        c = DraftLengthController(ControllerConfig(max_k=1, batch_margin=margin))
        for rows in (1, 2, 4, 8):
            c.observe_forward(rows, 1.0)  # verification rows cost nothing extra (AMX tiles)
        c.observe_draft(4, 0.0, batch=4)
        for _ in range(200):
            c.observe_acceptance(1, 1)  # every draft accepted: k = 1 about doubles the rate
        c.observe_catch_up(100, 1.0)  # 0.01 s a token
        return c

    c = controller(0.15)
    plain, spec = c.rate(0, batch=4), c.rate(1, batch=4)
    assert spec == pytest.approx(2 * plain, rel=0.03)
    remaining = 100.0
    full = remaining * (1 / plain - 1 / spec)  # saved at the predicted rate
    beyond = remaining * (1 / plain - 1.15 / spec)  # saved beyond the 15% margin
    between = int((full + beyond) / 2 / 0.01)  # a backlog whose catch-up costs between the two
    assert not c.would_speculate(4, backlog=between, remaining=remaining)
    assert c.choose(batch=4, backlog=between, remaining=remaining) == 0
    assert c.would_speculate(4, backlog=int(beyond / 0.01) - 2, remaining=remaining)
    assert controller(0.0).would_speculate(4, backlog=between, remaining=remaining)  # no margin: pays
    assert c.would_speculate(1, backlog=between, remaining=remaining)  # one sequence, no margin: it pays


def test_a_probe_needing_a_catch_up_comes_within_the_exploration_share():
    """Figures measured at a bad moment said speculation does not pay; every new prompt then
    starts with a backlog the draft must catch up on. A probe still comes -- once its catch-up is
    at most explore_share of the time decoded plainly since the last draft -- so speculation can
    turn back on, and exploring never costs more than that share."""
    c = DraftLengthController(ControllerConfig(max_k=4, probe_every=4, explore_share=0.05))
    for rows in range(1, 6):
        c.observe_forward(rows, 0.1 + 0.01 * (rows - 1))  # a plain step 0.1 s; drafts would pay ...
    c.observe_draft(1, 0.01)
    for _ in range(50):
        c.observe_acceptance(2, 0)  # ... but were measured never accepted
    c.observe_catch_up(100, 1.0)  # 0.01 s a token: a 100-token prompt costs 1 s = 10 plain steps
    assert not c.would_speculate(1, backlog=100)
    ks = [c.choose(backlog=100, remaining=1000) for _ in range(250)]
    probes = [i for i, k in enumerate(ks) if k > 0]
    assert probes and probes[0] >= 199  # 1 s of catch-up once 20 s (200 steps of 0.1 s) went plainly
    assert all(k == c.cfg.probe_k for i, k in enumerate(ks) if i in probes)
    assert len(probes) * 1.0 <= 0.05 * 0.1 * len(ks) + 1.0  # catch-ups within the share (plus one)
    assert all(c.choose(batch=2, backlog=100, remaining=1000) == 0 for _ in range(300))  # not when batched


def test_a_rarely_measured_small_block_never_costs_more_than_a_larger_one():
    """Plain steps of 3 sequences were timed once at a slow moment (3 rows: 0.97 s) and 4 rows many
    times since (0.62 s): 3 rows are predicted at most 0.62 s, so the stale figure cannot make plain
    decoding at batch 3 look slow and speculation look like a gain."""
    c = DraftLengthController(ControllerConfig(max_k=4))
    c.observe_forward(3, 0.97)
    for _ in range(5):
        c.observe_forward(4, 0.62)
    c.observe_forward(8, 0.91)
    assert c.predict_forward(3) == pytest.approx(0.62)
    assert c.predict_forward(4) == pytest.approx(0.62) and c.predict_forward(8) == pytest.approx(0.91)
    assert c.predict_forward(6) == pytest.approx(0.62 + 0.29 / 2)  # interpolated as before


def test_a_batch_draft_never_predicted_cheaper_than_a_smaller_batch_forward():
    """A batch-3 draft figure caught once as 0.4 ms a token (a forward that mostly fed another
    sequence's backlog) is raised to what the batch-2 forward costs: 2 * 9.1 ms over 3 sequences."""
    c = DraftLengthController(ControllerConfig(max_k=4))
    c.observe_draft(1, 0.0149)
    c.observe_draft(4, 0.0364, batch=2)  # 9.1 ms a token, two sequences
    c.observe_draft(3, 0.0012, batch=3)
    assert c.predict_draft(3) == pytest.approx(2 * 0.0091 / 3)
    assert c.predict_draft(2) == pytest.approx(0.0091)  # measured and consistent: as measured
    assert c.predict_draft(6) == pytest.approx(2 * 0.0091 / 6)  # unmeasured: floored the same way


def test_draft_cost_is_learned_per_batch_size():
    c = DraftLengthController(ControllerConfig(max_k=4))
    assert c.predict_draft(4) == 0.0  # nothing measured: optimistic
    c.observe_draft(3, 0.3)  # one sequence: 0.1 s per drafted token
    c.observe_draft(8, 0.2, batch=4)  # four sequences drafting together: 0.025 s per token
    assert c.predict_draft(1) == pytest.approx(0.1) and c.predict_draft(4) == pytest.approx(0.025)
    assert c.predict_draft(2) == pytest.approx(0.1)  # unmeasured: the nearest smaller batch's cost
    assert c.predict_draft(8) == pytest.approx(0.025)
    c.observe_forward(4, 0.1)
    c.observe_forward(8, 0.1)
    # the batch-4 rate uses the batch-4 draft cost: k=1 costs 4 * 0.025 + forward(8)
    assert c.rate(1, 4) == pytest.approx(4 * c.expected_tokens(1) / (4 * 0.025 + 0.1))


def test_unexplored_positions_are_guessed_from_the_deepest_measured_one():
    c = DraftLengthController(ControllerConfig(max_k=8, prior_acceptance=0.6))
    for rows in range(1, 10):
        c.observe_forward(rows, 1.0 + 0.05 * (rows - 1))
    c.observe_draft(1, 0.05)
    for _ in range(100):  # only k=2 was ever drafted, always fully accepted
        c.observe_acceptance(2, 2)
    assert c.accept[2] == 0.6  # position 3 itself has no measurement
    assert c.expected_tokens(4) > 4.5  # but it is guessed like position 2 (~1.0), not the prior
    assert c.choose() > 2  # so longer drafts get tried


def test_one_slow_measurement_does_not_pin_a_draft_length():
    """A single slow forward of the block k=5 needs (say another process ran) is outvoted by the
    next few measurements instead of keeping k small for the rest of the request."""
    c = controller(0.95)
    for _ in range(2):
        c.observe_forward(6, 1.1)  # k=5 ran a few times
    assert c.choose() >= 5
    c.observe_forward(6, 20.0)  # one outlier, 20x the real cost
    assert c.forward_cost[6] < 1.2 and c.choose() >= 5
    for _ in range(2):
        c.observe_forward(6, 20.0)  # but a lasting change is followed
    assert c.forward_cost[6] == 20.0 and c.choose() != 5


def test_overhead_outside_the_forwards_counts_against_speculation():
    """Time a speculative step spends beyond the two forwards (the draft catching up on a skipped
    prompt, bookkeeping) is part of its cost: measured large enough, the controller decodes plainly."""
    c = controller(0.8)
    assert c.choose() > 0
    for _ in range(3):
        c.observe_step(False, 1, 0.01)
        c.observe_step(True, 1, 5.0)
    assert c.step_overhead[(True, 1)] == 5.0 and c.choose() == 0


def test_small_predicted_gain_speculates_alone_but_not_in_a_batch():
    """With several sequences a predicted gain below ``batch_margin`` keeps plain decoding."""
    def rates(margin: float):
        c = DraftLengthController(ControllerConfig(max_k=1, batch_margin=margin))
        for rows in (1, 2, 4):  # drafting one token (acceptance ~1/3) predicts ~1.1x plain
            c.observe_forward(rows, 1.0 if rows <= 2 else 1.2)
        c.observe_draft(1, 0.0)
        c.observe_draft(2, 0.0, batch=2)
        for _ in range(200):
            c.observe_acceptance(1, 0)
            c.observe_acceptance(1, 0)
            c.observe_acceptance(1, 0)
            c.observe_acceptance(1, 1)
        return c

    c = rates(0.15)
    gain = c.rate(1, batch=2) / c.rate(0, batch=2)
    assert 1.0 < gain < 1.15
    assert c.choose(batch=1) == 1 and c.choose(batch=2) == 0 and not c.would_speculate(batch=2)
    assert rates(0.0).choose(batch=2) == 1


def test_rows_a_proposer_attaches_to_its_steps_are_priced_in():
    """Lookahead adds its Jacobi window (here 6 rows) to every drafting step's forward: where rows
    cost (AVX2: 1 + 0.12 a row) speculation that pays with k + 1 rows does not with 6 more."""
    def fed(aux_rows: int) -> DraftLengthController:
        c = DraftLengthController(ControllerConfig(max_k=4, probe_every=10**6))
        c.aux_rows = aux_rows
        for rows in range(1, 17):
            c.observe_forward(rows, 1.0 + 0.12 * (rows - 1))
        c.observe_draft(1, 0.0)  # a free proposer, like n-gram lookup
        for _ in range(200):
            c.observe_acceptance(4, 1)  # the first guess holds half the time, rarely more
            c.observe_acceptance(4, 0)
        return c
    assert fed(0).choose() > 0
    assert fed(6).choose() == 0
    assert fed(6).step_cost(2) > fed(0).step_cost(2) and fed(6).step_cost(0) == fed(0).step_cost(0)


def test_a_block_caught_at_a_slow_moment_is_probed_again():
    """A fresh engine's first steps can time a 3-row forward at many times its cost; plain decoding
    then looks best and that figure is never measured again unless a probe re-measures it. Probes
    go on for one sequence, and a few of them bring speculation back."""
    c = DraftLengthController(ControllerConfig(max_k=4, probe_every=4))
    c.observe_forward(3, 0.5)  # the first step: cold, ten times its real cost
    c.observe_forward(1, 0.05)
    c.observe_draft(1, 0.001)  # n-gram lookup: drafting is nearly free
    for _ in range(20):
        c.observe_acceptance(2, 2)  # drafts are accepted
    chosen = [c.choose() for _ in range(5)]
    assert chosen[:3] == [0, 0, 0] and chosen[3] > 0  # plain, then a probe after probe_every steps
    for _ in range(3):  # the probes' forwards, at the real cost
        c.observe_forward(chosen[3] + 1, 0.055)
    assert c.choose() > 0


def test_a_draft_cost_timed_through_a_stall_is_probed_again():
    """One drafting step timed through a stall (a garbage collection, a page fault) can price a
    free n-gram lookup at 90 ms a token: no probe could pay at that price, so without exploration
    the figure is never measured again. For one sequence a probe is still made once its extra cost
    fits ``explore_share`` of the time decoded plainly, and the re-measured cost brings speculation back."""
    c = DraftLengthController(ControllerConfig(max_k=4, probe_every=4))
    c.observe_forward(1, 0.036)
    c.observe_forward(3, 0.040)
    c.observe_draft(4, 0.35)  # 87.5 ms a token
    for _ in range(20):
        c.observe_acceptance(2, 2)
    assert not c._could_pay(2, 1, c.rate(0))
    chosen = [c.choose() for _ in range(200)]
    first = next(i for i, k in enumerate(chosen) if k > 0)
    # extra cost of the probe ~ 2 * 87.5 + 40 - 36 ms = 0.179 s: it waits for ~3.6 s of plain decoding
    assert 80 < first < 120 and sum(1 for k in chosen[:first] if k) == 0
    for _ in range(2):  # the probes' drafts, at their real cost
        c.observe_draft(2, 0.0002)
    assert c.choose() > 0


def test_exploration_beyond_paying_probes_costs_at_most_its_share():
    """Where speculation truly cannot pay (a slow draft), the probes made anyway cost at most
    ``explore_share`` of the time decoded plainly."""
    cfg = ControllerConfig(max_k=4, probe_every=4)
    c = DraftLengthController(cfg)
    c.observe_forward(1, 0.036)
    c.observe_forward(3, 0.040)
    c.observe_draft(1, 0.05)
    plain_seconds = extra = 0.0
    for _ in range(2000):
        k = c.choose()
        if k:
            extra += c.step_cost(k, 1) - 0.036
            c.observe_acceptance(k, 0)
        else:
            plain_seconds += 0.036
    assert 0 < extra <= cfg.explore_share * plain_seconds * 1.01


def test_auxiliary_rows_are_priced_at_their_recent_mean():
    """A proposer attaching its own rows on some drafting steps only (lookahead's window) is priced
    for what its steps added, starting from the most it may add."""
    c = DraftLengthController(ControllerConfig(max_k=4))
    c.aux_rows = 6
    for rows in range(1, 12):
        c.observe_forward(rows, 0.03 + 0.01 * rows)
    full = c.step_cost(2)
    for _ in range(30):
        c.observe_aux_rows(0)
    assert c.aux_rows == 0 and c.step_cost(2) < full - 0.05
    for _ in range(30):
        c.observe_aux_rows(6)
    assert c.aux_rows == 6 and c.step_cost(2) == pytest.approx(full)


def test_short_catch_ups_do_not_price_a_prompt():
    """A catch-up of a few tokens is one draft forward whose fixed cost, spread over them, is several
    times a prompt token's: the per-token figure comes from long catch-ups (prompts), and a short
    one is priced at least at a drafted token's time."""
    c = DraftLengthController(ControllerConfig())
    c.observe_draft(4, 0.032)  # 8 ms a drafted token (one-row forwards)
    c.observe_catch_up(120, 0.24)  # a prompt: 2 ms a token
    for _ in range(5):
        c.observe_catch_up(2, 0.009)  # after n-gram steps: 4.5 ms a token
    assert c.catch_up_cost == pytest.approx(0.002)
    assert c.catch_up_seconds(100) == pytest.approx(0.2)
    assert c.catch_up_seconds(2) == pytest.approx(0.008)  # one forward
    assert c.catch_up_seconds(0) == 0.0
    fresh = DraftLengthController(ControllerConfig())
    fresh.observe_catch_up(3, 0.012)  # only short ones seen so far: their figure stands in
    assert fresh.catch_up_cost == pytest.approx(0.004)
