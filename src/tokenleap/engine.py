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
from dataclasses import replace

import torch

from .cache import KVCache
from .config import SamplingParams
from .controller import ControllerConfig, DraftLengthController
from .errors import PromptTooLongError
from .logprobs import token_logprobs
from .metrics import SpecStats
from .models.transformer import Segment, Transformer
from .penalties import apply_penalties
from .proposers.base import Draft, DraftRequest, Proposer
from .sampling import logits_to_probs, request_randomness
from .seeded import SeededNoise
from .sequence import Sequence
from .verify import Verification, verify_coupled, verify_greedy, verify_sampling


class Engine:
    def __init__(self, model: Transformer, tokenizer, *, max_len: int | None = None, num_slots: int = 1,
                 proposer: Proposer | None = None, controller: ControllerConfig | None = None,
                 prefill_chunk: int = 256, cache: KVCache | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_len = min(max_len or model.config.max_position_embeddings, model.config.max_position_embeddings)
        if cache is not None:  # e.g. a PagedKVCache shared by a serving scheduler
            self.max_len = min(self.max_len, cache.max_len)
        self.cache = cache if cache is not None else KVCache(model.config, num_slots, self.max_len, model.dtype)
        self.totals = SpecStats()  # every sequence's steps, for server metrics
        self.proposer = proposer
        self.controller = DraftLengthController(controller or ControllerConfig())
        self._attached: set[int] = set()  # sequences holding a cache slot: the batch a newcomer joins
        self.prefill_chunk = prefill_chunk
        self.eos_ids = frozenset(getattr(tokenizer, "eos_token_ids", ()) or model.config.eos_token_ids)
        self._ids = itertools.count()

    # -- lifecycle --------------------------------------------------------------------------
    def add(self, prompt: list[int], params: SamplingParams) -> Sequence:
        """Validate, allocate a cache slot and prefill; the first token is produced here."""
        seq = self.create(prompt, params)
        self.attach(seq)
        while self.prefill_step(seq):
            pass
        return seq

    def create(self, prompt: list[int], params: SamplingParams) -> Sequence:
        """Validate and build a sequence without touching the cache (then ``attach``, ``prefill_step``)."""
        if not prompt:
            raise PromptTooLongError("the prompt is empty: give at least one token")
        room = self.max_len - len(prompt)
        if room < 1:
            raise PromptTooLongError(f"the prompt has {len(prompt)} tokens but the context window is "
                                     f"{self.max_len}; shorten it or raise --max-model-len")
        if params.max_tokens > room:
            params = replace(params, max_tokens=room)
        return Sequence(seq_id=next(self._ids), prompt=list(prompt), params=params, eos_ids=self.eos_ids,
                        detokenizer=self.tokenizer.detokenizer(),
                        generator=None if params.greedy else request_randomness(params.seed))

    def attach(self, seq: Sequence) -> None:
        """Give ``seq`` a cache slot and start its proposer state (its cache is filled by ``prefill_step``)."""
        seq.slot = self.cache.allocate()
        self._attached.add(seq.seq_id)
        if self.proposer is not None:
            self.proposer.begin(seq.seq_id, seq.prompt)

    def detach(self, seq: Sequence) -> None:
        """Free ``seq``'s cache and proposer state but keep its tokens (preemption; ``attach`` resumes)."""
        if seq.slot >= 0:
            self.cache.free(seq.slot)
            seq.slot = -1
        self._attached.discard(seq.seq_id)
        if self.proposer is not None:
            self.proposer.end(seq.seq_id)

    def release(self, seq: Sequence) -> None:
        self.detach(seq)
        if seq.finish_reason is None:
            seq.finish_reason = "abort"

    def ready(self, seq: Sequence) -> bool:
        """Prefilled: the cache holds every token but the last, which the next step feeds."""
        return seq.num_generated > 0 and self.cache.lengths[seq.slot] == len(seq.tokens) - 1

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
    def prefill_step(self, seq: Sequence, draft_alongside: bool = True) -> int:
        """Fill the next chunk of ``seq``'s missing cache entries; returns its rows (0: nothing left).
        With ``draft_alongside`` a draft model may prefill the chunk too; without, it catches up at
        the first step that drafts for ``seq`` (a server: only then is the batch known).

        Prompt chunks are the fixed windows [i*chunk, (i+1)*chunk), computed with fast GEMMs; the last
        one yields the first token. After a preemption the same call recomputes the cache bitwise: the
        prompt in the same windows, then the generated tokens row-exact, as decoding computed them."""
        done, end, exact = self.prefill_window(seq)
        if end <= done:
            return 0
        t0 = time.perf_counter()
        chunk = seq.tokens[done:end]
        n_prompt = len(seq.prompt)
        # prompt logprobs: row r predicts position done + r + 1 (each recorded once, also after a preemption)
        scored = seq.params.prompt_logprobs is not None and len(seq.prompt_logprobs) < min(end + 1, n_prompt)
        rows = None if scored else torch.tensor([len(chunk) - 1])
        out = self.model(torch.tensor(chunk), [Segment(seq.slot, done, len(chunk))], self.cache,
                         logit_rows=rows, row_exact=exact)  # logits: [1 or len(chunk), vocab]
        if scored:
            first = len(seq.prompt_logprobs)  # the next prompt position without a logprob
            last = min(end + 1, n_prompt)
            if done < first <= end:
                seq.prompt_logprobs += token_logprobs(out.logits[first - done - 1:last - done - 1],
                                                      seq.tokens[first:last], seq.params.prompt_logprobs)
        if self.proposer is not None and draft_alongside:
            self._prefill_proposer(seq, seq.tokens[:end])
        if end == len(seq.prompt) and seq.num_generated == 0:
            # the last row's logits as a one-row head computes them (a many-row head may round differently)
            logits = self.model.lm_head(out.hidden[-1][-1:], exact).float() if scored else out.logits  # [1, vocab]
            kept = self._emit(seq, self._verify(seq, None, logits), logits)
            seq.stats.record_step(0, 0, kept)
            self.totals.record_step(0, 0, kept)
        seq.stats.prefill_seconds += time.perf_counter() - t0
        return len(chunk)

    def _prefill_proposer(self, seq: Sequence, tokens: list[int]) -> None:
        """A draft model fills its cache alongside the target's prefill -- unless speculation is
        not predicted to pay, with that prefill counted, at the batch this sequence joins (every
        sequence holding a slot, newcomers included); a later proposal catches up if load drops."""
        backlog = self.proposer.backlog(seq.seq_id, tokens)
        remaining = seq.params.max_tokens - seq.num_generated
        if not self.controller.would_speculate(max(1, len(self._attached)), backlog, remaining):
            return
        t0 = time.perf_counter()
        self.proposer.prefill(seq.seq_id, tokens)
        self.controller.observe_catch_up(backlog, time.perf_counter() - t0)

    def choose_k(self, seqs: list[Sequence], batch: int | None = None) -> int:
        """The controller's draft length for a step of ``seqs``, a catch-up it would need included;
        ``batch``: the batch size to judge at if more sequences are about to join (default: len(seqs))."""
        if self.proposer is None:
            return 0
        backlog = sum(self.proposer.backlog(s.seq_id, s.tokens) for s in seqs)
        remaining = sum(s.params.max_tokens - s.num_generated for s in seqs)
        return self.controller.choose(max(batch or 0, len(seqs)), backlog, remaining)

    def prefill_window(self, seq: Sequence) -> tuple[int, int, bool]:
        """(start, end, row_exact) of the next ``prefill_step``; start == end when nothing is missing."""
        done, n_prompt = self.cache.lengths[seq.slot], len(seq.prompt)
        if done < n_prompt:
            return done, min((done // self.prefill_chunk + 1) * self.prefill_chunk, n_prompt), False
        return done, max(done, min(done + self.prefill_chunk, len(seq.tokens) - 1)), True

    def step(self, seqs: list[Sequence], k: int | None = None) -> None:
        """One decoding step for every unfinished sequence in ``seqs`` (one target forward).

        ``k`` overrides the controller's draft length (a scheduler short of cache memory passes 0)."""
        seqs = [s for s in seqs if not s.finished]
        if not seqs:
            return
        start = time.perf_counter()
        if k is None or self.proposer is None:
            k = self.choose_k(seqs)
        drafts, drafting, catch_up = self._draft_all(seqs, k)
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
        if self.proposer is not None:  # what the step cost beyond the timed forwards and any catch-up
            spec = any(d is not None for d in drafts)
            self.controller.observe_step(spec, len(seqs), time.perf_counter() - start - elapsed - drafting - catch_up)

    def _draft_all(self, seqs: list[Sequence], k: int) -> tuple[list[Draft | None], float, float]:
        """Every sequence's draft for this step, from one ``propose_many`` call, the seconds spent
        drafting and the seconds the draft spent catching up on unseen tokens (not drafting)."""
        ks = [min(k, s.params.max_tokens - s.num_generated - 1, self.max_len - len(s.tokens) - 1) for s in seqs]
        asked = [(s, n) for s, n in zip(seqs, ks) if n > 0]
        if not asked:
            return [None] * len(seqs), 0.0, 0.0
        t0 = time.perf_counter()
        requests = [DraftRequest(s.seq_id, s.tokens, n, s.params, s.generator) for s, n in asked]
        got = self.proposer.propose_many(requests)
        elapsed = time.perf_counter() - t0
        catch_up = sum(d.catch_up_seconds for d in got if d is not None)  # an empty draft may have caught up
        self.controller.observe_catch_up(sum(d.catch_up_tokens for d in got if d is not None), catch_up)
        for (s, _), d in zip(asked, got):
            s.stats.prefill_seconds += d.catch_up_seconds if d is not None else 0.0
        got = [d if d is not None and d.tokens else None for d in got]
        drafting = elapsed - catch_up  # shared by the sequences in proportion to their draft tokens
        drafted = sum(len(d.tokens) for d in got if d is not None)
        by_seq = {}
        for (s, _), d in zip(asked, got):
            by_seq[s.seq_id] = d
            share = len(d.tokens) / drafted if d is not None else 0.0
            s.stats.draft_seconds += drafting * share if drafted else drafting / len(asked)
        if drafted:
            self.controller.observe_draft(drafted, drafting, batch=len(asked))
        return [by_seq.get(s.seq_id) for s in seqs], drafting if drafted else 0.0, catch_up

    def _accept(self, seq: Sequence, draft: Draft | None, logits: torch.Tensor) -> None:
        # logits: [1 + len(draft), vocab]
        n = len(seq.tokens)
        result = self._verify(seq, draft, logits)
        self.cache.truncate(seq.slot, n + result.num_accepted)  # last token + accepted drafts
        proposed = len(draft.tokens) if draft else 0
        if draft is not None:
            self.proposer.accept(seq.seq_id, result.num_accepted)
            self.controller.observe_acceptance(proposed, result.num_accepted)
        kept = self._emit(seq, result, logits)
        accepted = min(result.num_accepted, kept)
        seq.stats.record_step(proposed, accepted, kept)
        self.totals.record_step(proposed, accepted, kept)

    @staticmethod
    def _emit(seq: Sequence, result: Verification, logits: torch.Tensor) -> int:
        """Append the verified tokens (stop rules apply) and their logprobs; returns how many were kept.
        Token i of ``result`` was chosen from row i of ``logits`` [>= len(result.tokens), vocab]."""
        kept = seq.append(result.tokens)
        if seq.params.logprobs is not None and kept:
            seq.logprobs += token_logprobs(logits[:kept], result.tokens[:kept], seq.params.logprobs)
        return kept

    @staticmethod
    def _verify(seq: Sequence, draft: Draft | None, logits: torch.Tensor) -> Verification:
        drafted = torch.tensor(draft.tokens if draft else [], dtype=torch.long)  # [k]
        p = seq.params
        if p.adjusts_logits:  # the target's distribution given each row's history
            logits = apply_penalties(logits, p, seq.prompt, seq.generated, draft.tokens if draft else [])
        if p.greedy:
            return verify_greedy(drafted, logits)
        probs = logits_to_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)  # [k+1, vocab]
        if isinstance(seq.generator, SeededNoise):  # row 0 chooses the token at position len(tokens)
            return verify_coupled(drafted, probs, seq.generator, len(seq.tokens))
        return verify_sampling(drafted, draft.probs if draft else None, probs, seq.generator)
