"""A proposal as a token tree: the data model verification works on (a chain is a tree of one branch).

Node 0 is the **root**: the sequence's last decided token, not yet in the target's cache. Every other
node is a drafted token whose parent is an earlier node (``parents[i] < i``, so nodes are listed in
topological order and any prefix of the list is itself a tree). One target forward pass over the
``n`` nodes gives ``n`` rows: row ``i`` is the target's distribution for the token that follows the
path root -> ... -> i, i.e. the distribution node ``i``'s children are judged by.

Where a node sits:

* its RoPE position is ``pos + depth[i]`` (``pos``: the root's position in the sequence);
* it sees the committed cache ``[0, pos)`` plus its ancestors and itself (:meth:`TokenTree.visible`),
  never a sibling or a cousin -- so its logits are those of plain decoding of the same prefix;
* a cache can store node ``i`` at scratch index ``pos + i`` (distinct for siblings), then move the
  accepted path into ``pos + 1, pos + 2, ...`` after verification (:meth:`TokenTree.compaction`).

The draft's distributions: ``draft_probs[i]`` is the distribution ``q`` node ``i``'s children were
drawn from, without replacement (so siblings are distinct tokens). ``None`` means the children are
deterministic choices (n-gram continuations, the draft's top-k); verification then treats each one
as a one-hot ``q``. Leaves' rows of ``draft_probs`` are unused.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass(frozen=True, eq=False)
class TokenTree:
    tokens: torch.Tensor  # [n] long; tokens[0] is the root
    parents: torch.Tensor  # [n] long; parents[0] == -1, 0 <= parents[i] < i
    draft_probs: torch.Tensor | None = None  # [n, vocab] float: q at each node (its children's), or None
    hidden: torch.Tensor | None = field(default=None, repr=False)  # [n, d] per-node states for heads, optional
    # a forward layout (:meth:`with_rows`), not a proposal: siblings may repeat a token; never verified
    layout: bool = False

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if self.tokens.dim() != 1 or n < 1 or self.tokens.dtype != torch.long:
            raise ValueError(f"tokens must be a non-empty 1-D long tensor, got {tuple(self.tokens.shape)} "
                             f"{self.tokens.dtype}")
        if self.parents.shape != (n,) or self.parents.dtype != torch.long:
            raise ValueError(f"parents must be [n] = [{n}] long, got {tuple(self.parents.shape)}")
        if int(self.parents[0]) != -1:
            raise ValueError("node 0 is the root: parents[0] must be -1")
        if n > 1 and not bool(((self.parents[1:] >= 0) & (self.parents[1:] < torch.arange(1, n))).all()):
            raise ValueError("every node's parent must be an earlier node (0 <= parents[i] < i)")
        if self.draft_probs is not None and (self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != n):
            raise ValueError(f"draft_probs must be [n, vocab] with n = {n}, got {tuple(self.draft_probs.shape)}")
        for kids in ([] if self.layout else self.children):
            tokens = [int(self.tokens[c]) for c in kids]
            if len(set(tokens)) != len(tokens):
                raise ValueError(f"siblings must be distinct tokens, got {tokens}")

    @classmethod
    def chain(cls, root: int, drafts: list[int], draft_probs: torch.Tensor | None = None) -> "TokenTree":
        """A chain: ``root`` followed by ``drafts`` (``draft_probs # [k, vocab]``: the distribution
        ``drafts[i]`` was drawn from, as :class:`~tokenleap.spec.proposers.base.Draft` holds it)."""
        k = len(drafts)
        tokens = torch.tensor([root, *drafts], dtype=torch.long)  # [k+1]
        parents = torch.arange(-1, k, dtype=torch.long)  # [k+1]
        q = None
        if draft_probs is not None:
            assert draft_probs.shape[0] == k, f"draft_probs must be [k={k}, vocab], got {tuple(draft_probs.shape)}"
            q = torch.cat([draft_probs, torch.zeros(1, draft_probs.shape[1], dtype=draft_probs.dtype)])  # [k+1, vocab]
        return cls(tokens, parents, q)

    @classmethod
    def from_paths(cls, root: int, paths: list[list[int]]) -> "TokenTree":
        """The trie of token ``paths`` below ``root`` (shared prefixes merged, first-seen order kept);
        deterministic children (``draft_probs`` None)."""
        tokens, parents, index = [root], [-1], {}
        for path in paths:
            at = 0
            for token in path:
                key = (at, token)
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(token)
                    parents.append(at)
                at = index[key]
        return cls(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    def with_rows(self, tokens: list[int], parents: list[int]) -> "TokenTree":
        """A forward layout: this tree's nodes, then extra rows (``parents[j]`` indexes the whole
        list, nodes first, and is below ``size + j``). The extra rows are computed in the same forward
        as the nodes, each seeing the committed cache plus its own ancestors, but are no candidates:
        a proposer reads their logits (``proposers.base.AuxRows``), verification never sees them."""
        n, m = self.size, len(tokens)
        assert len(parents) == m and all(0 <= p < n + j for j, p in enumerate(parents)), (
            f"each extra row's parent must be an earlier row, got {parents} after {n} nodes")
        return TokenTree(torch.cat([self.tokens, torch.tensor(tokens, dtype=torch.long)]),
                         torch.cat([self.parents, torch.tensor(parents, dtype=torch.long)]), layout=True)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @cached_property
    def depth(self) -> torch.Tensor:  # [n] long, the root at 0
        depth = [0] * self.size
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            depth[i] = depth[p] + 1
        return torch.tensor(depth, dtype=torch.long)

    @cached_property
    def parent_list(self) -> list[int]:
        return self.parents.tolist()

    @cached_property
    def children(self) -> list[list[int]]:
        """Each node's children in node order (the order verification tries them in)."""
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            kids[p].append(i)
        return kids

    @property
    def is_chain(self) -> bool:
        return bool((self.parents == torch.arange(-1, self.size - 1)).all())

    def path(self, node: int) -> list[int]:
        """Node indices from the root's first child down to ``node`` (empty for the root)."""
        out = []
        while node > 0:
            out.append(node)
            node = int(self.parents[node])
        return out[::-1]

    def visible(self) -> torch.Tensor:  # [n, n] bool, shared: do not modify
        """``visible[i, j]``: node ``i`` attends to node ``j`` (``j`` is ``i`` or one of its ancestors).
        Built once per tree: every layer of a forward reads it."""
        return self._visible

    @cached_property
    def _visible(self) -> torch.Tensor:  # [n, n] bool
        mask = torch.eye(self.size, dtype=torch.bool)
        for i, p in enumerate(self.parent_list[1:], start=1):
            mask[i] |= mask[p]
        return mask

    def positions(self, pos: int) -> torch.Tensor:  # [n] long
        """RoPE positions of the nodes when the root sits at sequence position ``pos``."""
        return self.depth + pos

    def compaction(self, accepted: list[int]) -> list[tuple[int, int]]:
        """(from node, to offset) moves that put an accepted path's nodes right after the root, in
        order: node ``accepted[j]`` stored at offset ``accepted[j]`` goes to offset ``j + 1``.
        Moves that change nothing (a chain's path) are left out."""
        return [(node, j + 1) for j, node in enumerate(accepted) if node != j + 1]


__all__ = ["TokenTree"]
