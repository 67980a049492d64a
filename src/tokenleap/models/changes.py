"""A counter of changes to the modules that decide how a model runs (``backend.py``).

A model chooses its backend once and keeps the choice while the counter stands still; anything
that could change the choice moves it: assigning or deleting a submodule, parameter or buffer of a
``TracksChanges`` module (quantization and ``fuse_projections_`` replace layers this way),
converting one (``.to(dtype)``, ``.float()``, ...), and the in-place edits that bypass both, which
call ``modules_changed`` themselves (``build.float32_activations_`` retypes parameters through
``.data``, ``hugepages.move_weights_`` moves packed buffers). The counter is global: a change to
one model makes every model re-choose at its next forward, which costs one pass over its layers
and never a wrong choice.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

_counter = itertools.count(1)
_generation = 0


def modules_changed() -> None:
    """Record that some model's modules changed: every model re-chooses its backend before its next forward."""
    global _generation
    _generation = next(_counter)  # strictly increasing, also when two threads race


def generation() -> int:
    """The current count of changes; a choice made at another count may be stale."""
    return _generation


class TracksChanges(nn.Module):
    """A module whose submodules, parameters and buffers take part in the backend choice: replacing,
    removing or converting any of them counts as a change (``modules_changed``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if value is None or isinstance(value, (nn.Module, torch.Tensor)):
            modules_changed()
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        modules_changed()
        super().__delattr__(name)

    def _apply(self, fn, recurse: bool = True):  # .to(), .float(), .bfloat16(), ... of this module or a parent
        modules_changed()
        return super()._apply(fn, recurse)


__all__ = ["TracksChanges", "generation", "modules_changed"]
