"""Deliberately biased versions of ``tree_verify._try_children`` (the sibling loop of recursive
rejection sampling), for the negative controls: a statistical check of tree sampling must reject
each of them, or it could not have caught the bug it stands for.

Each takes and returns what ``_try_children`` does: (tree, kids, p, q, u) -> (accepted child or
None, the residual to draw from). p: ``[vocab]`` target row; q: ``[vocab]`` the distribution the kids
were drawn from, None for one-hot drafts; u: ``[n-1]`` uniforms, one per non-root node.
"""
from __future__ import annotations

import torch


def restart_from_p_ignoring_q(tree, kids: list[int], p: torch.Tensor, q: torch.Tensor | None,
                              u: torch.Tensor) -> tuple[int | None, torch.Tensor]:
    """Bug: every sibling is accepted with probability p(x), as if it were the only guess of a
    one-hot draft, and after rejecting them all it draws from p itself: the rejected guesses keep
    their mass (and a drawn draft's q is ignored)."""
    for c in kids:
        if float(u[c - 1]) < float(p[int(tree.tokens[c])]):
            return c, p
    return None, p


def restart_from_p_with_q(tree, kids: list[int], p: torch.Tensor, q: torch.Tensor | None,
                          u: torch.Tensor) -> tuple[int | None, torch.Tensor]:
    """Bug: every sibling is tested against p itself, min(1, p(x) / q(x)), instead of the residual
    the earlier rejections left; the final residual is max(0, p - q), as after one rejection."""
    for c in kids:
        x = int(tree.tokens[c])
        q_x = 1.0 if q is None else float(q[x])
        if float(u[c - 1]) * q_x < float(p[x]):
            return c, p
    return None, (p - q).clamp_min(0) if q is not None else p


def no_q_update(tree, kids: list[int], p: torch.Tensor, q: torch.Tensor | None,
                u: torch.Tensor) -> tuple[int | None, torch.Tensor]:
    """Bug: the residual shrinks after each rejection, but later siblings are judged by the full q,
    as if the siblings were drawn with replacement (q never loses a rejected guess's mass)."""
    residual, mass = p, 1.0
    for c in kids:
        x = int(tree.tokens[c])
        q_x = 1.0 if q is None else float(q[x])
        if float(u[c - 1]) * q_x * mass < float(residual[x]):
            return c, residual
        nxt = (residual - mass * q).clamp_min(0)
        if float(nxt.sum()) <= 0:
            return None, p
        residual, mass = nxt, float(nxt.sum())
    return None, residual


__all__ = ["no_q_update", "restart_from_p_ignoring_q", "restart_from_p_with_q"]
