"""Prefix caching in the paged KV cache: prompt windows computed once are reused bitwise, blocks are
reference-counted, cached windows nobody holds count as free and are evicted least recently used first."""
from __future__ import annotations

import json

import pytest
import torch

from tokenleap.config import SamplingParams
from tokenleap.cache.paged import PagedKVCache
from tokenleap.serve.scheduler import Scheduler, SchedulerConfig

from serving_helpers import alone, model, paged_engine
from test_scheduler import submit

WINDOW, BLOCK = 16, 8  # prefill windows of 16 tokens = 2 blocks


def keys(n: int) -> list[bytes]:
    return [bytes([i]) * 4 for i in range(n)]


def test_windows_are_shared_counted_free_when_idle_and_evicted_lru():
    cfg = model().config
    cache = PagedKVCache(cfg, 8, 64, torch.float32, block_size=4, num_slots=4)
    a = cache.allocate()
    kv = torch.randn(cfg.num_key_value_heads, 16, cfg.head_dim)  # [kv_heads, 16, hd]
    cache.write(0, a, 0, kv, -kv)
    cache.commit(a, 16)
    cache.register_prefix(a, 0, keys(1)[0], 8)
    cache.register_prefix(a, 1, keys(2)[1], 8)
    assert cache.num_used_blocks == 4 and cache.num_cached_blocks == 4
    cache.free(a)  # nobody holds the windows: cached, yet free for reservations
    assert cache.num_free_blocks == 8 and cache.num_cached_blocks == 4
    spare = cache.allocate()
    assert cache.can_reserve(spare, 32)  # all 8 blocks: 4 never used, 4 of idle windows (evicted by reserve)
    cache.free(spare)
    b, c = cache.allocate(), cache.allocate()
    assert cache.attach_prefix(b, keys(2), 8) == 16 and cache.lengths[b] == 16
    assert cache.attach_prefix(c, keys(1) + [b"miss"], 8) == 8  # stops at the first window not cached
    assert torch.equal(cache.read(0, b, 16)[0], kv) and torch.equal(cache.read(0, c, 8)[1], -kv[:, :8])
    assert cache.num_used_blocks == 4  # shared, not copied
    assert (cache.prefix_queries, cache.prefix_hits) == (32, 24)
    cache.free(b)
    assert cache.num_used_blocks == 2  # window 0 still held by c; window 1 idle
    cache.reserve(cache.allocate(), 20)  # 5 blocks: 4 never used + window 1 evicted
    assert cache.num_cached_blocks == 2 and cache.num_free_blocks == 1
    cache.free(c)
    d = cache.allocate()
    assert cache.attach_prefix(d, keys(2), 8) == 8  # window 0 survived, window 1 was evicted
    cache.clear_prefix_cache()
    assert cache.num_cached_blocks == 0 and cache.num_used_blocks == 7  # d's 2 blocks + the reservation's 5
    cache.free(d)
    assert cache.num_used_blocks == 5 and cache.attach_prefix(cache.allocate(), keys(1), 8) == 0


def test_a_prompts_lookup_counts_all_its_tokens_as_queried():
    """vLLM's hit rate: hits over every prompt token looked up -- a prompt shorter than a window, and
    the tail past a prompt's last whole window, count as queried (never as hits)."""
    cache = PagedKVCache(model().config, 16, 64, torch.float32, block_size=4)
    prompt = list(range(1, 20))  # 19 tokens: windows of 8 at 0-7 and 8-15 (the last token's window computed)
    a = cache.allocate()
    assert cache.attach_prompt(a, prompt[:5], 8) == 0 and (cache.prefix_queries, cache.prefix_hits) == (5, 0)
    cache.free(a)
    b = cache.allocate()
    cache.reserve(b, 16)
    cache.commit(b, 16)
    cache.register_window(b, prompt, 0, 8, 8)
    cache.register_window(b, prompt, 8, 16, 8)
    c = cache.allocate()
    assert cache.attach_prompt(c, prompt, 8) == 16
    assert (cache.prefix_queries, cache.prefix_hits) == (5 + 19, 16)


def test_no_prefix_caching_when_off_or_windows_split_blocks():
    cfg = model().config
    for cache, window in ((PagedKVCache(cfg, 8, 64, torch.float32, block_size=4, prefix_caching=False), 8),
                          (PagedKVCache(cfg, 8, 64, torch.float32, block_size=4), 6)):
        a = cache.allocate()
        cache.reserve(a, 12)
        cache.commit(a, 12)
        cache.register_prefix(a, 0, b"k", window)
        cache.free(a)
        assert cache.num_cached_blocks == 0 and cache.attach_prefix(cache.allocate(), [b"k"], window) == 0


def shared_prefix_jobs(n: int, prefix: int = 40, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 96, (prefix,), generator=g).tolist()
    return [(system + torch.randint(3, 96, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist(),
             SamplingParams(max_tokens=int(torch.randint(10, 60, (1,), generator=g)), ignore_eos=True))
            for _ in range(n)]


@pytest.mark.parametrize("kind", [None, "ngram", "draft"])
@pytest.mark.parametrize("blocks", [128, 17])
def test_shared_prefixes_are_reused_and_outputs_equal_alone(kind, blocks):
    """A shared 40-token prefix: its two whole windows are computed once, then reused by every
    later request -- with a small pool too, where cached windows get evicted and sequences preempted."""
    eng = paged_engine(kind, blocks=blocks, chunk=WINDOW, block_size=BLOCK)
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=8, log_interval=0))
    jobs = shared_prefix_jobs(10)
    first = submit(sched, *jobs[0])
    sched.run_until_idle()
    sinks = [first] + [submit(sched, p, params) for p, params in jobs[1:]]
    sched.run_until_idle()
    for (prompt, params), sink in zip(jobs, sinks):
        assert sink.tokens == alone(prompt, params, chunk=WINDOW).generated, prompt
    assert eng.cache.prefix_hits >= 2 * WINDOW * 5
    assert eng.cache.num_used_blocks == 0 and eng.cache.num_cached_blocks > 0  # idle windows stay cached
    if kind == "draft":  # the draft's cache keeps the windows it caught up on, too
        assert eng.proposer.cache.prefix_hits > 0 and eng.proposer.cache.num_used_blocks == 0
    if blocks == 17:
        assert sched.stats.preemptions > 0


def test_a_follow_up_turn_reuses_the_conversation_so_far():
    eng = paged_engine("draft", blocks=64, chunk=WINDOW, block_size=BLOCK)
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=4, log_interval=0))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    turn1 = list(range(10, 50))  # 40 tokens
    sink = submit(sched, turn1, params)
    sched.run_until_idle()
    turn2 = turn1 + sink.tokens + [7, 8, 9]  # 63 tokens: windows 0-2 hold 48 of them
    hits = eng.cache.prefix_hits
    sink2 = submit(sched, turn2, params)
    sched.run_until_idle()
    assert eng.cache.prefix_hits - hits == 2 * WINDOW  # turn 1's prompt windows (its reply was decoded, not prefilled)
    assert sink2.tokens == alone(turn2, params, chunk=WINDOW).generated


def test_prompt_logprobs_requests_compute_every_prompt_row():
    eng = paged_engine(None, blocks=64, chunk=WINDOW, block_size=BLOCK)
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=4, log_interval=0))
    prompt = list(range(10, 50))
    submit(sched, prompt, SamplingParams(max_tokens=4))
    sched.run_until_idle()
    seq = eng.create(prompt, SamplingParams(max_tokens=4, prompt_logprobs=1))
    eng.attach(seq)
    assert seq.cached_tokens == 0 and eng.cache.lengths[seq.slot] == 0
    again = eng.create(prompt, SamplingParams(max_tokens=4))
    eng.attach(again)
    assert again.cached_tokens == 2 * WINDOW


def test_server_reports_cached_prompt_tokens_and_prefix_metrics():
    import httpx
    import openai

    from tokenleap.serve.app import ServerConfig, create_app
    from serving_helpers import ChatToyTokenizer, LiveServer

    eng = paged_engine("ngram", blocks=64, chunk=WINDOW, block_size=BLOCK)
    tok = ChatToyTokenizer(96)
    system = {"role": "system", "content": "You answer in short sentences about the sea."}
    chats = [[system, {"role": "user", "content": q}] for q in ("hello", "tides?")]
    prompts = [tok.encode(tok.apply_chat_template(m)) for m in chats]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    assert shared >= 2 * WINDOW
    config = ServerConfig(model_name="tiny", scheduler=SchedulerConfig(log_interval=0))
    with LiveServer(create_app(eng, config)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
        first, second = (c.chat.completions.create(model="tiny", messages=m, max_tokens=6, temperature=0)
                         for m in chats)
        metrics = httpx.get(s.url + "/metrics").text
        # Anthropic's stream: message_start's usage splits the prompt as the final usage does
        body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "stream": True, "system": system["content"],
                "messages": [{"role": "user", "content": "tides!"}]}
        with httpx.stream("POST", s.url + "/v1/messages", json=body, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    start, end = events[0]["message"]["usage"], events[-2]["usage"]
    assert events[0]["type"] == "message_start" and events[-2]["type"] == "message_delta"
    assert start["cache_read_input_tokens"] == end["cache_read_input_tokens"] == shared // WINDOW * WINDOW
    assert start["input_tokens"] == end["input_tokens"] > 0
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # (always there, as OpenAI sends it)
    assert second.usage.prompt_tokens_details.cached_tokens == shared // WINDOW * WINDOW
    assert second.choices[0].message.content == alone(prompts[1], SamplingParams(max_tokens=6), chunk=WINDOW).text
    assert f'tokenleap:prefix_cache_hits_total{{model_name="tiny"}} {float(shared // WINDOW * WINDOW)}' in metrics
    assert "tokenleap:prefix_cache_queries_total" in metrics


needs_kernel = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                  reason="the kernels need AVX2 + FMA")


def _int4_engine(kind, prefix_caching: bool = True, blocks: int = 64):
    """An engine over a tiny int4 model whose layers all run fused: prompt windows are row-exact
    at no cost, so the prefix cache shares single blocks, replies included."""
    from tokenleap.models.quant import quantize_
    from tokenleap.spec.engine import Engine
    from tokenleap.spec.controller import ControllerConfig
    from tokenleap.spec.proposers.ngram import NgramProposer
    from conftest import tiny_model
    from serving_helpers import ChatToyTokenizer

    from tokenleap.spec.proposers.draft_model import DraftModelProposer

    def int4_model(seed):
        m = tiny_model("qwen2", seed=seed, hidden=64, intermediate=256, layers=2)
        quantize_(m, "int4")
        return m

    def paged(m):
        return PagedKVCache(m.config, blocks, 128, torch.float32, block_size=BLOCK, num_slots=4,
                            prefix_caching=prefix_caching)

    target = int4_model(5)
    proposer = NgramProposer(3, 1) if kind == "ngram" else None
    if kind == "draft":  # the draft caches its blocks the same way (its entries steer proposals only)
        draft = int4_model(77)
        proposer = DraftModelProposer(draft, 96, 128, cache=paged(draft), catch_up_chunk=WINDOW)
    return Engine(target, ChatToyTokenizer(96), max_len=128, prefill_chunk=WINDOW, cache=paged(target),
                  proposer=proposer, controller=ControllerConfig(max_k=4, fixed_k=2 if kind == "draft" else None))


@needs_kernel
@pytest.mark.parametrize("kind", [None, "ngram", "draft"])
def test_row_exact_prefill_shares_blocks_of_prompts_and_replies(kind):
    """With an int4 model on the fused layers every position's keys and values are what any split of
    the prompt (or decoding) writes: a follow-up turn takes the whole conversation so far, block by
    block -- the previous prompt and reply, not only whole prefill windows -- and the entries it takes
    are bitwise those a cache without prefix caching computes; outputs equal."""
    from tokenleap.models.backend import exact_prefill_is_free

    eng, ref = _int4_engine(kind), _int4_engine(kind, prefix_caching=False)
    assert exact_prefill_is_free(eng.model, eng.cache)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    turn1 = list(range(10, 51))  # 41 tokens: 2 whole prefill windows and 9 tokens more
    *_, (seq1, _) = eng.generate(turn1, params)
    turn2 = turn1 + seq1.generated + [7, 8, 9]  # 64 tokens; 41 + 20 - 1 = 60 positions were computed
    seq2 = eng.add(turn2, params)
    assert seq2.cached_tokens == 60 // BLOCK * BLOCK  # 56: within turn 1's reply, past its windows
    if kind == "draft":  # the draft took as much of its own cache: the prompt and the reply it drafted for
        assert eng.proposer.cache.prefix_hits == 56
    fresh = ref.add(turn2, params)
    assert fresh.cached_tokens == 0
    n = len(turn2) - 1
    for layer in range(eng.model.config.num_hidden_layers):
        for mine, theirs in zip(eng.cache.read(layer, seq2.slot, n), ref.cache.read(layer, fresh.slot, n)):
            assert torch.equal(mine, theirs), layer
    while not seq2.finished:
        eng.step([seq2])
    while not fresh.finished:
        ref.step([fresh])
    assert seq2.generated == fresh.generated
    eng.release(seq2)
    ref.release(fresh)
    # a shared system prompt: a later request takes every whole block of it, past the prefill windows
    third = eng.add(turn1 + [90, 91], params)
    assert third.cached_tokens == 40  # blocks 0-4 (whole prefill windows alone: 32)


@needs_kernel
def test_row_exact_preempted_sequences_resume_from_their_blocks():
    """A preempted sequence's whole blocks, reply included, stay cached: resumed while they are, it
    takes them back instead of recomputing them; under a small pool (blocks evicted meanwhile) it
    recomputes. Either way the output equals the prompt alone."""
    eng, ref = _int4_engine("ngram"), _int4_engine("ngram", prefix_caching=False)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = list(range(20, 50))
    seq = eng.add(prompt, params)
    for _ in range(12):
        eng.step([seq])
    eng.detach(seq)  # as the scheduler preempts
    eng.attach(seq)
    held = eng.cache.lengths[seq.slot]
    assert held == (len(seq.tokens) - 1) // BLOCK * BLOCK > len(prompt)
    assert seq.cached_tokens == 0  # its own blocks: no earlier request's prompt was reused (vLLM's count)
    while eng.prefill_step(seq):  # the blocks not taken back
        pass
    while not seq.finished:
        eng.step([seq])
    assert seq.generated == _alone(ref, prompt, params)
    eng.release(seq)
    small = _int4_engine("ngram", blocks=17)
    sched = Scheduler(small, SchedulerConfig(max_num_seqs=4, log_interval=0))
    g = torch.Generator().manual_seed(3)
    jobs = [(torch.randint(3, 96, (int(n),), generator=g).tolist(), params) for n in (30, 26, 34, 22)]
    sinks = [submit(sched, p, params) for p, params in jobs]
    sched.run_until_idle()
    assert sched.stats.preemptions > 0
    for (p, params), sink in zip(jobs, sinks):
        assert sink.tokens == _alone(ref, p, params)


def _alone(engine, prompt, params):
    *_, (seq, _) = engine.generate(prompt, params)
    return seq.generated
