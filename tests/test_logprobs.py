"""Logprobs of generated and prompt tokens: they equal the model's own log-softmax, and speculation
reports bitwise the same figures as plain decoding (the rows of a verification forward are those
of one-token steps)."""
from __future__ import annotations

import pytest
import torch

from tokenleap.cache.contiguous import KVCache
from tokenleap.config import ConfigError, SamplingParams
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.spec.logprobs import token_logprobs
from tokenleap.models.transformer import Segment
from tokenleap.spec.proposers.draft_model import DraftModelProposer
from tokenleap.spec.proposers.ngram import NgramProposer

from conftest import ToyTokenizer, tiny_model

VOCAB = 96
PROMPT = [5, 9, 14, 3, 7, 9, 14, 3, 21, 22]


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2", seed=1, vocab=VOCAB, hidden=64, intermediate=128, layers=2)


def run(target, params, proposer=None, k=None, chunk=256, prompt=PROMPT):
    eng = Engine(target, ToyTokenizer(VOCAB), max_len=128, proposer=proposer, prefill_chunk=chunk,
                 controller=ControllerConfig(max_k=6, fixed_k=k))
    *_, (seq, _) = eng.generate(prompt, params)
    return seq


def reference_log_softmax(target, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    """One forward over the whole text, no speculation, no cache reuse."""
    cache = KVCache(target.config, 1, 128, torch.float32)
    logits = target(torch.tensor(ids), [Segment(cache.allocate(), 0, len(ids))], cache).logits
    return torch.log_softmax(logits.double(), dim=-1)


def test_token_logprobs_against_log_softmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    out = token_logprobs(logits, [4, 0, 49], 5)
    ref = torch.log_softmax(logits, dim=-1)
    for i, (tok, lp) in enumerate(zip([4, 0, 49], out)):
        assert lp.token_id == tok and lp.logprob == pytest.approx(float(ref[i, tok]), abs=1e-6)
        assert [t for t, _ in lp.top] == ref[i].topk(5).indices.tolist()
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.rank == 1 + int((ref[i] > ref[i, tok]).sum())  # vLLM's rank: 1 for the likeliest
    assert all(lp.top == () for lp in token_logprobs(logits, [1, 2, 3], 0))


def test_generated_logprobs_are_the_models(target):
    seq = run(target, SamplingParams(max_tokens=20, ignore_eos=True, logprobs=3))
    assert [lp.token_id for lp in seq.logprobs] == seq.generated
    ref = reference_log_softmax(target, seq.tokens[:-1])[len(PROMPT) - 1:]  # row j scores generated[j]
    for j, lp in enumerate(seq.logprobs):
        assert lp.logprob == pytest.approx(float(ref[j, lp.token_id]), abs=1e-4)
        assert lp.top[0] == (lp.token_id, lp.logprob)  # greedy picks the most likely token
        assert len(lp.top) == 3


def test_sampled_tokens_get_their_raw_logprob(target):
    seq = run(target, SamplingParams(max_tokens=15, temperature=1.5, top_k=5, seed=3, ignore_eos=True, logprobs=0))
    ref = reference_log_softmax(target, seq.tokens[:-1])[len(PROMPT) - 1:]
    assert [lp.token_id for lp in seq.logprobs] == seq.generated
    for j, lp in enumerate(seq.logprobs):  # before temperature and top-k, as vLLM reports by default
        assert lp.logprob == pytest.approx(float(ref[j, lp.token_id]), abs=1e-4) and lp.top == ()


@pytest.mark.parametrize("k", [2, 5, None])
def test_speculative_logprobs_equal_plain_bitwise(target, k):
    params = SamplingParams(max_tokens=30, ignore_eos=True, logprobs=4)
    want = run(target, params).logprobs
    for proposer in (DraftModelProposer(target, VOCAB, 128), NgramProposer(3, 1),
                     DraftModelProposer(tiny_model("qwen2", seed=77, vocab=VOCAB), VOCAB, 128)):
        seq = run(target, params, proposer, k)
        assert seq.logprobs == want, type(proposer).__name__


def test_stop_inside_a_draft_keeps_logprobs_aligned(target):
    plain = run(target, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1))
    seq = run(target, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1),
              DraftModelProposer(target, VOCAB, 128), 5)  # everything accepted: max_tokens lands in a draft
    assert len(seq.logprobs) == seq.num_generated == 12 and seq.logprobs == plain.logprobs


@pytest.mark.parametrize("chunk", [3, 256])
def test_prompt_logprobs(target, chunk):
    params = SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    seq = run(target, params, chunk=chunk)
    assert len(seq.prompt_logprobs) == len(PROMPT) and seq.prompt_logprobs[0] is None
    ref = reference_log_softmax(target, PROMPT)
    for p in range(1, len(PROMPT)):
        lp = seq.prompt_logprobs[p]
        assert lp.token_id == PROMPT[p] and len(lp.top) == 2
        assert lp.logprob == pytest.approx(float(ref[p - 1, PROMPT[p]]), abs=1e-4)
    # asking for them changes nothing else
    assert seq.generated == run(target, SamplingParams(max_tokens=6, ignore_eos=True), chunk=chunk).generated


def test_logprob_values_are_checked():
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(ConfigError, match="logprobs"):
            SamplingParams(logprobs=bad)
    with pytest.raises(ConfigError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=99)


def test_prompt_logprobs_survive_a_preemption(target):
    """A preempted sequence recomputes its cache (prompt windows, then its tokens row-exact); its
    prompt logprobs are recorded once and its continuation and logprobs are unchanged."""
    params = SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=1, logprobs=1)
    want = run(target, params, chunk=4)
    eng = Engine(target, ToyTokenizer(VOCAB), max_len=128, prefill_chunk=4)
    seq = eng.create(PROMPT, params)
    eng.attach(seq)
    while eng.prefill_step(seq):
        pass
    for _ in range(4):
        eng.step([seq])
    eng.detach(seq)  # preempted: cache freed, tokens kept
    eng.attach(seq)
    while eng.prefill_step(seq):
        pass
    while not seq.finished:
        eng.step([seq])
    assert seq.generated == want.generated and seq.logprobs == want.logprobs
    assert seq.prompt_logprobs == want.prompt_logprobs and len(seq.prompt_logprobs) == len(PROMPT)
