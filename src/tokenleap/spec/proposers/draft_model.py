"""Drafting with a smaller model of the same tokenizer.

The draft keeps its own KV cache. ``fed[seq]`` counts the sequence's leading tokens whose keys and
values the draft cache holds; after a rejection it is cut back to the accepted prefix (O(1)), and
the next proposal first feeds whatever the draft has not seen (the recovered or bonus token, or
the whole prompt when the engine skipped the draft's prefill because speculation was off).
"""
from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from tokenleap.cache.contiguous import CacheFullError, KVCache
from tokenleap.config import SamplingParams
from tokenleap.errors import TokenleapError
from tokenleap.models.backend import prefix_windows
from tokenleap.models.transformer import Segment, Transformer
from tokenleap.spec.confidence import Calibration, ConfidenceLog, should_stop, token_confidence
from tokenleap.spec.sampling import greedy, params_probs, sample
from tokenleap.spec.seeded import SeededNoise
from tokenleap.spec.proposers.base import Draft, DraftRequest
from tokenleap.spec.proposers.draft_head import BatchHead, ReducedVocabHead, VocabFit
from tokenleap.spec.proposers.draft_tree import GrownTree, accept_path, grow


# a proposal normally feeds the token drafted last plus the target's recovered or bonus token
_STEP_TOKENS = 2


class DraftingLane:
    """What a lane of batched drafting (one sequence within ``propose_many``: this module's, the
    cascade's and layer skip's ``_Lane``) does with each row of logits its forward gives it; the
    dataclasses declare the fields."""

    req: DraftRequest
    drafted: list[int]
    probs: list[torch.Tensor]  # each [1, vocab]
    pushed: int  # drafted tokens the request's grammar followed
    confidences: list[float]  # each drafted token's confidence (only with req.stop_below)
    calibration: Calibration | None = None  # the proposer's confidence -> acceptance (None: identity)
    confidence: float = 1.0  # the product of the drafted tokens' calibrated confidences
    stopped: bool = False  # the confidence fell below the request's floor: no further token

    def take(self, row: torch.Tensor, pos: int) -> int:
        """Draft the token for sequence position ``pos`` from ``row`` (logits, [1, vocab]) and record
        it with its distribution q. Under a grammar (structured output) the row is masked first: q is
        then the masked distribution, which verification uses, so sampling stays exact; the grammar
        follows the token until ``rollback``. With the request's ``stop_below`` the lane stops once
        its running confidence falls below the floor for its length (``spec/confidence.py``)."""
        constraint = self.req.constraint
        if constraint is not None:
            row = constraint.draft(row)
        token, probs = DraftModelProposer._choose(row, self.req.params, self.req.generator, pos)
        if constraint is not None:
            self.pushed += constraint.push(token)
        self.drafted.append(token)
        if probs is not None:
            self.probs.append(probs)
        if self.req.stop_below:
            raw = token_confidence(row if probs is None else probs, probs is not None)
            self.confidences.append(raw)
            self.confidence *= self.calibration(raw) if self.calibration is not None else raw
            self.check_stop(next_free=False)
        return token

    def check_stop(self, next_free: bool) -> None:
        """Stop when the running confidence is below the floor for the next token, which costs a draft
        forward unless ``next_free`` (computed already: a cascade's guess the draft agreed with)."""
        self.stopped = should_stop(self.confidence, len(self.drafted), self.req.stop_below,
                                   0.0 if next_free else self.req.stop_draft)

    def wants_more(self) -> bool:
        """Whether the lane drafts another token: fewer than k so far and not stopped."""
        return len(self.drafted) < self.req.k and not self.stopped

    @property
    def cut(self) -> bool:
        """The chain ended short of k on its confidence (``Draft.cut``)."""
        return self.stopped and len(self.drafted) < self.req.k

    def rollback(self) -> None:
        """Return the request's grammar to the committed text (verification advances it itself)."""
        if self.req.constraint is not None:
            self.req.constraint.rollback(self.pushed)

    def q(self) -> torch.Tensor | None:
        """The drafted tokens' distributions, [drafted, vocab]; None when greedy (no q recorded)."""
        return torch.cat(self.probs) if self.probs else None


@dataclass(eq=False)
class _Lane(DraftingLane):
    """One sequence's drafting within ``propose_many``."""

    index: int  # position in the request list
    req: DraftRequest
    slot: int
    pending: list[int]  # tokens to feed before the next draft token
    pos: int  # cache position of pending[0]
    drafted: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # each [1, vocab]
    catch_up: float = 0.0
    catch_up_tokens: int = 0
    catch_up_drafted: int = 0  # drafted by forwards that fed a backlog
    failed: bool = False
    pushed: int = 0  # drafted tokens the request's grammar followed (undone after drafting)
    confidences: list[float] = field(default_factory=list)
    calibration: Calibration | None = None


@functools.lru_cache(maxsize=None)
def _warn_short(positions: int, max_len: int) -> None:
    """Said once a process for each pair (an LLM builds a proposer for each of its engines)."""
    logging.getLogger("tokenleap").warning(
        "the draft model reads %d positions, fewer than the %d of this context: a sequence past %d tokens "
        "decodes without it", positions, max_len, positions)


class DraftModelProposer:
    name = "draft"
    drafts_trees = True  # a request with max_nodes gets a dynamic tree (draft_tree.py)
    stops_on_confidence = True  # a chain honours DraftRequest.stop_below

    def __init__(self, model: Transformer, target_vocab_size: int, max_len: int, num_slots: int = 1,
                 cache: KVCache | None = None, head: ReducedVocabHead | None = None,
                 catch_up_chunk: int = 256, fit_vocab: bool = False) -> None:
        """``fit_vocab``: the draft shares the target's tokenizer but its embedding matrix is padded to
        another size; its logits are fitted to the target's (``draft_head.VocabFit``)."""
        if model.config.vocab_size != target_vocab_size and not fit_vocab:
            raise TokenleapError(
                f"draft model vocabulary ({model.config.vocab_size} tokens) differs from the target's "
                f"({target_vocab_size}); a draft model must share the target's tokenizer")
        self.model = model
        self.head = head  # None: the model's own full-vocabulary head
        self.target_vocab = target_vocab_size if model.config.vocab_size != target_vocab_size else None
        if target_vocab_size > model.config.vocab_size:  # the target may emit an id past the draft's rows
            model.stand_in_id = 0
        # a longer backlog is fed this many tokens a call (no draft for that sequence meanwhile),
        # so one sequence's catch-up never stalls the others of its batch for long
        self.catch_up_chunk = catch_up_chunk
        self._heads: dict[int, object] = {}
        # any cache with KVCache's interface, e.g. a PagedKVCache when serving many sequences
        self.cache = cache if cache is not None else KVCache(model.config, num_slots, max_len, model.dtype)
        # the draft drafts only within its own positions (a draft of a shorter context than the
        # target's leaves longer sequences to plain steps, as vLLM does)
        self.max_len = min(self.cache.max_len, model.config.max_context)
        if model.config.max_context < max_len:
            _warn_short(model.config.max_context, max_len)
        self._slot: dict[int, int] = {}
        self._fed: dict[int, int] = {}
        self._prompt: dict[int, list[int]] = {}
        self._tokens: dict[int, list[int]] = {}  # the sequence's tokens as last seen (for the prefix cache)
        self._proposal_start: dict[int, int] = {}
        self._grown: dict[int, GrownTree] = {}  # the last proposal of a sequence, when it was a tree
        self.confidence = ConfidenceLog()  # where a chain asked to stop on confidence learns how far to trust it

    def begin(self, seq_id: int, prompt: list[int]) -> None:
        slot = self._slot[seq_id] = self.cache.allocate()
        self._prompt[seq_id] = self._tokens[seq_id] = prompt
        # a paged cache may hold the prompt's first windows already (prefix caching): fed without work
        self._fed[seq_id] = self.cache.attach_prompt(slot, prompt, *self._windows())
        if self.head is not None:
            self._heads[seq_id] = self.head.for_prompt(prompt)

    def propose(self, seq_id: int, tokens: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft | None:
        return self.propose_many([DraftRequest(seq_id, tokens, k, params, generator)])[0]

    def propose_many(self, requests: list[DraftRequest]) -> list[Draft | None]:
        """Draft for several sequences at once: draft position j of every sequence in one forward
        (a one-row forward reads the whole draft's weights, a few rows cost little more)."""
        lanes, trees = [], []
        out: list[Draft | None] = [None] * len(requests)
        for i, r in enumerate(requests):
            self._grown.pop(r.seq_id, None)
            self._tokens[r.seq_id] = r.tokens
            if r.k <= 0 or len(r.tokens) + r.k > self.max_len:
                continue
            fed = min(self._fed[r.seq_id], len(r.tokens) - 1)
            if r.max_nodes > 0 and r.constraint is None and len(r.tokens) - fed <= self.catch_up_chunk:
                trees.append((i, r))  # a token tree (draft_tree.py); a grammar's drafts stay chains
                continue
            if len(r.tokens) - fed > self.catch_up_chunk:  # a long backlog: one chunk now, drafts later
                out[i] = self._catch_up_chunk(r.seq_id, r.tokens[fed:fed + self.catch_up_chunk], fed)
                continue
            self._proposal_start[r.seq_id] = len(r.tokens)
            lanes.append(_Lane(i, r, self._slot[r.seq_id], r.tokens[fed:], fed,  # pending: at least the last token
                               calibration=self.confidence.calibration))
        active = lanes
        while active := [l for l in active if l.wants_more()]:
            if not self._draft_position(active):  # a paged cache out of blocks: no draft for these
                for l in active:
                    l.failed = True
                    valid = min(l.pos, len(l.req.tokens))  # drafted tokens fed so far are not the sequence's
                    self._fed[l.req.seq_id] = valid
                    self.cache.truncate(l.slot, valid)
                active = []
        if trees:
            drafts, grown = grow(self, trees)
            self._grown.update(grown)
            for i, d in drafts.items():
                out[i] = d
        for l in lanes:
            l.rollback()
            self.confidence.drafted(l.req.seq_id, [] if l.failed else l.confidences)
            if not l.failed:
                self._fed[l.req.seq_id] = l.pos  # the last drafted token is not fed yet
                out[l.index] = Draft(tokens=l.drafted, probs=l.q(), catch_up_seconds=l.catch_up,
                                     catch_up_tokens=l.catch_up_tokens, catch_up_drafted=l.catch_up_drafted,
                                     cut=l.cut)
        return out

    def _draft_position(self, lanes: list["_Lane"]) -> bool:
        """Feed every lane's pending tokens in one forward and draft each lane's next token."""
        tokens, segments, last = [], [], []
        for l in lanes:
            segments.append(Segment(l.slot, l.pos, len(l.pending), row_start=len(tokens)))
            tokens += l.pending
            last.append(len(tokens) - 1)
        t0 = time.perf_counter()
        # a few rows a lane: the decode path (row-exact kernels, one compiled call a layer); a backlog: prefill
        few = all(len(l.pending) <= _STEP_TOKENS for l in lanes) or bool(self._windows()[1])
        try:
            logits = self.model(torch.tensor(tokens), segments, self.cache, logit_rows=torch.tensor(last),
                                row_exact=few, head=self._head_for([l.req.seq_id for l in lanes])).logits  # [lanes, vocab]
        except CacheFullError:
            return False
        backlog = [l for l in lanes if len(l.pending) > _STEP_TOKENS]  # feeding a backlog: prefill work
        for l in backlog:
            l.catch_up += (time.perf_counter() - t0) / len(backlog)
            l.catch_up_tokens += len(l.pending)
        for j, l in enumerate(lanes):
            l.pos += len(l.pending)
            l.pending = [l.take(logits[j : j + 1], l.pos)]
        for l in backlog:
            l.catch_up_drafted += 1
        return True

    def _catch_up_chunk(self, seq_id: int, tokens: list[int], pos: int) -> Draft:
        """Feed one chunk of a long backlog (``tokens`` from position ``pos``); an empty draft
        reports the time it took."""
        t0 = time.perf_counter()
        self._feed(seq_id, tokens, pos)
        return Draft(tokens=[], probs=None, catch_up_seconds=time.perf_counter() - t0, catch_up_tokens=len(tokens))

    def _head_for(self, seq_ids: list[int]):
        if self.head is None:
            return self._fitted(None)
        heads = [self._heads[s] for s in seq_ids]
        return self._fitted(heads[0] if len(heads) == 1 else BatchHead(heads))

    def _fitted(self, head):
        """``head`` (None: the model's own) with its logits fitted to the target's vocabulary where
        the two sizes differ; else ``head`` unchanged."""
        if self.target_vocab is None:
            return head
        return VocabFit(head or self.model.lm_head, self.target_vocab)

    def backlog(self, seq_id: int, tokens: list[int]) -> int:
        return max(0, len(tokens) - self._fed[seq_id] - _STEP_TOKENS)

    def prefill(self, seq_id: int, tokens: list[int]) -> None:
        """Feed ``tokens`` not yet fed, alongside the target's chunked prefill, so the first
        proposal does not stall on a long prompt (nor count the prompt as drafting time)."""
        fed = self._fed[seq_id]
        self._tokens[seq_id] = tokens
        if fed < len(tokens) < self.max_len:  # (past its positions the draft never drafts: nothing to feed)
            self._feed(seq_id, tokens[fed:], fed)

    def _feed(self, seq_id: int, tokens: list[int], pos: int) -> None:
        """Put ``tokens`` (from position ``pos``, the first not fed) into the draft cache."""
        slot = self._slot[seq_id]
        try:
            self._forward(slot, tokens, pos)
        except CacheFullError:
            self.cache.truncate(slot, pos)
            return
        self._fed[seq_id] = pos + len(tokens)
        self.cache.register_prefill(slot, self._prompt[seq_id], self._tokens[seq_id], pos, pos + len(tokens),
                                    *self._windows())

    def accept(self, seq_id: int, num_accepted: int, path: list[int] | None = None) -> None:
        """``path``: the accepted nodes of a tree proposal (a chain's are 1 .. num_accepted)."""
        self.confidence.verified(seq_id, num_accepted)
        grown = self._grown.pop(seq_id, None)
        if grown is not None:
            accept_path(self, seq_id, grown, path if path is not None else list(range(1, num_accepted + 1)))
            return
        valid = self._proposal_start[seq_id] + num_accepted  # tokens both agree on
        self._fed[seq_id] = min(self._fed[seq_id], valid)
        self.cache.truncate(self._slot[seq_id], self._fed[seq_id])

    def fed(self, seq_id: int) -> int:
        """How many of the sequence's leading tokens the draft cache holds."""
        return self._fed[seq_id]

    def rewind(self, seq_id: int, length: int) -> None:
        """Keep only the first ``length`` fed tokens (a caller whose token ids changed past them:
        a draft of another tokenizer re-tokenizing the accepted text)."""
        if length < self._fed[seq_id]:
            self._fed[seq_id] = length
            self.cache.truncate(self._slot[seq_id], length)

    def end(self, seq_id: int) -> None:
        slot = self._slot.pop(seq_id, None)
        if slot is not None:
            window, salt = self._windows()
            if salt:  # row-exact entries: the reply's whole blocks too, for a follow-up turn
                self.cache.register_computed(slot, self._tokens[seq_id], self._fed[seq_id], window, salt)
            self.cache.free(slot)
        self._tokens.pop(seq_id, None)
        self._fed.pop(seq_id, None)
        self._prompt.pop(seq_id, None)
        self._proposal_start.pop(seq_id, None)
        self._heads.pop(seq_id, None)
        self._grown.pop(seq_id, None)
        self.confidence.end(seq_id)

    def _forward(self, slot: int, tokens: list[int], pos: int, head=None) -> torch.Tensor:
        seg = [Segment(slot=slot, pos_start=pos, length=len(tokens))]
        last = torch.tensor([len(tokens) - 1])
        return self.model(torch.tensor(tokens), seg, self.cache, logit_rows=last, head=head,
                          row_exact=bool(self._windows()[1])).logits

    def _windows(self) -> tuple[int, bytes]:
        """(window, salt) of the draft cache's prefix entries (``backend.prefix_windows``): single
        blocks where this draft computes every row row-exact at no cost, else its catch-up chunks."""
        return prefix_windows(self.model, self.cache, self.catch_up_chunk)

    @staticmethod
    def _choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | SeededNoise | None,
                pos: int) -> tuple[int, torch.Tensor | None]:
        """The draft token for sequence position ``pos`` from ``logits`` [1, vocab]; with a seeded
        request's noise, the choice the target makes if its distribution is the draft's."""
        if params.greedy:
            return int(greedy(logits)[0]), None
        probs = params_probs(logits, params)  # [1, vocab]
        if not 0 < float(probs.sum()) < math.inf:  # (probabilities are never negative: one sum tells)
            # a diverged draft row (NaN or inf logits): drafting from the uniform q keeps verification
            # exact; sampling the broken row would pick an id past the vocabulary
            probs = torch.full_like(probs, 1.0 / probs.shape[-1])
        if isinstance(generator, SeededNoise):
            return int(generator.choose(probs, pos)[0]), probs
        return int(sample(probs, generator)[0]), probs  # probs: [1, vocab]
