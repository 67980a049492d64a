"""The tests ``tokenleap verify`` rests on: the randomized PIT is exactly uniform for tokens drawn
from the stated distributions, and Kolmogorov-Smirnov tells a 10% temperature bias from them."""
from __future__ import annotations

import pytest
import torch

from tokenleap.config import ConfigError
from tokenleap.spec.sampling import logits_to_probs
from tokenleap.spec.stat_tests import ks_uniform, pit_values


def _draws(probs: torch.Tensor, seed: int) -> torch.Tensor:  # probs: [n, vocab] -> [n]
    return torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)).squeeze(1)


def _logits(n: int, vocab: int, seed: int) -> torch.Tensor:  # [n, vocab]: peaked heads, long tails
    g = torch.Generator().manual_seed(seed)
    return 2.5 * torch.randn(n, vocab, generator=g)


def test_ks_p_value_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for seed, n in [(0, 40), (1, 300), (2, 2000)]:
        u = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) ** 1.15
        mine = ks_uniform(u)
        ref = stats.kstest(u.numpy(), "uniform", method="asymp")
        assert mine.statistic == pytest.approx(ref.statistic, abs=1e-12)
        assert mine.p_value == pytest.approx(ref.pvalue, rel=0.1, abs=2e-3)


def test_pit_of_exact_draws_is_uniform():
    """Tokens drawn from p, transformed under p: KS accepts (over many independent repeats the
    p-values are themselves roughly uniform: the rejection rate at 0.05 stays near 5%)."""
    rejected = 0
    for rep in range(40):
        probs = logits_to_probs(_logits(400, 50, rep), 1.0)  # [400, 50]
        u = pit_values(_draws(probs, 1000 + rep), probs, torch.Generator().manual_seed(rep))
        assert u.min() >= 0 and u.max() < 1
        rejected += ks_uniform(u).rejects(0.05)
    assert rejected <= 6  # binomial(40, 0.05): P(> 6) < 0.01


def test_pit_detects_a_ten_percent_temperature_bias():
    logits = _logits(1500, 50, 7)
    exact = logits_to_probs(logits, 1.0)  # [1500, 50]
    biased = logits_to_probs(logits, 0.9)
    u = pit_values(_draws(biased, 3), exact, torch.Generator().manual_seed(4))
    fit = ks_uniform(u)
    assert fit.rejects(0.01) and fit.mean < 0.5  # likely tokens drawn too often: u leans towards 0
    hotter = pit_values(_draws(logits_to_probs(logits, 1.1), 5), exact, torch.Generator().manual_seed(6))
    assert ks_uniform(hotter).rejects(0.01) and ks_uniform(hotter).mean > 0.5


def test_pit_handles_point_masses_and_ties():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.25, 0.25, 0.5]])  # [2, 3]
    u = pit_values(torch.tensor([1, 0]), probs, torch.Generator().manual_seed(0))
    assert 0 <= u[0] < 1  # a sure token spreads over the whole interval
    assert 0.5 <= u[1] < 0.75  # order: 2 (0.5), then 0 and 1 tied, 0 first by id


def test_loglik_score_is_calibrated_and_sees_sharpening():
    from tokenleap.spec.stat_tests import fit_test, loglik_score
    zs = []
    for rep in range(40):
        probs = logits_to_probs(_logits(300, 50, 100 + rep), 1.0)  # [300, 50]
        zs.append(loglik_score(_draws(probs, 2000 + rep), probs).z)
    z = torch.tensor(zs)
    assert abs(float(z.mean())) < 0.6 and 0.6 < float(z.std()) < 1.5  # standard normal under the null
    logits = _logits(300, 50, 9)
    exact = logits_to_probs(logits, 1.0)
    sharp = loglik_score(_draws(logits_to_probs(logits, 0.9), 11), exact)
    assert sharp.z > 0 and sharp.rejects(0.01)  # 300 draws suffice where KS needs far more
    flat = loglik_score(_draws(logits_to_probs(logits, 1.1), 12), exact)
    assert flat.z < 0 and flat.rejects(0.01)
    wide = _logits(1000, 50, 10)  # [1000, 50]
    both = fit_test(_draws(logits_to_probs(wide, 0.9), 13), logits_to_probs(wide, 1.0), torch.Generator().manual_seed(1))
    assert both.p_value == pytest.approx(min(1.0, 2 * min(both.ks.p_value, both.score.p_value)))
    assert both.rejects(0.01)


def test_loglik_score_rejects_an_impossible_token():
    from tokenleap.spec.stat_tests import loglik_score
    probs = torch.tensor([[0.5, 0.5, 0.0]])
    assert loglik_score(torch.tensor([2]), probs).p_value == 0.0


def test_tokens_sharing_rows_give_what_a_row_per_token_gives():
    """The fit test handed each distinct row once (``row_of``: the row each token reads), worked on a few
    rows at a time, gives bitwise the transforms and score of a row per token -- over several chunks."""
    from tokenleap.spec.stat_tests import _CHUNK, fit_test, loglik_score
    gen = torch.Generator().manual_seed(1)  # (a draw where the lone row's sums come out otherwise: seeds 1, 2)
    # (a row as long as SmolLM2's vocabulary: torch splits a lone row's sum among threads)
    rows = torch.softmax(torch.randn(2 * _CHUNK + 1, 49152, generator=gen) * 3, -1)  # [17, 49152]
    row_of = torch.randint(0, rows.shape[0], (200,), generator=gen)
    tokens = torch.multinomial(rows[row_of], 1, generator=gen).flatten()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # (the suite's one thread never splits a sum)
    try:
        each = pit_values(tokens, rows[row_of], torch.Generator().manual_seed(1))
        assert torch.equal(pit_values(tokens, rows, torch.Generator().manual_seed(1), row_of), each)
        assert loglik_score(tokens, rows, row_of) == loglik_score(tokens, rows[row_of])
        assert (fit_test(tokens, rows, torch.Generator().manual_seed(2), row_of)
                == fit_test(tokens, rows[row_of], torch.Generator().manual_seed(2)))
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ConfigError, match="every token needs its distribution row"):
        pit_values(tokens, rows, gen, row_of[:-1])
    with pytest.raises(ConfigError, match="every token needs its distribution row"):
        loglik_score(tokens, rows[:-1], row_of.clamp_min(rows.shape[0] - 1))
