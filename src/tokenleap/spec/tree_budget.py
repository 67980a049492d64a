"""The token-tree side of the step controller: what a tree of N drafted nodes, k levels deep, is
predicted to yield and to cost -- from figures measured on tree steps only, kept apart from the
chain's (``controller.py`` weighs both against each other and against plain decoding).

**Acceptance by depth and sibling rank.** c(d, r) = P(a node at depth d that is its parent's
(r+1)-th child is accepted | its parent was accepted), as exponentially forgotten hit / trial
counts over every node whose parent lay on the accepted path (the root included). Greedy
verification accepts at most one child of a node, so these are Sequoia's positional acceptances,
per depth. Priors (a fraction of one observation, so trees get tried and a few steps decide):
rank 0 takes the chain's measured acceptance at that depth, rank r >= 1 a shrinking share of what
rank 0 leaves; a depth never measured is guessed like the one above it.

**Expected tokens.** Under those figures the best tree of N nodes at most k deep is grown best
first (a node is worth the product of c along its path; its first child and its next sibling
become candidates once it is taken), and E = 1 + the sum of the N best values -- one growth per
depth gives every N at once. A proposer does not grow that tree (a draft model ranks by its own
probabilities, an n-gram trie by counts, and either may draft fewer nodes than it may), so two
measured ratios per budget correct it: ``shape``, the value of the tree actually verified over
the best tree's value at that budget and depth (both computed from the same figures, so free of
outcome noise), and ``fill``, drafted nodes over the budget (what the forward's rows follow).

**Draft cost.** Seconds per tree level per sequence at each batch size, measured on tree steps: a
draft model grows a tree with one batched forward per level over its frontier, an n-gram trie
costs nothing. Unmeasured, the caller's figure for a chain's drafted token stands in (optimistic:
a level is never cheaper than a chain token, so trees get tried, then measured).

**Forward cost.** Seconds of the target's forwards that held trees, by row count, apart from the
chain's figures (tree attention, its per-row key lists and compaction need not cost what a chain's
rows do). A row count not measured on trees is the chain's prediction for it times the median ratio
measured tree / chain-predicted seconds (1 before any tree ran), and never more than a larger tree
measured.

**Planning** (:class:`TreePlanner`): the tree (budget N, depth k) with the most predicted tokens
per second, weighed against the best chain the controller's cost model offers (a tree must beat
it by a margin), and now and then a try of the kind not chosen, within an exploration share of
the time decoded since the last try.
"""
from __future__ import annotations

import heapq
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Protocol

# Tree budgets weighed (and the maximum). A tree's forward holds its root too, so a budget of N
# drafted nodes is N + 1 rows: these make 4, 6, 8, 12, 16, 24, 32 ... rows, the counts the
# products split into without a mostly empty group (AMX tiles take 16 rows at a time: 17 rows of
# the bf16 target cost 8% more than 16, of the int4 target 32% more, on the Xeon).
_BUDGETS = (2, 3, 5, 7, 11, 15, 23, 31, 47, 63, 95, 127, 191, 255)


@dataclass(frozen=True)
class StepPlan:
    """One step's shape: ``k`` drafted tokens (a tree: levels; 0: plain decoding) and ``nodes`` > 0
    for a token tree of at most that many drafted nodes (0: a chain). ``floors``, ``draft_floor``: a
    chain that may stop short of k on its draft's confidence (``DraftRequest.stop_below``,
    ``stop_draft``; empty: k tokens), ``planned``: the length the cost model chose for it."""

    k: int
    nodes: int = 0
    floors: tuple[float, ...] = ()
    draft_floor: float = 0.0
    planned: int = 0


class ChainCosts(Protocol):
    """What tree planning asks of the chain's cost model (``controller.DraftLengthController``)."""

    step_overhead: dict

    def rate(self, k: int, batch: int = 1) -> float: ...

    def step_cost(self, k: int, batch: int = 1) -> float: ...

    def predict_draft(self, batch: int) -> float: ...

    def predict_forward(self, rows: int, explore: bool = False) -> float: ...

    def chain_acceptance(self) -> list[float]: ...

    def best_chain(self, batch: int, floor: float | None = None) -> tuple[int, float]: ...


def depths_and_ranks(parents: list[int]) -> list[tuple[int, int]]:
    """Each node's (depth, sibling rank) in a tree given by ``parents`` (``parents[0] == -1``,
    children listed in the order they rank); the root is (0, 0)."""
    out, seen = [(0, 0)], [0] * len(parents)
    for p in parents[1:]:
        out.append((out[p][0] + 1, seen[p]))
        seen[p] += 1
    return out


class TreeModel:
    """Measured acceptance, shape and draft cost of token trees (see the module docstring)."""

    def __init__(self, max_depth: int, max_rank: int = 4, ema: float = 0.15, prior_weight: float = 0.5,
                 sibling_prior: float = 0.35, window: int = 5) -> None:
        self.max_depth, self.max_rank = max_depth, max_rank
        self.ema, self.prior_weight, self.sibling_prior, self.window = ema, prior_weight, sibling_prior, window
        self._hits = [[0.0] * max_rank for _ in range(max_depth)]  # [depth - 1][rank]
        self._trials = [[0.0] * max_rank for _ in range(max_depth)]
        self._shape: dict[int, deque[float]] = {}  # budget -> recent actual / best tree values
        self._fill: dict[int, deque[float]] = {}  # budget -> recent drafted nodes / budget
        self.draft_cost_at: dict[int, float] = {}  # batch -> seconds per level per sequence
        self._draft_obs: dict[int, deque[float]] = {}
        self.forward_cost: dict[int, float] = {}  # rows -> seconds of forwards that held trees
        self._forward_obs: dict[int, deque[float]] = {}
        self._vs_chain: deque[float] = deque(maxlen=4 * window)  # measured / chain-predicted seconds

    # -- figures ----------------------------------------------------------------------------
    def acceptance(self, chain: list[float]) -> list[list[float]]:
        """c[d - 1][r] for d in 1..max_depth; ``chain[i]``: the chain's conditional acceptance at
        depth i + 1 (rank 0's prior)."""
        table, w = [], self.prior_weight
        for d in range(self.max_depth):
            row = []
            for r in range(self.max_rank):
                if r == 0:
                    prior = chain[d] if d < len(chain) else (chain[-1] if chain else 0.5)
                else:  # a shrinking share of what the better-ranked siblings leave
                    prior = max(0.0, 1.0 - sum(row)) * self.sibling_prior
                if self._trials[d][r] > 0:
                    row.append((self._hits[d][r] + w * prior) / (self._trials[d][r] + w))
                elif d > 0 and self._trials[d - 1][r] > 0:  # unmeasured: like the depth above
                    row.append(table[d - 1][r])
                else:
                    row.append(prior)
            table.append(row)
        return table

    def best_values(self, c: list[list[float]], nodes: int, depth: int) -> list[float]:
        """Prefix sums: [n] = the value of the best tree of n nodes at most ``depth`` deep (n <= nodes)."""
        heap = [(-c[0][0], 1, 0, 1.0)]  # (-value, depth, rank, parent's value)
        sums = [0.0]
        while heap and len(sums) <= nodes:
            neg, d, r, parent = heapq.heappop(heap)
            sums.append(sums[-1] - neg)
            if d < depth:
                heapq.heappush(heap, (neg * c[d][0], d + 1, 0, -neg))
            if r + 1 < self.max_rank:
                heapq.heappush(heap, (-parent * c[d - 1][r + 1], d, r + 1, parent))
        sums += [sums[-1]] * (nodes + 1 - len(sums))  # deeper trees are cut: more nodes add nothing
        return sums

    def tree_value(self, c: list[list[float]], parents: list[int]) -> float:
        """Expected accepted drafted nodes of a given tree under ``c`` (ranks past max_rank: none)."""
        value = [1.0] * len(parents)
        for i, (d, r) in enumerate(depths_and_ranks(parents)):
            if i:
                ok = d <= self.max_depth and r < self.max_rank
                value[i] = value[parents[i]] * c[d - 1][r] if ok else 0.0
        return sum(value[1:])

    def shape(self, budget: int) -> float:
        return self._ratio(self._shape, budget)

    def fill(self, budget: int) -> float:
        return self._ratio(self._fill, budget)

    def _ratio(self, table: dict[int, deque[float]], budget: int) -> float:
        """The median measured at ``budget``, else at the nearest budget measured, else 1."""
        if not table:
            return 1.0
        key = budget if budget in table else min(table, key=lambda b: (abs(b - budget), b))
        return statistics.median(table[key])

    def expected_tokens(self, c: list[list[float]], budgets: list[int], depth: int) -> dict[int, float]:
        """Tokens a step is predicted to emit for each budget in ``budgets`` at ``depth``."""
        sums = self.best_values(c, max(budgets), depth)
        return {n: 1.0 + self.shape(n) * sums[n] for n in budgets}

    def predict_draft(self, batch: int, chain_cost: float) -> float:
        """Seconds per level per sequence at ``batch``: measured, else the nearest smaller batch's,
        else ``chain_cost`` (the chain's seconds per drafted token)."""
        known = self.draft_cost_at
        if batch in known:
            return known[batch]
        smaller = [b for b in known if b < batch]
        return known[max(smaller)] if smaller else max(chain_cost, known[min(known)] if known else 0.0)

    def predict_forward(self, rows: int, chain_guess: float) -> float:
        """Seconds of a forward over ``rows`` holding trees; ``chain_guess``: the chain's prediction."""
        guess = self.forward_cost.get(rows)
        if guess is None:
            guess = chain_guess * (statistics.median(self._vs_chain) if self._vs_chain else 1.0)
        return min([guess] + [c for r, c in self.forward_cost.items() if r > rows])

    # -- learning ---------------------------------------------------------------------------
    def observe_forward(self, rows: int, seconds: float, chain_guess: float) -> None:
        """A forward over ``rows`` that held trees took ``seconds``; the chain predicted ``chain_guess``."""
        self._push(self._forward_obs, rows, seconds)
        self.forward_cost[rows] = statistics.median(self._forward_obs[rows])
        if chain_guess > 0:
            self._vs_chain.append(seconds / chain_guess)

    def observe(self, parents: list[int], path: list[int], budget: int, depth: int, chain: list[float]) -> None:
        """A verified tree step: ``parents`` of the drafted tree (a chain answered for a tree:
        ``[-1, 0, 1, ...]``), its accepted nodes ``path``, the ``budget`` and ``depth`` it was asked for."""
        c = self.acceptance(chain)
        best = self.best_values(c, budget, min(depth, self.max_depth))[budget]
        if best > 0:
            self._push(self._shape, budget, min(1.0, self.tree_value(c, parents) / best))
        self._push(self._fill, budget, min(1.0, (len(parents) - 1) / budget))
        on_path = {0, *path}
        keep = 1.0 - self.ema
        for i, (d, r) in enumerate(depths_and_ranks(parents)):
            if i == 0 or parents[i] not in on_path or d > self.max_depth or r >= self.max_rank:
                continue
            self._hits[d - 1][r] = self._hits[d - 1][r] * keep + (1.0 if i in on_path else 0.0)
            self._trials[d - 1][r] = self._trials[d - 1][r] * keep + 1.0

    def observe_draft(self, levels: int, seconds: float, batch: int) -> None:
        """A tree of ``levels`` grown for each of ``batch`` sequences together in ``seconds``."""
        if levels > 0:
            self._push(self._draft_obs, batch, seconds / (levels * batch))
            self.draft_cost_at[batch] = statistics.median(self._draft_obs[batch])

    def _push(self, table: dict[int, deque[float]], key: int, value: float) -> None:
        table.setdefault(key, deque(maxlen=self.window)).append(value)


class TreePlanner:
    """Trees weighed against chains, from a :class:`TreeModel`'s figures and the chain's cost model
    (see the module docstring); ``margin``: how much faster a tree must be predicted to replace the
    best chain, ``probe_every`` / ``explore_share``: how often the kind not chosen is tried."""

    def __init__(self, model: TreeModel, margin: float, probe_every: int, explore_share: float) -> None:
        self.model = model
        self.margin, self.probe_every, self.explore_share = margin, probe_every, explore_share
        self._streak, self._seconds = 0, 0.0  # drafting steps and predicted seconds since the last try

    def best_plan(self, chain: ChainCosts, batch: int, max_nodes: int) -> tuple[StepPlan, float]:
        """The best of plain (by the batch margin), every chain and, with ``max_nodes``, every tree."""
        k, rate = chain.best_chain(batch)
        tree, tree_rate = self.best_tree(chain, batch, max_nodes) if max_nodes else (None, 0.0)
        if tree is not None and tree_rate > rate * (1.0 + self.margin):
            return tree, tree_rate
        return StepPlan(k), rate

    def fixed_depth_plan(self, chain: ChainCosts, batch: int, max_nodes: int, k: int) -> StepPlan:
        """A fixed draft length ``k`` with a tree budget: the chain or the tree of that depth
        predicted faster, the other tried every ``probe_every`` steps."""
        tree, tree_rate = self.best_tree(chain, batch, max_nodes, depths=(k,))
        best = tree if tree is not None and tree_rate > chain.rate(k, batch) * (1.0 + self.margin) else StepPlan(k)
        other = StepPlan(k) if best.nodes else tree
        return other if self.probe_due(chain, best, other, batch) else best

    def probe_due(self, chain: ChainCosts, best: StepPlan, other: StepPlan | None, batch: int) -> bool:
        """Is it time to try ``other`` (the kind not chosen) instead of ``best``? Every
        ``probe_every`` drafting steps, once what it is predicted to cost beyond ``best`` is at
        most ``explore_share`` of the time decoded since the last try."""
        self._streak += 1
        self._seconds += self.plan_cost(chain, best, batch)
        if other is None or self._streak < self.probe_every:
            return False
        extra = self.plan_cost(chain, other, batch) - self.plan_cost(chain, best, batch)
        if extra > self.explore_share * self._seconds:
            return False
        self._streak, self._seconds = 0, 0.0
        return True

    def plan_cost(self, chain: ChainCosts, plan: StepPlan, batch: int) -> float:
        """Predicted seconds of a step following ``plan``."""
        if not plan.nodes:
            return chain.step_cost(plan.k, batch)
        return plan.k * self.level_cost(chain, batch) + self.forward_cost(chain, plan.nodes, batch)

    def level_cost(self, chain: ChainCosts, batch: int) -> float:
        """Predicted seconds of one tree level's drafting for ``batch`` sequences."""
        return batch * self.model.predict_draft(batch, chain.predict_draft(batch))

    def best_tree(self, chain: ChainCosts, batch: int, max_nodes: int, depths=None) -> tuple[StepPlan | None, float]:
        """The tree (budget N <= ``max_nodes``, depth k) with the highest predicted rate, and that rate."""
        budgets = [n for n in _BUDGETS if n < max_nodes] + [max_nodes]
        c = self.model.acceptance(chain.chain_acceptance())
        costs = {n: self.forward_cost(chain, n, batch) for n in budgets}
        level = self.level_cost(chain, batch)
        best, best_rate = None, 0.0
        for k in depths or range(1, self.model.max_depth + 1):
            tokens = self.model.expected_tokens(c, budgets, k)
            for n in budgets:
                if n <= k:  # no more nodes than levels: a chain's shape at best -- that is the chain's option
                    continue
                cost = k * level + costs[n]
                r = batch * tokens[n] / cost if cost > 0 else float("inf")
                if r > best_rate * 1.0001:
                    best, best_rate = StepPlan(k, n), r
        return best, best_rate

    def forward_cost(self, chain: ChainCosts, nodes: int, batch: int) -> float:
        """Seconds of a tree step's target forward and overhead at budget ``nodes`` (rows: the
        root and the nodes the proposer is measured to fill)."""
        rows = batch * (1 + max(1, round(self.model.fill(nodes) * nodes)))
        overhead = chain.step_overhead.get(("tree", batch), chain.step_overhead.get((True, batch), 0.0))
        # (the chain's figures without their optimism for unmeasured longer blocks: a tree is tried
        # where the rows measured so far say it may pay, or when probed)
        return self.model.predict_forward(rows, chain.predict_forward(rows)) + overhead


def machine_tree_mode(mode: str) -> str:
    """What ``--spec-tree`` ``mode`` means on this machine. ``auto`` weighs trees per step only where
    the target's multi-row verification is flat (bf16 / int products on AMX tiles: 16 rows cost about
    one); on a CPU without AMX every extra row costs, and trees measured slower end to end than
    chains there (BENCHMARKS §1), while a per-step choice fed noisy row costs still tried them -- so
    ``auto`` drafts chains. ``on`` / ``off`` are taken as given."""
    if mode != "auto":
        return mode
    from tokenleap import kernels

    return "auto" if kernels.amx_available() else "off"
