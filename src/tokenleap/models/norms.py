"""RMSNorm, with Gemma's form: ``x / rms(x) * (1 + weight)`` where the weight is stored as an
offset from one (Hugging Face Gemma checkpoints; ``offset=1``)."""
from __future__ import annotations

import torch
from torch import nn

from tokenleap import kernels
from tokenleap.models.changes import TracksChanges


class RMSNorm(TracksChanges):
    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset  # 1.0 for Gemma: the multiplier is 1 + weight, formed in float32
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def scale(self) -> torch.Tensor:
        """The float32 multiplier ``offset + weight`` (``weight`` itself without an offset), cached
        per weight tensor so a replaced or re-typed weight is picked up."""
        if not self.offset:
            return self.weight
        key = (self.weight.data_ptr(), self.weight.dtype, self.weight.device)
        cached = self.__dict__.get("_scale")
        if cached is None or cached[0] != key:
            cached = (key, self.weight.float() + self.offset)  # [dim]
            self.__dict__["_scale"] = cached
        return cached[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, dim]; normalise in fp32 like the reference implementations
        w = self.scale()
        if x.dtype == torch.float32 and w.dtype == torch.float32 and kernels.available():
            return kernels.rms_norm(x.contiguous(), w, self.eps)  # one fused op (sum of squares in fp64)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma: scale in float32, then round once to the input dtype
            return (xf * w).to(x.dtype)
        return self.weight * xf.to(x.dtype)
