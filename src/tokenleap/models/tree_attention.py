"""Attention for the rows of a token tree (a :class:`~tokenleap.spec.tree.TokenTree` in a segment).

Node ``i`` of a tree whose root sits at position ``pos`` is stored at cache index ``pos + i`` and
rotated for position ``pos + depth[i]``. It attends to the committed entries ``[0, pos)`` and then
to its ancestors and itself, in path order: exactly the keys plain decoding of the same prefix
holds, in the same order. Each row is one call of the same one-row attention plain decoding
makes, so a node's output -- and its logits -- are bitwise those of plain decoding.

A forward may carry any contiguous range of nodes whose ancestors the cache already holds (a
draft model grows its tree a level at a time this way).
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def tree_attention(
    q: torch.Tensor,  # [rows, heads, hd], rotated: nodes seg.tree_first .. + rows - 1
    cache,
    layer: int,
    seg,  # a Segment with a tree; its root sits at seg.pos_start
    attend_row: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:  # [rows, heads, hd]
    """Each node's attention; ``attend_row(q # [1, heads, hd], keys, values # [n_kv, L, hd])`` is the
    layer's one-row attention over all ``L`` keys (``Attention._attend_row``)."""
    pos, tree = seg.pos_start, seg.tree
    prefix_k, prefix_v = cache.read(layer, seg.slot, pos)  # [n_kv, pos, hd]
    visible = tree.visible()  # [n, n]
    out = torch.empty_like(q)
    for r in range(q.shape[0]):
        idx = torch.nonzero(visible[seg.tree_first + r])[:, 0] + pos  # [depth + 1] cache indices, path order
        anc_k, anc_v = cache.read_at(layer, seg.slot, idx)  # [n_kv, depth + 1, hd]
        keys, values = torch.cat([prefix_k, anc_k], dim=1), torch.cat([prefix_v, anc_v], dim=1)
        out[r] = attend_row(q[r : r + 1], keys, values)[0]
    return out


__all__ = ["tree_attention"]
