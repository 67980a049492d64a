"""In-place quantization of a whole model: ``quantize_`` (every float linear layer to int8 / int4),
``quantize_from_gguf_`` (re-using a GGUF file's own 4-bit blocks) and ``fuse_projections_``.
The layers themselves are in ``qlinear.py`` (re-exported here)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenleap.config import ConfigError
from tokenleap.models.linear import Linear
from tokenleap.models.qlinear import (GEMM_MIN_ROWS, INT4_GROUP_SIZES, QUANT_MODES, Int4Linear, Int8Linear, QuantLinear,
                      _check_compute_dtype, int4_from_gguf_q4, int4_unsupported_reason)
from tokenleap.models.int6 import Int6Linear, int6_unsupported_reason
from tokenleap.models.w8a8 import W8A8Linear, smoothing, w8a8_block

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- whole model


@dataclass(frozen=True)
class QuantReport:
    mode: str
    bytes_before: int
    bytes_after: int
    quantized: tuple[str, ...]  # module names now Int8Linear / Int4Linear
    kept_float: tuple[tuple[str, str], ...]  # (module name, reason)

    def __str__(self) -> str:
        ratio = self.bytes_before / max(self.bytes_after, 1)
        s = (f"{self.mode}: {len(self.quantized)} linear layers quantized, weights "
             f"{self.bytes_before / 2**20:.1f} MiB -> {self.bytes_after / 2**20:.1f} MiB ({ratio:.2f}x smaller)")
        return s + "".join(f"\n  kept float: {n} ({r})" for n, r in self.kept_float)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of all parameters and persistent buffers (quantized weights), shared tensors counted once."""
    seen, total = set(), 0
    for m in model.modules():
        tensors = list(m._parameters.values())
        tensors += [b for name, b in m._buffers.items() if name not in m._non_persistent_buffers_set]
        packed = m.__dict__.get("_packed")  # a bf16 Linear's packed copy, once its float weight is released
        if isinstance(packed, torch.Tensor) and getattr(m, "weight", None) is not None and m.weight.numel() == 0:
            tensors.append(packed)
        for t in tensors:
            if t is None:
                continue
            key = id(t) if t.device.type == "meta" else (t.data_ptr(), t.dtype, tuple(t.shape))
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def _float_linears(model: nn.Module, skip_lm_head: bool) -> list[tuple[nn.Module, str, str, Linear]]:
    """(parent, attribute, full name, layer) for every float ``Linear``; embeddings are not Linear."""
    out = []
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            name = f"{parent_name}.{attr}" if parent_name else attr
            if isinstance(child, Linear) and not (skip_lm_head and name == "lm_head"):
                out.append((parent, attr, name, child))
    return out


_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # projections sharing one input


def _w8a8_smoothing(model: nn.Module, act_max: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Each float Linear's W8A8 smoothing vector, shared by the projections of one input (so they
    can be joined): by module name."""
    out: dict[str, torch.Tensor] = {}
    act_max = act_max or {}
    for parent_name, parent in model.named_modules():
        prefix = f"{parent_name}." if parent_name else ""
        grouped = set()
        for group in _INPUT_GROUPS:
            parts = [getattr(parent, n, None) for n in group]
            if all(isinstance(p, Linear) for p in parts):
                s = smoothing([p.weight for p in parts], act_max.get(prefix + group[0]))
                out.update({prefix + n: s for n in group})
                grouped.update(group)
        for attr, child in parent.named_children():
            if isinstance(child, Linear) and attr not in grouped:
                out[prefix + attr] = smoothing([child.weight], act_max.get(prefix + attr))
    return out


def _quantize_one(lin: Linear, mode: str, group_size: int, compute_dtype: torch.dtype,
                  smooth: torch.Tensor | None = None) -> tuple[nn.Module | None, str]:
    if mode == "w8a8":
        if w8a8_block(lin.in_features) is None:
            return None, f"W8A8 kernel: in_features {lin.in_features} is not a multiple of 64"
        return W8A8Linear.from_float(lin.weight, lin.bias, smooth if smooth is not None else torch.ones(lin.in_features)), ""
    if mode == "int8":
        return Int8Linear.from_float(lin.weight, lin.bias, compute_dtype), ""
    reason = int4_unsupported_reason(lin.out_features, lin.in_features, group_size)
    if reason:
        return None, f"int4 kernel: {reason}"
    return Int4Linear.from_float(lin.weight, lin.bias, group_size, compute_dtype), ""


def _check_mode(mode: str, what: str = "quantization mode") -> None:
    if mode not in QUANT_MODES:
        raise ConfigError(f"unknown {what} {mode!r}; choose one of: {', '.join(QUANT_MODES)}")


def quantize_(model: nn.Module, mode: str, skip_lm_head: bool = False, group_size: int = 32,
              compute_dtype: torch.dtype = torch.bfloat16,
              act_max: dict[str, torch.Tensor] | None = None) -> QuantReport:
    """Replace every float ``Linear`` of ``model`` (q/k/v/o, MLP, lm_head unless skipped) in place.

    mode: "none" | "int8" | "int4" | "w8a8" (``act_max``: each Linear's input maxima by name, from
    ``calibration.activation_maxima``, for its smoothing). Embeddings stay float; with tied embeddings a quantized lm_head
    gets its own int copy (faster logits, the float embedding is still needed for lookups).
    Layers the int4 kernel cannot take stay float; the report lists them with the reason.
    """
    _check_mode(mode)
    if mode == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ConfigError(f"unsupported int4 group size {group_size}; choose one of {INT4_GROUP_SIZES}")
    _check_compute_dtype(compute_dtype)
    before = weight_bytes(model)
    done, kept = [], []
    if mode != "none":
        smooth = _w8a8_smoothing(model, act_max) if mode == "w8a8" else {}
        for parent, attr, name, lin in _float_linears(model, skip_lm_head):
            new, reason = _quantize_one(lin, mode, group_size, compute_dtype, smooth.get(name))
            if new is None:
                kept.append((name, reason))
                continue
            setattr(parent, attr, new)  # drops the float Linear (and its weight, unless tied)
            done.append(name)
    return _report(model, mode, before, done, kept)


def _report(model: nn.Module, mode: str, before: int, done: list, kept: list) -> QuantReport:
    for name, reason in kept:
        log.info("kept %s in float: %s", name, reason)
    return QuantReport(mode, before, weight_bytes(model), tuple(done), tuple(kept))


def fuse_projections_(model: nn.Module) -> int:
    """Join each attention block's q/k/v and each MLP's gate/up int8 (int4, bf16) projections into one layer
    (one kernel call instead of three or two; outputs bitwise unchanged). Returns how many joins
    were made; layers that cannot be joined (torch's kernels, mixed int8 / int4, float) are left as they are."""
    joined = 0
    for m in model.modules():
        for names, target in ((("q_proj", "k_proj", "v_proj"), "qkv"), (("gate_proj", "up_proj"), "gate_up")):
            if hasattr(m, target) and getattr(m, target) is None and all(hasattr(m, n) for n in names):
                parts = [getattr(m, n) for n in names]
                fused = (Int8Linear.concat(parts) or Int4Linear.concat(parts) or W8A8Linear.concat(parts)
                         or Linear.concat(parts))
                if fused is not None:
                    setattr(m, target, fused)
                    for n in names:
                        delattr(m, n)
                        setattr(m, n, None)
                    joined += 1
    return joined


_GGUF_4BIT = ("Q4_0", "Q4_1", "Q4_K")  # the block types Int4Linear takes exactly


def has_4bit_blocks(gguf: Any) -> bool:
    """Whether a GGUF file (a ``GGUFFile``) stores any weight in a block type ``Int4Linear`` takes."""
    return any(getattr(info.qtype, "name", "") in _GGUF_4BIT for info in gguf.infos.values())


def quantize_from_gguf_(model: nn.Module, gguf: Any, other: str = "int8", skip_lm_head: bool = False,
                        compute_dtype: torch.dtype = torch.bfloat16) -> QuantReport:
    """Quantize ``model`` (built from the same GGUF) in place, reusing the file's 4-bit blocks.

    Layers stored as Q4_0 / Q4_1 / Q4_K become ``Int4Linear`` with exactly the file's values; with
    ``other="int8"`` (keep the file's precision) Q6_K layers become ``Int6Linear``, also exactly the
    file's values (where tokenleap's kernels run); the rest (Q5_0, Q8_0, F16, ...) are quantized
    from the model's float weight with ``other`` ("int8", "int4" or "none"). gguf: a path, or a ``tokenleap.models.gguf.GGUFFile`` (anything
    with ``hf_to_gguf`` (HF names it holds) and ``raw_tensor(hf_name) -> (type, raw, shape)``).
    """
    _check_mode(other, "mode for non-4-bit tensors")
    _check_compute_dtype(compute_dtype)
    if isinstance(gguf, (str, os.PathLike)):
        from tokenleap.models.gguf import GGUFFile
        gguf = GGUFFile(gguf)
    f = gguf
    before = weight_bytes(model)
    done, kept = [], []
    for parent, attr, name, lin in _float_linears(model, skip_lm_head):
        hf_name = f"{name}.weight"
        if hf_name not in f.hf_to_gguf and name == "lm_head":
            hf_name = "model.embed_tokens.weight"  # tied embeddings: the file stores only the embedding
        new, reason = None, ""
        qtype, raw, shape = f.raw_tensor(hf_name)
        if tuple(shape) != (lin.out_features, lin.in_features):
            raise ValueError(f"{hf_name} is {tuple(shape)} in the GGUF but {name} is "
                             f"{(lin.out_features, lin.in_features)}; build the model from the same file")
        if getattr(qtype, "name", "") in _GGUF_4BIT:
            reason = int4_unsupported_reason(*shape, 32)
            if reason is None:
                new = Int4Linear.from_gguf(qtype, raw, shape, lin.bias, compute_dtype)
        if new is None and other == "int8" and getattr(qtype, "name", "") == "Q6_K":
            reason = int6_unsupported_reason(*shape)
            if reason is None:
                new = Int6Linear.from_gguf(raw, shape, lin.bias)
        if new is None and other != "none":
            new, reason = _quantize_one(lin, other, 32, compute_dtype)
        if new is None:
            kept.append((name, reason or f"{getattr(qtype, 'name', qtype)} tensor and other='none'"))
            continue
        setattr(parent, attr, new)
        done.append(name)
    return _report(model, f"gguf+{other}", before, done, kept)


__all__ = ["Int8Linear", "Int4Linear", "Int6Linear", "QuantLinear", "QuantReport", "QUANT_MODES", "GEMM_MIN_ROWS", "quantize_",
           "fuse_projections_", "quantize_from_gguf_", "int4_from_gguf_q4", "int4_unsupported_reason",
           "weight_bytes"]
