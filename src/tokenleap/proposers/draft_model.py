"""Drafting with a smaller model of the same tokenizer.

The draft keeps its own KV cache. ``fed[seq]`` counts the sequence's leading tokens whose keys and
values the draft cache holds; after a rejection it is cut back to the accepted prefix (O(1)), and
the next proposal first feeds whatever the draft has not seen (the recovered or bonus token, or
the whole prompt when the engine skipped the draft's prefill because speculation was off).
"""
from __future__ import annotations

import time

import torch

from ..cache import CacheFullError, KVCache
from ..config import SamplingParams
from ..errors import TokenleapError
from ..models.transformer import Segment, Transformer
from ..sampling import greedy, logits_to_probs, sample
from .base import Draft
from .draft_head import ReducedVocabHead


# a proposal normally feeds the token drafted last plus the target's recovered or bonus token
_STEP_TOKENS = 2


class DraftModelProposer:
    name = "draft"

    def __init__(self, model: Transformer, target_vocab_size: int, max_len: int, num_slots: int = 1,
                 cache: KVCache | None = None, head: ReducedVocabHead | None = None) -> None:
        if model.config.vocab_size != target_vocab_size:
            raise TokenleapError(
                f"draft model vocabulary ({model.config.vocab_size} tokens) differs from the target's "
                f"({target_vocab_size}); a draft model must share the target's tokenizer")
        self.model = model
        self.head = head  # None: the model's own full-vocabulary head
        self._heads: dict[int, object] = {}
        # any cache with KVCache's interface, e.g. a PagedKVCache when serving many sequences
        self.cache = cache if cache is not None else KVCache(model.config, num_slots, max_len, model.dtype)
        self._slot: dict[int, int] = {}
        self._fed: dict[int, int] = {}
        self._proposal_start: dict[int, int] = {}

    def begin(self, seq_id: int, prompt: list[int]) -> None:
        self._slot[seq_id] = self.cache.allocate()
        self._fed[seq_id] = 0
        if self.head is not None:
            self._heads[seq_id] = self.head.for_prompt(prompt)

    def propose(self, seq_id: int, tokens: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft | None:
        slot, fed = self._slot[seq_id], min(self._fed[seq_id], len(tokens) - 1)
        if len(tokens) + k > self.cache.max_len:
            return None
        self._proposal_start[seq_id] = len(tokens)
        pending = tokens[fed:]  # at least the last token; more after a skipped prefill
        drafted: list[int] = []
        rows: list[torch.Tensor] = []
        pos, catch_up = fed, 0.0
        for _ in range(k):
            t0 = time.perf_counter()
            try:
                logits = self._forward(slot, pending, pos, self._heads.get(seq_id))  # [1, vocab]
            except CacheFullError:  # a paged cache out of blocks: no draft this step
                self._fed[seq_id] = pos
                self.cache.truncate(slot, pos)
                return None
            if len(pending) > _STEP_TOKENS:  # feeding a backlog: prefill work, not drafting
                catch_up += time.perf_counter() - t0
            pos += len(pending)
            token, probs = self._choose(logits, params, generator)
            drafted.append(token)
            if probs is not None:
                rows.append(probs)
            pending = [token]
        self._fed[seq_id] = pos  # the last drafted token is not fed yet
        return Draft(tokens=drafted, probs=torch.cat(rows) if rows else None, catch_up_seconds=catch_up)

    def prefill(self, seq_id: int, tokens: list[int]) -> None:
        """Feed ``tokens`` not yet fed, alongside the target's chunked prefill, so the first
        proposal does not stall on a long prompt (nor count the prompt as drafting time)."""
        slot, fed = self._slot[seq_id], self._fed[seq_id]
        if fed >= len(tokens):
            return
        try:
            self._forward(slot, tokens[fed:], fed)
        except CacheFullError:
            self.cache.truncate(slot, fed)
            return
        self._fed[seq_id] = len(tokens)

    def accept(self, seq_id: int, num_accepted: int) -> None:
        valid = self._proposal_start[seq_id] + num_accepted  # tokens both agree on
        self._fed[seq_id] = min(self._fed[seq_id], valid)
        self.cache.truncate(self._slot[seq_id], self._fed[seq_id])

    def end(self, seq_id: int) -> None:
        slot = self._slot.pop(seq_id, None)
        if slot is not None:
            self.cache.free(slot)
        self._fed.pop(seq_id, None)
        self._proposal_start.pop(seq_id, None)
        self._heads.pop(seq_id, None)

    def _forward(self, slot: int, tokens: list[int], pos: int, head=None) -> torch.Tensor:
        seg = [Segment(slot=slot, pos_start=pos, length=len(tokens))]
        last = torch.tensor([len(tokens) - 1])
        return self.model(torch.tensor(tokens), seg, self.cache, logit_rows=last, head=head).logits

    @staticmethod
    def _choose(logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
        # logits: [1, vocab]
        if params.greedy:
            return int(greedy(logits)[0]), None
        probs = logits_to_probs(logits, params.temperature, params.top_k, params.top_p, params.min_p)
        return int(sample(probs, generator)[0]), probs  # probs: [1, vocab]
