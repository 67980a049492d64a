"""The layer-skip draft's LM head: the target's own head over the first ``n`` token ids (byte-level
BPE ranks common tokens first) and the special tokens -- views into the head's weights, no copy.

Qwen2.5-Coder-1.5B's head (151,936 x 1,536, Q6_K beside 4-bit layers) is about a fifth of what a
decode step reads; a drafted token through half the layers and the whole head would cost ~60% of
a plain step. Over 32,768 ids it reads a fifth of that. Losslessness is untouched: drafted tokens
are verified by the full model, and in sampling mode q is the distribution the draft drew from
(zero outside the subset); only acceptance can drop, when the target picks a token outside it.

The rows are read through the head's own kernel on a slice of its packed weights (int8, int4,
int6, bf16 packed for AVX2 or AMX tiles) or of its float weight; other heads get no reduced head (None).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from tokenleap import kernels
from tokenleap.models.int6 import Int6Linear
from tokenleap.models.linear import Linear
from tokenleap.models.qlinear import Int4Linear, Int8Linear

_BLOCK = 16  # rows per slice: every packed layout's block size divides it

Product = Callable[[torch.Tensor, bool], torch.Tensor]  # (x [rows, hidden], row_exact) -> [rows, hi - lo]


def _rows(head, lo: int, hi: int) -> Product | None:
    """The product of x with rows ``lo .. hi - 1`` of ``head``'s weight (multiples of 16), through
    views of its stored weights; None where the layout is not one of these."""
    if getattr(head, "bias", None) is not None:
        return None
    if isinstance(head, Int8Linear) and head.use_kernel:
        packed, scales = head.packed[lo // 8:hi // 8], head.scales[lo:hi]  # [(hi-lo)/8, in/8, 8, 8], [hi-lo]
        return lambda x, exact: kernels.weight_product(x.float(), packed, scales, exact)
    if isinstance(head, Int4Linear) and head.use_kernel:
        per = kernels.int4_rows_per_entry(head.packed)  # 8-row blocks, or pairs of them
        packed, sm = head.packed[lo // per:hi // per], head.scales_and_mins[lo // per:hi // per]
        return lambda x, exact: kernels.int4_linear(x.float(), packed, sm)
    if isinstance(head, Int6Linear):  # a GGUF's Q6_K head kept exactly (int4 targets)
        per = kernels.int6_rows_per_entry(head.packed)  # 8-row blocks [.., in/32, 208], or pairs [.., in/32, 2, 208]
        packed, d = head.packed[lo // per:hi // per], head.d[lo // per:hi // per]  # d: [.., in/256, (2,) 8]
        return lambda x, exact: kernels.int6_linear(x.float(), packed, d, None)
    if isinstance(head, Linear):
        packed = head.__dict__.get("_packed") if head.weight.dtype == torch.bfloat16 and head._bf16_kernel() else None
        if isinstance(packed, torch.Tensor):
            per = 16 if packed.dim() == 5 else 8  # AMX tiles: 16 rows a block; AVX2: 8
            view = packed[lo // per:hi // per]
            return lambda x, exact: kernels.weight_product(x.float(), view, None, exact)
        if head.weight.dtype == torch.float32 and head.weight.numel():
            w = head.weight[lo:hi]  # [hi-lo, hidden]
            return lambda x, exact: torch.cat([x[i:i + 1] @ w.T for i in range(x.shape[0])]) if exact else x @ w.T
    return None


class PrefixHead:
    """Logits [rows, vocab] over ids ``0 .. n - 1`` and ``keep_ids``, -inf elsewhere."""

    def __init__(self, parts: list[tuple[int, int, Product]], vocab: int, keep: torch.Tensor) -> None:
        self.parts, self.vocab, self.keep = parts, vocab, keep  # keep: [k] ids scored outside the prefix

    def __call__(self, x: torch.Tensor, row_exact: bool = False) -> torch.Tensor:
        out = torch.full((x.shape[0], self.vocab), float("-inf"), dtype=torch.float32)
        for lo, hi, product in self.parts:
            out[:, lo:hi] = product(x, row_exact)
        if self.keep.numel():  # the kept ids' blocks were scored whole; only the ids themselves count
            prefix_end = self.parts[0][1]
            keep_mask = torch.zeros(self.vocab, dtype=torch.bool)
            keep_mask[:prefix_end] = True
            keep_mask[self.keep] = True
            out[:, ~keep_mask] = float("-inf")
        return out


def prefix_head(model, n: int = 32768, keep_ids=()) -> PrefixHead | None:
    """``model``'s head over ids < ``n`` and ``keep_ids`` (e.g. EOS), or None: a vocabulary under
    twice ``n`` (little to save), or a head layout without row views."""
    vocab = model.config.vocab_size
    n = -(-n // _BLOCK) * _BLOCK
    if n <= 0 or vocab < 2 * n:
        return None
    head = model.lm_head
    first = _rows(head, 0, n)
    if first is None:
        return None
    parts = [(0, n, first)]
    keep = sorted({int(i) for i in keep_ids if n <= int(i) < vocab})
    for block in sorted({i // _BLOCK for i in keep}):
        lo, hi = block * _BLOCK, min((block + 1) * _BLOCK, vocab)
        if hi - lo < _BLOCK:  # a last, partial block: the slice would not be a whole kernel block
            continue
        parts.append((lo, hi, _rows(head, lo, hi)))
    kept = [i for i in keep if any(lo <= i < hi for lo, hi, _ in parts[1:])]
    return PrefixHead(parts, vocab, torch.tensor(kept, dtype=torch.long))
