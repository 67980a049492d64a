"""Verification of a token tree (:class:`~tokenleap.spec.tree.TokenTree`) -- pure functions.

The target computed one row per node: ``target[i]`` is its distribution for the token after the
path to node ``i``. Verification walks down from the root; at each node it decides which child (if
any) the target's own choice equals, moves there, and stops at a node where no child is taken. The
result is the **accepted path** (node indices) and one more token chosen at the node where the walk
stopped -- the **recovered** token when children were rejected there, the **bonus** token at a leaf.

* Greedy: the child whose token is the row's argmax, if there is one; the argmax at the end.
* Seeded (drafter-invariant, :mod:`tokenleap.spec.seeded`): the target's choice at a node of depth ``d``
  is the race winner at sequence position ``pos + d``, fixed by (seed, position, token); follow the
  child holding it. The tokens are those of plain seeded sampling, whatever the tree holds.
* Unseeded: recursive rejection sampling over siblings drawn without replacement (SpecInfer's
  multi-candidate scheme with Jeon et al.'s without-replacement update). At a node with target
  distribution ``p`` and children ``x_1 .. x_m`` drawn from ``q`` without replacement, child ``j``
  is accepted with probability ``min(1, p_j(x_j) / q_j(x_j))``; on rejection
  ``p_{j+1} = norm(max(0, p_j - q_j))`` and ``q_{j+1} = norm(q_j with x_j removed)``. When every
  child is rejected the token is drawn from the last residual. Each node's emitted token then has
  exactly the target's distribution, so the output is that of sampling the target alone.
  Deterministic children (``draft_probs`` None) are one-hot ``q``: child ``j`` is accepted with
  probability ``p_j(x_j)``, the residual is ``p_j`` without ``x_j``.

For a chain every rule reduces to :mod:`tokenleap.spec.verify`'s, with the same use of the generator
(one uniform per drafted node, drawn up front, then one for the last token), so a chain verified
here gives bitwise the tokens the chain verifier gives.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenleap.spec.sampling import greedy, inverse_cdf, rand_rows
from tokenleap.spec.seeded import SeededNoise
from tokenleap.spec.tree import TokenTree


@dataclass(frozen=True)
class TreeVerification:
    """The accepted path (node indices, root excluded) and the tokens a step emits: the path's
    tokens, then the recovered or bonus token."""

    path: list[int]
    tokens: list[int]  # len(tokens) == len(path) + 1

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def verify_tree_greedy(
    tree: TokenTree,
    target_logits: torch.Tensor,  # [n, vocab]
) -> TreeVerification:
    """Follow the target's argmax down the tree; emit the longest matching path plus the argmax after it."""
    _check(tree, target_logits)
    return verify_tree_choices(tree, greedy(target_logits).tolist())


def verify_tree_choices(tree: TokenTree, choice: list[int]) -> TreeVerification:
    """:func:`verify_tree_greedy` given the target's argmax of every node's row already (``choice``:
    one id per node, e.g. a slice of an argmax computed over a whole step's rows at once)."""
    assert len(choice) == tree.size, f"need one choice per node: {tree.size}, got {len(choice)}"
    return _walk(tree, lambda node: choice[node])


def verify_tree_coupled(
    tree: TokenTree,
    target_probs: torch.Tensor,  # [n, vocab], filtered by logits_to_probs
    noise: SeededNoise,
    pos: int,  # sequence position of the token the root's row chooses
) -> TreeVerification:
    """Drafter-invariant verification of a seeded request: at every node the target's seeded choice
    for its position, followed down the tree (only the rows on the walk are raced)."""
    _check(tree, target_probs)
    depth = tree.depth.tolist()
    return _walk(tree, lambda node: int(noise.choose(target_probs[node : node + 1], pos + depth[node])[0]))


def verify_tree_sampling(
    tree: TokenTree,
    target_probs: torch.Tensor,  # [n, vocab], filtered by logits_to_probs
    generator: torch.Generator | None = None,
) -> TreeVerification:
    """Recursive rejection sampling down the tree; see the module docstring."""
    _check(tree, target_probs)
    u = rand_rows(1, tree.size - 1, generator)[0]  # [n-1]: node c's acceptance uniform is u[c-1]
    last_u = rand_rows(1, 1, generator)  # [1, 1]
    path, node = [], 0
    while True:
        p = target_probs[node].double()  # [vocab]
        q = None if tree.draft_probs is None else tree.draft_probs[node].double()  # [vocab]
        child, residual = _try_children(tree, tree.children[node], p, q, u)
        if child is None:
            token = int(inverse_cdf(residual[None], last_u)[0])
            return TreeVerification(path, [int(tree.tokens[c]) for c in path] + [token])
        path.append(child)
        node = child


def _try_children(
    tree: TokenTree,
    kids: list[int],
    p: torch.Tensor,  # [vocab] float64, the target row (sums to 1)
    q: torch.Tensor | None,  # [vocab] float64, the distribution the kids were drawn from; None: one-hot each
    u: torch.Tensor,  # [n-1] float64 uniforms
) -> tuple[int | None, torch.Tensor]:
    """The accepted child, or None and the residual (unnormalized, ``[vocab]``) to draw from."""
    residual, mass = p, 1.0  # the unmodified row counts as normalized, exactly like the chain test
    for c in kids:
        x = int(tree.tokens[c])
        q_x = 1.0 if q is None else float(q[x])
        if float(u[c - 1]) * q_x * mass < float(residual[x]):  # min(1, p(x)/q(x)), no division; q(x) = 0 accepts iff p(x) > 0
            return c, residual
        if q is None:
            nxt = residual.clone()
            nxt[x] = 0.0
        else:
            nxt = (residual - mass * q).clamp_min(0)  # max(0, p - q) in residual's scale
            q = q.clone()
            q[x] = 0.0
            q_mass = float(q.sum())
            q = q / q_mass if q_mass > 0 else q
        if float(nxt.sum()) <= 0:  # p <= q everywhere (p == q): a rejection of probability zero
            return None, p
        residual, mass = nxt, float(nxt.sum())
    return None, residual


def _walk(tree: TokenTree, choose) -> TreeVerification:
    """Follow ``choose(node)`` (the target's token at a node) while a child holds it."""
    path, node = [], 0
    tokens = tree.tokens.tolist()
    while True:
        token = choose(node)
        child = next((c for c in tree.children[node] if tokens[c] == token), None)
        if child is None:
            return TreeVerification(path, [tokens[c] for c in path] + [token])
        path.append(child)
        node = child


def _check(tree: TokenTree, target: torch.Tensor) -> None:
    assert target.dim() == 2 and target.shape[0] == tree.size, (
        f"need one target row per node: [n={tree.size}, vocab], got {tuple(target.shape)}")
    assert tree.draft_probs is None or tree.draft_probs.shape == target.shape, (
        f"draft_probs {tuple(tree.draft_probs.shape)} and target {tuple(target.shape)} differ in shape")


__all__ = ["TreeVerification", "verify_tree_greedy", "verify_tree_choices", "verify_tree_coupled", "verify_tree_sampling"]
