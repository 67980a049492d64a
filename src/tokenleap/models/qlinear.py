"""Weight-only int8 / int4 linear layers (whole-model quantization is in ``quant.py``).

Every kernel used here is row-invariant -- a row's output is bitwise the same whatever the number
of rows in the call -- so ``row_exact`` needs no per-row loop, unlike fp32 ``Linear``.

* ``Int8Linear``: symmetric per-output-channel scale, ``w = q * scale`` with q in [-127, 127].
  With tokenleap's compiled kernels (``tokenleap.kernels``, AVX2): float32 activations, the
  row-invariant ``int8_linear`` for decode / verification and a blocked ``int8_gemm`` for prefill
  windows of ``GEMM_MIN_ROWS``+ rows. Otherwise torch's ``aten._weight_int8pack_mm`` (inputs a
  multiple of 16; other widths: the int8 weight as ``compute_dtype`` in ``F.linear``).
  Measured here (1536x8960 layer, 2 threads, weights streamed from memory): tokenleap 0.8 ms for
  one row, 1.6 ms for four; torch 1.6 / 2.5 ms (bf16 activations).
* ``Int4Linear``: groups of ``group_size`` (32, 64, 128 or 256) input columns, asymmetric
  min/max round-to-nearest, ``w = q * scale + min`` with q in [0, 15]. Needs out_features % 16
  == 0 and in_features % group_size == 0; ``quantize_`` keeps other layers float and says why.
  With tokenleap's kernels: the W4A8 ``int4_linear`` (float16 scale / min per 32 inputs,
  activations quantized to int8 per 32 inputs the way llama.cpp does for its 4-bit products);
  measured here with weights streamed from memory (``scripts/bench_kernels.py``, 1536x8960
  layer): 0.52 ms for one row vs int8's 0.87, 0.73 vs 1.77 ms for four rows. Otherwise torch's ``aten._weight_int4pack_mm_for_cpu``
  (convention ``(q - 8) * scale + zero``).

Activation dtype of torch's kernels: activations, scales (and zeros) in one dtype. On this
AVX2-only CPU the bf16 paths were measured much faster than fp32 (8960x1536 layer, 1 thread,
M=1/4/8 rows: int8 3.5/4.7/9.0 ms with bf16 vs 14/82/163 ms with fp32 activations; int4 2.4/4.2/
7.0 vs 29/120/239 ms), so ``compute_dtype`` defaults to bf16: x is cast to bf16, the kernel runs,
and the result is cast back to x's dtype. ``compute_dtype=torch.float32`` is exact to fp32
rounding (scales and zeros kept in fp32) but slow; the GGUF exactness tests use it.

GGUF: ``int4_from_gguf_q4`` turns Q4_0 / Q4_1 / Q4_K blocks into (q, scale, min) with group
size 32, representing the file's dequantized values exactly (up to the dtype scale and min are
stored in: float32 with ``compute_dtype=torch.float32``, else float16 on tokenleap's kernel or
bfloat16 on torch's), so no second round of quantization error is added.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenleap import kernels
from tokenleap.config import QUANT_MODES, ConfigError
from tokenleap.models.linear import ROW_INVARIANT_DTYPES
GEMM_MIN_ROWS = kernels.GEMM_MIN_ROWS

INT4_GROUP_SIZES = (32, 64, 128, 256)
COMPUTE_DTYPES = (torch.bfloat16, torch.float32)
_MIN_SCALE = 1e-10  # scale for all-equal rows/groups (the zero point then carries the value)


def _check_compute_dtype(dtype: torch.dtype) -> None:
    if dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"unsupported quantized compute dtype {dtype}; choose torch.bfloat16 or torch.float32")


def _row_chunks(n: int, chunk: int = 8192) -> list[slice]:
    """Row ranges of at most ``chunk`` rows (a multiple of 64, the int4 packing's row block)."""
    return [slice(i, min(i + chunk, n)) for i in range(0, n, chunk)]


def _int4_on_kernel(compute_dtype: torch.dtype) -> bool:
    """Int4 layers run on tokenleap's W4A8 kernel (float16 scale / min) unless the exact float32
    reference is asked for or the kernels are unavailable."""
    return compute_dtype != torch.float32 and kernels.available()


def _joined_bias(layers: list[nn.Module]) -> nn.Parameter | None:
    """The biases of layers joined side by side (zeros for a layer without one), or None if none has one."""
    if all(l.bias is None for l in layers):
        return None
    parts = [l.bias.detach() if l.bias is not None else torch.zeros(l.out_features) for l in layers]
    return nn.Parameter(torch.cat(parts), requires_grad=False)


def _finish(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Cast the kernel's [rows, out] result back to x's dtype and shape; add the bias elementwise."""
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias.to(x.dtype)  # elementwise per row: row-invariant
    return y.view(*x.shape[:-1], y.shape[-1])


class Int8Linear(nn.Module):
    """``y = x (q * scale)^T (+ b)``; q int8 [out, in], scale per output channel.

    With tokenleap's compiled kernels (``tokenleap.kernels``) the weight is kept only in the
    kernels' packed layout and the product runs in float32 (exact int8 -> fp32 weights, fp32
    accumulation), whatever ``compute_dtype`` says: the row-invariant ``int8_linear`` for decoding
    and verification (``row_exact``) and for few rows, the blocked ``int8_gemm`` for prefill
    windows of many rows. Otherwise torch's kernel runs in ``compute_dtype``. Out features are
    padded to a multiple of 8 for the kernels.
    """

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 compute_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        _check_compute_dtype(compute_dtype)
        self.out_features, self.in_features = qweight.shape
        self.compute_dtype = compute_dtype
        self.use_kernel = self.in_features % 8 == 0 and kernels.available()
        q = qweight.to(torch.int8)
        if self.use_kernel:
            pad = -self.out_features % 8
            q = F.pad(q, (0, 0, 0, pad)) if pad else q  # [out8, in]
            sc = F.pad(scales.to(compute_dtype).float(), (0, pad))  # [out8]: the values torch's path would use
            self.register_buffer("packed", kernels.pack_int8(q))  # [out8/8, in/8, 8, 8]
            self.register_buffer("scales", sc.contiguous())
        else:
            self.register_buffer("_qweight", q.contiguous())  # [out, in]
            self.register_buffer("scales", scales.to(compute_dtype).contiguous())  # [out]
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def concat(cls, layers: list["Int8Linear"]) -> "Int8Linear | None":
        """One layer computing ``layers``' outputs side by side, or None when they cannot be joined
        (torch's kernel, or an output size the kernel pads). Each output column is computed exactly
        as in its own layer, so the joined layer's results are bitwise the same."""
        if not all(isinstance(l, cls) and l.use_kernel and l.out_features % 8 == 0 for l in layers):
            return None
        if len({(l.in_features, l.compute_dtype) for l in layers}) != 1:
            return None
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.compute_dtype, new.use_kernel = layers[0].in_features, layers[0].compute_dtype, True
        new.out_features = sum(l.out_features for l in layers)
        new.register_buffer("packed", torch.cat([l.packed for l in layers]))  # [sum out/8, in/8, 8, 8]
        new.register_buffer("scales", torch.cat([l.scales for l in layers]))
        new.bias = _joined_bias(layers)
        return new

    @property
    def qweight(self) -> torch.Tensor:
        """int8 [out, in]."""
        if self.use_kernel:
            return kernels.unpack_int8(self.packed)[: self.out_features]
        return self._qweight

    def weight_scales(self) -> torch.Tensor:
        """Per-output-channel scales, [out] (the padding dropped)."""
        return self.scales[: self.out_features]

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   compute_dtype: torch.dtype = torch.bfloat16) -> "Int8Linear":
        _check_compute_dtype(compute_dtype)
        n, k = weight.shape
        q = torch.empty(n, k, dtype=torch.int8)  # [out, in]
        scale = torch.empty(n, dtype=compute_dtype)  # [out]
        for r in _row_chunks(n):  # chunks bound the float temporaries (lm_head: 151936 rows)
            w = weight[r].detach().float()  # [chunk, in]
            scale[r] = (w.abs().amax(dim=1) / 127).clamp_min(_MIN_SCALE)
            # quantize against the scale as stored, so rounding of the scale is not an extra error
            q[r] = torch.round(w / scale[r].float()[:, None]).clamp_(-127, 127)
        return cls(q, scale, bias, compute_dtype)

    def forward(self, x: torch.Tensor, row_exact: bool = False) -> torch.Tensor:
        # x: [rows, in] -> [rows, out]; both kernels are row-invariant, so row_exact needs nothing extra
        if self.use_kernel:
            x2 = x.reshape(-1, self.in_features).float()  # [rows, in]
            y = kernels.weight_product(x2, self.packed, self.scales, row_exact)  # [rows, out8]
            if y.shape[1] != self.out_features:
                y = y[:, : self.out_features]
            return _finish(y, x, self.bias)
        xc = x.reshape(-1, self.in_features).to(self.compute_dtype).contiguous()  # [rows, in]
        if self.in_features % 16 == 0:
            y = torch.ops.aten._weight_int8pack_mm(xc, self._qweight, self.scales)  # [rows, out]
        else:  # torch's kernel reads inputs 16 at a time: other widths gave wrong values or crashed
            w = self._qweight.to(self.compute_dtype)  # [out, in], exact
            if row_exact and xc.shape[0] > 1 and self.compute_dtype not in ROW_INVARIANT_DTYPES:
                y = torch.cat([F.linear(xc[i:i + 1], w) for i in range(xc.shape[0])]) * self.scales
            else:
                y = F.linear(xc, w) * self.scales  # [rows, out]
        return _finish(y, x, self.bias)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the kernel multiplies by, [out, in] float32."""
        return self.qweight.float() * self.weight_scales().float()[:, None]

    def dequantized_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of ``dequantized_weight()``, [len(ids), in] float32, bitwise the same: only
        the 8-row blocks holding them are unpacked."""
        if not self.use_kernel:
            return self._qweight[ids].float() * self.scales[ids].float()[:, None]
        blocks, rows = block_rows(ids, 8)
        q = kernels.unpack_int8(self.packed[blocks])  # [b * 8, in]
        return q[rows].float() * self.scales[ids].float()[:, None]

    def extra_repr(self) -> str:
        compute = "float32 (tokenleap kernel)" if self.use_kernel else self.compute_dtype
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, compute={compute}"


class Int4Linear(nn.Module):
    """``y = x W^T (+ b)`` with ``W[n, k] = q[n, k] * scale[n, g] + min[n, g]``, q in 0..15, g = k // group_size.

    With tokenleap's compiled kernels (and ``compute_dtype`` not float32) the product is the
    W4A8 ``int4_linear``: scales and mins in float16 per 32 inputs, each row of x quantized to int8
    per 32 inputs, integer dot products -- row-invariant, and about half the time of int8 for any
    number of rows (it reads half the bytes; see BENCHMARKS.md). Otherwise, and always with
    ``compute_dtype=torch.float32`` (the exact reference: fp32 scales, mins and activations),
    torch's ``aten._weight_int4pack_mm_for_cpu``.
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 bias: torch.Tensor | None = None, group_size: int = 32,
                 compute_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        _check_compute_dtype(compute_dtype)
        reason = int4_unsupported_reason(q.shape[0], q.shape[1], group_size)
        if reason:
            raise ConfigError(f"Int4Linear: {reason}")
        self.out_features, self.in_features = q.shape
        self.group_size, self.compute_dtype = group_size, compute_dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.use_kernel = _int4_on_kernel(compute_dtype)
        if self.use_kernel:
            rep = group_size // 32  # the kernel's groups are 32 wide
            packed, sm = kernels.pack_int4(q, scales.float().repeat_interleave(rep, 1),
                                           mins.float().repeat_interleave(rep, 1))
            self.register_buffer("packed", packed)  # uint8 [out/8, in/8, 8, 4] or paired [out/16, in/32, 2, 128]
            self.register_buffer("scales_and_mins", sm)  # float16 [out/8, in/32, 2, 8] or [out/16, in/32, 2, 2, 8]
            return
        # torch's kernel: w = (q - 8) * scale + zero; row chunks of a multiple of 64 pack like the whole
        pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
        packed = torch.cat([pack(q[r].to(torch.int32).contiguous(), 1) for r in _row_chunks(q.shape[0])])  # [out, in/2]
        sz = torch.stack([scales.float(), mins.float() + 8 * scales.float()], dim=-1)  # [out, in/gs, 2]
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", sz.transpose(0, 1).to(compute_dtype).contiguous())  # [in/gs, out, 2]

    @classmethod
    def concat(cls, layers: list["Int4Linear"]) -> "Int4Linear | None":
        """One layer computing ``layers``' outputs side by side (bitwise the same results), or None
        when they cannot be joined (not all on tokenleap's kernel, or different inputs)."""
        if not all(isinstance(l, cls) and l.use_kernel for l in layers):
            return None
        if len({l.in_features for l in layers}) != 1:
            return None
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        first = layers[0]
        new.in_features, new.group_size, new.compute_dtype = first.in_features, first.group_size, first.compute_dtype
        new.use_kernel, new.out_features = True, sum(l.out_features for l in layers)
        new.register_buffer("packed", torch.cat([l.packed for l in layers]))
        new.register_buffer("scales_and_mins", torch.cat([l.scales_and_mins for l in layers]))
        new.bias = _joined_bias(layers)
        return new

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = 32,
                   compute_dtype: torch.dtype = torch.bfloat16) -> "Int4Linear":
        """Asymmetric round-to-nearest per group: min -> q = 0, max -> q = 15 (scale and min are
        rounded to the dtype they are stored in first, so q is chosen against the stored values)."""
        _check_compute_dtype(compute_dtype)
        n, k = weight.shape
        reason = int4_unsupported_reason(n, k, group_size)
        if reason:
            raise ConfigError(f"Int4Linear: {reason}")
        store = torch.float16 if _int4_on_kernel(compute_dtype) else compute_dtype
        q = torch.empty(n, k, dtype=torch.uint8)  # [out, in]
        scale = torch.empty(n, k // group_size)  # [out, groups]
        low = torch.empty(n, k // group_size)
        for r in _row_chunks(n):
            w = weight[r].detach().float().reshape(-1, k // group_size, group_size)  # [chunk, groups, gs]
            lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [chunk, groups]
            s = ((hi - lo) / 15).clamp_min(_MIN_SCALE).to(store).float()
            m = lo.to(store).float()
            scale[r], low[r] = s, m
            q[r] = torch.round((w - m[..., None]) / s[..., None]).clamp_(0, 15).reshape(-1, k)
        return cls(q, scale, low, bias, group_size, compute_dtype)

    @classmethod
    def from_gguf(cls, qtype: Any, raw: Any, shape: tuple[int, int], bias: torch.Tensor | None = None,
                  compute_dtype: torch.dtype = torch.bfloat16) -> "Int4Linear":
        """Build from raw GGUF Q4_0 / Q4_1 / Q4_K blocks of a [out, in] weight (see ``int4_from_gguf_q4``)."""
        q, scales, mins = int4_from_gguf_q4(qtype, raw, shape)
        return cls(q, scales, mins, bias, 32, compute_dtype)

    def forward(self, x: torch.Tensor, row_exact: bool = False) -> torch.Tensor:
        # x: [rows, in] -> [rows, out]; both kernels are row-invariant, so row_exact needs nothing extra
        if self.use_kernel:
            if x.dtype == torch.float32 and x.dim() == 2 and (self.bias is None or self.bias.dtype == torch.float32):
                # the decoder's case: one op, bias included
                return kernels.int4_linear(x, self.packed, self.scales_and_mins, self.bias)
            y = kernels.int4_linear(x.reshape(-1, self.in_features).float(), self.packed, self.scales_and_mins)
            return _finish(y, x, self.bias)
        xc = x.reshape(-1, self.in_features).to(self.compute_dtype).contiguous()  # [rows, in]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xc, self.packed, self.group_size,
                                                        self.scales_and_zeros)  # [rows, out]
        return _finish(y, x, self.bias)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the kernel multiplies by, [out, in] float32 (the W4A8 kernel multiplies it by
        int8-quantized activations)."""
        if self.use_kernel:
            return _dequantize_int4(self.packed, self.scales_and_mins)
        eye = torch.eye(self.in_features, dtype=torch.float32)  # [in, in]: run torch's kernel on an identity
        sz = self.scales_and_zeros.float()  # exact widening of bf16
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, sz).T.contiguous()

    def dequantized_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of ``dequantized_weight()``, [len(ids), in] float32, bitwise the same: only
        the blocks holding them are unpacked (a few of a 151,936-row LM head, not all of it)."""
        if not self.use_kernel:
            return self.dequantized_weight()[ids]
        blocks, rows = block_rows(ids, kernels.int4_rows_per_entry(self.packed))
        return _dequantize_int4(self.packed[blocks], self.scales_and_mins[blocks])[rows]  # [b * per, in] -> rows

    def extra_repr(self) -> str:
        compute = "W4A8 (tokenleap kernel)" if self.use_kernel else self.compute_dtype
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
                f"group_size={self.group_size}, compute={compute}")


def block_rows(ids: torch.Tensor, per: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed blocks (``per`` rows each) holding rows ``ids``, and where each of those rows lands
    once just these blocks are unpacked: ([b], [len(ids)])."""
    blocks, where = torch.unique(ids // per, return_inverse=True)
    return blocks, where * per + ids % per


def _dequantize_int4(packed: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    """``pack_int4``'s operands back to float32 weights [rows, in]."""
    q, s, m = kernels.unpack_int4(packed, sm)  # [rows, in], [rows, in/32] x2
    groups = q.float().view(q.shape[0], -1, 32)  # [rows, in/32, 32]
    return (groups * s.unsqueeze(-1) + m.unsqueeze(-1)).view(q.shape[0], -1)


QuantLinear = (Int8Linear, Int4Linear)


def int4_unsupported_reason(out_features: int, in_features: int, group_size: int) -> str | None:
    """Why the int4 kernel cannot take an [out, in] weight, or None when it can."""
    if group_size not in INT4_GROUP_SIZES:
        return f"group size {group_size} is not one of {INT4_GROUP_SIZES}"
    if out_features % 16:
        return f"out_features {out_features} is not a multiple of 16"
    if in_features % group_size:
        return f"in_features {in_features} is not a multiple of the group size {group_size}"
    return None


# ----------------------------------------------------------------------------------------- GGUF


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 little-endian halves -> [...] float64."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float64)


def _q4k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 packed bytes -> 8 six-bit scales and 8 six-bit mins: [..., 12] -> ([..., 8], [..., 8])."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]  # bytes 0-3, 4-7, 8-11
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float64), mn.astype(np.float64)


def int4_from_gguf_q4(qtype: Any, raw: Any, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw GGUF Q4_0 / Q4_1 / Q4_K blocks of an [out, in] weight -> the int4 kernel's parameters.

    raw: the tensor's bytes (anything ``np.asarray`` takes; e.g. ``GGUFFile.raw_tensor``'s
    uint8 [out, bytes_per_row]) with rows in HF order; shape: (out, in) in HF / torch order.
    Returns q uint8 [out, in] in 0..15, scales and mins float32 [out, in/32], such that
    ``q * scale + min`` equals ``gguf.quants.dequantize`` up to float32 rounding:
      Q4_0: d * (q - 8)                      -> scale d,      min -8 d
      Q4_1: d * q + m                        -> scale d,      min m
      Q4_K: d * sc_j * q - dmin * m_j        -> scale d sc_j, min -dmin m_j
            (256-value super-blocks of 8 sub-blocks of 32 with 6-bit sc_j, m_j)
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    qtype = T(int(qtype))
    if qtype not in (T.Q4_0, T.Q4_1, T.Q4_K):
        raise ValueError(f"int4_from_gguf_q4 takes Q4_0, Q4_1 or Q4_K blocks, not {qtype.name}")
    n, k = (int(s) for s in shape)
    block, type_size = GGML_QUANT_SIZES[qtype]
    b = np.asarray(raw, dtype=np.uint8).reshape(n, k // block, type_size)  # [out, blocks, bytes]
    if qtype == T.Q4_K:
        d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]  # [out, blocks, 1]
        sc, mn = _q4k_scale_min(b[..., 4:16])  # [out, blocks, 8]
        qs = b[..., 16:].reshape(n, k // block, 4, 1, 32)  # 4 chunks of 32 bytes: sub-blocks 2c (low), 2c+1 (high)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=3)  # [out, blocks, 4, 2, 32]
        scale = d * sc
        low = -dmin * mn
    else:
        d = _f16(b[..., 0:2])  # [out, blocks]
        off = 2 if qtype == T.Q4_0 else 4
        qs = b[..., None, off:]  # [out, blocks, 1, 16]: values j (low nibble) and j + 16 (high)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # [out, blocks, 2, 16]
        scale = d
        low = -8 * d if qtype == T.Q4_0 else _f16(b[..., 2:4])
    to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a.reshape(n, k // 32), dtype=np.float32))
    return torch.from_numpy(q.reshape(n, k).copy()), to_t(scale), to_t(low)


__all__ = ["Int8Linear", "Int4Linear", "QuantLinear", "QUANT_MODES", "GEMM_MIN_ROWS", "INT4_GROUP_SIZES",
           "int4_from_gguf_q4", "int4_unsupported_reason"]
