"""``--spec auto``: several proposers behind one, and per sequence, per step, the one that drafts.

The engine asks :meth:`AutoProposer.plan` instead of its controller for a step's draft length
(``Engine.choose_k``): for each sequence :class:`~tokenleap.spec.bandit.Bandit` ranks the arms by
predicted accepted tokens per second of cost, and ``propose_many`` lets the best one draft (a cheap
arm with nothing to propose -- n-gram without a match -- hands the step to the next). Every
verified token goes through the same verifier whichever arm drafted it, so the output is exactly
plain decoding's (greedy and seeded token for token, sampling in distribution).

Keeping each arm consistent when it did not draft a step: an arm is only told ``accept`` for a
proposal it made. A draft model therefore falls behind while another arm drafts and catches up on
the tokens it missed at its next proposal (its ``backlog``, which the plan prices in); n-gram
indexes are rebuilt from the tokens at every proposal. Arms plug in by name: anything with the
proposer protocol (``base.py``) can be an arm; ``shadow = True`` on a proposer (deterministic,
nearly free) lets the bandit score it every step without verifying its drafts.
"""
from __future__ import annotations

import time
from dataclasses import replace

from tokenleap.spec.bandit import Bandit, BanditConfig, Choice, SeqBandit
from tokenleap.spec.confidence import chain_floors
from tokenleap.spec.controller import DraftLengthController
from tokenleap.spec.proposers.base import Draft, DraftRequest, Proposer
from tokenleap.spec.report import DraftWork


class AutoProposer:
    name = "auto"

    def __init__(self, arms: dict[str, Proposer], config: BanditConfig | None = None, trees: bool = False) -> None:
        if not arms:
            raise ValueError("auto needs at least one proposer")
        self.arms = arms
        # token trees from arms that may draft either (``drafts_trees``): only when asked for (--spec-tree
        # on); the bandit weighs chains. An arm whose method is a tree (lookahead's guesses) keeps its budget.
        self.trees = trees
        self.bandit = Bandit([(n, bool(getattr(p, "shadow", False)), getattr(p, "aux_rows", 0))
                              for n, p in arms.items()], config)
        self.note: str | None = None  # how its draft model was chosen (``--spec auto`` without --draft-model)
        self.target: DraftLengthController | None = None  # the engine's controller (target costs), set by plan
        self._seqs: dict[int, SeqBandit] = {}
        self._plans: dict[int, list[Choice]] = {}
        self._drafted: dict[int, tuple[str, int, int, bool, bool]] = {}  # seq -> (arm, depth proposed, depth asked for, a probe?, cut?)
        # seq -> arm -> (start, proposal, asked, drafted): a shadow arm's proposal of max_k tokens made
        # at the plan; ``drafted`` None if another arm drafted the step, else (depth, accepted) once
        # the verified draft's outcome is known (``accept``), (0, 0) until then
        self._shadows: dict[int, dict[str, tuple[int, list[int], int, tuple[int, int] | None]]] = {}

    @property
    def aux_rows(self) -> int:
        """The most auxiliary rows (``Draft.aux``) any arm attaches to a step (lookahead's window)."""
        return max(getattr(p, "aux_rows", 0) for p in self.arms.values())

    @property
    def parts(self) -> list:
        return list(self.arms.values())

    def bind_cache(self, cache) -> None:
        """Hand the target's cache to the arms that draft in it (layer-skip self-speculation)."""
        for p in self.arms.values():
            if hasattr(p, "bind_cache"):
                p.bind_cache(cache)

    # -- lifecycle --------------------------------------------------------------------------
    def begin(self, seq_id: int, prompt: list[int]) -> None:
        self._seqs[seq_id] = self.bandit.new_sequence()
        self._shadows[seq_id] = {}
        for p in self.arms.values():
            p.begin(seq_id, prompt)

    def prefill(self, seq_id: int, tokens: list[int], batch: int = 1, remaining: float = float("inf")) -> None:
        """Warm an arm that needs it (a draft model) alongside the target's prefill only if it would
        draft this sequence's first step (``Bandit.rank``): it beats plain decoding and every other
        arm, with the warm-up paid back over the ``remaining`` tokens at a step of ``batch``
        sequences -- never while a shadow arm (n-gram) lets the sequence settle first. Otherwise it
        catches up at the first step it is chosen for, priced by the same rule, or never: a prompt
        that n-gram lookup serves alone costs no draft prefill."""
        seq = self._seqs[seq_id]
        backlogs = {n: p.backlog(seq_id, tokens) for n, p in self.arms.items()}
        warm = [n for n, b in backlogs.items() if b > 0]
        if not warm:
            return
        target = self.target
        if target is not None and target.forward_cost:  # nothing measured yet: warm, and so measure
            ranked = self.bandit.rank(seq, batch, target, backlogs, remaining, self.bandit.cfg.max_k)
            warm = [ranked[0].arm] if ranked and ranked[0].arm in warm else []
        for name in warm:
            p = self.arms[name]
            t0 = time.perf_counter()
            before = backlogs[name]
            p.prefill(seq_id, tokens)
            self.bandit.observe_catch_up(name, before - p.backlog(seq_id, tokens), time.perf_counter() - t0)

    def backlog(self, seq_id: int, tokens: list[int]) -> int:
        """Tokens the arm planned first must catch up on (the engine's controller is not asked)."""
        plan = self._plans.get(seq_id)
        return self.arms[plan[0].arm].backlog(seq_id, tokens) if plan else 0

    def end(self, seq_id: int) -> None:
        seq = self._seqs.get(seq_id)
        if seq is not None:  # arms that did not draft for it grow staler (``Bandit._probe``)
            self.bandit.end_sequence(seq)
        for p in self.arms.values():
            p.end(seq_id)
        for table in (self._seqs, self._plans, self._drafted, self._shadows):
            table.pop(seq_id, None)

    # -- planning ---------------------------------------------------------------------------
    def plan(self, items: list[tuple[int, list[int], float]], batch: int, target: DraftLengthController) -> int:
        """Choose the arms and draft length of each sequence (seq_id, tokens, tokens it may still
        generate) for the coming step of ``batch`` sequences, with the target's costs as ``target``
        (the engine's controller) measures them; returns the longest draft planned (0: every
        sequence decodes plainly). Shadow arms are scored here, and their proposals for the step made
        first: the plan knows which of them has one (``Bandit.rank``'s ``present``)."""
        if self.target is not target:
            self.bandit.bind_target(target)
        self.target = target
        max_k = target.cfg.fixed_k or target.cfg.max_k
        longest = 0
        for seq_id, tokens, remaining in items:
            seq = self._seqs[seq_id]
            self._score_shadows(seq_id, seq, tokens)
            shadows = {n: p.propose(seq_id, tokens, max_k, None, None)  # type: ignore[arg-type]
                       for n, p in self.arms.items() if self.bandit.arms[n].shadow}
            present = {n: d is not None and bool(d.tokens) for n, d in shadows.items()}
            backlogs = {n: p.backlog(seq_id, tokens) for n, p in self.arms.items()}
            plan = self.bandit.plan(seq, batch, target, backlogs, remaining, max_k, present)
            if target.cfg.fixed_k is not None:  # a fixed draft length: the arm is chosen, k is not
                plan = [replace(c, k=max_k) for c in plan]
            else:
                plan = [self._confident(c, seq, batch, max_k) for c in plan]
            self._plans[seq_id] = plan
            longest = max([longest] + [c.k for c in plan])
            self._shadow_proposals(seq_id, tokens, plan, max_k, shadows)
        return longest

    def _shadow_proposals(self, seq_id: int, tokens: list[int], plan: list[Choice], max_k: int,
                          drafts: dict[str, Draft | None]) -> None:
        """Keep what each shadow arm would draft now (``drafts``, max_k long) for scoring. The plan's
        first choice drafts the step itself: its drafted positions are observed through ``accept``,
        and its proposal past them only if the draft is accepted whole (``_score_shadows``)."""
        first = plan[0].arm if plan else None
        for name, d in drafts.items():
            if name != first:
                self.bandit.observe_offer(self._seqs[seq_id], name, d is not None and bool(d.tokens))
            if d is not None and d.tokens:
                self._shadows[seq_id][name] = (len(tokens), list(d.tokens), max_k, (0, 0) if name == first else None)

    def _score_shadows(self, seq_id: int, seq: SeqBandit, tokens: list[int]) -> None:
        """Compare the shadow proposals of the last step with the tokens it emitted. A proposal whose
        arm drafted the step is scored only at the position past the depth it drafted, and only if
        that draft was accepted whole (then the step's bonus token is the verified token there: a
        deterministic draft token would have been accepted iff it equals it)."""
        for name, (start, proposal, asked, drafted) in self._shadows[seq_id].items():
            known = tokens[start:start + len(proposal) + 1]
            n = min(len(proposal), len(known))
            first = 0
            if drafted is not None:
                depth, accepted = drafted
                if not depth or accepted < depth or n <= depth or proposal[:depth] != known[:depth]:
                    continue
                first, n = depth, depth + 1
            if not n:
                continue
            matched = next((i for i in range(n) if proposal[i] != known[i]), n)
            if matched < n:  # position matched + 1 failed
                proposed = matched + 1
            elif n == len(proposal) and len(known) > n and asked > n:
                proposed = n + 1  # the step went past the proposal's end: a position it had nothing for
            else:
                proposed = n  # a full match of what is known so far: later positions unknown
            self.bandit.observe_acceptance(seq, name, proposed, matched, first)
        self._shadows[seq_id] = {}

    # -- drafting ---------------------------------------------------------------------------
    def propose(self, seq_id, tokens, k, params, generator) -> Draft | None:
        return self.propose_many([DraftRequest(seq_id, tokens, k, params, generator)])[0]

    def propose_many(self, requests: list[DraftRequest]) -> list[Draft | None]:
        """Each request's draft from its plan's first arm that proposes something; the arms draft
        for their sequences in batches, in rounds (round r: every request's r-th choice still open)."""
        out: list[Draft | None] = [None] * len(requests)
        plans = {}
        for i, r in enumerate(requests):
            plan = self._plans.pop(r.seq_id, None)
            if plan is None and self.target is not None:  # a step the engine did not plan (an explicit k)
                seq, backlogs = self._seqs[r.seq_id], {n: p.backlog(r.seq_id, r.tokens) for n, p in self.arms.items()}
                plan = self.bandit.plan(seq, len(requests), self.target, backlogs, float("inf"), r.k)
            plans[i] = plan if plan is not None else [Choice(next(iter(self.arms)), r.k, 0.0)]
            self._drafted.pop(r.seq_id, None)
        open_ = dict.fromkeys(range(len(requests)), 0)  # request -> index of its next choice
        while open_:
            by_arm: dict[str, list[int]] = {}
            for i, j in list(open_.items()):
                if j >= len(plans[i]):
                    del open_[i]
                    continue
                by_arm.setdefault(plans[i][j].arm, []).append(i)
            for name, idx in by_arm.items():
                chains = not self.trees and getattr(self.arms[name], "drafts_trees", False)
                reqs = [replace(requests[i], k=min(requests[i].k, plans[i][open_[i]].k),
                                max_nodes=0 if chains else requests[i].max_nodes,
                                stop_below=plans[i][open_[i]].floors, stop_draft=plans[i][open_[i]].draft_floor,
                                planned=plans[i][open_[i]].planned)
                        for i in idx]
                for i, req, d in zip(idx, reqs, self._draft(name, reqs)):
                    aux = getattr(d, "aux", None) is not None
                    if d is None or d.tokens or aux or not d.catch_up_tokens:  # (not a call that only caught up)
                        offered = d is not None and bool(d.tokens or aux)
                        self.bandit.observe_offer(self._seqs[requests[i].seq_id], name, offered)
                    if d is not None and (d.tokens or d.catch_up_tokens or aux):
                        out[i], probe = d, plans[i][open_[i]].probe
                        del open_[i]
                        if d.tokens or aux:  # the engine verifies it and reports back through accept
                            # (a step carrying only the arm's own rows -- lookahead's window without
                            # a guess -- emits one token: counted as a first position missed, so the
                            # arm's expected yield per step includes its steps without a guess)
                            if d.tree is not None and d.tokens:
                                depth = asked = int(d.tree.depth.max())
                            else:
                                depth, asked = max(1, len(d.tokens)), req.k
                            self._drafted[requests[i].seq_id] = (name, depth, asked, probe, d.cut)
                            self.bandit.drafted(self._seqs[requests[i].seq_id], name, probe)
                    else:
                        open_[i] += 1
        return out

    def _confident(self, choice: Choice, seq: SeqBandit, batch: int, max_k: int) -> Choice:
        """``choice`` -- if its arm ends a chain where the draft's confidence no longer pays
        (``stops_on_confidence``) -- as a chain of up to ``max_k`` tokens (``confidence.chain_floors``)
        with the floors for its predicted rate, the arm's draft cost and this sequence's acceptance
        of it; a probe, or an arm that drafts otherwise, unchanged."""
        target = self.target
        if (choice.probe or choice.rate <= 0.0 or choice.k <= 0 or not target.cfg.confidence_stop
                or not getattr(self.arms[choice.arm], "stops_on_confidence", False)):
            return choice
        arm = self.bandit.arms[choice.arm]
        cap, floors, draft_floor = chain_floors(choice.k, max_k, batch, arm.costs.predict_draft(batch),
                                                target.predict_forward, choice.rate,
                                                seq.arms[choice.arm].acceptance.estimates(arm.prior()))
        return replace(choice, k=cap, floors=floors, draft_floor=draft_floor, planned=choice.k) if floors else choice

    def _draft(self, name: str, reqs: list[DraftRequest]) -> list[Draft | None]:
        """``name``'s drafts for ``reqs``, timed into the arm's cost tables and labelled with the arm."""
        t0 = time.perf_counter()
        got = self.arms[name].propose_many(reqs)
        seconds = time.perf_counter() - t0
        catch_up = sum(d.catch_up_seconds for d in got if d is not None)
        self.bandit.observe_catch_up(name, sum(d.catch_up_tokens for d in got if d is not None), catch_up)
        drafted = sum(len(d.tokens) for d in got if d is not None)
        if drafted and not catch_up:  # a forward that also fed a backlog is counted as catch-up whole
            self.bandit.observe_draft(name, drafted, seconds, batch=len(reqs))
        elif drafted:  # the tokens drafted after the catch-up's forwards (a probe's), by the controller's rule
            caught = sum(d.catch_up_drafted for d in got if d is not None)
            self.bandit.arms[name].costs.observe_draft_after_catch_up(
                DraftWork(drafted, 0, len(reqs), seconds - catch_up, 0, catch_up, caught))
        # each draft labelled with its arm (or the arm's own finer label, e.g. n-gram from earlier outputs)
        return [replace(d, proposer=d.proposer if d.proposer and d.proposer.startswith(name) else name)
                if d is not None else None for d in got]

    def accept(self, seq_id: int, num_accepted: int, path: list[int] | None = None) -> None:
        drafted = self._drafted.pop(seq_id, None)
        if drafted is None:
            return
        name, depth, asked, probe, cut = drafted
        shadow = self._shadows.get(seq_id, {}).get(name)
        if shadow is not None and shadow[3] is not None:  # its proposal past the draft is scored next plan
            self._shadows[seq_id][name] = shadow[:3] + ((depth, num_accepted),)
        # a draft shorter than asked for that was accepted whole: the position past its end had no
        # token, which for the arm's yield per step is a miss (n-gram continuations run out) -- unless
        # the arm cut it short by its own confidence
        proposed = depth + 1 if num_accepted >= depth and asked > depth and not cut else depth
        self.bandit.observe_acceptance(self._seqs[seq_id], name, proposed, num_accepted)
        self.bandit.observe_probe(self._seqs[seq_id], name, depth, num_accepted, probe)
        self.arms[name].accept(seq_id, num_accepted, path)
