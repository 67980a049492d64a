"""Dense linear layer whose rows can be computed batch-invariantly.

bf16 weights use tokenleap's compiled kernel where it is available (row-invariant by construction,
float32 products and sums; see ``tokenleap.kernels``), torch's bf16 ``F.linear`` otherwise.

Losslessness needs a position's logits to be bitwise the same whether that position is computed
alone (plain decoding) or inside a block (verification, batching). On CPU, bf16 ``F.linear`` and the
int8/int4 weight-only kernels are row-invariant; fp32 GEMM is not (MKL picks a different reduction
for different row counts). So in ``row_exact`` mode an fp32 layer computes each row as its own
matrix-vector product -- the very call plain decoding makes -- and a block costs one GEMV per row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenleap import kernels
from tokenleap.models.changes import TracksChanges

# dtypes whose F.linear rows were measured bitwise-equal for any number of rows on torch's CPU kernels
ROW_INVARIANT_DTYPES = (torch.bfloat16,)


class Linear(TracksChanges):
    """``y = x W^T (+ b)`` with parameters named like ``nn.Linear`` (``weight``, ``bias``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, row_exact: bool = False) -> torch.Tensor:
        # x: [rows, in_features] -> [rows, out_features]
        if self.weight.dtype == torch.bfloat16 and self._bf16_kernel():
            return self._bf16_forward(x, row_exact)
        if x.dtype != self.weight.dtype:  # float32 activations, bf16 weights, no kernel: bf16 F.linear
            bias = None if self.bias is None else self.bias.to(self.weight.dtype)
            return F.linear(x.to(self.weight.dtype), self.weight, bias).to(x.dtype)
        if not row_exact or x.shape[0] == 1 or self.weight.dtype in ROW_INVARIANT_DTYPES:
            return F.linear(x, self.weight, self.bias)
        return torch.cat([F.linear(x[i : i + 1], self.weight, self.bias) for i in range(x.shape[0])])

    @classmethod
    def concat(cls, layers: list[nn.Module]) -> "Linear | None":
        """One bf16 layer computing ``layers``' outputs side by side (q | k | v, gate | up), or None.
        Every output of tokenleap's bf16 product is its own chain, so joining changes no value."""
        if not all(isinstance(l, Linear) and l.weight.dtype == torch.bfloat16 for l in layers):
            return None
        if len({l.in_features for l in layers}) != 1:
            return None
        has_bias = any(l.bias is not None for l in layers)
        new = cls(layers[0].in_features, sum(l.out_features for l in layers), bias=has_bias)
        new.weight = nn.Parameter(torch.cat([l.weight for l in layers]), requires_grad=False)
        if has_bias:
            dtype = next(l.bias.dtype for l in layers if l.bias is not None)
            new.bias = nn.Parameter(torch.cat([l.bias if l.bias is not None else torch.zeros(l.out_features, dtype=dtype)
                                               for l in layers]), requires_grad=False)
        return new

    def _bf16_kernel(self) -> bool:
        """tokenleap's bf16 kernel applies (AVX2 machine, sizes multiples of 16); packs the weight
        once into the kernel's layout, for AMX tiles where the CPU has them and the inputs are a
        multiple of 32 (a second copy: the float weight may be shared, e.g. tied)."""
        packed = self.__dict__.get("_packed")
        if packed is None:
            ok = self.out_features % 16 == 0 and self.in_features % 16 == 0 and kernels.available()
            w = self.weight.detach()
            if ok and self.in_features % 32 == 0 and kernels.amx_available():
                packed = kernels.pack_bf16_amx(w)  # [out/16, in/32, 16, 16, 2]
            else:
                packed = kernels.pack_bf16(w) if ok else False  # [out/8, in/16, 8, 16]
            self.__dict__["_packed"] = packed
        return packed is not False

    def release_float_weight(self) -> bool:
        """Drop the bf16 weight once the kernel's packed copy holds it (every product then reads
        the packed copy), halving the layer's memory; True if released. The caller keeps weights
        other modules read (a tied LM head's is the embedding: ``build.pack_bf16_weights_``)."""
        packed = self.__dict__.get("_packed")
        if not isinstance(packed, torch.Tensor) or self.weight.numel() == 0:
            return False
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)
        return True

    def _bf16_forward(self, x: torch.Tensor, row_exact: bool) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).float()  # [rows, in]
        y = kernels.weight_product(x2, self.__dict__["_packed"], None, row_exact)  # [rows, out]
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"
