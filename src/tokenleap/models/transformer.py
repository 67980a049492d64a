"""The one decoder of every supported family, in plain PyTorch: RMSNorm, RoPE, grouped-query
attention, gated MLP (SwiGLU or GeGLU). Llama / Qwen2 / Mistral / Phi-3 are the plain layer;
Qwen3 adds per-head q/k norms; Gemma 3 adds pre/post norms around attention and MLP, scaled
embeddings, its own attention scale and local (sliding-window) layers with their own RoPE base.

Parameter names follow Hugging Face (``model.layers.0.self_attn.q_proj.weight`` ...), so weights
load without renaming. ``forward`` takes a flat list of new rows that may belong to several
sequences (``segments``), writes their keys/values into the KV cache at explicit positions and
returns logits for the rows asked for, plus hidden states of any layers asked for.

Batch invariance: with ``row_exact=True`` every row is computed exactly as if it were alone --
linear layers are row-invariant (see ``linear.py``) and attention is evaluated one query row at a
time over that row's own prefix of the cache, the same call a one-token step makes. A sliding
layer's row sees the last ``sliding_window`` positions of its prefix; the compiled fast paths
(``rope_store_attend``, ``kernels.decoder_layer``) take only plain layers and plain attention, so
other layers run the Python code below, which keeps the same one-row-at-a-time rule. Which path a
layer takes is chosen once per state of the modules (``backend.py``, ``Transformer.backend``); a
call checks only its own rows and cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenleap import kernels
from tokenleap.cache.contiguous import KVCache
from tokenleap.config import ModelConfig
from tokenleap.models import changes
from tokenleap.models.backend import (Backend, ModelBackend, choose_backend, rows_fit_compiled_attention,
                                      rows_fit_fused_layer)
from tokenleap.models.changes import TracksChanges
from tokenleap.models.linear import Linear
from tokenleap.models.norms import RMSNorm
from tokenleap.models.rope import Rotary, rotaries
from tokenleap.models.tree_attention import tree_attention


@dataclass(frozen=True)
class Segment:
    """Rows ``[row_start, row_start + length)`` of a forward belong to cache ``slot`` and sit at
    positions ``pos_start .. pos_start + length - 1`` of that sequence."""

    slot: int
    pos_start: int
    length: int
    row_start: int = 0
    # a token tree (spec/tree.py) whose root sits at pos_start: row r is node tree_first + r, stored
    # at pos_start + tree_first + r, at position pos_start + depth[node], seeing the committed cache
    # and its ancestors only (tree_attention.py; ancestors before tree_first are in the cache already)
    tree: Any = None
    tree_first: int = 0

    @property
    def end(self) -> int:
        """One past the cache index of the segment's last row."""
        return self.pos_start + self.tree_first + self.length

    @property
    def tree_ints(self) -> list[int]:
        """The compiled kernels' form of the tree: [first, parents of every node] (empty: a chain)."""
        return [self.tree_first, *self.tree.parent_list] if self.tree is not None else []


def windowed_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos0: int, scale: float,
                       window: int, row_exact: bool) -> torch.Tensor:
    """Causal attention of rows at positions pos0 .. pos0+T-1 over the keys before them, each row
    seeing only its last ``window`` positions (itself included) -- transformers' sliding-window mask.

    q: [T, heads, hd]; keys, values: [n_kv, pos0 + T, hd] -> [T, heads, hd]. With ``row_exact`` (or one
    row) each row is its own call of the same shapes, so its values do not depend on the block."""
    T, heads, hd = q.shape
    n_kv = keys.shape[0]
    group = heads // n_kv

    def rows(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        qh = qs.reshape(qs.shape[0], n_kv, group, hd).permute(1, 2, 0, 3)  # [n_kv, group, t, hd]
        scores = torch.matmul(qh, ks.unsqueeze(1).transpose(-1, -2)) * scale  # [n_kv, group, t, n]
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(qs.dtype)
        out = torch.matmul(probs, vs.unsqueeze(1))  # [n_kv, group, t, hd]
        return out.permute(2, 0, 1, 3).reshape(qs.shape[0], heads, hd)

    if row_exact or T == 1:
        outs = []
        for t in range(T):
            n = pos0 + t + 1
            lo = max(0, n - window)
            outs.append(rows(q[t : t + 1], keys[:, lo:n], values[:, lo:n], None))
        return torch.cat(outs)
    end = pos0 + T
    qpos = torch.arange(pos0, end).unsqueeze(1)  # [T, 1]
    kpos = torch.arange(end).unsqueeze(0)  # [1, end]
    mask = (kpos <= qpos) & (kpos > qpos - window)
    return rows(q, keys, values, mask)  # mask [T, end] broadcasts over [n_kv, group]


class Attention(TracksChanges):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.hd, bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv * self.hd, bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv * self.hd, bias)
        self.o_proj = Linear(self.n_heads * self.hd, cfg.hidden_size, cfg.o_proj_bias)
        self.qkv: nn.Module | None = None
        self.qkv_sizes = (self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd)
        offset = 1.0 if cfg.gemma_style else 0.0
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps, offset) if cfg.qk_norm else None  # per head
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps, offset) if cfg.qk_norm else None
        self.scale = cfg.attention_scale
        self.default_scale = cfg.query_pre_attn_scalar is None  # softmax scale head_dim ** -0.5
        self.window = cfg.sliding_window if cfg.is_sliding(layer) else None
        self.sliding = cfg.is_sliding(layer)  # uses the local rotary where the model has one
        self.plain = self.window is None  # full causal attention: the compiled attention applies
        self.backend = Backend.PYTHON  # set by the model's choice (Transformer.backend)

    def _qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [rows, heads*hd], k: [rows, n_kv*hd] -> the same shapes, each head RMS-normalised
        if self.q_norm is None:
            return q, k
        rows = q.shape[0]
        q = self.q_norm(q.reshape(rows * self.n_heads, self.hd)).view(rows, -1)
        k = self.k_norm(k.reshape(rows * self.n_kv, self.hd)).view(rows, -1)
        return q, k

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, cache: KVCache,
                segments: list[Segment], row_exact: bool) -> torch.Tensor:
        rows = x.shape[0]  # x: [rows, hidden]
        if self.qkv is not None:  # q, k and v projections fused into one weight (see fuse_projections_)
            q, k, v = self.qkv(x, row_exact).split(self.qkv_sizes, dim=-1)  # [rows, heads*hd], 2x [rows, n_kv*hd]
        else:
            q, k, v = self.q_proj(x, row_exact), self.k_proj(x, row_exact), self.v_proj(x, row_exact)
        q, k = self._qk_norm(q, k)
        # decode / verification on a contiguous float32 cache: one op a sequence (rotate, store, attend)
        if self.backend is Backend.COMPILED_ATTENTION and rows_fit_compiled_attention(rows, row_exact, cache):
            q, k, v = (q.reshape(rows, -1, self.hd), k.reshape(rows, -1, self.hd), v.reshape(rows, -1, self.hd))
            outs = []
            for seg in segments:
                r = slice(seg.row_start, seg.row_start + seg.length)
                ks, vs = cache.slot_stores(self.layer, seg.slot, seg.end)
                if seg.tree is not None:
                    outs.append(kernels.rope_store_attend_tree(q[r], k[r], v[r], rotary.cos, rotary.sin, ks, vs,
                                                               seg.pos_start, seg.tree_ints, self.scale))
                else:
                    outs.append(kernels.rope_store_attend(q[r], k[r], v[r], rotary.cos, rotary.sin, ks, vs,
                                                          seg.pos_start, self.scale))  # [len, heads, hd]
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
            cache.write(self.layer, seg.slot, seg.pos_start + seg.tree_first, k[r].transpose(0, 1), v[r].transpose(0, 1))
            if seg.tree is not None:
                out[r] = tree_attention(q[r], cache, self.layer, seg, self._attend_row)
            elif self.plain:
                out[r] = self._attend(q[r], cache, seg, row_exact)
            else:
                keys, values = cache.read(self.layer, seg.slot, seg.pos_start + seg.length)  # [n_kv, end, hd]
                out[r] = windowed_attention(q[r], keys, values, seg.pos_start, self.scale, self.window,
                                            row_exact)
        return self.o_proj(out.view(rows, self.n_heads * self.hd), row_exact)

    def _attend_row(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """One row that sees every key, computed as a one-token decoding step computes it.
        q: [1, heads, hd]; keys, values: [n_kv, L, hd] -> [1, heads, hd]"""
        last = keys.shape[1] - 1
        if self.plain:
            return self._attend_keys(q, keys, values, last, True)
        return windowed_attention(q, keys, values, last, self.scale, self.window, True)

    def _attend(self, q: torch.Tensor, cache: KVCache, seg: Segment, row_exact: bool) -> torch.Tensor:
        # q: [T, heads, hd] -> [T, heads, hd]; query t sees cache positions 0 .. pos_start + t
        keys, values = cache.read(self.layer, seg.slot, seg.pos_start + q.shape[0])  # [n_kv, end, hd]
        return self._attend_keys(q, keys, values, seg.pos_start, row_exact)

    def _attend_keys(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos_start: int,
                     row_exact: bool) -> torch.Tensor:
        # q: [T, heads, hd]; keys, values: [n_kv, pos_start + T, hd]; query t sees keys 0 .. pos_start + t
        T, group = q.shape[0], self.n_heads // self.n_kv
        end = pos_start + T
        scale = None if self.default_scale else self.scale  # SDPA's own default is head_dim ** -0.5
        if (row_exact or T == 1) and self.backend is Backend.COMPILED_ATTENTION:
            return kernels.attend_rows(q, keys, values, pos_start, self.scale)  # each row on its own
        if row_exact or T == 1:
            outs = []
            for t in range(T):  # each row exactly as a one-token step computes it
                qt = q[t].view(1, self.n_kv, group, self.hd)  # [1, n_kv, group, hd]
                n = pos_start + t + 1
                o = F.scaled_dot_product_attention(qt, keys[None, :, :n], values[None, :, :n], scale=scale)
                outs.append(o.reshape(-1, self.hd))  # [heads, hd]
            return torch.stack(outs)
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, T, hd]
        mask = torch.ones(T, end, dtype=torch.bool, device=q.device).tril(pos_start)  # [T, end]
        o = F.scaled_dot_product_attention(qh, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask,
                                           enable_gqa=True, scale=scale)  # [1, heads, T, hd]
        return o[0].transpose(0, 1)


class MLP(TracksChanges):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)
        self.gate_up: nn.Module | None = None  # gate and up fused into one weight (see fuse_projections_)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"  # GeGLU (Gemma) instead of SwiGLU

    def forward(self, x: torch.Tensor, row_exact: bool) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x, row_exact).chunk(2, dim=-1)  # 2x [rows, intermediate] (views)
        else:
            gate, up = self.gate_proj(x, row_exact), self.up_proj(x, row_exact)
        if self.gelu:
            return self.down_proj(F.gelu(gate, approximate="tanh") * up, row_exact)
        if gate.dtype == torch.float32 and gate.shape[-1] % 8 == 0 and kernels.available():
            return self.down_proj(kernels.silu_mul(gate, up), row_exact)  # one fused pass
        return self.down_proj(F.silu(gate) * up, row_exact)


class Block(TracksChanges):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        offset = 1.0 if cfg.gemma_style else 0.0
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        self.mlp = MLP(cfg)
        self.sandwich = cfg.gemma_style  # Gemma: norms after attention and MLP too
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        # the compiled one-call layer (fused_layer) implements exactly the plain Llama layer
        self.plain = not (self.sandwich or cfg.qk_norm or self.mlp.gelu or not self.self_attn.plain
                          or not self.self_attn.default_scale)

    def forward(self, x, positions, rotary, cache, segments, row_exact):
        if self.sandwich:
            h = self.self_attn(self.input_layernorm(x), positions, rotary, cache, segments, row_exact)
            x = x + self.post_attention_layernorm(h)
            h = self.mlp(self.pre_feedforward_layernorm(x), row_exact)
            return x + self.post_feedforward_layernorm(h)
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, cache, segments, row_exact)
        return x + self.mlp(self.post_attention_layernorm(x), row_exact)


class Decoder(TracksChanges):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, 1.0 if cfg.gemma_style else 0.0)


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [len(logit_rows), vocab] in float32
    hidden: dict[int, torch.Tensor]  # layer index -> [rows, hidden]; -1 is the final normed state


class Transformer(TracksChanges):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.init_rotary()
        self.use_fused_layers = True
        # a draft fed a target's ids, whose embedding matrix has more rows than this one's (a padded
        # vocabulary, one tokenizer): an id past this table reads this id's row instead (None: none may)
        self.stand_in_id: int | None = None

    @property
    def use_fused_layers(self) -> bool:
        """Whether layers that can run on the fused layer kernel do (``backend.py``); False keeps the
        Python layers, which tests compare the kernel with."""
        return self.__dict__["_use_fused_layers"]

    @use_fused_layers.setter
    def use_fused_layers(self, on: bool) -> None:
        if self.__dict__.get("_use_fused_layers") != bool(on):
            self.__dict__["_use_fused_layers"] = bool(on)
            changes.modules_changed()

    @property
    def backend(self) -> ModelBackend:
        """How each layer runs decode / verification rows (``backend.py``): chosen at the first use
        and again after any change to the modules (quantization, joined projections, a dtype change,
        ``use_fused_layers``), so a forward never runs on a choice made for other modules."""
        chosen = self.__dict__.get("_backend")
        now = changes.generation()
        if chosen is None or chosen.generation != now:
            chosen = choose_backend(self, now)
            for block, kind in zip(self.model.layers, chosen.attention):
                block.self_attn.backend = kind
            self.__dict__["_backend"] = chosen
        return chosen

    def init_rotary(self) -> None:
        """(Re)build the cos / sin tables (after construction on the meta device)."""
        self.rotary, self.rotary_local = rotaries(self.config)

    def rotary_of(self, block: nn.Module) -> Rotary:
        """Gemma's sliding layers rotate with their own base frequency; every other layer with the global."""
        return self.rotary_local if block.self_attn.sliding and self.rotary_local is not None else self.rotary

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[rows] ids -> [rows, hidden] in the model dtype; Gemma scales by sqrt(hidden) in the table's
        dtype first, as transformers does."""
        if self.stand_in_id is not None:
            tokens = torch.where(tokens < self.config.vocab_size, tokens, self.stand_in_id)  # [rows]
        x = self.model.embed_tokens(tokens)  # [rows, hidden]
        if self.config.gemma_style:
            x = x * torch.tensor(self.config.hidden_size ** 0.5).to(x.dtype)
        return x.to(self.dtype)  # bf16 tables may feed float32 layers

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, segments: list[Segment], cache: KVCache,
                logit_rows: torch.Tensor | None = None, row_exact: bool = False,
                hidden_layers: tuple[int, ...] = (), num_layers: int | None = None,
                head=None, skip: frozenset[int] = frozenset()) -> ForwardOutput:
        """Run new rows through the model and update ``cache``.

        tokens: [rows] token ids; segments place consecutive row ranges in cache slots.
        logit_rows: [n] indices of rows whose logits are wanted (None: all rows).
        num_layers: stop after this many layers (early exit for self-speculation).
        head: replaces ``lm_head`` (e.g. a draft's reduced-vocabulary head); called as head(x, row_exact).
        skip: layer indices not run (layer-skip self-speculation: a skipped layer passes the hidden
        state through and writes nothing into ``cache``).
        """
        positions = torch.cat([s.tree.positions(s.pos_start)[s.tree_first:s.tree_first + s.length] if s.tree is not None
                               else torch.arange(s.pos_start, s.pos_start + s.length) for s in segments])
        x = self.embed(tokens)  # [rows, hidden]
        hidden: dict[int, torch.Tensor] = {}
        n = num_layers or len(self.model.layers)
        # (not layers[:n]: slicing a ModuleList builds a new one, registering every layer, each forward)
        layers = [b for i, b in enumerate(self.model.layers) if i < n and i not in skip]
        plans = None
        backend = self.backend  # also sets each Attention's own path
        if rows_fit_fused_layer(x.shape[0], row_exact, cache):
            plans = backend.fused_plans(None if len(layers) == len(self.model.layers) else
                                        [b.self_attn.layer for b in layers])
        if plans:
            seg_ints = [v for s in segments for v in (s.slot, s.pos_start, s.length, s.row_start)]
            tables = cache.prepare_rows([(s.slot, s.end) for s in segments])
            trees = [v for s in segments for v in (len(s.tree_ints), *s.tree_ints)]
            if not any(s.tree is not None for s in segments):
                trees = []  # chains only: the plain layer call
        for i, block in enumerate(layers):
            if plans:  # the whole layer in one compiled call, bitwise the same as block(...)
                p, li = plans[i], block.self_attn.layer
                if trees:
                    x = kernels.decoder_layer_trees(x, p.weights, p.ints, self.rotary.cos, self.rotary.sin,
                                                    cache.k[li], cache.v[li], seg_ints, tables, trees, p.eps, p.scale)
                else:
                    x = kernels.decoder_layer(x, p.weights, p.ints, self.rotary.cos, self.rotary.sin, cache.k[li],
                                              cache.v[li], seg_ints, tables, p.eps, p.scale)
            else:
                x = block(x, positions, self.rotary_of(block), cache, segments, row_exact)
            if block.self_attn.layer in hidden_layers:
                hidden[block.self_attn.layer] = x
        for s in segments:
            cache.commit(s.slot, s.end)
        sel = x if logit_rows is None else x[logit_rows]
        normed = self.model.norm(sel)
        hidden[-1] = normed
        logits = (head or self.lm_head)(normed, row_exact).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return ForwardOutput(logits=logits, hidden=hidden)
