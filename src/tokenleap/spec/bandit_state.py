"""The state ``--spec auto``'s bandit (``bandit.py``) keeps: its configuration, each arm's figures
over every sequence, each sequence's acceptance of each arm and its exploration clocks, and a
planned choice."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenleap.spec.controller import DraftLengthController


@dataclass(frozen=True)
class BanditConfig:
    max_k: int = 8
    initial_k: int = 4  # the first draft of an arm, before anything is measured
    ema: float = 0.2  # forgetting rate of a sequence's acceptance counts (faster than the controller's)
    prior_weight: float = 1.0  # observations' worth of the arm's acceptance over all sequences
    # the same for an arm measured only on the steps it drafts (a draft model, not shadow-scored):
    # one estimate too low takes it out of the sequence until a probe (``probe_every`` steps), so
    # its estimate forgets more slowly and leans on its prior more (one missed first token must not
    # halve it)
    drafted_ema: float = 0.1
    drafted_prior_weight: float = 3.0
    # that prior: the arm's acceptance over every sequence, forgotten at this rate per draft (about
    # the last 50 drafts) -- a few poor drafts at the end of one answer must not set the next one's
    prior_ema: float = 0.02
    probe_every: int = 16  # plain steps (for this sequence) between tries of an arm that does not pay
    probe_k: int = 2
    explore_share: float = 0.05  # a probe's catch-up may cost at most this share of the time since the last
    batch_margin: float = 0.15  # with several sequences an arm must beat plain by this much (as the controller)
    # a new sequence's first steps, while a shadow arm is there to learn its text from, choose no arm
    # that must catch up first (a draft model's prefill): the catch-up is then judged by this text's
    # own acceptance of the free arm, not by earlier sequences' (code after prose would prefill a
    # draft that n-gram lookup then leaves idle)
    settle_steps: int = 3
    # the best choice drafts one token deeper when that position has not been drafted by the arm for
    # this sequence in this many steps: acceptance is only seen up to the depth drafted, so a position
    # judged poor once (or never tried) would otherwise pin k below what the text now allows
    deepen_every: int = 8
    # a deepened position that fails doubles the wait before the next deepening (up to
    # 2**deepen_backoff times deepen_every), one that passes restores it: on int4 targets an extra
    # row is not free, and a position that keeps failing must not cost a draft token every 8 steps
    deepen_backoff: int = 3
    # a draft accepted whole drafts one deeper at the next step (while no deepened position has failed
    # since one last passed): on text the draft follows exactly (a list, a count, a copied block) the
    # chain grows a token a step to max_k, as the engine's own controller grows it, instead of a token
    # every ``deepen_every`` steps against deeper estimates still held at the prior
    deepen_on_whole: bool = True
    # a probe that finds none of its tokens accepted doubles the arm's wait before its next probe in
    # the sequence (up to 2**probe_backoff times probe_every); a draft accepted whole resets it: an arm
    # that keeps missing on this text (lookahead's guesses on prose) stops taxing every 16th step
    probe_backoff: int = 3
    # an arm that drafted for none of the last this many finished sequences is stale: its figures
    # (the prior acceptance and cost every new sequence starts from) were last measured on other
    # text, and while they rank it below plain decoding nothing re-measures them -- the arm is not
    # chosen, and a long prompt's catch-up never fits a probe's share. A lone sequence probes a stale
    # arm once (``probe_every`` idle steps in) if the catch-up fits ``stale_share`` of its answer's
    # predicted time (a long document's prompt is not fed to a stale draft model); 0: never
    stale_sequences: int = 2
    stale_share: float = 0.25
    # each stale probe doubles the stale wait (up to 2**stale_backoff times stale_sequences); drafting
    # on its merits for a sequence it was not probed in resets it: on a run of short answers that a
    # draft model's catch-up on the prompt never pays for (code completions at a cursor), the probes
    # would otherwise tax every third request
    stale_backoff: int = 3


class SeqAcceptance:
    """One sequence's conditional acceptance b_i of one arm's drafts (exponentially forgotten counts)."""

    def __init__(self, max_k: int, ema: float, prior_weight: float) -> None:
        self.hits, self.trials = [0.0] * max_k, [0.0] * max_k
        self.ema, self.prior_weight = ema, prior_weight

    def observe(self, proposed: int, accepted: int, first: int = 0) -> None:
        """Positions 1..accepted passed, position accepted + 1 failed (if it was proposed); positions
        up to ``first`` are left alone (already observed)."""
        keep = 1.0 - self.ema
        for i in range(first, min(proposed, accepted + 1, len(self.hits))):
            self.hits[i] = self.hits[i] * keep + (1.0 if i < accepted else 0.0)
            self.trials[i] = self.trials[i] * keep + 1.0

    def estimates(self, prior: list[float]) -> list[float]:
        """b_i for every position: the counts with ``prior`` worth ``prior_weight`` observations."""
        w = self.prior_weight
        return [(h + w * p) / (t + w) for h, t, p in zip(self.hits, self.trials, prior)]

    def expected_tokens(self, k: int, prior: list[float]) -> float:
        """E(k): tokens a step drafting k is expected to emit (the bonus token included)."""
        total, run = 1.0, 1.0
        for b in self.estimates(prior)[:k]:
            run *= b
            total += run
        return total


@dataclass
class Arm:
    """One proposer's figures over every sequence: seconds per drafted token by batch size, catch-up
    seconds per token, and acceptance (``prior``: what a new sequence's starts from)."""

    name: str
    shadow: bool  # deterministic and nearly free: scored every step by comparing with what was emitted
    costs: DraftLengthController
    aux_rows: int = 0  # rows it adds to each of its steps' target forward beside the draft (lookahead's window)
    # an arm measured only when it drafts: its acceptance over every sequence, forgotten slowly -- the
    # prior a sequence's own acceptance starts from (a shadow arm's is the cost model's recent one)
    history: SeqAcceptance | None = None
    idle_sequences: int = 0  # finished sequences in a row it did not draft for
    stale_misses: int = 0  # stale probes since it last drafted on its merits for a sequence without one

    def prior(self) -> list[float]:
        """The acceptance b_i a sequence's own figures for this arm start from."""
        if self.history is None:
            return self.costs.accept
        return self.history.estimates([self.costs.cfg.prior_acceptance] * len(self.history.hits))


@dataclass
class SeqArmState:
    acceptance: SeqAcceptance
    idle_steps: int = 0  # steps of this sequence since the arm last drafted for it
    idle_seconds: float = 0.0  # predicted seconds those steps took
    # step (``SeqBandit.steps``) at which the arm last drafted position i + 1 for the sequence
    depth_seen: list[int] = field(default_factory=list)
    # how often the arm had a draft when asked (exponentially forgotten): n-gram lookup often finds
    # no match, and its steps without one decode plainly, so its rate is weighed by this
    offers: float = 1.0
    probe_misses: int = 0  # probes in a row none of whose tokens were accepted
    deepened: int = 0  # the depth of the arm's draft in flight drafted one deeper (``Bandit._deepen``), or 0
    deepen_misses: int = 0  # deepened positions in a row that failed
    whole: int = 0  # the depth of the arm's last draft for the sequence if it was accepted whole, else 0
    whole_step: int = -1  # the sequence's step count when ``whole`` was observed
    drafted_any: bool = False  # the arm drafted for the sequence at least once
    chosen: bool = False  # it drafted for the sequence on its merits (not as a probe)
    stale_probed: bool = False  # it was probed for the sequence as a stale arm


@dataclass(frozen=True)
class Choice:
    arm: str
    k: int
    rate: float  # predicted tokens per second (per step of the batch)
    probe: bool = False  # an exploratory draft by an arm not ranked (``Bandit.observe_probe`` takes its outcome)
    floors: tuple[float, ...] = ()  # a chain that ends on its draft's confidence (``DraftRequest.stop_below``)
    draft_floor: float = 0.0  # (``DraftRequest.stop_draft``)
    planned: int = 0  # ... and the length the bandit chose for it (``DraftRequest.planned``)


@dataclass
class SeqBandit:
    """A sequence's per-arm acceptance and exploration clocks."""

    arms: dict[str, SeqArmState] = field(default_factory=dict)
    steps: int = 0  # steps planned for the sequence so far
    seconds: float = 0.0  # their predicted seconds
    explored: float = 0.0  # catch-up seconds spent on probes for this sequence
