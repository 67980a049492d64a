"""Verification of drafted tokens against the target model -- pure functions, no cache, no model.

A proposer drafts ``k`` tokens ``x_0 .. x_{k-1}``; one target forward pass over them yields
``k + 1`` distributions: row ``i`` is the target's distribution ``p_i`` for the position of
``x_i``, and row ``k`` is the distribution for the position after the last draft.

* **accepted** tokens: the longest prefix of the draft that the verifier keeps. Greedy: ``x_i``
  equals the target's argmax. Sampling: ``x_i`` passes the test ``u_i < p_i(x_i) / q_i(x_i)``
  with ``u_i ~ U[0, 1)`` (acceptance probability ``min(1, p/q)``).
* **recovered** token: emitted at the first rejected position ``j``. Greedy: the target's argmax.
  Sampling: drawn from the residual ``norm(max(0, p_j - q_j))``.
* **bonus** token: emitted when all ``k`` drafts are accepted, from row ``k`` (argmax, or a
  sample from ``p_k``).

So every step emits ``num_accepted + 1`` tokens. With sampling, the emitted sequence has exactly
the distribution of sampling from the target alone (Leviathan et al. 2023; Chen et al. 2023):
speculation is lossless. ``q`` is the draft's distribution, filtered by the same
:func:`tokenleap.spec.sampling.logits_to_probs` settings as ``p``; a deterministic proposer (n-gram)
passes ``draft_probs=None`` and counts as ``q`` one-hot on its token.

Zero-probability guards: ``q(x) == 0`` never divides (the test is ``u * q < p``); a residual with
no mass (``p <= q`` everywhere, i.e. ``p == q``) falls back to ``p``; sampling never picks a
zero-probability token. All randomness comes from the request's ``torch.Generator``: per request,
``k`` acceptance uniforms, then one uniform for the recovered or bonus token, so a plain sampling
step (``k == 0``) consumes the generator exactly like :func:`tokenleap.spec.sampling.sample`.

A seeded request is verified by :func:`verify_coupled` instead: its tokens are chosen by
:class:`tokenleap.spec.seeded.SeededNoise` (Gumbel-max with noise keyed by position), which makes
verification a greedy match on the noisy scores -- the draft is accepted where it chose what the
target chooses -- and the output that of plain seeded sampling, token for token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenleap.spec.sampling import Generators, greedy, inverse_cdf, rand_rows
from tokenleap.spec.seeded import SeededNoise


@dataclass(frozen=True)
class Verification:
    """The outcome of one step: accepted draft tokens, then one recovered or bonus token."""

    tokens: list[int]  # len(tokens) == num_accepted + 1
    num_accepted: int


def verify_greedy(
    draft_tokens: torch.Tensor,  # [k] long
    target_logits: torch.Tensor,  # [k+1, vocab]
) -> Verification:
    """Accept drafts while they equal the target's argmax, then emit the target's argmax."""
    _check_shapes(draft_tokens[None], target_logits[None])
    return verify_greedy_choices(draft_tokens.tolist(), greedy(target_logits).tolist())


def verify_greedy_batch(
    draft_tokens: torch.Tensor,  # [b, k] long
    target_logits: torch.Tensor,  # [b, k+1, vocab]
) -> list[Verification]:
    """:func:`verify_greedy` for ``b`` sequences that drafted the same number of tokens."""
    b, k = _check_shapes(draft_tokens, target_logits)
    target = greedy(target_logits)  # [b, k+1]
    matched = draft_tokens == target[:, :k]  # [b, k]
    num_accepted = matched.long().cumprod(dim=-1).sum(dim=-1)  # [b]
    last = target.gather(1, num_accepted[:, None])  # [b, 1]
    return _results(draft_tokens, num_accepted, last[:, 0])


def verify_greedy_choices(draft_tokens: list[int], choice: list[int]) -> Verification:
    """:func:`verify_greedy` given the target's argmax of each row already (``choice``: k + 1 ids,
    e.g. one slice of an argmax computed over a whole step's rows at once)."""
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == choice[n]:
        n += 1
    return Verification(list(draft_tokens[:n]) + [choice[n]], n)


def verify_sampling(
    draft_tokens: torch.Tensor,  # [k] long
    draft_probs: torch.Tensor | None,  # [k, vocab], or None for a deterministic proposer
    target_probs: torch.Tensor,  # [k+1, vocab], filtered by logits_to_probs
    generator: torch.Generator | None = None,
) -> Verification:
    """Rejection-sampling verification of one sequence; see the module docstring."""
    q = None if draft_probs is None else draft_probs[None]
    return verify_sampling_batch(draft_tokens[None], q, target_probs[None], generator)[0]


def verify_sampling_batch(
    draft_tokens: torch.Tensor,  # [b, k] long
    draft_probs: torch.Tensor | None,  # [b, k, vocab], or None for deterministic proposers
    target_probs: torch.Tensor,  # [b, k+1, vocab]
    generator: Generators = None,
) -> list[Verification]:
    """:func:`verify_sampling` for ``b`` sequences that drafted the same number of tokens.

    ``generator`` is one generator for the whole batch, or one per sequence; with one per
    sequence, sequence ``i`` gets the same result as ``verify_sampling`` with its generator.
    """
    b, k = _check_shapes(draft_tokens, target_probs)
    assert draft_probs is None or draft_probs.shape == (b, k, target_probs.shape[-1]), (
        f"draft_probs must be [b, k, vocab] = {(b, k, target_probs.shape[-1])}, "
        f"got {tuple(draft_probs.shape)}")
    u = rand_rows(b, k, generator)  # [b, k]
    num_accepted = _num_accepted(draft_tokens, draft_probs, target_probs, u)  # [b]
    p_next = _row_at(target_probs, num_accepted).double()  # [b, vocab]
    q_next = _draft_row_at(draft_tokens, draft_probs, num_accepted, p_next.shape[-1])  # [b, vocab]
    weights = _residual(p_next, q_next)  # [b, vocab]
    last = inverse_cdf(weights, rand_rows(b, 1, generator))  # [b]
    return _results(draft_tokens, num_accepted, last)


def verify_coupled(
    draft_tokens: torch.Tensor,  # [k] long
    target_probs: torch.Tensor,  # [k+1, vocab], filtered by logits_to_probs
    noise: SeededNoise,
    pos: int,  # sequence position of the first verified token (row 0)
) -> Verification:
    """Drafter-invariant verification of a seeded request: row ``i`` chooses
    ``noise.choose(p_i, pos + i)``; drafts are accepted while they equal those choices, then the
    target's choice is emitted. Whatever was drafted, the tokens are those of plain seeded sampling."""
    _, k = _check_shapes(draft_tokens[None], target_probs[None])
    target = noise.choose(target_probs, pos)  # [k+1]
    num_accepted = (draft_tokens == target[:k]).long().cumprod(dim=-1).sum(dim=-1, keepdim=True)  # [1]
    return _results(draft_tokens[None], num_accepted, target[num_accepted])[0]


def _num_accepted(
    draft_tokens: torch.Tensor,  # [b, k] long
    draft_probs: torch.Tensor | None,  # [b, k, vocab] or None
    p: torch.Tensor,  # [b, k+1, vocab]
    u: torch.Tensor,  # [b, k] float64
) -> torch.Tensor:  # [b] long
    """Length of the accepted prefix: ``u_i * q_i(x_i) < p_i(x_i)`` for every i before it."""
    idx = draft_tokens[..., None]  # [b, k, 1]
    p_x = p[:, :-1].gather(-1, idx)[..., 0].double()  # [b, k]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)  # [b, k] one-hot draft: q(x) = 1
    else:
        q_x = draft_probs.gather(-1, idx)[..., 0].double()  # [b, k]
    accepted = u * q_x < p_x  # [b, k]; q == 0 accepts iff p > 0, without dividing
    return accepted.long().cumprod(dim=-1).sum(dim=-1)


def _row_at(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # [b, vocab]
    """Row ``pos[i]`` of sequence ``i``: ``x # [b, m, vocab]``, ``pos # [b]`` long."""
    index = pos[:, None, None].expand(-1, 1, x.shape[-1])  # [b, 1, vocab]
    return x.gather(1, index)[:, 0]


def _draft_row_at(
    draft_tokens: torch.Tensor,  # [b, k] long
    draft_probs: torch.Tensor | None,  # [b, k, vocab] or None
    pos: torch.Tensor,  # [b] long, in [0, k]
    vocab: int,
) -> torch.Tensor:  # [b, vocab] float64
    """The draft distribution ``q`` at ``pos``; all zeros where ``pos == k`` (bonus position)."""
    b, k = draft_tokens.shape
    if k == 0:
        return torch.zeros(b, vocab, dtype=torch.float64)
    rejected = (pos < k)[:, None]  # [b, 1]
    at = pos.clamp(max=k - 1)  # [b]
    if draft_probs is None:
        token = draft_tokens.gather(1, at[:, None])  # [b, 1]
        q = torch.zeros(b, vocab, dtype=torch.float64).scatter(1, token, 1.0)  # [b, vocab]
    else:
        q = _row_at(draft_probs, at).double()  # [b, vocab]
    return q * rejected


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # p, q [b, vocab] -> [b, vocab]
    """``max(0, p - q)`` (unnormalized; sampling normalizes), or ``p`` where that has no mass."""
    r = (p - q).clamp_min(0)  # [b, vocab]
    has_mass = r.sum(dim=-1, keepdim=True) > 0  # [b, 1]
    return torch.where(has_mass, r, p)


def _check_shapes(draft_tokens: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    assert draft_tokens.dim() == 2 and target.dim() == 3, (
        f"need draft_tokens [b, k] and target [b, k+1, vocab], got "
        f"{tuple(draft_tokens.shape)} and {tuple(target.shape)}")
    assert draft_tokens.dtype == torch.long, f"draft_tokens must be long, got {draft_tokens.dtype}"
    b, k = draft_tokens.shape
    assert target.shape[:2] == (b, k + 1), (
        f"target must have k+1 = {k + 1} rows per sequence, got shape {tuple(target.shape)}")
    return b, k


def _results(
    draft_tokens: torch.Tensor,  # [b, k] long
    num_accepted: torch.Tensor,  # [b] long
    last: torch.Tensor,  # [b] long, the recovered or bonus token
) -> list[Verification]:
    rows = torch.cat([num_accepted[:, None], draft_tokens, last[:, None]], dim=1).tolist()  # [b, k+2]
    return [Verification(row[1:1 + row[0]] + [row[-1]], row[0]) for row in rows]


__all__ = ["Verification", "verify_greedy", "verify_greedy_batch", "verify_greedy_choices", "verify_sampling",
           "verify_sampling_batch", "verify_coupled"]
