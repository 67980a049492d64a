"""What speculation costs on this machine, as measured while running: the draft's seconds per
drafted token by batch size, the target's seconds per forward by the rows it computes, what a step
spends outside those forwards (speculative and plain steps apart, per batch size), and the draft's
seconds per token fed outside drafting (a catch-up). ``controller.DraftLengthController`` decides
with these tables; ``bandit.Bandit`` prices each proposer of ``--spec auto`` with one each.

Each cost is the median of its last few observations, so a single slow step cannot pin a figure.
A row count never measured is predicted from the measured ones: linear through the nearest two;
past the largest, for one sequence as cheap as the largest measured while at most 16 rows (so each
longer draft gets tried: one step), for several along the slope of the two largest or, if
steeper, the slope from the smallest (at least flat) -- so a batch size never measured is judged
by the row costs smaller batches measured instead of being tried blind, with every sequence's
catch-up; beyond 16 rows, where every CPU is compute-bound, at least proportionally to rows.
Costs are kept monotone in size: a block never costs more than a larger one measured, and a
batch's draft forward never less than a smaller batch's (one figure caught at a slow or fast
moment cannot tip the choice). A forward figure not measured in the last ``STALE_FORWARDS``
forwards is taken at most at the line through the nearest smaller and larger figures measured
since: this machine's speed drifts (a shared VM by 5-10% within minutes), and a figure caught in a
slow spell that nothing re-measures -- the row count of a proposer no longer chosen -- would
otherwise keep that proposer out for good. The optimistic figure gets its row count tried, which
measures it again.

The draft's figures (seconds per drafted token, per token caught up) are measured only while the
draft runs, so they go stale the same way while plain steps or another proposer run. A draft and
its target slow down and speed up together with the machine, their ratio nearly fixed
(BENCHMARKS.md, "Draft figures read at the machine's drift"). So each draft figure is read at its
drift: the target's forward figures now over what they were when the draft figure was last
measured (``drift``), for the row counts measured again since. The target's figures are those of
``speed_source``: this table's own for the engine's controller (None), the engine's controller's
for an arm of ``--spec auto``.
"""
from __future__ import annotations

import statistics
from collections import deque

_MEMORY_BOUND_ROWS = 16  # beyond this many rows an unmeasured forward is guessed at least proportional to rows
STALE_FORWARDS = 32  # a forward figure not measured in this many forwards is bounded by fresher neighbours
LONG_CATCH_UP = 16  # a catch-up of this many tokens or more measures the draft's cost per prompt token
MAX_DRIFT = 2.0  # a draft figure is scaled by the target's drift since it was measured, within [1/this, this]


class CostTables:
    """The measured cost figures and their predictions for sizes not measured (module docstring)."""

    def __init__(self, cost_window: int = 5) -> None:
        self.cost_window = cost_window  # a cost is the median of its last this-many observations
        # batch size -> seconds per drafted token (a batched draft forward serves every sequence)
        self.draft_cost_at: dict[int, float] = {}
        self.forward_cost: dict[int, float] = {}  # rows -> seconds
        self._draft_obs: dict[int, deque[float]] = {}
        self._forward_obs: dict[int, deque[float]] = {}
        self._forwards = 0  # target forwards observed
        self._forward_seen: dict[int, int] = {}  # rows -> ``_forwards`` at its last observation
        # (speculative?, batch) -> seconds a step spends outside the draft's and the target's
        # forwards (verification, bookkeeping); a catch-up is not part of it (see catch_up_cost)
        self.step_overhead: dict[tuple[bool, int], float] = {}
        self._overhead_obs: dict[tuple[bool, int], deque[float]] = {}
        self.catch_up_cost: float | None = None  # seconds per token the draft feeds outside drafting
        # seconds per token of long catch-ups (prompts) and of short ones (a few tokens: one forward's
        # fixed cost spread over them, several times a prompt token's); the long ones set the figure
        self._catch_up_obs: deque[float] = deque(maxlen=cost_window)
        self._short_catch_up_obs: deque[float] = deque(maxlen=cost_window)
        # whose forward figures the draft figures drift with (module docstring; None: this table's own)
        self.speed_source: CostTables | None = None
        self.follow_drift = True  # False: draft figures are taken as measured
        self._forward_count: dict[int, int] = {}  # rows -> forwards of that size observed
        # the speed source's forward figures (rows -> (seconds, count)) when the draft cost per drafted
        # token / per token caught up was last observed
        self._draft_mark: dict[int, tuple[float, int]] | None = None
        self._catch_up_mark: dict[int, tuple[float, int]] | None = None

    @property
    def draft_cost(self) -> float | None:
        """Seconds per drafted token when drafting for one sequence (None: not measured yet)."""
        return self.draft_cost_at.get(1)

    @draft_cost.setter
    def draft_cost(self, seconds: float) -> None:
        self._draft_obs.pop(1, None)
        self._observe(self._draft_obs, self.draft_cost_at, 1, seconds)
        self._draft_mark = self._speed_mark()

    def predict_draft(self, batch: int) -> float:
        """Seconds per drafted token at ``batch`` sequences: measured, else the nearest smaller
        batch's figure (batching only makes a token cheaper), else optimistic zero -- and never so
        low that a draft forward for ``batch`` sequences would cost less than one measured for fewer
        (a figure caught at a fast moment, or a batch measured once, cannot make drafting look cheap);
        read at the target's drift since the draft was last measured (``drift``)."""
        known = self.draft_cost_at
        if not known:
            return 0.0
        drift = self.drift(self._draft_mark)
        if batch in known:
            per = known[batch]
        elif smaller := [b for b in known if b < batch]:
            per = known[max(smaller)]
        else:
            return known[min(known)] * drift
        return max(per, max((known[b] * b for b in known if b < batch), default=0.0) / batch) * drift

    def catch_up_per_token(self) -> float | None:
        """Seconds per token the draft feeds outside drafting, at the target's drift since it was
        measured (None: never measured)."""
        if self.catch_up_cost is None:
            return None
        return self.catch_up_cost * self.drift(self._catch_up_mark)

    def _speed_mark(self) -> dict[int, tuple[float, int]]:
        """The speed source's forward figures now, those measured recently only (a figure left from an
        earlier spell would make the drift since then look like drift since this draft figure)."""
        src = self.speed_source or self
        return {r: (c, src._forward_count.get(r, 0)) for r, c in src.forward_cost.items() if not src._stale(r)}

    def drift(self, mark: dict[int, tuple[float, int]] | None) -> float:
        """How much slower (> 1) or faster (< 1) the target's forwards run now than at ``mark``: over
        the row counts whose figure has been measured afresh since (``cost_window`` forwards of that
        size, so the median holds none from before), the median of the figure now over the figure
        then; 1 where none has (the draft figure is as recent as any), within ``MAX_DRIFT``."""
        src = self.speed_source or self
        if not self.follow_drift or not mark:
            return 1.0
        ratios = [src.forward_cost[r] / then for r, (then, count) in mark.items()
                  if then > 0 and r in src.forward_cost and src._forward_count.get(r, 0) - count >= self.cost_window]
        if not ratios:
            return 1.0
        return min(MAX_DRIFT, max(1.0 / MAX_DRIFT, statistics.median(ratios)))

    def catch_up_seconds(self, tokens: float) -> float:
        """Predicted seconds for the draft to feed ``tokens`` it has not followed: one forward over
        them -- their number times the per-token cost of long catch-ups, but never less than a
        drafted token's time (a forward of one row)."""
        if tokens <= 0:
            return 0.0
        return max(tokens * (self.catch_up_per_token() or 0.0), self.predict_draft(1) if self.draft_cost_at else 0.0)

    def predict_forward(self, rows: int, explore: bool = False) -> float:
        """Seconds for a target forward over ``rows``. ``explore`` (one sequence): a block larger
        than any measured, up to 16 rows, is guessed as cheap as the largest measured, so each
        longer draft gets tried -- one step, no catch-up; several sequences extrapolate instead.
        Never more than a larger block measured: a row count measured rarely (at a slow moment)
        cannot make plain decoding, which computes the fewest rows, look slow."""
        larger = [c for r, c in self.forward_cost.items() if r > rows]
        guess = self._raw_forward(rows, explore)
        guess = min(guess, min(larger)) if larger else guess
        if rows in self.forward_cost and self._stale(rows):
            fresh = [r for r in self.forward_cost if not self._stale(r)]
            below, above = [r for r in fresh if r < rows], [r for r in fresh if r > rows]
            if below and above:
                guess = min(guess, self._line(max(below), min(above), rows))
        return guess

    def _stale(self, rows: int) -> bool:
        return self._forwards - self._forward_seen.get(rows, self._forwards) > STALE_FORWARDS

    def _raw_forward(self, rows: int, explore: bool) -> float:
        if rows in self.forward_cost:
            return self.forward_cost[rows]
        if not self.forward_cost:
            return 1.0
        known = sorted(self.forward_cost)
        lower = [r for r in known if r < rows]
        upper = [r for r in known if r > rows]
        if not upper:  # a block larger than any measured: along the slope of the two largest, or
            top = known[-1]  # the slope from the smallest, if steeper (one noisy figure flattens the first)
            if explore and rows <= _MEMORY_BOUND_ROWS:
                return self.forward_cost[top]
            guess = self.forward_cost[top]
            if len(known) > 1:
                slope = max(self._slope(known[-2], top), self._slope(known[0], top))
                guess += slope * (rows - top)
            if rows > _MEMORY_BOUND_ROWS:  # large blocks are compute-bound: at least ~ rows
                guess = max(guess, self.forward_cost[top] * rows / top)
            return guess
        if not lower:
            return self.forward_cost[upper[0]]
        return self._line(lower[-1], upper[0], rows)

    def _slope(self, r0: int, r1: int) -> float:
        return max(0.0, (self.forward_cost[r1] - self.forward_cost[r0]) / (r1 - r0))

    def _line(self, r0: int, r1: int, rows: int) -> float:
        return self.forward_cost[r0] + self._slope(r0, r1) * (rows - r0)

    # -- learning ---------------------------------------------------------------------------
    def observe_forward_seconds(self, rows: int, seconds: float) -> None:
        """A target forward over ``rows`` (a chain's or plain step's) took ``seconds``."""
        self._forwards += 1
        self._forward_seen[rows] = self._forwards
        self._forward_count[rows] = self._forward_count.get(rows, 0) + 1
        self._observe(self._forward_obs, self.forward_cost, rows, seconds)

    def _observe(self, obs: dict, table: dict, key, value: float) -> None:
        """The median of the last ``cost_window`` observations: one slow step (a page fault, another
        process) moves nothing, and a size measured rarely (a probe) is right after a few visits."""
        window = obs.setdefault(key, deque(maxlen=self.cost_window))
        window.append(value)
        table[key] = statistics.median(window)

    def observe_step(self, speculative: bool, batch: int, overhead: float, tree: bool = False) -> None:
        """A whole step's seconds beyond its timed draft and target forwards (``tree``: a tree step's)."""
        key = ("tree", batch) if tree else (speculative, batch)
        self._observe(self._overhead_obs, self.step_overhead, key, max(0.0, overhead))  # type: ignore[arg-type]

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """The draft fed ``tokens`` outside drafting (a prompt, a backlog) in ``seconds``."""
        if tokens <= 0:
            return
        (self._catch_up_obs if tokens >= LONG_CATCH_UP else self._short_catch_up_obs).append(seconds / tokens)
        self.catch_up_cost = statistics.median(self._catch_up_obs or self._short_catch_up_obs)
        self._catch_up_mark = self._speed_mark()

    def observe_draft(self, tokens: int, seconds: float, batch: int = 1) -> None:
        """``tokens`` drafted in ``seconds`` for ``batch`` sequences together."""
        if tokens <= 0:
            return
        self._observe(self._draft_obs, self.draft_cost_at, batch, seconds / tokens)
        self._draft_mark = self._speed_mark()
