"""The Python API: ``LLM(model=...).generate(prompts, SamplingParams(...))`` and ``.stream(...)``.

``generate`` of several prompts runs them together through the continuous-batching scheduler (with
speculation) on a paged cache, so one target forward serves the whole batch; every row is computed
as if alone, so each output is token-identical to generating that prompt by itself (greedy, and
seeded sampling)."""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from tokenleap.spec.tree_budget import machine_tree_mode
from tokenleap.config import ConfigError, SamplingParams, SpecConfig
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import PREFILL_CHUNK, Engine
from tokenleap.models.pretrained import LoadedModel, load_model
from tokenleap.spec.logprobs import TokenLogprob
from tokenleap.spec.proposers.base import Proposer
from tokenleap.spec.sequence import Sequence


@dataclass
class RequestOutput:
    prompt: str | list[int]
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str | None
    seconds: float
    stats: dict[str, Any] = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # per generated token, when SamplingParams.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (the first: None)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None: EOS, length)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "num_tokens": self.num_tokens,
                "prompt_tokens": self.prompt_tokens, "finish_reason": self.finish_reason,
                "stop_reason": self.stop_reason, "seconds": round(self.seconds, 4),
                "tokens_per_second": round(self.tokens_per_second, 3),
                "stats": self.stats, **self._logprob_fields()}

    def _logprob_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.logprobs is not None:
            out["logprobs"] = [t.to_dict() for t in self.logprobs]
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = [None if t is None else t.to_dict() for t in self.prompt_logprobs]
        return out


@dataclass
class StreamChunk:
    text: str  # new text since the previous chunk
    token_ids: list[int]  # all generated token ids so far
    finished: bool
    output: RequestOutput | None = None  # set on the last chunk


class LLM:
    """A target model, its tokenizer, and optionally a speculative proposer."""

    def __init__(self, model: str | Path, *, dtype: str | torch.dtype = "auto", quant: str = "none",
                 speculative: SpecConfig | None = None, max_model_len: int | None = None,
                 cache_dir: str | Path | None = None, num_slots: int = 1, max_num_seqs: int = 16) -> None:
        target = load_model(model, dtype=dtype, quant=quant, cache_dir=cache_dir)
        self.cache_dir = cache_dir  # where a layer-skip calibration is stored
        spec, note = resolve_auto_draft(speculative or SpecConfig(), str(model), cache_dir)
        draft = load_draft(spec, target, cache_dir) if uses_draft(spec) else None
        self._setup(target, spec, draft, max_model_len, num_slots, max_num_seqs)
        self.spec_note = note

    @classmethod
    def from_loaded(cls, target: LoadedModel, speculative: SpecConfig | None = None, draft: LoadedModel | None = None,
                    *, max_model_len: int | None = None, num_slots: int = 1, max_num_seqs: int = 16) -> "LLM":
        """An LLM around models already loaded (``draft``: the draft model of a "draft" ``speculative``)."""
        llm = cls.__new__(cls)
        llm._setup(target, speculative or SpecConfig(), draft, max_model_len, num_slots, max_num_seqs)
        return llm

    def _setup(self, target: LoadedModel, spec: SpecConfig, draft: LoadedModel | None, max_model_len: int | None,
               num_slots: int, max_num_seqs: int) -> None:
        if spec.method == "draft" and draft is None:
            raise ConfigError("speculative method 'draft' needs the draft model loaded")
        if max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.target, self.tokenizer, self.spec, self.draft = target, target.tokenizer, spec, draft
        self.spec_note: str | None = None  # how --spec auto chose its draft model, for --stats
        self.max_num_seqs = max_num_seqs  # prompts decoded together by generate()
        self.max_len = min(max_model_len or 4096, target.model.config.max_position_embeddings)
        self.prefill_chunk = PREFILL_CHUNK  # of every engine built here
        self.num_slots = num_slots
        self._engine: Engine | None = None

    @property
    def engine(self) -> Engine:
        """The engine ``stream``, a one-prompt ``generate`` and a one-conversation ``chat`` run on,
        built on first use: a paged KV cache of ``num_slots`` slots and a whole context of blocks
        each, and its proposer. Its prefix cache keeps what earlier requests computed, so the next
        turn of a conversation (or the same system prompt again) starts from it. Batches and chat
        sessions run on paged engines of their own, and never pay for this one's cache."""
        if self._engine is None:
            from tokenleap.serve.batch import request_engine
            self._engine = request_engine(self)
        return self._engine

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
        from tokenleap.models.quant import weight_bytes
        t, engine = self.target, engine or self.engine
        line = (f"{t.source} ({t.dtype}, quant {t.quant}): weights {weight_bytes(t.model) / 2**30:.2f} GiB, "
                f"KV cache {engine.cache.nbytes / 2**20:.0f} MiB for {engine.max_len} tokens; "
                f"decode rows: {t.model.backend.describe()}")
        if engine.proposer is not None:
            line += f"; speculation: {self.spec.method}, draft length {self.spec.num_tokens}"
            arms = getattr(engine.proposer, "arms", None)
            if arms is not None:
                line += f" (proposers: {', '.join(arms)})"
        if self.spec_note:
            line += f"; {self.spec_note}"
        return line

    # -- prompts ----------------------------------------------------------------------------
    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    # -- generation -------------------------------------------------------------------------
    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               chat: bool = False) -> Iterator[StreamChunk]:
        params = params or SamplingParams()
        ids = self.encode(prompt, chat)
        t0 = time.perf_counter()
        seq = None
        for seq, piece in self.engine.generate(ids, params):
            if not seq.finished:
                yield StreamChunk(piece, seq.generated, False)
            else:
                last_piece = piece
        assert seq is not None
        yield StreamChunk(last_piece, seq.generated, True, request_output(prompt, seq, time.perf_counter() - t0))

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None, chat: bool = False) -> list[RequestOutput]:
        """One output per prompt, in order. ``params``: one for all, or a list with one per prompt (as
        vLLM takes them). Several prompts are decoded together, up to ``max_num_seqs`` at a time."""
        prompts = _prompt_list(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ConfigError(f"got {len(params)} SamplingParams for {len(prompts)} prompts: give one, "
                                  f"or one per prompt")
            per_prompt = list(params)
        else:
            per_prompt = [params or SamplingParams()] * len(prompts)
        if len(prompts) == 1:
            *_, last = self.stream(prompts[0], per_prompt[0], chat)
            return [last.output]
        from tokenleap.serve.batch import generate_batch
        return generate_batch(self, list(prompts), per_prompt, chat)

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
        from tokenleap.text.fim import encode_fim
        ids, fim = encode_fim(self.tokenizer, prefix, suffix)
        params = params or SamplingParams()
        return ids, replace(params, stop_token_ids=params.stop_token_ids + fim.stop_ids)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             params: SamplingParams | list[SamplingParams] | None = None, *,
             tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Replies to conversations, as vLLM's ``LLM.chat``: ``messages`` is one conversation (a list of
        ``{"role", "content"}`` dicts) or a list of them; each is rendered with the model's chat
        template (``tools``: function definitions the template shows the model; ``continue_final_message``:
        the reply continues the last message instead of opening a new turn; ``chat_template_kwargs``:
        extra template variables), then generated as ``generate`` does. An output's ``prompt`` is the
        rendered conversation's token ids."""
        if not messages:
            raise ConfigError("no messages given")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        extra = {**(chat_template_kwargs or {}), **({"tools": tools} if tools is not None else {})}
        prompts = [self.tokenizer.encode_chat(list(c), add_generation_prompt=add_generation_prompt,
                                              continue_final_message=continue_final_message, **extra)
                   for c in conversations]
        return self.generate(prompts, params)


    def embed(self, prompts: str | list[int] | list[str] | list[list[int]], pooling: str = "last",
              normalize: bool = True) -> list[list[float]]:
        """One embedding per prompt, in order: the target's final hidden state at the last token
        (``pooling="mean"``: averaged over the tokens), L2-normalized unless ``normalize`` is false
        (``models/embed.py``; the server's ``--embeddings``)."""
        from tokenleap.models.embed import embed
        ids = [self.encode(p) for p in _prompt_list(prompts)]
        if not all(0 < len(x) <= self.max_len for x in ids):
            raise ConfigError(f"prompts to embed must have 1 to {self.max_len} tokens")
        try:
            vectors = embed(self.target.model, ids, pooling, normalize, self.prefill_chunk)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return [v.tolist() for v in vectors]


def _prompt_list(prompts: str | list[int] | list[str] | list[list[int]]) -> list:
    """One prompt (text or token ids) as a list of one; a ConfigError for none."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    if not prompts:
        raise ConfigError("no prompts given")
    return list(prompts)


def request_output(prompt: str | list[int], seq: Sequence, seconds: float) -> RequestOutput:
    """A finished sequence's ``RequestOutput`` (``prompt``: as the caller gave it)."""
    params = seq.params
    return RequestOutput(prompt=prompt, text=seq.text, token_ids=seq.generated, prompt_tokens=len(seq.prompt),
                         finish_reason=seq.finish_reason, seconds=seconds, stats=seq.stats.to_dict(),
                         logprobs=list(seq.logprobs) if params.logprobs is not None else None,
                         prompt_logprobs=list(seq.prompt_logprobs) if params.prompt_logprobs is not None else None,
                         stop_reason=seq.stop_reason)


def load_draft(spec: SpecConfig, target: LoadedModel, cache_dir: str | Path | None) -> LoadedModel:
    """``spec``'s draft model, in the target's dtype unless ``spec.draft_dtype`` says otherwise."""
    return load_model(spec.draft_model, dtype=spec.draft_dtype or target.dtype, quant=spec.draft_quant,
                      cache_dir=cache_dir, gguf_other="int4")


def build_proposer(spec: SpecConfig, target: LoadedModel, max_len: int, num_slots: int,
                   cache_dir: str | Path | None, draft_cache=None) -> Proposer | None:
    """The proposer ``spec`` asks for, its draft model (if any) loaded here. ``draft_cache(draft_model)``
    may supply the draft's KV cache (a server passes a paged one); by default the draft gets a
    contiguous cache of ``num_slots``."""
    note = None
    if spec.method == "auto":
        spec, note = resolve_auto_draft(spec, target.source, cache_dir)
    draft = load_draft(spec, target, cache_dir) if uses_draft(spec) else None
    proposer = proposer_for(spec, target, draft, max_len, num_slots, cache_dir, draft_cache)
    if note is not None:
        proposer.note = note  # what was picked and why, for the server's startup line
    return proposer


def proposer_for(spec: SpecConfig, target: LoadedModel, draft: LoadedModel | None, max_len: int, num_slots: int,
                 cache_dir: str | Path | None = None, draft_cache=None) -> Proposer | None:
    """The proposer ``spec`` asks for, with its draft model (method "draft", or "auto" with one) already
    loaded as ``draft``; ``cache_dir`` holds layer-skip calibrations, ``draft_cache`` as in
    :func:`build_proposer`."""
    if spec.method is None:
        return None
    if spec.method == "ngram":
        from tokenleap.spec.proposers.ngram import NgramProposer
        return NgramProposer(spec.ngram_max, spec.ngram_min)
    if spec.method == "lookahead":
        return lookahead_proposer(spec)
    if spec.method == "layerskip":  # the target drafts for itself: no draft model, no extra weights
        from tokenleap.spec.proposers.layerskip import layerskip_proposer
        return layerskip_proposer(target, spec.skip_layers, cache_dir,
                                  lookup=spec.ngram_max if spec.layerskip_lookup else 0)
    if spec.method == "auto":
        return auto_proposer(spec, target, draft, max_len, num_slots, cache_dir, draft_cache)
    if spec.method != "draft":
        raise ConfigError(f"no proposer is built for speculative method {spec.method!r}")
    if draft is None:
        raise ConfigError("speculative method 'draft' needs the draft model loaded")
    cache = draft_cache(draft) if draft_cache is not None else None
    return draft_proposer(draft, target.model.config.vocab_size, max_len, num_slots, spec.draft_vocab, cache,
                          spec.draft_spec, target.tokenizer)


def lookahead_proposer(spec: SpecConfig) -> Proposer:
    """Lookahead decoding's proposer (its guesses' trie budget is ``spec.tree_nodes``)."""
    from tokenleap.spec.proposers.lookahead import LookaheadProposer
    return LookaheadProposer(spec.lookahead_window, spec.lookahead_ngram, spec.lookahead_guesses,
                             lookup_max=spec.ngram_max)


def draft_proposer(draft: LoadedModel, target_vocab_size: int, max_len: int, num_slots: int = 1,
                   draft_vocab: int | None = SpecConfig.draft_vocab, cache=None, draft_spec: str | None = None,
                   target_tokenizer=None) -> Proposer:
    """A draft-model proposer for a loaded draft; with ``draft_vocab`` (and a vocabulary over twice
    that) the draft scores only a reduced vocabulary (see ``proposers.draft_head``); with
    ``draft_spec="ngram"`` n-gram lookup speculates the draft's own steps (``proposers.cascade``).
    Given the target's tokenizer, a draft of another tokenizer drafts through text
    (``proposers.cross_tokenizer``); without it, a vocabulary mismatch is refused."""
    from tokenleap.spec.proposers.cascade import CascadeDraftProposer
    from tokenleap.spec.proposers.cross_tokenizer import CrossTokenizerProposer, same_tokenizer
    from tokenleap.spec.proposers.draft_model import DraftModelProposer

    head = None
    if draft_vocab and draft.model.config.vocab_size > 2 * draft_vocab:
        from tokenleap.spec.proposers.draft_head import ReducedVocabHead
        specials = draft.tokenizer.backend.get_added_tokens_decoder().keys()
        head = ReducedVocabHead(draft.model.lm_head, draft_vocab, specials)
    kind = CascadeDraftProposer if draft_spec == "ngram" else DraftModelProposer
    if target_tokenizer is not None and not same_tokenizer(target_tokenizer, draft.tokenizer):
        inner = kind(draft.model, draft.model.config.vocab_size, max_len, num_slots, cache=cache, head=head)
        return CrossTokenizerProposer(inner, target_tokenizer, draft.tokenizer)
    return kind(draft.model, target_vocab_size, max_len, num_slots, cache=cache, head=head)


def uses_draft(spec: SpecConfig) -> bool:
    """Whether ``spec`` needs a draft model loaded (auto: when one is named or was picked)."""
    return spec.method == "draft" or (spec.method == "auto" and bool(spec.draft_model))


def resolve_auto_draft(spec: SpecConfig, model: str, cache_dir: str | Path | None) -> tuple[SpecConfig, str | None]:
    """``spec`` with ``draft_model="auto"`` replaced by the draft ``models.pairing`` picks (or none),
    and a sentence saying what was picked and why; other specs unchanged (no sentence)."""
    if spec.method != "auto" or spec.draft_model != "auto":
        return spec, None
    from tokenleap.models.pairing import pick_draft
    pick = pick_draft(model.removeprefix("catalog:"), cache_dir, quant=None if spec.draft_quant == "none" else spec.draft_quant)
    return replace(spec, draft_model=pick.name, draft_quant=pick.quant if pick.name else spec.draft_quant), pick.reason


# --spec auto's candidate proposers, in order (ties go to the first). Other methods join by name as
# soon as SpecConfig accepts them and proposer_for builds them (no change to spec/proposers/auto.py).
AUTO_ARMS = ("draft", "layerskip", "lookahead", "ngram")
# a layer-skip calibration predicting less than this speed-up on this machine keeps the arm out of
# --spec auto: where drafting by most of the target's layers costs most of a target step (a
# memory-bound bf16 target on AMX: 0.999x), its probes only cost time
LAYERSKIP_MIN_SPEEDUP = 1.05


def lookahead_joins_auto(has_draft_model: bool) -> bool:
    """Whether the lookahead arm joins --spec auto: only without a draft model. Beside one, n-gram
    lookup (free) and the draft's cascade already serve the repeated text lookahead's guesses come
    from, and its probes were measured to cost steps for next to no tokens (BENCHMARKS, "Lookahead
    out of --spec auto beside a draft model")."""
    return not has_draft_model


def layerskip_joins_auto(predicted_speedup: float | None) -> bool:
    """Whether a layer-skip arm with this calibration prediction joins --spec auto (None: a skipped
    set given without a prediction, which joins)."""
    return predicted_speedup is None or predicted_speedup >= LAYERSKIP_MIN_SPEEDUP


def auto_proposer(spec: SpecConfig, target: LoadedModel, draft: LoadedModel | None, max_len: int, num_slots: int,
                  cache_dir: str | Path | None, draft_cache=None) -> Proposer:
    """``--spec auto``: every proposer this configuration has -- n-gram always, the draft model when
    one is loaded, the other methods when this build has them (lookahead only without a draft model,
    layer skip once calibrated to pay) -- behind one that picks per sequence."""
    from tokenleap.errors import TokenleapError
    from tokenleap.spec.bandit import BanditConfig
    from tokenleap.spec.proposers.auto import AutoProposer
    arms: dict[str, Proposer] = {}
    # the draft arm drafts chains (trees only with --spec-tree on), so it is a cascade: n-gram lookup
    # speculates the draft model's own steps, which changes no drafted token and saves draft forwards
    draft_spec = spec.draft_spec or (None if spec.tree == "on" else "ngram")
    for name in AUTO_ARMS:
        if name == "draft":
            if draft is not None:
                arms[name] = draft_proposer(draft, target.model.config.vocab_size, max_len, num_slots,
                                            spec.draft_vocab, draft_cache(draft) if draft_cache else None,
                                            draft_spec, target.tokenizer)
            continue
        if name == "lookahead" and not lookahead_joins_auto(draft is not None):
            continue
        try:
            # (the n-gram arm stands for prompt lookup: the layer-skip arm drafts with its layers only)
            arm = proposer_for(replace(spec, method=name, draft_model=None, layerskip_lookup=False), target,
                               None, max_len, num_slots, cache_dir)
        except (ConfigError, TokenleapError, ImportError):  # a method this build does not have (yet)
            continue
        if name == "layerskip" and getattr(arm, "skip", None) is None:
            continue  # joins once calibrated (tokenleap calibrate): no search inside a user's request
        if name == "layerskip" and not layerskip_joins_auto(getattr(arm, "predicted_speedup", None)):
            continue  # calibrated here, and predicted not to pay
        arms[name] = arm
    fixed = None if spec.num_tokens == "auto" else int(spec.num_tokens)
    return AutoProposer(arms, BanditConfig(max_k=max(spec.max_num_tokens, fixed or 1)), trees=spec.tree == "on")
