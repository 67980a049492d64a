"""Adaptive draft length: choose k each step to maximise expected tokens per second.

Model (docs/METRICS.md): with conditional acceptance b_i = P(draft i accepted | drafts 1..i-1 accepted),
a step that drafts k tokens yields E(k) = 1 + sum_{i<=k} prod_{j<=i} b_j tokens per sequence.
Its cost is the draft's time for k tokens plus one target forward over ``batch * (k + 1)`` rows.
All three figures are measured while running: b_i as exponentially forgotten hit / trial counts
with a weak prior (so a few observations already count; a position never drafted yet is guessed
like the deepest measured one), the draft's seconds per token, and the target's
seconds per forward as a function of the rows it computes, plus what a step spends outside
those forwards -- the cost tables of ``costs.py`` (medians of recent observations, predicted for
sizes never measured), which this controller extends.
Turning speculation on for sequences the draft has not followed (a prompt whose draft prefill was
skipped, tokens decoded plainly meanwhile) first costs a catch-up: the draft feeding that backlog,
measured in seconds per token. It is an investment, made only when the predicted time saved over
the tokens the batch may still generate exceeds it.
When no k beats plain decoding, the step decodes plainly; every ``probe_every`` plain steps it
drafts once with a small k, so a change in the text (a copy-heavy passage) is noticed -- unless
even full acceptance could not pay at this batch size, or the draft would first have to catch up
on more than two plain steps' worth of time and (for one sequence) more than ``explore_share`` of
the time decoded plainly since the last draft. For one sequence a probe is also made, whatever the
figures predict, once its extra cost over a plain step fits that share: figures measured at a bad
moment (a draft cost timed through a stall) cannot lock speculation out, and exploring costs at most
that share where speculation truly does not pay. A probe that first catches the draft up still
times the tokens drafted after the catch-up's forward (``observe_draft_after_catch_up``): plain
steps never time the draft, so probes are what re-measure its cost.
While drafting, every ``probe_every`` steps it tries one step with k - 1 or k + 1 (alternately),
so the neighbours' costs stay measured and an early noisy figure cannot pin k.

**Token trees** (``choose_step``, with a tree budget and ``tree="auto"``): a step is plain, a chain
of k or a tree of at most N drafted nodes, k levels deep -- whichever is predicted the most tokens
per second (the trees weighed by ``tree_budget.TreePlanner`` against this module's chain figures).
A tree's yield and draft cost come from ``tree_budget.TreeModel`` (acceptance by depth
and sibling rank, measured on tree steps only, with priors that let trees be tried); its forward
cost is measured by rows on tree steps, the chain's rows -> seconds figures (flat where the machine
is memory-bound, trees nearly free there; steep on an AVX2 CPU, chains win) standing in, scaled by
the measured tree / chain ratio, where a row count has not held a tree yet; what a tree step spends
beyond its forwards (walking and compacting the tree) is measured apart from a chain step's. Every
``tree_probe_every`` drafting steps the best option of the kind not chosen is tried once, so both
stay measured. ``tree="on"``: always a tree of the whole budget, k chosen as for a chain (its
acceptance counted by depth); ``"off"``: chains.

How a proposer feeds it (the engine does this, handing each step's ``StepReport`` to
``observe_step_report``): the proposer says it can draft trees with a ``drafts_trees = True``
attribute (else its steps are chains); its drafting time is timed around ``propose_many`` and
given as ``observe_draft`` (chains: seconds per drafted token) or ``observe_tree_draft`` (trees:
seconds per level) -- a proposer that drafts for free measures as free; verified steps come back
as ``observe_acceptance`` (chains) or ``observe_tree`` (the tree's parents and accepted path).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenleap.spec.confidence import chain_floors
from tokenleap.spec.costs import CostTables
from tokenleap.spec.tree_budget import StepPlan, TreeModel, TreePlanner

if TYPE_CHECKING:
    from tokenleap.spec.report import DraftWork, StepReport


@dataclass(frozen=True)
class ControllerConfig:
    max_k: int = 8
    fixed_k: int | None = None  # a fixed draft length disables adaptation
    prior_acceptance: float = 0.6
    ema: float = 0.15  # forgetting rate of acceptance counts
    cost_window: int = 5  # a cost is the median of its last this-many observations
    initial_k: int = 4  # the first step's draft length, before any cost is measured
    prior_weight: float = 0.5  # observations' worth of prior_acceptance in each b_i
    probe_every: int = 16
    probe_k: int = 2
    # for one sequence, a probe whose draft must first catch up on more than two plain steps' worth
    # of tokens (a new prompt, after speculation was judged not to pay) is made once that catch-up
    # is at most this fraction of the time decoded plainly since the last draft: acceptance and
    # costs measured at a bad moment cannot switch speculation off for good; exploring costs at
    # most this share
    explore_share: float = 0.05
    # with several sequences, draft only when predicted at least this much faster than plain: the
    # per-step model leaves out costs that grow with load (the draft prefilling newcomers and
    # catching up after plain stretches, noisier cost figures); following predictions of ~1.1x
    # measured 0.8x in the serving benchmark
    batch_margin: float = 0.15
    # with a tree budget: "on" always trees of the whole budget, "auto" plain / chain / tree by
    # predicted tokens per second, "off" chains only
    tree: str = "on"
    tree_probe_every: int = 32  # drafting steps between tries of the kind (chain / tree) not chosen
    # ... and a try waits until it is predicted to cost at most this share of the time decoded since
    # the last one (a tree whose rows cost, on an AVX2 CPU, is tried rarely)
    tree_explore_share: float = 0.02
    # a tree replaces the best chain only when predicted this much faster: its figures are noisier
    # (more rows, a shape the proposer decides), and a near tie is not worth a tree's risk
    tree_margin: float = 0.05
    # a draft model's chain (an adaptive k) stops early where the draft's own confidence says the
    # next token would not pay for itself (spec/confidence.py); k is then the longest it may run
    confidence_stop: bool = True


class DraftLengthController(CostTables):
    def __init__(self, config: ControllerConfig) -> None:
        super().__init__(config.cost_window)
        self.cfg = config
        # rows the proposer adds to a drafting step's forward: set by the engine to the most it may
        # add, then following the mean of what drafting steps added (observe_aux_rows)
        self.aux_rows = 0
        self._aux_mean: float | None = None
        self.accept = [config.prior_acceptance] * config.max_k  # conditional b_i
        # exponentially forgotten counts behind accept[i]: (hits + prior weight) / (trials + weight)
        self._hits = [0.0] * config.max_k
        self._trials = [0.0] * config.max_k
        self._plain_streak = 0
        self._plain_seconds = 0.0  # predicted time decoded plainly since the last step that drafted
        self._spec_streak, self._side = 0, 1
        # the proposer can end a chain where its draft's confidence no longer pays (set by the engine):
        # with confidence_stop and an adaptive k, a drafting step's k is then the longest it may run
        self.stops_on_confidence = False
        self.trees = TreeModel(config.max_k)  # token trees' acceptance, shape and draft cost
        self.planner = TreePlanner(self.trees, config.tree_margin, config.tree_probe_every, config.tree_explore_share)

    # -- choosing ---------------------------------------------------------------------------
    def choose(self, batch: int = 1, backlog: int = 0, remaining: float = float("inf")) -> int:
        """The draft length for a step of ``batch`` sequences drafting chains (``choose_step``)."""
        return self.choose_step(batch, backlog, remaining).k

    def choose_step(self, batch: int = 1, backlog: int = 0, remaining: float = float("inf"),
                    max_nodes: int = 0, mode: str | None = None) -> StepPlan:
        """The next step's plan for ``batch`` sequences; ``backlog``: tokens the draft must catch up
        on before drafting for them, ``remaining``: tokens they may still generate, ``max_nodes``:
        the tree budget the engine allows (0: chains only), ``mode``: overrides ``cfg.tree``."""
        mode = (mode or self.cfg.tree) if max_nodes > 0 else "off"
        on = max_nodes if mode == "on" else 0  # "on": every drafting step a tree of the whole budget
        trees = max_nodes if mode == "auto" else 0
        if self.cfg.fixed_k is not None:
            if trees and self.forward_cost:
                return self.planner.fixed_depth_plan(self, batch, trees, self.cfg.fixed_k)
            return StepPlan(self.cfg.fixed_k, on)
        if not self.forward_cost:  # nothing measured yet: a middling first chain
            return StepPlan(min(self.cfg.initial_k, self.cfg.max_k), on)
        plain = self.rate(0, batch)
        best, best_rate = self.planner.best_plan(self, batch, trees)
        if best.k and not self._pays_back(plain, best_rate, backlog, remaining, batch):
            best = StepPlan(0)
        if best.k == 0:
            return self._plain_or_probe(batch, plain, backlog, on)
        self._plain_streak = 0
        self._plain_seconds = 0.0
        self._spec_streak += 1
        if trees:  # the other kind, now and then
            if best.nodes == 0:
                other = self._best_tree(batch, trees)[0]
            else:
                other = StepPlan(max(1, self.best_chain(batch, 0.0)[0]))
            if self.planner.probe_due(self, best, other, batch):
                return other
        if self.cuts_on_confidence and best.nodes == 0 and not on:  # the draft's confidence ends the chain
            return self.confident_chain(best.k, best_rate, batch)
        if self._spec_streak >= self.cfg.probe_every:  # re-measure a neighbouring length now and
            self._spec_streak = 0  # then, so an early, noisy cost figure cannot lock k in place
            self._side = -self._side
            if 1 <= best.k + self._side <= self.cfg.max_k:
                return StepPlan(best.k + self._side, best.nodes or on)
        return StepPlan(best.k, best.nodes or on)

    def _plain_or_probe(self, batch: int, plain: float, backlog: int, on: int) -> StepPlan:
        """A plain step -- or, every ``probe_every`` plain steps, a probe with a small k (module
        docstring); ``plain``: plain decoding's predicted rate, ``on``: "on" mode's tree budget."""
        self._plain_streak += 1
        self._plain_seconds += batch / plain
        probe_k = min(self.cfg.probe_k, self.cfg.max_k)
        # a probe is cheap information unless the draft must first catch up on more than a
        # couple of plain steps' worth of tokens (e.g. prompts whose draft prefill was skipped):
        # then only within the exploration share of the time decoded plainly meanwhile
        catch_up = self.catch_up_seconds(backlog)
        # (one sequence only: batched speculation rarely pays here, a loaded server keeps its floor)
        explore = self.cfg.explore_share * self._plain_seconds if batch == 1 else 0.0
        affordable = catch_up <= max(2 * batch / plain, explore)
        # a probe even full acceptance could not pay for is still made once it, catch-up included,
        # fits the exploration share (one sequence): a draft cost timed through a stall (a page
        # fault, another process) is otherwise never measured again and rules speculation out for good
        if self._plain_streak >= self.cfg.probe_every and (
                (affordable and self.could_pay(batch))
                or (batch == 1 and catch_up + self.step_cost(probe_k, 1) - 1.0 / plain <= explore)):
            self._plain_streak = 0
            self._plain_seconds = 0.0
            return StepPlan(probe_k, on)
        return StepPlan(0)

    def new_text(self) -> None:
        """A request starts on an otherwise idle engine: the chain's acceptance learned so far
        describes other requests' text, not this one's, so it restarts from the prior (the costs,
        the machine's, are kept). Carried over, a chat prompt's low acceptance would keep the
        draft from drafting, or even prefilling, for a code prompt after it that it drafts well."""
        self._hits = [0.0] * self.cfg.max_k
        self._trials = [0.0] * self.cfg.max_k
        self.accept = [self.cfg.prior_acceptance] * self.cfg.max_k

    def could_pay(self, batch: int = 1) -> bool:
        """Whether drafting could beat plain decoding at all, were every draft accepted (True
        before anything is measured)."""
        if not self.forward_cost:
            return True
        return self._could_pay(min(self.cfg.probe_k, self.cfg.max_k), batch, self.rate(0, batch) * self._margin(batch))

    def would_speculate(self, batch: int = 1, backlog: int = 0, remaining: float = float("inf"),
                        max_nodes: int = 0) -> bool:
        """Whether some chain (or, with a tree budget in "auto" mode, some tree) is currently
        predicted to beat plain decoding after paying for a ``backlog`` the draft must feed first
        (no probing, no state change)."""
        if self.cfg.fixed_k is not None:
            return self.cfg.fixed_k > 0
        best, best_rate = self.planner.best_plan(self, batch, max_nodes if self.cfg.tree == "auto" else 0)
        return best.k > 0 and self._pays_back(self.rate(0, batch), best_rate, backlog, remaining, batch)

    def best_chain(self, batch: int, floor: float | None = None) -> tuple[int, float]:
        """The k > 0 with the highest predicted rate if it beats ``floor`` (default: plain by the
        batch margin), else (0, floor)."""
        best_k, best_rate = 0, self.rate(0, batch) * self._margin(batch) if floor is None else floor
        for k in range(1, self.cfg.max_k + 1):
            r = self.rate(k, batch)
            if r > best_rate * 1.0001:
                best_k, best_rate = k, r
        return best_k, best_rate

    def _best_tree(self, batch: int, max_nodes: int) -> tuple[StepPlan | None, float]:
        """The best tree at ``batch`` within ``max_nodes`` and its rate (``TreePlanner.best_tree``)."""
        return self.planner.best_tree(self, batch, max_nodes)

    def _plan_cost(self, plan: StepPlan, batch: int) -> float:
        """Predicted seconds of a step following ``plan`` (``TreePlanner.plan_cost``)."""
        return self.planner.plan_cost(self, plan, batch)

    @property
    def cuts_on_confidence(self) -> bool:
        """Whether drafting chains end on the draft's confidence (``confident_chain``)."""
        return self.stops_on_confidence and self.cfg.confidence_stop and self.cfg.fixed_k is None

    def confident_chain(self, k: int, rate: float, batch: int = 1) -> StepPlan:
        """A chain planned at ``k`` tokens and ``rate`` tokens per second that runs as far as
        ``confidence.chain_floors`` allows while its draft's confidence pays for each further token
        (with this controller's figures): the draft then decides where the chain ends."""
        cap, floors, draft_floor = chain_floors(k, self.cfg.max_k, batch, self.predict_draft(batch),
                                                self.predict_forward, rate, self.chain_acceptance())
        return StepPlan(cap, floors=floors, draft_floor=draft_floor, planned=k) if floors else StepPlan(k)

    def chain_acceptance(self) -> list[float]:
        """The chain's conditional acceptance by depth; a position never drafted is guessed like the
        deepest one measured (acceptance changes slowly along a draft), so high acceptance invites
        trying longer drafts."""
        out, last = [], self.cfg.prior_acceptance
        for i in range(self.cfg.max_k):
            last = self.accept[i] if self._trials[i] > 0 else last
            out.append(last)
        return out

    def _pays_back(self, plain_rate: float, spec_rate: float, backlog: int, remaining: float, batch: int = 1) -> bool:
        """Does speculating at ``spec_rate`` instead of ``plain_rate`` (tokens/s) over ``remaining``
        tokens save more time than the draft's catch-up on ``backlog`` tokens costs? With several
        sequences only the gain beyond ``batch_margin`` counts: the choice itself demands that
        margin of a prediction, and a catch-up spent on a gain the margin would have refused is
        lost (8 sequences on an AMX Xeon: ~2.4 s of catch-up for a predicted 1.3x that measured
        below the margin, and the server fell back to plain -- 0.78-0.85x in those rounds)."""
        cost = self.catch_up_seconds(backlog)
        if cost <= 0.0:
            return True
        spec_rate = spec_rate / self._margin(batch)
        return spec_rate > plain_rate and remaining * (1.0 / plain_rate - 1.0 / spec_rate) > cost

    def _margin(self, batch: int) -> float:
        return 1.0 + (self.cfg.batch_margin if batch > 1 else 0.0)

    def _could_pay(self, k: int, batch: int, plain_rate: float) -> bool:
        """Would drafting k tokens beat plain decoding if every draft were accepted? If not (the
        batch makes verification too costly), a probe for acceptance cannot change the choice.
        For one sequence the verification is taken at a plain step's cost: a figure for k + 1 rows
        caught at a slow moment (a fresh engine's first steps) and never measured again since would
        otherwise rule out every probe, and so its own correction, for good."""
        if batch == 1:
            cost = (k * self.predict_draft(1) + self.predict_forward(1)
                    + self.step_overhead.get((True, 1), 0.0))
            return (k + 1) / cost > plain_rate if cost > 0 else True
        return batch * (k + 1) / self.step_cost(k, batch) > plain_rate

    def expected_tokens(self, k: int) -> float:
        total, run = 1.0, 1.0
        for b in self.chain_acceptance()[:k]:
            run *= b
            total += run
        return total

    def rate(self, k: int, batch: int = 1) -> float:
        """Predicted tokens per second of a step drafting k tokens for each of ``batch`` sequences."""
        cost = self.step_cost(k, batch)
        return batch * self.expected_tokens(k) / cost if cost > 0 else float("inf")

    def step_cost(self, k: int, batch: int = 1) -> float:
        """Predicted seconds of a step drafting k tokens for each of ``batch`` sequences with this
        controller's proposer (:meth:`spec_step_cost` with its measured draft cost and ``aux_rows``)."""
        return self.spec_step_cost(k, batch, self.predict_draft(batch) if k else 0.0, self.aux_rows)

    def spec_step_cost(self, k: int, batch: int, draft_per_token: float, aux_rows: int = 0) -> float:
        """Predicted seconds of a step drafting k tokens for each of ``batch`` sequences at
        ``draft_per_token`` seconds a drafted token: drafting, one target forward over
        ``batch * (k + 1)`` rows -- plus ``aux_rows`` a sequence when the proposer attaches rows of
        its own to a drafting step (lookahead's Jacobi window) -- and the step's measured overhead.
        The bandit of ``--spec auto`` prices each of its proposers by the same formula."""
        rows = batch * (k + 1 + (aux_rows if k else 0))
        return (k * batch * draft_per_token + self.predict_forward(rows, batch == 1)
                + self.step_overhead.get((k > 0, batch), 0.0))

    # -- learning ---------------------------------------------------------------------------
    def observe_step_report(self, report: StepReport) -> None:
        """Everything a step measured (``Engine.step``'s report): the draft's catch-up and cost, the
        target forward, each sequence's acceptance (in the step's order: counts are forgotten
        exponentially), the step's overhead."""
        work = report.draft
        self.observe_catch_up(work.catch_up_tokens, work.catch_up_seconds)
        if work.tokens and not work.catch_up_seconds:  # a forward that also fed a backlog counts as
            if report.auto_tree:  # catch-up whole, leaving its drafts ~free; a tree's cost: per level
                self.observe_tree_draft(work.depth, work.seconds, batch=work.batch)
            else:
                self.observe_draft(work.tokens, work.seconds, batch=work.batch)
        elif not report.auto_tree:
            self.observe_draft_after_catch_up(work)
        self.observe_forward(report.rows, report.forward_seconds, tree=report.held_apart)
        for o in report.outcomes:
            if o.drafted and report.auto_tree:  # (a tree asked for and answered by a chain counts too)
                self.observe_tree(list(o.parents), list(o.path), report.tree_budget, report.k)
            elif o.drafted:  # a tree counts by depth: the draft length is its depth
                self.observe_acceptance(o.proposed, o.accepted)
        if report.overhead_seconds is not None:  # what the step cost beyond its timed forwards and catch-up
            self.observe_step(report.speculative, report.batch, report.overhead_seconds, tree=report.held_apart)

    def observe_draft_after_catch_up(self, work: DraftWork) -> None:
        """Price a draft token on a step that first caught up (a probe after plain steps) by the
        tokens drafted after the catch-up's forwards, for one sequence (in a batch the catch-up's
        forward drafts for the others too). Plain steps never time the draft, so without this a
        figure timed through a slow spell of the host would stay until drafting resumed -- which
        that figure itself may forbid."""
        rest = work.tokens - work.catch_up_drafted
        if work.batch == 1 and work.catch_up_drafted > 0 and rest > 0 and work.seconds > 0.0:
            self.observe_draft(rest, work.seconds, batch=1)

    def observe_forward(self, rows: int, seconds: float, tree: bool = False) -> None:
        """A target forward over ``rows`` took ``seconds`` (``tree``: it held token trees the
        controller chose -- measured apart from chains' and plain steps')."""
        if tree:
            self.trees.observe_forward(rows, seconds, self.predict_forward(rows))
        else:
            self.observe_forward_seconds(rows, seconds)

    def observe_tree(self, parents: list[int], path: list[int], budget: int, depth: int) -> None:
        """One sequence's tree step: the drafted tree's ``parents`` (a chain answered for a tree:
        ``[-1, 0, 1, ...]``), its accepted nodes ``path``, the ``budget`` and ``depth`` asked for."""
        self.trees.observe(parents, path, budget, depth, self.chain_acceptance())

    def observe_tree_draft(self, levels: int, seconds: float, batch: int = 1) -> None:
        """Trees ``levels`` deep grown for ``batch`` sequences together in ``seconds``."""
        self.trees.observe_draft(levels, seconds, batch)

    def observe_aux_rows(self, rows: float) -> None:
        """A drafting step's proposer rows per sequence (lookahead's window, attached on some steps):
        ``aux_rows`` becomes their exponentially forgotten mean, starting from the most it may add."""
        start = float(self.aux_rows) if self._aux_mean is None else self._aux_mean
        self._aux_mean = start + self.cfg.ema * (rows - start)
        self.aux_rows = round(self._aux_mean)

    def observe_acceptance(self, proposed: int, accepted: int, first: int = 0) -> None:
        """One sequence's step: positions 1..accepted passed, position accepted+1 failed (if proposed);
        positions up to ``first`` are left alone (already observed)."""
        for i in range(first, min(proposed, accepted + 1)):
            keep = 1.0 - self.cfg.ema
            self._hits[i] = self._hits[i] * keep + (1.0 if i < accepted else 0.0)
            self._trials[i] = self._trials[i] * keep + 1.0
            w = self.cfg.prior_weight
            self.accept[i] = (self._hits[i] + w * self.cfg.prior_acceptance) / (self._trials[i] + w)
