"""The tree budget chosen from cost (``--spec-tree auto``): the controller picks a tree where extra
rows are free and siblings are accepted, a chain where rows cost, plain decoding where nothing pays;
through the engine, whatever it picks, the output is plain decoding's (greedy and seeded, n-gram
tries and a draft model's trees) and unseeded sampling stays exact."""
from __future__ import annotations

import random

import pytest

import tokenleap.spec.tree_verify as tv
import test_spec_sampling as sampling_check
from tokenleap.config import SamplingParams, SpecConfig
from tokenleap.spec.controller import ControllerConfig, DraftLengthController, StepPlan
from tokenleap.spec.engine import Engine
from tokenleap.spec.proposers.draft_model import DraftModelProposer
from tokenleap.spec.proposers.ngram import NgramProposer
from tokenleap.spec.tree_budget import TreeModel, TreePlanner, depths_and_ranks

from conftest import ToyTokenizer, a_model_file, tiny_model
from tree_helpers import restart_from_p_ignoring_q

VOCAB = 96
# a trie at depth 1: three siblings under the root; rank 0 continues two levels
BUSH = [-1, 0, 0, 0, 1, 4]


def _controller(row_cost: float, chain_acceptance: float, rank1: float, *, draft_cost: float = 0.0,
                tree_draft_cost: float | None = None, steps: int = 150, **cfg) -> DraftLengthController:
    """Forward seconds 1 + row_cost * (rows - 1) for every row count up to 40, a chain measured at
    ``chain_acceptance`` per position, and tree steps where the root's first child is accepted
    with that probability and, when it is not, its second child with probability ``rank1``."""
    c = DraftLengthController(ControllerConfig(max_k=6, tree="auto", **cfg))
    for rows in range(1, 41):
        c.observe_forward(rows, 1.0 + row_cost * (rows - 1))
    c.observe_draft(1, draft_cost)
    c.observe_tree_draft(1, draft_cost if tree_draft_cost is None else tree_draft_cost)
    rng = random.Random(0)
    for _ in range(steps):
        accepted = 0
        while accepted < 6 and rng.random() < chain_acceptance:
            accepted += 1
        c.observe_acceptance(6, accepted)
        if rng.random() < chain_acceptance:
            path = [1, 4] if rng.random() < chain_acceptance else [1]
        else:
            path = [2] if rng.random() < rank1 else []
        c.observe_tree(BUSH, path, budget=5, depth=3)
    return c


def test_depths_and_ranks():
    assert depths_and_ranks(BUSH) == [(0, 0), (1, 0), (1, 1), (1, 2), (2, 0), (3, 0)]


def test_best_tree_values_follow_acceptance_by_depth_and_rank():
    m = TreeModel(max_depth=3, max_rank=2)
    c = [[0.5, 0.3]] * 3
    one_level = m.best_values(c, 3, depth=1)
    assert one_level == pytest.approx([0.0, 0.5, 0.8, 0.8])  # two children at most: a third node adds nothing
    deeper = m.best_values(c, 3, depth=2)
    assert deeper == pytest.approx([0.0, 0.5, 0.8, 1.05])  # rank-1 sibling (0.3) before the grandchild (0.25)
    # a tree proposed as it is, valued by the same figures
    assert m.tree_value(c, [-1, 0, 0, 1]) == pytest.approx(0.5 + 0.3 + 0.25)


def test_measured_sibling_acceptance_moves_the_figures():
    m = TreeModel(max_depth=3)
    chain = [0.6, 0.6, 0.6]
    before = m.acceptance(chain)[0][1]
    for _ in range(40):
        m.observe(BUSH, [2], budget=5, depth=3, chain=chain)  # always the second child
    after = m.acceptance(chain)
    assert after[0][1] > 0.95 > before
    assert after[0][0] < 0.05  # the first child never was
    assert m.fill(5) == 1.0  # five drafted nodes for a budget of five


def test_tree_where_rows_are_free_and_siblings_accept():
    c = _controller(row_cost=0.002, chain_acceptance=0.5, rank1=0.8)
    plan = c.choose_step(max_nodes=16)
    assert plan.nodes > 0 and plan.k >= 1


def test_chain_where_rows_cost():
    c = _controller(row_cost=0.12, chain_acceptance=0.8, rank1=0.5)
    plan = c.choose_step(max_nodes=16)
    assert plan.k > 0 and plan.nodes == 0


def test_plain_where_nothing_pays():
    c = _controller(row_cost=1.0, chain_acceptance=0.3, rank1=0.2)
    assert c.choose_step(max_nodes=16) == StepPlan(0)


def test_a_costly_tree_draft_means_a_chain():
    """Rows free, siblings accepted, but growing a tree costs a forward per level that a chain's
    drafted token does not (a draft model's frontier on a slow CPU)."""
    cheap = _controller(row_cost=0.002, chain_acceptance=0.6, rank1=0.5, draft_cost=0.05, tree_draft_cost=0.05)
    costly = _controller(row_cost=0.002, chain_acceptance=0.6, rank1=0.5, draft_cost=0.05, tree_draft_cost=2.0)
    assert cheap.choose_step(max_nodes=16).nodes > 0
    assert costly.choose_step(max_nodes=16).nodes == 0


def test_tree_forwards_are_measured_apart_from_chains():
    """The chain's rows cost nothing extra, but forwards that held trees measured slow: a chain."""
    c = _controller(row_cost=0.002, chain_acceptance=0.5, rank1=0.8)
    assert c.choose_step(max_nodes=16).nodes > 0
    for rows in range(3, 18):
        c.observe_forward(rows, 3.0, tree=True)
    assert c.choose_step(max_nodes=16).nodes == 0
    assert c.forward_cost[9] < 1.1  # the chain's figures are untouched
    assert c.trees.predict_forward(40, c.predict_forward(40)) == pytest.approx(3.0, rel=0.1)  # unmeasured: scaled


def test_off_and_on_modes():
    c = _controller(row_cost=0.002, chain_acceptance=0.5, rank1=0.8)
    assert c.choose_step(max_nodes=16, mode="off").nodes == 0
    assert c.choose_step(max_nodes=16, mode="on").nodes == 16
    assert c.choose_step(max_nodes=0).nodes == 0  # no budget: chains whatever the mode


def test_the_kind_not_chosen_is_probed_now_and_then():
    c = _controller(row_cost=0.12, chain_acceptance=0.8, rank1=0.5, tree_probe_every=8, probe_every=1000,
                    tree_explore_share=1.0)
    plans = [c.choose_step(max_nodes=16) for _ in range(32)]
    trees = [i for i, p in enumerate(plans) if p.nodes]
    assert trees == [7, 15, 23, 31]


def test_a_costly_kind_is_probed_within_the_exploration_share():
    """A tree predicted to cost more than the chain's step is tried only once the time decoded
    since the last try is 1 / tree_explore_share times that extra cost (here more than the
    tree_probe_every steps)."""
    c = _controller(row_cost=0.5, chain_acceptance=0.6, rank1=0.3, tree_probe_every=8, probe_every=1000,
                    tree_explore_share=0.02)
    best = c.choose_step(max_nodes=16)
    tree = c._best_tree(1, 16)[0]
    step, extra = c._plan_cost(best, 1), c._plan_cost(tree, 1) - c._plan_cost(best, 1)
    assert best.nodes == 0 and extra / (0.02 * step) > 2 * 8
    plans = [c.choose_step(max_nodes=16) for _ in range(400)]
    first = next(i for i, p in enumerate(plans) if p.nodes)  # steps counted: the one before the loop, 0..first
    assert first + 2 >= extra / (0.02 * step) > first + 1
    assert sum(1 for p in plans if p.nodes) <= 401 * 0.02 * step / extra + 1


def test_unmeasured_trees_get_tried_then_dropped_where_rows_cost():
    """A simulated AVX2 machine: every row costs; the controller tries trees on its priors, measures
    them, and keeps to chains afterwards but for the periodic probe."""
    c = DraftLengthController(ControllerConfig(max_k=6, tree="auto", tree_probe_every=32))
    rng = random.Random(1)
    plans = []
    for _ in range(300):
        plan = c.choose_step(max_nodes=16)
        plans.append(plan)
        rows = 1 + (plan.nodes or plan.k)  # a tree's rows cost more than a chain's (tree attention)
        c.observe_forward(rows, 0.05 * (1 + 0.25 * (rows - 1)) * (1.2 if plan.nodes else 1.0), tree=bool(plan.nodes))
        if plan.k == 0:
            continue
        if plan.nodes:
            parents = [-1] + [0] * min(plan.nodes, 3) + list(range(3, plan.nodes))[: max(0, plan.nodes - 3)]
            path = [1] if rng.random() < 0.7 else []
            c.observe_tree_draft(plan.k, 0.0)
            c.observe_tree(parents, path, plan.nodes, plan.k)
        else:
            accepted = 0
            while accepted < plan.k and rng.random() < 0.7:
                accepted += 1
            c.observe_draft(plan.k, 0.0)
            c.observe_acceptance(plan.k, accepted)
    late = plans[100:]
    assert any(p.nodes for p in plans[:100])  # trees were tried
    assert sum(1 for p in late if p.nodes) <= len(late) // 32 + 1  # then only probed
    assert sum(1 for p in late if p.k and not p.nodes) > 0.8 * len(late)


def test_fixed_draft_length_with_auto_trees():
    c = _controller(row_cost=0.002, chain_acceptance=0.5, rank1=0.8, fixed_k=3)
    plan = c.choose_step(max_nodes=16)
    assert plan.k == 3 and plan.nodes > 0
    c = _controller(row_cost=0.3, chain_acceptance=0.5, rank1=0.2, fixed_k=3)
    assert c.choose_step(max_nodes=16) == StepPlan(3)


def test_spec_config_tree_modes():
    assert SpecConfig().tree == "auto"
    assert SpecConfig(method="ngram").tree_nodes == 15  # auto: the budget the controller may use (16 rows)
    assert SpecConfig(method="ngram", max_tree_nodes=31).tree_nodes == 31
    assert SpecConfig(method="ngram", tree="off").tree_nodes == 0


# -- through the engine --------------------------------------------------------------------

REPEATS = [[5, 9, 14, 3, 7, 9, 14, 3, 7, 9, 14, 8, 5, 9, 14, 3], [11, 12, 11, 13, 11, 12, 11, 14, 11, 12]]
PARAMS = [
    SamplingParams(max_tokens=30, ignore_eos=True),
    SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=4),
    SamplingParams(max_tokens=30, temperature=0.9, top_k=20, seed=9, repetition_penalty=1.3, min_tokens=10),
]


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2", seed=3, vocab=VOCAB, hidden=64, intermediate=128, layers=2)


def _engine(model, proposer=None, **cfg):
    ctl = ControllerConfig(max_k=4, tree="auto", **cfg)
    return Engine(model, ToyTokenizer(VOCAB, (2,)), max_len=96, proposer=proposer, controller=ctl,
                  tree_nodes=8 if proposer else 0)


def _generate(eng, prompt, params):
    *_, (seq, _) = eng.generate(prompt, params)
    return seq


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded", "seeded-penalties"])
@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_auto_trees_equal_plain(target, params, kind):
    """A fixed depth makes the controller alternate chains and trees (its probe every other step),
    so both kinds run whatever this machine's costs; the adaptive controller runs as it likes."""
    draft = tiny_model("qwen2", seed=77, vocab=VOCAB, hidden=64, intermediate=128, layers=2)

    def proposer():
        return NgramProposer(3, 1) if kind == "ngram" else DraftModelProposer(draft, VOCAB, 96)

    trees, chains = 0, 0
    for prompt in REPEATS:
        want = _generate(_engine(target), prompt, params).generated
        for cfg in (dict(fixed_k=3, tree_probe_every=2, tree_explore_share=1.0), dict(tree_probe_every=3)):
            seq = _generate(_engine(target, proposer(), **cfg), prompt, params)
            assert seq.generated == want, (prompt, cfg)
            trees += seq.stats.tree_steps
            chains += seq.stats.draft_steps - seq.stats.tree_steps
    assert trees > 0 and chains > 0


def _auto_trees(monkeypatch) -> list[int]:
    """Engines of the sampling check drafting with a fixed depth and trees every other step; the
    sizes of the trees verified."""
    init = Engine.__init__
    ctl = ControllerConfig(max_k=3, fixed_k=3, tree="auto", tree_probe_every=2, tree_explore_share=1.0)
    monkeypatch.setattr(Engine, "__init__", lambda self, *a, **kw: init(
        self, *a, **{**kw, "tree_nodes": 8, "controller": ctl}))
    sizes = []
    verify_tree = Engine._verify_tree
    monkeypatch.setattr(Engine, "_verify_tree", lambda self, seq, tree, logits: (
        sizes.append(tree.size), verify_tree(self, seq, tree, logits))[1])
    return sizes


@pytest.mark.parametrize("full_trees", [False, True])
def test_auto_tree_sampling_is_exact(monkeypatch, full_trees):
    """The adaptive planner decides from measured times how many steps verify trees, so alone it
    would leave this check's power to the machine; ``full_trees`` verifies a full tree every step, the
    negative control's setting below, with the real verifier."""
    target, draft = sampling_check.model(11, 1.0), sampling_check.model(12, 2.0)
    sizes = _auto_trees(monkeypatch)
    if full_trees:
        monkeypatch.setattr(TreePlanner, "fixed_depth_plan", lambda self, chain, batch, nodes, k: StepPlan(k, nodes))
    counts = sampling_check.sample_counts(target, draft, seed=6, monkeypatch=monkeypatch)
    assert sizes and max(sizes) > 3  # branching trees were verified
    if full_trees:
        assert min(sizes) > 3
    assert sampling_check.p_value(counts, sampling_check.exact_distribution(target)) > 1e-3


def test_auto_tree_sampling_check_rejects_a_biased_tree_verifier(monkeypatch):
    """Every step verifies a full tree here: which steps the adaptive planner makes trees (and of
    what size) follows measured times, so with it the bias's weight, and the p-value, would vary
    from run to run and machine to machine."""
    target, draft = sampling_check.model(11, 1.0), sampling_check.model(12, 2.0)
    sizes = _auto_trees(monkeypatch)
    monkeypatch.setattr(TreePlanner, "fixed_depth_plan", lambda self, chain, batch, nodes, k: StepPlan(k, nodes))
    monkeypatch.setattr(tv, "_try_children", restart_from_p_ignoring_q)
    counts = sampling_check.sample_counts(target, draft, seed=6, monkeypatch=monkeypatch)
    assert sizes and min(sizes) > 3
    assert sampling_check.p_value(counts, sampling_check.exact_distribution(target)) < 1e-6


def test_cli_spec_tree_default_is_auto(tmp_path):
    from tokenleap.cli.main import build_parser, spec_config

    base = ["generate", "--model", a_model_file(tmp_path), "--prompt", "x", "--spec", "ngram"]
    spec = spec_config(build_parser().parse_args(base))
    assert spec.tree == "auto" and spec.tree_nodes == 15
    spec = spec_config(build_parser().parse_args(base + ["--spec-tree", "off", "--max-tree-nodes", "8"]))
    assert spec.tree == "off" and spec.tree_nodes == 0


def test_bench_auto_tree_methods():
    from types import SimpleNamespace

    from tokenleap.bench.common import BenchError
    from tokenleap.bench.methods import build_tokenleap, parse_methods
    from tokenleap.kernels import amx_available

    model = tiny_model("qwen2", seed=3, vocab=VOCAB, hidden=64, intermediate=128, layers=2)
    pool = SimpleNamespace(target=lambda: SimpleNamespace(model=model, tokenizer=ToyTokenizer(VOCAB, (2,))),
                           opts=SimpleNamespace(max_len=64))
    specs = parse_methods("ngram,ngram:tree=auto,nodes=8,ngram-tree", add_plain=False)
    engines = [build_tokenleap(s, pool).engine for s in specs]
    auto = "auto" if amx_available() else "off"  # auto weighs trees only where verification rows are flat
    assert [(e.tree_nodes, e.controller.cfg.tree) for e in engines] == [(0, "off"), (8, auto), (15, "on")]
    with pytest.raises(BenchError, match="tree must be one of"):
        parse_methods("ngram:tree=maybe")


def test_auto_trees_only_where_verification_rows_are_flat(monkeypatch):
    import tokenleap.kernels as kernels
    from tokenleap.spec.tree_budget import machine_tree_mode

    for amx in (True, False):
        monkeypatch.setattr(kernels, "amx_available", lambda amx=amx: amx)
        assert machine_tree_mode("auto") == ("auto" if amx else "off")
        assert machine_tree_mode("on") == "on" and machine_tree_mode("off") == "off"
