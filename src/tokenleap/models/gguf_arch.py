"""Per-family GGUF metadata -> ``ModelConfig`` fields: RoPE scaling, sliding windows, Gemma 3.

llama.cpp writes some settings as metadata (``{arch}.rope.scaling.*``,
``{arch}.attention.sliding_window``) and hard-codes others in its model code; those are filled in
here the way llama.cpp (and the Hugging Face original) has them: Gemma 3 slides on five of every
six layers with RoPE base 10000 there, and scales queries by head_dim ** -0.5 (hidden / heads on
the 62-layer 27B). A Llama-architecture file with a sliding window is Mistral.
"""
from __future__ import annotations

from typing import Any

from tokenleap.errors import ModelFormatError

_GEMMA3_PATTERN, _GEMMA3_LOCAL_THETA = 6, 10000.0


def rope_scaling_from_gguf(gg: Any) -> dict[str, Any]:
    """transformers-style rope scaling of a GGUF (``{}`` when plain); refuses what tokenleap cannot compute."""
    arch, meta, path = gg.architecture, gg.metadata, gg.path
    if "rope_factors_long.weight" in gg.infos or "rope_factors_short.weight" in gg.infos:
        raise ModelFormatError(f"{path}: LongRoPE scaling (rope_factors_long / rope_factors_short) is not "
                               "supported by tokenleap; use a model without it (e.g. Phi-3 4k instead of 128k)")
    dims, key_length = meta.get(f"{arch}.rope.dimension_count"), meta.get(f"{arch}.attention.key_length")
    if key_length is None:
        key_length = meta.get(f"{arch}.embedding_length", 0) // max(meta.get(f"{arch}.attention.head_count", 1), 1)
    if dims is not None and key_length and int(dims) != int(key_length):
        raise ModelFormatError(f"{path}: RoPE over {dims} of {key_length} head dimensions (partial rotary) "
                               "is not supported by tokenleap")
    kind = str(meta.get(f"{arch}.rope.scaling.type", "none") or "none")
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 0.0) or 0.0)
    if kind == "none" or (kind == "linear" and factor in (0.0, 1.0)):
        return {}
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        attn = float(meta.get(f"{arch}.rope.scaling.attn_factor", 1.0) or 1.0)
        if attn != 1.0 or f"{arch}.rope.scaling.yarn_log_multiplier" in meta:
            raise ModelFormatError(f"{path}: YaRN with llama.cpp's attn_factor / yarn_log_multiplier is not "
                                   "supported by tokenleap; use the Hugging Face checkpoint")
        out: dict[str, Any] = {"rope_type": "yarn", "factor": factor or 1.0}
        out["original_max_position_embeddings"] = int(meta.get(
            f"{arch}.rope.scaling.original_context_length", meta.get(f"{arch}.context_length", 4096)))
        for key in ("beta_fast", "beta_slow"):
            if f"{arch}.rope.scaling.yarn_{key}" in meta:
                out[key] = float(meta[f"{arch}.rope.scaling.yarn_{key}"])
        return out
    raise ModelFormatError(f"{path}: RoPE scaling {kind!r} is not supported by tokenleap "
                           "(it implements linear and yarn in GGUF files, and Llama 3's rope_freqs)")


def rope_freq_factors(gg: Any, head_dim: int) -> tuple[float, ...]:
    """Llama 3's ``rope_freqs`` tensor (per-frequency divisors of inv_freq), or ()."""
    import numpy as np
    from gguf import quants

    info = gg.infos.get("rope_freqs.weight")
    if info is None:
        return ()
    raw = gg._data[info.file][info.offset:info.offset + info.nbytes].reshape(info.byte_shape)
    values = np.asarray(quants.dequantize(raw, info.qtype), dtype=np.float32).reshape(-1)
    if values.size != head_dim // 2:
        raise ModelFormatError(f"{gg.path}: rope_freqs has {values.size} values, expected {head_dim // 2}")
    return tuple(float(v) for v in values)


def arch_fields(gg: Any, layers: int, heads: int, hidden: int, head_dim: int) -> dict[str, Any]:
    """ModelConfig fields that differ by family: architecture, sliding window, Gemma 3's settings."""
    arch, meta = gg.architecture, gg.metadata
    window = meta.get(f"{arch}.attention.sliding_window")
    window = int(window) if window else None
    fields: dict[str, Any] = {"architecture": arch, "sliding_window": window}
    if arch == "llama" and window is not None:
        fields["architecture"] = "mistral"
    if arch == "qwen3" and window is not None:
        fields["sliding_window"] = None  # Qwen3 slides only with use_sliding_window, which GGUF does not carry
    if arch == "gemma3":
        pattern = meta.get("gemma3.attention.sliding_window_pattern", _GEMMA3_PATTERN)
        if isinstance(pattern, list):  # per layer: True where the layer slides
            types = tuple("sliding_attention" if p else "full_attention" for p in pattern)
        else:
            types = tuple("sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(layers))
        fields |= {
            "layer_types": types if window is not None else (),
            "rope_local_base_freq": float(meta.get("gemma3.rope.freq_base_swa", _GEMMA3_LOCAL_THETA)),
            "query_pre_attn_scalar": float(hidden // heads if layers == 62 else head_dim),
            "final_logit_softcapping": _opt_float(meta.get("gemma3.final_logit_softcapping")),
            "hidden_act": "gelu_pytorch_tanh",
        }
    return fields


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


__all__ = ["rope_scaling_from_gguf", "rope_freq_factors", "arch_fields"]
