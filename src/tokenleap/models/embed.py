"""Embeddings of texts from a decoder model's final hidden states, as llama.cpp serves them with
``--embeddings`` and vLLM's pooling runner does for decoder-only models: the final norm's output at
the prompt's last token (pooling "last", vLLM's default for such models), averaged over its tokens
("mean"), at its first token ("cls", llama.cpp's name), or one vector per token ("none": a matrix
[tokens, hidden]), L2-normalized (each row). A generative model's embeddings are a by-product, not a
retrieval model's.

Each text runs through the model alone in a cache of its own, in prefill windows (``embed_windows``
yields after each, for a caller that interleaves other work); the logits are not computed (the head
is replaced by an empty one).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from tokenleap.cache.contiguous import KVCache
from tokenleap.models.transformer import Segment, Transformer

POOLINGS = ("last", "mean", "cls", "none")


def _no_logits(x: torch.Tensor, row_exact: bool) -> torch.Tensor:  # [rows, hidden] -> [rows, 0]
    return x[:, :0]


def embed_windows(model: Transformer, ids: list[int], pooling: str = "last", normalize: bool = True,
                  chunk: int = 256) -> Iterator[torch.Tensor | None]:
    """The embedding of ``ids`` (non-empty) one prefill window at a time: None after each window but
    the last, then the float32 vector [hidden] (pooling "none": [len(ids), hidden]) -- so a caller
    can interleave other work between the windows of a long input (the server's scheduler does)."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    if not ids:
        raise ValueError("cannot embed an empty token list")
    n = 1 if pooling == "cls" else len(ids)  # (a causal model's first hidden state sees only the first token)
    cache = KVCache(model.config, 1, n, model.dtype)
    slot = cache.allocate()
    tokens = torch.tensor(ids[:n])
    total = torch.zeros(model.config.hidden_size, dtype=torch.float64)
    rows_out = []
    for start in range(0, n, chunk):
        rows = min(chunk, n - start)
        want = None if pooling in ("mean", "none") else torch.tensor([rows - 1])
        h = model(tokens[start:start + rows], [Segment(slot, start, rows)], cache, logit_rows=want,
                  head=_no_logits).hidden[-1].float()  # [rows or 1, hidden]
        if pooling == "mean":
            total += h.double().sum(0)
        elif pooling == "none":
            rows_out.append(h)
        if start + rows < n:
            yield None
    vec = (total / n).float() if pooling == "mean" else torch.cat(rows_out) if pooling == "none" else h[-1]
    yield F.normalize(vec, dim=-1) if normalize else vec  # [hidden] or [n, hidden]


def embed(model: Transformer, token_lists: list[list[int]], pooling: str = "last", normalize: bool = True,
          chunk: int = 256) -> list[torch.Tensor]:
    """One float32 vector [hidden] per token list (each non-empty), pooled by ``pooling`` (``"none"``:
    a matrix [tokens, hidden] per list)."""
    return [list(embed_windows(model, ids, pooling, normalize, chunk))[-1] for ids in token_lists]



def normalize_embedding(v: torch.Tensor, norm: int) -> torch.Tensor:
    """``v`` (each row) normalized as llama.cpp's ``embd_normalize`` says: -1 not at all, 0 scaled so the
    largest magnitude is 32760 (int16 range), 1 by the sum of magnitudes, 2 (its default) Euclidean,
    p > 2 by the p-norm."""
    if norm < 0:
        return v
    if norm == 0:
        top = v.abs().amax(dim=-1, keepdim=True) / 32760.0
        return torch.where(top > 0, v / top, v)
    if norm == 2:
        return F.normalize(v, dim=-1)  # (as embed() and /v1/embeddings normalize: the same values)
    scale = v.abs().pow(norm).sum(dim=-1, keepdim=True).pow(1.0 / norm)
    return torch.where(scale > 0, v / scale, v)


__all__ = ["POOLINGS", "embed", "embed_windows", "normalize_embedding"]
