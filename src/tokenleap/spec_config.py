"""How to speculate: ``SpecConfig``, its validation, and the settings as a dictionary (the Python
API's ``speculative=``, which also takes vLLM's ``speculative_config`` spellings)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from tokenleap.config import MAX_DRAFT_TOKENS, QUANT_MODES, ConfigError, _check, is_int


# vLLM's speculative_config names -> SpecConfig's
_VLLM_NAMES = {"num_speculative_tokens": "num_tokens", "model": "draft_model", "prompt_lookup_max": "ngram_max",
               "prompt_lookup_min": "ngram_min", "quantization": "draft_quant"}


@dataclass(frozen=True)
class SpecConfig:
    """How to speculate. ``method=None`` means plain decoding."""

    method: str | None = None  # None (plain decoding) or one of __post_init__'s methods
    draft_model: str | None = None  # "auto" (method "auto" only): an installed catalog draft, see models/pairing.py
    # the draft model's weights: None (not set) is "none" for method "draft", and for "auto" the precision
    # it picks drafts at (int4, models/pairing.py), the draft named or picked; "none" asks for unquantized
    draft_quant: str | None = None
    draft_dtype: str | None = None
    draft_spec: str | None = None  # None | "ngram": n-gram lookup speculates the draft model's own steps (cascade)
    num_tokens: int | str = "auto"  # "auto" or a fixed draft length >= 1
    max_num_tokens: int = 8  # upper bound for the adaptive controller
    draft_vocab: int | None = 32768  # draft head over the first N ids + specials + prompt; None = full
    ngram_max: int = 4
    # 2: a one-token match rarely predicts what follows (replayed on Qwen2.5-Coder's outputs, 10-27%
    # of their first guesses right, against 43-58% after two-token matches and 57-94% after four)
    ngram_min: int = 2
    # n-gram lookup (and a cascade's guesses) also in the last N tokens of earlier outputs (0: off;
    # spec/proposers/output_pool.py): text the target wrote for other requests, matched 3-8 tokens long.
    # Regenerated replies drafted from the first one ran 1.18x (n-gram) / 1.05x (auto) in total, fresh
    # prompts 1.01x / 1.00x (BENCHMARKS, "Earlier outputs as a lookup source"); about 22 MiB
    ngram_pool: int = 32768
    # token trees (draft model: dynamic trees; n-gram: tries): "auto" the controller chooses plain, a chain or
    # a tree (budget <= max_tree_nodes, depth) per step from measured costs | "on": always trees | "off": chains
    tree: str = "auto"
    max_tree_nodes: int = 15  # drafted nodes a tree may hold (its depth is the draft length); with the root: 16 rows
    # lookahead decoding: a Jacobi window of W positions x (N - 1) levels beside up to G n-gram guesses
    lookahead_window: int = 3
    lookahead_ngram: int = 3
    lookahead_guesses: int = 3
    skip_layers: str = "auto"  # layer skip: the layers drafts skip ("4,5,6,10-14"), or "auto" (calibrated, cached)
    # layer skip: a sequence copying its text drafts by prompt lookup (suffixes of 2..ngram_max tokens)
    # instead of the skipped-layer forwards
    layerskip_lookup: bool = True
    # eagle: the trained draft head's file, or "auto" (the one `tokenleap train-head` stored for the target)
    draft_head: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(self.method in (None, "draft", "ngram", "lookahead", "layerskip", "eagle", "auto"),
               f"unknown speculative method {self.method!r}; choose auto, draft, ngram, lookahead, layerskip or eagle")
        _check(isinstance(self.draft_head, str) and bool(self.draft_head),
               f"draft_head must be 'auto' or a path, got {self.draft_head!r}")
        if isinstance(self.draft_model, os.PathLike):  # a local directory or GGUF file given as a Path
            object.__setattr__(self, "draft_model", os.fspath(self.draft_model))
        for name in ("draft_model", "draft_dtype", "draft_spec"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, str), f"{name} must be a string or None, got {value!r}")
        _check(isinstance(self.skip_layers, str), f"skip_layers must be 'auto' or a list like '4,5,10-14', "
                                                  f"got {self.skip_layers!r}")
        _check(isinstance(self.layerskip_lookup, bool), f"layerskip_lookup must be True or False, "
                                                        f"got {self.layerskip_lookup!r}")
        _check(self.draft_vocab is None or (is_int(self.draft_vocab) and self.draft_vocab >= 0),
               f"draft_vocab must be None or an integer >= 0 (0: the draft's full head), got {self.draft_vocab!r}")
        _check(isinstance(self.extra, dict), f"extra must be a dict, got {self.extra!r}")
        _check(self.draft_quant is None or self.draft_quant in QUANT_MODES,
               f"draft_quant {self.draft_quant!r} is not a quantization; choose one of {', '.join(QUANT_MODES)}")
        from tokenleap.spec.proposers.layerskip import parse_skip_layers
        parse_skip_layers(self.skip_layers)  # ConfigError on a bad list (layer indices are checked at load)
        _check(self.draft_model != "auto" or self.method == "auto",
               "draft_model 'auto' (pick an installed catalog draft) goes with method 'auto'")
        _check(self.method != "draft" or bool(self.draft_model),
               "speculative method 'draft' needs a draft model (--draft-model NAME_OR_PATH)")
        _check(self.draft_spec in (None, "ngram"),
               f"unknown draft speculation {self.draft_spec!r}; choose ngram (or none)")
        _check(self.draft_spec is None or self.method == "draft",
               "--draft-spec ngram speculates a draft model's steps: it needs --spec draft --draft-model M")
        _check(self.draft_spec is None or self.tree != "on",
               "--draft-spec ngram speculates chains of the draft model's steps: drop --spec-tree on")
        # (a draft is verified in one forward: past a few hundred rows it costs more than it could save,
        # and the controller's tables grow with the bound)
        _check(self.num_tokens == "auto" or (is_int(self.num_tokens) and 1 <= self.num_tokens <= MAX_DRAFT_TOKENS),
               f"num_tokens must be 'auto' or an integer in 1 .. {MAX_DRAFT_TOKENS}, got {self.num_tokens!r}")
        _check(is_int(self.max_num_tokens) and 1 <= self.max_num_tokens <= MAX_DRAFT_TOKENS,
               f"max_num_tokens must be an integer in 1 .. {MAX_DRAFT_TOKENS}, got {self.max_num_tokens!r}")
        _check(is_int(self.ngram_pool) and self.ngram_pool >= 0,
               f"ngram_pool must be an integer >= 0 (tokens of earlier outputs; 0: off), got {self.ngram_pool!r}")
        _check(is_int(self.ngram_min) and is_int(self.ngram_max) and 1 <= self.ngram_min <= self.ngram_max,
               f"need integers 1 <= ngram_min <= ngram_max, got {self.ngram_min!r} and {self.ngram_max!r}")
        _check(self.tree in ("auto", "on", "off"), f"tree must be 'auto', 'on' or 'off', got {self.tree!r}")
        _check(is_int(self.max_tree_nodes) and 1 <= self.max_tree_nodes <= MAX_DRAFT_TOKENS,
               f"max_tree_nodes must be an integer in 1 .. {MAX_DRAFT_TOKENS}, got {self.max_tree_nodes!r}")
        for name, low, high in (("lookahead_window", 1, 32), ("lookahead_ngram", 2, 8), ("lookahead_guesses", 1, 32)):
            value = getattr(self, name)
            _check(is_int(value) and low <= value <= high,
                   f"{name} must be an integer in {low} .. {high}, got {value!r}")
        self._check_combination()

    def _check_combination(self) -> None:
        """Settings that only one method reads are refused beside another, so none is ignored silently."""
        drafting = self.method in ("draft", "auto")
        _check(self.draft_model is None or drafting,
               f"draft_model goes with method 'draft' or 'auto' (method {self.method!r} uses no draft model)")
        _check(drafting or (self.draft_quant in (None, "none") and self.draft_dtype is None),
               "draft_quant and draft_dtype set a draft model's weights: they go with method 'draft' or 'auto'")
        _check(self.skip_layers == "auto" or self.method in ("layerskip", "auto"),
               "skip_layers goes with method 'layerskip'")
        _check(self.draft_head == "auto" or self.method == "eagle", "draft_head goes with method 'eagle'")
        _check(self.method is not None or self.num_tokens == "auto",
               "num_tokens sets a draft length: it goes with a speculative method")

    @classmethod
    def from_dict(cls, settings: dict[str, Any]) -> "SpecConfig":
        """Settings from a dictionary of SpecConfig's fields, or of vLLM's ``speculative_config``
        (``num_speculative_tokens``, ``model``, ``prompt_lookup_max`` / ``_min``, ``quantization``,
        method ``draft_model``; an eagle ``model`` is the head). As on the command line, a draft model
        without a method means method "draft", and method "auto" without one picks an installed draft."""
        d = dict(settings)
        if d.get("method") == "draft_model":
            d["method"] = "draft"
        for vllm_name, name in _VLLM_NAMES.items():
            if vllm_name in d:
                name = "draft_head" if vllm_name == "model" and d.get("method") == "eagle" else name
                if name in d:
                    raise ConfigError(f"speculative: give {vllm_name!r} (vLLM's name) or {name!r}, not both")
                d[name] = d.pop(vllm_name)
        if "method" not in d and d.get("draft_model") is not None:
            d["method"] = "draft"
        if d.get("method") == "auto" and "draft_model" not in d:
            d["draft_model"] = "auto"
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"speculative: unknown setting(s) {', '.join(map(repr, unknown))}; the settings are "
                              f"SpecConfig's fields ({', '.join(cls.__dataclass_fields__)}) or vLLM's "
                              f"{', '.join(_VLLM_NAMES)}")
        return cls(**d)

    @property
    def tree_nodes(self) -> int:
        """Drafted nodes an engine's trees may hold; 0 when trees are off. Lookahead's guesses always
        form a trie: the longest draft (the text's own continuation) and G - 1 pool n-grams."""
        if self.method == "lookahead":
            longest = max(self.max_num_tokens, self.num_tokens if isinstance(self.num_tokens, int) else 1)
            return longest + (self.lookahead_guesses - 1) * (self.lookahead_ngram - 1)
        if self.draft_spec is not None:  # a cascade speculates a draft model's chain (proposers/cascade.py)
            return 0
        return self.max_tree_nodes if self.tree != "off" and self.method is not None else 0


def default_ngram_min(ngram_max: int) -> int:
    """n-gram lookup's shortest suffix match when none is asked for: ``SpecConfig.ngram_min``, at most
    ``ngram_max``."""
    return min(SpecConfig.ngram_min, ngram_max)
