"""Presence / frequency / repetition penalties: the pure function against a direct per-token loop,
and speculation with penalties stays lossless (greedy token-identical; sampling exact)."""
from __future__ import annotations

import pytest
import torch

from tokenleap.config import ConfigError, SamplingParams
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.spec.penalties import apply_penalties, bad_word_sequences
from tokenleap.spec.proposers.draft_model import DraftModelProposer
from tokenleap.spec.proposers.ngram import NgramProposer

from conftest import ToyTokenizer, tiny_model

VOCAB = 96


def naive(row: torch.Tensor, params: SamplingParams, prompt: list[int], history: list[int]) -> torch.Tensor:
    out = row.clone()
    n = params.repetition_last_n
    recent = (prompt + history)[-n:] if n else prompt + history  # what the repetition penalty sees
    for t in range(out.shape[0]):
        c = history.count(t)
        out[t] += dict(params.logit_bias).get(t, 0.0)  # the bias first (transformers' and vLLM's order)
        if params.repetition_penalty != 1 and t in recent:
            out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
        out[t] -= params.frequency_penalty * c + params.presence_penalty * (c > 0)
        if params.allowed_token_ids and t not in params.allowed_token_ids:
            out[t] = float("-inf")
        for *rest, last in params.bad_word_ids:  # barred where the history ends with the rest
            if t == last and (not rest or history[-len(rest):] == rest):
                out[t] = float("-inf")
    return out


@pytest.mark.parametrize("kw", [dict(presence_penalty=0.7), dict(frequency_penalty=-1.3),
                                dict(repetition_penalty=1.8), dict(repetition_penalty=0.6, presence_penalty=2.0,
                                                                   frequency_penalty=0.4),
                                dict(logit_bias={3: -100.0, 11: 5.5}, presence_penalty=0.3),
                                dict(logit_bias={2: 4.0, 7: -6.0, 19: 3.0}, repetition_penalty=2.0),
                                dict(repetition_penalty=1.8, repetition_last_n=3),
                                dict(repetition_penalty=0.6, repetition_last_n=6, frequency_penalty=0.4),
                                dict(allowed_token_ids=(2, 3, 17, 40), logit_bias={3: 2.0}),
                                dict(bad_word_ids=((5,), (7, 8, 9), (3, 7, 4), (1, 3, 3, 7, 2), (99, 6)))])
def test_penalties_match_a_per_token_loop(kw):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 20, generator=g) * 3  # [k+1, vocab]
    params = SamplingParams(**kw)
    prompt, generated, draft = [1, 2, 2, 19], [3, 3, 7, 1], [7, 8, 3]
    got = apply_penalties(logits, params, prompt, generated, draft)
    for i in range(4):
        want = naive(logits[i], params, prompt, generated + draft[:i])
        assert torch.allclose(got[i], want, atol=1e-6), (kw, i)
    assert torch.equal(apply_penalties(logits, SamplingParams(), prompt, generated, draft), logits)


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2", seed=1, vocab=VOCAB, hidden=64, intermediate=128, layers=2)


def run(target, params, proposer=None, k=None):
    eng = Engine(target, ToyTokenizer(VOCAB), max_len=128, proposer=proposer,
                 controller=ControllerConfig(max_k=6, fixed_k=k))
    *_, (seq, _) = eng.generate([5, 9, 14, 3, 7, 9, 14, 3], params)
    return seq


@pytest.mark.parametrize("kw", [dict(frequency_penalty=1.5), dict(repetition_penalty=1.3, presence_penalty=0.5),
                                dict(logit_bias={40: 3.0, 41: -100.0}),
                                dict(repetition_penalty=1.5, repetition_last_n=5),
                                dict(allowed_token_ids=(9, 14, 40, 41, 50, 61)),
                                dict(bad_word_ids=None)])
def test_greedy_speculation_with_penalties_equals_plain(target, kw):
    if kw == dict(bad_word_ids=None):  # bar the plain reply's own bigrams and one of its tokens
        free = run(target, SamplingParams(max_tokens=30, ignore_eos=True)).generated
        kw = dict(bad_word_ids=(tuple(free[3:5]), tuple(free[10:13]), (free[20],)))
    params = SamplingParams(max_tokens=30, ignore_eos=True, **kw)
    want = run(target, params).generated
    assert want != run(target, SamplingParams(max_tokens=30, ignore_eos=True)).generated  # the penalty acts
    assert set(want) <= set(kw.get("allowed_token_ids", range(VOCAB)))
    for word in kw.get("bad_word_ids", ()):
        assert all(tuple(want[i:i + len(word)]) != word for i in range(len(want)))
    if "repetition_last_n" in kw:  # the window acts: the same penalty over everything chooses otherwise
        whole = {**kw, "repetition_last_n": 0}
        assert want != run(target, SamplingParams(max_tokens=30, ignore_eos=True, **whole)).generated
    for k in (3, None):
        for proposer in (DraftModelProposer(target, VOCAB, 128), NgramProposer(3, 1),
                         DraftModelProposer(tiny_model("qwen2", seed=77, vocab=VOCAB), VOCAB, 128)):
            assert run(target, params, proposer, k).generated == want, (type(proposer).__name__, k)


def test_penalty_values_are_checked():
    for kw in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
               dict(presence_penalty=float("nan")), dict(logit_bias={5: 101.0}), dict(logit_bias={-1: 1.0}),
               dict(repetition_last_n=-1), dict(repetition_last_n=2.5)):
        with pytest.raises(ConfigError, match="penalty|logit_bias|repetition_last_n"):
            SamplingParams(**kw)


def test_bad_words_are_tokenized_as_written_and_after_a_space(target):
    tok = ToyTokenizer(VOCAB)
    words = bad_word_sequences(lambda text: tok.encode(text, add_special_tokens=False), ("  ab", "c"))
    assert words == tuple(dict.fromkeys(tuple(tok.encode(t, add_special_tokens=False))
                                        for t in ("ab", " ab", "c", " c")))
    free = run(target, SamplingParams(max_tokens=30, ignore_eos=True)).generated
    pair = free[6:8]
    word = "".join(chr(t + 192) for t in pair)  # the toy tokenizer reads chr(t + 192) as token t
    barred = run(target, SamplingParams(max_tokens=30, ignore_eos=True, bad_words=(word,)))
    first = next(i for i in range(len(free)) if free[i:i + 2] == pair)
    got = barred.generated
    assert got[:first + 1] == free[:first + 1] and got[first + 1] != pair[1]
    assert all(got[i:i + 2] != pair for i in range(len(got)))
    assert barred.params.bad_word_ids == (tuple(pair), (32, *pair)) and barred.params.bad_words == ()
    for bad in (dict(bad_words=("",)), dict(bad_words=(" ",)), dict(bad_word_ids=((),)),
                dict(bad_word_ids=((1, -2),)), dict(bad_word_ids=(3, 4))):
        with pytest.raises(ConfigError, match="bad_word"):
            SamplingParams(**bad)


def test_bias_and_repetition_penalty_as_transformers_processes_them():
    """transformers' SequenceBias then RepetitionPenalty processors (vLLM's order too): a seen token's
    biased logit is what the penalty scales."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor
    logits = torch.randn(1, 20, generator=torch.Generator().manual_seed(0)) * 3  # [1, vocab]
    prompt, generated, bias = [1, 2, 2, 19], [3, 3, 7, 1], {2: 4.0, 7: -6.0, 19: 3.0}
    ids = torch.tensor([prompt + generated])
    want = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(ids, logits.clone())
    want = RepetitionPenaltyLogitsProcessor(2.0)(ids, want)
    got = apply_penalties(logits, SamplingParams(logit_bias=bias, repetition_penalty=2.0), prompt, generated, [])
    assert torch.allclose(got, want, atol=1e-6)


def test_barred_sequences_by_their_index_equal_the_rule():
    """Barred sequences are indexed once (by prefix) -- a row costs a lookup per prefix length, not a
    loop over every word -- and bar exactly what the rule says: a sequence's last token in a row whose
    history ends with the rest of it; single tokens everywhere."""
    import random
    from tokenleap.spec.penalties import _bar_words
    rng = random.Random(3)
    for _ in range(200):
        vocab = 12
        words = tuple({tuple(rng.randrange(vocab + 2) for _ in range(rng.randint(1, 4))): None
                       for _ in range(rng.randint(1, 8))})
        generated = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        draft = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
        got = torch.zeros(len(draft) + 1, vocab)
        _bar_words(got, words, generated, draft)
        want = torch.zeros_like(got)
        for i in range(len(draft) + 1):
            history = generated + draft[:i]
            for *rest, last in words:
                ends_with_rest = len(history) >= len(rest) and history[len(history) - len(rest):] == rest
                if last < vocab and (not rest or ends_with_rest):
                    want[i, last] = float("-inf")
        assert torch.equal(got, want), (words, generated, draft)


def test_a_draft_past_a_token_the_allowed_set_forbids_does_not_fail_the_request(target):
    """allowed_token_ids with bad words: n-gram lookup drafts a token outside the allowed set, and the row
    after it follows a history in which the bad words bar every allowed token. Verification never reaches
    that row (the drafted token is rejected first) and plain decoding never meets it, so speculation --
    chains and trees, greedy and seeded -- decodes what plain decoding does instead of failing there."""
    prompt = [10, 11, 12] * 6 + [10, 11]  # lookup continues "10 11" with 12
    bad = ((12, 10), (12, 11), (10, 10), (11, 11))
    for extra in ({}, {"temperature": 0.8, "seed": 3}):
        params = SamplingParams(max_tokens=12, ignore_eos=True, allowed_token_ids=(10, 11), bad_word_ids=bad, **extra)

        def generated(proposer=None, tree_nodes=0):
            eng = Engine(target, ToyTokenizer(VOCAB), max_len=128, proposer=proposer, tree_nodes=tree_nodes,
                         controller=ControllerConfig(max_k=4, fixed_k=4 if proposer else None))
            *_, (seq, _) = eng.generate(prompt, params)
            return seq.generated, seq.stats.draft_tokens

        want, _ = generated()
        assert set(want) == {10, 11} and all(a != b for a, b in zip(want, want[1:]))  # (what both rules allow)
        for tree_nodes in (0, 8):
            got, drafted = generated(NgramProposer(3, 1), tree_nodes)
            assert got == want and drafted > 0, (extra, tree_nodes)
    with pytest.raises(ConfigError, match="leave no token"):  # a dead end plain decoding meets is still refused
        list(Engine(target, ToyTokenizer(VOCAB), max_len=128).generate(prompt, SamplingParams(
            max_tokens=4, allowed_token_ids=(10, 11), bad_word_ids=((10,), (11,)))))
