"""How a model runs its decode / verification rows: chosen once per state of its modules, not per call.

Three ways exist, fastest first, and all three compute bitwise the same rows (the tests compare
them), so the choice moves only speed:

- ``Backend.FUSED_LAYER``: the whole decoder layer in one ``kernels.decoder_layer`` call, operands in
  a ``fused_layer.LayerPlan``;
- ``Backend.COMPILED_ATTENTION``: the Python layer with its attention on the compiled kernels
  (``rope_store_attend`` -- rotate, store, attend in one call -- on a contiguous cache, ``attend_rows``
  otherwise);
- ``Backend.PYTHON``: torch's ops throughout.

What a path needs splits in two. The model's own state -- its dtype, its modules, whether the
kernels are loaded -- is decided by ``choose_backend`` once, and again whenever the modules change
(``changes.py``: ``Transformer.backend`` re-chooses when the change counter moved). The call's own
rows -- how many, whether they must be row-exact, and which cache they go to -- are checked per
call by ``rows_fit_fused_layer`` and ``rows_fit_compiled_attention``: a model serves several caches
(the engine's, a draft's, contiguous or paged) and both prefill windows and decode rows.
"""
from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from tokenleap import kernels
from tokenleap.models.fused_layer import LayerPlan, layer_plan, products_ignore_row_exact


class Backend(enum.Enum):
    FUSED_LAYER = "fused layer"
    COMPILED_ATTENTION = "compiled attention"
    PYTHON = "python"


@dataclass(frozen=True)
class ModelBackend:
    """The choice for every layer of one model, valid while ``changes.generation()`` equals ``generation``."""

    layers: tuple[Backend, ...]  # per layer: how its decode / verification rows run
    attention: tuple[Backend, ...]  # per layer: its Attention's own path when the layer runs in Python
    plans: tuple[LayerPlan | None, ...]  # per layer: the fused layer's operands; None where it does not run
    generation: int

    def fused_plans(self, layers: Sequence[int] | None = None) -> tuple[LayerPlan, ...] | None:
        """The fused layer's operands for ``layers`` (None: every layer), or None unless every one of
        them runs fused: a forward runs all its layers one way, the kernel's or Python's."""
        plans = self.plans if layers is None else tuple(self.plans[i] for i in layers)
        return None if any(p is None for p in plans) else plans

    def describe(self) -> str:
        """E.g. ``fused layer (24 layers)`` or ``compiled attention (20 layers), python (4 layers)``."""
        counts = Counter(self.layers)
        return ", ".join(f"{b.value} ({counts[b]} layer{'s' * (counts[b] != 1)})" for b in Backend if counts[b])


def choose_backend(model: Any, generation: int) -> ModelBackend:
    """Each layer's backend for ``model`` (a ``transformer.Transformer``) as its modules stand now.

    Compiled attention needs, for a layer:
      - the kernels loaded (``kernels.available()``: an AVX2 CPU, a compiler, not turned off);
      - float32 activations (the model's dtype): the kernels compute in float32, while a bf16
        model's Python layers round between ops in bf16 -- the kernels would give other values;
      - full causal attention (``Attention.plain``): the kernels attend over a row's whole prefix,
        a sliding layer's row sees only its last ``sliding_window`` positions;
      - a head size that is a multiple of 8 (the kernels' vectors of 8 floats).
    The fused layer needs all that, and:
      - ``model.use_fused_layers`` (tests turn it off to compare with the Python layers);
      - the plain Llama layer (``Block.plain``): the kernel has no q/k norms, pre/post norms, GeGLU
        or other attention scale;
      - a plan (``fused_layer.layer_plan``): every product on tokenleap's int4 / int6 / int8 / bf16 / W8A8
        kernels (a float32 ``Linear``'s rows are torch GEMVs the kernel does not reproduce), float32
        norms of one eps, an MLP width the SiLU kernel takes.
    ``generation``: ``changes.generation()`` read before looking at the modules, so a change made
    meanwhile still makes the next forward choose again.
    """
    compiled = model.dtype == torch.float32 and kernels.available()
    blocks: list[nn.Module] = list(model.model.layers)
    attention = tuple(Backend.COMPILED_ATTENTION if compiled and b.self_attn.plain and b.self_attn.hd % 8 == 0
                      else Backend.PYTHON for b in blocks)
    fused = compiled and model.use_fused_layers
    plans = tuple(layer_plan(b) if fused and b.plain and a is Backend.COMPILED_ATTENTION else None
                  for b, a in zip(blocks, attention))
    layers = tuple(Backend.FUSED_LAYER if p is not None else a for p, a in zip(plans, attention))
    return ModelBackend(layers, attention, plans, generation)


def _float32_cache(cache: Any) -> bool:
    return cache.k[0].dtype == torch.float32  # the kernels store float32 keys and values


def rows_fit_fused_layer(rows: int, row_exact: bool, cache: Any) -> bool:
    """This call's rows may run on the fused layer: one row or row-exact rows (the kernel computes
    each row on its own, as plain decoding does; a prefill window's blocked products are faster),
    into a float32 cache the kernel addresses, contiguous or paged (``prepare_rows``)."""
    return (row_exact or rows == 1) and hasattr(cache, "prepare_rows") and _float32_cache(cache)


def rows_fit_compiled_attention(rows: int, row_exact: bool, cache: Any) -> bool:
    """This call's rows may run ``rope_store_attend``: one row or row-exact rows, into a contiguous
    float32 cache (``slot_stores``: one slot's whole store, which the kernel writes itself)."""
    return (row_exact or rows == 1) and hasattr(cache, "slot_stores") and _float32_cache(cache)


def exact_prefill_is_free(model: Any, cache: Any) -> bool:
    """Whether ``model`` computes prompt windows into ``cache`` row-exact at little cost: every layer
    runs fused and every product ignores row-exactness (``products_ignore_row_exact``), so only
    attention differs -- the fused layer's per-row kernel instead of one batched product. Measured
    (BENCHMARKS): level or faster up to 8,000 prompt tokens on an AVX-512 EPYC; on an AMX Xeon 4%
    slower at 400 tokens and 11% at 1,000, where torch's batched product uses AVX-512. Then each
    position's keys and values are bitwise what any chunking of the prompt, or decoding one token
    at a time, writes there: the prefix cache may share them block by block."""
    plans = model.backend.fused_plans()
    return plans is not None and all(products_ignore_row_exact(p) for p in plans) and \
        rows_fit_fused_layer(2, True, cache)


def prefix_windows(model: Any, cache: Any, prefill_chunk: int) -> tuple[int, bytes]:
    """(window, salt) of the prefix cache's entries for ``model`` in ``cache``. Where prompt windows
    are computed row-exact at no cost (``exact_prefill_is_free``), every position's entries are what
    decoding writes: windows of one cache block, over prompts and replies alike (salt b"exact").
    Else the fixed prefill windows, computed by the batched path, are reused whole (salt b"")."""
    if exact_prefill_is_free(model, cache):
        return getattr(cache, "block_size", prefill_chunk), b"exact"
    return prefill_chunk, b""


__all__ = ["Backend", "ModelBackend", "choose_backend", "exact_prefill_is_free", "prefix_windows",
           "rows_fit_compiled_attention", "rows_fit_fused_layer"]
