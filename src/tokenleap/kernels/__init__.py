"""Optional compiled CPU kernels, built once per machine with the PyTorch C++ extension tools.

``products.cpp``: weight-only products for float32 activations, row-invariant by construction,
in cache-friendly packed layouts -- ``int8_linear`` (about 2x torch's ``_weight_int8pack_mm`` for
one row on this project's AVX2 machine, 1.5x for 2-8 rows), ``bf16_linear``, ``int4_linear``
(W4A8: activations quantized to int8 per 32 inputs, integer dot products; about half int8's
time), and ``*_gemm`` blocked variants for prefill windows. ``int6.cpp``: ``int6_linear``, a GGUF's
Q6_K weights exactly (W6A8). ``attention.cpp``: the attention of decode / verification / tree
rows over their keys, every (row, head) on its own in a fixed order, the keys the rows share read
once for all of a kv head's query heads and rows (``attention512.cpp``: the same on AVX-512
vectors, where the CPU has them). ``decoder.cpp``: ``attend_rows`` (causal
attention for decode / verification rows), ``rope_store_attend`` (rotate, store into the cache,
attend in one call), and fused ``rms_norm``, ``rope_``, ``silu_mul``; every row on its own.
``layer.cpp``: ``decoder_layer``, a whole decoder layer for a decode / verification step in one
call (the same kernels in the same order: bitwise the Python layer). ``amx.cpp``:
``bf16_amx_linear``, bf16 products on AMX tiles where the CPU has them (``amx_available``; weights
packed by ``pack_bf16_amx``): activations rounded to bf16, any number of rows at about one row's
cost, row-invariant. ``amx_int.cpp``: ``int4_linear``'s and ``int6_linear``'s products of
``AMX_INT8_MIN_ROWS``+ rows on AMX-INT8 tiles (bitwise the AVX2 kernels' values, so a call takes
either). They need an x86-64 CPU with AVX2, FMA and F16C, a C++ compiler and ninja; the first
use compiles them (~30 s) into ``<tokenleap cache>/kernels/<key>``. Where any of that is
missing, ``available()`` is False, the reason is logged once, and the layers use torch's own
kernels instead. ``TOKENLEAP_KERNELS=0`` turns the kernels off. ``compiler.py`` compiles them;
``layouts.py`` packs 4- and 6-bit weights into the layouts the products read.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
from pathlib import Path

import torch

from tokenleap.kernels import compiler as _compiler

log = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict[str, object] = {}


def _reason_unavailable() -> str | None:
    if os.environ.get("TOKENLEAP_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return "disabled by TOKENLEAP_KERNELS"
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512"):
        return f"CPU capability {cap!r} has no AVX2"
    return None


def _load() -> None:
    reason = _reason_unavailable()
    if reason is None:
        try:
            _compiler.build()
            torch.ops.tokenleap.int8_linear  # noqa: B018 -- raises if the ops did not register
            torch.ops.tokenleap.attend_rows  # noqa: B018
            torch.ops.tokenleap.decoder_layer  # noqa: B018
        except Exception as e:  # no compiler, no ninja, a build error: fall back, say why
            reason = f"could not build {', '.join(p.name for p in _compiler.SOURCES)}: {type(e).__name__}: {str(e).strip()[-300:]}"
    if reason:
        log.warning("tokenleap CPU kernels unavailable (%s); using torch's kernels", reason)
    elif "amx_int8" in cpu_flags():
        # an AMX CPU: AMX-INT8 tiles from AMX_INT8_MIN_ROWS rows; below that the AVX-512 VNNI tiles
        # (left on, as on every CPU that has them: faster than the AVX2 tiles at 1-16 rows there too)
        if _tiles_granted("amx_int8"):
            torch.ops.tokenleap.amx_int8_rows(AMX_INT8_MIN_ROWS)
    _state["reason"] = reason


def available() -> bool:
    """True when the compiled kernels are loaded (builds them on first call)."""
    with _lock:
        if "reason" not in _state:
            _load()
    return _state["reason"] is None


def ready() -> bool:
    """``available()`` answers without compiling anything: loaded, off, or built on disk already."""
    return "reason" in _state or _reason_unavailable() is not None or _compiler.built()


def unavailable_reason() -> str | None:
    available()
    return _state["reason"]  # type: ignore[return-value]


def _tiles_granted(flag: str) -> bool:
    """AMX tiles of kind ``flag`` (amx_bf16, amx_int8) may run: not turned off by ``TOKENLEAP_AMX=0``,
    the CPU has them, and Linux granted this process the tile state (the loaded kernels ask)."""
    allowed = os.environ.get("TOKENLEAP_AMX", "1").strip().lower() not in ("0", "false", "no", "off")
    return allowed and flag in cpu_flags() and bool(torch.ops.tokenleap.amx_init())


def amx_available() -> bool:
    """True where bf16 products can run on AMX tiles: the kernels are loaded, the CPU has AMX-BF16
    and Linux granted this process the tile state. ``TOKENLEAP_AMX=0`` turns them off (and the
    int4 / int6 products' tiles, see ``set_amx_int8_rows``)."""
    if "amx" not in _state:
        _state["amx"] = available() and _tiles_granted("amx_bf16")
    return bool(_state["amx"])


def w8a8_available() -> bool:
    """True where W8A8 products (``w8a8.cpp``, ``models/w8a8.py``) can run on AMX-INT8 tiles."""
    if "w8a8" not in _state:
        _state["w8a8"] = available() and _tiles_granted("amx_int8") and hasattr(torch.ops.tokenleap, "w8a8_linear")
    return bool(_state["w8a8"])


# int4 / int6 products of at least this many rows run on AMX-INT8 tiles where the CPU has them
# (loading the kernels sets it); fewer rows take the AVX-512 VNNI tiles. On a 2-core Xeon (model
# 207), a whole int4 step of the 1.5B model (ms, AMX from 4 rows / VNNI at every count, interleaved):
# 95 / 80 at 4 rows, 109 / 101 at 6, 136 / 151 at 8, 250 / 277 at 16; the 0.5B: 37 / 28 at 4, 43 /
# 45 at 8. The int6 LM head alone (151936x1536): VNNI 14.7 / 19.8 / 27.0 ms at 4 / 6 / 8 rows, AMX
# 22.8 / 25.0 / 27.7.
AMX_INT8_MIN_ROWS = 8


def set_amx_int8_rows(rows: int) -> int:
    """int4 / int6 products of at least ``rows`` rows run on AMX-INT8 tiles (0: never); returns the
    previous setting. Both kernels compute bitwise the same values, so this changes only speed.
    Raises where the tiles are unavailable (``rows`` > 0)."""
    available()
    return int(torch.ops.tokenleap.amx_int8_rows(rows))


def vnni_supported() -> bool:
    """True where int4 / int6 products can take the AVX-512 VNNI register tiles (``vnni.cpp``): the
    kernels are loaded and the CPU has AVX-512 F / BW / VL and VNNI."""
    return available() and bool(torch.ops.tokenleap.vnni_supported())


def set_vnni(on: bool) -> bool:
    """int4 / int6 products take the AVX-512 VNNI tiles (``on``, the default where the CPU has them;
    on an AMX CPU, for calls of fewer than ``AMX_INT8_MIN_ROWS`` rows) or the AVX2 ones; returns the
    previous setting. Both compute bitwise the same values, so this
    changes only speed; ``on`` has no effect where the CPU lacks VNNI."""
    available()
    return bool(torch.ops.tokenleap.vnni(1 if on else 0))


def attention512_supported() -> bool:
    """True where attention can take the AVX-512 kernel (``attention512.cpp``): the kernels are loaded
    and the CPU has AVX-512 F / DQ / VL."""
    return available() and bool(torch.ops.tokenleap.attention512_supported())


def set_attention512(on: bool) -> bool:
    """Attention (``attend_rows`` and the fused layers' attention) takes the AVX-512 kernel (``on``,
    the default where the CPU has it) or the AVX2 one, for heads of a multiple of 16 floats; returns
    the previous setting. The two sum a score's products in different orders, so a row's bits
    depend on the setting: set it before a model runs, not between steps (benchmarks and tests)."""
    available()
    return bool(torch.ops.tokenleap.attention512(1 if on else 0))


def set_vnni_pair_rows(rows: int) -> int:
    """int4 / int6 products of at least ``rows`` rows (of 4096 inputs or more, one row fewer) take
    the VNNI two-block tiles, fewer rows the one-block tiles (``vnni.cpp``; 0 or less: the built-in
    threshold, 4); returns the previous threshold. Both tiles compute bitwise the same values, so
    this changes only speed (benchmarks and tests set it)."""
    available()
    return int(torch.ops.tokenleap.vnni_pair_rows(rows))


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split())
    except (OSError, IndexError):
        return frozenset()


def pack_bf16_amx(w: torch.Tensor) -> torch.Tensor:
    """bfloat16 [N, K] (N a multiple of 16, K of 32) -> the AMX product's layout [N/16, K/32, 16, 16, 2]:
    per 16 outputs and 32 inputs, input pair r of output n at [.., r, n, :]."""
    n, k = w.shape
    return w.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """bfloat16 [N, K] (N a multiple of 8, K of 16) -> the bf16 products' layout [N/8, K/16, 8, 16]."""
    n, k = w.shape
    return w.reshape(n // 8, 8, k // 16, 16).permute(0, 2, 1, 3).contiguous()


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] (N, K multiples of 8) -> the int8 products' layout [N/8, K/8, 8, 8]."""
    n, k = q.shape
    return q.reshape(n // 8, 8, k // 8, 8).permute(0, 2, 1, 3).contiguous()


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int8``: [N/8, K/8, 8, 8] -> [N, K]."""
    nb, kb = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(nb * 8, kb * 8)


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x float32 [M, K] @ (unpack(packed) * scale[:, None]).T -> float32 [M, N]; row-invariant."""
    return torch.ops.tokenleap.int8_linear(x, packed, scale)


def int8_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The same product as ``int8_linear`` blocked for many rows (N a multiple of 16); faster from
    ~16 rows up, but a row's rounding depends on the call, so only for prefill windows."""
    return torch.ops.tokenleap.int8_gemm(x, packed, scale)


GEMM_MIN_ROWS = 48  # from here on (and only without row exactness) the blocked GEMM is used


def weight_product(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor | None, row_exact: bool) -> torch.Tensor:
    """x float32 [M, K] times int8 (with ``scale``; ``pack_int8``) or bfloat16 (``scale`` None;
    ``pack_bf16``) weights -> float32 [M, N]: the row-invariant product, or for prefill windows
    (not ``row_exact``, ``GEMM_MIN_ROWS``+ rows, N a multiple of 16) the blocked GEMM. bf16 weights
    packed for AMX tiles (``pack_bf16_amx``, 5 dims) always take the tiles' product."""
    if packed.dim() == 5:  # packed for AMX tiles: row-exact and fast at every size
        return torch.ops.tokenleap.bf16_amx_linear(x, packed)
    gemm = not row_exact and x.shape[0] >= GEMM_MIN_ROWS and packed.shape[0] % 2 == 0
    if scale is None:
        return bf16_gemm(x, packed) if gemm else bf16_linear(x, packed)
    return int8_gemm(x, packed, scale) if gemm else int8_linear(x, packed, scale)


def bf16_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x float32 [M, K] @ W.T for bfloat16 W packed by ``pack_bf16`` -> float32 [M, N]; row-invariant,
    products and sums in float32."""
    ones = unit_scale(packed.shape[0] * 8)
    return torch.ops.tokenleap.bf16_linear(x, packed, ones)


def bf16_gemm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``bf16_linear`` blocked for many rows (N a multiple of 16); prefill windows only."""
    return torch.ops.tokenleap.bf16_gemm(x, packed, unit_scale(packed.shape[0] * 8))


_ONES: dict[int, torch.Tensor] = {}


def unit_scale(n: int) -> torch.Tensor:  # the bfloat16 products' "scale": multiplying by 1 is exact
    if n not in _ONES:
        _ONES[n] = torch.ones(n)
    return _ONES[n]


def int4_linear(x: torch.Tensor, packed: torch.Tensor, sm: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x float32 [M, K] times 4-bit weights from ``pack_int4`` -> float32 [M, N]. Each row of x is
    quantized to int8 per group of 32 (as llama.cpp does for its 4-bit products); integer dot
    products, one fixed float chain per output: row-invariant for any number of rows. ``bias``
    (float32 [N]) is added after the products."""
    return torch.ops.tokenleap.int4_linear(x, packed, sm, bias)


def int6_linear(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x float32 [M, K] times 6-bit weights from ``pack_int6`` -> float32 [M, N]; x quantized to int8
    per 32 inputs, integer dot products per 16, one fixed float chain per output: row-invariant."""
    return torch.ops.tokenleap.int6_linear(x, packed, d, bias)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for float32 [M, I] (views with unit column stride are fine): SwiGLU's
    activation in one pass."""
    return torch.ops.tokenleap.silu_mul(gate, up)


def attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos0: int, scale: float) -> torch.Tensor:
    """Causal attention of new rows q float32 [T, H, hd] at positions pos0 .. pos0+T-1 over
    keys / values float32 [n_kv, L, hd] (L >= pos0 + T; grouped heads) -> [T, H, hd]; each row
    computed on its own (row-invariant). For decoding and verification, not long prefills."""
    return torch.ops.tokenleap.attend_rows(q, keys, values, pos0, scale)


def rope_store_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_store: torch.Tensor, v_store: torch.Tensor, pos0: int, scale: float) -> torch.Tensor:
    """One sequence's decode / verification attention in one call: rotate q [T, H, hd] and
    k [T, n_kv, hd] at positions pos0.., store k and v into k_store / v_store [n_kv, max_len, hd]
    (one cache slot), attend -> [T, H, hd]. Bitwise the same as ``rope_``, a cache write and
    ``attend_rows``."""
    return torch.ops.tokenleap.rope_store_attend(q, k, v, cos, sin, k_store, v_store, pos0, scale)


def decoder_layer(x: torch.Tensor, weights: list[torch.Tensor | None], ints: list[int], cos: torch.Tensor,
                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, segments: list[int],
                  tables: list[int], eps: float, scale: float) -> torch.Tensor:
    """One decoder layer over float32 rows x [M, hidden] of a decode / verification step: see
    ``layer.cpp`` for the operands (``tokenleap.models.fused_layer`` builds them). Writes the rows'
    keys and values into k_cache / v_cache -- contiguous [slots, n_kv, max_len, hd], or paged
    [n_kv, blocks, block_size, hd] with the segments' block ``tables`` -- and returns the layer's output."""
    return torch.ops.tokenleap.decoder_layer(x, weights, ints, cos, sin, k_cache, v_cache, segments, tables, eps, scale)


def rope_store_attend_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            k_pool: torch.Tensor, v_pool: torch.Tensor, table: list[int], pos0: int,
                            scale: float) -> torch.Tensor:
    """``rope_store_attend`` on a paged cache: pools [n_kv, blocks, block_size, hd], ``table`` the
    sequence's blocks covering positions 0 .. pos0+T-1."""
    return torch.ops.tokenleap.rope_store_attend_paged(q, k, v, cos, sin, k_pool, v_pool, table, pos0, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` per row of float32 [M, D] (sum of squares in float64)."""
    return torch.ops.tokenleap.rms_norm(x, weight, eps)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split layout, in place on contiguous float32 [M, heads, hd]; returns x."""
    torch.ops.tokenleap.rope_(x, cos, sin, positions)
    return x


from tokenleap.kernels.layouts import (int4_rows_per_entry, int6_rows_per_entry, pack_int4, pack_int6,  # noqa: E402
                                       unpack_int4, unpack_int6)

__all__ = ["available", "unavailable_reason", "amx_available", "w8a8_available", "set_amx_int8_rows", "vnni_supported", "set_vnni", "set_vnni_pair_rows", "attention512_supported", "set_attention512", "AMX_INT8_MIN_ROWS", "cpu_flags", "pack_bf16_amx", "pack_bf16", "pack_int8", "unpack_int8", "int8_linear", "int8_gemm", "bf16_linear",
           "bf16_gemm", "weight_product", "pack_int4", "unpack_int4", "int4_rows_per_entry", "int4_linear", "pack_int6", "unpack_int6", "int6_rows_per_entry", "int6_linear", "attend_rows", "silu_mul", "rope_store_attend", "rope_store_attend_paged", "decoder_layer", "GEMM_MIN_ROWS", "rms_norm", "rope_"]


def rope_store_attend_tree(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           k_store: torch.Tensor, v_store: torch.Tensor, pos0: int, tree: list[int],
                           scale: float) -> torch.Tensor:
    """``rope_store_attend`` for the rows of a token tree whose root sits at ``pos0``: ``tree`` is
    [first, parents of nodes 0 .. n-1], the rows are nodes first .. first+T-1 (see tree.cpp)."""
    return torch.ops.tokenleap.rope_store_attend_tree(q, k, v, cos, sin, k_store, v_store, pos0, tree, scale)


def decoder_layer_trees(x: torch.Tensor, weights: list[torch.Tensor | None], ints: list[int], cos: torch.Tensor,
                        sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, segments: list[int],
                        tables: list[int], trees: list[int], eps: float, scale: float) -> torch.Tensor:
    """``decoder_layer`` whose segments may be token trees: ``trees`` holds, per segment, m and then
    m ints (0 for a chain, else rope_store_attend_tree's [first, parents...])."""
    return torch.ops.tokenleap.decoder_layer_trees(x, weights, ints, cos, sin, k_cache, v_cache, segments, tables,
                                                   trees, eps, scale)
