"""Verification: exact greedy rules, and the sampling verifier's output distribution.

The statistical tests simulate speculative decoding of two tokens with a small vocabulary. The
target's distribution at position 1 depends on token 0 (table ``p1[t0]``), the drafter's too.
Whatever the drafter, the emitted pair must follow ``p0(t0) * p1(t1 | t0)`` exactly; a Pearson
chi-square test checks it, and the same test at the same seed and sample size must reject two
deliberately biased verifiers, which shows it has the power to catch a lossy verifier.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tokenleap.spec.sampling import logits_to_probs, make_generator, sample
from tokenleap.spec.seeded import SeededNoise

from conftest import chi2_pvalue
from tokenleap.spec.verify import (Verification, verify_coupled, verify_greedy, verify_greedy_batch, verify_sampling,
                              verify_sampling_batch)

V = 6  # vocabulary size of the statistical tests
TRIALS = 20000


# ---------------------------------------------------------------- greedy


def test_greedy_all_accepted_then_bonus():
    logits = torch.eye(4)[[2, 0, 3, 1]] * 5  # [4, 4]: argmaxes 2, 0, 3, 1
    out = verify_greedy(torch.tensor([2, 0, 3]), logits)
    assert out == Verification([2, 0, 3, 1], 3)


def test_greedy_first_mismatch_recovers():
    logits = torch.eye(4)[[2, 0, 3, 1]] * 5  # [4, 4]
    assert verify_greedy(torch.tensor([2, 1, 3]), logits) == Verification([2, 0], 1)
    assert verify_greedy(torch.tensor([0, 0, 3]), logits) == Verification([2], 0)


def test_greedy_k0_and_ties():
    logits = torch.tensor([[1.0, 7.0, 7.0, 0.0]])  # [1, 4]: tie, first max wins
    assert verify_greedy(torch.zeros(0, dtype=torch.long), logits) == Verification([1], 0)
    assert verify_greedy(torch.tensor([2]), logits.repeat(2, 1)) == Verification([1], 0)


def test_greedy_batch_equals_single():
    logits = torch.randn(5, 4, 9, generator=torch.Generator().manual_seed(0))  # [5, 4, 9]
    drafts = logits[:, :3].argmax(-1)  # [5, 3]
    drafts[1, 0] = (drafts[1, 0] + 1) % 9
    drafts[2, 2] = (drafts[2, 2] + 1) % 9
    batch = verify_greedy_batch(drafts, logits)
    assert batch == [verify_greedy(drafts[i], logits[i]) for i in range(5)]
    assert [v.num_accepted for v in batch] == [3, 0, 2, 3, 3]


def test_sampling_with_greedy_rows_is_exact_greedy():
    """temperature 0 gives one-hot target rows; rejection sampling then reproduces greedy."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(50, 4, 9, generator=gen)  # [50, 4, 9]
    drafts = torch.randint(0, 9, (50, 3), generator=gen)  # [50, 3]
    drafts[::2] = logits[::2, :3].argmax(-1)
    q = torch.softmax(torch.randn(50, 3, 9, generator=gen), -1)  # [50, 3, 9]
    p = logits_to_probs(logits.reshape(-1, 9), temperature=0.0).reshape(50, 4, 9)  # [50, 4, 9]
    assert verify_sampling_batch(drafts, q, p, gen) == verify_greedy_batch(drafts, logits)
    assert verify_sampling_batch(drafts, None, p, gen) == verify_greedy_batch(drafts, logits)


# ---------------------------------------------------------------- a two-token simulation


@dataclass(frozen=True)
class Case:
    p0: torch.Tensor  # [V] target, position 0
    p1: torch.Tensor  # [V, V] target, position 1, row = token 0
    p2: torch.Tensor  # [V, V] target, position 2, row = token 1
    q0: torch.Tensor | None  # [V] draft, position 0; None: deterministic drafter
    q1: torch.Tensor | None  # [V, V] draft, position 1, row = token 0


def random_case(seed: int, draft: bool = True, **filters) -> Case:
    gen = torch.Generator().manual_seed(seed)

    def probs(rows: int) -> torch.Tensor:  # [rows, V]
        return logits_to_probs(torch.randn(rows, V, generator=gen) * 1.5, **filters)

    p0, p1, p2 = probs(1)[0], probs(V), probs(V)
    q0, q1 = (probs(1)[0], probs(V)) if draft else (None, None)
    return Case(p0, p1, p2, q0, q1)


def draft(q: torch.Tensor | None, fixed: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Draft tokens # [n]: sampled from rows ``q # [n, V]``, or ``fixed # [n]`` when q is None."""
    return fixed if q is None else torch.multinomial(q, 1, generator=gen)[:, 0]


def simulate(case: Case, verify, k: int = 2, trials: int = TRIALS) -> tuple[torch.Tensor, list]:
    """Counts of emitted pairs # [V, V] over ``trials`` runs, and the first step's results.

    The first step drafts ``k`` tokens (1: the pair can end with a bonus token; 2: with a
    recovered one); a step that emits one token is followed by a step drafting one token.
    """
    gen = torch.Generator().manual_seed(0)
    one_hot = case.q0 is None
    x0 = draft(None if one_hot else case.q0.expand(trials, V), torch.full((trials,), 3), gen)  # [n]
    x1 = draft(None if one_hot else case.q1[x0], (x0 * 5 + 1) % V, gen)  # [n]
    target = torch.stack([case.p0.expand(trials, V), case.p1[x0], case.p2[x1]], 1)  # [n, 3, V]
    q = None if one_hot else torch.stack([case.q0.expand(trials, V), case.q1[x0]], 1)  # [n, 2, V]
    drafts = torch.stack([x0, x1], 1)[:, :k]  # [n, k]
    first = verify(drafts, None if one_hot else q[:, :k], target[:, :k + 1], gen)
    pairs = [v.tokens[:2] for v in first if len(v.tokens) >= 2]
    short = [v.tokens[0] for v in first if len(v.tokens) == 1]
    if short:  # rejected at position 0: the next step drafts one token after the recovered one
        t0 = torch.tensor(short)  # [m]
        y = draft(None if one_hot else case.q1[t0], (t0 * 5 + 1) % V, gen)  # [m]
        target = torch.stack([case.p1[t0], case.p2[y]], 1)  # [m, 2, V]
        q = None if one_hot else case.q1[t0][:, None]  # [m, 1, V]
        pairs += [[a, v.tokens[0]] for a, v in zip(short, verify(y[:, None], q, target, gen))]
    cells = torch.tensor(pairs) @ torch.tensor([V, 1])  # [trials]
    return torch.bincount(cells, minlength=V * V).reshape(V, V), first


def assert_lossless(case: Case, k: int = 2, verify=verify_sampling_batch) -> list[Verification]:
    counts, first = simulate(case, verify, k)
    joint = case.p0[:, None] * case.p1  # [V, V]
    assert chi2_pvalue(counts.sum(1), case.p0) > 1e-3, "first token does not follow p0"
    assert chi2_pvalue(counts, joint) > 1e-3, "emitted pairs do not follow p0 x p1"
    return first


@pytest.mark.parametrize("k", [1, 2])
def test_lossless_random_draft(k):
    first = assert_lossless(random_case(10), k)
    assert 0 < sum(v.num_accepted for v in first) < k * TRIALS


def test_lossless_filtered_top_k_top_p():
    case = random_case(11, top_k=4, top_p=0.85)
    assert (case.p1 == 0).any() and (case.q1 == 0).any() and not torch.equal(case.p1 > 0, case.q1 > 0)
    assert_lossless(case)


def test_lossless_temperature_and_min_p():
    assert_lossless(random_case(12, temperature=0.7, min_p=0.1))


@pytest.mark.parametrize("k", [1, 2])
def test_lossless_deterministic_drafter(k):
    first = assert_lossless(random_case(13, draft=False), k)
    assert 0 < sum(v.num_accepted for v in first) < k * TRIALS


def test_lossless_when_p_equals_q_all_accepted():
    c = random_case(14)
    first = assert_lossless(Case(c.p0, c.p1, c.p2, c.p0, c.p1))
    assert all(v.num_accepted == 2 for v in first)


def test_lossless_with_disjoint_supports_all_rejected():
    c = random_case(15)
    lo, hi = torch.arange(V) < V // 2, torch.arange(V) >= V // 2  # [V] each

    def restrict(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        t = t * keep
        return t / t.sum(-1, keepdim=True)

    case = Case(restrict(c.p0, lo), restrict(c.p1, lo), c.p2, restrict(c.q0, hi), restrict(c.q1, hi))
    first = assert_lossless(case)
    assert all(v.num_accepted == 0 for v in first)


# ---------------------------------------------------------------- the test has teeth


def always_accept(draft_tokens, draft_probs, target_probs, gen) -> list[Verification]:
    """Biased: keeps every draft token, so the output follows q instead of p."""
    k = draft_tokens.shape[1]
    bonus = torch.multinomial(target_probs[:, k], 1, generator=gen)[:, 0]  # [b]
    return [Verification(d + [t], k) for d, t in zip(draft_tokens.tolist(), bonus.tolist())]


def resample_from_target(draft_tokens, draft_probs, target_probs, gen) -> list[Verification]:
    """Biased: correct acceptance test, but a rejection resamples from p, not max(0, p - q)."""
    b, k = draft_tokens.shape
    p_x = target_probs[:, :k].gather(-1, draft_tokens[..., None])[..., 0]  # [b, k]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(
        -1, draft_tokens[..., None])[..., 0]  # [b, k]
    accepted = (torch.rand(b, k, generator=gen) * q_x < p_x).long().cumprod(-1).sum(-1)  # [b]
    last = torch.multinomial(target_probs[torch.arange(b), accepted], 1, generator=gen)[:, 0]  # [b]
    rows = zip(draft_tokens.tolist(), accepted.tolist(), last.tolist())
    return [Verification(d[:n] + [t], n) for d, n, t in rows]


@pytest.mark.parametrize("biased", [always_accept, resample_from_target])
@pytest.mark.parametrize("draft_kind", ["sampled", "deterministic"])
def test_statistical_check_rejects_biased_verifiers(biased, draft_kind):
    case = random_case(10 if draft_kind == "sampled" else 13, draft=draft_kind == "sampled")
    counts, _ = simulate(case, biased, k=2)
    assert chi2_pvalue(counts, case.p0[:, None] * case.p1) < 1e-6


# ---------------------------------------------------------------- reproducibility and guards


def test_seeded_reproducibility_and_per_sequence_generators():
    c = random_case(16)
    drafts = torch.multinomial(c.q1, 2, replacement=True, generator=make_generator(0))  # [V, 2]
    q = torch.stack([c.q1[drafts[:, 0]], c.q1[drafts[:, 1]]], 1)  # [V, 2, V]
    p = torch.stack([c.p1[drafts[:, 0]], c.p1[drafts[:, 1]], c.p2[drafts[:, 1]]], 1)  # [V, 3, V]
    one = [verify_sampling(drafts[i], q[i], p[i], make_generator(100 + i)) for i in range(V)]
    again = [verify_sampling(drafts[i], q[i], p[i], make_generator(100 + i)) for i in range(V)]
    batch = verify_sampling_batch(drafts, q, p, [make_generator(100 + i) for i in range(V)])
    assert one == again == batch
    runs = {tuple(tuple(v.tokens) for v in verify_sampling_batch(drafts, q, p, make_generator(s)))
            for s in range(5)}
    assert len(runs) > 1  # the generator matters


def test_k0_is_a_plain_sampling_step():
    p = random_case(17).p1  # [V, V]
    for seed in range(20):
        out = verify_sampling(torch.zeros(0, dtype=torch.long), None, p[:1], make_generator(seed))
        assert out == Verification([int(sample(p[:1], make_generator(seed))[0])], 0)


def test_zero_probabilities_never_nan_or_zero_token():
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0], [0.2, 0.0, 0.8, 0.0]])  # [3, 4]
    q_top2 = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]])  # [2, 4]
    q_top0 = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])  # [2, 4]
    cases = {
        "p = q = 0 at x: reject, residual empty, fall back to p": (torch.tensor([0, 2]), p[:2]),
        "q(x) = 0 and p(x) = 0: reject": (torch.tensor([3, 2]), q_top0),
        "q(x) = 0 and p(x) > 0: accept": (torch.tensor([1, 2]), q_top2),
        "p = q: accept everything": (torch.tensor([1, 2]), p[:2]),
    }
    for seed in range(50):
        for name, (drafts, q) in cases.items():
            out = verify_sampling(drafts, q, p, make_generator(seed))
            assert len(out.tokens) == out.num_accepted + 1
            emitted = p[torch.arange(len(out.tokens)), torch.tensor(out.tokens)]  # [len]
            assert (emitted > 0).all(), f"{name}: emitted a zero-probability token: {out}"
    accepted = [verify_sampling(d, q, p, make_generator(0)).num_accepted for d, q in cases.values()]
    assert accepted == [0, 0, 2, 2]


def test_coupled_verification_emits_the_seeded_choices_whatever_was_drafted():
    gen = torch.Generator().manual_seed(8)
    probs = logits_to_probs(torch.randn(5, 12, generator=gen), 1.0, 0, 0.9)  # [5, 12], k = 4
    noise = SeededNoise(31)
    choice = noise.choose(probs, 40)  # [5] what plain seeded sampling emits at positions 40 .. 44
    assert verify_coupled(choice[:4], probs, noise, 40) == Verification(choice.tolist(), 4)
    for j in range(4):  # the first wrong draft at j: j accepted, then the target's choice
        drafts = choice[:4].clone()
        drafts[j] = (drafts[j] + 1) % 12
        assert verify_coupled(drafts, probs, noise, 40) == Verification(choice[:j + 1].tolist(), j)
    assert verify_coupled(torch.tensor([], dtype=torch.long), probs[:1], noise, 40) == Verification(choice[:1].tolist(), 0)


def test_coupled_acceptance_is_within_the_drafter_invariant_bounds():
    """A draft choosing with the same noise from q is accepted with probability between
    (1 - TV) / (1 + TV) (Gumbel-max coupling's guarantee) and 1 - TV (rejection sampling's)."""
    gen = torch.Generator().manual_seed(9)
    p = torch.softmax(torch.randn(1, 8, generator=gen), -1)  # [1, 8]
    q = torch.softmax(torch.log(p) + 0.7 * torch.randn(1, 8, generator=gen), -1)  # [1, 8]
    tv = float((p - q).abs().sum()) / 2
    n = 4000
    accepted = sum(verify_coupled(SeededNoise(s).choose(q, 0), torch.cat([p, p]), SeededNoise(s), 0).num_accepted
                   for s in range(n)) / n
    assert 0.1 < tv < 0.5
    assert (1 - tv) / (1 + tv) - 0.02 < accepted < 1 - tv + 0.02
