"""Filling a sequence's cache: the prompt in fixed windows, the first token, a draft model's prefill
alongside -- and, after a preemption, the same entries recomputed bitwise. ``Engine``'s base: the
decoding step (``engine.py``) reads the cache these calls fill."""
from __future__ import annotations

import time

import torch

from tokenleap.cache.contiguous import KVCache
from tokenleap.models.backend import prefix_windows
from tokenleap.models.transformer import Segment, Transformer
from tokenleap.spec.controller import DraftLengthController
from tokenleap.spec.logprobs import token_logprobs
from tokenleap.spec.proposers.base import Proposer
from tokenleap.spec.report import outcome, record_stats
from tokenleap.spec.sequence import Sequence
from tokenleap.spec.stats import SpecStats
from tokenleap.spec.step_verify import TargetRows, check_finite, verify_chain


class Prefill:
    """The engine's prefill calls; the attributes below are ``Engine``'s."""

    model: Transformer
    cache: KVCache
    proposer: Proposer | None
    controller: DraftLengthController
    totals: SpecStats
    prefill_chunk: int
    tree_nodes: int

    def prefill_step(self, seq: Sequence, draft_alongside: bool = True) -> int:
        """Fill the next chunk of ``seq``'s missing cache entries; returns its rows (0: nothing left).
        With ``draft_alongside`` a draft model may prefill the chunk too; without, it catches up at
        the first step that drafts for ``seq`` (a server: only then is the batch known).

        Prompt chunks are the fixed windows [i*chunk, (i+1)*chunk), computed with fast GEMMs -- or
        row-exact where that costs nothing (``backend.exact_prefill_is_free``); the last one yields the
        first token. After a preemption the same call recomputes the cache bitwise: the prompt in the
        same windows, then the generated tokens row-exact, as decoding computed them."""
        done, end, exact = self.prefill_window(seq)
        if end <= done:
            return 0
        t0 = time.perf_counter()
        chunk = seq.tokens[done:end]
        n_prompt = len(seq.prompt)
        # prompt logprobs: row r predicts position done + r + 1 (each recorded once, also after a preemption)
        scored = seq.params.prompt_logprobs is not None and len(seq.prompt_logprobs) < min(end + 1, n_prompt)
        rows = None if scored else torch.tensor([len(chunk) - 1])
        last_layer = (self.model.config.num_hidden_layers - 1,) if self._feature_takers else ()
        out = self.model(torch.tensor(chunk), [Segment(seq.slot, done, len(chunk))], self.cache,
                         logit_rows=rows, row_exact=exact, hidden_layers=last_layer)  # logits: [1 or len(chunk), vocab]
        check_finite(out.logits)
        if last_layer:  # every row's features (the final norm's output) to a proposer drafting from them
            feats = self.model.model.norm(out.hidden[last_layer[0]])  # [len(chunk), hidden]
            for taker in self._feature_takers:
                taker.take_features(seq.seq_id, done, feats)
        if scored:
            first = len(seq.prompt_logprobs)  # the next prompt position without a logprob
            last = min(end + 1, n_prompt)
            if done < first <= end:
                seq.prompt_logprobs += token_logprobs(out.logits[first - done - 1:last - done - 1],
                                                      seq.tokens[first:last], seq.params.prompt_logprobs)
        self.cache.register_prefill(seq.slot, seq.prompt, seq.tokens, done, end, *self._prefix_windows())  # for reuse
        if self.proposer is not None and draft_alongside:
            self._prefill_proposer(seq, seq.tokens[:end])
        if end == len(seq.prompt) and seq.num_generated == 0:
            # the last row's logits as a one-row head computes them (a many-row head may round differently)
            logits = self.model.lm_head(out.hidden[-1][-1:], exact).float() if scored else out.logits  # [1, vocab]
            result = verify_chain(seq, None, TargetRows(logits))
            record_stats(outcome(seq.seq_id, "none", None, result, self._emit(seq, result, logits), len(chunk)),
                         seq.stats, self.totals)
        seq.stats.prefill_seconds += time.perf_counter() - t0
        return len(chunk)

    def _prefill_proposer(self, seq: Sequence, tokens: list[int]) -> None:
        """A draft model fills its cache alongside the target's prefill -- unless speculation is
        not predicted to pay, with that prefill counted, at the batch this sequence joins (every
        sequence holding a slot, newcomers included); a later proposal catches up if load drops.
        A request alone on the engine starts from the prior acceptance (``new_text``: what was
        learned describes other text) and always feeds the draft, unless drafting could not pay
        even at full acceptance; its own first steps then decide."""
        batch = max(1, len(self._attached))
        if hasattr(self.proposer, "plan"):  # a composite (--spec auto) judges each of its proposers itself
            self.proposer.prefill(seq.seq_id, tokens, batch, self.expected_remaining(seq))
            return
        if batch == 1 and seq.num_generated == 0:  # (a preempted request resuming is the same text)
            self.controller.new_text()
        backlog = self.proposer.backlog(seq.seq_id, tokens)
        nodes = self.tree_nodes if self._tree_mode() == "auto" else 0
        lone = batch == 1 and self.controller.could_pay(1)
        if not lone and not self.controller.would_speculate(batch, backlog, self.expected_remaining(seq), nodes):
            return
        t0 = time.perf_counter()
        self.proposer.prefill(seq.seq_id, tokens)
        self.controller.observe_catch_up(backlog, time.perf_counter() - t0)

    def prefill_window(self, seq: Sequence) -> tuple[int, int, bool]:
        """(start, end, row_exact) of the next ``prefill_step``; start == end when nothing is missing."""
        done, n_prompt = self.cache.lengths[seq.slot], len(seq.prompt)
        if done < n_prompt:
            exact = bool(self._prefix_windows()[1])
            return done, min((done // self.prefill_chunk + 1) * self.prefill_chunk, n_prompt), exact
        return done, max(done, min(done + self.prefill_chunk, len(seq.tokens) - 1)), True

    def _prefix_windows(self) -> tuple[int, bytes]:
        return prefix_windows(self.model, self.cache, self.prefill_chunk)
