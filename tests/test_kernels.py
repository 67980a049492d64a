"""tokenleap's compiled CPU kernel: built on AVX2 machines, exact to fp32, bitwise row-invariant,
and the torch fallback taken when it is unavailable."""
from __future__ import annotations

import os
import subprocess

import pytest
import torch
import torch.nn.functional as F

from tokenleap import kernels
from tokenleap.models.quant import Int8Linear

HAS_AVX2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
needs_kernel = pytest.mark.skipif(not HAS_AVX2, reason="the kernel needs AVX2 + FMA")


@pytest.fixture(autouse=True, scope="module")
def _kernels_loaded():  # the ops register on first use; tests here call them directly
    if HAS_AVX2:
        kernels.available()


@needs_kernel
def test_kernel_builds_on_avx2_machines():
    # CI runs on an AVX2 machine: a build failure must show up here, not as a silent slow fallback
    assert kernels.available(), kernels.unavailable_reason()


def _compiler_major() -> int:
    """The major version of the C++ compiler torch's extension builds use (0 where unknown)."""
    try:
        out = subprocess.run([os.environ.get("CXX", "c++"), "-dumpversion"], capture_output=True, text=True,
                             timeout=30).stdout
        return int(out.strip().split(".")[0])
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


@needs_kernel
def test_the_isa_files_are_in_the_build_where_the_compiler_knows_them():
    """A fault in an ISA file (amx.cpp, amx_int.cpp, vnni.cpp, w8a8.cpp) makes the build fall back to
    the AVX2 kernels alone, and on a CPU with VNNI or AMX their tests then skip instead of failing.
    With gcc 11 or newer, which has every intrinsic those files use, the full build must be the one
    loaded, and on a CPU with AVX-512 VNNI the VNNI tiles must be on."""
    if _compiler_major() < 11:
        pytest.skip("a compiler older than gcc 11 may lack the AMX intrinsics: the fallback is expected")
    assert kernels.available(), kernels.unavailable_reason()
    assert hasattr(torch.ops.tokenleap, "w8a8_linear"), "the kernels were built without the ISA files"
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= kernels.cpu_flags():
        assert kernels.vnni_supported()


def test_pack_unpack_round_trip():
    q = torch.randint(-127, 128, (24, 40), dtype=torch.int8)
    packed = kernels.pack_int8(q)  # [3, 5, 8, 8]
    assert packed.shape == (3, 5, 8, 8) and torch.equal(packed[1, 2, 3], q[8 + 3, 16:24])
    assert torch.equal(kernels.unpack_int8(packed), q)


@needs_kernel
@pytest.mark.parametrize("n,k", [(8, 8), (64, 200), (136, 1024), (48, 2600)])  # 2600: several 1024-k spans
def test_int8_linear_matches_fp64_reference(n, k):
    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) + 0.01
    x = torch.randn(13, k, generator=g)
    y = kernels.int8_linear(x, kernels.pack_int8(q), scale)  # [13, n]
    ref = (x.double() @ q.double().T) * scale.double()  # [13, n]
    tol = 1e-6 * (x.double().abs() @ q.double().abs().T * scale.double()).clamp_min(1)  # fp32 accumulation error
    assert ((y.double() - ref).abs() <= tol * k ** 0.5).all()


@needs_kernel
@pytest.mark.parametrize("k", [520, 2600])
def test_int8_linear_rows_bitwise_independent_of_row_count(k):
    """K = 2600: two whole 1024-k spans and a partial one, whose accumulators are stored and reloaded
    between spans (their values: test_int8_linear_matches_fp64_reference); 1-13 rows take 3-row,
    2-row and 1-row tiles."""
    g = torch.Generator().manual_seed(3)
    q = kernels.pack_int8(torch.randint(-127, 128, (48, k), dtype=torch.int8, generator=g))
    scale = torch.rand(48, generator=g)
    x = torch.randn(13, k, generator=g)
    assert_rows_independent(lambda rows: kernels.int8_linear(rows, q, scale), x)


def assert_rows_independent(product, x: torch.Tensor) -> None:
    """product(x[a:b]) gives each row bitwise what product(that row alone) gives, for every
    prefix of x and one slice from its middle."""
    n = x.shape[0]
    alone = torch.cat([product(x[i : i + 1]) for i in range(n)])  # [n, out]
    for m in range(1, n + 1):
        assert torch.equal(product(x[:m]), alone[:m]), m
    assert torch.equal(product(x[n // 4 : n - 2]), alone[n // 4 : n - 2])


@needs_kernel
def test_int8_layer_pads_odd_output_sizes_and_keeps_fp32_exactness():
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(21, 64, generator=g), torch.randn(21, generator=g)
    layer = Int8Linear.from_float(w, b, torch.float32)
    assert layer.use_kernel and layer.packed.shape == (3, 8, 8, 8) and layer.qweight.shape == (21, 64)
    x = torch.randn(7, 64, generator=g)
    y = layer(x)  # [7, 21]
    assert y.shape == (7, 21)
    assert torch.allclose(y, F.linear(x, layer.dequantized_weight(), b), rtol=1e-5, atol=1e-5)


def test_layer_falls_back_to_torch_kernel_when_unavailable(monkeypatch):
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(32, 64, generator=g), torch.randn(3, 64, generator=g)
    monkeypatch.setitem(kernels._state, "reason", "disabled in this test")
    layer = Int8Linear.from_float(w, None, torch.float32)
    assert not layer.use_kernel and not hasattr(layer, "packed")
    assert torch.allclose(layer(x), F.linear(x, layer.dequantized_weight()), rtol=1e-5, atol=1e-5)


def test_environment_variable_disables_kernels(monkeypatch):
    monkeypatch.setenv("TOKENLEAP_KERNELS", "0")
    assert kernels._reason_unavailable() == "disabled by TOKENLEAP_KERNELS"


@needs_kernel
@pytest.mark.parametrize("m", [1, 5, 6, 13, 64])
def test_int8_gemm_matches_reference(m):
    g = torch.Generator().manual_seed(m)
    q = torch.randint(-127, 128, (32, 520), dtype=torch.int8, generator=g)  # K spans 3 panels of 256
    scale = torch.rand(32, generator=g) + 0.01
    x = torch.randn(m, 520, generator=g)
    y = kernels.int8_gemm(x, kernels.pack_int8(q), scale)  # [m, 32]
    ref = (x.double() @ q.double().T) * scale.double()
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    lin = kernels.int8_linear(x, kernels.pack_int8(q), scale)
    assert torch.allclose(y, lin, rtol=1e-5, atol=1e-5 * lin.abs().max().item())


@needs_kernel
def test_int8_layer_uses_gemm_only_for_prefill_windows(monkeypatch):
    from tokenleap.models import quant

    layer = Int8Linear.from_float(torch.randn(32, 64))
    calls = []
    monkeypatch.setattr(kernels, "int8_gemm", lambda *a: calls.append("gemm") or torch.zeros(a[0].shape[0], 32))
    layer(torch.randn(quant.GEMM_MIN_ROWS, 64))
    layer(torch.randn(quant.GEMM_MIN_ROWS, 64), row_exact=True)  # verification: never the GEMM
    layer(torch.randn(quant.GEMM_MIN_ROWS - 1, 64))
    assert calls == ["gemm"]


@needs_kernel
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_fused_projections_are_bitwise_the_same_model(mode):
    """Joining q/k/v and gate/up into one int8 (int4) layer each changes no bit of the logits."""
    from tokenleap.cache.contiguous import KVCache
    from tokenleap.models.quant import fuse_projections_, quantize_
    from tokenleap.models.transformer import Segment

    from conftest import tiny_model

    def logits(model):
        cache = KVCache(model.config, 1, 32, torch.float32)
        slot = cache.allocate()
        out = model(torch.tensor([3, 1, 4, 1, 5, 9]), [Segment(slot, 0, 6)], cache, row_exact=True).logits
        step = model(torch.tensor([2]), [Segment(slot, 6, 1)], cache, row_exact=True).logits
        return torch.cat([out, step])

    plain = tiny_model("qwen2", seed=6, hidden=64, intermediate=128)  # qwen2: q/k/v carry biases
    quantize_(plain, mode)
    fused = tiny_model("qwen2", seed=6, hidden=64, intermediate=128)
    quantize_(fused, mode)
    assert fuse_projections_(fused) == 2 * fused.config.num_hidden_layers
    attn = fused.model.layers[0].self_attn
    assert attn.qkv is not None and attn.q_proj is None and fused.model.layers[0].mlp.gate_up is not None
    assert torch.equal(logits(plain), logits(fused))


@needs_kernel
def test_fused_rms_norm_and_rope_match_torch_formulas():
    from tokenleap.models.transformer import RMSNorm, Rotary

    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 48, generator=g)
    norm = RMSNorm(48, 1e-6)
    norm.weight.data = torch.randn(48, generator=g)
    want = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.allclose(norm(x), want, rtol=1e-5, atol=1e-6)
    rot = Rotary(16, 10000.0, 64)
    q = torch.randn(5, 3, 16, generator=g)
    pos = torch.tensor([0, 7, 8, 30, 63])
    cos, sin = rot.cos[pos][:, None], rot.sin[pos][:, None]
    want = q * cos + torch.cat([-q[..., 8:], q[..., :8]], dim=-1) * sin
    assert torch.allclose(rot(q.clone(), pos), want, rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("n,k", [(48, 272), (48, 1296)])
def test_bf16_products_exact_to_fp32_and_row_invariant(n, k):
    """K = 1296: two whole 512-k spans and a partial one, whose accumulators are stored and reloaded
    between spans; 1-13 rows take 3-row, 2-row and 1-row tiles."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(13, k, generator=g)
    packed = kernels.pack_bf16(w)
    ref = x.double() @ w.double().T
    tol = 1e-5 * (x.double().abs() @ w.double().abs().T)
    assert ((kernels.bf16_linear(x, packed).double() - ref).abs() <= tol).all()
    assert ((kernels.bf16_gemm(x, packed).double() - ref).abs() <= tol).all()
    assert_rows_independent(lambda rows: kernels.bf16_linear(rows, packed), x)


needs_amx = pytest.mark.skipif(not (HAS_AVX2 and kernels.amx_available()), reason="the CPU has no AMX-BF16")


def test_pack_bf16_amx_places_each_weight_where_the_tiles_read_it():
    w = torch.randn(32, 64).bfloat16()
    p = kernels.pack_bf16_amx(w)  # [N/16, K/32, 16 input pairs, 16 outputs, 2]
    assert p.shape == (2, 2, 16, 16, 2)
    for nb, kb, r, n, e in [(0, 0, 0, 0, 1), (1, 0, 3, 5, 0), (1, 1, 15, 15, 1), (0, 1, 7, 2, 0)]:
        assert p[nb, kb, r, n, e] == w[nb * 16 + n, kb * 32 + 2 * r + e]


@needs_amx
@pytest.mark.parametrize("n,k", [(48, 96), (272, 1536)])
def test_bf16_amx_product_matches_reference_and_is_row_invariant(n, k):
    """Activations rounded to bf16, products summed in float32; 1-40 rows take one or two 16-row
    tile groups and pairs of 16-column blocks plus a last single one (n = 48, 272)."""
    g = torch.Generator().manual_seed(12)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(40, k, generator=g)
    packed = kernels.pack_bf16_amx(w)
    y = kernels.weight_product(x, packed, None, row_exact=True)  # [40, n]
    xr = x.bfloat16().double()
    ref = xr @ w.double().T
    tol = 1e-5 * (xr.abs() @ w.double().abs().T)
    assert ((y.double() - ref).abs() <= tol).all()
    assert_rows_independent(lambda rows: kernels.weight_product(rows, packed, None, row_exact=True), x)
    assert torch.equal(kernels.weight_product(x, packed, None, row_exact=False), y)  # prefill: the same values


@needs_amx
def test_bf16_amx_product_rejects_mismatched_operands():
    packed = kernels.pack_bf16_amx(torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="inputs"):
        torch.ops.tokenleap.bf16_amx_linear(torch.randn(2, 96), packed)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.tokenleap.bf16_amx_linear(torch.randn(2, 64).bfloat16(), packed)


@needs_kernel
def test_bf16_linear_layer_uses_the_kernel():
    from tokenleap.models.linear import Linear

    lin = Linear(64, 32, bias=True).to(torch.bfloat16)
    torch.nn.init.normal_(lin.weight)
    torch.nn.init.normal_(lin.bias)
    x = torch.randn(5, 64).bfloat16()
    y = lin(x, row_exact=True)  # [5, 32] bf16
    assert lin.__dict__["_packed"] is not False and y.dtype == torch.bfloat16
    want = (x.float() @ lin.weight.float().T + lin.bias.float()).bfloat16()
    assert torch.allclose(y.float(), want.float(), rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------------------ int4 (W4A8)


def _int4_operands(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)  # [N, K]
    scale = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()  # [N, K/32], float16 values
    low = (-8 * scale + 0.001 * torch.randn(n, k // 32, generator=g)).half().float()
    return q, scale, low


def _w4a8_reference(x: torch.Tensor, q, scale, low) -> torch.Tensor:
    """What int4_linear states it computes, in float64: x quantized to int8 per 32 inputs (round
    half to even of x * 127 / max|x|), times q * scale + min."""
    m, k = x.shape
    xg = x.reshape(m, k // 32, 32)
    amax = xg.abs().amax(-1, keepdim=True)  # [M, K/32, 1]
    # float32 127 / amax correctly rounded, as the kernel's 127.f / amax (torch's `127 / t` is
    # reciprocal(t) * 127: one ulp off for ~1 value in 4, which flips an xq now and then)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xg * inv)  # [M, K/32, 32]
    xd = (xq.double() * (amax / 127).double()).reshape(m, k)
    w = q.double() * scale.double().repeat_interleave(32, 1) + low.double().repeat_interleave(32, 1)
    return xd @ w.T  # [M, N]


def test_int4_pack_unpack_round_trip():
    q, scale, low = _int4_operands(16, 64, 0)
    packed, sm = kernels.pack_int4(q, scale, low, paired=False)
    assert packed.shape == (2, 8, 8, 4) and sm.shape == (2, 2, 2, 8) and sm.dtype == torch.float16
    # byte (column 3, t=1) of k-step 5 in block 1: q[8+3, 41] low nibble, q[8+3, 45] high nibble
    assert int(packed[1, 5, 3, 1]) == int(q[11, 41]) | (int(q[11, 45]) << 4)
    q2, s2, m2 = kernels.unpack_int4(packed, sm)
    assert torch.equal(q2, q) and torch.equal(s2, scale) and torch.equal(m2, low)
    assert kernels.int4_rows_per_entry(packed) == 8


def test_int4_paired_layout_round_trip():
    """The paired layout: each pair of 8-column blocks' groups alternate (128 bytes of the first
    block, then of the second); scales and mins likewise."""
    q, scale, low = _int4_operands(32, 64, 1)
    packed, sm = kernels.pack_int4(q, scale, low, paired=True)
    assert packed.shape == (2, 2, 2, 128) and sm.shape == (2, 2, 2, 2, 8) and sm.dtype == torch.float16
    # pair 1, group 1, its second block (columns 24-31), k-step 1 (inputs 40-47), column 3, t=1:
    # q[27, 41] in the low nibble, q[27, 45] in the high one
    assert int(packed[1, 1, 1, 1 * 32 + 3 * 4 + 1]) == int(q[27, 41]) | (int(q[27, 45]) << 4)
    assert float(sm[1, 1, 1, 0, 3]) == float(scale[27, 1]) and float(sm[1, 1, 1, 1, 3]) == float(low[27, 1])
    q2, s2, m2 = kernels.unpack_int4(packed, sm)
    assert torch.equal(q2, q) and torch.equal(s2, scale) and torch.equal(m2, low)
    assert kernels.int4_rows_per_entry(packed) == 16
    # the same values as the blocked layout, regrouped
    blocked, bsm = kernels.pack_int4(q, scale, low, paired=False)
    assert torch.equal(packed.reshape(2, 2, 2, 128), blocked.reshape(2, 2, 2, 128).transpose(1, 2))
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.pack_int4(q[:8], scale[:8], low[:8], paired=True)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 7])
def test_int4_layouts_give_the_same_bits(rows, vnni):
    """The AVX2 kernel's blocked and paired tiles, and (where the CPU has them) the VNNI tiles on the
    paired layout, compute bitwise the same values, bias included."""
    q, scale, low = _int4_operands(48, 160, rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(48, generator=torch.Generator().manual_seed(48))
    blocked = kernels.int4_linear(x, *kernels.pack_int4(q, scale, low, paired=False), bias)
    paired = kernels.pack_int4(q, scale, low, paired=True)
    assert torch.equal(kernels.int4_linear(x, *paired, bias), blocked)  # VNNI off (the fixture)
    if kernels.vnni_supported():
        vnni(True)
        assert torch.equal(kernels.int4_linear(x, *paired, bias), blocked)


@needs_kernel
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (64, 1024)])
def test_int4_linear_matches_its_formula(n, k):
    q, scale, low = _int4_operands(n, k, n + k)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(k))
    x[2, :32] = 0  # an all-zero group quantizes to zeros with scale 0
    y = kernels.int4_linear(x, *kernels.pack_int4(q, scale, low))  # [9, n]
    ref = _w4a8_reference(x, q, scale, low)
    mag = (x.double().abs() @ (q.double() * scale.double().repeat_interleave(32, 1)).T).clamp_min(1)
    assert ((y.double() - ref).abs() <= 1e-5 * mag).all()
    # and it is a close approximation of the float product
    w = q.float() * scale.repeat_interleave(32, 1) + low.repeat_interleave(32, 1)
    assert ((y - x @ w.T).norm() / (x @ w.T).norm()) < 0.02


@needs_kernel
@pytest.mark.parametrize("n,paired", [(40, False), (48, False), (16, True), (48, True)])
def test_int4_linear_rows_bitwise_independent_of_row_count(n, paired):
    packed, sm = kernels.pack_int4(*_int4_operands(n, 320, 7), paired=paired)
    x = torch.randn(11, 320, generator=torch.Generator().manual_seed(8))  # every tile shape
    assert_rows_independent(lambda rows: kernels.int4_linear(rows, packed, sm), x)


needs_amx_int8 = pytest.mark.skipif(not (HAS_AVX2 and kernels.amx_available() and "amx_int8" in kernels.cpu_flags()),
                                    reason="the CPU has no AMX-INT8")


@pytest.fixture
def amx_int8_rows():
    """Set which int4 / int6 products take the AMX tiles within a test; the loaded setting comes
    back after."""
    before = kernels.set_amx_int8_rows(0)
    yield kernels.set_amx_int8_rows
    kernels.set_amx_int8_rows(before)


@needs_amx_int8
@pytest.mark.parametrize("n,k", [(48, 96), (64, 160), (272, 1536)])  # an odd / even number of 32-input groups
def test_int4_on_amx_tiles_gives_the_avx2_kernels_bits(n, k, amx_int8_rows):
    """TDPBSUD's exact group sums and int4.cpp's float chain: every row count (one row, a 16-row
    pass, passes with a tail) gives bitwise the AVX2 kernel's values on the paired layout (a pass
    takes one pair of 8-column blocks)."""
    q, scale, low = _int4_operands(n, k, n * k)
    packed, sm = kernels.pack_int4(q, scale, low, paired=True)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(k))
    x[3, 32:64] = 0
    amx_int8_rows(0)
    avx2 = kernels.int4_linear(x, packed, sm)  # [40, n]
    amx_int8_rows(1)
    for m in (1, 2, 5, 16, 17, 33, 40):
        assert torch.equal(kernels.int4_linear(x[:m], packed, sm), avx2[:m]), m
    assert_rows_independent(lambda rows: kernels.int4_linear(rows, packed, sm), x[:20])
    ref = _w4a8_reference(x, q, scale, low)
    mag = (x.double().abs() @ (q.double() * scale.double().repeat_interleave(32, 1)).T).clamp_min(1)
    assert ((avx2.double() - ref).abs() <= 1e-5 * mag).all()


@needs_amx_int8
def test_amx_int8_rows_setting_round_trips(amx_int8_rows):
    assert amx_int8_rows(7) == 0
    assert amx_int8_rows(-3) == 7  # negative: off, like 0
    assert amx_int8_rows(0) == 0


needs_vnni = pytest.mark.skipif(not (HAS_AVX2 and kernels.vnni_supported()),
                                reason="the CPU has no AVX-512 VNNI")


@pytest.fixture
def vnni():
    """Turn int4 / int6 products' AVX-512 VNNI tiles on or off within a test (starting off); the
    loaded setting comes back after."""
    before = kernels.set_vnni(False)
    yield kernels.set_vnni
    kernels.set_vnni(before)


@needs_vnni
@pytest.mark.parametrize("n,k", [(48, 96), (64, 160), (272, 1536), (16, 4096)])  # odd / even group counts; long rows
def test_int4_on_vnni_tiles_gives_the_avx2_kernels_bits(n, k, vnni):
    """vpdpbusd's exact group sums and int4.cpp's float chain: every row count (tiles of 1-8 rows,
    passes with a tail, each over one pair of column blocks) gives bitwise the AVX2 kernel's values
    on the paired layout, bias included."""
    q, scale, low = _int4_operands(n, k, n * k + 1)
    packed, sm = kernels.pack_int4(q, scale, low, paired=True)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(k + 1))
    x[3, 32:64] = 0
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    assert vnni(False) is False  # the fixture turned it off
    avx2 = kernels.int4_linear(x, packed, sm, bias)  # [20, n]
    assert vnni(True) is False
    for m in range(1, 21):
        assert torch.equal(kernels.int4_linear(x[:m], packed, sm, bias), avx2[:m]), m
    assert_rows_independent(lambda rows: kernels.int4_linear(rows, packed, sm), x)
    assert vnni(False) is True


def test_vnni_setting_is_off_where_the_cpu_lacks_it(vnni):
    """Turning the tiles on reports them on only where the CPU has VNNI; off is always off."""
    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason()}")
    vnni(True)
    assert vnni(False) is kernels.vnni_supported()
    assert vnni(False) is False


@needs_kernel
def test_int4_layer_on_kernel_and_float32_reference_on_torch():
    from tokenleap.models.quant import Int4Linear

    g = torch.Generator().manual_seed(9)
    w, x = torch.randn(32, 128, generator=g), torch.randn(4, 128, generator=g)
    fast, exact = Int4Linear.from_float(w), Int4Linear.from_float(w, compute_dtype=torch.float32)
    assert fast.use_kernel and not exact.use_kernel and fast.packed.dtype == torch.uint8
    deq = fast.dequantized_weight()  # [32, 128] from float16 scale / min
    y = fast(x)
    q, s, m = kernels.unpack_int4(fast.packed, fast.scales_and_mins)
    torch.testing.assert_close(y.double(), _w4a8_reference(x, q, s, m), rtol=1e-5, atol=1e-5)
    assert ((y - x @ deq.T).norm() / (x @ deq.T).norm()) < 0.02
    assert ((exact(x) - x @ w.T).norm() / (x @ w.T).norm()) < 0.15


# ------------------------------------------------------------------------------ attention rows


@pytest.fixture(params=[False, True], ids=["avx2", "avx512"])
def attention_kernel(request):
    """Each attention test once on the AVX2 kernel and once on the AVX-512 one (where the CPU has
    it); the loaded setting comes back after."""
    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason()}")
    if request.param and not kernels.attention512_supported():
        pytest.skip("the CPU has no AVX-512")
    before = kernels.set_attention512(request.param)
    yield request.param
    kernels.set_attention512(before)


@needs_kernel
@pytest.mark.parametrize("heads,kv,hd,pos0,rows", [(12, 2, 128, 37, 6), (4, 4, 24, 0, 9), (6, 3, 64, 13, 1),
                                                   (2, 1, 256, 21, 17)])
def test_attend_rows_matches_sdpa_and_is_row_invariant(heads, kv, hd, pos0, rows, attention_kernel):
    g = torch.Generator().manual_seed(hd + rows)
    length = pos0 + rows
    q = torch.randn(rows, heads, hd, generator=g)
    k = torch.randn(kv, length + 5, hd, generator=g)[:, :length]  # strided views, like a cache's
    v = torch.randn(kv, length + 5, hd, generator=g)[:, :length]
    out = kernels.attend_rows(q, k, v, pos0, hd ** -0.5)  # [rows, heads, hd]
    group = heads // kv
    for t in range(rows):  # row t sees positions 0 .. pos0 + t
        n = pos0 + t + 1
        want = F.scaled_dot_product_attention(q[t].view(1, kv, group, hd), k[None, :, :n], v[None, :, :n])
        torch.testing.assert_close(out[t], want.reshape(heads, hd), rtol=1e-5, atol=1e-5)
        assert torch.equal(kernels.attend_rows(q[t : t + 1], k[:, :n], v[:, :n], pos0 + t, hd ** -0.5)[0], out[t])


@needs_kernel
@pytest.mark.parametrize("heads,kv,hd", [(12, 2, 128), (7, 1, 64), (4, 4, 32)])
def test_attend_rows_shared_keys_give_each_row_its_own_result_at_any_thread_count(heads, kv, hd, attention_kernel):
    """Rows of one call share their common keys (read once for all rows and heads of a unit; units
    split by thread count): every row and thread count gives the row's result alone, bitwise."""
    g = torch.Generator().manual_seed(heads * hd)
    pos0, rows = 203, 21  # more rows than one unit takes; keys not a multiple of 8
    q = torch.randn(rows, heads, hd, generator=g)
    k = torch.randn(kv, pos0 + rows + 3, hd, generator=g)[:, : pos0 + rows]
    v = torch.randn(kv, pos0 + rows + 3, hd, generator=g)[:, : pos0 + rows]
    alone = [kernels.attend_rows(q[t : t + 1], k[:, : pos0 + t + 1], v[:, : pos0 + t + 1], pos0 + t, hd ** -0.5)[0]
             for t in range(rows)]
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            out = kernels.attend_rows(q, k, v, pos0, hd ** -0.5)
            for t in range(rows):
                assert torch.equal(out[t], alone[t]), (n, t)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_attention_kernels_agree_and_the_avx512_setting_is_off_where_the_cpu_lacks_it():
    """The AVX-512 kernel sums a score's products in another order than the AVX2 one: the two agree
    to float rounding, and only where the CPU has AVX-512 (and the head a multiple of 16 floats)
    does the setting take effect."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(5, 12, 128, generator=g)
    k, v = torch.randn(2, 305, 128, generator=g), torch.randn(2, 305, 128, generator=g)
    before = kernels.set_attention512(False)
    try:
        avx2 = kernels.attend_rows(q, k, v, 300, 128 ** -0.5)
        assert kernels.set_attention512(True) is False
        wide = kernels.attend_rows(q, k, v, 300, 128 ** -0.5)
        assert kernels.set_attention512(False) is kernels.attention512_supported()
        torch.testing.assert_close(wide, avx2, rtol=1e-5, atol=1e-6)
        if kernels.attention512_supported():
            assert not torch.equal(wide, avx2)  # the setting took effect: another summation order
            kernels.set_attention512(True)  # a head of 24 floats: the AVX2 kernel either way
            q24, k24, v24 = q[..., :24].contiguous(), k[..., :24].contiguous(), v[..., :24].contiguous()
            on = kernels.attend_rows(q24, k24, v24, 300, 24 ** -0.5)
            kernels.set_attention512(False)
            assert torch.equal(on, kernels.attend_rows(q24, k24, v24, 300, 24 ** -0.5))
    finally:
        kernels.set_attention512(before)


@needs_kernel
def test_attend_rows_takes_zero_rows():
    k = v = torch.randn(2, 5, 32)
    assert kernels.attend_rows(torch.randn(0, 4, 32), k, v, 5, 32 ** -0.5).shape == (0, 4, 32)


@needs_kernel
def test_silu_mul_matches_torch_on_strided_halves():
    gu = torch.randn(5, 96, generator=torch.Generator().manual_seed(11)) * 30  # large |g|: no overflow
    gate, up = gu.chunk(2, dim=-1)  # [5, 48] views, row stride 96
    torch.testing.assert_close(kernels.silu_mul(gate, up), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@needs_kernel
def test_int4_linear_adds_bias_after_the_product():
    q, scale, low = _int4_operands(16, 64, 12)
    packed, sm = kernels.pack_int4(q, scale, low)
    x, b = torch.randn(3, 64), torch.randn(16)
    assert torch.equal(kernels.int4_linear(x, packed, sm, b), kernels.int4_linear(x, packed, sm) + b)


@needs_kernel
def test_rope_store_attend_equals_rope_cache_write_and_attend_rows():
    g = torch.Generator().manual_seed(13)
    heads, kv, hd, pos0, rows, max_len = 6, 2, 32, 9, 4, 20
    qkv = torch.randn(rows, (heads + 2 * kv) * hd, generator=g)
    q, k, v = qkv.split([heads * hd, kv * hd, kv * hd], dim=-1)  # strided views, as the model has them
    q, k, v = q.view(rows, heads, hd), k.view(rows, kv, hd), v.view(rows, kv, hd)
    angles = torch.randn(64, hd, generator=g)
    cos, sin = angles.cos(), angles.sin()
    history = torch.randn(2, kv, max_len, hd, generator=g)
    ks, vs = history[0].clone(), history[1].clone()  # one cache slot, positions < pos0 already filled
    out = kernels.rope_store_attend(q, k, v, cos, sin, ks, vs, pos0, hd ** -0.5)
    positions = torch.arange(pos0, pos0 + rows)
    k_ref, v_ref = history[0].clone(), history[1].clone()
    k_ref[:, pos0 : pos0 + rows] = kernels.rope_(k.contiguous(), cos, sin, positions).transpose(0, 1)
    v_ref[:, pos0 : pos0 + rows] = v.transpose(0, 1)
    want = kernels.attend_rows(kernels.rope_(q.contiguous(), cos, sin, positions), k_ref[:, : pos0 + rows],
                               v_ref[:, : pos0 + rows], pos0, hd ** -0.5)
    assert torch.equal(ks, k_ref) and torch.equal(vs, v_ref) and torch.equal(out, want)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_dequantized_rows_are_the_weights_rows_and_the_draft_head_reads_only_those(kernel, monkeypatch):
    """``dequantized_rows`` unpacks only the blocks holding the rows asked for, bitwise the rows of
    ``dequantized_weight``; the draft's reduced head built from them equals one built from the
    whole head (its shared subset at int4, a prompt's extra rows at int8)."""
    from tokenleap.models.quant import Int4Linear
    from tokenleap.spec.proposers.draft_head import ReducedVocabHead
    if kernel and not HAS_AVX2:
        pytest.skip("the kernel needs AVX2 + FMA")
    if not kernel:
        monkeypatch.setitem(kernels._state, "reason", "disabled in this test")
    g = torch.Generator().manual_seed(9)
    ids = torch.tensor([37, 0, 5, 5, 36, 17])  # repeats, several rows of one block, unsorted
    for layer in (Int8Linear.from_float(torch.randn(38, 64, generator=g)),
                  Int4Linear.from_float(torch.randn(48, 64, generator=g))):
        assert layer.use_kernel == kernel
        assert torch.equal(layer.dequantized_rows(ids), layer.dequantized_weight()[ids])
    head = Int8Linear.from_float(torch.randn(80, 64, generator=g))
    reduced = ReducedVocabHead(head, static_size=24, special_ids=[79])
    full = Int8Linear.from_float(head.dequantized_weight())  # the whole head at int8, then the subset
    static = torch.tensor(list(range(24)) + [79])
    w = full.qweight[static].float() * full.weight_scales()[static].float()[:, None]
    x = torch.randn(3, 64, generator=g)
    want = Int4Linear.from_float(F.pad(w, (0, 0, 0, -25 % 16)))(x)[:, :25] if kernel else \
        Int8Linear(full.qweight[static], full.weight_scales()[static])(x)
    assert torch.equal(reduced._static(x), want)
    extra = torch.tensor([40, 60])
    assert torch.equal(reduced._rows(extra)(x), Int8Linear(full.qweight[extra], full.weight_scales()[extra])(x))
