"""Weight buffers on transparent huge pages.

A decode step streams every weight matrix once; with 4 KiB pages that is a TLB miss and a stopped
hardware prefetch every 4 KiB. Measured on this project's AVX2 machine (one row, weights read from
memory): bf16 products 13.5-14.5 -> 16.8-17.3 GB/s with the same packed weights on 2 MiB pages.
PyTorch's allocator does not ask for huge pages by default, so the packed weights the kernels read
are copied once, at load, into private anonymous mappings advised ``MADV_HUGEPAGE`` (honoured where
transparent huge pages are "always" or "madvise"; elsewhere the copy is harmless). The values are
unchanged, so nothing computed changes. ``TOKENLEAP_HUGEPAGES=0`` turns it off.
"""
from __future__ import annotations

import mmap
import os

import torch
from torch import nn

from tokenleap.models.changes import modules_changed

_HUGE = 2 << 20  # bytes in a huge page on x86-64
_MIN_BYTES = 1 << 20  # smaller buffers are not worth a mapping of their own
_STREAMED = ("packed", "scales_and_mins", "d", "scales")  # the kernels' weight operands


def enabled() -> bool:
    off = os.environ.get("TOKENLEAP_HUGEPAGES", "1").strip().lower() in ("0", "false", "no", "off")
    return not off and hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE")


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` in a 2 MiB-aligned private mapping advised for huge pages."""
    n = t.numel() * t.element_size()
    m = mmap.mmap(-1, n + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the copy faults in huge pages
    except OSError:  # a kernel without transparent huge pages: keep the tensor where it is
        m.close()
        return t
    raw = torch.frombuffer(m, dtype=torch.uint8)  # keeps the mapping alive as long as any view
    start = (-raw.data_ptr()) % _HUGE
    out = raw[start:start + n].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def move_weights_(model: nn.Module, min_bytes: int = _MIN_BYTES) -> int:
    """Put the packed weight buffers the kernels stream (int4 / int6 / int8 / packed bf16) of at
    least ``min_bytes`` on huge pages; returns the bytes moved (0 when disabled)."""
    if not enabled():
        return 0
    moved = 0
    for module in model.modules():
        packed = module.__dict__.get("_packed")  # Linear's packed bf16 copy
        if isinstance(packed, torch.Tensor) and packed.numel() * packed.element_size() >= min_bytes:
            module.__dict__["_packed"] = new = on_huge_pages(packed)
            moved += (new is not packed) * packed.numel() * packed.element_size()
        for name, buf in list(module.named_buffers(recurse=False)):
            if name in _STREAMED and buf.numel() * buf.element_size() >= min_bytes:
                setattr(module, name, new := on_huge_pages(buf))
                moved += (new is not buf) * buf.numel() * buf.element_size()
    modules_changed()  # the fused layers' plans held the buffers replaced above (backend.py)
    return moved


__all__ = ["enabled", "move_weights_", "on_huge_pages"]
