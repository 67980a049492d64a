"""Offline batching for ``LLM.generate``: every prompt becomes a scheduler request on a paged engine
built for the call (sharing the LLM's weights), and the scheduler is driven on the calling thread
until all are done -- continuous batching with speculation, as the server runs it.

Each verified row is computed as if alone (``row_exact``), and a seeded request's noise depends on
its seed and positions only, so every output is token-identical to generating its prompt by itself.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tokenleap.cancellation import check_cancelled
from tokenleap.config import SamplingParams
from tokenleap.spec.engine import Engine
from tokenleap.errors import TokenleapError
from tokenleap.cache.paged import PagedKVCache
from tokenleap.spec.proposers.lookahead import window_rows
from tokenleap.serve.request import Output, Request
from tokenleap.serve.scheduler import Scheduler, SchedulerConfig
from tokenleap.spec.stats import SpecStats

if TYPE_CHECKING:
    from tokenleap.api import LLM
    from tokenleap.outputs import RequestOutput

BLOCK_SIZE = 16


class BatchRequestError(TokenleapError):
    """One prompt of an offline batch failed (the message names it and says why)."""


def batch_engine(llm: "LLM", lengths: list[int]) -> Engine:
    """A paged engine for prompts that may reach ``lengths`` tokens each: cache slots for the batch
    and blocks for its longest sequences (a shortfall only preempts, which is exact)."""
    max_len, slots = llm.max_len, min(len(lengths), llm.max_num_seqs)
    per_seq = -(-(max_len + 1) // BLOCK_SIZE)
    longest = sorted((min(n, max_len + 1) for n in lengths), reverse=True)[:slots]
    blocks = max(sum(-(-n // BLOCK_SIZE) + 1 + _scratch_blocks(llm) for n in longest), per_seq)
    return _paged_engine(llm, blocks, slots)


def request_engine(llm: "LLM") -> Engine:
    """``LLM.engine``: ``llm.num_slots`` slots and a whole context of blocks each. A finished
    request's cached blocks count as free, and a later prompt that starts the same way (a
    conversation's next turn) shares them rather than needing blocks of its own for them."""
    return _paged_engine(llm, llm.num_slots * _context_blocks(llm), llm.num_slots)


def coroutine_engine(llm: "LLM") -> Engine:
    """The engine of ``LLM.astream``'s scheduler: ``max_num_seqs`` slots, and blocks for as many whole
    contexts within the default serving budget (``kv_budget_gb``), never under one -- a shortfall only
    preempts, which is exact."""
    from tokenleap.cache.paged import kv_budget_gb, num_blocks_for_budget
    model, context = llm.target.model, _context_blocks(llm)
    budget = num_blocks_for_budget(model.config, model.dtype, BLOCK_SIZE, int(kv_budget_gb() * 2**30))
    return _paged_engine(llm, max(min(llm.max_num_seqs * context, budget), context), llm.max_num_seqs)


def session_engine(llm: "LLM") -> Engine:
    """A paged engine for one conversation, a turn at a time: one cache slot, and blocks for two
    whole contexts -- the turn being generated, and the prompt windows earlier turns computed, which
    its prefix cache keeps so that the next turn (the same conversation, longer) reuses them."""
    return _paged_engine(llm, 2 * _context_blocks(llm), 1)


def _context_blocks(llm: "LLM") -> int:
    """Blocks for one sequence of the whole context, with a step's scratch rows past its end."""
    return -(-(llm.max_len + 1) // BLOCK_SIZE) + 1 + _scratch_blocks(llm)


def _scratch_blocks(llm: "LLM") -> int:
    """Blocks for a token tree's nodes (and a proposer's auxiliary rows) past a sequence's end."""
    from tokenleap.spec.proposers.factory import lookahead_joins_auto
    spec = llm.spec  # lookahead's window rows: its own method, or an arm of auto (as auto_proposer decides)
    lookahead = spec.method == "lookahead" or (spec.method == "auto" and lookahead_joins_auto(llm.draft is not None))
    aux = window_rows(spec.lookahead_window, spec.lookahead_ngram) if lookahead else 0
    return -(-(spec.tree_nodes + aux) // BLOCK_SIZE)


def _paged_engine(llm: "LLM", blocks: int, slots: int) -> Engine:
    """An engine on ``llm``'s weights with paged caches of ``blocks`` blocks and ``slots`` slots
    (the draft model's too, if any)."""
    model, max_len = llm.target.model, llm.max_len
    cache = PagedKVCache(model.config, blocks, max_len, model.dtype, BLOCK_SIZE, num_slots=slots)
    draft_cache = None
    if llm.draft is not None:  # --spec draft, or auto with a draft model
        draft = llm.draft.model
        draft_cache = PagedKVCache(draft.config, blocks, max_len, draft.dtype, BLOCK_SIZE, num_slots=slots)
    return Engine(model, llm.tokenizer, max_len=max_len, proposer=llm._proposer(max_len, slots, draft_cache),
                  controller=llm._controller(), prefill_chunk=llm.prefill_chunk, cache=cache,
                  tree_nodes=llm.spec.tree_nodes)


def _naming(origins: list[int], i: int, e: Exception) -> Exception:
    """``e`` (a prompt's or its parameters' error) with the caller's prompt index in front of its message."""
    e.args = (f"prompt {origins[i]} of the batch: {e.args[0] if e.args else e}",) + e.args[1:]
    return e


def generate_batch(llm: "LLM", prompts: list, params: list[SamplingParams], chat: bool,
                   origins: list[int] | None = None) -> tuple[list["RequestOutput"], list[SpecStats]]:
    """``prompts`` (text or token ids) decoded together: the outputs and each one's counters, in the
    prompts' order (``origins``: the caller's index of each, where ``n`` > 1 repeated prompts; errors name it)."""
    from tokenleap.config import ConfigError
    from tokenleap.errors import PromptTooLongError
    from tokenleap.outputs import request_output
    origins = origins or list(range(len(prompts)))
    ids = []
    for i, p in enumerate(prompts):
        try:
            ids.append(llm.encode(p, chat))
        except ConfigError as e:
            raise _naming(origins, i, e) from None
    engine = batch_engine(llm, [len(p) + (sp.max_tokens or llm.max_len) + llm.spec.max_num_tokens + 1
                                for p, sp in zip(ids, params)])
    seqs = []  # every prompt validated before any work
    for i, (p, sp) in enumerate(zip(ids, params)):
        try:
            seqs.append(engine.create(p, sp))
        except (ConfigError, PromptTooLongError) as e:
            raise _naming(origins, i, e) from None
    sched = Scheduler(engine, SchedulerConfig(max_num_seqs=engine.cache.num_slots, max_waiting=len(seqs),
                                              log_interval=0))
    done: dict[int, float] = {}
    errors: dict[int, str] = {}

    def sink(i: int):
        def on_output(out: Output) -> None:
            if out.finish_reason is not None:
                done[i] = time.perf_counter()
            if out.error:
                errors[i] = out.error
        return on_output

    t0 = time.perf_counter()
    sched.submit([Request(seq, sink(i)) for i, seq in enumerate(seqs)])
    # (an agenerate / achat given up, or the LLM closed, stops before the next iteration: the call's own engine
    # goes with its blocks)
    sched.run_until_idle(before=lambda: (check_cancelled(), llm._check_open()))
    if errors:
        i, message = min(errors.items())
        raise BatchRequestError(f"prompt {origins[i]} of the batch failed: {message}")
    outputs = []
    for prompt, seq, i in zip(prompts, seqs, range(len(seqs))):
        seq.stats.total_seconds = done[i] - t0
        outputs.append(request_output(prompt, seq, done[i] - t0))
    return outputs, [seq.stats for seq in seqs]
