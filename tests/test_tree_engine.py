"""Token trees through the model and the engine: a node's logits are bitwise those of plain decoding
of its own prefix (contiguous and paged caches, float32 / int8 / int4 / bf16 / W8A8 weights, next to
other sequences), the accepted path is compacted into the cache, and tree speculation gives the
tokens of plain decoding (greedy and seeded, with penalties and min_tokens)."""
from __future__ import annotations

import pytest
import torch

from tokenleap import kernels
from tokenleap.cache.contiguous import KVCache
from tokenleap.config import SamplingParams
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.spec.stats import SpecStats
from tokenleap.models.quant import quantize_
from tokenleap.models.transformer import Segment
from tokenleap.cache.paged import PagedKVCache
from tokenleap.spec.proposers.ngram import NgramProposer
from tokenleap.spec.tree import TokenTree

from conftest import ToyTokenizer, tiny_model

VOCAB = 96
PROMPT = list(range(3, 20))
# root 30; siblings at depth 1 (31, 32, 33), depth 2 (34, 35 under 31; 36 under 33), depth 3 (37 under 35)
TREE = TokenTree(torch.tensor([30, 31, 32, 33, 34, 35, 36, 37]), torch.tensor([-1, 0, 0, 0, 1, 1, 3, 5]))


def _model(kind: str):
    m = tiny_model("qwen2", seed=3, vocab=VOCAB, hidden=64, intermediate=128, layers=2)
    if kind in ("int8", "int4", "w8a8"):
        quantize_(m, kind)
    elif kind == "bf16":
        m = tiny_model("qwen2", seed=3, vocab=VOCAB, hidden=64, intermediate=128, layers=2, dtype=torch.bfloat16)
    return m


def _cache(model, kind: str):
    if kind == "paged":
        return PagedKVCache(model.config, 48, 64, model.dtype if model.dtype != torch.bfloat16 else torch.bfloat16,
                            block_size=4, num_slots=4)
    return KVCache(model.config, 4, 64, model.dtype)


def _plain_logits(model, cache, prompt: list[int], tail: list[int]) -> torch.Tensor:  # [vocab]
    """Plain decoding: ``prompt`` prefilled, then ``tail`` one token a step; the last step's logits."""
    slot = cache.allocate()
    model(torch.tensor(prompt), [Segment(slot, 0, len(prompt))], cache)
    for i, tok in enumerate(tail):
        out = model(torch.tensor([tok]), [Segment(slot, len(prompt) + i, 1)], cache, row_exact=True).logits[0]
    cache.free(slot)
    return out


@pytest.mark.parametrize("weights", ["fp32", "int8", "int4", "bf16", "w8a8"])
@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
def test_tree_rows_are_bitwise_plain_decoding(weights, cache_kind):
    if weights == "w8a8" and not kernels.w8a8_available():
        pytest.skip("W8A8 products need AMX-INT8 tiles")
    model = _model(weights)
    cache = _cache(model, cache_kind)
    a, b = cache.allocate(), cache.allocate()
    other = [50, 51, 52]
    model(torch.tensor(PROMPT), [Segment(a, 0, len(PROMPT))], cache)
    model(torch.tensor(other), [Segment(b, 0, len(other))], cache)
    # one forward: the tree of sequence a, then a chain of sequence b beside it
    tokens = torch.cat([TREE.tokens, torch.tensor([53, 54])])
    segs = [Segment(a, len(PROMPT), TREE.size, 0, tree=TREE), Segment(b, len(other), 2, TREE.size)]
    logits = model(tokens, segs, cache, row_exact=True).logits  # [n + 2, vocab]
    ref_cache = _cache(model, cache_kind)
    for node in range(TREE.size):
        tail = [int(TREE.tokens[c]) for c in [0] + TREE.path(node)]
        assert torch.equal(logits[node], _plain_logits(model, ref_cache, PROMPT, tail)), f"node {node}"
    for i, tail in enumerate(([53], [53, 54])):
        assert torch.equal(logits[TREE.size + i], _plain_logits(model, ref_cache, other, tail))


@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
def test_a_tree_fed_in_parts_gives_the_same_rows(cache_kind):
    model = _model("fp32")
    cache = _cache(model, cache_kind)
    a, b = cache.allocate(), cache.allocate()
    for slot in (a, b):
        model(torch.tensor(PROMPT), [Segment(slot, 0, len(PROMPT))], cache)
    whole = model(TREE.tokens, [Segment(a, len(PROMPT), TREE.size, tree=TREE)], cache, row_exact=True).logits
    parts = [model(TREE.tokens[lo:hi], [Segment(b, len(PROMPT), hi - lo, tree=TREE, tree_first=lo)], cache,
                   row_exact=True).logits for lo, hi in ((0, 1), (1, 4), (4, 8))]
    assert torch.equal(torch.cat(parts), whole)
    assert cache.lengths[b] == len(PROMPT) + TREE.size


@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
def test_compacted_path_continues_as_plain_decoding(cache_kind):
    model = _model("fp32")
    cache = _cache(model, cache_kind)
    slot = cache.allocate()
    model(torch.tensor(PROMPT), [Segment(slot, 0, len(PROMPT))], cache)
    model(TREE.tokens, [Segment(slot, len(PROMPT), TREE.size, tree=TREE)], cache, row_exact=True)
    path = TREE.path(7)  # nodes 1 -> 5 -> 7: two of them move
    cache.compact(slot, len(PROMPT), path)
    cache.truncate(slot, len(PROMPT) + 1 + len(path))
    accepted = [int(TREE.tokens[c]) for c in [0] + path]
    nxt = model(torch.tensor([60]), [Segment(slot, len(PROMPT) + len(accepted), 1)], cache, row_exact=True).logits[0]
    ref = _plain_logits(model, _cache(model, cache_kind), PROMPT, accepted + [60])
    assert torch.equal(nxt, ref)


def _engine(model, tree_nodes: int, proposer=None, cache=None):
    return Engine(model, ToyTokenizer(VOCAB, (2,)), max_len=64, proposer=proposer, cache=cache,
                  controller=ControllerConfig(max_k=4, fixed_k=4 if proposer else None), tree_nodes=tree_nodes)


def _generate(eng, prompt, params):
    *_, (seq, _) = eng.generate(prompt, params)
    return seq


REPEATS = [[5, 9, 14, 3, 7, 9, 14, 3, 7, 9, 14, 8, 5, 9, 14, 3], [11, 12, 11, 13, 11, 12, 11, 14, 11, 12]]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=30, ignore_eos=True),
    SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=4),
    SamplingParams(max_tokens=30, temperature=0.9, top_k=20, seed=9, repetition_penalty=1.3,
                   presence_penalty=0.4, min_tokens=10),
], ids=["greedy", "seeded", "seeded-penalties"])
@pytest.mark.parametrize("paged", [False, True])
def test_ngram_tree_speculation_equals_plain(params, paged, monkeypatch):
    model = _model("fp32")
    trees = []
    verify_tree = Engine._verify_tree
    monkeypatch.setattr(Engine, "_verify_tree", lambda self, seq, tree, logits: (
        trees.append(tree.size), verify_tree(self, seq, tree, logits))[1])
    total = SpecStats()
    for prompt in REPEATS:
        want = _generate(_engine(model, 0), prompt, params).generated
        cache = PagedKVCache(model.config, 40, 64, torch.float32, block_size=4, num_slots=1) if paged else None
        eng = _engine(model, 8, NgramProposer(3, 1), cache)
        seq = _generate(eng, prompt, params)
        assert seq.generated == want, prompt
        total.merge(eng.totals)
    assert trees  # branching trees were verified
    stats = total.to_dict()
    assert stats["tree_steps"] == len(trees) and stats["mean_tree_nodes"] > 1
    assert sum(stats["accepted_by_sibling_rank"]) <= stats["accepted_tokens"]


def test_ngram_proposes_branching_trees():
    p = NgramProposer(3, 1)
    p.begin(0, [])
    tokens = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 9, 1, 2]
    tree = p.propose_tree(0, tokens, 8, 4)
    assert tree.tokens[0] == 2 and not tree.is_chain
    assert tree.size - 1 <= 8 and int(tree.depth.max()) <= 4
    # both continuations of "1 2 3" are in the tree: 4 (twice, first) and 5
    assert [int(tree.tokens[c]) for c in tree.children[1]] == [4, 5]


def test_bench_tree_methods_build_tree_engines():
    from types import SimpleNamespace

    from tokenleap.bench.methods import build_tokenleap, parse_methods

    model = _model("fp32")
    pool = SimpleNamespace(target=lambda: SimpleNamespace(model=model, tokenizer=ToyTokenizer(VOCAB, (2,))),
                           opts=SimpleNamespace(max_len=64))
    specs = parse_methods("ngram-tree:k=3,nodes=8,ngram", add_plain=False)
    engines = [build_tokenleap(s, pool).engine for s in specs]
    assert [e.tree_nodes for e in engines] == [8, 0]
    assert all(isinstance(e.proposer, NgramProposer) for e in engines)


def test_spec_config_tree_settings():
    from tokenleap.config import ConfigError, SpecConfig

    assert SpecConfig(method="ngram", tree="on", max_tree_nodes=12).tree_nodes == 12
    assert SpecConfig(method="ngram", tree="off").tree_nodes == 0 and SpecConfig(tree="on").tree_nodes == 0
    assert SpecConfig(method="ngram").tree_nodes == 15  # auto (the default): the budget the controller may use
    for bad in (dict(tree="maybe"), dict(max_tree_nodes=0), dict(max_tree_nodes=True)):
        with pytest.raises(ConfigError):
            SpecConfig(method="ngram", **bad)


@pytest.mark.parametrize("kind", ["ngram", "draft", "self-draft"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_scheduler_with_trees_equals_requests_alone(kind, sampled, monkeypatch):
    """Continuous batching with every sequence's tree in one forward, on paged caches (target and
    draft), outputs equal to each request run alone; every block given back."""
    from serving_helpers import alone, paged_engine, workload
    from tokenleap.serve.scheduler import Request, Scheduler, SchedulerConfig

    eng = paged_engine(kind, blocks=96, k=3)
    eng.tree_nodes = 8
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=6, log_interval=0))
    outs, jobs = [], []
    for i, (prompt, m) in enumerate(workload(8, seed=2)):
        extra = dict(temperature=0.8, seed=50 + i) if sampled else {}
        params = SamplingParams(max_tokens=m, ignore_eos=True, **extra)
        tokens: list[int] = []
        sched.submit([Request(eng.create(prompt, params), lambda o, t=tokens: t.extend(o.token_ids))])
        jobs.append((prompt, params, tokens))
    trees = []
    verify_tree = Engine._verify_tree
    monkeypatch.setattr(Engine, "_verify_tree", lambda self, seq, tree, logits: (
        trees.append(tree.size), verify_tree(self, seq, tree, logits))[1])
    sched.run_until_idle()
    for prompt, params, tokens in jobs:
        assert tokens == alone(prompt, params).generated, prompt
    assert trees  # trees were verified inside batches
    from prometheus_client import generate_latest

    from tokenleap.serve.metrics import make_registry
    text = generate_latest(make_registry(sched.snapshot, "m")).decode()
    assert f'tokenleap:spec_decode_num_tree_steps_total{{model_name="m"}} {float(len(trees))}' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_sibling_rank_total{model_name="m",rank="0"}' in text \
        or sum(eng.totals.rank_accepted) == 0
    assert eng.cache.num_used_blocks == 0
    if kind != "ngram":
        assert eng.proposer.cache.num_used_blocks == 0
