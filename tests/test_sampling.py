"""logits_to_probs against analytic distributions; greedy; seeded sampling."""
from __future__ import annotations

import math

import pytest
import torch

from tokenleap.config import SamplingParams
from conftest import chi2_pvalue
from tokenleap.spec.seeded import BLOCK, SeededNoise, mix, splitmix64
from tokenleap.spec.sampling import (SamplingFilters, greedy, inverse_cdf, logits_to_probs,
                                make_generator, sample)

# probabilities that are exact in binary, in a shuffled order: token 1 > token 3 > tokens 0 = 2
P4 = torch.tensor([0.125, 0.5, 0.125, 0.25])  # [4]
LOGITS4 = P4.log()[None]  # [1, 4]


def probs_of(**kw) -> list[float]:
    return logits_to_probs(LOGITS4, **kw)[0].tolist()


def test_temperature_matches_softmax():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0)) * 3  # [3, 10]
    out = logits_to_probs(logits, temperature=0.7)  # [3, 10]
    torch.testing.assert_close(out, torch.softmax(logits / 0.7, dim=-1))
    assert out.dtype == torch.float32


def test_temperature_zero_is_one_hot_at_first_max():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])  # [2, 4]
    out = logits_to_probs(logits, temperature=0.0, top_p=0.5)  # [2, 4]
    assert out.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    assert greedy(logits).tolist() == [1, 0]


def test_top_k():
    assert probs_of(top_k=2) == pytest.approx([0, 2 / 3, 0, 1 / 3])
    assert probs_of(top_k=1) == [0.0, 1.0, 0.0, 0.0]
    assert probs_of(top_k=0) == pytest.approx(P4.tolist())
    assert probs_of(top_k=99) == pytest.approx(P4.tolist())
    # a tie at the cut keeps the lower token id
    assert probs_of(top_k=3) == pytest.approx([1 / 7, 4 / 7, 0, 2 / 7])


def test_top_p_boundaries():
    # cumulative 0.5, 0.75, 0.875, 1.0 in the order 1, 3, 0, 2
    assert probs_of(top_p=0.75) == pytest.approx([0, 2 / 3, 0, 1 / 3])  # reaches 0.75 exactly
    assert probs_of(top_p=0.76) == pytest.approx([1 / 7, 4 / 7, 0, 2 / 7])  # tie: lower id
    assert probs_of(top_p=0.74) == pytest.approx([0, 2 / 3, 0, 1 / 3])
    assert probs_of(top_p=0.5) == [0.0, 1.0, 0.0, 0.0]
    assert probs_of(top_p=1e-9) == [0.0, 1.0, 0.0, 0.0]  # the top token is always kept
    assert probs_of(top_p=1.0) == pytest.approx(P4.tolist())


def test_min_p():
    assert probs_of(min_p=0.6) == [0.0, 1.0, 0.0, 0.0]  # keeps p >= 0.3
    assert probs_of(min_p=0.45) == pytest.approx([0, 2 / 3, 0, 1 / 3])  # keeps p >= 0.225
    assert probs_of(min_p=0.2) == pytest.approx(P4.tolist())  # keeps p >= 0.1
    assert probs_of(min_p=1.0) == [0.0, 1.0, 0.0, 0.0]


def test_order_temperature_then_top_k_then_top_p():  # (min-p's place: test_sampling_order.py)
    # T = 2 flattens to sqrt(P4): 0.369, 0.261, 0.185, 0.185 -> top_p 0.7 keeps three tokens
    flat = P4.sqrt() * torch.tensor([1.0, 1.0, 0.0, 1.0])  # [4]
    assert probs_of(temperature=2.0, top_p=0.7) == pytest.approx((flat / flat.sum()).tolist())
    assert probs_of(temperature=1.0, top_p=0.7) == pytest.approx([0, 2 / 3, 0, 1 / 3])
    # top-k first: 2/3, 1/3 -> top_p 0.6 keeps one token (top-p first would keep two)
    assert probs_of(top_k=2, top_p=0.6) == [0.0, 1.0, 0.0, 0.0]
    # all four: T = 2, top-k 3, top-p 0.95, min-p 0.6 (drops 0.185 < 0.6 * 0.369)
    assert probs_of(temperature=2.0, top_k=3, top_p=0.95, min_p=0.6) == pytest.approx(
        [0, math.sqrt(0.5) / (math.sqrt(0.5) + 0.5), 0, 0.5 / (math.sqrt(0.5) + 0.5)])


def test_temperature_last_filters_the_untempered_distribution():
    """llama.cpp's order: top-k / top-p / min-p judge the model's own distribution, then the
    temperature flattens what is left -- a hot min-p keeps only the tokens it keeps at T = 1."""
    assert probs_of(temperature=2.0, min_p=0.45, temperature_last=True) == pytest.approx(
        [0, math.sqrt(0.5) / (math.sqrt(0.5) + 0.5), 0, 0.5 / (math.sqrt(0.5) + 0.5)])  # 0.5, 0.25 kept, T = 2
    assert probs_of(temperature=2.0, min_p=0.45)[0] > 0  # temperature first: T = 2 lets 0.125 back in
    assert probs_of(temperature=0.5, top_p=0.7, temperature_last=True) == pytest.approx([0, 0.8, 0, 0.2])
    logits = _lm_rows(3, 3000, 7, 6.0)  # [3, 3000]
    for kw in (dict(top_k=40), dict(top_p=0.8), dict(min_p=0.1), dict(top_k=30, top_p=0.9, min_p=0.05)):
        keep = logits_to_probs(logits, temperature_last=True, **kw) > 0  # the kept set at T = 1, llama.cpp's order
        want = torch.softmax((logits / 1.7).masked_fill(~keep, float("-inf")), dim=-1)
        got = logits_to_probs(logits, temperature=1.7, temperature_last=True, **kw)
        torch.testing.assert_close(got, want)
        mixed = logits_to_probs(logits, temperature=1.7, temperature_last=torch.tensor([True, False, True]), **kw)
        assert torch.equal(mixed[0], got[0]) and torch.equal(mixed[2], got[2])  # per row
        assert torch.equal(mixed[1], logits_to_probs(logits[1:2], temperature=1.7, **kw)[0])
    assert torch.equal(logits_to_probs(logits, temperature=0.0, temperature_last=True),
                       logits_to_probs(logits, temperature=0.0))  # greedy either way


def test_rows_are_independent_and_params_per_row():
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(1)) * 4  # [6, 1000]
    params = [(1.0, 0, 1.0, 0.0), (0.7, 50, 1.0, 0.0), (1.3, 0, 0.9, 0.0),
              (1.0, 0, 1.0, 0.05), (0.0, 0, 1.0, 0.0), (0.8, 20, 0.8, 0.01)]
    t, k, p, m = (torch.tensor(col) for col in zip(*params))  # [6] each
    batch = logits_to_probs(logits.bfloat16(), t, k, p, m)  # [6, 1000]
    alone = [logits_to_probs(logits[i:i + 1].bfloat16(), *params[i]) for i in range(6)]
    for i in range(6):
        assert torch.equal(batch[i], alone[i][0]), f"row {i} depends on its batch"
    reordered = logits_to_probs(logits.flip(0).bfloat16(), t.flip(0), k.flip(0), p.flip(0), m.flip(0))
    assert torch.equal(reordered.flip(0), batch)
    assert batch.dtype == torch.float32 and not batch.isnan().any()
    torch.testing.assert_close(batch.sum(-1), torch.ones(6))


def _lm_rows(n: int, vocab: int, seed: int, spread: float) -> torch.Tensor:  # [n, vocab]
    """Noise plus a few dozen favoured tokens a row, like a language model's logits; ``spread``
    flattens (small) or sharpens (large) the favoured part."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g)
    top = torch.randint(0, vocab, (n, 40), generator=g)
    return x.scatter_(1, top, torch.linspace(spread, spread / 4, 40).expand(n, 40).contiguous())


@pytest.mark.parametrize("kw", [dict(top_p=0.9), dict(top_p=0.5, temperature=0.7), dict(top_k=50),
                                dict(top_k=1000, top_p=0.95), dict(min_p=0.05), dict(top_p=0.99, min_p=0.01),
                                dict(temperature=1.3, top_k=20, top_p=0.8, min_p=0.1),
                                dict(top_p=torch.tensor([0.9, 0.3, 1.0, 0.999]), top_k=torch.tensor([0, 5, 0, 700]))])
def test_large_vocabularies_filter_as_the_full_sort_does(kw):
    """Over a large vocabulary the filters first look at each row's highest logits only; the kept
    set must be the one a stable sort of the whole row gives -- also where a row's nucleus is wider
    than the candidates (flat rows, top_k above them, min_p alone), which go to the full sort."""
    from tokenleap.spec import sampling
    for spread, seed in ((12.0, 0), (4.0, 1), (1.0, 2)):  # peaked, moderate, nearly flat
        logits = _lm_rows(4, 20000, seed, spread)  # [4, 20000]
        out = logits_to_probs(logits, **kw)  # [4, 20000]
        n = logits.shape[0]
        t = sampling._column(kw.get("temperature", 1.0), n, torch.float32)
        x = logits / t
        k = sampling._column(kw.get("top_k", 0), n, torch.long)
        k = torch.where((k <= 0) | (k > x.shape[1]), x.shape[1], k)
        keep = sampling._keep_sorted(x, k, sampling._column(kw.get("top_p", 1.0), n, torch.float32),
                                     sampling._column(kw.get("min_p", 0.0), n, torch.float32))
        assert torch.equal(out > 0, keep)
        assert torch.equal(out, torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1))


def test_ties_at_the_candidates_edge_are_broken_by_id_as_in_the_full_sort():
    """Many equal logits around the last candidate: the full sort decides which of them come first."""
    from tokenleap.spec import sampling
    x = torch.zeros(1, 5000)
    x[0, ::7] = 1.0  # hundreds of equal logits, the candidates' edge among them
    x[0, 4000:4100] = 5.0  # 100 tokens far above the rest
    probs = logits_to_probs(x, top_p=0.999)  # [1, 5000]
    keep = sampling._keep_sorted(x, torch.tensor([[5000]]), torch.tensor([[0.999]]), torch.tensor([[0.0]]))
    assert torch.equal(probs > 0, keep)
    top = logits_to_probs(x, top_k=200)[0] > 0  # the 100 high ones, then the lowest ids among the ties
    assert top[4000:4100].all() and int(top.sum()) == 200
    assert torch.equal(top.nonzero().flatten()[:100], torch.arange(0, 700, 7))


def test_large_vocabulary_rows_do_not_depend_on_their_batch():
    """A row's probabilities are bitwise the same alone and among other rows (one decode step's
    row against a verification block's)."""
    logits = _lm_rows(6, 30000, 5, 6.0)
    for kw in (dict(top_p=0.9, temperature=0.8), dict(top_k=40), dict(min_p=0.02)):
        block = logits_to_probs(logits, **kw)
        for i in range(logits.shape[0]):
            assert torch.equal(logits_to_probs(logits[i:i + 1], **kw)[0], block[i])


def test_masked_logits_stay_zero():
    logits = torch.tensor([[float("-inf"), 1.0, 2.0, float("-inf")]])  # [1, 4]
    for kw in ({}, {"top_k": 3}, {"top_p": 0.99}, {"min_p": 0.01}):
        out = logits_to_probs(logits, **kw)[0]  # [4]
        assert out[0] == 0 and out[3] == 0 and not out.isnan().any()


def test_filters_from_params():
    reqs = [SamplingParams(temperature=0.8, top_k=5), SamplingParams(),  # the default is greedy
            SamplingParams(temperature=1.0, top_p=0.5, temperature_last=True)]
    filters = SamplingFilters.from_params(reqs, rows=[2, 1, 3])
    assert filters.top_k.tolist() == [5, 5, 0, 0, 0, 0]
    assert filters.temperature_last.tolist() == [False] * 3 + [True] * 3
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(2))  # [6, 30]
    out = filters.probs(logits)  # [6, 30]
    assert torch.equal(out[0], logits_to_probs(logits[:1], 0.8, 5)[0])
    assert out[2].tolist() == torch.nn.functional.one_hot(logits[2].argmax(), 30).float().tolist()
    assert torch.equal(out[5], logits_to_probs(logits[5:], 1.0, 0, 0.5)[0])


def test_sample_is_seeded_and_per_row():
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(3)), -1)  # [4, 50]
    a = sample(probs, make_generator(7))
    b = sample(probs, make_generator(7))
    assert torch.equal(a, b)
    gens = [make_generator(s) for s in (10, 11, 12, 13)]
    batch = sample(probs, gens)  # [4]
    alone = [sample(probs[i:i + 1], make_generator(10 + i))[0] for i in range(4)]
    assert batch.tolist() == [int(x) for x in alone]


def test_sample_never_picks_zero_probability():
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0],
                          [1e-30, 0.0, 0.0, 0.0, 0.0]]).repeat(2000, 1)  # [6000, 5]
    tokens = sample(probs, make_generator(0))  # [6000]
    assert (probs.gather(1, tokens[:, None]) > 0).all()
    # rounding edges: u = 0 with leading zeros, u just below 1 with trailing zeros
    weights = torch.tensor([[0.0, 0.0, 0.5, 0.5, 0.0, 0.0]] * 2)  # [2, 6]
    u = torch.tensor([[0.0], [1.0 - 2.0 ** -53]], dtype=torch.float64)  # [2, 1]
    assert inverse_cdf(weights, u).tolist() == [2, 3]


def test_sample_distribution():
    p = torch.tensor([0.05, 0.0, 0.4, 0.25, 0.3, 0.0])  # [6]
    tokens = sample(p.repeat(20000, 1), make_generator(123))  # [20000]
    counts = torch.bincount(tokens, minlength=6)  # [6]
    assert chi2_pvalue(counts, p) > 1e-3
    assert chi2_pvalue(counts, torch.tensor([0.1, 0.0, 0.35, 0.25, 0.3, 0.0])) < 1e-6  # has teeth


def test_splitmix64_matches_the_reference_generator():
    # the reference splitmix64 seeded with 0 outputs these first (Vigna's splitmix64.c)
    assert [mix(0), mix(0x9E3779B97F4A7C15)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]
    state = torch.tensor([0, 0x9E3779B97F4A7C15 - 2**64])  # the same bit patterns in int64
    assert [x & (2**64 - 1) for x in splitmix64(state).tolist()] == [mix(0), mix(0x9E3779B97F4A7C15)]


def brute_force(noise: SeededNoise, probs: torch.Tensor, pos: int) -> list[int]:
    """argmin_x E(t, x) / p(x) with E computed for every token (``probs # [n, vocab]``)."""
    n, vocab = probs.shape
    out = []
    for i in range(n):
        m, j = noise.block_minima(pos + i, vocab)  # [blocks] each
        e = noise.exponentials(pos + i, torch.arange(m.numel()), m, j).flatten()[:vocab]  # [vocab]
        p = probs[i].double()
        out.append(int(torch.argmin(torch.where(p > 0, e / p, float("inf")))))
    return out


@pytest.mark.parametrize("vocab", [5, 256, 700, 2000])
def test_seeded_race_skips_blocks_but_picks_what_brute_force_picks(vocab):
    gen = torch.Generator().manual_seed(vocab)
    for trial in range(20):
        scale = [0.5, 2.0, 6.0, 12.0][trial % 4]  # flat to peaked
        logits = torch.randn(4, vocab, generator=gen) * scale  # [4, vocab]
        probs = logits_to_probs(logits, 1.0, 0, 0.9 if trial % 3 == 0 else 1.0)
        noise = SeededNoise(trial * 7919 - 3)
        assert noise.choose(probs, trial).tolist() == brute_force(noise, probs, trial)


def test_block_exponentials_are_exp1():
    noise = SeededNoise(12)
    m, j = noise.block_minima(3, 300 * BLOCK)  # [300]
    e = noise.exponentials(3, torch.arange(300), m, j)  # [300, BLOCK] independent Exp(1)
    assert torch.equal(e.amin(dim=-1), m) and torch.equal(e.argmin(dim=-1), j)
    cells = torch.bucketize(e.flatten(), torch.tensor([0.25, 0.5, 1.0, 2.0, 3.0], dtype=torch.float64))
    edges = torch.tensor([0.0, 0.25, 0.5, 1.0, 2.0, 3.0, float("inf")], dtype=torch.float64)
    expected = torch.exp(-edges[:-1]) - torch.exp(-edges[1:])  # [6] Exp(1) mass per cell
    assert chi2_pvalue(torch.bincount(cells, minlength=6), expected) > 1e-3


def test_seeded_noise_samples_exactly_over_seeds_and_over_positions():
    p = torch.tensor([[0.05, 0.0, 0.4, 0.25, 0.3, 0.0]])  # [1, 6]
    by_seed = torch.cat([SeededNoise(s).choose(p, 17) for s in range(5000)])  # [5000]
    by_pos = SeededNoise(5).choose(p.expand(5000, 6), 0)  # [5000], rows at positions 0 .. 4999
    for tokens in (by_seed, by_pos):
        counts = torch.bincount(tokens, minlength=6)  # [6]
        assert chi2_pvalue(counts, p[0]) > 1e-3
        assert chi2_pvalue(counts, torch.tensor([0.1, 0.0, 0.35, 0.25, 0.3, 0.0])) < 1e-6  # has teeth


def test_seeded_noise_depends_on_seed_position_and_token_only():
    probs = torch.softmax(torch.randn(5, 600, generator=torch.Generator().manual_seed(2)) * 0.3, -1)  # [5, 600]
    noise = SeededNoise(-3)  # any 64-bit seed
    rows = noise.choose(probs, 100)  # [5]
    assert rows.tolist() == [int(noise.choose(probs[i:i + 1], 100 + i)[0]) for i in range(5)]
    assert torch.equal(SeededNoise(-3).choose(probs, 100), rows)
    assert len({tuple(SeededNoise(s).choose(probs, 100).tolist()) for s in range(4)}) > 1
    # dropping other tokens from the support keeps every token's noise: the winner stays
    kept = probs.clone()
    for i, t in enumerate(rows.tolist()):
        kept[i, (t + 1) % 600] = 0
        kept[i, (t + 300) % 600] = 0
    assert torch.equal(noise.choose(kept, 100), rows)


def test_seeded_noise_never_picks_zero_probability():
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0], [1e-30, 0.0, 0.0, 0.0, 0.0]])
    tokens = torch.stack([SeededNoise(s).choose(probs, 0) for s in range(500)])  # [500, 3]
    assert (probs.gather(1, tokens.T) > 0).all()
    assert tokens[:, 1].eq(4).all() and tokens[:, 2].eq(0).all()


def test_a_seed_of_any_size_seeds_a_generator():
    """torch takes 64 bits: a larger (or negative) seed is reduced, deterministically, not an error."""
    from tokenleap.spec.sampling import make_generator, torch_seed
    for seed in (2**70 + 3, -5, 2**64 - 1):
        a, b = torch.rand(4, generator=make_generator(seed)), torch.rand(4, generator=make_generator(seed))
        assert torch.equal(a, b) and 0 <= torch_seed(seed) < 2**64
    assert torch.equal(torch.rand(4, generator=make_generator(2**64 + 7)), torch.rand(4, generator=make_generator(7)))
