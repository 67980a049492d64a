"""Drafting with a trained feature-level head (``heads/eagle.py``): ``--spec eagle``.

The engine hands this proposer the target's features (final normed hidden states) of every
position it computes -- prompt rows at prefill, the verified rows after each step -- through
``take_features``. Position p's pair (f_p, x_{p+1}) goes into the head's own cache of keys and
values once x_{p+1} is known; the prediction at the newest pair is the first draft token's
feature, and each further draft token feeds the head its own prediction. Drafted pairs sit past
``fed`` in the cache and are overwritten when the target's real features for those positions come.

Where the target did not compute some positions (a prefix served from the prefix cache), the head
attends only to the positions it has features for: acceptance may drop, the output cannot change.
Every drafted token is verified by the target like any other draft (greedy: argmax match; sampling:
q is the distribution over the head's vocabulary subset the token was drawn from).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tokenleap.heads.eagle import EagleHead, grouped_attention, layer
from tokenleap.models.qlinear import Int8Linear
from tokenleap.spec.proposers.base import Draft, DraftRequest
from tokenleap.spec.proposers.draft_head import BatchHead, ReducedVocabHead
from tokenleap.spec.proposers.draft_model import DraftingLane
from tokenleap.spec.confidence import ConfidenceLog


@dataclass(eq=False)
class _State:
    """One sequence's head cache and the target features not fed to it yet."""

    head: object  # the sequence's vocabulary-subset head (SequenceHead)
    keys: torch.Tensor  # [capacity, kv, hd], position p at row p - base
    values: torch.Tensor
    base: int = 0  # first position the cache holds (later than 0 after a gap in the features)
    fed: int = 0  # positions base .. fed - 1 hold the target's real pairs
    feats_start: int = 0  # position of feats[0]
    feats: list[torch.Tensor] = field(default_factory=list)  # each [rows, H]: positions feats_start ..
    feats_end: int = 0  # one past the last position in feats
    last: torch.Tensor | None = None  # the prediction at position fed - 1 ([1, H]), the next draft's feature

    def keep_feats(self, start: int, feats: torch.Tensor | None) -> None:
        """The pending features are ``feats`` [rows, H] (None: none) from position ``start``."""
        self.feats = [feats] if feats is not None and feats.shape[0] else []
        self.feats_start = start
        self.feats_end = start + (feats.shape[0] if feats is not None else 0)


@dataclass(eq=False)
class _Lane(DraftingLane):
    req: DraftRequest
    drafted: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    pushed: int = 0
    confidences: list[float] = field(default_factory=list)
    calibration: object = None


class EagleProposer:
    name = "eagle"
    stops_on_confidence = True  # a chain honours DraftRequest.stop_below
    wants_features = True  # the engine calls take_features with the target's normed final hidden states

    def __init__(self, head: EagleHead, target_model, special_ids=(), max_len: int = 4096, int8: bool = True) -> None:
        head.cfg.check_target(target_model.config)
        self.cfg = head.cfg
        self.max_len = max_len
        # the layer's weights at int8 with a scale a row (a draft's precision moves only acceptance);
        # int8=False keeps the float modules (the training forward's exact arithmetic)
        self._lin = {n: Int8Linear.from_float(m.weight.detach().float(),
                                              m.bias.detach().float() if m.bias is not None else None)
                     if int8 else m for n, m in head.linears.items()}
        self._norms = {n: p.detach().float() for n, p in head.norms.items()}
        self._embed = target_model.embed  # token ids [rows] -> [rows, H]
        self.vocab_head = ReducedVocabHead(target_model.lm_head, self.cfg.subset, special_ids)
        self._states: dict[int, _State] = {}
        self.confidence = ConfidenceLog()

    # -- the engine's feature hand-off --------------------------------------------------------
    def take_features(self, seq_id: int, pos: int, feats: torch.Tensor) -> None:
        """The target's features [rows, H] of positions pos .. pos + rows - 1 (a recomputation of
        positions already taken replaces them; a gap drops what precedes it)."""
        st = self._states.get(seq_id)
        if st is None or feats.shape[0] == 0:
            return
        feats = feats.detach().float()
        if pos < st.fed:  # computed again (a preemption's recompute): the cache is cut back to it
            st.last = None
            if pos <= st.base:
                st.base = pos  # nothing of the cache stays (its rows are positions from base)
            st.fed = pos
        if not (st.feats and pos == st.feats_end):  # (the usual case: the next positions, appended)
            inside = st.feats and st.feats_start <= pos < st.feats_end
            st.keep_feats(st.feats_start if inside else pos,
                          torch.cat(st.feats)[:pos - st.feats_start] if inside else None)
        if st.fed < st.feats_start:
            st.base = st.fed = pos  # a gap: the head starts over from what it has features for
            st.last = None
        st.feats.append(feats)
        st.feats_end = pos + feats.shape[0]

    # -- the proposer protocol --------------------------------------------------------------
    def begin(self, seq_id: int, prompt: list[int]) -> None:
        cap = min(self.max_len, max(64, len(prompt) + 64))
        kv = (cap, self.cfg.num_kv_heads, self.cfg.head_dim)
        self._states[seq_id] = _State(self.vocab_head.for_prompt(prompt), torch.zeros(kv), torch.zeros(kv))

    def prefill(self, seq_id: int, tokens: list[int]) -> None:
        """Feed the head the pairs the features taken so far complete (prefill work, not drafting)."""
        self._catch_up([(self._states[seq_id], tokens)])

    def backlog(self, seq_id: int, tokens: list[int]) -> int:
        st = self._states[seq_id]
        return max(0, min(st.feats_end, len(tokens) - 1) - st.fed - 2)

    def propose(self, seq_id: int, tokens: list[int], k: int, params, generator) -> Draft | None:
        return self.propose_many([DraftRequest(seq_id, tokens, k, params, generator)])[0]

    def propose_many(self, requests: list[DraftRequest]) -> list[Draft | None]:
        """Draft for several sequences at once: their pending pairs in one forward, then one forward
        per draft position for every lane still drafting (each row attends to its own sequence)."""
        out: list[Draft | None] = [None] * len(requests)
        lanes, t0 = [], time.perf_counter()
        pending = [(i, r, self._states.get(r.seq_id)) for i, r in enumerate(requests)]
        pending = [(i, r, st) for i, r, st in pending
                   if st is not None and r.k > 0 and len(r.tokens) + r.k <= self.max_len]
        fed_before = {r.seq_id: st.fed for _, r, st in pending}
        self._catch_up([(st, r.tokens) for _, r, st in pending])
        # more than a step's usual pairs fed is catch-up work: its time shared by the pairs each fed
        backlogs = {r.seq_id: fed if (fed := st.fed - fed_before[r.seq_id]) > 2 else 0 for _, r, st in pending}
        share = (time.perf_counter() - t0) / max(1, sum(backlogs.values()))
        for i, r, st in pending:
            backlog = backlogs[r.seq_id]
            if st.fed != len(r.tokens) - 1 or st.last is None:  # the features do not reach the last token
                out[i] = Draft(tokens=[], probs=None, catch_up_seconds=share * backlog,
                               catch_up_tokens=backlog) if backlog else None
                continue
            lanes.append((i, _Lane(r, calibration=self.confidence.calibration), st, backlog))
        # (lane, state, feature predicted for position pos, pos): the head's next draft is token pos + 1
        active = [(lane, st, st.last, len(lane.req.tokens) - 1) for _, lane, st, _ in lanes]
        while active:
            heads = [st.head for _, st, _, _ in active]
            logits = (heads[0] if len(heads) == 1 else BatchHead(heads))(torch.cat([f for _, _, f, _ in active]))
            more = []
            for j, (lane, st, feat, pos) in enumerate(active):
                token = lane.take(logits[j:j + 1], pos + 1)
                if lane.wants_more():
                    more.append((lane, st, feat, token, pos))
            if not more:
                break
            # each lane's drafted pair at position pos (scratch past fed) predicts the next feature
            preds = self._run([(st, feat, [token], pos) for _, st, feat, token, pos in more])  # [lanes, H]
            active = [(lane, st, preds[j:j + 1], pos + 1) for j, (lane, st, _, _, pos) in enumerate(more)]
        for i, lane, st, backlog in lanes:
            lane.rollback()
            self.confidence.drafted(lane.req.seq_id, lane.confidences)
            out[i] = Draft(tokens=lane.drafted, probs=lane.q(), catch_up_tokens=backlog, cut=lane.cut,
                           catch_up_seconds=share * backlog)
        return out

    def accept(self, seq_id: int, num_accepted: int, path: list[int] | None = None) -> None:
        self.confidence.verified(seq_id, num_accepted)  # the features of the kept rows come by take_features

    def end(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)
        self.confidence.end(seq_id)

    # -- the head's forwards ------------------------------------------------------------------
    def _catch_up(self, seqs: list[tuple[_State, list[int]]]) -> None:
        """Feed every pair (f_p, x_{p+1}) whose feature and next token are known, for all ``seqs``
        (each a state and its sequence's tokens) in one forward."""
        parts, pending = [], []
        for st, tokens in seqs:
            end = min(st.feats_end, len(tokens) - 1)  # last position p + 1 with x_{p+1} known
            if end > st.fed:
                feats = torch.cat(st.feats)  # [pending, H] from feats_start
                parts.append((st, feats[st.fed - st.feats_start:end - st.feats_start], tokens[st.fed + 1:end + 1],
                              st.fed))
                pending.append(feats)
        if not parts:
            return
        preds = self._run(parts)
        row = 0
        for (st, feats, _, pos), all_feats in zip(parts, pending):
            row += feats.shape[0]
            end = pos + feats.shape[0]
            st.fed, st.last = end, preds[row - 1:row]
            st.keep_feats(end, all_feats[end - st.feats_start:])

    @torch.inference_mode()
    def _run(self, parts: list[tuple[_State, torch.Tensor, list[int], int]]) -> torch.Tensor:
        """The head's layer on each part's pairs -- (state, features [rows, H], next tokens, first
        position) -- written into that sequence's cache, in one forward; returns the predicted
        features [all rows, H] in part order."""
        for st, feats, _, pos in parts:
            self._reserve(st, pos + feats.shape[0])
        feats = torch.cat([f for _, f, _, _ in parts])  # [rows, H]
        embeds = self._embed(torch.tensor([t for _, _, toks, _ in parts for t in toks])).float()  # [rows, H]
        positions = torch.cat([torch.arange(pos, pos + f.shape[0]) for _, f, _, pos in parts])

        def attend(q, k, v):  # each part's rows against its own sequence's cache
            outs, row = [], 0
            for st, f, _, pos in parts:
                n, lo = f.shape[0], pos - st.base
                st.keys[lo:lo + n], st.values[lo:lo + n] = k[row:row + n], v[row:row + n]
                outs.append(grouped_attention(q[row:row + n], st.keys[:lo + n], st.values[:lo + n], lo))
                row += n
            return torch.cat(outs)

        return layer(self.cfg, lambda name, x: self._lin[name](x), self._norms.__getitem__, feats, embeds,
                     positions, attend)

    def _reserve(self, st: _State, end: int) -> None:
        """Room in the sequence's cache for positions up to ``end`` (doubling)."""
        need = end - st.base
        if need <= st.keys.shape[0]:
            return
        cap = max(need, 2 * st.keys.shape[0])
        for name in ("keys", "values"):
            old = getattr(st, name)
            grown = torch.zeros((cap, *old.shape[1:]))
            grown[:old.shape[0]] = old
            setattr(st, name, grown)
