"""Proposers from a ``SpecConfig``: the draft model loaded beside a target, each method's proposer,
and ``--spec auto``'s arms (which methods join it, and when). The Python API, the CLI, the server
and the benchmark build their proposers here."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tokenleap.config import ConfigError, SpecConfig
from tokenleap.models.pretrained import LoadedModel, load_model
from tokenleap.spec.proposers.base import Proposer


def load_draft(spec: SpecConfig, target: LoadedModel, cache_dir: str | Path | None) -> LoadedModel:
    """``spec``'s draft model, in the target's dtype unless ``spec.draft_dtype`` says otherwise."""
    return load_model(spec.draft_model, dtype=spec.draft_dtype or target.dtype, quant=spec.draft_quant or "none",
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
                 cache_dir: str | Path | None = None, draft_cache=None, log=None) -> Proposer | None:
    """The proposer ``spec`` asks for, with its draft model (method "draft", or "auto" with one) already
    loaded as ``draft``; ``cache_dir`` holds layer-skip calibrations, ``draft_cache`` as in
    :func:`build_proposer`; ``log``: where layer skip says which calibration it uses (default stderr)."""
    if spec.method is None:
        return None
    if spec.method == "ngram":
        from tokenleap.spec.proposers.ngram import NgramProposer
        return NgramProposer(spec.ngram_max, spec.ngram_min, output_pool(spec.ngram_pool))
    if spec.method == "lookahead":
        return lookahead_proposer(spec)
    if spec.method == "layerskip":  # the target drafts for itself: no draft model, no extra weights
        from tokenleap.spec.proposers.layerskip import layerskip_proposer
        return layerskip_proposer(target, spec.skip_layers, cache_dir, log,
                                  lookup=spec.ngram_max if spec.layerskip_lookup else 0)
    if spec.method == "eagle":
        return eagle_proposer(target, spec.draft_head, max_len, cache_dir)
    if spec.method == "auto":
        return auto_proposer(spec, target, draft, max_len, num_slots, cache_dir, draft_cache)
    if spec.method != "draft":
        raise ConfigError(f"no proposer is built for speculative method {spec.method!r}")
    if draft is None:
        raise ConfigError("speculative method 'draft' needs the draft model loaded")
    cache = draft_cache(draft) if draft_cache is not None else None
    return draft_proposer(draft, target.model.config.vocab_size, max_len, num_slots, spec.draft_vocab, cache,
                          spec.draft_spec, target.tokenizer, output_pool(spec.ngram_pool))


def eagle_proposer(target: LoadedModel, draft_head: str, max_len: int, cache_dir: str | Path | None) -> Proposer:
    """A trained draft head's proposer (``proposers.eagle``): ``draft_head`` a file, or "auto" for the
    head ``tokenleap train-head`` stored for the target (a ConfigError naming the command if none)."""
    from tokenleap.heads.eagle import EagleHead, default_head_path
    from tokenleap.models.catalog import default_cache_dir
    from tokenleap.spec.proposers.eagle import EagleProposer
    path = Path(draft_head) if draft_head != "auto" else default_head_path(
        Path(cache_dir) if cache_dir else default_cache_dir(), target.source.removeprefix("catalog:"))
    head = EagleHead.load(path, target.model.config)  # (refused before its memory is taken if it does not fit)
    specials = target.tokenizer.backend.get_added_tokens_decoder().keys()
    proposer = EagleProposer(head, target.model, specials, max_len)
    proposer.note = f"draft head {path}"  # which head drafts, for --stats and the server's startup line
    return proposer


def output_pool(tokens: int):
    """A pool of earlier outputs of ``tokens`` tokens (``SpecConfig.ngram_pool``) for an engine's lookup
    drafters (None: 0, off)."""
    if not tokens:
        return None
    from tokenleap.spec.proposers.output_pool import OutputPool
    return OutputPool(tokens)


def lookahead_proposer(spec: SpecConfig) -> Proposer:
    """Lookahead decoding's proposer (its guesses' trie budget is ``spec.tree_nodes``)."""
    from tokenleap.spec.proposers.lookahead import LookaheadProposer
    return LookaheadProposer(spec.lookahead_window, spec.lookahead_ngram, spec.lookahead_guesses,
                             lookup_max=spec.ngram_max)


def draft_proposer(draft: LoadedModel, target_vocab_size: int, max_len: int, num_slots: int = 1,
                   draft_vocab: int | None = SpecConfig.draft_vocab, cache=None, draft_spec: str | None = None,
                   target_tokenizer=None, pool=None) -> Proposer:
    """A draft-model proposer for a loaded draft; with ``draft_vocab`` (and a vocabulary over twice
    that) the draft scores only a reduced vocabulary (see ``proposers.draft_head``); with
    ``draft_spec="ngram"`` n-gram lookup speculates the draft's own steps (``proposers.cascade``;
    also in the earlier outputs of ``pool``, an ``OutputPool``, for a draft of the target's tokenizer).
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
    note = f"draft model {draft.source.removeprefix('catalog:')} ({_precision(draft)})"
    if target_tokenizer is not None and not same_tokenizer(target_tokenizer, draft.tokenizer):
        inner = kind(draft.model, draft.model.config.vocab_size, max_len, num_slots, cache=cache, head=head)
        proposer = CrossTokenizerProposer(inner, target_tokenizer, draft.tokenizer)
        proposer.draft_note = f"{note}, another tokenizer: drafts through text"
        return proposer
    extra = {"pool": pool} if kind is CascadeDraftProposer else {}
    # the target's tokenizer, its embedding matrix padded to another size (Qwen2.5 7B+ beside 0.5B-3B)
    fit = target_tokenizer is not None
    proposer = kind(draft.model, target_vocab_size, max_len, num_slots, cache=cache, head=head, fit_vocab=fit, **extra)
    proposer.draft_note = note
    return proposer


def _precision(model: LoadedModel) -> str:
    """"int4", or the dtype's name for unquantized weights."""
    return model.quant if model.quant != "none" else str(model.dtype).removeprefix("torch.")


def uses_draft(spec: SpecConfig) -> bool:
    """Whether ``spec`` needs a draft model loaded (auto: when one is named or was picked)."""
    return spec.method == "draft" or (spec.method == "auto" and bool(spec.draft_model))


def resolve_auto_draft(spec: SpecConfig, model: str, cache_dir: str | Path | None) -> tuple[SpecConfig, str | None]:
    """``spec`` with ``draft_model="auto"`` replaced by the draft ``models.pairing`` picks (or none),
    and a sentence saying what was picked and why; a draft named for ``auto`` without a precision
    gets the one auto picks drafts at (no sentence); other specs unchanged (no sentence)."""
    from tokenleap.models.pairing import AUTO_DRAFT_QUANT, pick_draft
    if spec.method != "auto" or not spec.draft_model:
        return spec, None
    if spec.draft_model != "auto":
        return (spec if spec.draft_quant is not None else replace(spec, draft_quant=AUTO_DRAFT_QUANT)), None
    from tokenleap.models.catalog import catalog_name_of
    name = catalog_name_of(model, Path(cache_dir) if cache_dir else None) or model.removeprefix("catalog:")
    pick = pick_draft(name, cache_dir, quant=spec.draft_quant)
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
    pool = output_pool(spec.ngram_pool)  # one pool for the n-gram arm and the cascade's guesses
    # the draft arm drafts chains (trees only with --spec-tree on), so it is a cascade: n-gram lookup
    # speculates the draft model's own steps, which changes no drafted token and saves draft forwards
    draft_spec = spec.draft_spec or (None if spec.tree == "on" else "ngram")
    for name in AUTO_ARMS:
        if name == "draft":
            if draft is not None:
                arms[name] = draft_proposer(draft, target.model.config.vocab_size, max_len, num_slots,
                                            spec.draft_vocab, draft_cache(draft) if draft_cache else None,
                                            draft_spec, target.tokenizer, pool)
            continue
        if name == "lookahead" and not lookahead_joins_auto(draft is not None):
            continue
        # the arm's own settings: none of the draft model's (its precision, say), the skipped layers only for
        # layer skip (the n-gram arm stands for prompt lookup: the layer-skip arm drafts with its layers
        # only, and says nothing of its calibration, since it may not join)
        arm_spec = replace(spec, method=name, draft_model=None, draft_quant=None, draft_dtype=None,
                           skip_layers=spec.skip_layers if name == "layerskip" else "auto",
                           layerskip_lookup=False, ngram_pool=0)
        try:
            arm = proposer_for(arm_spec, target, None, max_len, num_slots, cache_dir, log=lambda _: None)
        except (TokenleapError, ImportError):  # a method this build cannot run here
            continue
        if name == "ngram" and pool is not None:
            arm.output_pool = pool
        if name == "layerskip" and getattr(arm, "skip", None) is None:
            continue  # joins once calibrated (tokenleap calibrate): no search inside a user's request
        if name == "layerskip" and not layerskip_joins_auto(getattr(arm, "predicted_speedup", None)):
            continue  # calibrated here, and predicted not to pay
        arms[name] = arm
    fixed = None if spec.num_tokens == "auto" else int(spec.num_tokens)
    return AutoProposer(arms, BanditConfig(max_k=max(spec.max_num_tokens, fixed or 1)), trees=spec.tree == "on")
