"""A draft model's chain cut short where the draft is unsure (spec/confidence.py): the floors follow
the cost model, the calibration learns how far a draft's confidence can be trusted, a cut never
changes what is emitted (greedy, seeded and sampled), and a cut draft accepted whole is no miss."""
from __future__ import annotations

import pytest
import torch

import tokenleap.spec.step_verify as step_verify
from tokenleap.config import SamplingParams
from tokenleap.models.build import build_transformer
from tokenleap.spec.confidence import (Calibration, ConfidenceLog, chain_floors, decision_acceptance, should_stop,
                                      thresholds, token_confidence)
from tokenleap.spec.controller import ControllerConfig, DraftLengthController
from tokenleap.spec.engine import Engine
from tokenleap.spec.proposers.auto import AutoProposer
from tokenleap.spec.proposers.base import DraftRequest
from tokenleap.spec.proposers.cascade import CascadeDraftProposer
from tokenleap.spec.proposers.draft_model import DraftModelProposer
from tokenleap.spec.proposers.ngram import NgramProposer
from tokenleap.spec.tree_budget import StepPlan

from conftest import ToyTokenizer, random_weights, tiny_config, tiny_model
from test_spec_sampling import biased_verifier, exact_distribution, p_value, sample_counts
from test_spec_sampling import pair  # noqa: F401  (the fixture)

VOCAB = 96
PROMPT = [5, 9, 14, 3, 7, 9, 14, 3, 11]


# -- the rule ---------------------------------------------------------------------------------

def test_floors_price_a_draft_token_and_a_row_against_the_step_rate():
    # rows 1-3 cost 30 ms, each further row 5 ms more; a drafted token 10 ms; the step yields 40 tok/s
    forward = lambda rows: 0.030 + 0.005 * max(0, rows - 3)  # noqa: E731
    # per decision the verification row's part: after 1 token the 3rd row (free), after 2 or 3 a
    # 5 ms row, * 40 / 0.8; and the draft forward's part, 10 ms * 40 / 0.8
    rows, draft = thresholds(4, 0.010, forward, 40.0, 0.8)
    assert rows == pytest.approx((0.0, 0.25, 0.25)) and draft == pytest.approx(0.5)
    # an acceptance under 0.5 is taken at 0.5: a floor never rules a second token out for good
    rows, draft = thresholds(3, 0.010, forward, 40.0, 0.2)
    assert rows == pytest.approx((0.0, 0.4)) and draft == pytest.approx(0.8)
    assert thresholds(1, 0.010, forward, 40.0, 0.8) == ((), 0.0)  # one token: nothing to decide
    # the batch's other rows are in the forward: every further row costs
    assert thresholds(2, 0.010, forward, 40.0, 0.8, others=3)[0] == pytest.approx((0.25,))


def test_a_decision_expects_position_twos_acceptance_never_below_position_ones():
    """The first decision a chain makes is whether to draft position 2, and the chains that went on
    to it measured how often it passes; a low, starved estimate there does not lock it out."""
    assert decision_acceptance([0.6, 0.9, 0.5]) == 0.9
    assert decision_acceptance([0.7, 0.3]) == 0.7
    assert decision_acceptance([0.8]) == 0.8
    forward = lambda rows: 0.030 + 0.005 * rows  # noqa: E731
    cap, rows, draft = chain_floors(2, 4, 1, 0.010, forward, 40.0, [0.6, 0.8])
    assert cap == 4 and draft == pytest.approx(0.010 * 40.0 / 0.8) and rows[0] == pytest.approx(0.005 * 40.0 / 0.8)


def test_a_chain_stops_once_its_running_confidence_is_below_the_floor():
    assert not should_stop(0.9, 1, (0.5, 0.5))
    assert should_stop(0.4, 1, (0.5, 0.5))
    assert should_stop(0.45, 2, (0.1, 0.5))
    assert not should_stop(0.01, 3, (0.5, 0.5))  # past the floors: k ends the chain
    assert should_stop(0.7, 1, (0.5, 0.5), 0.3) and not should_stop(0.7, 1, (0.5, 0.5))  # a draft forward's part


def test_confidence_is_the_top_probability_of_the_drafted_distribution():
    logits = torch.tensor([[0.0, float("-inf"), 0.0, 1.0]])
    assert token_confidence(logits, False) == pytest.approx(torch.softmax(logits, -1).max().item())
    assert token_confidence(torch.tensor([[0.2, 0.7, 0.1]]), True) == pytest.approx(0.7)


def test_calibration_starts_at_the_confidence_and_learns_the_pair():
    cal = Calibration()
    assert cal(0.05) == pytest.approx(0.05) and cal(0.93) == pytest.approx(0.95)
    for _ in range(200):  # a self-draft: unsure, yet every token accepted
        cal.observe([0.12, 0.15, 0.11], 3)
    assert cal(0.13) > 0.9 and cal(0.93) == pytest.approx(0.95)
    cal.observe([0.95, 0.95, 0.13], 1)  # the third token follows a rejection: never judged
    assert cal.trials[1] == pytest.approx(sum(0.98 ** i for i in range(600)))
    log = ConfidenceLog()
    log.drafted(7, [0.95, 0.95])
    log.verified(7, 0)  # the first token rejected: only it is counted
    assert log.calibration.trials[9] == 1.0 and log.calibration.hits[9] == 0.0
    log.verified(7, 2)  # nothing pending any more
    assert log.calibration.trials[9] == 1.0


# -- the proposers ----------------------------------------------------------------------------

def sharp_model(seed: int):
    """A toy model of sharper distributions than ``tiny_model``'s: its top token's probability
    ranges widely, so confidence floors cut some chains and not others."""
    cfg = tiny_config("llama")
    return build_transformer(cfg, random_weights(cfg, seed, scale=0.3), torch.float32)


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


@pytest.mark.parametrize("cls", [DraftModelProposer, CascadeDraftProposer])
def test_a_cut_draft_is_the_uncut_draft_s_prefix(target, cls):
    draft = tiny_model("llama", seed=1)
    tokens = PROMPT * 3
    params = SamplingParams(max_tokens=32)
    for floors, length in [((0.0,) * 4, 5), ((0.0, 2.0, 2.0, 2.0), 2), ((2.0,) * 4, 1)]:
        whole, cut = cls(draft, VOCAB, 128), cls(draft, VOCAB, 128)
        whole.begin(0, tokens)
        cut.begin(0, tokens)
        full = whole.propose_many([DraftRequest(0, tokens, 5, params)])[0]
        d = cut.propose_many([DraftRequest(0, tokens, 5, params, stop_below=floors)])[0]
        assert len(full.tokens) == 5 and not full.cut
        assert d.tokens == full.tokens[:length] and d.cut == (length < 5)
        whole.accept(0, length)
        cut.accept(0, length)
        assert cut.fed(0) == len(tokens) + length - 1  # all but its last drafted token, fed next time
        assert sum(cut.confidence.calibration.trials) > 0 == sum(whole.confidence.calibration.trials)  # learnt
        nxt = tokens + d.tokens + [3]  # drafting goes on from the accepted text, as after the uncut draft
        again = cut.propose_many([DraftRequest(0, nxt, 3, params)])[0]
        assert again.tokens == whole.propose_many([DraftRequest(0, nxt, 3, params)])[0].tokens


def _floors_everywhere(monkeypatch, k: int, floor: float) -> None:
    """Every step of the engine a chain of up to k tokens with this floor at every length (whatever
    this machine's timings would make the cost model choose)."""
    monkeypatch.setattr(DraftLengthController, "choose_step",
                        lambda self, *a, **kw: StepPlan(k, floors=(floor,) * (k - 1), planned=1))


def _count_cuts(monkeypatch, cls) -> list[bool]:
    cuts: list[bool] = []
    orig = cls.propose_many

    def counting(self, requests):
        out = orig(self, requests)
        cuts.extend(d.cut for d in out if d is not None and d.tokens)
        return out

    monkeypatch.setattr(cls, "propose_many", counting)
    return cuts


@pytest.mark.parametrize("cls", [DraftModelProposer, CascadeDraftProposer])
@pytest.mark.parametrize("seeded", [False, True])
def test_output_with_confidence_stops_equals_plain_decoding(cls, seeded, monkeypatch):
    target, draft = tiny_model("llama", seed=0), sharp_model(4)
    params = SamplingParams(max_tokens=48, ignore_eos=True, **({"temperature": 0.8, "seed": 3} if seeded else {}))
    want = list(Engine(target, ToyTokenizer(VOCAB, (2,)), max_len=160).generate(PROMPT, params))[-1][0].generated
    _floors_everywhere(monkeypatch, 6, 0.5)
    cuts = _count_cuts(monkeypatch, cls)
    eng = Engine(target, ToyTokenizer(VOCAB, (2,)), max_len=160, proposer=cls(draft, VOCAB, 160),
                 controller=ControllerConfig(max_k=6))
    assert eng.controller.cuts_on_confidence
    assert list(eng.generate(PROMPT, params))[-1][0].generated == want
    assert any(cuts) and not all(cuts)


def test_no_floors_for_a_fixed_k_switched_off_or_a_proposer_that_cannot_stop(target):
    def engine(proposer, **cfg):
        return Engine(target, ToyTokenizer(VOCAB, (2,)), max_len=160, proposer=proposer,
                      controller=ControllerConfig(max_k=6, **cfg))

    assert engine(DraftModelProposer(target, VOCAB, 160)).controller.cuts_on_confidence
    assert not engine(DraftModelProposer(target, VOCAB, 160), fixed_k=3).controller.cuts_on_confidence
    assert not engine(DraftModelProposer(target, VOCAB, 160), confidence_stop=False).controller.cuts_on_confidence
    assert not engine(NgramProposer(4, 2)).controller.cuts_on_confidence  # n-gram has no confidence
    c = engine(DraftModelProposer(target, VOCAB, 160)).controller
    for rows in range(1, 10):
        c.observe_forward(rows, 0.030 + 0.004 * rows)
    c.draft_cost = 0.003
    plan = c.choose_step(1)
    assert plan.k == 6 and len(plan.floors) == 5 and 1 <= plan.planned < 6  # planned k, run up to max_k
    rows, draft = thresholds(6, 0.003, c.predict_forward, c.rate(plan.planned, 1),
                             decision_acceptance(c.chain_acceptance()))
    assert plan.floors == pytest.approx(rows) and plan.draft_floor == pytest.approx(draft) and draft > 0
    batched = c.confident_chain(3, 100.0, batch=4)  # a batch keeps its planned k as the bound
    assert batched.k == 3 and len(batched.floors) == 2


def test_sampling_with_confidence_stops_matches_target_distribution(pair, monkeypatch):  # noqa: F811
    """Unseeded rejection sampling over chains whose length the draft's own confidence decides."""
    target, draft = pair
    _floors_everywhere(monkeypatch, 3, 0.9)
    cuts = _count_cuts(monkeypatch, DraftModelProposer)
    counts = sample_counts(target, draft, seed=8, monkeypatch=monkeypatch, controller=ControllerConfig(max_k=3))
    assert p_value(counts, exact_distribution(target)) > 1e-3
    assert sum(cuts) > 100 and len(cuts) - sum(cuts) > 100  # both cut and whole chains were verified


def test_same_check_rejects_a_biased_verifier_with_confidence_stops(pair, monkeypatch):  # noqa: F811
    target, draft = pair
    _floors_everywhere(monkeypatch, 3, 0.9)
    monkeypatch.setattr(step_verify, "verify_sampling", biased_verifier)
    counts = sample_counts(target, draft, seed=8, monkeypatch=monkeypatch, controller=ControllerConfig(max_k=3))
    assert p_value(counts, exact_distribution(target)) < 1e-6


def test_a_cut_draft_accepted_whole_is_no_miss_for_auto(target):
    draft = DraftModelProposer(target, VOCAB, 160)
    auto = AutoProposer({"ngram": NgramProposer(4, 2), "draft": draft})
    eng = Engine(target, ToyTokenizer(VOCAB, (2,)), max_len=160, proposer=auto,
                 controller=ControllerConfig(max_k=6))
    seq = eng.add(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
    state = auto._seqs[seq.seq_id].arms["draft"].acceptance
    for cut, judged in ((True, 2), (False, 3)):  # 2 drafted, both accepted: position 3 a miss unless cut
        before = list(state.trials)
        auto._drafted[seq.seq_id] = ("draft", 2, 5, False, cut)
        draft._proposal_start[seq.seq_id] = len(seq.tokens)
        auto.accept(seq.seq_id, 2)
        assert sum(1 for a, b in zip(before, state.trials) if b > a) == judged
