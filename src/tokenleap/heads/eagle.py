"""A trained feature-level draft head (EAGLE-style): one decoder layer that runs beside the target.

The target's final hidden state at position t (after its final norm: the vector its LM head turns
into the distribution of token t + 1) is the *feature* f_t. The head reads f_t together with the
embedding of the token x_{t+1} that followed, and predicts f_{t+1}; the target's own LM head (over a
subset of the vocabulary, frozen) turns that prediction into a draft of token x_{t+2}. Drafting
further feeds the head its own predicted features (Li et al., 2024, "EAGLE"). A draft token costs
one small layer and the subset head -- a few percent of a target step -- where a separate draft
model costs a third of one.

Layout of the layer (pre-norm, as the target's): fc: [2H -> H] on concat(f_t, emb(x_{t+1})), then
attention (the target's head counts and RoPE base) and a SiLU-gated MLP, each behind an RMSNorm and
added to its input, then a final RMSNorm. The same function computes the layer for training (whole
sequences, causal) and for drafting (a few rows against a per-sequence cache of keys and values).

The head file is a safetensors file; its metadata holds the ``EagleConfig`` as JSON.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tokenleap.errors import ConfigError
from tokenleap.models.cache_files import remove_abandoned, written_aside

_META_KEY = "tokenleap_eagle"
LINEARS = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NORMS = ("input_norm", "post_attention_norm", "final_norm")


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_eps: float
    vocab_size: int  # the target's vocabulary (a head fits one tokenizer)
    subset: int  # the head drafts among the first ``subset`` token ids, the specials and the prompt's
    target: str = ""  # the target model it was trained beside (a note; the shapes are what is checked)

    def __post_init__(self) -> None:
        sizes = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size", "subset")
        bad = [f"{n} {getattr(self, n)!r}" for n in sizes
               if not isinstance(getattr(self, n), int) or isinstance(getattr(self, n), bool) or getattr(self, n) < 1]
        if bad:
            raise ConfigError(f"a draft head's shape needs positive integers; this one has {', '.join(bad)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"a draft head's {self.num_heads} attention heads do not share its "
                              f"{self.num_kv_heads} key-value heads evenly")
        for n in ("rope_theta", "rms_eps"):
            value = getattr(self, n)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise ConfigError(f"a draft head's {n} must be a positive number, got {value!r}")

    @classmethod
    def for_target(cls, cfg, intermediate_size: int | None = None, subset: int = 32768,
                   target: str = "") -> "EagleConfig":
        """The head's shape for a target ``ModelConfig``: its attention shape and RoPE base, an MLP of
        ``intermediate_size`` (default: half the target's, a multiple of 64)."""
        inter = intermediate_size or max(64, cfg.intermediate_size // 2 // 64 * 64)
        return cls(hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                   num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, intermediate_size=inter,
                   rope_theta=float(cfg.rope_theta), rms_eps=float(cfg.rms_norm_eps),
                   vocab_size=cfg.vocab_size, subset=min(subset, cfg.vocab_size), target=target)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Each projection's (in, out) features."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"fc": (2 * h, h), "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a head file of this shape stores, by name."""
        shapes: dict[str, tuple[int, ...]] = {f"{n}.weight": (b, a) for n, (a, b) in self.linear_shapes().items()}
        shapes["fc.bias"] = (self.hidden_size,)
        shapes.update({f"{n}.weight": (self.hidden_size,) for n in NORMS})
        return shapes

    def check_target(self, cfg) -> None:
        """A ConfigError unless the head fits the target ``ModelConfig`` (width, vocabulary)."""
        if cfg.hidden_size != self.hidden_size or cfg.vocab_size != self.vocab_size:
            raise ConfigError(
                f"this draft head was trained for a model of hidden size {self.hidden_size} and "
                f"{self.vocab_size} tokens ({self.target or 'unnamed'}); the target has "
                f"{cfg.hidden_size} and {cfg.vocab_size}")


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding in the half-split layout: x [rows, heads, hd], positions [rows]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)  # [hd/2]
    ang = positions.float()[:, None] * inv[None, :]  # [rows, hd/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :].to(x.dtype)  # [rows, 1, hd]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :].to(x.dtype)
    half = hd // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


# attend(q [rows, heads, hd], k [rows, kv, hd], v [rows, kv, hd]) -> [rows, heads * hd]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def layer(cfg: EagleConfig, lin: Callable[[str, torch.Tensor], torch.Tensor], norm: Callable[[str], torch.Tensor],
          feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
    """The head's layer on ``rows`` positions: feats and embeds [rows, H] (f_t and emb(x_{t+1})),
    positions [rows] (t); returns the predicted features f_{t+1} [rows, H]. ``lin(name, x)`` applies
    a named linear map, ``norm(name)`` gives a norm's weight, ``attend`` the attention over the
    sequence so far (training: causal within the rows; drafting: a cache)."""
    rows = feats.shape[0]
    h = lin("fc", torch.cat([feats, embeds], -1))  # [rows, H]
    x = rms_norm(h, norm("input_norm"), cfg.rms_eps)
    q = rope(lin("q_proj", x).view(rows, cfg.num_heads, cfg.head_dim), positions, cfg.rope_theta)
    k = rope(lin("k_proj", x).view(rows, cfg.num_kv_heads, cfg.head_dim), positions, cfg.rope_theta)
    v = lin("v_proj", x).view(rows, cfg.num_kv_heads, cfg.head_dim)
    h = h + lin("o_proj", attend(q, k, v))
    x = rms_norm(h, norm("post_attention_norm"), cfg.rms_eps)
    h = h + lin("down_proj", F.silu(lin("gate_proj", x)) * lin("up_proj", x))
    return rms_norm(h, norm("final_norm"), cfg.rms_eps)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first: int) -> torch.Tensor:
    """Attention of q [rows, heads, hd] at positions first .. first + rows - 1 over keys / values
    [first + rows, kv, hd] (positions 0 ..), each row seeing itself and what precedes it."""
    rows = q.shape[0]
    mask = None
    if rows > 1:
        mask = torch.arange(keys.shape[0])[None, :] <= (first + torch.arange(rows))[:, None]  # [rows, n]
    return masked_attention(q, keys, values, mask)


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     mask: torch.Tensor | None) -> torch.Tensor:
    """q [rows, heads, hd] over keys / values [n, kv, hd] where ``mask`` [rows, n] (None: all) allows;
    returns [rows, heads * hd]."""
    rows, heads, hd = q.shape
    group = heads // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, n, hd]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask)  # [heads, rows, hd]
    return out.transpose(0, 1).reshape(rows, heads * hd)


class EagleHead(nn.Module):
    """The head's weights as float modules, for training and for saving."""

    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.linears = nn.ModuleDict({n: nn.Linear(a, b, bias=(n == "fc"))
                                      for n, (a, b) in cfg.linear_shapes().items()})
        self.norms = nn.ParameterDict({n: nn.Parameter(torch.ones(cfg.hidden_size)) for n in NORMS})

    def forward(self, feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Whole sequences: feats, embeds [T, H] of one sequence, positions [T] -> predictions [T, H]."""
        return self.two_steps(feats, embeds, positions, second=False)[0]

    def two_steps(self, feats: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                  second: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The predictions [T, H] from the given features, and (``second``) the next ones [T - 1, H]
        from the head's own predictions as drafting makes them: row t + 1 reads (f^_{t+1}, emb(x_{t+2}))
        and attends to the given features' pairs up to position t and to itself -- the second draft
        token's situation, trained on directly."""
        saved = {}

        def first(q, k, v):
            saved["k"], saved["v"] = k, v
            return grouped_attention(q, k, v, 0)

        def lin(n, x):
            return self.linears[n](x)

        pred = layer(self.cfg, lin, lambda n: self.norms[n], feats, embeds, positions, first)
        if not second or feats.shape[0] < 2:
            return pred, None
        rows = feats.shape[0] - 1

        def again(q, k, v):
            keys, values = torch.cat([saved["k"], k]), torch.cat([saved["v"], v])  # [T + rows, kv, hd]
            seen = torch.arange(feats.shape[0])[None, :] <= torch.arange(rows)[:, None]  # given pairs up to t
            mask = torch.cat([seen, torch.eye(rows, dtype=torch.bool)], 1)  # [rows, T + rows]
            return masked_attention(q, keys, values, mask)

        return pred, layer(self.cfg, lin, lambda n: self.norms[n], pred[:-1], embeds[1:], positions[1:], again)

    def save(self, path: Path) -> None:
        """Write the head to ``path`` (aside, then renamed into place, with the process's umask: a head
        an admin trains is readable by the server's user); a ConfigError for non-finite weights."""
        from safetensors.torch import save
        tensors = {f"{n}.weight": m.weight.detach().contiguous() for n, m in self.linears.items()}
        tensors["fc.bias"] = self.linears["fc"].bias.detach().contiguous()
        tensors.update({f"{n}.weight": p.detach().contiguous() for n, p in self.norms.items()})
        if not all(bool(torch.isfinite(t).all()) for t in tensors.values()):
            raise ConfigError("the trained head has non-finite weights (training diverged: try a smaller --lr); "
                              "not saved")
        data = save(tensors, metadata={_META_KEY: json.dumps(asdict(self.cfg))})
        remove_abandoned(path.parent, "*.safetensors")  # saves killed part-way
        with written_aside(path) as tmp:
            tmp.write_bytes(data)

    @classmethod
    def load(cls, path: Path, target=None) -> "EagleHead":
        """A head saved by ``save``; a ConfigError for a missing or foreign file, or one that does not fit
        the ``target`` ``ModelConfig`` if given -- every check made before the head's memory is taken (its
        metadata could name any size)."""
        from safetensors import SafetensorError, safe_open
        if not Path(path).is_file():
            raise ConfigError(f"no draft head file at {path} (train one with `tokenleap train-head`)")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = (f.metadata() or {}).get(_META_KEY)
                if meta is None:
                    raise ConfigError(f"{path} is not a tokenleap draft head (no {_META_KEY} metadata)")
                cfg = EagleConfig(**json.loads(meta))
                if target is not None:
                    cfg.check_target(target)
                stored = set(f.keys())
                missing = sorted(set(cfg.tensor_shapes()) - stored)
                if missing:
                    raise ConfigError(f"the draft head {path} is damaged: it lacks {', '.join(missing)}")
                for name, shape in cfg.tensor_shapes().items():
                    if tuple(f.get_slice(name).get_shape()) != shape:
                        raise ConfigError(f"the draft head {path} is damaged: its tensor {name} is "
                                          f"{list(f.get_slice(name).get_shape())}, its metadata says {list(shape)}")
                head = cls(cfg)
                for n, m in head.linears.items():
                    m.weight.data.copy_(f.get_tensor(f"{n}.weight"))
                head.linears["fc"].bias.data.copy_(f.get_tensor("fc.bias"))
                for n, p in head.norms.items():
                    p.data.copy_(f.get_tensor(f"{n}.weight"))
            if not all(bool(torch.isfinite(p).all()) for p in head.parameters()):
                raise ConfigError(f"the draft head {path} has non-finite weights (a diverged training): "
                                  "train it again with a smaller --lr")
        except ConfigError:  # (a ValueError: said once, not wrapped in "cannot read")
            raise
        except (SafetensorError, OSError, KeyError, RuntimeError, TypeError, ValueError) as e:
            raise ConfigError(f"cannot read the draft head {path}: {e}") from e
        return head


def default_head_path(cache_root: Path, model: str) -> Path:
    """Where ``tokenleap train-head`` stores a model's head, and ``--draft-head auto`` looks."""
    return Path(cache_root) / "heads" / Path(str(model)).name / "eagle.safetensors"
