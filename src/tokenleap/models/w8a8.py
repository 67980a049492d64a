"""W8A8 linear layers: int8 weights and int8 activations, for targets whose verification should
cost about one row's weight stream whatever the rows (``--quant w8a8``).

``y = scale * sum_b d_b * (xq_b . q_b)``: weights ``q`` int8 with one scale per output; the
activations are first divided by a fixed smoothing vector ``s`` per input (the weights carry it:
``q ~ W * s / scale``), then quantized to int8 per row and per block of ``block`` inputs
(``d_b = max|x_b| / 127``, round half to even). The smoothing (SmoothQuant, alpha = 0.5) moves the
range of Qwen's outlier channels into the weights: ``s_j = sqrt(max|x_j| / max|W_j|)``, with the
activation maxima measured by a calibration forward (``calibration.activation_maxima``). Each row is
quantized on its own and its integer sums are exact, so a row's output never depends on the other
rows of the call: row-invariant, like every product tokenleap verifies with.

With AMX-INT8 tiles (``kernels/w8a8.cpp``) 16 rows cost about 1.2x one row, half the bf16
product's time (BENCHMARKS "W8A8"). Elsewhere ``w8a8_reference`` computes the same values
bitwise with torch ops (slow: for tests and correctness, not for serving; ``load_model`` refuses
``w8a8`` on CPUs without the tiles).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenleap import kernels

W8A8_BLOCKS = (256, 128, 64)  # the largest dividing in_features is a layer's activation block
SMOOTH_ALPHA = 0.5
_FLOOR = 1e-5  # smallest maximum a channel is credited with (a channel never seen active)


def w8a8_block(in_features: int) -> int | None:
    """The activation block of a layer with ``in_features`` inputs, or None when none divides it."""
    return next((b for b in W8A8_BLOCKS if in_features % b == 0), None)


def _column_absmax(w: torch.Tensor, rows: int = 2048) -> torch.Tensor:
    """max |w[:, j]| per column as float32, in w's own dtype and row chunks (|x| and max are exact
    in any float format, so this equals the float32 computation without a float32 copy)."""
    w = w.detach()
    out = w[:rows].abs().amax(dim=0)
    for r0 in range(rows, w.shape[0], rows):
        out = torch.maximum(out, w[r0:r0 + rows].abs().amax(dim=0))
    return out.float()


def smoothing(weights: list[torch.Tensor], act_max: torch.Tensor | None) -> torch.Tensor:
    """s [in] for layers sharing one input (q/k/v, gate/up): sqrt(max|x_j| / max|W_j|) over all of
    them, so they can be joined; ones without activation maxima."""
    in_features = weights[0].shape[1]
    if act_max is None:
        return torch.ones(in_features)
    w_max = torch.stack([_column_absmax(w) for w in weights]).amax(dim=0)  # [in]
    a = act_max.float().clamp_min(_FLOOR) ** SMOOTH_ALPHA
    return (a / w_max.clamp_min(_FLOOR) ** (1 - SMOOTH_ALPHA)).clamp_min(_FLOOR)


def pack_w8a8(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] (N a multiple of 16, K of 64) -> the kernel's [N/16, K/64, 16, 16, 4]: per 16
    outputs and 64 inputs, row r holds inputs 4r..4r+3 of each output (TDPBSSD's B tile)."""
    n, k = q.shape
    return q.reshape(n // 16, 16, k // 64, 16, 4).permute(0, 2, 3, 1, 4).contiguous()


def w8a8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, inv_smooth: torch.Tensor,
                   block: int) -> torch.Tensor:
    """x float32 [M, K] -> float32 [M, N]: ``kernels/w8a8.cpp``'s values, bitwise (the same float32
    quantization; exact integer sums; float64 sums of exact products in block order)."""
    m, k = x.shape
    n, nb = q.shape[0], k // block
    xb = (x * inv_smooth).view(m, nb, block)  # [M, blocks, block]
    amax = xb.abs().amax(dim=-1)  # [M, blocks]
    d = (amax / torch.full_like(amax, 127.0)).double()
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv[..., None]).clamp_(-127, 127).double()
    y = torch.empty(m, n)
    for c in range(0, n, 4096):  # output chunks bound the float64 temporaries
        qc = q[c:c + 4096].double().view(-1, nb, block)  # [chunk, blocks, block]
        sums = torch.einsum("mbk,nbk->bmn", xq, qc)  # exact: integers below 2^53
        acc = torch.zeros(m, qc.shape[0], dtype=torch.float64)
        for b in range(nb):
            acc = acc + sums[b] * d[:, b, None]
        y[:, c:c + 4096] = (acc * scale[c:c + 4096].double()).float()
    return y


class W8A8Linear(nn.Module):
    """``y = x (q * scale / s)^T (+ b)`` with int8 activations (module docstring). Out features are
    padded to a multiple of 32 for the kernel (zero rows, sliced off)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, smooth: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.block = w8a8_block(self.in_features)
        if self.block is None:
            raise ValueError(f"W8A8 needs in_features divisible by 64, got {self.in_features}")
        pad = -self.out_features % 32
        self.use_kernel = kernels.w8a8_available()
        q8 = F.pad(q.to(torch.int8), (0, 0, 0, pad))  # [out32, in]
        self.register_buffer("scale", F.pad(scale.float(), (0, pad)).contiguous())  # [out32]
        self.register_buffer("inv_smooth", (1.0 / smooth.float()).contiguous())  # [in]
        if self.use_kernel:
            self.register_buffer("packed", pack_w8a8(q8))  # [out32/16, in/64, 16, 16, 4]
        else:
            self.register_buffer("_qweight", q8.contiguous())  # [out32, in]
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, smooth: torch.Tensor) -> "W8A8Linear":
        """Quantize ``weight`` [out, in] scaled by ``smooth`` [in] (``smoothing``) per output channel."""
        n, k = weight.shape
        q = torch.empty(n, k, dtype=torch.int8)
        scale = torch.empty(n)
        s = smooth.float()
        for r0 in range(0, n, 1024):  # chunks bound the float temporaries (an LM head: 151936 rows)
            w = weight[r0:r0 + 1024].detach().to(torch.float32, copy=True).mul_(s)  # [chunk, in], a copy
            lo, hi = torch.aminmax(w, dim=1)
            sc = (torch.maximum(-lo, hi) / 127).clamp_min(1e-10)  # max |w| per output
            scale[r0:r0 + 1024] = sc
            q[r0:r0 + 1024] = w.div_(sc[:, None]).round_().clamp_(-127, 127)
        return cls(q, scale, s, bias)

    @classmethod
    def concat(cls, layers: list[nn.Module]) -> "W8A8Linear | None":
        """One layer computing ``layers``' outputs side by side -- bitwise each layer's, as every
        output is computed on its own -- or None unless all share one input smoothing and no padding."""
        if not all(isinstance(l, cls) and l.out_features % 32 == 0 for l in layers):
            return None
        first = layers[0]
        if any(l.in_features != first.in_features or l.use_kernel != first.use_kernel
               or not torch.equal(l.inv_smooth, first.inv_smooth) for l in layers):
            return None
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.block, new.use_kernel = first.in_features, first.block, first.use_kernel
        new.out_features = sum(l.out_features for l in layers)
        new.register_buffer("scale", torch.cat([l.scale for l in layers]))
        new.register_buffer("inv_smooth", first.inv_smooth.clone())
        weights = "packed" if first.use_kernel else "_qweight"
        new.register_buffer(weights, torch.cat([getattr(l, weights) for l in layers]))
        biases = [l.bias for l in layers]
        new.bias = None if all(b is None for b in biases) else nn.Parameter(torch.cat(
            [b if b is not None else torch.zeros(l.out_features) for b, l in zip(biases, layers)]), requires_grad=False)
        return new

    def int8_weight(self) -> torch.Tensor:
        """The int8 weights q [out, in] (padding dropped), from whichever layout this layer keeps."""
        if self.use_kernel:
            p = self.packed  # [out32/16, in/64, 16, 16, 4]
            q = p.permute(0, 3, 1, 2, 4).reshape(p.shape[0] * 16, self.in_features)
        else:
            q = self._qweight
        return q[: self.out_features]

    def dequantized_weight(self) -> torch.Tensor:
        """float32 [out, in]: the weight the int8 values stand for, ``q * scale / s`` (what a reduced
        draft head or a re-quantization starts from)."""
        return self.int8_weight().float() * self.scale[: self.out_features, None] * self.inv_smooth

    def forward(self, x: torch.Tensor, row_exact: bool = False) -> torch.Tensor:
        # x: [rows, in] -> [rows, out]; row-invariant either way, so row_exact needs nothing extra
        x2 = x.reshape(-1, self.in_features).float().contiguous()  # [rows, in]
        if self.use_kernel:
            y = torch.ops.tokenleap.w8a8_linear(x2, self.packed, self.scale, self.inv_smooth, self.block)
        else:
            y = w8a8_reference(x2, self._qweight, self.scale, self.inv_smooth, self.block)
        y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias  # elementwise per row: row-invariant
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        where = "AMX-INT8 tiles" if self.use_kernel else "torch reference"
        return f"in={self.in_features}, out={self.out_features}, block={self.block}, {where}"
