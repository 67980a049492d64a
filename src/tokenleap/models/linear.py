"""Dense linear layer whose rows can be computed batch-invariantly.

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

# dtypes whose F.linear rows were measured bitwise-equal for any number of rows on torch's CPU kernels
ROW_INVARIANT_DTYPES = (torch.bfloat16,)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with parameters named like ``nn.Linear`` (``weight``, ``bias``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, row_exact: bool = False) -> torch.Tensor:
        # x: [rows, in_features] -> [rows, out_features]
        if not row_exact or x.shape[0] == 1 or self.weight.dtype in ROW_INVARIANT_DTYPES:
            return F.linear(x, self.weight, self.bias)
        return torch.cat([F.linear(x[i : i + 1], self.weight, self.bias) for i in range(x.shape[0])])

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"
