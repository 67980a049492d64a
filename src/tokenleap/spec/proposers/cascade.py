"""Cascade drafting: the draft model's own steps are speculated by n-gram lookup.

A draft model proposes k tokens with k one-position forwards. Where the text repeats, n-gram lookup
over the sequence (its committed tokens and what the draft produced so far) guesses the draft's next
tokens; one draft forward then runs over the pending token(s) and the guesses, and the draft keeps
its own choice at each row while it equals the guess before it (greedy: its argmax; seeded: its
seeded race; unseeded: a sample from its row, drawn in order from the request's generator as
plain drafting draws it). A guess the draft would not have produced ends the forward; its rows are
dropped from the draft cache.

The draft's forward is row-exact whenever guesses ride along (a row's logits are bitwise those of a
one-row forward over the same prefix), so the tokens proposed, and each token's distribution ``q``
handed to the target's verifier, are exactly what plain draft-model drafting produces: the target's
output is unchanged and only the number of draft forwards drops. A forward that feeds a long
backlog (the prefill path) carries no guesses, so it too computes what plain drafting computes.
"""
from __future__ import annotations

import time

import torch

from tokenleap.cache.contiguous import CacheFullError
from tokenleap.models.transformer import Segment
from tokenleap.spec.proposers.draft_head import BatchHead
from tokenleap.spec.proposers.draft_model import _STEP_TOKENS, DraftModelProposer, _Lane
from tokenleap.spec.proposers.ngram import _Index
from tokenleap.spec.proposers.output_pool import OutputPool


class CascadeDraftProposer(DraftModelProposer):
    """A :class:`DraftModelProposer` whose autoregressive drafting is itself speculated by n-gram
    lookup (``ngram_max`` .. ``ngram_min`` long suffixes); ``stats`` counts its draft forwards."""

    name = "cascade"

    def __init__(self, *args, ngram_max: int = 4, ngram_min: int = 2, pool: OutputPool | None = None,
                 **kwargs) -> None:
        # ngram_min 2: one-token matches guessed poorly on Qwen (a fifth to a quarter of the guessed
        # rows kept with them allowed), and every guessed row costs draft compute
        super().__init__(*args, **kwargs)
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.output_pool = pool  # earlier outputs: guesses where the text has none (``ngram.py``)
        self._index: dict[int, _Index] = {}
        # draft forwards run, guessed rows fed, guesses the draft kept (for stats and tests)
        self.stats = {"forwards": 0, "guessed": 0, "kept": 0}

    def begin(self, seq_id: int, prompt: list[int]) -> None:
        super().begin(seq_id, prompt)
        self._index[seq_id] = _Index(self.ngram_min, self.ngram_max)

    def predict(self, seq_id: int, prediction: list[int]) -> None:
        """The request's predicted output (OpenAI's ``prediction``): guesses come from it too."""
        self._index[seq_id].set_reference(prediction)

    def end(self, seq_id: int) -> None:
        super().end(seq_id)
        self._index.pop(seq_id, None)

    def _guesses(self, lane: _Lane) -> list[int]:
        """Up to the lane's room minus one tokens guessed to follow its drafted tokens: what followed
        the latest earlier occurrence of the longest matching suffix (committed text indexed)."""
        # the forward drafts one token past the guesses; a chain that may run past its planned length on
        # its confidence carries guesses up to that length only (rows its confidence may never reach)
        room = min(lane.req.k, lane.req.planned or lane.req.k) - len(lane.drafted) - 1
        if room <= 0:
            return []
        index = self._index[lane.req.seq_id]
        committed = lane.req.tokens
        index.truncate(len(committed))
        index.extend(committed)  # incremental: committed tokens only grow
        return index.continuation(committed + lane.drafted if lane.drafted else committed, room, self.output_pool)

    def _draft_position(self, lanes: list[_Lane]) -> bool:
        """Feed every lane's pending tokens and its n-gram guesses in one forward; each lane drafts
        one token, plus one more for every leading guess equal to the draft's own choice."""
        few = all(len(l.pending) <= _STEP_TOKENS for l in lanes)  # row-exact: guesses may ride along
        guesses = [self._guesses(l) if few else [] for l in lanes]
        tokens, segments, rows, row_heads = [], [], [], []
        for l, g in zip(lanes, guesses):
            segments.append(Segment(l.slot, l.pos, len(l.pending) + len(g), row_start=len(tokens)))
            tokens += l.pending + g
            first = len(tokens) - len(g) - 1  # the row of the last pending token
            rows.append(first)
            row_heads += [l.req.seq_id] * (len(g) + 1)
        logit_rows = torch.tensor([r + j for r, g in zip(rows, guesses) for j in range(len(g) + 1)])
        t0 = time.perf_counter()
        try:
            logits = self.model(torch.tensor(tokens), segments, self.cache, logit_rows=logit_rows,
                                row_exact=few, head=self._row_heads(row_heads)).logits  # [sum(g + 1), vocab]
        except CacheFullError:
            if not any(guesses):
                return False
            for l in lanes:  # room for the pending tokens alone, perhaps: plain drafting's forward
                self.cache.truncate(l.slot, l.pos)
            return super()._draft_position(lanes)
        self.stats["forwards"] += 1
        backlog = [l for l in lanes if len(l.pending) > _STEP_TOKENS]  # feeding a backlog: prefill work
        for l in backlog:
            l.catch_up += (time.perf_counter() - t0) / len(backlog)
            l.catch_up_tokens += len(l.pending)
        at = 0
        before = {id(l): len(l.drafted) for l in backlog}
        for l, g in zip(lanes, guesses):
            l.pos += len(l.pending)
            kept = 0
            for j in range(len(g) + 1):
                token = l.take(logits[at + j: at + j + 1], l.pos + j)
                if j == len(g) or token != g[j]:
                    break
                if l.req.stop_below:  # the next token's row is in this forward: only its verification costs
                    l.check_stop(next_free=True)
                if l.stopped:  # (its later guesses are dropped)
                    break
                kept += 1
            at += len(g) + 1
            self.stats["guessed"] += len(g)
            self.stats["kept"] += kept
            l.pos += kept  # the kept guesses are fed; the rest leave the draft cache
            if kept < len(g):
                self.cache.truncate(l.slot, l.pos)
            l.pending = [l.drafted[-1]]
        for l in backlog:
            l.catch_up_drafted += len(l.drafted) - before[id(l)]
        return True

    def _row_heads(self, seq_ids: list[int]):
        """The reduced-vocabulary head for rows of these sequences (one head per row), or None."""
        if self.head is None:
            return self._fitted(None)
        return self._fitted(BatchHead([self._heads[s] for s in seq_ids]))


__all__ = ["CascadeDraftProposer"]
