"""Attention for the rows of a token tree (a :class:`~tokenleap.spec.tree.TokenTree` in a segment).

Node ``i`` of a tree whose root sits at position ``pos`` is stored at cache index ``pos + i`` and
rotated for position ``pos + depth[i]``. It attends to the committed entries ``[0, pos)`` and then
to its ancestors and itself, in path order: exactly the keys plain decoding of the same prefix
holds, in the same order. Each row is one call of the same one-row attention plain decoding
makes, so a node's output -- and its logits -- are bitwise those of plain decoding.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def tree_attention(
    q: torch.Tensor,  # [n, heads, hd], rotated
    cache,
    layer: int,
    slot: int,
    pos: int,  # the root's position (and cache index)
    tree,
    attend_row: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:  # [n, heads, hd]
    """Each node's attention; ``attend_row(q # [1, heads, hd], keys, values # [n_kv, L, hd])`` is the
    layer's one-row attention over all ``L`` keys (``Attention._attend_row``)."""
    prefix_k, prefix_v = cache.read(layer, slot, pos)  # [n_kv, pos, hd]
    visible = tree.visible()  # [n, n]
    out = torch.empty_like(q)
    for i in range(tree.size):
        idx = torch.nonzero(visible[i])[:, 0] + pos  # [depth_i + 1] cache indices, path order
        anc_k, anc_v = cache.read_at(layer, slot, idx)  # [n_kv, depth_i + 1, hd]
        keys, values = torch.cat([prefix_k, anc_k], dim=1), torch.cat([prefix_v, anc_v], dim=1)
        out[i] = attend_row(q[i : i + 1], keys, values)[0]
    return out


__all__ = ["tree_attention"]
