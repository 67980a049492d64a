"""Llama / Qwen2 decoder in plain PyTorch (RMSNorm, RoPE, grouped-query attention, SwiGLU).

Parameter names follow Hugging Face (``model.layers.0.self_attn.q_proj.weight`` ...), so weights
load without renaming. ``forward`` takes a flat list of new rows that may belong to several
sequences (``segments``), writes their keys/values into the KV cache at explicit positions and
returns logits for the rows asked for, plus hidden states of any layers asked for.

Batch invariance: with ``row_exact=True`` every row is computed exactly as if it were alone --
linear layers are row-invariant (see ``linear.py``) and attention is evaluated one query row at a
time over that row's own prefix of the cache, the same call a one-token step makes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..cache import KVCache
from ..config import ModelConfig
from .fused_layer import LayerPlan, layer_plan
from .linear import Linear


@dataclass(frozen=True)
class Segment:
    """Rows ``[row_start, row_start + length)`` of a forward belong to cache ``slot`` and sit at
    positions ``pos_start .. pos_start + length - 1`` of that sequence."""

    slot: int
    pos_start: int
    length: int
    row_start: int = 0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, dim]; normalise in fp32 like the reference implementations
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and kernels.available():
            return kernels.rms_norm(x, self.weight, self.eps)  # one fused op (sum of squares in fp64)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding, half-split layout (Hugging Face's ``rotate_half``)."""

    def __init__(self, head_dim: int, theta: float, max_pos: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)  # [max_pos, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_pos, hd]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [rows, heads, hd]; positions: [rows]
        if x.dtype == torch.float32 and kernels.available():
            return kernels.rope_(x.contiguous(), self.cos, self.sin, positions)  # fused, in place
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)  # [rows, 1, hd]
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.hd, bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv * self.hd, bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv * self.hd, bias)
        self.o_proj = Linear(self.n_heads * self.hd, cfg.hidden_size, False)
        self.qkv: nn.Module | None = None
        self.qkv_sizes = (self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, cache: KVCache,
                segments: list[Segment], row_exact: bool) -> torch.Tensor:
        rows = x.shape[0]  # x: [rows, hidden]
        if self.qkv is not None:  # q, k and v projections fused into one weight (see fuse_projections_)
            q, k, v = self.qkv(x, row_exact).split(self.qkv_sizes, dim=-1)  # [rows, heads*hd], 2x [rows, n_kv*hd]
        else:
            q, k, v = self.q_proj(x, row_exact), self.k_proj(x, row_exact), self.v_proj(x, row_exact)
        # decode / verification on a contiguous float32 cache: one op a sequence (rotate, store, attend)
        if (row_exact or rows == 1) and x.dtype == torch.float32 and hasattr(cache, "slot_stores") \
                and cache.k[self.layer].dtype == torch.float32 and kernels.available():
            q, k, v = (q.view(rows, -1, self.hd), k.view(rows, -1, self.hd), v.view(rows, -1, self.hd))
            outs = []
            for seg in segments:
                r = slice(seg.row_start, seg.row_start + seg.length)
                ks, vs = cache.slot_stores(self.layer, seg.slot, seg.pos_start + seg.length)
                outs.append(kernels.rope_store_attend(q[r], k[r], v[r], rotary.cos, rotary.sin, ks, vs,
                                                      seg.pos_start, self.hd ** -0.5))  # [len, heads, hd]
            if len(outs) == 1:
                return self.o_proj(outs[0].view(rows, self.n_heads * self.hd), row_exact)
            out = torch.empty(rows, self.n_heads, self.hd)
            for seg, o in zip(segments, outs):
                out[seg.row_start : seg.row_start + seg.length] = o
            return self.o_proj(out.view(rows, self.n_heads * self.hd), row_exact)
        q = rotary(q.reshape(rows, self.n_heads, self.hd), positions)
        k = rotary(k.reshape(rows, self.n_kv, self.hd), positions)
        v = v.reshape(rows, self.n_kv, self.hd)
        out = torch.empty_like(q)  # [rows, heads, hd]
        for seg in segments:
            r = slice(seg.row_start, seg.row_start + seg.length)
            cache.write(self.layer, seg.slot, seg.pos_start, k[r].transpose(0, 1), v[r].transpose(0, 1))
            out[r] = self._attend(q[r], cache, seg, row_exact)
        return self.o_proj(out.view(rows, self.n_heads * self.hd), row_exact)

    def _attend(self, q: torch.Tensor, cache: KVCache, seg: Segment, row_exact: bool) -> torch.Tensor:
        # q: [T, heads, hd] -> [T, heads, hd]; query t sees cache positions 0 .. pos_start + t
        T, group = q.shape[0], self.n_heads // self.n_kv
        end = seg.pos_start + T
        keys, values = cache.read(self.layer, seg.slot, end)  # [n_kv, end, hd]
        if (row_exact or T == 1) and q.dtype == torch.float32 and kernels.available():
            return kernels.attend_rows(q, keys, values, seg.pos_start, self.hd ** -0.5)  # each row on its own
        if row_exact or T == 1:
            outs = []
            for t in range(T):  # each row exactly as a one-token step computes it
                qt = q[t].view(1, self.n_kv, group, self.hd)  # [1, n_kv, group, hd]
                n = seg.pos_start + t + 1
                o = F.scaled_dot_product_attention(qt, keys[None, :, :n], values[None, :, :n])
                outs.append(o.reshape(-1, self.hd))  # [heads, hd]
            return torch.stack(outs)
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, T, hd]
        mask = torch.ones(T, end, dtype=torch.bool, device=q.device).tril(seg.pos_start)  # [T, end]
        o = F.scaled_dot_product_attention(qh, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask,
                                           enable_gqa=True)  # [1, heads, T, hd]
        return o[0].transpose(0, 1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.gate_up: nn.Module | None = None  # gate and up fused into one weight (see fuse_projections_)

    def forward(self, x: torch.Tensor, row_exact: bool) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x, row_exact).chunk(2, dim=-1)  # 2x [rows, intermediate] (views)
        else:
            gate, up = self.gate_proj(x, row_exact), self.up_proj(x, row_exact)
        if gate.dtype == torch.float32 and gate.shape[-1] % 8 == 0 and kernels.available():
            return self.down_proj(kernels.silu_mul(gate, up), row_exact)  # one fused pass
        return self.down_proj(F.silu(gate) * up, row_exact)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, rotary, cache, segments, row_exact):
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, cache, segments, row_exact)
        return x + self.mlp(self.post_attention_layernorm(x), row_exact)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [len(logit_rows), vocab] in float32
    hidden: dict[int, torch.Tensor]  # layer index -> [rows, hidden]; -1 is the final normed state


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        self.use_fused_layers = True  # see _fused_plans; False forces the Python layers (tests compare)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, segments: list[Segment], cache: KVCache,
                logit_rows: torch.Tensor | None = None, row_exact: bool = False,
                hidden_layers: tuple[int, ...] = (), num_layers: int | None = None,
                head=None) -> ForwardOutput:
        """Run new rows through the model and update ``cache``.

        tokens: [rows] token ids; segments place consecutive row ranges in cache slots.
        logit_rows: [n] indices of rows whose logits are wanted (None: all rows).
        num_layers: stop after this many layers (early exit for self-speculation).
        head: replaces ``lm_head`` (e.g. a draft's reduced-vocabulary head); called as head(x, row_exact).
        """
        positions = torch.cat([torch.arange(s.pos_start, s.pos_start + s.length) for s in segments])
        x = self.model.embed_tokens(tokens).to(self.dtype)  # [rows, hidden]; bf16 tables may feed float32 layers
        hidden: dict[int, torch.Tensor] = {}
        layers = self.model.layers[: num_layers or len(self.model.layers)]
        plans = self._fused_plans(layers, x, cache, row_exact)
        if plans:
            seg_ints = [v for s in segments for v in (s.slot, s.pos_start, s.length, s.row_start)]
            tables = cache.prepare_rows([(s.slot, s.pos_start + s.length) for s in segments])
        for i, block in enumerate(layers):
            if plans:  # the whole layer in one compiled call, bitwise the same as block(...)
                p, li = plans[i], block.self_attn.layer
                x = kernels.decoder_layer(x, p.weights, p.ints, self.rotary.cos, self.rotary.sin, cache.k[li],
                                          cache.v[li], seg_ints, tables, p.eps, p.scale)
            else:
                x = block(x, positions, self.rotary, cache, segments, row_exact)
            if i in hidden_layers:
                hidden[i] = x
        for s in segments:
            cache.commit(s.slot, s.pos_start + s.length)
        sel = x if logit_rows is None else x[logit_rows]
        normed = self.model.norm(sel)
        hidden[-1] = normed
        logits = (head or self.lm_head)(normed, row_exact).float()
        return ForwardOutput(logits=logits, hidden=hidden)

    def _fused_plans(self, layers, x: torch.Tensor, cache, row_exact: bool) -> list[LayerPlan] | None:
        """Plans for running every layer on ``kernels.decoder_layer``, or None: only for the rows of a
        decode / verification step (row-exact or one row), float32, on a float32 cache (contiguous
        or paged), with every product on tokenleap's int4 / int6 / int8 kernels."""
        if not (self.use_fused_layers and (row_exact or x.shape[0] == 1) and x.dtype == torch.float32
                and hasattr(cache, "prepare_rows") and cache.k[0].dtype == torch.float32 and kernels.available()):
            return None
        plans = [layer_plan(b) for b in layers]
        return None if any(p is None for p in plans) else plans
