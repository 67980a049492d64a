"""A cheaper LM head for the draft model: logits over a subset of the vocabulary.

The draft's untied head over Qwen's 151,936 tokens is over a quarter of the weights a 0.5B draft
reads per token. Drafting only among the tokens the target is likely to emit -- the first
``static_size`` ids (byte-level BPE ranks common tokens first), every special token, and the
tokens of the request's own prompt -- cuts that cost by about four fifths. Losslessness is
untouched: the target still verifies every draft token, and in sampling mode ``q`` is exactly
the distribution the draft drew from (zero outside the subset). Only acceptance can change,
when the target's choice falls outside the subset.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from tokenleap import kernels
from tokenleap.models.hugepages import move_weights_
from tokenleap.models.quant import Int4Linear, Int8Linear


def float_rows(head: nn.Module, ids: torch.Tensor) -> torch.Tensor:  # [len(ids), hidden]
    if hasattr(head, "dequantized_rows"):
        return head.dequantized_rows(ids)
    if hasattr(head, "dequantized_weight"):
        return head.dequantized_weight()[ids]
    return head.weight.detach()[ids].float()


class ReducedVocabHead:
    def __init__(self, lm_head: nn.Module, static_size: int = 32768, special_ids: Iterable[int] = ()) -> None:
        self._head = lm_head
        self.vocab = lm_head.out_features
        ids = sorted(set(range(min(static_size, self.vocab))) | {i for i in special_ids if 0 <= i < self.vocab})
        self.static_ids = torch.tensor(ids, dtype=torch.long)  # [s]
        self._static = self._static_rows(self.static_ids)
        self._in_static = torch.zeros(self.vocab, dtype=torch.bool)
        self._in_static[self.static_ids] = True

    def _rows(self, ids: torch.Tensor) -> Int8Linear:
        """The head's rows ``ids`` at int8, a scale a row (so a row's values do not depend on which
        rows are asked for with it); only those rows are dequantized."""
        return Int8Linear.from_float(float_rows(self._head, ids))

    def _static_rows(self, ids: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """The shared subset, read for every drafted token: 4-bit on tokenleap's kernel (half the
        bytes of int8; a draft's precision moves only acceptance), padded to the kernel's 16 rows."""
        rows = self._rows(ids)
        if not kernels.available() or rows.in_features % 32:
            return rows
        w = rows.qweight.float() * rows.weight_scales().float()[:, None]  # [s, hidden]
        layer = Int4Linear.from_float(torch.nn.functional.pad(w, (0, 0, 0, -len(ids) % 16)))
        move_weights_(layer)  # read for every drafted token: huge pages, like the model's own weights
        n = len(ids)
        return lambda x: layer(x)[:, :n]

    def for_prompt(self, prompt: list[int]) -> "SequenceHead":
        # (a target's padding ids past this head's rows: none)
        p = torch.tensor(sorted(i for i in set(prompt) if i < self.vocab), dtype=torch.long)
        extra = p[~self._in_static[p]] if p.numel() else p  # [e]
        return SequenceHead(self, extra, self._rows(extra) if extra.numel() else None)


class SequenceHead:
    """The head one sequence drafts with: the shared subset plus that prompt's own tokens."""

    def __init__(self, shared: ReducedVocabHead, extra_ids: torch.Tensor, extra: Int8Linear | None) -> None:
        self.shared, self.extra_ids, self.extra = shared, extra_ids, extra

    def __call__(self, x: torch.Tensor, row_exact: bool = False) -> torch.Tensor:
        # x: [rows, hidden] -> [rows, vocab] logits, -inf outside the subset
        return _subset_logits(self.shared, x, [(slice(None), self)])


class BatchHead:
    """Several sequences' heads over one forward's rows (row i belongs to heads[i]): the shared
    subset is scored for all rows in one product, each prompt's extra tokens for its own row."""

    def __init__(self, heads: list[SequenceHead]) -> None:
        self.heads = heads
        self.shared = heads[0].shared

    def __call__(self, x: torch.Tensor, row_exact: bool = False) -> torch.Tensor:
        # x: [len(heads), hidden] -> [len(heads), vocab], -inf outside each row's subset
        return _subset_logits(self.shared, x, [(slice(i, i + 1), h) for i, h in enumerate(self.heads)])


def _subset_logits(shared: ReducedVocabHead, x: torch.Tensor, parts: list[tuple[slice, SequenceHead]]) -> torch.Tensor:
    """Logits [rows, vocab], -inf outside the subsets: the shared subset for every row of x
    [rows, hidden] in one product, each part's prompt tokens for that part's rows."""
    out = torch.full((x.shape[0], shared.vocab), float("-inf"), dtype=torch.float32)
    out[:, shared.static_ids] = shared._static(x).float()
    for rows, head in parts:
        if head.extra is not None:
            out[rows, head.extra_ids] = head.extra(x[rows]).float()
    return out


class VocabFit:
    """A draft head's logits fitted to the target's vocabulary size, for a draft of the target's
    tokenizer whose embedding matrix is padded to another size (Qwen2.5's 0.5B-3B hold 151,936 rows,
    its 7B and larger 152,064; no real token lies in the padding): columns the draft lacks are -inf
    (never drafted), columns the target lacks are dropped. The draft then draws from, and reports,
    exactly this distribution over the target's ids, so verification stays exact."""

    def __init__(self, head: Callable[..., torch.Tensor], vocab: int) -> None:
        self.head, self.vocab = head, vocab

    def __call__(self, x: torch.Tensor, row_exact: bool = False) -> torch.Tensor:
        logits = self.head(x, row_exact)  # [rows, draft vocab]
        extra = self.vocab - logits.shape[-1]
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))  # [rows, vocab]
        return logits[:, :self.vocab]  # [rows, vocab]
