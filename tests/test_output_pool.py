"""The output pool (``spec/proposers/output_pool.py``): earlier sequences' outputs as a lookup source
of the n-gram drafters. Its tables on their own (longest match, latest occurrence, eviction); the
n-gram proposer's order of sources; and on a tiny model, a sequence whose reply an earlier one wrote
is verified many tokens a step while every output (greedy, seeded, each proposer that looks text
up) stays plain decoding's."""
from __future__ import annotations

import pytest

from tokenleap.config import SamplingParams
from tokenleap.spec.bandit import BanditConfig, Choice
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.spec.proposers.auto import AutoProposer
from tokenleap.spec.proposers.base import output_pools, remember_output
from tokenleap.spec.proposers.draft_model import DraftModelProposer
from tokenleap.spec.proposers.ngram import NgramProposer
from tokenleap.spec.proposers.output_pool import OutputPool

from conftest import ToyTokenizer, tiny_model

VOCAB = 96
PROMPT = [5, 9, 14, 3, 7, 21, 30, 4]


def test_the_pool_continues_the_latest_occurrence_of_a_suffix():
    pool = OutputPool(max_tokens=100, n_min=2, n_max=4)
    pool.add([1, 2, 3, 4, 5, 6])
    pool.add([9, 2, 3, 7, 8])
    assert pool.continuation([0, 2, 3], 2, 3) == [7, 8]  # the latest output holding (2, 3)
    assert pool.continuation([1, 2, 3], 3, 3) == [4, 5, 6]  # (1, 2, 3) only in the first
    assert pool.continuation([1, 2, 3], 1, 3) == [] and pool.continuation([1, 2, 3], 5, 3) == []  # n out of range
    assert pool.continuation([4, 4], 2, 3) == []
    pool.add([1, 2])  # shorter than min_output: not kept
    assert (len(pool), pool.outputs) == (11, 2)
    with pytest.raises(ValueError):
        OutputPool(max_tokens=0)


def test_the_oldest_outputs_leave_and_their_entries_with_them():
    pool = OutputPool(max_tokens=12, n_min=2, n_max=3)
    pool.add([1, 2, 3, 4, 5, 6])
    pool.add([7, 8, 9, 10, 11, 12])
    pool.add([1, 2, 30, 31, 32])  # 17 tokens: the first output leaves
    assert (len(pool), pool.outputs) == (11, 2)
    assert pool.continuation([1, 2, 3], 3, 2) == []  # only the first output had (1, 2, 3)
    assert pool.continuation([0, 1, 2], 2, 2) == [30, 31]
    for i in range(40):  # many outputs through a small pool: lookups stay right
        pool.add([100 + i, 101 + i, 102 + i, 103 + i])
    assert len(pool) <= 12 and pool.continuation([139, 140], 2, 3) == [141, 142]
    assert pool.continuation([100, 101], 2, 3) == []
    assert sum(len(v) for t in pool._tables.values() for v in t.values()) < 40  # entries leave with their output
    pool.clear()
    assert len(pool) == 0 and pool.continuation([139, 140], 2, 3) == []


def test_the_ngram_proposer_looks_the_pool_up_after_its_own_text():
    pool = OutputPool(max_tokens=100, n_min=2, n_max=6)
    pool.add([40, 41, 42, 43, 44, 45, 46, 47])
    p = NgramProposer(4, 2, pool)
    params = SamplingParams()
    p.begin(0, [])
    assert p.propose(0, [1, 2, 41, 42], 3, params, None).tokens == [43, 44, 45]  # nothing in the text: the pool
    p.begin(1, [])
    own = [41, 42, 9, 8, 41, 42]
    assert p.propose(1, own, 3, params, None).tokens == [9, 8, 41]  # equal n: the text first
    p.begin(2, [])
    longer = [99, 42, 43, 7, 8, 40, 41, 42, 43]  # the pool's 4-gram match beats the text's 2-gram (42, 43)
    assert p.propose(2, longer, 2, params, None).tokens == [44, 45]
    tree = p.propose_tree(0, [1, 2, 41, 42], max_nodes=5, max_depth=4)
    assert tree is not None and tree.tokens[1:5].tolist() == [43, 44, 45, 46]
    bare = NgramProposer(4, 2)
    bare.begin(0, [])
    assert bare.propose(0, [1, 2, 41, 42], 3, params, None) is None  # without the pool: no match


def test_remember_output_fills_each_shared_pool_once():
    pool = OutputPool(max_tokens=100, n_min=2, n_max=4)
    auto = AutoProposer({"ngram": NgramProposer(4, 2, pool), "other": NgramProposer(3, 2, pool)}, BanditConfig(max_k=4))
    remember_output(auto, [1, 2, 3, 4, 5])
    assert pool.outputs == 1 and output_pools(auto) == [pool]
    assert output_pools(NgramProposer(4, 2)) == []  # no pool: remember_output has nothing to fill


@pytest.fixture(scope="module")
def models():
    return (tiny_model("qwen2", seed=1, vocab=VOCAB, hidden=64, intermediate=128, layers=2),
            tiny_model("qwen2", seed=78, vocab=VOCAB))


def run(engine: Engine, params: SamplingParams):
    *_, (seq, _) = engine.generate(PROMPT, params)
    return seq


def engine(target, proposer) -> Engine:
    return Engine(target, ToyTokenizer(VOCAB, (2,)), max_len=160, proposer=proposer,
                  controller=ControllerConfig(max_k=6, fixed_k=6 if proposer is not None else None))


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=60, ignore_eos=True),
                                    SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.8, seed=5)],
                         ids=["greedy", "seeded"])
def test_an_output_written_before_is_drafted_from_the_pool_and_the_output_is_unchanged(models, params):
    target, draft = models
    plain = run(engine(target, None), params).generated
    pool = OutputPool(n_min=2, n_max=6)
    eng = engine(target, NgramProposer(4, 2, pool))
    first = run(eng, params)
    assert first.generated == plain and pool.outputs == 1
    again = run(eng, params)  # the same request again (a regeneration): its reply is in the pool
    assert again.generated == plain
    assert again.stats.accepted_tokens >= 45 and again.stats.target_forwards < first.stats.target_forwards
    # its drafts are counted apart: n-gram from earlier outputs
    assert "ngram-pool" not in first.stats.proposer_tokens and again.stats.proposer_tokens["ngram-pool"] >= 45
    # the same with --spec auto's n-gram arm beside a draft model, and on a fresh engine with other text
    auto_pool = OutputPool(n_min=2, n_max=6)
    auto = engine(target, AutoProposer({"draft": DraftModelProposer(draft, VOCAB, 160),
                                        "ngram": NgramProposer(4, 2, auto_pool)}, BanditConfig(max_k=6)))
    assert run(auto, params).generated == plain and run(auto, params).generated == plain
    solo_auto = AutoProposer({"ngram": NgramProposer(4, 2, OutputPool(n_min=2, n_max=6))}, BanditConfig(max_k=6))
    # auto keeps the arm's finer label. Whether the arm drafts at all is auto's choice by measured costs,
    # which on a busy machine can decode a whole regeneration plainly: the arm is chosen at every step here.
    solo_auto.bandit.plan = lambda *a, **kw: [Choice("ngram", 6, 0.0)]  # type: ignore[method-assign]
    solo = engine(target, solo_auto)
    first_solo, again_solo = run(solo, params), run(solo, params)
    assert first_solo.generated == plain and again_solo.generated == plain
    assert "ngram-pool" not in first_solo.stats.proposer_tokens
    assert again_solo.stats.proposer_tokens.get("ngram-pool", 0) >= 45
    other = OutputPool(n_min=2, n_max=6)
    other.add([(t * 7 + 3) % VOCAB for t in plain])  # an unrelated earlier output: proposals that miss
    assert run(engine(target, NgramProposer(4, 2, other)), params).generated == plain


def test_the_default_engine_keeps_its_outputs_and_drafts_from_them(models):
    """Through the Python API (the scheduler's path, as the server's): the pool is on by default, a
    request asked again drafts its earlier reply, and the reply is unchanged; ngram_pool=0 keeps none."""
    import torch

    from tokenleap.api import LLM
    from tokenleap.config import SpecConfig
    from tokenleap.models.pretrained import LoadedModel
    target, _ = models
    loaded = LoadedModel(target, ToyTokenizer(VOCAB, (2,)), torch.float32, "none", "tiny", None)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    runs = {}
    for size in (SpecConfig.ngram_pool, 0):
        spec = SpecConfig(method="ngram", ngram_pool=size, num_tokens=6, tree="off")  # (fixed: no timed choices)
        llm = LLM.from_loaded(loaded, spec, max_model_len=160)
        runs[size] = [llm.generate([PROMPT], params)[0] for _ in range(2)]
    (first, again), (bare, bare_again) = runs[SpecConfig.ngram_pool], runs[0]
    assert SpecConfig.ngram_pool > 0 and first.token_ids == again.token_ids == bare.token_ids == bare_again.token_ids
    assert again.stats["accepted_tokens"] >= first.stats["accepted_tokens"] + 20
    assert bare_again.stats["accepted_tokens"] == bare.stats["accepted_tokens"]


def test_startup_lines_say_when_earlier_outputs_are_read():
    from tokenleap.cli.serve import _speculation
    from tokenleap.spec.proposers.base import output_pool_note
    pooled = NgramProposer(4, 2, OutputPool(1000))
    words = "n-gram lookup in the last 1000 tokens of earlier outputs too"
    assert output_pool_note(NgramProposer(4, 2)) is None and output_pool_note(pooled) == words
    assert _speculation(pooled) == f"ngram ({words})" and _speculation(NgramProposer(4, 2)) == "ngram"
    auto = AutoProposer({"ngram": pooled}, BanditConfig(max_k=4))
    auto.note = "a draft picked"
    assert _speculation(auto) == f"auto (ngram; a draft picked; {words})" and _speculation(None) == "off"
