"""Dynamic draft trees from a draft model (proposers/draft_tree.py) through the engine: greedy and
seeded output equal plain decoding, a draft identical to the target accepts whole paths, and
unseeded sampling keeps the target's exact distribution (with a biased tree verifier rejected)."""
from __future__ import annotations

import pytest
import torch

import tokenleap.spec.tree_verify as tv
import test_spec_sampling as sampling_check
from tokenleap.config import SamplingParams
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.spec.proposers.draft_model import DraftModelProposer

from conftest import ToyTokenizer, tiny_model
from tree_helpers import restart_from_p_ignoring_q

VOCAB = 96
PROMPTS = [[5, 9, 14, 3, 7, 9, 14, 3], [40, 41, 42, 43, 40, 41], [11] * 6 + [12, 13, 11, 11]]


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2", seed=1, vocab=VOCAB, hidden=64, intermediate=128, layers=2)


def _engine(target, draft=None, tree_nodes=0, paged=False):
    proposer = DraftModelProposer(draft, VOCAB, 128) if draft is not None else None
    return Engine(target, ToyTokenizer(VOCAB, (2,)), max_len=128, proposer=proposer, tree_nodes=tree_nodes,
                  controller=ControllerConfig(max_k=4, fixed_k=4 if draft is not None else None))


def _run(eng, prompt, params):
    *_, (seq, _) = eng.generate(prompt, params)
    return seq


@pytest.fixture
def tree_sizes(monkeypatch):
    sizes = []
    verify_tree = Engine._verify_tree
    monkeypatch.setattr(Engine, "_verify_tree", lambda self, seq, tree, logits: (
        sizes.append(tree.size), verify_tree(self, seq, tree, logits))[1])
    return sizes


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=32, ignore_eos=True),
    SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.9, seed=3),
    SamplingParams(max_tokens=32, temperature=1.0, top_p=0.9, seed=8, frequency_penalty=0.5, min_tokens=8),
], ids=["greedy", "seeded", "seeded-penalties"])
@pytest.mark.parametrize("draft_seed", [None, 77], ids=["self-draft", "random-draft"])
def test_tree_drafts_give_plain_output(target, params, draft_seed, tree_sizes):
    draft = target if draft_seed is None else tiny_model("qwen2", seed=draft_seed, vocab=VOCAB)
    for prompt in PROMPTS:
        want = _run(_engine(target), prompt, params).generated
        for nodes in (6, 16):
            seq = _run(_engine(target, draft, nodes), prompt, params)
            assert seq.generated == want, (prompt, nodes)
    assert tree_sizes and max(tree_sizes) > 5  # branching trees were verified


def test_self_draft_tree_accepts_whole_paths(target):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    seq = _run(_engine(target, target, 16), PROMPTS[0], params)
    # the draft's own greedy path is in the tree (a flat random model grows wide, shallow trees)
    assert seq.stats.draft_tokens > 0 and seq.stats.accepted_tokens >= 0.9 * seq.stats.draft_tokens
    assert seq.stats.rank_accepted[0] == seq.stats.accepted_tokens  # always the draft's first choice


def _with_trees(monkeypatch, nodes: int = 8):
    init = Engine.__init__
    monkeypatch.setattr(Engine, "__init__", lambda self, *a, **kw: init(self, *a, **{**kw, "tree_nodes": nodes}))


def test_tree_sampling_through_the_engine_is_exact(monkeypatch, tree_sizes):
    target, draft = sampling_check.model(11, 1.0), sampling_check.model(12, 2.0)
    _with_trees(monkeypatch)
    counts = sampling_check.sample_counts(target, draft, seed=5, monkeypatch=monkeypatch)
    assert tree_sizes and max(tree_sizes) > 3
    assert sampling_check.p_value(counts, sampling_check.exact_distribution(target)) > 1e-3


def test_the_engine_check_rejects_a_biased_tree_verifier(monkeypatch):
    target, draft = sampling_check.model(11, 1.0), sampling_check.model(12, 2.0)
    _with_trees(monkeypatch)
    monkeypatch.setattr(tv, "_try_children", restart_from_p_ignoring_q)
    counts = sampling_check.sample_counts(target, draft, seed=5, monkeypatch=monkeypatch)
    assert sampling_check.p_value(counts, sampling_check.exact_distribution(target)) < 1e-6


def test_frontier_nodes_outside_the_budget_are_not_fed_and_the_trees_are_the_same(target, monkeypatch):
    import tokenleap.spec.proposers.draft_tree as dt

    draft = tiny_model("qwen2", seed=77, vocab=VOCAB)
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    def run(prune: bool):
        trees, rows = [], []
        feed, verify_tree = dt._feed_frontier, Engine._verify_tree
        monkeypatch.setattr(dt, "_feed_frontier", lambda proposer, lanes: (
            rows.append(sum(g.frontier[-1][0] - g.frontier[0][0] + 1 for g in lanes)), feed(proposer, lanes))[1])
        monkeypatch.setattr(Engine, "_verify_tree", lambda self, seq, tree, logits: (
            trees.append((tree.tokens.tolist(), tree.parents.tolist())), verify_tree(self, seq, tree, logits))[1])
        if not prune:
            monkeypatch.setattr(dt, "_prune_frontier", lambda g, budget: None)
        out = [_run(_engine(target, draft, nodes), prompt, params).generated for prompt in PROMPTS for nodes in (6, 16)]
        monkeypatch.undo()
        return out, trees, sum(rows)

    pruned, full = run(True), run(False)
    assert pruned[0] == full[0] and pruned[1] == full[1]  # the same output from the same trees
    assert len(pruned[1]) > 10 and max(len(t) for t, _ in pruned[1]) > 5
    assert pruned[2] < full[2]  # ... for fewer draft rows


def test_a_tree_that_first_feeds_a_backlog_reports_it_as_catch_up():
    """Tokens decoded while the draft sat out are fed before its tree grows: prefill work, as for
    a chain, not drafting -- the controller would otherwise price trees by the backlog."""
    from tokenleap.spec.proposers.base import DraftRequest

    draft = DraftModelProposer(tiny_model("qwen2", seed=78, vocab=VOCAB), VOCAB, 128, num_slots=2)
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = PROMPTS[0]
    for i in range(2):
        draft.begin(i, prompt)
        draft.prefill(i, prompt)
    usual, behind = prompt + [7], prompt + [7, 8, 9, 10, 11, 12]  # after one step / after plain steps
    got = draft.propose_many([DraftRequest(0, usual, 3, greedy, max_nodes=8),
                              DraftRequest(1, behind, 3, greedy, max_nodes=8)])
    assert all(d is not None and d.tree is not None for d in got)
    assert got[0].catch_up_seconds == 0.0 and got[0].catch_up_tokens == 0
    assert got[1].catch_up_seconds > 0.0 and got[1].catch_up_tokens == len(behind) - len(prompt)
    assert draft._fed[1] == len(behind)  # the backlog is in the cache: the next tree drafts at once


def _grown_tree(max_len: int, tokens: list[int], k: int = 4, nodes: int = 8):
    """The tree a fresh draft (seed 77: it branches) grows after ``tokens`` in a cache of ``max_len``."""
    from tokenleap.spec.proposers.base import DraftRequest

    draft = DraftModelProposer(tiny_model("qwen2", seed=77, vocab=VOCAB), VOCAB, max_len)
    draft.begin(0, tokens[:-1])
    draft.prefill(0, tokens[:-1])
    got = draft.propose_many([DraftRequest(0, tokens, k, SamplingParams(max_tokens=8, ignore_eos=True),
                                           max_nodes=nodes)])[0]
    return got, draft


def test_a_draft_tree_needs_cache_room_for_the_nodes_it_feeds_only():
    """The draft's cache holds the fed nodes (at most 1 + WIDTH * (k - 1) rows past the root), not a
    row per grown node: near the end of the cache the tree is the same as in a large one. A level
    the cache cannot hold is grown but not fed, so a tree still comes out where even less room is
    left. (A scratch row per grown node overflowed such caches, and every tree failed after the
    draft had paid for its levels.)"""
    from tokenleap.spec.proposers.draft_tree import WIDTH

    tokens = PROMPTS[0] * 4 + [7]  # 33 tokens, the root at position 32
    k, room = 4, 1 + WIDTH * 3  # rows past the root a depth-4 tree may feed
    big, _ = _grown_tree(128, tokens, k)
    assert big is not None and big.tree is not None and int(big.tree.depth.max()) >= 2
    tight, draft = _grown_tree(len(tokens) - 1 + room, tokens, k)
    assert tight is not None and tight.tree is not None
    assert (tight.tree.tokens.tolist(), tight.tree.parents.tolist()) == (big.tree.tokens.tolist(),
                                                                         big.tree.parents.tolist())
    squeezed, _ = _grown_tree(len(tokens) + k, tokens, k)  # room for the root and a few fed nodes
    assert squeezed is not None and squeezed.tree is not None and int(squeezed.tree.depth.max()) >= 2


def test_tree_drafts_near_the_end_of_the_context_give_plain_output(target):
    """A sequence that runs to its context's end through draft trees (the draft's cache no bigger
    than the target's): every step near the end still drafts, and the output is plain decoding's."""
    draft = tiny_model("qwen2", seed=77, vocab=VOCAB)
    with torch.no_grad():
        draft.lm_head.weight.mul_(40.0)  # sure of itself: deep, narrow trees
    prompt = PROMPTS[0] * 4
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    max_len = len(prompt) + 40

    def engine(proposer):
        return Engine(target, ToyTokenizer(VOCAB, (2,)), max_len=max_len, proposer=proposer, tree_nodes=15,
                      controller=ControllerConfig(max_k=8, fixed_k=8))

    want = _run(engine(None), prompt, params)
    seq = _run(engine(DraftModelProposer(draft, VOCAB, max_len)), prompt, params)
    assert seq.generated == want.generated and seq.finish_reason == want.finish_reason
    assert seq.stats.draft_steps >= 0.8 * seq.stats.target_forwards - 2  # trees all the way, not plain steps
