"""The decoding step: propose -> one target forward over every drafted position -> verify ->
roll both caches back to what was accepted -> hand out the accepted tokens.

Plain decoding is the same step with an empty draft. All rows of a step, over every running
sequence, go through one target forward in ``row_exact`` mode, so a position's logits are bitwise
the same whether it was computed alone, inside a draft block or next to other sequences -- which
is what makes greedy speculative output token-identical to plain greedy output.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import torch

from .cache import KVCache
from .config import SamplingParams
from .controller import ControllerConfig, DraftLengthController
from .errors import PromptTooLongError
from .models.transformer import Segment, Transformer
from .proposers.base import Draft, Proposer
from .sampling import logits_to_probs, make_generator
from .sequence import Sequence
from .verify import Verification, verify_greedy, verify_sampling


class Engine:
    def __init__(self, model: Transformer, tokenizer, *, max_len: int | None = None, num_slots: int = 1,
                 proposer: Proposer | None = None, controller: ControllerConfig | None = None,
                 prefill_chunk: int = 256) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_len = min(max_len or model.config.max_position_embeddings, model.config.max_position_embeddings)
        self.cache = KVCache(model.config, num_slots, self.max_len, model.dtype)
        self.proposer = proposer
        self.controller = DraftLengthController(controller or ControllerConfig())
        self.prefill_chunk = prefill_chunk
        self.eos_ids = frozenset(getattr(tokenizer, "eos_token_ids", ()) or model.config.eos_token_ids)
        self._ids = itertools.count()

    # -- lifecycle --------------------------------------------------------------------------
    def add(self, prompt: list[int], params: SamplingParams) -> Sequence:
        """Validate, allocate a cache slot and prefill; the first token is produced here."""
        if not prompt:
            raise PromptTooLongError("the prompt is empty: give at least one token")
        room = self.max_len - len(prompt)
        if room < 1:
            raise PromptTooLongError(f"the prompt has {len(prompt)} tokens but the context window is "
                                     f"{self.max_len}; shorten it or raise --max-model-len")
        if params.max_tokens > room:
            params = _replace_max_tokens(params, room)
        seq = Sequence(seq_id=next(self._ids), prompt=list(prompt), params=params, eos_ids=self.eos_ids,
                       detokenizer=self.tokenizer.detokenizer(),
                       generator=None if params.greedy else make_generator(params.seed))
        seq.slot = self.cache.allocate()
        if self.proposer is not None:
            self.proposer.begin(seq.seq_id, seq.prompt)
        self._prefill(seq)
        return seq

    def release(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            self.cache.free(seq.slot)
            seq.slot = -1
        if self.proposer is not None:
            self.proposer.end(seq.seq_id)
        if seq.finish_reason is None:
            seq.finish_reason = "abort"

    def generate(self, prompt: list[int], params: SamplingParams) -> Iterator[tuple[Sequence, str]]:
        """Decode one request; yields (sequence, new text) after every step."""
        t0 = time.perf_counter()
        seq = self.add(prompt, params)
        try:
            yield seq, seq.take_text()
            while not seq.finished:
                self.step([seq])
                yield seq, seq.take_text()
        finally:
            seq.stats.total_seconds = time.perf_counter() - t0
            self.release(seq)

    # -- the step ---------------------------------------------------------------------------
    def _prefill(self, seq: Sequence) -> None:
        t0 = time.perf_counter()
        n = len(seq.prompt)
        for start in range(0, n, self.prefill_chunk):
            chunk = seq.prompt[start:start + self.prefill_chunk]
            last = torch.tensor([len(chunk) - 1])
            out = self.model(torch.tensor(chunk), [Segment(seq.slot, start, len(chunk))], self.cache,
                             logit_rows=last)
        result = self._verify(seq, None, out.logits)  # [1, vocab]
        seq.stats.prefill_seconds += time.perf_counter() - t0
        seq.stats.record_step(0, 0, seq.append(result.tokens))

    def step(self, seqs: list[Sequence]) -> None:
        """One decoding step for every unfinished sequence in ``seqs`` (one target forward)."""
        seqs = [s for s in seqs if not s.finished]
        if not seqs:
            return
        k = self.controller.choose(len(seqs)) if self.proposer is not None else 0
        drafts = [self._draft(s, k) for s in seqs]
        tokens, segments, row = [], [], 0
        for s, d in zip(seqs, drafts):
            block = [s.tokens[-1]] + (d.tokens if d else [])
            segments.append(Segment(s.slot, len(s.tokens) - 1, len(block), row_start=row))
            tokens += block
            row += len(block)
        t0 = time.perf_counter()
        logits = self.model(torch.tensor(tokens), segments, self.cache, row_exact=True).logits  # [rows, vocab]
        elapsed = time.perf_counter() - t0
        self.controller.observe_forward(row, elapsed)
        for s, d, seg in zip(seqs, drafts, segments):
            s.stats.verify_seconds += elapsed * seg.length / row
            self._accept(s, d, logits[seg.row_start:seg.row_start + seg.length])

    def _draft(self, seq: Sequence, k: int) -> Draft | None:
        k = min(k, seq.params.max_tokens - seq.num_generated - 1, self.max_len - len(seq.tokens) - 1)
        if k <= 0:
            return None
        t0 = time.perf_counter()
        draft = self.proposer.propose(seq.seq_id, seq.tokens, k, seq.params, seq.generator)
        elapsed = time.perf_counter() - t0
        seq.stats.draft_seconds += elapsed
        if draft is not None and draft.tokens:
            self.controller.observe_draft(len(draft.tokens), elapsed)
            return draft
        return None

    def _accept(self, seq: Sequence, draft: Draft | None, logits: torch.Tensor) -> None:
        # logits: [1 + len(draft), vocab]
        n = len(seq.tokens)
        result = self._verify(seq, draft, logits)
        self.cache.truncate(seq.slot, n + result.num_accepted)  # last token + accepted drafts
        proposed = len(draft.tokens) if draft else 0
        if draft is not None:
            self.proposer.accept(seq.seq_id, result.num_accepted)
            self.controller.observe_acceptance(proposed, result.num_accepted)
        kept = seq.append(result.tokens)
        seq.stats.record_step(proposed, min(result.num_accepted, kept), kept)

    @staticmethod
    def _verify(seq: Sequence, draft: Draft | None, logits: torch.Tensor) -> Verification:
        drafted = torch.tensor(draft.tokens if draft else [], dtype=torch.long)  # [k]
        p = seq.params
        if p.greedy:
            return verify_greedy(drafted, logits)
        probs = logits_to_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)  # [k+1, vocab]
        return verify_sampling(drafted, draft.probs if draft else None, probs, seq.generator)


def _replace_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    from dataclasses import replace
    return replace(params, max_tokens=max_tokens)
