"""Operands for the compiled ``decoder_layer`` kernel: a whole decoder layer in one call.

A decode step of a small model spends a large share of its time in Python -- module calls, a dozen
small ops a layer -- rather than in the products (about a third of a 0.5B draft's step). When a
layer's products all run on tokenleap's int4 / int6 / int8 / bf16 / W8A8 kernels and the model and its KV cache
(contiguous or paged) are float32, ``Transformer.forward`` hands each layer to ``kernels.decoder_layer``
instead: the same kernels in the same order, so the result is bitwise the Python layer's.
Plans are built when the model chooses its backend (``backend.py``), again after any change to its
modules, so a plan never holds a replaced layer's tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenleap import kernels
from tokenleap.models.int6 import Int6Linear
from tokenleap.models.linear import Linear
from tokenleap.models.qlinear import Int4Linear, Int8Linear
from tokenleap.models.w8a8 import W8A8Linear

_INT4, _INT6, _INT8, _BF16, _W8A8 = 4, 6, 8, 16, 88


@dataclass(frozen=True)
class LayerPlan:
    weights: tuple[torch.Tensor | None, ...]  # norms, then (packed, scales, bias) per product
    ints: tuple[int, ...]  # heads, kv heads, head dim, #attention inputs, #MLP inputs, (kind, out, param) per product
    eps: float
    scale: float  # the attention's softmax scale


def _product(lin: nn.Module | None) -> tuple[list, list[int]] | None:
    """(tensors, ints) of one weight product the kernel can run, or None."""
    bias = getattr(lin, "bias", None)
    if bias is not None and bias.dtype != torch.float32:
        return None
    if isinstance(lin, Int4Linear) and lin.use_kernel:
        return [lin.packed, lin.scales_and_mins, bias], [_INT4, lin.out_features, 0]
    if isinstance(lin, Int6Linear):
        return [lin.packed, lin.d, bias], [_INT6, lin.out_features, 0]
    if isinstance(lin, Int8Linear) and lin.use_kernel:
        return [lin.packed, lin.scales, bias], [_INT8, lin.out_features, 0]
    if isinstance(lin, W8A8Linear) and lin.use_kernel:
        # the kernel reads the per-output scales, then the inverse smoothing, from one tensor
        return [lin.packed, torch.cat([lin.scale, lin.inv_smooth]), bias], [_W8A8, lin.out_features, lin.block]
    if isinstance(lin, Linear) and lin.weight.dtype == torch.bfloat16 and lin._bf16_kernel():
        return [lin.__dict__["_packed"], kernels.unit_scale(lin.out_features), bias], [_BF16, lin.out_features, 0]
    return None


def _modules(block: nn.Module) -> list:
    attn, mlp = block.self_attn, block.mlp
    attn_in = [attn.qkv] if attn.qkv is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
    mlp_in = [mlp.gate_up] if mlp.gate_up is not None else [mlp.gate_proj, mlp.up_proj]
    return [attn_in, attn.o_proj, mlp_in, mlp.down_proj, block.input_layernorm, block.post_attention_layernorm]


def layer_plan(block: nn.Module) -> LayerPlan | None:
    """The kernel's operands for ``block`` (a ``transformer.Block``), or None when it cannot run it:
    the kernel computes the plain Llama layer only (``Block.plain``: no q/k norms, no pre/post norms,
    SwiGLU, full causal attention at scale head_dim ** -0.5)."""
    if not getattr(block, "plain", True):
        return None
    return _build(block, *_modules(block))


def _build(block, attn_in, o_proj, mlp_in, down, norm1, norm2) -> LayerPlan | None:
    attn = block.self_attn
    if norm1.weight.dtype != torch.float32 or norm2.weight.dtype != torch.float32 or norm1.eps != norm2.eps:
        return None
    products = [_product(m) for m in [*attn_in, o_proj, *mlp_in, down]]
    if any(p is None for p in products):
        return None
    if sum(m.out_features for m in mlp_in) % 16:  # SiLU * up runs 8 lanes at a time on each half
        return None
    weights: list[torch.Tensor | None] = [norm1.weight, norm2.weight]
    ints = [attn.n_heads, attn.n_kv, attn.hd, len(attn_in), len(mlp_in)]
    for tensors, kind_out in products:
        weights += tensors
        ints += kind_out
    return LayerPlan(tuple(weights), tuple(ints), float(norm1.eps), attn.hd ** -0.5)


def products_ignore_row_exact(plan: LayerPlan) -> bool:
    """Whether every product of ``plan`` runs one kernel whatever the rows (int4, int6, W8A8): then a
    prefill window computed row-exact costs what the window's own path costs. int8 and bf16 weights
    have a faster blocked GEMM for a window's many rows, which a row-exact call gives up."""
    kinds = plan.ints[5::3]  # (kind, out, param) per product after the five shape ints
    return all(kind in (_INT4, _INT6, _W8A8) for kind in kinds)


__all__ = ["LayerPlan", "layer_plan", "products_ignore_row_exact"]
