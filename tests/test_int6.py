"""6-bit (Q6_K) layers: exact repacking of GGUF blocks, the W6A8 kernel's formula, row invariance,
and their place in models loaded from GGUF files."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenleap import kernels
from tokenleap.models.int6 import Int6Linear, int6_from_gguf_q6k

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
needs_kernel = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                  reason="the kernels need AVX2 + FMA")


def random_q6k(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random Q6_K blocks (gguf cannot quantize to Q6_K): random payload and scales, finite d."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 210), dtype=np.uint8)
    d = (rng.random((rows, cols // 256)) * 0.002 + 1e-4).astype(np.float16)
    blocks[..., 208:210] = d.view(np.uint8).reshape(rows, cols // 256, 2)
    return blocks.reshape(rows, -1)


def w6a8_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x quantized to int8 per 32 as the kernel does (float32: xq = round(x * (127 / max|x|)), half to
    even; scale max|x| / 127), times weight, in float64."""
    m, k = x.shape
    xg = x.float().view(m, k // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    xq = torch.round(xg * (torch.full_like(amax, 127.0) / amax))  # correctly rounded, as 127.f / amax
    return (xq.double() * (amax / 127).double()).view(m, k) @ weight.double().T


def test_q6k_blocks_repack_exactly():
    raw = random_q6k(16, 512)
    q, sc, d = int6_from_gguf_q6k(raw, (16, 512))
    assert q.dtype == torch.uint8 and int(q.max()) <= 63 and sc.dtype == torch.int8
    mine = d.repeat_interleave(256, 1) * sc.float().repeat_interleave(16, 1) * (q.float() - 32)
    np.testing.assert_array_equal(mine.numpy(), gguf.quants.dequantize(raw, T.Q6_K))


@needs_kernel
def test_pack_unpack_round_trip():
    raw = random_q6k(32, 768, seed=1)
    q, sc, d = int6_from_gguf_q6k(raw, (32, 768))
    for paired in (False, True):
        packed, dd = kernels.pack_int6(q, sc, d, paired=paired)
        assert packed.shape == ((2, 24, 2, 208) if paired else (4, 24, 208)), paired
        assert dd.shape == ((2, 3, 2, 8) if paired else (4, 3, 8)), paired
        back = kernels.unpack_int6(packed, dd)
        assert all(torch.equal(a, b) for a, b in zip(back, (q, sc, d))), paired
    blocked, _ = kernels.pack_int6(q[:16], sc[:16], d[:16], paired=False)
    paired, _ = kernels.pack_int6(q[:16], sc[:16], d[:16], paired=True)
    assert torch.equal(paired[0, 5, 1], blocked[1, 5])  # group 5 of the pair's second block
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.pack_int6(q[:24], sc[:24], d[:24], paired=True)
    layer = Int6Linear(q, sc, d)
    np.testing.assert_array_equal(layer.dequantized_weight().numpy(), gguf.quants.dequantize(raw, T.Q6_K))


@needs_kernel
@pytest.mark.parametrize("n,k", [(8, 256), (64, 512), (40, 1536)])
def test_int6_linear_matches_its_formula(n, k):
    layer = Int6Linear(*int6_from_gguf_q6k(random_q6k(n, k, seed=n), (n, k)))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(k))
    want = w6a8_reference(x, layer.dequantized_weight())
    got = layer(x).double()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@needs_kernel
def test_int6_rows_bitwise_independent_of_row_count_and_bias_added_after():
    n, k = 48, 512
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    layer = Int6Linear(*int6_from_gguf_q6k(random_q6k(n, k, seed=2), (n, k)), bias)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(4))
    full = layer(x)
    for rows in range(1, 12):
        assert torch.equal(layer(x[:rows]), full[:rows])
    assert torch.equal(full, kernels.int6_linear(x, layer.packed, layer.d) + bias)


@needs_kernel
def test_q6k_layers_become_int6_when_keeping_precision():
    """quantize_from_gguf_: Q6_K -> Int6Linear with other="int8", re-quantized to int4 with other="int4"."""
    from tokenleap.models.build import build_transformer
    from tokenleap.models.qlinear import Int4Linear
    from tokenleap.models.quant import quantize_from_gguf_

    from conftest import random_weights, tiny_config

    cfg = tiny_config("qwen2", hidden=256, intermediate=512)
    weights = random_weights(cfg, seed=5)
    names = [n for n in weights if n.endswith("proj.weight") or n == "lm_head.weight"]
    raw = {n: (T.Q6_K, random_q6k(*weights[n].shape, seed=i)) for i, n in enumerate(names)}
    for n, (_, r) in raw.items():  # the model's float weights are the file's values, as when loading it
        weights[n] = torch.from_numpy(gguf.quants.dequantize(r, T.Q6_K))

    class File:
        hf_to_gguf = {n: n for n in names}

        def raw_tensor(self, name):
            return T.Q6_K, raw[name][1], tuple(weights[name].shape)

    for other, kind in (("int8", Int6Linear), ("int4", Int4Linear)):
        model = build_transformer(cfg, dict(weights), torch.float32)
        quantize_from_gguf_(model, File(), other=other)
        assert isinstance(model.lm_head, kind) and isinstance(model.model.layers[0].mlp.down_proj, kind)
        if other == "int8":  # exactly the file's values
            v = model.model.layers[0].self_attn.v_proj
            assert torch.equal(v.dequantized_weight(), weights["model.layers.0.self_attn.v_proj.weight"])


@pytest.mark.skipif(not (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and kernels.amx_available()
                         and "amx_int8" in kernels.cpu_flags()), reason="the CPU has no AMX-INT8")
@pytest.mark.parametrize("n,k", [(40, 256), (48, 512), (272, 1536)])
def test_int6_on_amx_tiles_gives_the_avx2_kernels_bits(n, k):
    """Two TDPBSUD of 16 inputs a group and int6.cpp's float chain: every row count gives bitwise
    the AVX2 kernel's values (n = 40: an odd number of 8-column blocks, packed blocked, stays on the
    AVX2 kernel; the others are packed paired where the CPU has AVX-512 VNNI, as AMX machines do)."""
    layer = Int6Linear(*int6_from_gguf_q6k(random_q6k(n, k, seed=k), (n, k)))
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(n))
    before = kernels.set_amx_int8_rows(0)
    try:
        avx2 = kernels.int6_linear(x, layer.packed, layer.d)  # [40, n]
        kernels.set_amx_int8_rows(1)
        for m in (1, 2, 5, 16, 17, 33, 40):
            assert torch.equal(kernels.int6_linear(x[:m], layer.packed, layer.d), avx2[:m]), m
    finally:
        kernels.set_amx_int8_rows(before)
    want = w6a8_reference(x, layer.dequantized_weight())
    assert (avx2.double() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.skipif(not (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and kernels.vnni_supported()),
                    reason="the CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("n,k", [(40, 256), (48, 512), (272, 1536), (24, 4096), (16, 4096)])
def test_int6_on_vnni_tiles_gives_the_avx2_kernels_bits(n, k):
    """vpdpbusd over a half's two k-steps and int6.cpp's float chain: every row count (tiles of 1-8
    rows, passes with a tail) gives bitwise the AVX2 kernel's values, bias included -- on the paired
    layout (N a multiple of 16: two-block tiles at every row count) and on the blocked one (n = 40,
    24: one-block tiles below 4 rows -- below 3 on rows of 4096 inputs -- two-block tiles from there
    on, with a last single block where the count is odd)."""
    layer = Int6Linear(*int6_from_gguf_q6k(random_q6k(n, k, seed=k + 1), (n, k)))
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(n + 1))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(k))
    before = kernels.set_vnni(False)
    try:
        avx2 = kernels.int6_linear(x, layer.packed, layer.d, bias)  # [20, n]
        kernels.set_vnni(True)
        for m in range(1, 21):
            assert torch.equal(kernels.int6_linear(x[:m], layer.packed, layer.d, bias), avx2[:m]), m
    finally:
        kernels.set_vnni(before)
    want = w6a8_reference(x, layer.dequantized_weight()) + bias.double()
    assert (avx2.double() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.skipif(not kernels.vnni_supported(), reason="the CPU has no AVX-512 VNNI")
def test_two_block_tiles_from_any_row_count_give_the_same_int6_bits():
    """int6's two-block tiles at 1-3 rows and its one-block tiles at 4-12 rows compute bitwise what
    the built-in choice of tiles computes; the setting round-trips."""
    packed, d = kernels.pack_int6(*int6_from_gguf_q6k(random_q6k(48, 512, seed=3), (48, 512)), paired=False)
    x = torch.randn(12, 512, generator=torch.Generator().manual_seed(5))
    builtin = [kernels.int6_linear(x[:m], packed, d) for m in range(1, 13)]
    try:
        for rows, before in ((1, 4), (100, 1)):  # 4: the built-in threshold
            assert kernels.set_vnni_pair_rows(rows) == before
            for m in range(1, 13):
                assert torch.equal(kernels.int6_linear(x[:m], packed, d), builtin[m - 1]), (rows, m)
    finally:
        assert kernels.set_vnni_pair_rows(0) == 100


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 7])
def test_int6_layouts_give_the_same_bits(rows):
    """The AVX2 kernel on the blocked and the paired layout, and (where the CPU has them) the VNNI
    tiles on the paired layout, compute bitwise the same values, bias included."""
    q, sc, d = int6_from_gguf_q6k(random_q6k(48, 512, seed=rows), (48, 512))
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(48, generator=torch.Generator().manual_seed(48))
    before = kernels.set_vnni(False)
    try:
        blocked = kernels.int6_linear(x, *kernels.pack_int6(q, sc, d, paired=False), bias)
        paired = kernels.pack_int6(q, sc, d, paired=True)
        assert torch.equal(kernels.int6_linear(x, *paired, bias), blocked)
        if kernels.vnni_supported():
            kernels.set_vnni(True)
            assert torch.equal(kernels.int6_linear(x, *paired, bias), blocked)
    finally:
        kernels.set_vnni(before)


@needs_kernel
@pytest.mark.parametrize("paired", [False, True], ids=["blocked", "paired"])
def test_dequantized_rows_are_those_of_the_whole_weight(paired):
    """A few rows (a draft head's subset of an LM head) unpacked alone: bitwise the whole weight's rows."""
    q, sc, d = int6_from_gguf_q6k(random_q6k(64, 512, seed=3), (64, 512))
    layer = Int6Linear(q, sc, d)
    layer.packed, layer.d = kernels.pack_int6(q, sc, d, paired=paired)
    ids = torch.tensor([37, 0, 9, 63, 9, 16])
    assert torch.equal(layer.dequantized_rows(ids), layer.dequantized_weight()[ids])
