"""Unseeded layer-skip speculation samples exactly the target's distribution.

A 3-token vocabulary makes the exact distribution of 4-token continuations computable by
enumeration (81 sequences). The draft is the target with two of its four layers skipped, its
drafted rows' distributions q come from the skipped-layer logits, and verification is rejection
sampling: samples must fit the exact distribution by a chi-square test. The same test, at the same
seed and sample size, rejects a proposer that reports a q other than the one it drew from.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

import tokenleap.spec.engine as engine_mod
import tokenleap.spec.proposers.layerskip as layerskip_mod
from tokenleap.cache.contiguous import KVCache
from tokenleap.config import SamplingParams
from tokenleap.models.build import build_transformer
from tokenleap.models.transformer import Segment
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.spec.proposers.draft_model import DraftModelProposer
from tokenleap.spec.proposers.layerskip import LayerSkipProposer
from tokenleap.spec.proposers.ngram import NgramProposer
from tokenleap.spec.sampling import logits_to_probs, make_generator

from conftest import ToyTokenizer, random_weights, tiny_config

V, N_NEW, N_SAMPLES = 3, 4, 1500
PROMPT = [0, 1, 2, 1]
PARAMS = dict(temperature=0.9, top_k=0, top_p=1.0)
SKIP = frozenset({1, 2})


@pytest.fixture(scope="module")
def target():
    cfg = tiny_config("llama", vocab=V, hidden=32, intermediate=64, heads=2, kv_heads=1, layers=4)
    return build_transformer(cfg, random_weights(cfg, 22, scale=0.3), torch.float32)


def exact_distribution(model) -> dict[tuple[int, ...], float]:
    out = {}
    for cont in itertools.product(range(V), repeat=N_NEW):
        ids = PROMPT + list(cont)
        cache = KVCache(model.config, 1, 32, torch.float32)
        logits = model(torch.tensor(ids), [Segment(cache.allocate(), 0, len(ids))], cache).logits
        probs = logits_to_probs(logits[len(PROMPT) - 1: -1], **PARAMS)  # [N_NEW, V]
        out[cont] = float(torch.prod(probs[torch.arange(N_NEW), torch.tensor(cont)]))
    return out


def sample_counts(model, seed: int, monkeypatch, proposer=None) -> tuple[dict[tuple[int, ...], int], float]:
    """Counts of N_SAMPLES unseeded continuations (generators seeded from this test's stream) and
    the fraction of drafted tokens accepted."""
    eng = Engine(model, ToyTokenizer(V, eos=()), max_len=32, proposer=proposer or LayerSkipProposer(model, SKIP),
                 controller=ControllerConfig(max_k=3, fixed_k=3))
    gen = torch.Generator().manual_seed(seed)
    monkeypatch.setattr(engine_mod, "request_randomness",
                        lambda _: make_generator(int(torch.randint(0, 2**31, (1,), generator=gen))))
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(N_SAMPLES):
        *_, (seq, _) = eng.generate(PROMPT, SamplingParams(max_tokens=N_NEW, ignore_eos=True, **PARAMS))
        counts[tuple(seq.generated)] = counts.get(tuple(seq.generated), 0) + 1
    t = eng.totals
    return counts, t.accepted_tokens / max(1, t.draft_tokens)


def p_value(counts, exact) -> float:
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for key in sorted(exact, key=exact.get, reverse=True):  # pool cells with a small expectation
        e = exact[key] * N_SAMPLES
        if e >= 5:
            obs.append(counts.get(key, 0))
            exp.append(e)
        else:
            rest_o += counts.get(key, 0)
            rest_e += e
    obs.append(rest_o)
    exp.append(rest_e)
    total = sum(exp)
    return float(chisquare(obs, [e * N_SAMPLES / total for e in exp]).pvalue)


def test_layerskip_sampling_matches_target_distribution(target, monkeypatch):
    exact = exact_distribution(target)
    assert abs(sum(exact.values()) - 1) < 1e-5
    counts, acceptance = sample_counts(target, 5, monkeypatch)
    assert 0.05 < acceptance < 0.95  # the skipped-layer draft differs from the target: rejections happen
    assert p_value(counts, exact) > 1e-3


def test_same_check_rejects_a_wrong_draft_distribution(target, monkeypatch):
    """Negative control: the proposer draws from the skipped-layer q but reports q at another temperature."""
    choose = DraftModelProposer._choose

    def misreported(logits, params, generator, pos):
        token, _ = choose(logits, params, generator, pos)
        return token, logits_to_probs(logits, 3.0, 0, 1.0, 0.0)  # [1, V], not what the token came from

    monkeypatch.setattr(DraftModelProposer, "_choose", staticmethod(misreported))  # every drafting lane's choice
    counts, _ = sample_counts(target, 5, monkeypatch)
    assert p_value(counts, exact_distribution(target)) < 1e-6


def test_layerskip_with_prompt_lookup_matches_target_distribution(target, monkeypatch):
    """Copied text drafts by prompt lookup (a one-hot q), the rest by the skipped layers, in one run:
    samples still fit the exact distribution."""
    proposer = LayerSkipProposer(target, SKIP, lookup=NgramProposer(4, 2))
    copied = []
    find = proposer._copied
    monkeypatch.setattr(proposer, "_copied", lambda r: copied.append(find(r)) or copied[-1])
    counts, _ = sample_counts(target, 6, monkeypatch, proposer)
    used = sum(d is not None for d in copied)
    assert 0 < used < len(copied)  # both kinds of draft were made
    assert p_value(counts, exact_distribution(target)) > 1e-3
