"""Seeded sampling that does not depend on how it was drafted ("drafter-invariant", Daliri et al. 2024).

A seeded request's token at sequence position ``t`` is the winner of an exponential race::

    choice_t = argmin_x  E(t, x) / p_t(x)        over the tokens with p_t(x) > 0

where ``E(t, x)`` are independent Exp(1) variables fixed by (seed, t, x) alone. The winner is an
exact sample from ``p_t`` (the Gumbel-max trick: ``-log E`` is Gumbel), and a draft model that picks
``argmin_x E(t, x) / q_t(x)`` with the same noise proposes exactly the target's choice whenever its
own race has the same winner -- with probability at least ``(1 - TV) / (1 + TV)``, against the
``1 - TV`` of rejection sampling. Verification is then a greedy match, and the emitted tokens are
those of plain seeded sampling, whatever the draft, the draft length, the batch or a preemption.

The noise. ``U(k, i)`` is the top 53 bits of ``splitmix64(k + i)`` scaled to [0, 1); ``key_t =
mix(mix(seed) + t)`` (``mix`` is splitmix64 on 64-bit integers), with three streams ``k_min, k_arg,
k_tok = mix(key_t ^ 1), mix(key_t ^ 2), mix(key_t ^ 3)``. Tokens form blocks of ``BLOCK`` ids
(``b = x // BLOCK``, the last block possibly shorter, ``size_b`` ids). Per block::

    m_b = -log(1 - U(k_min, b)) / size_b             the block's minimum, Exp(size_b)
    j_b = floor(U(k_arg, b) * size_b)                where it sits in the block
    E(t, x) = m_b                                    for x = b * BLOCK + j_b
            = m_b - log(1 - U(k_tok, x))             for every other x of the block

-- by memorylessness, exactly ``size_b`` independent Exp(1) variables. ``E(t, x) >= m_b`` and
``p(x) <= max p over the block`` bound a block's best ratio from below, so ``choose`` computes the
noise only of the blocks that can still beat the best ratio found: O(vocab / BLOCK) work plus a
few blocks, instead of hashing every token. Ties (probability zero) go to the lowest token id.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 256
_MASK = (1 << 64) - 1
_GOLDEN, _MUL1, _MUL2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_CHOICES = 0x6E5F636F6D706C65  # choice_seed's own stream: its keys are not SeededNoise's position keys


def mix(x: int) -> int:
    """splitmix64 on a Python integer (taken modulo 2**64); returns an unsigned 64-bit value."""
    z = (x + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK
    return z ^ (z >> 31)


def choice_seed(seed: int, j: int) -> int:
    """The seed of completion ``j`` of a seeded request with ``n`` > 1: ``seed`` itself for the first, for
    the others a 63-bit value hashed from (seed, j) -- not ``seed + j``, which would make completion 1 of
    seed S the first completion of seed S + 1 (requests at nearby seeds sharing most of their samples)."""
    return seed if j == 0 else mix(mix(seed ^ _CHOICES) + j) >> 1


def _signed(x: int) -> int:
    """A 64-bit pattern as the signed value an int64 tensor holds."""
    x &= _MASK
    return x - (1 << 64) if x >> 63 else x


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:  # logical right shift of int64 bit patterns
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix64(z: torch.Tensor) -> torch.Tensor:  # int64 [...] -> int64 [...], wrapping arithmetic
    """:func:`mix` elementwise on int64 bit patterns (counters ``k + i`` -> independent-looking values)."""
    z = z + _signed(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(_MUL1)
    z = (z ^ _shr(z, 27)) * _signed(_MUL2)
    return z ^ _shr(z, 31)


def uniforms(key: int, index: torch.Tensor) -> torch.Tensor:  # index: long [...] -> float64 [...] in [0, 1)
    return _shr(splitmix64(index + _signed(key)), 11).double() * 2.0 ** -53


def _exponential(u: torch.Tensor) -> torch.Tensor:  # U[0, 1) -> Exp(1), float64
    return -torch.log1p(-u)


@dataclass(frozen=True)
class SeededNoise:
    """A seeded request's randomness: ``E(t, x)`` keyed by (seed, position, token); no state."""

    seed: int

    def streams(self, pos: int) -> tuple[int, int, int]:
        """(k_min, k_arg, k_tok) of position ``pos``."""
        key = mix(mix(self.seed) + pos)
        return mix(key ^ 1), mix(key ^ 2), mix(key ^ 3)

    def block_minima(self, pos: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(m_b, j_b) of every block at ``pos``: ``# [blocks]`` float64 and long."""
        blocks = -(-vocab // BLOCK)
        k_min, k_arg, _ = self.streams(pos)
        sizes = torch.full((blocks,), BLOCK, dtype=torch.long)  # [blocks]
        sizes[-1] = vocab - BLOCK * (blocks - 1)
        ids = torch.arange(blocks)  # [blocks]
        m = _exponential(uniforms(k_min, ids)) / sizes  # [blocks]
        j = (uniforms(k_arg, ids) * sizes).long()  # [blocks], < sizes since U < 1
        return m, j

    def exponentials(self, pos: int, blocks: torch.Tensor, m: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """``E(pos, x)`` of every id of ``blocks # [c]`` (given their ``m, j # [c]``): ``# [c, BLOCK]``
        (ids past the vocabulary included; callers mask them)."""
        _, _, k_tok = self.streams(pos)
        offset = torch.arange(BLOCK)  # [BLOCK]
        tokens = blocks[:, None] * BLOCK + offset  # [c, BLOCK]
        rest = _exponential(uniforms(k_tok, tokens))  # [c, BLOCK]
        return m[:, None] + torch.where(offset == j[:, None], 0.0, rest)

    def choose(self, probs: torch.Tensor, pos: int) -> torch.Tensor:  # probs [n, vocab] -> [n] long
        """Row ``i``'s race winner ``argmin_x E(pos + i, x) / probs[i, x]`` (probs need not sum to 1;
        each row needs positive mass)."""
        assert probs.dim() == 2, f"probs must be [n, vocab], got shape {tuple(probs.shape)}"
        n, vocab = probs.shape
        blocks = -(-vocab // BLOCK)
        padded = torch.nn.functional.pad(probs.float(), (0, blocks * BLOCK - vocab))  # [n, blocks * BLOCK]
        by_block = padded.view(n, blocks, BLOCK)  # [n, blocks, BLOCK]
        p_max = by_block.amax(dim=-1).double()  # [n, blocks]
        return torch.tensor([self._race(by_block[i], p_max[i], pos + i, vocab) for i in range(n)],
                            dtype=torch.long)

    def _race(self, p: torch.Tensor, p_max: torch.Tensor, pos: int, vocab: int) -> int:
        # p: [blocks, BLOCK] float32 (zero past the vocabulary), p_max: [blocks] float64
        m, j = self.block_minima(pos, vocab)
        inf = torch.tensor(float("inf"), dtype=torch.float64)
        bound = torch.where(p_max > 0, m / p_max, inf)  # [blocks] no ratio of the block is below it
        assert bool(torch.isfinite(bound).any()), "every row needs positive probability mass"
        best, best_token = float("inf"), -1
        todo = torch.argmin(bound)[None]  # [1] the most promising block first
        while todo.numel():
            bound[todo] = inf  # expanded
            e = self.exponentials(pos, todo, m[todo], j[todo])  # [c, BLOCK]
            q = p[todo].double()  # [c, BLOCK]
            ratio = torch.where(q > 0, e / q, inf).flatten()  # [c * BLOCK], ids ascending
            at = int(torch.argmin(ratio))  # first minimum: the lowest id among ties
            r, token = float(ratio[at]), int(todo[at // BLOCK]) * BLOCK + at % BLOCK
            if r < best or (r == best and token < best_token):
                best, best_token = r, token
            todo = torch.nonzero(bound <= best)[:, 0]  # [c'] blocks that may still hold a better ratio
        return best_token


__all__ = ["SeededNoise", "choice_seed", "splitmix64", "mix", "uniforms", "BLOCK"]
