"""Speculative sampling through the whole engine has exactly the target's distribution.

A tiny 3-token vocabulary makes the exact distribution of 4-token continuations computable by
enumeration (81 sequences). Samples from the engine with a deliberately different draft model
must fit it by a chi-square test; the same test at the same seed and sample size rejects a
verifier with a classic bug (resampling from p instead of norm(max(0, p - q)) on rejection).
Both ways of sampling are tested: rejection sampling (unseeded requests) and drafter-invariant
Gumbel-max sampling with noise keyed by position (seeded requests), whose check rejects noise
shared across positions.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

import tokenleap.spec.engine as engine_mod
import tokenleap.spec.step_verify as step_verify
from tokenleap.cache.contiguous import KVCache
from tokenleap.config import SamplingParams
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.models.build import build_transformer
from tokenleap.models.transformer import Segment
from tokenleap.spec.proposers.draft_model import DraftModelProposer
from tokenleap.spec.sampling import logits_to_probs, make_generator, sample
from tokenleap.spec.seeded import SeededNoise
from tokenleap.spec.verify import Verification

from conftest import ToyTokenizer, random_weights, tiny_config

V, N_NEW, N_SAMPLES = 3, 4, 1500
PROMPT = [0, 1, 2, 1]
PARAMS = dict(temperature=0.9, top_k=0, top_p=1.0)


def model(seed: int, scale: float, vocab: int = V):
    cfg = tiny_config("llama", vocab=vocab, hidden=32, intermediate=64, heads=2, kv_heads=1)
    return build_transformer(cfg, random_weights(cfg, seed, scale=scale), torch.float32)


@pytest.fixture(scope="module")
def pair():
    return model(11, 1.0), model(12, 2.0)  # a draft far from the target: many rejections


def penalized(logits: torch.Tensor, cont: tuple[int, ...], penalties: dict) -> torch.Tensor:
    """Row j after the continuation's first j tokens, penalized token by token (OpenAI's formulas)."""
    out = logits.clone()
    for j in range(out.shape[0]):
        for t in range(V):
            c = cont[:j].count(t)
            out[j, t] -= penalties.get("frequency_penalty", 0) * c + penalties.get("presence_penalty", 0) * (c > 0)
    return out


def exact_distribution(target, penalties: dict | None = None) -> dict[tuple[int, ...], float]:
    out = {}
    for cont in itertools.product(range(V), repeat=N_NEW):
        ids = PROMPT + list(cont)
        cache = KVCache(target.config, 1, 32, torch.float32)
        logits = target(torch.tensor(ids), [Segment(cache.allocate(), 0, len(ids))], cache).logits
        logits = penalized(logits[len(PROMPT) - 1: -1], cont, penalties or {})
        probs = logits_to_probs(logits, **PARAMS)  # [N_NEW, V]
        out[cont] = float(torch.prod(probs[torch.arange(N_NEW), torch.tensor(cont)]))
    return out


def sample_counts(target, draft, seed: int, monkeypatch, penalties: dict | None = None,
                  seeded: bool = False, controller: ControllerConfig | None = None) -> dict[tuple[int, ...], int]:
    """Counts of N_SAMPLES continuations, each its own request. Unseeded requests (rejection
    sampling) get generators seeded from this test's stream; seeded ones (noise keyed by position)
    get seeds from it. ``controller``: the engine's (default: chains of 3)."""
    proposer = DraftModelProposer(draft, V, 32, fit_vocab=draft.config.vocab_size != V)
    eng = Engine(target, ToyTokenizer(V, eos=()), max_len=32, proposer=proposer,
                 controller=controller or ControllerConfig(max_k=3, fixed_k=3))
    gen = torch.Generator().manual_seed(seed)

    def next_seed() -> int:
        return int(torch.randint(0, 2**31, (1,), generator=gen))

    if not seeded:
        monkeypatch.setattr(engine_mod, "request_randomness", lambda _: make_generator(next_seed()))
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(N_SAMPLES):
        params = SamplingParams(max_tokens=N_NEW, seed=next_seed() if seeded else None, ignore_eos=True,
                                **PARAMS, **(penalties or {}))
        *_, (seq, _) = eng.generate(PROMPT, params)
        key = tuple(seq.generated)
        counts[key] = counts.get(key, 0) + 1
    return counts


def p_value(counts, exact) -> float:
    keys = sorted(exact, key=exact.get, reverse=True)
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for k in keys:  # pool cells with a small expectation
        e = exact[k] * N_SAMPLES
        if e >= 5:
            obs.append(counts.get(k, 0))
            exp.append(e)
        else:
            rest_o += counts.get(k, 0)
            rest_e += e
    obs.append(rest_o)
    exp.append(rest_e)
    total = sum(exp)
    exp = [e * N_SAMPLES / total for e in exp]  # exact sums to 1 up to float rounding
    return float(chisquare(obs, exp).pvalue)


def test_engine_sampling_matches_target_distribution(pair, monkeypatch):
    target, draft = pair
    exact = exact_distribution(target)
    assert abs(sum(exact.values()) - 1) < 1e-5
    counts = sample_counts(target, draft, seed=5, monkeypatch=monkeypatch)
    assert p_value(counts, exact) > 1e-3


def test_engine_sampling_with_penalties_matches_target_distribution(pair, monkeypatch):
    """Penalties change the target distribution row by row (each row after its own drafted prefix);
    speculation must still sample exactly from it."""
    target, draft = pair
    penalties = dict(presence_penalty=0.8, frequency_penalty=0.6)
    exact = exact_distribution(target, penalties)
    assert max(abs(exact[k] - v) for k, v in exact_distribution(target).items()) > 0.02  # they act
    counts = sample_counts(target, draft, seed=6, monkeypatch=monkeypatch, penalties=penalties)
    assert p_value(counts, exact) > 1e-3


@pytest.mark.parametrize("draft_vocab", [2, 5])
def test_a_draft_of_another_vocabulary_size_samples_the_target_distribution(pair, monkeypatch, draft_vocab):
    """A draft whose embedding matrix is padded to another size than the target's (same tokenizer):
    its logits fitted to the target's ids (the missing one never drafted, the extra ones dropped),
    rejection sampling stays exact."""
    target, _ = pair
    counts = sample_counts(target, model(13, 2.0, vocab=draft_vocab), seed=7, monkeypatch=monkeypatch)
    assert p_value(counts, exact_distribution(target)) > 1e-3


def test_a_draft_whose_rows_are_nan_drafts_from_a_uniform_q_and_stays_exact(pair, monkeypatch):
    """A diverged draft (NaN logits: its head's weights broke, or activations overflowed) neither
    drafts an id past the vocabulary nor changes what is sampled: its rows count as a uniform q."""
    target, _ = pair
    broken = model(12, 2.0)
    broken.lm_head.weight.data.fill_(float("nan"))
    drafted = []
    real = DraftModelProposer.propose_many

    def propose_many(self, requests):
        out = real(self, requests)
        drafted.extend(t for d in out if d is not None for t in d.tokens)
        return out
    monkeypatch.setattr(DraftModelProposer, "propose_many", propose_many)
    counts = sample_counts(target, broken, seed=8, monkeypatch=monkeypatch)
    assert drafted and set(drafted) <= set(range(V))
    assert p_value(counts, exact_distribution(target)) > 1e-3


def biased_verifier(draft_tokens, draft_probs, target_probs, generator=None):
    """Rejection sampling with a bug: a rejected position resamples from p, not the residual."""
    k = draft_tokens.shape[0]
    u = torch.rand(k, generator=generator, dtype=torch.float64)
    for i in range(k):
        x = int(draft_tokens[i])
        if u[i] * float(draft_probs[i, x]) >= float(target_probs[i, x]):  # rejected:
            tok = int(sample(target_probs[i:i + 1], generator)[0])  # bug: from p, not the residual
            return Verification(draft_tokens[:i].tolist() + [tok], i)
    return Verification(draft_tokens.tolist() + [int(sample(target_probs[k:], generator)[0])], k)


def test_same_check_rejects_a_biased_verifier(pair, monkeypatch):
    target, draft = pair
    exact = exact_distribution(target)
    monkeypatch.setattr(step_verify, "verify_sampling", biased_verifier)
    counts = sample_counts(target, draft, seed=5, monkeypatch=monkeypatch)
    assert p_value(counts, exact) < 1e-6


def test_seeded_speculative_sampling_matches_target_distribution(pair, monkeypatch):
    """Seeded requests: drafter-invariant sampling (noise keyed by position) with a far draft."""
    target, draft = pair
    counts = sample_counts(target, draft, seed=7, monkeypatch=monkeypatch, seeded=True)
    assert p_value(counts, exact_distribution(target)) > 1e-3


def test_same_check_rejects_noise_shared_across_positions(pair, monkeypatch):
    choose = SeededNoise.choose

    def shared(self, probs, pos):  # bug: every position draws the same noise
        return torch.cat([choose(self, probs[i:i + 1], 0) for i in range(probs.shape[0])])

    target, draft = pair
    monkeypatch.setattr(SeededNoise, "choose", shared)
    counts = sample_counts(target, draft, seed=7, monkeypatch=monkeypatch, seeded=True)
    assert p_value(counts, exact_distribution(target)) < 1e-6
