"""Which proposer drafts a sequence's next step, and how far: the cost model of ``controller.py``
applied per proposer ("arm"), with acceptance measured per sequence.

For arm a, draft length k and a step of ``batch`` sequences, the predicted rate is

    rate(a, k) = batch * E_a(k) / (k * batch * c_a(batch) + F(batch * (k + 1)) + overhead)

with E_a(k) = 1 + sum_{i<=k} prod_{j<=i} b_j from this sequence's conditional acceptance b_j of
arm a's drafts, c_a the arm's measured seconds per drafted token at that batch size (a batched
draft forward serves every sequence it drafts for), and F / overhead the target's measured forward
cost by row count and a step's measured overhead -- the engine's own controller's figures, so
plain decoding (k = 0) is judged by exactly the numbers the controller uses. A sequence's
acceptance starts from the arm's recent acceptance over all sequences (the prior; a draft model's
over about its last 50 drafts, ``prior_ema``) and follows the sequence's own text with exponential
forgetting, so a request that turns from prose to copying
code moves to n-gram lookup within a few steps, and back. An arm that often has nothing to propose
(n-gram lookup without a match) is weighed by how often it has a draft: its other steps decode one
token at a plain step's cost -- where it is not known before the step whether it has one (below).

The plan for a sequence is every arm that beats plain decoding (by ``batch_margin`` with several
sequences) and pays back any catch-up it needs first (a draft model that has not followed the
sequence while another arm drafted must feed those tokens), best first: a cheap arm that finds
nothing to propose this step (n-gram without a match) hands the step to the next. A first arm's
catch-up must pay back against the best arm that needs none (not against plain decoding), and
is made beside a shadow arm with nothing to propose for this one step, which beats it on the steps
it has a proposal for, only where drafting the steps that arm leaves (its share of steps without a
proposal) repays the catch-up and the catch-ups its own steps will cause (on code, one step
without an n-gram match is no reason to feed the draft model the whole text; on prose where n-gram
lookup matches now and then, the draft model fills the rest); an arm
behind the first, which drafts only when the arms before it have nothing, within its one step.
Acceptance is only seen up to the depth drafted, so the first choice drafts one token deeper when
that position has gone ``deepen_every`` steps unmeasured for the sequence (each deepened position
that fails doubles that wait, ``deepen_backoff``), and at once after a draft accepted whole while no
deepened position has failed since one passed (``deepen_on_whole``): on text the draft follows
exactly the chain grows a token a step, as the engine's controller grows it. A new sequence's
first ``settle_steps`` steps choose no arm that needs a catch-up (a draft model's prefill) while a
shadow arm measures the text meanwhile, so that prefill is spent only where this text, not earlier
ones, says the draft beats the free arm. While a draft model that pays is in step with the sequence,
any other arm is charged the catch-up its step would leave that draft (one draft forward over the
tokens it emits): a free arm takes the step only where it gains more than switching costs, and the
draft model resumes at the next step the free arm has nothing for (its catch-up is that one step's
tokens, not a reason to leave the step to plain decoding). A plain step is charged alike: it leaves a
draft model in step with the sequence a token behind, so such a draft keeps drafting while it beats
plain decoding plus that token's catch-up -- it is not dropped on a slightly low estimate, to pay
to come back. An arm measured only on the steps it drafts (a draft model) forgets its acceptance
more slowly and leans on its prior more than a shadow arm (``drafted_ema``): one missed token must
not take it out of the sequence until the next probe. When no arm
pays, the step decodes plainly, and every ``probe_every`` steps an arm not tried for that long is
tried once with a short draft if its catch-up is affordable (for one sequence: also within the
exploration share of the whole answer), so a change in the text is noticed; a probe none of whose
tokens is accepted doubles the wait before that arm's next one (``probe_backoff``), so an arm that
keeps missing on this text costs fewer probe steps, and any draft of it accepted whole restores it.
An arm that drafted for none of the last ``stale_sequences`` finished sequences gets that probe in a
lone sequence with a larger share (``stale_share``), so figures measured on other text cannot rank
it out for good.
Arms whose proposals are deterministic and nearly free (``shadow``: n-gram lookup) are scored on
every step without drafting: their proposal is compared with the tokens the step emitted (on a
step one of them drafts, its proposal's position past the drafted ones is compared with the bonus
token, so a short draft does not hide how far its proposals run right). Their
proposal for the coming step is known before the plan (``present``): one without a proposal now
is left out of it, and one with a proposal is judged by its acceptance when it proposes, not
weighed down by the steps it has nothing for -- so a draft model that pays is not ranked behind
an arm that would leave most steps to plain decoding. That
count is exact: a deterministic draft token is accepted iff the verified token equals it, under
greedy, seeded and rejection sampling alike.
"""
from __future__ import annotations

from dataclasses import replace

from tokenleap.spec.bandit_state import Arm, BanditConfig, Choice, SeqAcceptance, SeqArmState, SeqBandit
from tokenleap.spec.controller import ControllerConfig, DraftLengthController

__all__ = ["Bandit", "BanditConfig", "Choice", "SeqBandit"]


class Bandit:
    """The per-arm cost tables and the choice of (arm, k) for each sequence of a step."""

    def __init__(self, arms: list[tuple[str, bool]] | list[tuple[str, bool, int]], config: BanditConfig | None = None) -> None:
        """``arms``: (name, shadow[, auxiliary rows a step]) each."""
        self.cfg = config or BanditConfig()
        ctl = ControllerConfig(max_k=self.cfg.max_k, ema=0.1)
        self.arms = {a[0]: Arm(a[0], a[1], DraftLengthController(ctl), a[2] if len(a) > 2 else 0,
                               None if a[1] else SeqAcceptance(self.cfg.max_k, self.cfg.prior_ema, 1.0))
                     for a in arms}

    def new_sequence(self) -> SeqBandit:
        c = self.cfg
        return SeqBandit({name: SeqArmState(SeqAcceptance(c.max_k, c.ema, c.prior_weight) if a.shadow
                                            else SeqAcceptance(c.max_k, c.drafted_ema, c.drafted_prior_weight),
                                            depth_seen=[0] * c.max_k) for name, a in self.arms.items()})

    def end_sequence(self, seq: SeqBandit) -> None:
        """A sequence finished: each arm that did not draft for it is one sequence staler; an arm
        probed in it as a stale arm waits twice as long before its next stale probe, and one that
        drafted on its merits without such a probe waits the least again."""
        for name, state in seq.arms.items():
            a = self.arms[name]
            a.idle_sequences = 0 if state.drafted_any else a.idle_sequences + 1
            if state.stale_probed:  # (its choice after the probe, the catch-up paid, proves nothing)
                a.stale_misses = min(a.stale_misses + 1, self.cfg.stale_backoff)
            elif state.chosen:
                a.stale_misses = 0

    # -- learning ---------------------------------------------------------------------------
    def observe_acceptance(self, seq: SeqBandit, arm: str, proposed: int, accepted: int, first: int = 0) -> None:
        """A step's positions 1..accepted of ``arm``'s proposal passed, position accepted + 1 failed
        (if proposed); ``first`` > 0: positions up to it were observed already (a shadow arm's
        proposal scored past the depth it drafted), only those after it are new."""
        state = seq.arms[arm]
        if not first:
            d = state.deepened
            if d and proposed >= d and accepted + 1 >= d:  # the deepened position was reached: passed or failed
                state.deepen_misses = 0 if accepted >= d else state.deepen_misses + 1
            state.deepened = 0
            state.whole = proposed if proposed and accepted >= proposed else 0
            state.whole_step = seq.steps  # (the plan's step it answers: only the next plan deepens on it)
        if proposed > first:
            state.acceptance.observe(proposed, accepted, first)
            self.arms[arm].costs.observe_acceptance(proposed, accepted, first)
            if self.arms[arm].history is not None:
                self.arms[arm].history.observe(proposed, accepted, first)

    def observe_draft(self, arm: str, tokens: int, seconds: float, batch: int) -> None:
        self.arms[arm].costs.observe_draft(tokens, seconds, batch)

    def observe_catch_up(self, arm: str, tokens: int, seconds: float) -> None:
        self.arms[arm].costs.observe_catch_up(tokens, seconds)

    def bind_target(self, target: DraftLengthController) -> None:
        """Read every arm's draft figures at the drift of ``target``'s forwards since they were
        measured (``costs.CostTables.drift``): an arm not drafting meanwhile keeps its figures from
        a faster or slower spell of the machine, which its target left too."""
        for a in self.arms.values():
            a.costs.speed_source = target

    # -- choosing ---------------------------------------------------------------------------
    def rate(self, seq: SeqBandit, arm: str, k: int, batch: int, target: DraftLengthController,
             followers: tuple[str, ...] = (), proposes: bool = False) -> float:
        """Predicted tokens per second of a step in which ``arm`` drafts k tokens for ``batch`` sequences;
        ``followers``: arms in step with the sequence that this step would leave behind, each then
        catching up on the tokens it emits (``DraftLengthController.catch_up_seconds``);
        ``proposes``: the arm is known to have a proposal for this step (its offer rate is moot)."""
        a, state = self.arms[arm], seq.arms[arm]
        tokens = state.acceptance.expected_tokens(k, a.prior())
        cost = target.spec_step_cost(k, batch, a.costs.predict_draft(batch), a.aux_rows)
        if state.offers < 1.0 and not proposes:  # a step it has nothing for decodes one token plainly
            tokens = state.offers * tokens + (1.0 - state.offers)
            cost = state.offers * cost + (1.0 - state.offers) * target.step_cost(0, batch)
        cost += sum(self.arms[f].costs.catch_up_seconds(tokens) for f in followers if f != arm)
        return batch * tokens / cost if cost > 0 else float("inf")

    def observe_probe(self, seq: SeqBandit, arm: str, drafted: int, accepted: int, probe: bool) -> None:
        """A verified draft of ``arm`` for the sequence (``probe``: an exploratory one): a probe none
        of whose tokens was accepted lengthens the wait before the arm's next probe in the sequence;
        any draft accepted whole restores it."""
        state = seq.arms[arm]
        if probe and accepted <= 0:
            state.probe_misses = min(state.probe_misses + 1, self.cfg.probe_backoff)
        elif accepted >= drafted:
            state.probe_misses = 0

    def observe_offer(self, seq: SeqBandit, arm: str, offered: bool) -> None:
        """Asked for a draft for the sequence, ``arm`` had one (or nothing: n-gram without a match)."""
        state = seq.arms[arm]
        state.offers += self.cfg.ema * ((1.0 if offered else 0.0) - state.offers)

    def plan(self, seq: SeqBandit, batch: int, target: DraftLengthController, backlogs: dict[str, int],
             remaining: float, max_k: int, present: dict[str, bool] | None = None) -> list[Choice]:
        """The arms to try for this sequence's next step, best first (empty: decode plainly).
        ``backlogs``: tokens each arm must catch up on first; ``remaining``: tokens still to come;
        ``present``: for arms whose proposal is known before the step (shadow arms), whether they have one."""
        max_k = min(max_k, self.cfg.max_k)
        if max_k <= 0:
            return []
        if not target.forward_cost:  # nothing measured: every arm with a middling first draft, as listed
            return [Choice(a, min(self.cfg.initial_k, max_k), 0.0) for a in self.arms]
        plain = target.rate(0, batch)
        margin = 1.0 + (self.cfg.batch_margin if batch > 1 else 0.0)
        ranked = self.rank(seq, batch, target, backlogs, remaining, max_k, present)
        seq.steps += 1
        step_seconds = batch / ranked[0].rate if ranked else batch / plain
        seq.seconds += step_seconds
        for state in seq.arms.values():
            state.idle_steps += 1
            state.idle_seconds += step_seconds
        best = ranked[0].rate if ranked else plain * margin
        probe = self._probe(seq, batch, target, backlogs, best, max_k, {c.arm for c in ranked}, remaining)
        if probe is not None:
            return [probe] + ranked
        if ranked:
            ranked[0] = self._deepen(seq, ranked[0], max_k)
        return ranked

    def _deepen(self, seq: SeqBandit, choice: Choice, max_k: int) -> Choice:
        """``choice`` one token past the arm's last draft if that draft, at the step before, was accepted
        whole (``deepen_on_whole``, while no deepened position has failed since one passed), else one
        token deeper if the arm has not drafted that position for this sequence in
        ``deepen_every`` steps (not for shadow arms: on the steps they do not draft, their whole
        proposal is compared with the tokens the step emits, and on the steps they draft, the
        position past the drafted ones with the step's bonus token); the positions drafted are
        marked as seen."""
        state, k = seq.arms[choice.arm], choice.k
        state.deepened = 0
        if not self.arms[choice.arm].shadow and k < max_k:
            if (self.cfg.deepen_on_whole and not state.deepen_misses and state.whole >= k
                    and state.whole_step == seq.steps - 1):
                k = min(state.whole + 1, max_k)
                state.deepened = k
            elif seq.steps - state.depth_seen[k] >= self.cfg.deepen_every << min(state.deepen_misses,
                                                                                 self.cfg.deepen_backoff):
                k += 1
                state.deepened = k
        state.depth_seen[:k] = [seq.steps] * k
        return choice if k == choice.k else replace(choice, k=k)

    def rank(self, seq: SeqBandit, batch: int, target: DraftLengthController, backlogs: dict[str, int],
             remaining: float, max_k: int, present: dict[str, bool] | None = None) -> list[Choice]:
        """The arms that beat plain decoding for this sequence's next step (by the batch margin) and pay
        back their catch-up over ``remaining`` tokens (the first arm: against the best arm without
        one; an arm behind the first: within its one step), best first, each at its best draft
        length; while the sequence settles (``settle_steps``) an arm with a catch-up is left out if
        a shadow arm is there; an arm ``present`` says has no proposal now is left out, one it says has
        one is rated by its acceptance when proposing. Nothing is recorded (``plan`` is the step's
        choice, with exploration)."""
        present = present or {}
        max_k = min(max_k, self.cfg.max_k)
        if max_k <= 0 or not target.forward_cost:
            return []
        plain = target.rate(0, batch)
        margin = 1.0 + (self.cfg.batch_margin if batch > 1 else 0.0)
        settling = seq.steps < self.cfg.settle_steps and any(a.shadow for a in self.arms.values())

        def eligible(followers: tuple[str, ...]) -> list[Choice]:
            out = []
            for name, a in self.arms.items():
                if (settling and backlogs.get(name, 0) > 0) or present.get(name) is False:
                    continue
                k, r = self._best_k(seq, name, batch, target, max_k, followers, present.get(name, False))
                catch_up = a.costs.catch_up_seconds(backlogs.get(name, 0))
                gain = remaining * (1.0 / plain - margin / r) if r > 0 else 0.0
                bar = self._plain_bar(seq, name, batch, plain, backlogs) * margin * 1.0001
                if r > bar and (catch_up <= 0.0 or gain > catch_up):
                    out.append(Choice(name, k, r))
            return out

        ranked = eligible(())
        # a draft model in step with the sequence (it drafted the last step) that pays now would have
        # to catch up on whatever another arm's step emits: that arm is charged the catch-up, so
        # a free arm wins the step only where it gains more than the switch costs
        followers = tuple(c.arm for c in ranked if backlogs.get(c.arm, 0) == 0
                          and self.arms[c.arm].costs.catch_up_cost is not None)
        if followers and len(ranked) > 1:
            ranked = eligible(followers)
        ranked.sort(key=lambda c: -c.rate)
        catch_up = {c.arm: self.arms[c.arm].costs.catch_up_seconds(backlogs.get(c.arm, 0)) for c in ranked}
        free = [c for c in ranked if catch_up[c.arm] <= 0.0]
        # a first arm that must catch up is an investment against the best arm that needs none: it
        # drafts first only where the time saved over that arm (not over plain decoding) repays it --
        # over the rest of the answer, so that arm at its rate over every step, those it has nothing
        # for too. A shadow arm with no proposal for this one step (n-gram lookup between matches)
        # that beats the first arm on the steps it has one takes those steps and leaves it the
        # rest: the investment must pay on those (``_pays_beside``), or the step goes to a free arm
        # or decodes plainly
        if ranked and catch_up[ranked[0].arm] > 0.0:
            first = ranked[0]
            # (not for an arm that drafted the sequence's last step but one: it has only that step's
            # tokens to feed, the switch the follower rule above already priced)
            invest = self._in_step(seq, first.arm, backlogs)
            if not invest:
                beside = {name: self._best_k(seq, name, batch, target, max_k, (), True)  # (k, rate) proposing
                          for name, a in self.arms.items() if a.shadow and present.get(name) is False}
                invest = all(self._pays_beside(seq, first, name, k, plain, margin, remaining, catch_up[first.arm])
                             for name, (k, r) in beside.items() if r * margin >= first.rate)
            if invest and free:
                c = free[0]
                long_run = self.rate(seq, c.arm, c.k, batch, target) if present.get(c.arm) else c.rate
                invest = remaining * (1.0 / long_run - margin / first.rate) > catch_up[first.arm]
            if not invest:  # the arm goes behind: it then drafts only as below
                head = free[:1]
                return head + [c for c in ranked if c not in head
                               and self._one_step_gain(seq, c, batch, plain) >= catch_up[c.arm]]
        # an arm behind the first drafts only on a step the arms before it find nothing to propose
        # for (n-gram without a match): its catch-up must pay back within that one step, not over
        # the whole answer the first arm is serving
        return ranked[:1] + [c for c in ranked[1:] if self._one_step_gain(seq, c, batch, plain) >= catch_up[c.arm]]

    def _in_step(self, seq: SeqBandit, arm: str, backlogs: dict[str, int]) -> bool:
        """``arm`` must feed what it did not follow (a draft model) and follows the sequence: nothing
        to feed, or only what the one step since its last draft emitted."""
        a, state = self.arms[arm], seq.arms[arm]
        return (not a.shadow and a.costs.catch_up_cost is not None
                and (backlogs.get(arm, 0) == 0 or (state.drafted_any and state.idle_steps <= 1)))

    def _plain_bar(self, seq: SeqBandit, arm: str, batch: int, plain: float, backlogs: dict[str, int]) -> float:
        """Plain decoding's rate as ``arm`` must beat it to draft the step: an arm in step with the
        sequence (``_in_step``) is left a token behind by a plain step, which its next draft in the
        sequence pays for at the per-token catch-up cost -- so a draft model that drafts about as
        fast as plain decoding keeps the sequence rather than dropping it on a slightly low
        estimate and paying to come back."""
        per_token = self.arms[arm].costs.catch_up_per_token()
        if not self._in_step(seq, arm, backlogs) or not per_token:
            return plain
        return batch / (batch / plain + per_token)

    def _pays_beside(self, seq: SeqBandit, first: Choice, shadow: str, shadow_k: int, plain: float, margin: float,
                     remaining: float, catch_up: float) -> bool:
        """Whether ``first``, which must catch up, repays that drafting only the steps ``shadow`` (a
        free arm that beats it where it has a proposal, drafting ``shadow_k`` there) has none for:
        over the ``remaining`` tokens the shadow arm proposes on its share of steps (``offers``),
        each of its steps leaving ``first`` its tokens to feed at the per-token catch-up cost, and
        ``first`` drafts the rest, each step saving its tokens' time over plain decoding."""
        offers = seq.arms[shadow].offers
        shadow_tokens = seq.arms[shadow].acceptance.expected_tokens(shadow_k, self.arms[shadow].prior())
        tokens = seq.arms[first.arm].acceptance.expected_tokens(first.k, self.arms[first.arm].prior())
        saved = (1.0 - offers) * tokens * (1.0 / plain - margin / first.rate)  # per step, on average
        fed = offers * shadow_tokens * (self.arms[first.arm].costs.catch_up_per_token() or 0.0)
        if saved <= fed:
            return False
        return remaining / (offers * shadow_tokens + (1.0 - offers) * tokens) * (saved - fed) > catch_up

    def _best_k(self, seq: SeqBandit, arm: str, batch: int, target: DraftLengthController, max_k: int,
                followers: tuple[str, ...] = (), proposes: bool = False) -> tuple[int, float]:
        """``arm``'s draft length of the best predicted rate (``rate``'s terms), and that rate."""
        rates = ((k, self.rate(seq, arm, k, batch, target, followers, proposes)) for k in range(1, max_k + 1))
        return max(rates, key=lambda kr: kr[1])

    def _one_step_gain(self, seq: SeqBandit, c: Choice, batch: int, plain: float) -> float:
        """Seconds one step of ``c`` is predicted to save over decoding its tokens plainly."""
        tokens = seq.arms[c.arm].acceptance.expected_tokens(c.k, self.arms[c.arm].prior())
        return batch * tokens * (1.0 / plain - 1.0 / c.rate) if c.rate > 0 else 0.0

    def _probe(self, seq: SeqBandit, batch: int, target: DraftLengthController, backlogs: dict[str, int],
               best: float, max_k: int, ranked: set[str], remaining: float = float("inf")) -> Choice | None:
        """One short draft by an arm idle for this sequence for ``probe_every`` steps -- not a
        shadow-scored arm (measured anyway), not one that could not beat the best choice even if
        every drafted token were accepted, and not one whose catch-up costs more than two steps
        and the exploration share of the time since it last drafted -- or, for one sequence, more
        than what is left of the exploration share of the whole answer (the steps so far and the
        ``remaining`` tokens at the best rate): a draft model that must first catch up on a long
        prompt gets one look per answer, which the time since its last draft alone never affords
        (the backlog grows by a token a step, about as fast as that share of a step). For one
        sequence, an arm gone stale across sequences (``stale_sequences``) is looked at within
        ``stale_share`` of the answer: its figures would otherwise never be measured again."""
        k = min(self.cfg.probe_k, max_k)
        answer = seq.seconds + remaining * batch / best if batch == 1 and remaining < float("inf") else 0.0
        for name, state in seq.arms.items():
            a = self.arms[name]
            if a.shadow or name in ranked or state.idle_steps < self.cfg.probe_every << state.probe_misses:
                continue
            catch_up = a.costs.catch_up_seconds(backlogs.get(name, 0))
            share = self.cfg.explore_share  # of the answer; a stale arm's (one sequence only) is larger
            stale = batch == 1 and 0 < self.cfg.stale_sequences << a.stale_misses <= a.idle_sequences
            if stale:
                share = max(share, self.cfg.stale_share)
            affordable = (catch_up <= max(2 * batch / best, self.cfg.explore_share * state.idle_seconds)
                          or seq.explored + catch_up <= share * answer)
            best_case = batch * (k + 1) / target.spec_step_cost(k, batch, a.costs.predict_draft(batch), a.aux_rows)
            if affordable and best_case > best:
                seq.explored += catch_up
                state.stale_probed = state.stale_probed or stale
                return Choice(name, k, 0.0, probe=True)
        return None

    def drafted(self, seq: SeqBandit, arm: str, probe: bool = False) -> None:
        """``arm`` drafted for the sequence (``probe``: an exploratory draft): its exploration clock
        restarts."""
        state = seq.arms[arm]
        state.idle_steps, state.idle_seconds = 0, 0.0
        state.drafted_any = True
        state.chosen = state.chosen or not probe
        self.arms[arm].idle_sequences = 0
