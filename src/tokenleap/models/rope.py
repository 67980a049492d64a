"""Rotary position embeddings: cos / sin tables per position, with transformers' RoPE scaling.

Every scaling type changes only the tables (the inverse frequencies, and yarn's attention factor
multiplying cos and sin), so every attention path -- Python, ``rope_store_attend``, the compiled
layer -- applies it unchanged. The formulas follow transformers' ``modeling_rope_utils`` step for
step in float32, so the tables equal transformers' to the last bit or nearly:

- ``linear``: inv_freq / factor.
- ``llama3``: low frequencies / factor, high ones kept, a smooth blend between.
- ``yarn``: a ramp between interpolated and extrapolated frequencies; cos and sin times the
  attention factor.
- ``dynamic`` (NTK): transformers recomputes the base from the current sequence length once it
  passes ``max_position_embeddings``, which would make a row's values depend on how many rows a
  step holds. tokenleap applies it per position instead: position p uses the frequencies of a
  sequence of length p + 1 -- what transformers computes decoding one token at a time -- so a row
  is the same alone or in a block. Up to ``max_position_embeddings`` this is plain RoPE, exactly
  as transformers; only a prompt longer than that differs from transformers' one-shot prefill.
- a GGUF's ``rope_freqs`` (Llama 3 files): inv_freq / factor per frequency (llama.cpp's form of
  ``llama3``).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenleap import kernels
from tokenleap.config import ModelConfig


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))  # [dim/2]


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(theta: float, dim: int, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    orig = s["original_max_position_embeddings"]
    factor = s.get("factor")
    factor = max_pos / orig if factor is None else float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attn)


def _dynamic_freqs(theta: float, dim: int, factor: float, max_pos: int, n: int) -> torch.Tensor:
    """[n, dim/2] angles: position p with the NTK base of a sequence of length max(p + 1, max_pos)."""
    pos = torch.arange(n, dtype=torch.float32)
    out = torch.outer(pos, _default_inv_freq(theta, dim))  # [n, dim/2]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    for p in range(max_pos, n):
        base = theta * ((factor * (p + 1) / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        out[p] = pos[p] * (1.0 / (base ** exponents))
    return out


def rope_tables(cfg: ModelConfig, theta: float, scaling: dict[str, Any], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``# [n, head_dim]`` (half-split layout) for positions 0 .. n-1."""
    dim = cfg.head_dim
    kind = scaling.get("rope_type", "default")
    attention_factor = 1.0
    if kind == "dynamic":
        freqs = _dynamic_freqs(theta, dim, float(scaling["factor"]), cfg.max_position_embeddings, n)
    else:
        if kind == "yarn":
            inv_freq, attention_factor = _yarn(theta, dim, scaling, cfg.max_position_embeddings)
        else:
            inv_freq = _default_inv_freq(theta, dim)  # [dim/2]
            if kind == "linear":
                inv_freq = inv_freq / float(scaling["factor"])
            elif kind == "llama3":
                inv_freq = _llama3(inv_freq, scaling)
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)  # [n, dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [n, dim]
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def _with_factors(cfg: ModelConfig, theta: float, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables for a GGUF's per-frequency divisors (then any linear factor, as llama.cpp applies both)."""
    inv_freq = _default_inv_freq(theta, cfg.head_dim) / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    scaling = cfg.rope_scaling_dict
    if scaling.get("rope_type") == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq)  # [n, dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


class Rotary(nn.Module):
    """Rotary position embedding, half-split layout (Hugging Face's ``rotate_half``): plain RoPE of
    base ``theta``, or any tables (``from_tables``, e.g. ``rope_tables``' scaled ones)."""

    def __init__(self, head_dim: int, theta: float, max_pos: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), _default_inv_freq(theta, head_dim))
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_pos, hd]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    @classmethod
    def from_tables(cls, cos: torch.Tensor, sin: torch.Tensor) -> "Rotary":
        """A rotary over given tables ``# [max_pos, hd]`` each."""
        rot = cls(2, 1.0, 0)
        rot.cos, rot.sin = cos, sin
        return rot

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [rows, heads, hd]; positions: [rows]
        if x.dtype == torch.float32 and kernels.available():
            return kernels.rope_(x.contiguous(), self.cos, self.sin, positions)  # fused, in place
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)  # [rows, 1, hd]
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


def rotaries(cfg: ModelConfig) -> tuple[Rotary, Rotary | None]:
    """(rotary of the global layers, rotary of the sliding layers where it differs, else None)."""
    n = cfg.max_context  # (past max_position_embeddings where the rope scaling extends the context)
    if cfg.rope_freq_factors:
        glob = Rotary.from_tables(*_with_factors(cfg, cfg.rope_theta, n))
    else:
        glob = Rotary.from_tables(*rope_tables(cfg, cfg.rope_theta, cfg.rope_scaling_dict, n))
    local = None
    if cfg.rope_local_base_freq is not None:
        local = Rotary.from_tables(*rope_tables(cfg, cfg.rope_local_base_freq, {}, n))
    return glob, local


__all__ = ["Rotary", "rope_tables", "rotaries"]
