"""Embeddings of texts from a decoder model's final hidden states, as llama.cpp serves them with
``--embeddings`` and vLLM's pooling runner does for decoder-only models: the final norm's output at
the prompt's last token (pooling "last", vLLM's default for such models) or averaged over its tokens
("mean"), L2-normalized. A generative model's embeddings are a by-product, not a retrieval model's.

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

POOLINGS = ("last", "mean")


def _no_logits(x: torch.Tensor, row_exact: bool) -> torch.Tensor:  # [rows, hidden] -> [rows, 0]
    return x[:, :0]


def embed_windows(model: Transformer, ids: list[int], pooling: str = "last", normalize: bool = True,
                  chunk: int = 256) -> Iterator[torch.Tensor | None]:
    """The embedding of ``ids`` (non-empty) one prefill window at a time: None after each window but
    the last, then the float32 vector [hidden] -- so a caller can interleave other work between
    the windows of a long input (the server's scheduler does)."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    if not ids:
        raise ValueError("cannot embed an empty token list")
    n = len(ids)
    cache = KVCache(model.config, 1, n, model.dtype)
    slot = cache.allocate()
    tokens = torch.tensor(ids)
    total = torch.zeros(model.config.hidden_size, dtype=torch.float64)
    for start in range(0, n, chunk):
        rows = min(chunk, n - start)
        want = None if pooling == "mean" else torch.tensor([rows - 1])
        h = model(tokens[start:start + rows], [Segment(slot, start, rows)], cache, logit_rows=want,
                  head=_no_logits).hidden[-1].float()  # [rows or 1, hidden]
        if pooling == "mean":
            total += h.double().sum(0)
        if start + rows < n:
            yield None
    vec = (total / n).float() if pooling == "mean" else h[-1]
    yield F.normalize(vec, dim=0) if normalize else vec


def embed(model: Transformer, token_lists: list[list[int]], pooling: str = "last", normalize: bool = True,
          chunk: int = 256) -> list[torch.Tensor]:
    """One float32 vector [hidden] per token list (each non-empty), pooled by ``pooling``."""
    return [list(embed_windows(model, ids, pooling, normalize, chunk))[-1] for ids in token_lists]


__all__ = ["POOLINGS", "embed", "embed_windows"]
