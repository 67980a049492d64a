"""``--spec auto``'s shadow scoring of n-gram lookup: its proposals compared with the tokens each
step emitted, past the depth it drafted too."""
from __future__ import annotations

from tokenleap.spec.bandit import BanditConfig, Choice
from tokenleap.spec.proposers.auto import AutoProposer
from tokenleap.spec.proposers.base import DraftRequest
from tokenleap.spec.proposers.ngram import NgramProposer

from bandit_helpers import FLAT, costs


def test_shadow_ngram_is_scored_against_the_emitted_tokens():
    prop = AutoProposer({"ngram": NgramProposer(4, 1)}, BanditConfig(max_k=4))
    target = costs(FLAT)
    prop.begin(0, [1, 2, 3, 4, 1, 2])
    prop._plans[0] = []
    tokens = [1, 2, 3, 4, 1, 2]
    drafts = {"ngram": prop.arms["ngram"].propose(0, tokens, 4, None, None)}  # made before the plan
    prop._shadow_proposals(0, tokens, [Choice("draft", 4, 0.0)], 4, drafts)  # n-gram would draft 3 4 1 2
    assert prop._shadows[0]["ngram"] == (6, [3, 4, 1, 2], 4, None)
    seq = prop._seqs[0]
    prop._score_shadows(0, seq, [1, 2, 3, 4, 1, 2, 3, 4, 9])  # the step emitted 3 4 9: two accepted, third not
    acc = seq.arms["ngram"].acceptance
    assert acc.trials[:4] == [1.0, 1.0, 1.0, 0.0] and acc.hits[:3] == [1.0, 1.0, 0.0]
    assert target is not None


def shadow_counts(proposal: list[int], emitted: list[int], asked: int = 4) -> tuple[list[float], list[float]]:
    """(trials, hits) by position after scoring an n-gram ``proposal`` against a step's ``emitted`` tokens."""
    prop = AutoProposer({"ngram": NgramProposer(4, 1)}, BanditConfig(max_k=4))
    prompt = [1, 2, 3]
    prop.begin(0, prompt)
    prop._shadows[0]["ngram"] = (len(prompt), proposal, asked, None)
    seq = prop._seqs[0]
    prop._score_shadows(0, seq, prompt + emitted)
    acc = seq.arms["ngram"].acceptance
    return acc.trials, acc.hits


def test_a_shadow_proposal_that_runs_out_counts_its_next_position_as_a_miss():
    """Asked for 4 tokens, lookup had 2; the step emitted 3 tokens matching both: position 3 had no
    token, which costs the yield a step would get exactly as a rejected one does."""
    assert shadow_counts([7, 8], [7, 8, 9]) == ([1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0])
    assert shadow_counts([7, 8], [7, 8]) == ([1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0])  # nothing known past it
    assert shadow_counts([7, 8], [7, 8, 9], asked=2) == ([1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0])  # all it was asked


def drafted_counts(depth: int, accepted: int, emitted: list[int]) -> tuple[list[float], list[float]]:
    """(trials, hits) by position after n-gram, planned first, drafts ``depth`` tokens of its proposal
    3 4 1 2 and the step accepts ``accepted`` of them and emits ``emitted``."""
    prop = AutoProposer({"ngram": NgramProposer(4, 1)}, BanditConfig(max_k=4))
    tokens = [1, 2, 3, 4, 1, 2]
    prop.begin(0, tokens)
    drafts = {"ngram": prop.arms["ngram"].propose(0, tokens, 4, None, None)}
    prop._shadow_proposals(0, tokens, [Choice("ngram", depth, 1.0)], 4, drafts)
    prop._drafted[0] = ("ngram", depth, depth, False, False)
    prop.accept(0, accepted)
    seq = prop._seqs[0]
    prop._score_shadows(0, seq, tokens + emitted)
    acc = seq.arms["ngram"].acceptance
    return acc.trials, acc.hits


def test_a_drafting_shadow_arm_is_scored_one_position_past_its_draft():
    """n-gram drafting one token of its proposal 3 4 1 2 each step would otherwise never measure its
    second position again: the step's bonus token, after the draft is accepted, is the verified
    token there. Nothing past what was verified is scored, nor anything after a rejection."""
    assert drafted_counts(1, 1, [3, 4]) == ([1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0])
    assert drafted_counts(1, 1, [3, 9]) == ([1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0])
    assert drafted_counts(2, 2, [3, 4, 1]) == ([1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0])
    assert drafted_counts(1, 0, [9]) == ([1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0])
    assert drafted_counts(4, 4, [3, 4, 1, 2, 5]) == ([1.0] * 4, [1.0] * 4)  # nothing past max_k


def test_ngram_judged_poor_past_one_token_recovers_while_it_drafts_one():
    """n-gram whose second position this sequence once judged poor drafts one token a step; its
    proposals are right all along. Scoring the position past the draft against each step's bonus
    token lets its chain grow back -- nothing else would measure that position while it drafts."""
    prop = AutoProposer({"ngram": NgramProposer(4, 2)}, BanditConfig(max_k=4))
    target = costs({r: 0.010 + 0.006 * r for r in range(1, 10)})  # each row costs (an int4 target)
    for _ in range(8):  # a shared history of good first positions, so n-gram beats plain decoding
        target.observe_acceptance(1, 1)
    period = [5, 6, 7, 8, 9, 10]
    tokens = period * 3
    prop.begin(0, tokens)
    seq = prop._seqs[0]
    for _ in range(6):  # position 2 failed several times, position 1 passed
        seq.arms["ngram"].acceptance.observe(2, 1)
    ks = []
    for _ in range(12):
        prop.plan([(0, tokens, 1000.0)], 1, target)
        draft = prop.propose_many([DraftRequest(0, tokens, 4, None, None)])[0]
        ks.append(len(draft.tokens))
        emitted = [period[(len(tokens) + i) % len(period)] for i in range(len(draft.tokens) + 1)]
        assert draft.tokens == emitted[:-1]  # the text repeats: every drafted token is accepted
        prop.accept(0, len(draft.tokens))
        tokens = tokens + emitted
    assert ks[0] == 1 and ks[-1] == 4, ks
