"""``--spec auto``'s exploration within a sequence: how far the chosen arm drafts, when a draft model
that must first catch up is looked at again, and which arms may catch up to fill in for another."""
from __future__ import annotations

from collections.abc import Callable

from tokenleap.spec.bandit import Bandit, BanditConfig
from tokenleap.spec.bandit_state import Choice

from bandit_helpers import FLAT, bandit, costs


def planned_lengths(config: dict, first: int, steps: int, takes: Callable[[int], int]) -> list[int]:
    """The draft arm's k over ``steps`` steps of a sequence in which n-gram lookup missed and the draft
    arm's one draft of ``first`` tokens had its second position fail (six one-token drafts passed since);
    the text takes ``takes(k)`` of each k drafted. ``config``: the bandit's settings."""
    b, target = bandit(draft_cost=0.003, settle_steps=0, **config), costs(FLAT)
    seq = b.new_sequence()
    for _ in range(10):
        b.observe_acceptance(seq, "ngram", 4, 0)
    b.observe_acceptance(seq, "draft", first, 1)  # position 1 passed, position 2 failed
    for _ in range(6):
        b.observe_acceptance(seq, "draft", 1, 1)
    ks = []
    for _ in range(steps):
        choice = b.plan(seq, 1, target, {}, 100, 4)[0]
        assert choice.arm == "draft"
        ks.append(choice.k)
        b.observe_acceptance(seq, "draft", choice.k, takes(choice.k))
        b.drafted(seq, "draft")
    return ks


def draft_lengths(deepen_every: int, steps: int = 40, deepen_on_whole: bool = False) -> list[int]:
    """The draft arm's k on a text it drafts well at every depth (``planned_lengths``)."""
    return planned_lengths({"deepen_every": deepen_every, "deepen_on_whole": deepen_on_whole}, 4, steps,
                           lambda k: k)  # the text takes every drafted token


def test_a_depth_judged_poor_once_is_drafted_again():
    never = draft_lengths(deepen_every=10**6)
    assert set(never) == {1}  # without deepening the failed position is never measured again
    ks = draft_lengths(deepen_every=8)
    assert ks[0] == 1 and 2 in ks[:8]  # position 2 is tried again within deepen_every steps ...
    assert min(ks[-5:]) >= 3  # ... and once the text shows it passes, the draft grows


def test_a_draft_accepted_whole_grows_a_token_a_step():
    slow = draft_lengths(deepen_every=8)
    ks = draft_lengths(deepen_every=8, deepen_on_whole=True)
    assert ks[:3] == [2, 3, 4] and set(ks[2:]) == {4}  # one deeper after each whole acceptance, to max_k
    assert slow[:4] == [1, 1, 1, 1]  # (by the interval alone: one deeper only after deepen_every steps)


def test_only_the_last_step_s_whole_draft_deepens_the_next():
    """A whole draft some steps ago (plain steps or other arms since, or a probe's) leaves the plan's k
    alone: only the step right after it drafts past it."""
    b = bandit(draft_cost=0.003, settle_steps=0, deepen_every=10**6)
    seq = b.new_sequence()
    seq.steps = 10
    b.observe_acceptance(seq, "draft", 3, 3)  # the draft of step 10, accepted whole
    seq.steps = 11  # (the next plan's step)
    assert b._deepen(seq, Choice("draft", 1, 1.0), 4).k == 4
    b.observe_acceptance(seq, "draft", 3, 3)
    seq.steps = 30  # ... and after eighteen steps without it
    assert b._deepen(seq, Choice("draft", 1, 1.0), 4).k == 1


def test_a_failed_deepening_stops_the_growth():
    ks = planned_lengths({"deepen_every": 10**6}, 4, 12, lambda k: min(k, 2))  # two tokens taken, never three
    assert ks[:2] == [2, 3] and set(ks[2:]) == {2}  # position 3 failed once: no growth after it


def probes(remaining: int | None, steps: int = 60) -> list[int]:
    """Steps at which a draft arm, not paying on earlier sequences' figures and behind this sequence
    by its prompt (50 tokens, one more each plain step, 0.5 ms each to feed), is probed."""
    b, target = bandit(draft_cost=0.002, settle_steps=0), costs(FLAT)
    b.observe_catch_up("draft", 100, 0.05)
    old = b.new_sequence()
    for _ in range(30):
        b.observe_acceptance(old, "draft", 4, 0)
        b.observe_acceptance(old, "ngram", 4, 0)
    seq = b.new_sequence()
    out = []
    for step in range(steps):
        left = float("inf") if remaining is None else remaining - step
        plan = b.plan(seq, 1, target, {"draft": 50 + step}, left, 4)
        if plan and plan[0].arm == "draft":
            out.append(step)
            break
    return out


def deepenings(deepen_backoff: int, steps: int = 120) -> int:
    """Steps the draft arm drafts past position 1 on a text that never takes position 2."""
    return sum(k > 1 for k in planned_lengths({"deepen_backoff": deepen_backoff}, 2, steps, lambda k: 1))


def test_a_deepened_position_that_keeps_failing_is_tried_less_often():
    assert deepenings(deepen_backoff=0) == 120 // BanditConfig.deepen_every  # every 8 steps
    assert deepenings(deepen_backoff=3) <= 5  # after 8, 16, 32, 64, 64 steps


def test_a_long_catch_up_gets_one_probe_per_answer():
    # the time since the last draft alone never affords the growing backlog ...
    assert probes(remaining=None) == []
    # ... the exploration share of the whole answer (128 tokens) does, once the arm is idle long enough
    assert probes(remaining=128) == [bandit(0.002).cfg.probe_every - 1]


def ranked_with_backlog(backlog: int, ngram_accepts: int, present: dict[str, bool] | None = None) -> list[str]:
    b, target = bandit(draft_cost=0.003, settle_steps=0), costs(FLAT)
    b.observe_catch_up("draft", 100, 0.05)  # 0.5 ms a token the draft missed
    seq = b.new_sequence()
    for _ in range(10):
        b.observe_acceptance(seq, "ngram", 4, ngram_accepts)
        b.observe_acceptance(seq, "draft", 4, 3)
    return [c.arm for c in b.rank(seq, 1, target, {"draft": backlog}, 100, 4, present)]


def test_an_arm_behind_the_first_catches_up_only_where_one_step_pays_for_it():
    assert ranked_with_backlog(1, ngram_accepts=4) == ["ngram", "draft"]  # a token behind: a cheap stand-in
    assert ranked_with_backlog(200, ngram_accepts=4) == ["ngram"]  # 0.1 s to stand in for one step
    assert ranked_with_backlog(200, ngram_accepts=0) == ["draft"]  # first: paid back over the answer


def test_a_catch_up_must_pay_back_against_the_arm_that_needs_none():
    # n-gram lookup accepting a position a step predicts nearly the draft's rate (166 against 173
    # tokens/s; plain 91): feeding the draft 60 tokens (30 ms) saves less than that over 100 tokens
    assert ranked_with_backlog(1, ngram_accepts=1) == ["draft", "ngram"]
    assert ranked_with_backlog(60, ngram_accepts=1) == ["ngram"]
    assert ranked_with_backlog(60, ngram_accepts=0) == ["draft"]  # n-gram does not pay: against plain


def test_no_catch_up_while_a_shadow_arm_without_a_match_this_step_is_predicted_to_beat_it():
    """n-gram lookup with nothing to propose for this one step, but copying this text better than
    the draft model would draft it, is still the arm for the rest of the answer: the draft does not
    catch up on a long backlog to fill the step (it may on a short one, where one step repays it)."""
    assert ranked_with_backlog(200, ngram_accepts=4, present={"ngram": False}) == []  # the step decodes plainly
    assert ranked_with_backlog(1, ngram_accepts=4, present={"ngram": False}) == ["draft"]  # repaid in one step
    # n-gram predicted below the draft (or below plain): the catch-up is judged as before
    assert ranked_with_backlog(60, ngram_accepts=1, present={"ngram": False}) == ["draft"]
    assert ranked_with_backlog(200, ngram_accepts=0, present={"ngram": False}) == ["draft"]


def first_arm(offer_every: int, present: dict[str, bool] | None = None) -> str:
    """The first choice for a text n-gram lookup copies perfectly whenever it has a match, which
    is on one step in ``offer_every``, against a draft accepting 3 of 4 (``present``: whether each
    shadow arm is known to have a proposal for the step)."""
    b, target = bandit(draft_cost=0.003, settle_steps=0), costs(FLAT)
    seq = b.new_sequence()
    for step in range(20):
        offered = step % offer_every == 0
        b.observe_offer(seq, "ngram", offered)
        if offered:
            b.observe_acceptance(seq, "ngram", 4, 4)
        b.observe_acceptance(seq, "draft", 4, 3)
    return b.rank(seq, 1, target, {}, 100, 4, present)[0].arm


def test_an_arm_that_rarely_has_a_draft_is_weighed_by_how_often_it_has_one():
    assert first_arm(offer_every=1) == "ngram"
    assert first_arm(offer_every=4) == "draft"  # three steps in four would decode plainly


def test_a_shadow_arm_known_to_propose_is_judged_by_its_proposals_and_one_known_not_to_is_left_out():
    """Shadow arms' proposals are made before the plan: on a step n-gram has a match for, its rate
    is that of its proposals (not weighed down by the steps it had nothing for); on a step it has
    none for, it is not in the plan at all."""
    assert first_arm(offer_every=4, present={"ngram": True}) == "ngram"
    assert first_arm(offer_every=1, present={"ngram": False}) == "draft"
    b, target = bandit(draft_cost=0.003, settle_steps=0), costs(FLAT)
    seq = b.new_sequence()
    b.observe_acceptance(seq, "ngram", 4, 4)
    assert [c.arm for c in b.rank(seq, 1, target, {}, 100, 4, {"ngram": False})] == ["draft"]


def probe_steps(outcomes: list[int], steps: int = 500, **config) -> list[int]:
    """Steps at which a cheap draft arm that does not pay (nothing accepted so far) is probed, the
    i-th probe accepting ``outcomes[i]`` of its tokens (the last outcome repeats)."""
    b, target = bandit(draft_cost=0.001, settle_steps=0, **config), costs(FLAT)
    seq = b.new_sequence()
    for _ in range(10):
        b.observe_acceptance(seq, "ngram", 4, 0)
        b.observe_acceptance(seq, "draft", 4, 0)
    out = []
    for step in range(steps):
        plan = b.plan(seq, 1, target, {}, 1000, 4)
        if plan and plan[0].probe:
            accepted = outcomes[min(len(out), len(outcomes) - 1)]
            out.append(step)
            b.drafted(seq, "draft")
            b.observe_probe(seq, "draft", plan[0].k, accepted, probe=True)
    return out


def test_probes_that_keep_missing_come_less_often_and_a_hit_restores_them():
    every = bandit(0.001).cfg.probe_every
    flat = probe_steps([0], probe_backoff=0)
    assert [b - a for a, b in zip(flat, flat[1:])] == [every] * (len(flat) - 1)  # without backoff
    missing = probe_steps([0])
    gaps = [b - a for a, b in zip(missing, missing[1:])]
    assert gaps[:4] == [2 * every, 4 * every, 8 * every, 8 * every]  # doubling, capped at 2**3
    restored = probe_steps([0, 0, 2, 0])  # the third probe is accepted whole
    gaps = [b - a for a, b in zip(restored, restored[1:])]
    assert gaps[:3] == [2 * every, 4 * every, every]


def poor_draft(feed_seconds: float = 0.002, **config) -> Bandit:
    """``bandit`` with a draft arm (2 ms a drafted token, ``feed_seconds`` a token to catch up) whose
    figures rank it below plain decoding: 30 drafts of each arm with nothing accepted."""
    b = bandit(draft_cost=0.002, settle_steps=0, **config)
    b.observe_catch_up("draft", 100, 100 * feed_seconds)
    old = b.new_sequence()
    for _ in range(30):
        b.observe_acceptance(old, "draft", 4, 0)
        b.observe_acceptance(old, "ngram", 4, 0)
    return b


def stale_probes(finished_without_draft: int, feed_seconds: float = 0.002, steps: int = 60) -> list[int]:
    """``probes`` (128 tokens to come) with a catch-up over the answer's exploration share -- 2 ms a
    token to feed -- after ``finished_without_draft`` sequences ended without the draft arm drafting."""
    b, target = poor_draft(feed_seconds), costs(FLAT)
    for _ in range(finished_without_draft):
        b.end_sequence(b.new_sequence())
    seq = b.new_sequence()
    for step in range(steps):
        plan = b.plan(seq, 1, target, {"draft": 50 + step}, 128 - step, 4)
        if plan and plan[0].arm == "draft":
            assert plan[0].probe
            b.drafted(seq, "draft")
            return [step]
    return []


def test_an_arm_gone_stale_across_sequences_is_probed_with_a_larger_share():
    stale = bandit(0.002).cfg.stale_sequences
    assert stale_probes(stale - 1) == []  # the figures still rule: the catch-up does not fit the share
    assert stale_probes(stale) == [bandit(0.002).cfg.probe_every - 1]
    assert stale_probes(stale, feed_seconds=0.02) == []  # a catch-up of most of the answer: still not


def stale_probed_sequences(sequences: int, chosen_in: frozenset[int] = frozenset(), **config) -> list[int]:
    """Which of ``sequences`` lone sequences in a row (of 60 steps, 128 tokens to come) probe the
    draft arm, whose figures rank it below plain decoding; in the sequences ``chosen_in`` it also
    drafts once on its merits."""
    b, target = poor_draft(**config), costs(FLAT)
    probed = []
    for i in range(sequences):
        seq = b.new_sequence()
        for step in range(60):
            plan = b.plan(seq, 1, target, {"draft": 50 + step}, 128 - step, 4)
            if plan and plan[0].arm == "draft":
                assert plan[0].probe
                b.drafted(seq, "draft", probe=True)
                probed.append(i)
                break
        if i in chosen_in:
            b.drafted(seq, "draft")
        b.end_sequence(seq)
    return probed


def test_each_stale_probe_doubles_the_wait_until_the_arm_drafts_on_its_merits_unprobed():
    assert stale_probed_sequences(16, stale_backoff=0) == [2, 5, 8, 11, 14]  # every third: 2 idle, then a probe
    assert stale_probed_sequences(40) == [2, 7, 16, 33]  # then 4, 8 and 16 (capped) idle sequences
    # chosen after its probe in sequence 7 (its catch-up already paid): no reset
    assert stale_probed_sequences(40, chosen_in=frozenset({7})) == [2, 7, 16, 33]
    # drafting on its merits in a sequence without a probe (8) resets the wait to 2 sequences
    assert stale_probed_sequences(20, chosen_in=frozenset({8})) == [2, 7, 11, 16]


def test_drafting_for_a_sequence_makes_an_arm_fresh_again():
    b = bandit(draft_cost=0.002)
    for _ in range(3):
        b.end_sequence(b.new_sequence())
    assert b.arms["draft"].idle_sequences == 3
    seq = b.new_sequence()
    b.drafted(seq, "draft")
    assert b.arms["draft"].idle_sequences == 0
    b.end_sequence(seq)  # it drafted for this one
    assert b.arms["draft"].idle_sequences == 0
    b.end_sequence(b.new_sequence())
    assert b.arms["draft"].idle_sequences == 1


def ranked_after_one_miss(**config) -> list[str]:
    """The arms ranked for a new sequence whose first draft missed its first token, where the draft
    model accepted 3 of every 5 positions over earlier sequences (its prior) and pays modestly."""
    b, target = bandit(draft_cost=0.004, settle_steps=0, **config), costs(FLAT)
    earlier = b.new_sequence()
    for i in range(30):
        b.observe_acceptance(earlier, "draft", 2, [0, 1, 2, 1, 2][i % 5])
        b.observe_acceptance(earlier, "ngram", 4, 0)
    seq = b.new_sequence()
    assert [c.arm for c in b.rank(seq, 1, target, {}, 100, 4, {"ngram": False})] == ["draft"]
    b.observe_acceptance(seq, "draft", 2, 0)
    return [c.arm for c in b.rank(seq, 1, target, {}, 100, 4, {"ngram": False})]


def test_one_missed_token_does_not_take_a_draft_model_out_of_a_sequence():
    """An arm measured only when it drafts leans on its prior more and forgets more slowly than a
    shadow arm scored every step: with the shadow arm's figures one miss would take it out."""
    assert ranked_after_one_miss() == ["draft"]
    assert ranked_after_one_miss(drafted_ema=0.2, drafted_prior_weight=1.0) == []


def in_step_bandit(draft_cost: float, ngram_accepts: int):
    """A draft model accepting 1 or 2 of 2 (``draft_cost`` seconds a drafted token, 2 ms a token to
    catch up on) and n-gram lookup accepting ``ngram_accepts`` of 4, with a match on every step so
    far."""
    b, target = bandit(draft_cost=draft_cost, settle_steps=0), costs(FLAT)
    b.observe_catch_up("draft", 100, 0.2)
    seq = b.new_sequence()
    for _ in range(12):
        for accepted in (1, 2, 1, 2):
            b.observe_acceptance(seq, "draft", 2, accepted)
        b.observe_acceptance(seq, "ngram", 4, ngram_accepts)
    return b, target, seq


def test_a_draft_model_in_step_keeps_a_sequence_it_drafts_about_as_fast_as_plain():
    """A plain step leaves a draft model in step with the sequence a token behind, which its next
    draft pays for: predicted a little slower than plain decoding (89 against 91 tokens/s) but
    faster than plain decoding plus that token's catch-up (77), it keeps drafting; once behind on
    tokens it did not follow, it must beat plain decoding itself."""
    b, target, seq = in_step_bandit(0.006, ngram_accepts=0)
    for _ in range(12):
        b.observe_acceptance(seq, "draft", 2, 0)
        b.observe_acceptance(seq, "draft", 2, 2)
    assert [c.arm for c in b.rank(seq, 1, target, {"draft": 0}, 100, 4, {"ngram": False})] == ["draft"]
    assert b.rank(seq, 1, target, {"draft": 5}, 100, 4, {"ngram": False}) == []


def test_a_draft_model_that_drafted_the_step_before_an_ngram_step_drafts_the_next():
    """n-gram lookup, with a match on every step so far and far faster than the draft model there
    (230 against 133 tokens/s), but without a match now: a draft that has not followed
    the sequence does not catch up to fill the step, one that drafted the step before n-gram's does
    (its 5 tokens are the switch the follower rule charged n-gram for)."""
    b, target, seq = in_step_bandit(0.003, ngram_accepts=2)
    assert b.rank(seq, 1, target, {"draft": 5}, 100, 4, {"ngram": False}) == []
    b.drafted(seq, "draft")
    seq.arms["draft"].idle_steps = 1  # n-gram drafted the step since
    assert [c.arm for c in b.rank(seq, 1, target, {"draft": 5}, 100, 4, {"ngram": False})] == ["draft"]


def ranked_beside_ngram(backlog: int, matches_every: int) -> list[str]:
    """The arms ranked for a step n-gram lookup has no match for, where it copies every token on the
    steps it has one (one in ``matches_every``) and the draft model accepts 3 of 4."""
    b, target = bandit(draft_cost=0.003, settle_steps=0), costs(FLAT)
    b.observe_catch_up("draft", 100, 0.05)  # 0.5 ms a token the draft missed
    seq = b.new_sequence()
    for step in range(12):
        b.observe_acceptance(seq, "draft", 4, 3)
        b.observe_offer(seq, "ngram", step % matches_every == 0)
        if step % matches_every == 0:
            b.observe_acceptance(seq, "ngram", 4, 4)
    return [c.arm for c in b.rank(seq, 1, target, {"draft": backlog}, 100, 4, {"ngram": False})]


def test_a_draft_catches_up_where_drafting_the_steps_ngram_leaves_repays_it():
    """n-gram lookup beats the draft model on the steps it has a match for: where that is every
    step, feeding the draft 60 tokens for no step left is not repaid; where it leaves half or two
    thirds of the steps, the draft drafting them repays that catch-up and the catch-ups n-gram's
    steps will leave it."""
    assert ranked_beside_ngram(60, matches_every=1) == []
    assert ranked_beside_ngram(60, matches_every=2) == ["draft"]
    assert ranked_beside_ngram(60, matches_every=3) == ["draft"]


def test_a_draft_models_prior_is_its_acceptance_over_many_drafts():
    """Five misses after sixty drafts accepted whole: the cost model's recent figure (about the last
    ten drafts) drops to 0.59, the prior a new sequence starts from (about the last fifty) stays at
    0.86; a shadow arm's prior is the cost model's figure."""
    b = bandit(draft_cost=0.003, settle_steps=0)
    seq = b.new_sequence()
    for _ in range(60):
        b.observe_acceptance(seq, "draft", 2, 2)
    for _ in range(5):
        b.observe_acceptance(seq, "draft", 2, 0)
    draft, ngram = b.arms["draft"], b.arms["ngram"]
    assert draft.costs.accept[0] < 0.6 < 0.85 < draft.prior()[0]
    assert ngram.prior() is ngram.costs.accept


def test_a_catch_up_is_repaid_only_on_the_steps_ngram_leaves():
    """n-gram lookup slower than the draft model over the answer (158 against 171 tokens/s, a match
    on one step in four) still takes the steps it has a match for: 0.4 s of catch-up is judged
    against drafting the other three in four, where it is not repaid, and is made where n-gram
    lookup leaves nearly every step."""
    assert ranked_beside_ngram(800, matches_every=4) == []
    assert ranked_beside_ngram(800, matches_every=1000) == ["draft"]
