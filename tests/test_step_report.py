"""Engine.step's report (spec/report.py): what the controller and the counters learn a step from."""
from __future__ import annotations

import pytest

from tokenleap.config import SamplingParams
from tokenleap.spec.controller import ControllerConfig, DraftLengthController
from tokenleap.spec.engine import Engine
from tokenleap.spec.proposers.ngram import NgramProposer
from tokenleap.spec.report import DraftWork, SeqOutcome, StepReport, record_stats
from tokenleap.spec.stats import SpecStats

from conftest import ToyTokenizer, tiny_model

VOCAB = 96
PROMPTS = [[5, 9, 14, 3, 7, 9, 14, 3, 7, 9], [40, 41, 42, 43, 40, 41, 42, 43, 40], [11] * 6 + [12, 13, 11, 11]]


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2", seed=1, vocab=VOCAB, hidden=64, intermediate=128, layers=2)


def _state(c: DraftLengthController) -> dict:
    """Everything a controller has learned (its tree model's figures included)."""
    out = {k: v for k, v in vars(c).items() if k not in ("trees", "planner")}
    out["trees"] = dict(vars(c.trees))
    out["planner"] = {k: v for k, v in vars(c.planner).items() if k != "model"}  # (model: c.trees)
    return out


def _chain(seq_id: int, k: int, accepted: int, kept: int) -> SeqOutcome:
    return SeqOutcome(seq_id, "ngram", True, k, accepted, kept, 1 + k, parents=tuple(range(-1, k)),
                      path=tuple(range(1, accepted + 1)))


def test_a_chain_report_teaches_the_controller_what_separate_observations_do():
    work = DraftWork(tokens=7, depth=4, batch=2, seconds=0.07, catch_up_tokens=0, catch_up_seconds=0.0)
    outcomes = (_chain(0, 4, 4, 5), _chain(1, 3, 0, 1), SeqOutcome(2, "none", False, 0, 0, 1, 1))
    report = StepReport(outcomes, k=4, tree_budget=0, auto_tree=False, held_apart=False, rows=10,
                        forward_seconds=0.5, draft=work, overhead_seconds=0.01)
    cfg = ControllerConfig(max_k=6)
    by_report, by_hand = DraftLengthController(cfg), DraftLengthController(cfg)
    by_report.observe_step_report(report)
    by_hand.observe_draft(7, 0.07, batch=2)
    by_hand.observe_forward(10, 0.5)
    by_hand.observe_acceptance(4, 4)
    by_hand.observe_acceptance(3, 0)  # (order matters: counts are forgotten exponentially)
    by_hand.observe_step(True, 3, 0.01)
    assert _state(by_report) == _state(by_hand)
    assert by_report.accept[0] != cfg.prior_acceptance and by_report.forward_cost == {10: 0.5}


def test_a_tree_report_chosen_by_auto_is_measured_apart():
    tree = SeqOutcome(0, "draft", True, 2, 2, 3, 5, parents=(-1, 0, 0, 1, 1), path=(1, 4), tree_nodes=4, ranks=(0, 1))
    work = DraftWork(tokens=4, depth=2, batch=2, seconds=0.02)
    report = StepReport((tree, _chain(1, 2, 1, 2)), k=2, tree_budget=4, auto_tree=True, held_apart=True,
                        rows=8, forward_seconds=0.3, draft=work, overhead_seconds=0.004)
    cfg = ControllerConfig(max_k=4, tree="auto")
    by_report, by_hand = DraftLengthController(cfg), DraftLengthController(cfg)
    by_hand.observe_forward(1, 0.1)  # a chain's figure the tree's forward is compared with
    by_report.observe_forward(1, 0.1)
    by_report.observe_step_report(report)
    by_hand.observe_tree_draft(2, 0.02, batch=2)
    by_hand.observe_forward(8, 0.3, tree=True)
    by_hand.observe_tree([-1, 0, 0, 1, 1], [1, 4], 4, 2)
    by_hand.observe_tree([-1, 0, 1], [1], 4, 2)  # a chain answering a tree request counts as a tree
    by_hand.observe_step(True, 2, 0.004, tree=True)
    assert _state(by_report) == _state(by_hand)
    assert by_report.trees.forward_cost == {8: 0.3} and ("tree", 2) in by_report.step_overhead


def test_a_draft_that_caught_up_records_no_draft_cost():
    work = DraftWork(tokens=4, depth=4, batch=1, seconds=0.01, catch_up_tokens=20, catch_up_seconds=0.4)
    report = StepReport((_chain(0, 4, 2, 3),), k=4, tree_budget=0, auto_tree=False, held_apart=False, rows=5,
                        forward_seconds=0.2, draft=work, overhead_seconds=None)
    c = DraftLengthController(ControllerConfig())
    c.observe_step_report(report)
    assert c.draft_cost_at == {} and c.catch_up_cost == pytest.approx(0.02) and c.step_overhead == {}


def test_tokens_drafted_after_a_catch_up_price_a_draft_token_for_one_sequence():
    """The catch-up's forward drafted the first token (its time is catch-up); the other tokens were
    drafted in ``seconds``. In a batch that forward drafted for the other sequences too: no figure."""
    for batch, want in ((1, {1: pytest.approx(0.01)}), (2, {})):
        work = DraftWork(tokens=3, depth=3, batch=batch, seconds=0.02, catch_up_tokens=20, catch_up_seconds=0.4,
                         catch_up_drafted=1)
        report = StepReport((_chain(0, 3, 2, 3),), k=3, tree_budget=0, auto_tree=False, held_apart=False, rows=4,
                            forward_seconds=0.2, draft=work, overhead_seconds=None)
        c = DraftLengthController(ControllerConfig())
        c.observe_step_report(report)
        assert c.draft_cost_at == want and c.catch_up_cost == pytest.approx(0.02)


def test_step_returns_the_report_its_counters_were_recorded_from(target):
    eng = Engine(target, ToyTokenizer(VOCAB), max_len=128, num_slots=3, proposer=NgramProposer(3, 1),
                 controller=ControllerConfig(max_k=4, fixed_k=4))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    seqs = [eng.add(p, params) for p in PROMPTS]
    before = {s.seq_id: len(s.tokens) for s in seqs}
    mine = {s.seq_id: SpecStats() for s in seqs}
    while not all(s.finished for s in seqs):
        totals, running = eng.totals.new_tokens, [s.seq_id for s in seqs if not s.finished]
        report = eng.step(seqs)
        assert isinstance(report, StepReport) and report.k == 4
        assert [o.seq_id for o in report.outcomes] == running  # the step's order
        assert report.rows == sum(o.rows for o in report.outcomes)
        assert eng.totals.new_tokens - totals == sum(o.kept for o in report.outcomes)
        for o in report.outcomes:
            assert o.kept <= o.accepted + 1 and o.accepted <= o.proposed
            assert o.path == tuple(range(1, o.accepted + 1)) and len(o.parents) == (o.proposed + 1 if o.drafted else 0)
            mine[o.seq_id].record_step(o.proposed, o.accepted, o.kept)
    assert eng.step(seqs) is None  # every sequence finished
    assert any(st.accepted_tokens for st in mine.values())  # the n-gram drafts were accepted somewhere
    for s in seqs:
        assert len(s.tokens) - before[s.seq_id] == mine[s.seq_id].new_tokens
        assert s.stats.accepted_tokens == mine[s.seq_id].accepted_tokens
        assert s.stats.position_accepted == mine[s.seq_id].position_accepted
        assert s.stats.target_forwards == mine[s.seq_id].target_forwards + 1  # + the prefill's token


def test_a_stop_rule_cutting_an_accepted_run_counts_the_verifiers_acceptance():
    """Four drafts accepted, the output stopped on the third (a stop string): the fourth was accepted
    all the same -- counted so (vLLM counts before its stop checks), not read as a rejection."""
    st = SpecStats()
    record_stats(_chain(0, 4, 4, 3), st)
    assert (st.new_tokens, st.draft_tokens, st.accepted_tokens) == (3, 4, 4)
    assert st.per_position_acceptance == [1.0, 1.0, 1.0, 1.0]
    assert st.proposer_accepted == {"ngram": 4} and st.proposer_tokens == {"ngram": 3}
