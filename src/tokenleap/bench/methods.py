"""Method specs (``draft:k=4``, ``ngram:k=3,max=4,min=1``), the models they share, tokenleap methods.

A spec names a family and options. ``parse_methods`` turns the ``--methods`` list into specs;
``build_methods`` turns specs into runnable methods that share one loaded target (and draft), so
tokenleap's plain, draft and n-gram methods run on the very same weights.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenleap.spec.tree_budget import machine_tree_mode
from tokenleap.config import ConfigError, SamplingParams, SpecConfig, default_ngram_min
from tokenleap.spec.controller import ControllerConfig
from tokenleap.spec.engine import Engine
from tokenleap.models.pretrained import LoadedModel, load_model, resolve_dtype
from tokenleap.bench.common import (AUTO_K_FAMILIES, FAMILIES, PEER, TOKENLEAP, TREE_MODES, TREE_NODES, BenchError,
                                    BenchMethod, Generation, MethodInfo)
from tokenleap.bench.machine import memory_status
from tokenleap.spec.proposers.base import forget_outputs
from tokenleap.spec.proposers.factory import output_pool

@dataclass(frozen=True)
class MethodSpec:
    family: str
    options: tuple[tuple[str, int | str], ...] = ()

    @property
    def name(self) -> str:
        if not self.options:
            return self.family
        return self.family + ":" + ",".join(f"{k}={v}" for k, v in self.options)

    @property
    def kind(self) -> str:
        return TOKENLEAP if self.family in ("plain", "draft", "ngram", "draft-tree", "ngram-tree", "cascade", "lookahead", "auto",
                                     "layerskip", "eagle") else PEER

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)


def parse_methods(text: str, add_plain: bool = True) -> list[MethodSpec]:
    """``plain,ngram:k=3,max=4,draft:k=auto`` -> specs; an item with ``=`` but no ``:`` continues
    the previous method's options. ``plain`` is put first when missing (speedups need it)."""
    items: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if part and "=" in part and ":" not in part and items:
            items[-1] += "," + part
        elif part:
            items.append(part)
    specs = [_parse_one(item) for item in items]
    if not specs:
        raise BenchError(f"no methods given; choose from {', '.join(FAMILIES)}")
    same = [(s.family, tuple(sorted(s.options))) for s in specs]  # (options in any order: one method)
    dup = next((s.name for s, key in zip(specs, same) if same.count(key) > 1), None)
    if dup:
        raise BenchError(f"method {dup!r} is listed twice (perhaps with its options in another order)")
    if add_plain and "plain" not in [s.name for s in specs]:
        specs.insert(0, MethodSpec("plain"))
    return specs


def _parse_one(item: str) -> MethodSpec:
    family, _, rest = item.partition(":")
    family = family.strip()
    if family not in FAMILIES:
        raise BenchError(f"unknown method {family!r}; valid methods: {', '.join(FAMILIES)} "
                         "(options like draft:k=4, draft:k=auto, ngram:k=3,max=4,min=1)")
    options = [_parse_option(family, o) for o in rest.split(",") if o.strip()] if rest else []
    keys = [key for key, _ in options]
    twice = next((key for key in keys if keys.count(key) > 1), None)
    if twice is not None:  # (the last would win, silently)
        raise BenchError(f"method {item!r}: option {twice} is given twice")
    spec = MethodSpec(family, tuple(options))
    if ngram_min(spec) > int(spec.get("max", 4)):
        raise BenchError(f"method {spec.name!r}: min must not exceed max")
    if family == "lookahead":  # its sizes checked now, before any model loads
        try:
            SpecConfig(method="lookahead", lookahead_window=int(spec.get("window", 3)),
                       lookahead_ngram=int(spec.get("ngram", 3)), lookahead_guesses=int(spec.get("guesses", 3)))
        except ConfigError as e:
            raise BenchError(f"method {spec.name!r}: {e}") from None
    return spec


def ngram_min(spec: MethodSpec) -> int:
    """The method's ``min`` option, by default SpecConfig's (at most its ``max``)."""
    return int(spec.get("min", default_ngram_min(int(spec.get("max", 4)))))


def _parse_option(family: str, text: str) -> tuple[str, int | str]:
    key, eq, value = (s.strip() for s in text.partition("="))
    allowed = FAMILIES[family]
    if key not in allowed or not eq:
        valid = ", ".join(allowed) or "none"
        raise BenchError(f"method {family!r}: unknown option {text.strip()!r}; valid options: {valid}")
    if value == "auto" and key == "k" and family in AUTO_K_FAMILIES:
        return key, value
    if key == "skip":  # layerskip: auto, or layer indices and ranges joined by + (a comma ends the option)
        from tokenleap.spec.proposers.layerskip import parse_skip_layers
        try:
            parse_skip_layers(value)
        except ConfigError as e:
            raise BenchError(f"method {family!r}: option skip must be auto or a list like 4-6+10-14 ({e})") from None
        return key, value
    if key == "head":  # eagle: auto, or a head file
        if not value:
            raise BenchError(f"method {family!r}: option head needs auto or a file")
        return key, value
    if key == "model":  # a draft model other than --draft (another tokenizer, another size)
        if not value:
            raise BenchError(f"method {family!r}: option model needs a model name or path")
        return key, value
    if key in ("lookup", "stop"):
        if value not in ("on", "off"):
            raise BenchError(f"method {family!r}: option {key} must be on or off, got {value!r}")
        return key, value
    if key == "tree":
        if value not in TREE_MODES:
            raise BenchError(f"method {family!r}: option tree must be one of {', '.join(TREE_MODES)}, got {value!r}")
        return key, value
    if not value.isdigit() or int(value) < (0 if key == "vocab" else 1):  # (vocab=0: the draft's full head)
        hint = ("an integer >= 0" if key == "vocab" else "an integer >= 1") + (
            " or auto" if key == "k" and family in AUTO_K_FAMILIES else "")
        raise BenchError(f"method {family!r}: option {key} must be {hint}, got {value!r}")
    return key, int(value)


@dataclass
class ModelOptions:
    target: str
    draft: str | None = None
    dtype: str = "auto"
    quant: str = "none"
    draft_quant: str = "none"
    cache_dir: str | None = None
    threads: int = 2
    max_len: int = 2048  # context the engines (and peers) reserve


@dataclass
class ModelPool:
    """Loads each model once, on first use, and hands it to every method that needs it."""

    opts: ModelOptions
    _cache: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, make) -> Any:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def target(self) -> LoadedModel:
        o = self.opts
        return self.get("target", lambda: load_model(o.target, o.dtype, o.quant, o.cache_dir))

    def draft(self, needed_by: str, model: str | None = None) -> LoadedModel:
        """The --draft model, or ``model`` (a method's ``model=`` option: another draft beside it in
        the same run), loaded once at the --draft-quant and the target's dtype."""
        o = self.opts
        name = model or o.draft
        if not name:
            raise BenchError(f"method {needed_by!r} needs a draft model: pass --draft MODEL (or model=NAME)")
        return self.get("draft" if name == o.draft else f"draft:{name}",
                        lambda: load_model(name, self.target().dtype, o.draft_quant, o.cache_dir, gguf_other="int4"))

    @property
    def dtype(self):
        return resolve_dtype(self.opts.dtype)


class TokenleapMethod:
    """tokenleap's engine with or without a proposer; one engine (and KV cache) per method."""

    kind = TOKENLEAP

    def __init__(self, name: str, engine: Engine) -> None:
        self.name = name
        self.engine = engine

    def forget_outputs(self) -> None:
        """Empty the proposer's pools of earlier outputs (after the warm-up, whose prompt is measured)."""
        if self.engine.proposer is not None:
            forget_outputs(self.engine.proposer)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        t0 = time.perf_counter()
        seq = None
        for seq, _ in self.engine.generate(prompt_ids, params):
            pass
        seconds = time.perf_counter() - t0
        st = seq.stats
        stats = {**st.to_dict(), "position_proposed": list(st.position_proposed),
                 "position_accepted": list(st.position_accepted)}
        return Generation(list(seq.generated), seq.text, seconds, seq.finish_reason, stats)


def _tree_mode(spec: MethodSpec) -> str:
    """A ``-tree`` family always drafts trees; ``draft`` / ``ngram`` take ``tree=auto|on|off`` (default off)."""
    return "on" if spec.family.endswith("-tree") else str(spec.get("tree", "off"))


def _controller(spec: MethodSpec) -> ControllerConfig:
    k = spec.get("k", "auto")
    kmax = int(spec.get("kmax", 8))
    fixed = None if k == "auto" else int(k)
    return ControllerConfig(max_k=max(kmax, fixed or 1), fixed_k=fixed, tree=machine_tree_mode(_tree_mode(spec)),
                            confidence_stop=spec.get("stop", "on") == "on")


def build_tokenleap(spec: MethodSpec, pool: ModelPool) -> TokenleapMethod:
    target, max_len = pool.target(), pool.opts.max_len
    proposer = None
    family = spec.family.removesuffix("-tree")  # a tree method drafts like its chain family
    if family == "ngram":
        from tokenleap.spec.proposers.ngram import NgramProposer
        proposer = NgramProposer(int(spec.get("max", 4)), ngram_min(spec), output_pool(int(spec.get("pool", 0))))
    elif family in ("draft", "cascade"):  # a draft of another tokenizer drafts through text (cross_tokenizer.py)
        from tokenleap.spec.proposers.factory import draft_proposer
        vocab = int(spec.get("vocab", SpecConfig.draft_vocab))  # vocab=0: the draft's full head
        draft = pool.draft(spec.name, spec.get("model"))
        proposer = draft_proposer(draft, target.model.config.vocab_size, max_len, draft_vocab=vocab,
                                  draft_spec="ngram" if family == "cascade" else None,
                                  target_tokenizer=target.tokenizer, pool=output_pool(int(spec.get("pool", 0))))
    nodes = int(spec.get("nodes", TREE_NODES)) if _tree_mode(spec) != "off" else 0
    if family == "lookahead":
        from tokenleap.spec.proposers.factory import lookahead_proposer
        k = spec.get("k", "auto")
        la = SpecConfig(method="lookahead", num_tokens=k, max_num_tokens=int(spec.get("kmax", 8)),
                        ngram_max=int(spec.get("max", 4)),
                        lookahead_window=int(spec.get("window", SpecConfig.lookahead_window)),
                        lookahead_ngram=int(spec.get("ngram", SpecConfig.lookahead_ngram)),
                        lookahead_guesses=int(spec.get("guesses", SpecConfig.lookahead_guesses)))
        proposer, nodes = lookahead_proposer(la), la.tree_nodes
    if family == "auto":
        proposer = _auto(spec, pool)
    if family == "layerskip":  # the target drafts for itself (skip=auto: the stored calibration, else made once)
        from tokenleap.spec.proposers.factory import build_proposer
        ls = SpecConfig(method="layerskip", skip_layers=str(spec.get("skip", "auto")),
                        layerskip_lookup=spec.get("lookup", "on") == "on")
        proposer = build_proposer(ls, target, max_len, 1, pool.opts.cache_dir)
    if family == "eagle":  # a trained head drafting from the target's features
        from tokenleap.spec.proposers.factory import eagle_proposer
        proposer = eagle_proposer(target, str(spec.get("head", "auto")), max_len, pool.opts.cache_dir)
    engine = Engine(target.model, target.tokenizer, max_len=max_len, proposer=proposer,
                    controller=_controller(spec), tree_nodes=nodes)
    return TokenleapMethod(spec.name, engine)


def _auto(spec: MethodSpec, pool: ModelPool):
    """``auto``: n-gram lookup, the --draft model when given, and the other methods this build has,
    chosen per request and step (``spec/proposers/auto.py``)."""
    from tokenleap.spec.proposers.factory import auto_proposer
    o = pool.opts
    k = spec.get("k", "auto")
    cfg = SpecConfig(method="auto", draft_model=o.draft, num_tokens=k, max_num_tokens=int(spec.get("kmax", 8)),
                     ngram_max=int(spec.get("max", 4)), ngram_min=ngram_min(spec), ngram_pool=int(spec.get("pool", 0)),
                     draft_vocab=int(spec.get("vocab", SpecConfig.draft_vocab)) or None)
    draft = pool.draft(spec.name) if o.draft else None
    return auto_proposer(cfg, pool.target(), draft, o.max_len, 1, o.cache_dir)


def build_methods(specs: list[MethodSpec], pool: ModelPool) -> tuple[list[BenchMethod], list[MethodInfo]]:
    """Build every spec; a peer that is not installed or fails to load is recorded, not raised."""
    from tokenleap.bench import peers

    methods: list[BenchMethod] = []
    infos: list[MethodInfo] = []
    for spec in specs:
        info = MethodInfo(spec.name, spec.family, spec.kind, dict(spec.options))
        t0 = time.perf_counter()
        if spec.kind == TOKENLEAP:
            method = build_tokenleap(spec, pool)
        else:
            method = peers.build_peer(spec, pool, info)
        mem = memory_status()
        info.detail.update(load_seconds=round(time.perf_counter() - t0, 2), rss_after_load_mb=mem.get("rss_mb"),
                           rss_anon_after_load_mb=mem.get("rss_anon_mb"), rss_file_after_load_mb=mem.get("rss_file_mb"))
        if method is not None:
            info.detail.update(getattr(method, "detail", {}))
            methods.append(method)
        infos.append(info)
    return methods, infos


def describe_target(pool: ModelPool) -> dict[str, Any]:
    t = pool.target()
    return {"source": t.source, "dtype": str(t.dtype).removeprefix("torch."), "quant": t.quant,
            "gguf": str(t.gguf_path) if t.gguf_path else None}
