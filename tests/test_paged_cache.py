"""Paged KV cache: block bookkeeping, bitwise-equal logits to the contiguous cache, and exact
recomputation of a preempted sequence."""
from __future__ import annotations

import pytest
import torch

from tokenleap.cache.contiguous import CacheFullError, KVCache
from tokenleap.config import SamplingParams
from tokenleap.models.transformer import Segment
from tokenleap.cache.paged import PagedKVCache
from tokenleap.spec.proposers.draft_model import DraftModelProposer

from conftest import tiny_model
from serving_helpers import CHUNK, MAX_LEN, VOCAB, alone, model, paged_engine


def test_blocks_follow_writes_truncation_and_free():
    cfg = model().config
    cache = PagedKVCache(cfg, 6, 64, torch.float32, block_size=4, num_slots=2)
    a, b = cache.allocate(), cache.allocate()
    k = torch.randn(cfg.num_key_value_heads, 10, cfg.head_dim)  # [kv_heads, T, hd]
    cache.write(0, a, 0, k, -k)
    cache.commit(a, 10)
    assert cache.num_slot_blocks(a) == 3 and cache.num_used_blocks == 3
    keys, values = cache.read(0, a, 10)
    assert torch.equal(keys, k) and torch.equal(values, -k)
    cache.truncate(a, 5)  # blocks wholly past position 5 go back
    assert cache.num_slot_blocks(a) == 2 and cache.num_free_blocks == 4
    assert torch.equal(cache.read(0, a, 5)[0], k[:, :5])
    with pytest.raises(CacheFullError):
        cache.reserve(b, 24)  # 6 blocks wanted, 4 free: all or nothing
    assert cache.num_slot_blocks(b) == 0
    cache.reserve(b, 16)
    assert cache.num_free_blocks == 0 and not cache.can_reserve(a, 9)
    cache.free(a)
    cache.free(b)
    assert cache.num_free_blocks == 6 and cache.num_free_slots == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_len", [128, 100])
def test_logits_bitwise_equal_to_contiguous_cache(dtype, max_len):
    m = tiny_model("qwen2", seed=1, vocab=VOCAB, dtype=dtype)
    flat = KVCache(m.config, 1, max_len, dtype)
    paged = PagedKVCache(m.config, 32, max_len, dtype, block_size=16, num_slots=2)
    s_flat, s_paged = flat.allocate(), paged.allocate()
    other = paged.allocate()  # a neighbour taking blocks in between, so blocks are not contiguous
    tokens = torch.randint(3, VOCAB, (max_len,), generator=torch.Generator().manual_seed(0))
    pos = 0
    steps = [(23, False), (9, False), (1, True), (5, True), (1, True), (17, True)] + [(1, True)] * (max_len - 56)
    for n, exact in steps:  # prefill chunks, verify blocks, then decode to the end of the window
        paged.reserve(other, min(pos + 16, max_len))
        want = m(tokens[pos:pos + n], [Segment(s_flat, pos, n)], flat, row_exact=exact).logits
        got = m(tokens[pos:pos + n], [Segment(s_paged, pos, n)], paged, row_exact=exact).logits
        assert torch.equal(want, got), (n, exact)
        pos += n
    table = paged.tables[s_paged]
    assert any(b != a + 1 for a, b in zip(table, table[1:]))  # the blocks really were scattered


@pytest.mark.parametrize("kind", [None, "ngram", "self-draft"])
def test_recompute_after_preemption_is_bitwise_exact(kind):
    eng = paged_engine(kind, blocks=32, k=3)
    prompt = [5, 9, 14, 3, 7, 9, 14, 3] * 3 + [11, 12, 13]  # 27 tokens: four prefill chunks
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    seq = eng.add(prompt, params)
    while seq.num_generated < CHUNK + 4:
        eng.step([seq])
    n = eng.cache.lengths[seq.slot]
    assert n == len(seq.tokens) - 1 and n - len(prompt) > CHUNK  # generated part spans chunks
    before = [tuple(t.clone() for t in eng.cache.read(layer, seq.slot, n)) for layer in range(2)]
    eng.detach(seq)  # preempted: blocks freed
    assert eng.cache.num_used_blocks == 0
    eng.attach(seq)
    while eng.prefill_step(seq):
        pass
    assert eng.ready(seq) and seq.num_generated == len(seq.tokens) - len(prompt)
    for layer, (k, v) in enumerate(before):
        got_k, got_v = eng.cache.read(layer, seq.slot, n)
        assert torch.equal(got_k, k) and torch.equal(got_v, v), layer
    while not seq.finished:
        eng.step([seq])
    assert seq.generated == alone(prompt, params).generated
    eng.release(seq)
    assert eng.cache.num_used_blocks == 0


def test_draft_proposer_on_a_paged_cache_frees_its_blocks():
    eng = paged_engine("draft", blocks=32)
    draft_cache = eng.proposer.cache
    prompt, params = [40, 41, 42, 43, 40, 41] * 4, SamplingParams(max_tokens=30, ignore_eos=True)
    *_, (seq, _) = eng.generate(prompt, params)
    assert seq.generated == alone(prompt, params).generated
    assert draft_cache.num_used_blocks == 0 and eng.cache.num_used_blocks == 0


def test_draft_out_of_blocks_drafts_nothing_instead_of_failing():
    target = model()
    cache = PagedKVCache(target.config, 1, MAX_LEN, torch.float32, block_size=16, num_slots=1)
    prop = DraftModelProposer(target, VOCAB, MAX_LEN, cache=cache)
    prop.begin(0, list(range(3, 30)))
    assert prop.propose(0, list(range(3, 30)), 3, SamplingParams(), None) is None
    assert cache.num_used_blocks == 0  # the failed feed was rolled back


def test_a_cache_larger_than_memory_is_a_config_error_naming_its_size(monkeypatch):
    """Sizes no machine holds (here about 1.5 PiB): one line with the size asked for, not torch's
    allocator traceback -- from the memory check, and from the allocator where memory cannot be read."""
    from tokenleap.cache import contiguous
    from tokenleap.config import ConfigError
    cfg = tiny_model("llama", seed=0).config
    for figures in (contiguous.meminfo, lambda field: None):
        monkeypatch.setattr(contiguous, "meminfo", figures)
        with pytest.raises(ConfigError, match=r"KV cache for 2000000000 slots of 512 tokens needs [\d.]+ GiB"):
            KVCache(cfg, 2_000_000_000, 512, torch.float32)
        with pytest.raises(ConfigError, match=r"2000000000 blocks of 16 tokens \(4 sequences\).*--kv-cache-gb"):
            PagedKVCache(cfg, 2_000_000_000, 512, torch.float32, num_slots=4)


def test_a_cache_the_allocator_grants_but_memory_cannot_hold_is_refused_before_it_is_touched(monkeypatch):
    """Zeroing a cache larger than available memory and free swap gets the process killed (the
    allocator grants it within the overcommit limit): the figures are checked first."""
    from tokenleap.cache import contiguous
    from tokenleap.config import ConfigError
    cfg = tiny_model("llama", seed=0).config
    size = 2 * cfg.num_hidden_layers * 64 * cfg.num_key_value_heads * 512 * cfg.head_dim * 4  # 64 slots, fp32
    figures = {"MemAvailable": size // 2, "SwapFree": size // 4}
    monkeypatch.setattr(contiguous, "meminfo", figures.get)
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises(ConfigError, match=r"64 slots of 512 tokens needs [\d.]+ GiB, and [\d.]+ GiB of memory and "
                                          r"[\d.]+ GiB of swap are available: lower"):
        KVCache(cfg, 64, 512, torch.float32)
    figures["SwapFree"] = 0
    with pytest.raises(ConfigError, match=r"needs [\d.]+ GiB, and [\d.]+ GiB of memory is available: lower"):
        KVCache(cfg, 64, 512, torch.float32)
    monkeypatch.undo()
    figures["SwapFree"] = size // 2  # with swap enough
    monkeypatch.setattr(contiguous, "meminfo", figures.get)
    assert KVCache(cfg, 64, 512, torch.float32).num_slots == 64
