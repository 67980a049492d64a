"""Dynamic draft trees grown by a draft model (the EAGLE-2 recipe, on a separate small model).

Each node carries the draft's cumulative log-probability of its path. Level by level, the
``WIDTH`` best nodes of the newest level are fed to the draft -- one batched forward over every
sequence's frontier, with tree attention -- and each gets its ``WIDTH`` most probable children;
the children are ranked by path score, so a level's best nodes are contiguous. After ``k`` levels
the ``max_nodes`` best-scoring nodes are kept (a child never scores above its parent, so the kept
set is a tree). A frontier node already outside the ``max_nodes`` best is not fed: nothing below
it could be kept, so where the draft is sure a level costs one or two rows, not ``WIDTH``.
Children are deterministic choices (``draft_probs`` None) except that a seeded request's first
child at a node is the draft's own seeded choice, the token most likely to match the target's
(drafter-invariant verification).

The draft's cache holds only the fed nodes, in the order they were fed, at scratch indices
``root + 1, root + 2, ...`` (at most ``1 + WIDTH * (k - 1)`` rows, not one per grown node); a level
that would not fit the cache is not fed and the tree stops growing there. After verification the
accepted path's fed prefix is moved into sequence order (``compact``), so the draft does not
recompute what it already holds.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from tokenleap.cache.contiguous import CacheFullError
from tokenleap.config import SamplingParams
from tokenleap.models.transformer import Segment
from tokenleap.spec.sampling import params_probs
from tokenleap.spec.seeded import SeededNoise
from tokenleap.spec.tree import TokenTree
from tokenleap.spec.proposers.base import Draft, DraftRequest

WIDTH = 4  # nodes expanded per level, and children per expanded node
FEW_ROWS = 8  # unseen tokens fed row-exact (the decode path) before a tree grows; more: prefill


@dataclass(eq=False)
class _Growth:
    """One sequence's tree while it grows (node 0: the root, the sequence's last token)."""

    index: int  # position in the request list
    req: DraftRequest
    slot: int
    root_pos: int
    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    scores: list[float] = field(default_factory=lambda: [0.0])
    stored: list[int] = field(default_factory=lambda: [0])  # fed nodes, in cache order from the root's index
    frontier: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (node, its children's q)
    failed: bool = False
    catch_up_seconds: float = 0.0  # the root forward's share, when it fed a backlog (not drafting)
    catch_up_tokens: int = 0

    def storage_tree(self) -> TokenTree:
        """The fed nodes then the frontier, renumbered in that (cache) order: what a forward over the
        frontier sees. Every frontier node's parent is fed, and storage order is growth order, which
        is topological."""
        nodes = self.stored + [n for n, _ in self.frontier]
        where = {n: i for i, n in enumerate(nodes)}
        parents = [-1] + [where[self.parents[n]] for n in nodes[1:]]
        return TokenTree(torch.tensor([self.tokens[n] for n in nodes]), torch.tensor(parents))


@dataclass(frozen=True)
class GrownTree:
    """What ``accept`` needs of a proposal: the root's position, each kept node's growth index and
    where the draft cache holds each fed node (offset from the root's index)."""

    root_pos: int
    growth_index: list[int]  # [kept nodes], growth_index[0] == 0
    stored_at: dict[int, int]  # growth index -> cache offset from root_pos, fed nodes only


def draft_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # [vocab] float32
    """What the draft ranks children by: its filtered distribution (temperature 1 when greedy)."""
    if params.greedy:
        return torch.softmax(logits.float(), dim=-1)
    return params_probs(logits[None], params)[0]


def children(q: torch.Tensor, params: SamplingParams, generator, pos: int) -> list[int]:
    """Up to WIDTH distinct child tokens of a node whose children sit at sequence position ``pos``."""
    top = [int(t) for t in torch.topk(q, min(WIDTH, q.shape[0])).indices if q[t] > 0]
    if isinstance(generator, SeededNoise) and not params.greedy:
        first = int(generator.choose(q[None], pos)[0])
        top = [first] + [t for t in top if t != first][: WIDTH - 1]
    return top or [int(q.argmax())]


def grow(proposer, items: list[tuple[int, DraftRequest]]) -> tuple[dict[int, Draft | None], dict[int, GrownTree]]:
    """Trees for ``items`` ((request index, request) pairs with small backlogs); returns the drafts by
    request index and, by sequence id, what ``accept`` needs."""
    lanes: list[_Growth] = []
    for i, r in items:
        slot = proposer._slot[r.seq_id]
        lanes.append(_Growth(i, r, slot, len(r.tokens) - 1, [r.tokens[-1]]))
    roots = _feed_roots(proposer, lanes)
    for g, q in zip(lanes, roots):
        if q is not None:
            g.frontier = [(0, q)]
    for level in range(1, max(g.req.k for g in lanes) + 1):
        growing = [g for g in lanes if not g.failed and g.frontier and level <= g.req.k]
        if not growing:
            break
        for g in growing:
            _add_level(g, level)
            _prune_frontier(g, g.req.max_nodes)
            if level == g.req.k or g.root_pos + len(g.stored) + len(g.frontier) > proposer.max_len:
                g.frontier = []  # the last level, or one the cache cannot hold: grown, not fed
        _feed_frontier(proposer, [g for g in growing if g.frontier])
    drafts, grown = {}, {}
    for g in lanes:
        proposer._proposal_start[g.req.seq_id] = len(g.req.tokens)
        if g.failed or len(g.tokens) == 1:  # (an empty draft still reports its catch-up)
            drafts[g.index] = Draft([], None, catch_up_seconds=g.catch_up_seconds,
                                    catch_up_tokens=g.catch_up_tokens) if g.catch_up_tokens else None
            continue
        tree, kept = _best_nodes(g, g.req.max_nodes)
        grown[g.req.seq_id] = GrownTree(g.root_pos, kept, {n: i for i, n in enumerate(g.stored)})
        drafts[g.index] = Draft(tokens=tree.tokens[1:].tolist(), probs=None, tree=None if tree.is_chain else tree,
                                catch_up_seconds=g.catch_up_seconds, catch_up_tokens=g.catch_up_tokens)
    return drafts, grown


def _feed_roots(proposer, lanes: list[_Growth]) -> list[torch.Tensor | None]:
    """Feed each sequence's unseen tokens (at least its last) in one forward: the roots' children's q.
    A lane with a backlog (tokens decoded while the draft sat out, beyond a step's usual one or two)
    reports its share of that forward as catch-up, as a chain's draft does: counted as drafting, a
    backlog makes trees look costly after plain steps, and the next steps stay plain."""
    tokens, segments, last, backlog = [], [], [], []
    for g in lanes:
        fed = min(proposer._fed[g.req.seq_id], g.root_pos)
        pending = g.req.tokens[fed:]
        segments.append(Segment(g.slot, fed, len(pending), row_start=len(tokens)))
        tokens += pending
        last.append(len(tokens) - 1)
        if proposer.backlog(g.req.seq_id, g.req.tokens) > 0:
            backlog.append((g, len(pending)))
    # a backlog goes through the prefill path, unless row-exact costs nothing there (prefix_windows)
    few = all(s.length <= FEW_ROWS for s in segments) or bool(proposer._windows()[1])
    t0 = time.perf_counter()
    try:
        logits = proposer.model(torch.tensor(tokens), segments, proposer.cache, logit_rows=torch.tensor(last),
                                row_exact=few, head=proposer._head_for([g.req.seq_id for g in lanes])).logits
    except CacheFullError:
        for g in lanes:
            g.failed = True
        return [None] * len(lanes)
    for g, n in backlog:
        g.catch_up_seconds, g.catch_up_tokens = (time.perf_counter() - t0) / len(backlog), n
    out = []
    for j, g in enumerate(lanes):
        proposer._fed[g.req.seq_id] = g.root_pos + 1
        out.append(draft_distribution(logits[j], g.req.params))
    return out


def _add_level(g: _Growth, level: int) -> None:
    """Children of the frontier, ranked by path score and appended best first."""
    new = []
    for node, q in g.frontier:
        for t in children(q, g.req.params, g.req.generator, g.root_pos + level):
            new.append((g.scores[node] + math.log(max(float(q[t]), 1e-30)), node, t))
    new.sort(key=lambda c: -c[0])
    first = len(g.tokens)
    for score, parent, token in new:
        g.tokens.append(token)
        g.parents.append(parent)
        g.scores.append(score)
    g.frontier = [(n, None) for n in range(first, min(first + WIDTH, len(g.tokens)))]


def _prune_frontier(g: _Growth, budget: int) -> None:
    """Drop the frontier nodes already outside the ``budget`` best nodes grown so far. Nodes only
    join, so such a node's rank only falls, and a child never ranks above its parent (its score
    adds a log-probability <= 0, its growth index is larger): neither the node nor anything grown
    below it can be kept. Feeding it would cost draft rows for nothing, and the kept tree is the
    same without it. A level's nodes rank in growth order, so the survivors stay a contiguous range."""
    if len(g.tokens) - 1 <= budget:
        return
    last = sorted((-g.scores[n], n) for n in range(1, len(g.tokens)))[budget - 1]
    g.frontier = [(n, q) for n, q in g.frontier if (-g.scores[n], n) <= last]


def _feed_frontier(proposer, lanes: list[_Growth]) -> None:
    """One forward over every lane's frontier, stored after the lane's fed nodes: their children's q.
    A cache out of room (a paged cache's shared blocks) ends the lanes' growth; the trees grown so
    far stay valid proposals."""
    if not lanes:
        return
    tokens, segments = [], []
    for g in lanes:
        segments.append(Segment(g.slot, g.root_pos, len(g.frontier), row_start=len(tokens), tree=g.storage_tree(),
                                tree_first=len(g.stored)))
        tokens += [g.tokens[n] for n, _ in g.frontier]
    try:
        logits = proposer.model(torch.tensor(tokens), segments, proposer.cache, row_exact=True,
                                head=proposer._head_for([g.req.seq_id for g in lanes])).logits  # [rows, vocab]
    except CacheFullError:
        for g in lanes:
            g.frontier = []
        return
    for g, seg in zip(lanes, segments):
        rows = logits[seg.row_start : seg.row_start + seg.length]
        g.stored += [n for n, _ in g.frontier]
        g.frontier = [(n, draft_distribution(rows[j], g.req.params)) for j, (n, _) in enumerate(g.frontier)]


def _best_nodes(g: _Growth, budget: int) -> tuple[TokenTree, list[int]]:
    """The ``budget`` best-scoring nodes (and the root) as a tree; their growth indices."""
    ranked = sorted(range(1, len(g.tokens)), key=lambda n: (-g.scores[n], n))[:budget]
    kept = [0] + sorted(ranked)  # parents precede children: growth order is topological
    where = {n: i for i, n in enumerate(kept)}
    parents = [-1] + [where[g.parents[n]] for n in kept[1:]]
    tree = TokenTree(torch.tensor([g.tokens[n] for n in kept]), torch.tensor(parents))
    return tree, kept


def accept_path(proposer, seq_id: int, grown: GrownTree, path: list[int]) -> None:
    """Keep the accepted path's fed prefix in the draft cache, in sequence order."""
    sources = []
    for node in path:
        offset = grown.stored_at.get(grown.growth_index[node])
        if offset is None:
            break
        sources.append(offset)
    slot = proposer._slot[seq_id]
    proposer.cache.compact(slot, grown.root_pos, sources)
    proposer._fed[seq_id] = grown.root_pos + 1 + len(sources)
    proposer.cache.truncate(slot, proposer._fed[seq_id])


__all__ = ["grow", "accept_path", "GrownTree", "WIDTH", "children", "draft_distribution"]
