"""The decoding step: propose -> one target forward over every drafted position -> verify ->
roll both caches back to what was accepted -> hand out the accepted tokens.

A proposal is a chain of drafted tokens or a token tree (``Draft.tree``, see ``spec/tree.py``):
a tree's nodes are rows of the same forward, each attending to its own prefix only; verification
walks it (``spec/tree_verify.py``) and the cache keeps the accepted path, moved into place.

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

from tokenleap.cache.contiguous import KVCache
from tokenleap.config import ConfigError, SamplingParams
from tokenleap.spec.controller import ControllerConfig, DraftLengthController, StepPlan
from tokenleap.errors import PromptTooLongError
from tokenleap.heap import freeze_long_lived
from tokenleap.spec.lengths import LengthHistory
from tokenleap.spec.logprobs import token_logprobs
from tokenleap.spec.penalties import for_vocabulary
from tokenleap.spec.prefill import Prefill
from tokenleap.spec.stats import SpecStats
from tokenleap.models.transformer import Segment, Transformer
from tokenleap.spec.proposers.base import Draft, DraftRequest, Proposer, begin_sequence, feature_takers, remember_output
from tokenleap.spec.report import DraftWork, SeqOutcome, StepReport, outcome, record_stats
from tokenleap.spec.sampling import request_randomness
from tokenleap.spec.sequence import Sequence
from tokenleap.spec.step_verify import TargetRows, check_finite, share_rows, verify_chain, verify_tree
from tokenleap.spec.tree import TokenTree
from tokenleap.spec.tree_verify import TreeVerification
from tokenleap.spec.structured import Constraints
from tokenleap.spec.verify import Verification


PREFILL_CHUNK = 256  # prompt tokens a prefill forward takes by default (and the prefix cache's window
# where prompt windows are not computed row-exact)


class Engine(Prefill):
    def __init__(self, model: Transformer, tokenizer, *, max_len: int | None = None, num_slots: int = 1,
                 proposer: Proposer | None = None, controller: ControllerConfig | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, cache: KVCache | None = None, tree_nodes: int = 0) -> None:
        self.model = model
        self.tree_nodes = tree_nodes  # > 0: proposers may draft token trees of this many nodes
        self.tokenizer = tokenizer
        self.max_len = min(max_len or model.config.max_context, model.config.max_context)
        if cache is not None:  # e.g. a PagedKVCache shared by a serving scheduler
            self.max_len = min(self.max_len, cache.max_len)
        self.cache = cache if cache is not None else KVCache(model.config, num_slots, self.max_len, model.dtype)
        self.totals = SpecStats()  # every sequence's steps, for server metrics
        self.proposer = proposer
        if hasattr(proposer, "bind_cache"):  # a self-drafting proposer (layer skip) drafts in the target's cache
            proposer.bind_cache(self.cache)
        # proposers drafting from the target's hidden states (a trained head): handed each computed row's
        # final normed hidden state (prefill: every row; a step: the rows it keeps)
        self._feature_takers = feature_takers(proposer)
        self.controller = DraftLengthController(controller or ControllerConfig())
        if not hasattr(proposer, "plan"):  # (a composite, --spec auto, prices each arm's rows itself)
            self.controller.aux_rows = getattr(proposer, "aux_rows", 0)  # e.g. lookahead's window, priced in
            self.controller.stops_on_confidence = getattr(proposer, "stops_on_confidence", False)
        self._plan: StepPlan | None = None  # choose_k's plan, for the step it was chosen for
        self._attached: set[int] = set()  # sequences holding a cache slot: the batch a newcomer joins
        self.prefill_chunk = prefill_chunk
        eos = tuple(getattr(tokenizer, "eos_token_ids", ()) or model.config.eos_token_ids)
        self.eos_ids = frozenset(eos)
        self.constraints = Constraints(tokenizer, model.config.vocab_size, eos)  # structured output
        self._ids = itertools.count()
        self.lengths = LengthHistory()  # recently finished sequences' lengths
        freeze_long_lived()  # the loaded models', proposers' and cache's objects: kept out of collections

    # -- lifecycle --------------------------------------------------------------------------
    def add(self, prompt: list[int], params: SamplingParams) -> Sequence:
        """Validate, allocate a cache slot and prefill; the first token is produced here. A prefill
        that fails (or is interrupted) frees the slot again."""
        seq = self.create(prompt, params)
        try:
            self.attach(seq)
            while self.prefill_step(seq):
                pass
        except BaseException:
            self.release(seq)
            raise
        return seq

    def create(self, prompt: list[int], params: SamplingParams) -> Sequence:
        """Validate and build a sequence without touching the cache (then ``attach``, ``prefill_step``)."""
        if not prompt:
            raise ConfigError("the prompt is empty: give at least one token")
        vocab = self.model.config.vocab_size
        if (outside := next((t for t in prompt if not 0 <= t < vocab), None)) is not None:
            # (a tokenizer with added tokens past the model's embeddings encodes text to such ids)
            raise ConfigError(f"the prompt holds token id {outside}, outside the model's vocabulary of {vocab}")
        room = self.max_len - len(prompt)
        if room < 1:
            raise PromptTooLongError(f"the prompt has {len(prompt)} tokens but the context window is "
                                     f"{self.max_len}; shorten it or raise --max-model-len")
        if params.max_tokens is None or params.max_tokens > room:  # (None: up to the window's end)
            params = replace(params, max_tokens=room)
        params = for_vocabulary(params, self.tokenizer, self.model.config.vocab_size)
        return Sequence(seq_id=next(self._ids), prompt=list(prompt), params=params, eos_ids=self.eos_ids,
                        detokenizer=self.tokenizer.detokenizer() if params.skip_special_tokens
                        else self.tokenizer.detokenizer(skip_special_tokens=False),
                        generator=None if params.greedy else request_randomness(params.seed),
                        constraint=self.constraints.make(params.structured) if params.structured else None)

    def attach(self, seq: Sequence) -> None:
        """Give ``seq`` a cache slot -- holding the prompt windows another sequence computed, if the
        cache keeps them -- and start its proposer state (``prefill_step`` fills the rest)."""
        seq.slot = self.cache.allocate()
        if seq.params.prompt_logprobs is None:  # prompt logprobs need every prompt row computed
            window, salt = self._prefix_windows()
            # row-exact entries: a preempted sequence resumes from its generated blocks too
            attached = self.cache.attach_prompt(seq.slot, seq.tokens if salt else seq.prompt, window, salt)
            if not seq.attached_before:  # (a preempted sequence resuming finds its own blocks)
                seq.cached_tokens = min(attached, len(seq.prompt))
        seq.attached_before = True
        self._attached.add(seq.seq_id)
        if self.proposer is not None:
            begin_sequence(self.proposer, seq.seq_id, seq.prompt, seq.params.prediction)

    def detach(self, seq: Sequence) -> None:
        """Free ``seq``'s cache and proposer state but keep its tokens (preemption; ``attach`` resumes).
        Where entries are row-exact, its whole windows stay cached: a follow-up turn's prompt (this
        one, its reply and more) takes them."""
        if seq.slot >= 0:
            window, salt = self._prefix_windows()
            if salt:
                self.cache.register_computed(seq.slot, seq.tokens, len(seq.tokens), window, salt)
            self.cache.free(seq.slot)
            seq.slot = -1
        self._attached.discard(seq.seq_id)
        if self.proposer is not None:
            self.proposer.end(seq.seq_id)

    def release(self, seq: Sequence) -> None:
        self.detach(seq)
        if seq.finish_reason is None:
            seq.finish_reason = "abort"
        else:
            self.lengths.finished(seq)
            if self.proposer is not None:
                remember_output(self.proposer, seq.generated)

    def expected_remaining(self, seq: Sequence) -> float:
        """Tokens ``seq`` may still generate, what a draft's catch-up is weighed against (``lengths.py``)."""
        return self.lengths.expected_remaining(seq)

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
    def choose_k(self, seqs: list[Sequence], batch: int | None = None) -> int:
        """The controller's draft length for a step of ``seqs``, a catch-up it would need included;
        ``batch``: the batch size to judge at if more sequences are about to join (default: len(seqs))."""
        if self.proposer is None:
            return 0
        if hasattr(self.proposer, "plan"):  # a composite (--spec auto) plans each sequence's proposer and k
            return self.proposer.plan([(s.seq_id, s.tokens, self.expected_remaining(s)) for s in seqs],
                                      max(batch or 0, len(seqs)), self.controller)
        backlog = sum(self.proposer.backlog(s.seq_id, s.tokens) for s in seqs)
        # (the tokens still to generate only weigh against a catch-up)
        remaining = sum(self.expected_remaining(s) for s in seqs) if backlog else float("inf")
        self._plan = self.controller.choose_step(max(batch or 0, len(seqs)), backlog, remaining, self.tree_nodes,
                                                 self._tree_mode())
        return self._plan.k

    def _tree_mode(self) -> str:
        """How this engine's tree budget is used: the controller's setting ("auto": chosen per step,
        "on", "off") for a proposer that declares ``drafts_trees``; any other proposer is asked
        with the whole budget (it may answer with a tree or a chain)."""
        return self.controller.cfg.tree if getattr(self.proposer, "drafts_trees", False) else "on"

    def step(self, seqs: list[Sequence], k: int | None = None) -> StepReport | None:
        """One decoding step for every unfinished sequence in ``seqs`` (one target forward); returns
        what it did and measured (None: every sequence had finished), which the controller and the
        speculation counters have already taken in.

        ``k`` overrides the controller's draft length (a scheduler short of cache memory passes 0)."""
        seqs = [s for s in seqs if not s.finished]
        if not seqs:
            return None
        start = time.perf_counter()
        if k is None or self.proposer is None:
            k = self.choose_k(seqs)
        plan, self._plan = self._plan, None
        if plan is None or plan.k != k:  # a k of the caller's own (e.g. 0 when short of cache blocks)
            plan = StepPlan(k, self.tree_nodes if k and self._tree_mode() == "on" else 0)
        auto_tree = plan.nodes > 0 and self._tree_mode() == "auto"  # measured apart from chain steps
        drafts, work = self._draft_all(seqs, plan)
        if getattr(self.proposer, "aux_rows", 0) and not hasattr(self.proposer, "plan"):
            # the rows the proposer attached this step (a composite prices its arms itself)
            if drafted := [d for d in drafts if d is not None]:
                self.controller.observe_aux_rows(sum(_aux_rows(d) for d in drafted) / len(drafted))
        tokens, segments, row = [], [], 0
        for s, d in zip(seqs, drafts):
            tree = _layout(s, d)
            block = tree.tokens.tolist() if tree is not None else [s.tokens[-1]] + (d.tokens if d else [])
            segments.append(Segment(s.slot, len(s.tokens) - 1, len(block), row_start=row, tree=tree))
            tokens += block
            row += len(block)
        t0 = time.perf_counter()
        out = self.model(torch.tensor(tokens), segments, self.cache, row_exact=True)
        logits = out.logits  # [rows, vocab]
        elapsed = time.perf_counter() - t0
        check_finite(logits)
        spans = [(seg.row_start, seg.length - _aux_rows(d)) for d, seg in zip(drafts, segments)]  # verified rows
        shared = share_rows(seqs, logits, spans)  # one argmax for the greedy sequences' rows
        outcomes = []
        for s, d, seg, rows in zip(seqs, drafts, segments, shared):
            s.stats.verify_seconds += elapsed * seg.length / row
            if _aux_rows(d):  # the proposer's own rows: read, dropped
                d.aux.observe(logits[seg.row_start + rows.size:seg.row_start + seg.length])  # [aux, vocab]
            outcomes.append(self._accept(s, d, rows, seg.length, out.hidden[-1][seg.row_start:seg.row_start + rows.size]
                                         if self._feature_takers else None))
        overhead = time.perf_counter() - start - elapsed - work.seconds - work.catch_up_seconds
        report = StepReport(tuple(outcomes), plan.k, plan.nodes, auto_tree,
                            held_apart=auto_tree and any(seg.tree is not None for seg in segments),
                            rows=row, forward_seconds=elapsed, draft=work,
                            overhead_seconds=overhead if self.proposer is not None else None)
        self.controller.observe_step_report(report)
        for s, o in zip(seqs, report.outcomes):
            record_stats(o, s.stats, self.totals)
        return report

    def _draft_all(self, seqs: list[Sequence], plan: StepPlan) -> tuple[list[Draft | None], DraftWork]:
        """Every sequence's draft for this step, from one ``propose_many`` call, and the drafting
        it took (seconds drafting; seconds and tokens the draft spent catching up, not drafting)."""
        k = plan.k
        ks = [min(k, s.params.max_tokens - s.num_generated - 1, self.max_len - len(s.tokens) - 1) for s in seqs]
        asked = [(s, n) for s, n in zip(seqs, ks) if n > 0]
        if not asked:
            return [None] * len(seqs), DraftWork()
        t0 = time.perf_counter()
        requests = [DraftRequest(s.seq_id, s.tokens, n, s.params, s.generator, s.constraint,
                                 max_nodes=self._tree_budget(s, plan.nodes), slot=s.slot,
                                 max_aux=self.aux_budget(s, max(k, self._tree_budget(s))),
                                 stop_below=plan.floors, stop_draft=plan.draft_floor, planned=plan.planned)
                    for s, n in asked]
        got = self.proposer.propose_many(requests)
        elapsed = time.perf_counter() - t0
        catch_up = sum(d.catch_up_seconds for d in got if d is not None)  # an empty draft may have caught up
        caught = sum(d.catch_up_tokens for d in got if d is not None)
        for (s, _), d in zip(asked, got):
            s.stats.prefill_seconds += d.catch_up_seconds if d is not None else 0.0
        got = [d if d is not None and (d.tokens or d.aux is not None) else None for d in got]
        for d, (s, _) in zip(got, asked):
            assert d is None or d.tree is None or d.tree.tokens[0] == s.tokens[-1], "a tree's root is the last token"
        drafting = elapsed - catch_up  # shared by the sequences in proportion to their draft tokens
        drafted = sum(len(d.tokens) for d in got if d is not None)
        by_seq = {}
        for (s, _), d in zip(asked, got):
            by_seq[s.seq_id] = d
            share = len(d.tokens) / drafted if d is not None and drafted else 0.0
            s.stats.draft_seconds += drafting * share if drafted else drafting / len(asked)
        caught_drafts = sum(d.catch_up_drafted for d in got if d is not None)
        work = DraftWork(drafted, max(n for _, n in asked), len(asked), drafting if drafted else 0.0, caught, catch_up,
                         caught_drafts)
        return [by_seq.get(s.seq_id) for s in seqs], work

    def aux_budget(self, seq: Sequence, nodes: int) -> int:
        """Auxiliary rows (``Draft.aux``) a step of ``seq`` drafting up to ``nodes`` nodes may add:
        the proposer's ``aux_rows``, if they all fit in the context window beside those nodes (the
        scheduler reserves cache blocks by the same rule, with the whole tree budget as ``nodes``)."""
        want = getattr(self.proposer, "aux_rows", 0)
        return want if want and nodes + want <= self.max_len - len(seq.tokens) - 1 else 0

    def _tree_budget(self, seq: Sequence, nodes: int | None = None) -> int:
        """Drafted nodes a tree for ``seq`` may hold: ``nodes`` (default ``tree_nodes``), within the
        context window."""
        return max(0, min(self.tree_nodes if nodes is None else nodes, self.max_len - len(seq.tokens) - 1))

    def _accept(self, seq: Sequence, draft: Draft | None, rows: TargetRows, forward_rows: int,
                feats: torch.Tensor | None = None) -> SeqOutcome:
        """Verify ``seq``'s rows (1 + len(draft); a tree: one per node), keep the accepted path, emit;
        returns the sequence's outcome (``forward_rows``: its rows in the forward, aux rows included).
        ``feats`` [rows, hidden]: the rows' features, the kept ones handed to the proposers wanting them."""
        n = len(seq.tokens)
        tree = draft.tree if draft is not None else None
        logits = rows.logits  # [1 + len(draft), vocab]
        if tree is None:
            result = verify_chain(seq, draft, rows)
        else:
            result = self._verify_tree(seq, tree, rows)
            self.cache.compact(seq.slot, n - 1, result.path)  # the accepted path right after the root
            logits = logits[[0] + result.path]  # [accepted + 1, vocab]: the rows the tokens were chosen from
        self.cache.truncate(seq.slot, n + result.num_accepted)  # last token + accepted drafts
        if feats is not None:
            kept = [0] + (result.path if tree is not None else list(range(1, result.num_accepted + 1)))
            for taker in self._feature_takers:
                taker.take_features(seq.seq_id, n - 1, feats[kept])  # [accepted + 1, hidden]: positions n - 1 ..
        if tree is not None:
            self.proposer.accept(seq.seq_id, result.num_accepted, result.path)
        elif draft is not None:
            self.proposer.accept(seq.seq_id, result.num_accepted)
        kept = self._emit(seq, result, logits)
        return outcome(seq.seq_id, _proposer_name(self.proposer, draft), draft, result, kept, forward_rows)

    def _verify_tree(self, seq: Sequence, tree: TokenTree, rows: TargetRows) -> TreeVerification:
        """One sequence's tree verification (``step_verify.verify_tree``), a seam tests may wrap."""
        return verify_tree(seq, tree, rows)

    @staticmethod
    def _emit(seq: Sequence, result: Verification | TreeVerification, logits: torch.Tensor) -> int:
        """Append the verified tokens (stop rules apply) and their logprobs; returns how many were kept.
        Token i of ``result`` was chosen from row i of ``logits`` [>= len(result.tokens), vocab]."""
        kept = seq.append(result.tokens)
        if seq.constraint is not None and kept:
            seq.constraint.advance(result.tokens[:kept])
        if seq.params.logprobs is not None and kept:
            seq.logprobs += token_logprobs(logits[:kept], result.tokens[:kept], seq.params.logprobs)
        return kept


def _layout(seq: Sequence, draft: Draft | None) -> TokenTree | None:
    """The tree a step's forward computes for ``seq``: the draft's tree (None: a plain chain), with
    the draft's auxiliary rows appended after its nodes (their cache entries lie past the nodes', so
    the truncation after verification drops them)."""
    if draft is None or draft.aux is None:
        return draft.tree if draft is not None else None
    base = draft.tree if draft.tree is not None else TokenTree.chain(seq.tokens[-1], draft.tokens)
    return base.with_rows(draft.aux.tokens, draft.aux.parents)


def _aux_rows(draft: Draft | None) -> int:
    """Auxiliary rows ``draft`` adds after its nodes (``Draft.aux``), never verified."""
    return len(draft.aux.tokens) if draft is not None and draft.aux is not None else 0


def _proposer_name(proposer: Proposer | None, draft: Draft | None) -> str:
    """Who drafted a step: the draft's label (a composite's arm), else the engine's proposer; "none"
    for a plain step."""
    if draft is None or proposer is None:
        return "none"
    return draft.proposer or proposer.name
