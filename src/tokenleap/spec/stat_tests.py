"""The two statistical tests ``tokenleap verify`` relies on -- pure functions of counts and samples.

* ``chi2_homogeneity``: do two samples of categories (token tuples) come from one distribution?
  Needs no model, but both samples carry noise, and a tuple's many rare categories get pooled.
* ``pit_values`` + ``ks_uniform``: do sampled tokens follow *known* next-token distributions? Each token t drawn
  from p becomes u = P(ranked before t) + V * p(t), with V uniform on [0, 1) and the vocabulary
  ranked by descending p (ties by id): the randomized probability integral transform. When the
  tokens follow p, each u is exactly uniform on [0, 1), and the u's of one sample's successive
  positions are independent (each is uniform given its prefix, by the chain rule). A sampler that
  favours likely tokens (too low a temperature, accepting drafts too often) moves u towards 0,
  one that favours the tail towards 1. The u's are tested with Kolmogorov-Smirnov. Against
  exact reference probabilities the only noise is the one sample's, and every position of every
  sample counts, so this test sees a small bias with far fewer samples than the homogeneity test.
* ``loglik_score``: the summed log-probability of the sampled tokens under the same exact
  distributions, against its exact mean (minus the entropies) and variance: a sampler that
  sharpens or flattens the distribution (a temperature bias, drafts accepted too often) moves it
  by about (1 / T' - 1) * sum Var(log p), the direction KS sees least. By the martingale central
  limit theorem the standardized sum is normal under the null hypothesis.
* ``fit_test`` combines the two (Bonferroni: twice the smaller p-value).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tokenleap.config import ConfigError


@dataclass(frozen=True)
class Homogeneity:
    """A chi-square test that two samples come from one distribution."""

    statistic: float
    dof: int
    p_value: float
    categories: int  # after merging rare ones

    def rejects(self, alpha: float) -> bool:
        return self.p_value < alpha


def chi2_homogeneity(a: dict[Any, int], b: dict[Any, int], min_expected: float = 5.0) -> Homogeneity:
    """Pearson's chi-square test of homogeneity on the 2 x C table of two samples' category counts.

    Categories whose expected count in either sample is below ``min_expected`` are pooled into one
    (and that pool into the rarest kept category if it is still too small), so the chi-square
    approximation holds. The p-value is the regularized upper incomplete gamma Q(dof/2, stat/2)."""
    na, nb = sum(a.values()), sum(b.values())
    if na == 0 or nb == 0:
        raise ConfigError("the homogeneity test needs two non-empty samples")
    keys = sorted(set(a) | set(b), key=lambda k: (-(a.get(k, 0) + b.get(k, 0)), repr(k)))
    total = torch.tensor([[a.get(k, 0) for k in keys], [b.get(k, 0) for k in keys]], dtype=torch.float64)  # [2, C]
    need = min_expected * (na + nb) / min(na, nb)  # a column total that gives every cell that expectation
    kept = total[:, total.sum(0) >= need]  # [2, C'] (sorted: the frequent columns)
    pool = total[:, total.sum(0) < need].sum(1, keepdim=True)  # [2, 1]
    if pool.sum() > 0:
        if pool.sum() >= need or kept.shape[1] == 0:
            kept = torch.cat([kept, pool], 1)
        else:
            kept[:, -1:] += pool
    c = kept.shape[1]
    if c < 2:  # every sample in one category: nothing tells the two apart
        return Homogeneity(0.0, 0, 1.0, c)
    rows, cols = kept.sum(1, keepdim=True), kept.sum(0, keepdim=True)  # [2, 1], [1, C']
    expected = rows * cols / kept.sum()  # [2, C']
    stat = float(((kept - expected) ** 2 / expected).sum())
    dof = c - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return Homogeneity(stat, dof, p, c)


@dataclass(frozen=True)
class Uniformity:
    """A Kolmogorov-Smirnov test that values are uniform on [0, 1)."""

    statistic: float  # D = sup |F_n(u) - u|
    n: int
    mean: float  # 0.5 when uniform; below: likely tokens drawn too often
    p_value: float

    def rejects(self, alpha: float) -> bool:
        return self.p_value < alpha


def ks_uniform(u: torch.Tensor) -> Uniformity:  # u: [n] values in [0, 1)
    """One-sample Kolmogorov-Smirnov test against U(0, 1); the p-value from the Kolmogorov
    distribution with Stephens' small-sample correction (accurate to a few percent from n = 5)."""
    n = u.numel()
    if n == 0:
        raise ConfigError("the uniformity test needs at least one value")
    x = torch.sort(u.double().flatten()).values  # [n]
    i = torch.arange(1, n + 1, dtype=torch.float64)  # [n]
    d = float(torch.maximum(i / n - x, x - (i - 1) / n).max())
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    if lam < 0.2:
        p = 1.0
    else:
        p = 2.0 * sum((-1) ** (k - 1) * math.exp(-2.0 * k * k * lam * lam) for k in range(1, 101))
        p = min(1.0, max(0.0, p))
    return Uniformity(d, n, float(x.mean()), p)


_CHUNK = 8  # distribution rows worked on at once: a row of a 150k vocabulary is 1.2 MB in float64, and
# the transform keeps about six such arrays a row (all 600 tokens of a certificate at once took 4 GB)


def _rows_of(tokens: torch.Tensor, probs: torch.Tensor, row_of: torch.Tensor | None):
    """Each token's row of ``probs`` (``row_of`` # [n] long; default: token i's is row i), checked, and
    the chunks of rows to work on with the tokens that read each: (rows # [c, vocab] float64, tokens'
    indices # [m], their rows within the chunk # [m])."""
    row_of = torch.arange(tokens.numel()) if row_of is None else row_of.long()
    if row_of.numel() != tokens.numel() or (row_of.numel() and not 0 <= int(row_of.min()) <= int(row_of.max())
                                             < probs.shape[0]):
        raise ConfigError("every token needs its distribution row")
    for start in range(0, probs.shape[0], _CHUNK):
        p = probs[start:start + _CHUNK].double()  # [c, vocab]
        index = ((row_of >= start) & (row_of < start + p.shape[0])).nonzero().flatten()  # [m]
        if p.shape[0] == 1:  # torch splits a lone long row's sum among threads (another order of the terms
            p = p.repeat(2, 1)  # than a row of a block): a copy beside it keeps every row's sums alike
        yield p, index, row_of[index] - start


@dataclass(frozen=True)
class TokenFigures:
    """What the two tests read of each drawn token's distribution, [n] float64 each: the mass ranked
    ahead of the token (descending probability, ties by id), its own probability, and the row's
    mean and variance of log p. A distribution row is reduced to these once, then dropped: the
    certificate's rows (600 KB each at a 150k vocabulary) need not all be kept."""

    lo: torch.Tensor
    mass: torch.Tensor
    mean: torch.Tensor
    var: torch.Tensor


def token_figures(tokens: torch.Tensor, probs: torch.Tensor, row_of: torch.Tensor | None = None) -> TokenFigures:
    """``tokens`` # [n] long against the rows of ``probs`` # [rows, vocab] (token i's row ``row_of[i]``,
    default row i; tokens that share a row have it ranked once), in one pass over the rows."""
    n = tokens.numel()
    lo, mass, mean, var = (torch.zeros(n, dtype=torch.float64) for _ in range(4))  # [n] each
    for p, index, local in _rows_of(tokens, probs, row_of):
        sorted_p, order = torch.sort(p, dim=-1, descending=True, stable=True)  # [c, vocab] each: ties by id
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(p.shape[1]).expand_as(order))  # [c, vocab]:
        # each token's place in that order (the inverse permutation)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # [c, vocab]: mass ranked ahead of each place
        t = tokens[index]  # [m]
        lo[index] = before[local, rank[local, t]]
        mass[index] = p[local, t]
        logp = torch.where(p > 0, p.log(), torch.zeros_like(p))  # [c, vocab]; 0 log 0 = 0
        row_mean = (p * logp).sum(-1)  # [c]: E log p = minus the entropy
        mean[index] = row_mean[local]
        var[index] = ((p * logp * logp).sum(-1) - row_mean * row_mean)[local]
    return TokenFigures(lo, mass, mean, var)


def pit_from(figures: TokenFigures, generator: torch.Generator) -> torch.Tensor:
    """The randomized probability integral transforms u # [n] float64 of tokens given their figures."""
    v = torch.rand(figures.lo.numel(), generator=generator, dtype=torch.float64)  # [n]
    return (figures.lo + v * figures.mass).clamp(0.0, 1.0 - 1e-12)


def pit_values(tokens: torch.Tensor, probs: torch.Tensor, generator: torch.Generator,
               row_of: torch.Tensor | None = None) -> torch.Tensor:
    """Randomized probability integral transforms of drawn ``tokens`` # [n] long under the
    distributions they were meant to follow: the rows of ``probs`` # [rows, vocab], token i's row
    ``row_of[i]`` (default: row i); returns u # [n] float64."""
    return pit_from(token_figures(tokens, probs, row_of), generator)


@dataclass(frozen=True)
class LikelihoodScore:
    """The standardized log-likelihood of sampled tokens under the distributions they should follow."""

    z: float  # > 0: likelier tokens than the distributions give (too sharp); < 0: too flat
    n: int
    p_value: float  # two-sided

    def rejects(self, alpha: float) -> bool:
        return self.p_value < alpha


def score_from(figures: TokenFigures) -> LikelihoodScore:
    """The likelihood score of tokens given their figures."""
    n = figures.mass.numel()
    if bool((figures.mass <= 0).any()):  # a token the distribution cannot produce
        return LikelihoodScore(float("-inf"), n, 0.0)
    sd = float(figures.var.clamp_min(0).sum().sqrt())
    if sd == 0:  # every row a point mass, every draw on it
        return LikelihoodScore(0.0, n, 1.0)
    z = float((figures.mass.log() - figures.mean).sum()) / sd
    return LikelihoodScore(z, n, math.erfc(abs(z) / math.sqrt(2)))


def loglik_score(tokens: torch.Tensor, probs: torch.Tensor, row_of: torch.Tensor | None = None) -> LikelihoodScore:
    """``tokens`` # [n] long drawn (supposedly) from the rows of ``probs`` # [rows, vocab] (token i's row
    ``row_of[i]``, default row i)."""
    return score_from(token_figures(tokens, probs, row_of))


@dataclass(frozen=True)
class Fit:
    """Both tests of sampled tokens against their exact distributions, and the combined verdict."""

    ks: Uniformity
    score: LikelihoodScore

    @property
    def p_value(self) -> float:  # Bonferroni over the two tests
        return min(1.0, 2 * min(self.ks.p_value, self.score.p_value))

    def rejects(self, alpha: float) -> bool:
        return self.p_value < alpha


def fit_test(tokens: torch.Tensor, probs: torch.Tensor, generator: torch.Generator,
             row_of: torch.Tensor | None = None) -> Fit:
    """``tokens`` # [n] against the rows of ``probs`` # [rows, vocab] (token i's row ``row_of[i]``,
    default row i): KS on the randomized PIT and the likelihood score."""
    return fit_figures(token_figures(tokens, probs, row_of), generator)


def fit_figures(figures: TokenFigures, generator: torch.Generator) -> Fit:
    """``fit_test`` of tokens given their figures (``token_figures``)."""
    return Fit(ks_uniform(pit_from(figures, generator)), score_from(figures))


__all__ = ["Fit", "Homogeneity", "LikelihoodScore", "TokenFigures", "Uniformity", "chi2_homogeneity", "fit_figures",
           "fit_test", "ks_uniform", "loglik_score", "pit_from", "pit_values", "score_from", "token_figures"]
