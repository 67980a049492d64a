"""Hugging Face config.json <-> ``ModelConfig`` for every supported family.

transformers 5 writes RoPE settings as ``rope_parameters`` (flat, or per layer type for Gemma 3);
older files use ``rope_theta`` + ``rope_scaling`` (with ``type`` or ``rope_type``). Both are read
into one normalised form: ``rope_theta`` and the scaling dictionary of the global layers, and
Gemma 3's local base frequency. A scaling type tokenleap does not implement (``longrope``,
``mrope``, ...) or a partial rotary factor is refused here, so no model loads and silently
computes different rotary embeddings than transformers would.
"""
from __future__ import annotations

from typing import Any

from tokenleap.config import ROPE_TYPES, ConfigError, ModelConfig, SUPPORTED_ARCHITECTURES

_MODEL_TYPES = {"gemma3_text": "gemma3"}  # HF model_type -> tokenleap architecture
_HF_MODEL_TYPE = {"gemma3": "gemma3_text"}  # and back
_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
_DEFAULT_HEAD_DIM = {"qwen3": 128, "gemma3": 256}  # the config classes' defaults when head_dim is absent
# transformers' config-class defaults for fields a config.json leaves out: max_position_embeddings,
# rms_norm_eps, num_key_value_heads (None: one per attention head)
_DEFAULTS = {"llama": (2048, 1e-6, None), "qwen2": (32768, 1e-6, 32), "qwen3": (32768, 1e-6, 32),
             "mistral": (131072, 1e-6, 8), "phi3": (4096, 1e-5, None), "gemma3": (131072, 1e-6, 4)}
# the same for the sizes themselves, where a family's published configs rely on them: the multimodal
# Gemma 3 checkpoints (4B, 12B, 27B) name in their text_config only what differs from Gemma3TextConfig
_SIZE_DEFAULTS = {"gemma3": {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
                             "num_hidden_layers": 26, "num_attention_heads": 8}}
# transformers builds these families' attention projections with a fixed bias, whatever the config
# says: Qwen2's q/k/v always have one, Mistral's and Phi-3's never
_FIXED_ATTENTION_BIAS = {"qwen2": True, "mistral": False, "phi3": False}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_GEMMA_GLOBAL_THETA, _GEMMA_LOCAL_THETA = 1_000_000.0, 10_000.0
_LAYER_KINDS = ("full_attention", "sliding_attention")
# Gemma 3 configs carry attn_logit_softcapping, but neither transformers' Gemma 3 nor llama.cpp applies
# it (Gemma 2 did); tokenleap follows them and ignores it.


def _architecture(d: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(tokenleap architecture, the text model's config dict) -- unwraps Gemma 3's multimodal config."""
    model_type = str(d.get("model_type", "")).lower()
    if not model_type:  # the class names this file's families have say which one it is
        classes = {cls: arch for arch, cls in _HF_CLASSES.items()}
        model_type = next((classes[a] for a in d.get("architectures") or [] if a in classes), "")
        if not model_type:
            raise ConfigError(f"config.json has no model_type (architectures: {d.get('architectures')!r}), so "
                              f"its model family is unknown; tokenleap supports {', '.join(SUPPORTED_ARCHITECTURES)}")
    if model_type == "gemma3" and isinstance(d.get("text_config"), dict):
        text = dict(d["text_config"])
        for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings"):
            if key not in text and key in d:
                text[key] = d[key]
        return "gemma3", text
    arch = _MODEL_TYPES.get(model_type, model_type)
    if arch not in SUPPORTED_ARCHITECTURES:
        archs = d.get("architectures") or [model_type or "unknown"]
        raise ConfigError(f"unsupported architecture {archs[0]!r} (model_type {model_type!r}); tokenleap "
                          f"supports {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch, d


def config_eos(raw: dict[str, Any]) -> Any:
    """config.json's ``eos_token_id`` (an id, a list, or None) as ``config_from_hf_dict`` reads it: a
    multimodal Gemma 3's from its text_config first."""
    try:
        _, d = _architecture(raw)
    except ConfigError:  # (a family tokenleap does not run: the tokenizer still reads the top level)
        d = raw
    return d.get("eos_token_id")


def _rope_settings(arch: str, d: dict[str, Any]) -> tuple[float, dict[str, Any], float | None]:
    """(rope_theta, scaling of the global layers (no rope_theta; {} when plain), local base freq)."""
    params = d.get("rope_parameters")
    local: dict[str, Any] | None = None
    if isinstance(params, dict) and any(k in params for k in _LAYER_KINDS):
        glob = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    elif isinstance(params, dict) and params:
        glob = dict(params)
    else:
        glob = {}
    saved_theta = glob.get("rope_theta")
    if isinstance(d.get("rope_scaling"), dict) and d["rope_scaling"]:
        # a rope_scaling beside rope_parameters (a model card's recipe added to a transformers 5 config)
        # replaces the global layers' parameters, as transformers reads it; the base frequency stays
        glob = dict(d["rope_scaling"])
    default_theta = _GEMMA_GLOBAL_THETA if arch == "gemma3" else 10000.0
    theta = float(glob.pop("rope_theta", None) or d.get("rope_theta") or saved_theta or default_theta)
    partial = glob.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ConfigError(f"partial_rotary_factor {partial} is not supported by tokenleap (it rotates whole heads)")
    rope_type = str(glob.pop("rope_type", None) or glob.pop("type", None) or "default")
    glob.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope scaling type {rope_type!r} is not supported by tokenleap (it implements "
                          f"{', '.join(ROPE_TYPES)}); use a checkpoint without it")
    if arch == "phi3" and rope_type != "default":  # (transformers' Phi-3 takes longrope alone)
        raise ConfigError(f"rope scaling type {rope_type!r} is not one Phi-3 takes (transformers allows only "
                          f"longrope there, which tokenleap does not support); use a checkpoint without it")
    scaling: dict[str, Any] = {}
    if rope_type != "default":
        scaling = {k: v for k, v in glob.items() if v is not None}
        scaling["rope_type"] = rope_type
        if "factor" not in scaling and rope_type != "yarn":
            raise ConfigError(f"rope scaling {rope_type!r} needs a 'factor'")
        if rope_type == "llama3":
            missing = [k for k in _LLAMA3_KEYS if k not in scaling]
            if missing:
                raise ConfigError(f"rope scaling 'llama3' needs {', '.join(missing)}")
        if rope_type in ("llama3", "yarn"):
            orig = d.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
            scaling["original_max_position_embeddings"] = int(orig or d.get("max_position_embeddings",
                                                                            _DEFAULTS[arch][0]))
        bad = sorted(k for k, v in scaling.items() if not isinstance(v, (int, float, str, bool)))
        if bad:
            raise ConfigError(f"rope scaling {rope_type!r} has unsupported entries {bad}")
    local_theta = None
    if arch == "gemma3":
        if local and (local.get("rope_type") or local.get("type") or "default") != "default":
            raise ConfigError("rope scaling of Gemma 3's sliding-window layers is not supported by tokenleap")
        local_theta = float((local or {}).get("rope_theta") or d.get("rope_local_base_freq") or _GEMMA_LOCAL_THETA)
    return theta, scaling, local_theta


def _sliding(arch: str, d: dict[str, Any], layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) as transformers applies them for ``arch``."""
    window = d.get("sliding_window")
    types = tuple(d.get("layer_types") or ())
    if arch == "llama":
        return None, ()
    if arch == "mistral":
        window = d.get("sliding_window", 4096)  # (a key set to null: no window)
    if arch in ("qwen2", "qwen3"):
        if not d.get("use_sliding_window"):
            return None, ()
        if not types and window is not None:
            first = int(d.get("max_window_layers", 28))  # (transformers' default for Qwen2 and Qwen3)
            types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers))
    if arch == "gemma3":
        if d.get("use_bidirectional_attention"):
            raise ConfigError("bidirectional Gemma 3 (an embedding model) is not a decoder tokenleap runs")
        window = d.get("sliding_window", 4096)
        if not types:
            pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
            types = tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))
    if window is None:
        return None, ()
    if arch in ("mistral", "phi3"):
        types = ()  # every layer slides in transformers' Mistral / Phi-3
    return int(window), types


def config_from_hf_dict(raw: dict[str, Any]) -> ModelConfig:
    """``ModelConfig`` from a Hugging Face config.json dictionary."""
    arch, d = _architecture(raw)
    d = {**_SIZE_DEFAULTS.get(arch, {}), **d}
    heads = int(d["num_attention_heads"])
    layers = int(d["num_hidden_layers"])
    eos = d.get("eos_token_id")
    eos_ids = tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    theta, scaling, local_theta = _rope_settings(arch, d)
    window, types = _sliding(arch, d, layers)
    default_act = "gelu_pytorch_tanh" if arch == "gemma3" else "silu"
    act = d.get("hidden_activation") or d.get("hidden_act") or default_act
    head_dim = d.get("head_dim") or _DEFAULT_HEAD_DIM.get(arch) or int(d["hidden_size"]) // heads
    scalar = d.get("query_pre_attn_scalar", 256 if arch == "gemma3" else None)
    positions, eps, kv_heads = _DEFAULTS[arch]
    return ModelConfig(
        architecture=arch,
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or kv_heads or heads),
        head_dim=int(head_dim),
        max_position_embeddings=int(d.get("max_position_embeddings", positions)),
        rope_theta=theta,
        rms_norm_eps=float(d.get("rms_norm_eps", eps)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", arch == "gemma3")),
        attention_bias=_FIXED_ATTENTION_BIAS.get(arch, bool(d.get("attention_bias", False))),
        mlp_bias=arch == "llama" and bool(d.get("mlp_bias", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids,
        rope_scaling=tuple(sorted(scaling.items())),
        rope_freq_factors=tuple(float(f) for f in d.get("rope_freq_factors") or ()),
        sliding_window=window,
        layer_types=types,
        rope_local_base_freq=local_theta,
        query_pre_attn_scalar=None if scalar is None else float(scalar),
        final_logit_softcapping=_opt_float(d.get("final_logit_softcapping")),
        hidden_act=str(act),
    )


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def config_to_hf_dict(c: ModelConfig) -> dict[str, Any]:
    """The config.json transformers accepts for ``c``; ``config_from_hf_dict`` reads it back equal.
    ``rope_freq_factors`` (a GGUF's rope_freqs) is tokenleap's own key: transformers has none."""
    eos = list(c.eos_token_ids)
    d: dict[str, Any] = {
        "model_type": _HF_MODEL_TYPE.get(c.architecture, c.architecture),
        "architectures": [_HF_CLASSES[c.architecture]],
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings, "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_norm_eps, "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias, "bos_token_id": c.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "hidden_activation" if c.architecture == "gemma3" else "hidden_act": c.hidden_act,
    }
    if c.mlp_bias:
        d["mlp_bias"] = True
    if c.rope_scaling:
        d["rope_scaling"] = dict(c.rope_scaling)
    if c.rope_freq_factors:
        d["rope_freq_factors"] = list(c.rope_freq_factors)
    if c.architecture == "gemma3":
        d |= {"rope_local_base_freq": c.rope_local_base_freq, "query_pre_attn_scalar": c.query_pre_attn_scalar,
              "final_logit_softcapping": c.final_logit_softcapping}
    elif c.query_pre_attn_scalar is not None:
        d["query_pre_attn_scalar"] = c.query_pre_attn_scalar
    d["sliding_window"] = c.sliding_window
    if c.sliding_window is not None:
        d["layer_types"] = [("sliding_attention" if c.is_sliding(i) else "full_attention")
                            for i in range(c.num_hidden_layers)]
        if c.architecture in ("qwen2", "qwen3"):
            d["use_sliding_window"] = True
            d["max_window_layers"] = next((i for i in range(c.num_hidden_layers) if c.is_sliding(i)),
                                          c.num_hidden_layers)
    elif c.architecture == "gemma3":
        d["layer_types"] = ["full_attention"] * c.num_hidden_layers
        d["sliding_window"] = None
    return d


__all__ = ["config_from_hf_dict", "config_to_hf_dict"]
