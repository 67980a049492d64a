"""The Python API: ``LLM(model=...).generate(prompts, SamplingParams(...))`` and ``.stream(...)``.

``generate`` of several prompts runs them together through the continuous-batching scheduler (with
speculation) on a paged cache, so one target forward serves the whole batch; every row is computed
as if alone, so each output is token-identical to generating that prompt by itself (greedy, and
seeded sampling)."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tokenleap.api_async import AsyncCalls
from tokenleap.api_inputs import _checked, _one_of, _prompt_list, _shown, _text_content, _unwrapped
from tokenleap.lifetime import Lifetime
from tokenleap.cancellation import check_cancelled
from tokenleap.step_gate import StepGate
from tokenleap.spec.tree_budget import machine_tree_mode
from tokenleap.config import ConfigError, SamplingParams, SpecConfig, is_int
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.seeded import choice_seed
from tokenleap.spec.engine import PREFILL_CHUNK, Engine
from tokenleap.models.pretrained import LoadedModel, load_model
from tokenleap.spec.proposers.base import Proposer, draft_model_note, output_pool_note
from tokenleap.spec.proposers.factory import load_draft, proposer_for, resolve_auto_draft, uses_draft
from tokenleap.outputs import RequestOutput, StreamChunk, grouped, request_output
from tokenleap.cache.contiguous import CacheFullError


_PROCESS_STATE = ("_engine", "_engine_lock", "_coroutines", "_coroutines_lock", "_coroutines_stop", "_steps",
                  "_close_lock")


class StreamsBusy(ConfigError):
    """Every slot of ``LLM.engine`` is held (open streams, or one-prompt generates on other threads)."""


def _check_sizes(max_model_len: int | None, num_slots: int, max_num_seqs: int) -> None:
    if max_model_len is not None and not (is_int(max_model_len) and max_model_len >= 2):
        raise ConfigError(f"max_model_len must be an integer >= 2 (a prompt token and room for a reply), "
                          f"got {max_model_len!r}")
    for name, n in (("num_slots", num_slots), ("max_num_seqs", max_num_seqs)):
        if not (is_int(n) and n >= 1):
            raise ConfigError(f"{name} must be an integer >= 1, got {n!r}")


class LLM(AsyncCalls, Lifetime):
    """A target model, its tokenizer, and optionally a speculative proposer."""

    def __init__(self, model: str | Path, *, dtype: str | torch.dtype = "auto", quant: str | None = "none",
                 speculative: SpecConfig | dict[str, Any] | None = None, max_model_len: int | None = None,
                 cache_dir: str | Path | None = None, num_slots: int = 1, max_num_seqs: int = 16,
                 chat_template: str | None = None) -> None:
        """``chat_template``: a Jinja template (or a file holding one) that renders chats instead of
        the model's own, as vLLM's ``--chat-template``."""
        _check_sizes(max_model_len, num_slots, max_num_seqs)  # before the minutes a load can take
        speculative = _spec_config(speculative)
        target = load_model(model, dtype=dtype, quant=quant, cache_dir=cache_dir, chat_template=chat_template)
        self.cache_dir = cache_dir  # where a layer-skip calibration is stored
        spec, note = resolve_auto_draft(speculative, str(model), cache_dir)
        draft = load_draft(spec, target, cache_dir) if uses_draft(spec) else None
        self._setup(target, spec, draft, max_model_len, num_slots, max_num_seqs)
        self.spec_note = note

    @classmethod
    def from_loaded(cls, target: LoadedModel, speculative: SpecConfig | None = None, draft: LoadedModel | None = None,
                    *, max_model_len: int | None = None, num_slots: int = 1, max_num_seqs: int = 16) -> "LLM":
        """An LLM around models already loaded (``draft``: the draft model of a "draft" ``speculative``)."""
        _check_sizes(max_model_len, num_slots, max_num_seqs)
        llm = cls.__new__(cls)
        llm._setup(target, speculative or SpecConfig(), draft, max_model_len, num_slots, max_num_seqs)
        return llm

    def _setup(self, target: LoadedModel, spec: SpecConfig, draft: LoadedModel | None, max_model_len: int | None,
               num_slots: int, max_num_seqs: int) -> None:
        if spec.method == "draft" and draft is None:
            raise ConfigError("speculative method 'draft' needs the draft model loaded")
        self.target, self.tokenizer, self.spec, self.draft = target, target.tokenizer, spec, draft
        self.spec_note: str | None = None  # how --spec auto chose its draft model, for --stats
        self.max_num_seqs = max_num_seqs  # prompts decoded together by generate()
        self.max_len = target.context_length(max_model_len)
        self.prefill_chunk = PREFILL_CHUNK  # of every engine built here
        self.num_slots = num_slots
        self._engine: Engine | None = None
        self._engine_lock = threading.Lock()  # LLM.engine's one build, when callers on several threads race to it
        self._coroutines = None  # astream's scheduler, started on first use (api_async.py)
        self._coroutines_stop = None  # its finalizer (stops it when the LLM is collected, or at exit)
        self._coroutines_lock = threading.Lock()
        self._steps = StepGate()  # LLM.engine's steps, one at a time (streams on several threads)
        self._closed = False

    def __getstate__(self) -> dict[str, Any]:
        # the engines (KV caches, proposers, the coroutines' scheduler thread) are this process's: a copy
        # builds its own
        state = {k: v for k, v in self.__dict__.items() if k not in _PROCESS_STATE}
        return {**state, "_engine": None, "_coroutines": None, "_coroutines_stop": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._engine_lock, self._coroutines_lock, self._steps = threading.Lock(), threading.Lock(), StepGate()
        for name in ("_coroutines", "_coroutines_stop"):  # (an LLM pickled before astream existed)
            self.__dict__.setdefault(name, None)
        self.__dict__.setdefault("_closed", False)

    @property
    def engine(self) -> Engine:
        """The engine ``stream``, a one-prompt ``generate`` and a one-conversation ``chat`` run on,
        built on first use: a paged KV cache of ``num_slots`` slots and a whole context of blocks
        each, and its proposer. Its prefix cache keeps what earlier requests computed, so the next
        turn of a conversation (or the same system prompt again) starts from it. Batches and chat
        sessions run on paged engines of their own, and never pay for this one's cache."""
        self._check_open()
        engine = self._engine
        if engine is None:
            with self._engine_lock:
                self._check_open()  # (closed while this thread waited for another's build)
                if self._engine is None:
                    from tokenleap.serve.batch import request_engine
                    built = request_engine(self)
                    if self.closed:  # (closed during the build: dropped, not kept -- nor by the error's frame)
                        del built
                        self._check_open()
                    self._engine = built
                engine = self._engine
        return engine

    @property
    def proposer(self) -> Proposer | None:
        return self.engine.proposer

    def _controller(self) -> ControllerConfig:
        fixed = None if self.spec.num_tokens == "auto" else int(self.spec.num_tokens)
        return ControllerConfig(max_k=max(self.spec.max_num_tokens, fixed or 1), fixed_k=fixed,
                                tree=machine_tree_mode(self.spec.tree))

    def _proposer(self, max_len: int, num_slots: int, cache=None) -> Proposer | None:
        """A fresh proposer for an engine (``cache``: the draft model's KV cache, by default contiguous)."""
        return proposer_for(self.spec, self.target, self.draft, max_len, num_slots, getattr(self, "cache_dir", None),
                            (lambda _: cache) if cache is not None else None)

    def describe(self, engine: Engine | None = None) -> str:
        """One line: what was loaded and the memory it holds (the KV cache: ``engine``'s, by default
        ``self.engine``'s)."""
        self._check_open()
        from tokenleap.models.quant import weight_bytes
        t, engine = self.target, engine or self.engine
        dtype = str(t.dtype).removeprefix("torch.")  # (bfloat16, as the draft note and bench's reports name it)
        line = (f"{t.source} ({dtype}, quant {t.quant}): weights {weight_bytes(t.model) / 2**30:.2f} GiB, "
                f"KV cache {engine.cache.nbytes / 2**20:.0f} MiB for {engine.max_len} tokens; "
                f"decode rows: {t.model.backend.describe()}")
        if engine.proposer is not None:
            line += f"; speculation: {self.spec.method}, draft length {self.spec.num_tokens}"
            arms = getattr(engine.proposer, "arms", None)
            if arms is not None:
                line += f" (proposers: {', '.join(arms)})"
            for note in (draft_model_note(engine.proposer), output_pool_note(engine.proposer),
                         getattr(engine.proposer, "note", None)):
                line += f"; {note}" if note else ""
        if self.spec_note:
            line += f"; {self.spec_note}"
        return line

    # -- prompts ----------------------------------------------------------------------------
    def encode(self, prompt: str | list[int] | dict[str, Any] | list[dict[str, Any]], chat: bool = False) -> list[int]:
        """A prompt's token ids: text encoded (``chat``: as a user message in the chat template; a list
        of messages, a conversation, rendered whole), or token ids checked against the vocabulary
        (vLLM's ``{"prompt": text}`` and ``{"prompt_token_ids": ids}`` taken too)."""
        self._check_open()
        prompt = _unwrapped(prompt)
        if chat and isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            return self.tokenizer.encode_chat([_text_content(m) for m in prompt])
        if isinstance(prompt, (list, tuple)):
            if prompt and not all(is_int(t) for t in prompt):
                raise ConfigError("a prompt is text or a list of token ids (a conversation, a list of messages, "
                                  "with chat=True; stream and infill take one prompt; generate and chat take a list)")
            vocab = self.target.model.config.vocab_size
            if not all(0 <= t < vocab for t in prompt):
                raise ConfigError(f"a prompt of token ids needs integers in [0, {vocab})")
            return list(prompt)
        if not isinstance(prompt, str):
            raise ConfigError(f"a prompt is text or a list of token ids, got {type(prompt).__name__}")
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's ``LLM.get_tokenizer``; also ``self.tokenizer``)."""
        self._check_open()
        return self.tokenizer

    # -- generation -------------------------------------------------------------------------
    def stream(self, prompt: str | list[int] | list[dict[str, Any]], params: SamplingParams | None = None,
               chat: bool = False, *, sampling_params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """One prompt's reply as it is decoded (``chat``: the prompt, a text or a conversation, rendered
        with the chat template); the last chunk carries the ``RequestOutput``."""
        prompt, params = _unwrapped(prompt), _checked(_one_of(params, sampling_params))
        if params.n > 1:
            raise ConfigError(f"stream gives one completion (n is {params.n}): generate or chat give n")
        ids = self.encode(prompt, chat)
        engine = self.engine  # (built on first use: not part of the request's time)
        busy = (f"every one of this LLM's {self.num_slots} streams is in use (streams still open, or one-prompt "
                "generate calls on other threads): read a stream to its end or close() it before starting another "
                "(or give LLM num_slots)")
        if not engine.cache.num_free_slots:
            raise StreamsBusy(busy)
        t0 = time.perf_counter()
        steps = engine.generate(ids, params)
        try:
            with self._steps.step():  # (streams on other threads step the same engine: one step at a time)
                self._check_open()  # (closed since: inside the gate, so no step follows a close)
                first = next(steps)  # takes a slot (and prefills): another thread may have taken the last one since
        except CacheFullError:
            raise StreamsBusy(busy) from None
        seq, item = None, first
        try:
            while item is not None:
                seq, piece = item
                if not seq.finished:
                    yield StreamChunk(piece, seq.generated, False)
                else:
                    last_piece = piece
                check_cancelled()  # (an agenerate / achat given up: before the next step)
                with self._steps.step():
                    self._check_open()
                    item = next(steps, None)
        finally:
            self._steps.close(steps)  # (frees the slot now when the caller stops early)
        assert seq is not None
        yield StreamChunk(last_piece, seq.generated, True,
                          request_output(_shown(prompt, ids), seq, time.perf_counter() - t0))

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None, chat: bool = False, *,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One output per prompt, in order. ``params`` (or ``sampling_params``, vLLM's name): one for all,
        or a list with one per prompt (as vLLM takes them); a prompt's ``n`` completions are its output's
        ``outputs``. Several prompts (and completions) are decoded together, up to ``max_num_seqs`` at a
        time. ``use_tqdm`` is taken for vLLM's callers and draws nothing."""
        self._check_open()
        params = _one_of(params, sampling_params)
        prompts = _prompt_list(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ConfigError(f"got {len(params)} SamplingParams for {len(prompts)} prompts: give one, "
                                  f"or one per prompt")
            per_prompt = [_checked(p) for p in params]
        else:
            per_prompt = [_checked(params)] * len(prompts)
        counts = [p.n for p in per_prompt]
        origins = list(range(len(prompts)))
        if counts != [1] * len(prompts):  # each completion a sequence (seeded: the j-th with choice_seed(seed, j))
            prompts = [p for p, n in zip(prompts, counts) for _ in range(n)]
            origins = [i for i, n in enumerate(counts) for _ in range(n)]
            per_prompt = [replace(p, n=1, seed=None if p.seed is None else choice_seed(p.seed, j))
                          for p in per_prompt for j in range(p.n)]
        if len(prompts) == 1 and self.engine.cache.num_free_slots:  # (else: an open stream holds the slot)
            try:
                *_, last = self.stream(prompts[0], per_prompt[0], chat)
                return [last.output]
            except StreamsBusy:
                pass  # another thread took the slot since: a batch engine of its own, as below
        from tokenleap.serve.batch import generate_batch
        return grouped(*generate_batch(self, list(prompts), per_prompt, chat, origins), counts)

    def infill(self, prefix: str, suffix: str, params: SamplingParams | None = None) -> RequestOutput:
        """The code for the gap between ``prefix`` and ``suffix`` (fill-in-the-middle, for code models
        with FIM tokens such as Qwen2.5-Coder; a ConfigError for others)."""
        ids, params = self.infill_request(prefix, suffix, params)
        *_, last = self.stream(ids, params)
        last.output.prompt = prefix
        return last.output

    def infill_request(self, prefix: str, suffix: str,
                       params: SamplingParams | None = None) -> tuple[list[int], SamplingParams]:
        """The fill-in-the-middle prompt's ids, and ``params`` with the FIM tokens that end a middle."""
        self._check_open()
        from tokenleap.text.fim import encode_fim
        ids, fim = encode_fim(self.tokenizer, prefix, suffix)
        params = params or SamplingParams()
        return ids, replace(params, stop_token_ids=params.stop_token_ids + fim.stop_ids)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             params: SamplingParams | list[SamplingParams] | None = None, *,
             tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Replies to conversations, as vLLM's ``LLM.chat``: ``messages`` is one conversation (a list of
        ``{"role", "content"}`` dicts, content a string or OpenAI's text parts) or a list of them; each
        is rendered with the model's chat template (``tools``: function definitions the template shows
        the model; ``continue_final_message``: the reply continues the last message instead of opening
        a new turn; ``chat_template_kwargs``: extra template variables), then generated as ``generate``
        does (``sampling_params``, ``use_tqdm``: as there). An output's ``prompt`` is the rendered
        conversation's token ids."""
        self._check_open()
        params = _one_of(params, sampling_params)
        if not messages:
            raise ConfigError("no messages given")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        extra = {**(chat_template_kwargs or {}), **({"tools": tools} if tools is not None else {})}
        prompts = [self.tokenizer.encode_chat([_text_content(m) for m in c],
                                              add_generation_prompt=add_generation_prompt,
                                              continue_final_message=continue_final_message, **extra)
                   for c in conversations]
        return self.generate(prompts, params)


    def embed(self, prompts: str | list[int] | list[str] | list[list[int]], pooling: str = "last",
              normalize: bool = True) -> list[list[float]]:
        """One embedding per prompt, in order: the target's final hidden state at the last token
        (``pooling="mean"``: averaged over the tokens; ``"cls"``: the first token's; ``"none"``: a
        vector a token), L2-normalized unless ``normalize`` is false (``models/embed.py``; the
        server's ``--embeddings``)."""
        self._check_open()
        from tokenleap.models.embed import embed
        ids = [self.encode(p) for p in _prompt_list(prompts)]
        if not all(0 < len(x) <= self.max_len for x in ids):
            raise ConfigError(f"prompts to embed must have 1 to {self.max_len} tokens")
        try:
            vectors = embed(self.target.model, ids, pooling, normalize, self.prefill_chunk)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return [v.tolist() for v in vectors]



def _spec_config(speculative: SpecConfig | dict[str, Any] | None) -> SpecConfig:
    """``speculative`` as a SpecConfig: a dict holds its fields, or vLLM's ``speculative_config``
    names (``SpecConfig.from_dict``)."""
    if speculative is None:
        return SpecConfig()
    if isinstance(speculative, dict):
        return SpecConfig.from_dict(speculative)
    if not isinstance(speculative, SpecConfig):
        raise ConfigError(f"speculative must be a SpecConfig or a dict of its fields, got {type(speculative).__name__}")
    return speculative
