"""6-bit weight layers: a GGUF's Q6_K tensors, kept exactly, on tokenleap's W6A8 kernel.

llama.cpp's Q4_K_M files store the output layer and part of v_proj / down_proj as Q6_K (6.56 bits
a weight). Re-quantizing those to int8 reads 22% more bytes, and int8's float products are slow
for several rows; re-quantizing them to int4 loses precision llama.cpp keeps. ``Int6Linear``
keeps the file's values, ``W[n, k] = d * sc[n, k // 16] * (q[n, k] - 32)``, and runs
``kernels.int6_linear`` (activations quantized to int8 per 32 inputs, as llama.cpp does for its
Q6_K products).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from tokenleap import kernels
from tokenleap.models.qlinear import block_rows

SUPER_BLOCK = 256


def int6_unsupported_reason(out_features: int, in_features: int) -> str | None:
    """Why a Q6_K [out, in] weight cannot become an ``Int6Linear``, or None when it can."""
    if not kernels.available():
        return f"tokenleap's kernels are unavailable ({kernels.unavailable_reason()})"
    if out_features % 8:
        return f"out_features {out_features} is not a multiple of 8"
    if in_features % SUPER_BLOCK:
        return f"in_features {in_features} is not a multiple of {SUPER_BLOCK}"
    return None


def int6_from_gguf_q6k(raw: Any, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw GGUF Q6_K blocks of an [out, in] weight (uint8 [out, bytes_per_row], rows in HF order)
    -> q uint8 [out, in] in 0..63, sc int8 [out, in/16], d float32 [out, in/256] such that
    ``d * sc * (q - 32)`` is exactly ``gguf.quants.dequantize``'s value.

    A Q6_K block of 256 weights is 210 bytes: 128 bytes of low nibbles, 64 bytes of top 2-bit
    pairs, 16 int8 scales (one per 16 consecutive weights), a float16 d. In each half of 128
    weights (64 low bytes L, 32 top bytes T), weight 32 i + l (i < 4, l < 32) takes the low or high
    nibble of L[l] (i = 0, 2) or L[l + 32] (i = 1, 3) and bits 2 i, 2 i + 1 of T[l] on top.
    """
    n, k = (int(s) for s in shape)
    b = np.asarray(raw, dtype=np.uint8).reshape(n, k // SUPER_BLOCK, 210)  # [out, blocks, bytes]
    ql = b[..., :128].reshape(n, -1, 2, 64)  # [out, blocks, half, 64]
    qh = b[..., 128:192].reshape(n, -1, 2, 32)  # [out, blocks, half, 32]
    low = np.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)
    top = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3)  # [out, blocks, half, i, 32]
    q = (low | (top << 4)).reshape(n, k)
    sc = b[..., 192:208].view(np.int8).reshape(n, k // 16)
    d = np.ascontiguousarray(b[..., 208:210]).view(np.float16)[..., 0].astype(np.float32)  # [out, blocks]
    return torch.from_numpy(q.copy()), torch.from_numpy(sc.copy()), torch.from_numpy(d)


class Int6Linear(nn.Module):
    """``y = x W^T (+ b)`` with Q6_K weights ``W = d * sc * (q - 32)`` on the W6A8 kernel (row-invariant)."""

    def __init__(self, q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        reason = int6_unsupported_reason(self.out_features, self.in_features)
        if reason:
            raise ValueError(f"Int6Linear: {reason}")
        packed, dd = kernels.pack_int6(q, sc, d)
        self.register_buffer("packed", packed)  # uint8 [out/8, in/32, 208] or paired [out/16, in/32, 2, 208]
        self.register_buffer("d", dd)  # float32 [out/8, in/256, 8] or paired [out/16, in/256, 2, 8]
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)

    @classmethod
    def from_gguf(cls, raw: Any, shape: tuple[int, int], bias: torch.Tensor | None = None) -> "Int6Linear":
        return cls(*int6_from_gguf_q6k(raw, shape), bias)

    def forward(self, x: torch.Tensor, row_exact: bool = False) -> torch.Tensor:
        # x: [rows, in] -> [rows, out]; the kernel is row-invariant, so row_exact needs nothing extra
        x2 = x.reshape(-1, self.in_features).float()  # [rows, in]
        y = kernels.int6_linear(x2, self.packed, self.d, self.bias)  # [rows, out]
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the kernel multiplies by (with int8-quantized activations), [out, in] float32."""
        return _dequantize(self.packed, self.d)

    def dequantized_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of ``dequantized_weight()``, [len(ids), in] float32, bitwise the same: only the
        blocks holding them are unpacked (a draft head's few rows of a 151,936-row LM head)."""
        blocks, rows = block_rows(ids, kernels.int6_rows_per_entry(self.packed))  # 8 rows an entry, 16 paired
        return _dequantize(self.packed[blocks], self.d[blocks])[rows]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, compute=W6A8 (Q6_K)"


def _dequantize(packed: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``pack_int6``'s operands (whole entries of 8 or 16 rows) back to float32 weights [rows, in]."""
    q, sc, dd = kernels.unpack_int6(packed, d)
    return dd.repeat_interleave(SUPER_BLOCK, 1) * sc.float().repeat_interleave(16, 1) * (q.float() - 32)


__all__ = ["Int6Linear", "int6_from_gguf_q6k", "int6_unsupported_reason"]
