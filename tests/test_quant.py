"""Weight-only int8 / int4 layers: accuracy, bitwise row invariance, GGUF 4-bit repacking, sizes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokenleap import kernels
from tokenleap.cache.contiguous import KVCache
from tokenleap.config import ConfigError
from tokenleap.models.build import build_transformer
from tokenleap.models.linear import Linear
from tokenleap.models.quant import (Int4Linear, Int8Linear, int4_from_gguf_q4, quantize_, quantize_from_gguf_,
                                    weight_bytes)
from tokenleap.models.transformer import Segment

from conftest import assert_block_rows_equal_steps, random_weights, tiny_config, tiny_model

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
SHAPE = dict(hidden=128, intermediate=256)  # every projection fits the int4 kernel (out % 16, in % 32)


def run(model, cache, slot, tokens, start, row_exact=False):
    seg = [Segment(slot=slot, pos_start=start, length=len(tokens))]
    return model(torch.tensor(tokens), seg, cache, row_exact=row_exact).logits


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


# ------------------------------------------------------------------------------------ layers


@pytest.mark.parametrize("kind,bound", [("int8", 0.02), ("int4", 0.15)])
@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float32])
def test_layer_close_to_float(kind, bound, compute):
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(96, 256, generator=g), torch.randn(96, generator=g), torch.randn(5, 256, generator=g)
    layer = (Int8Linear.from_float(w, b, compute) if kind == "int8" else Int4Linear.from_float(w, b, 32, compute))
    y = layer(x)  # [5, 96]
    assert y.dtype == x.dtype and y.shape == (5, 96)
    assert rel_err(y, F.linear(x, w, b)) < bound
    # the kernel multiplies by exactly dequantized_weight() (up to activation rounding)
    xr = x.to(compute).float()
    assert rel_err(y, F.linear(xr, layer.dequantized_weight(), b)) < (1e-5 if compute == torch.float32 else 1e-2)


@pytest.mark.parametrize("kernels_on", [True, False])
@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float32])
def test_int8_layers_of_any_input_width(monkeypatch, kernels_on, compute):
    """Inputs that are not a multiple of 16 (or 8): torch's int8 kernel gave wrong values or crashed
    on them; they multiply by exactly ``dequantized_weight()``, and each row alone as in a block."""
    if not kernels_on:
        monkeypatch.setattr(kernels, "available", lambda: False)
    g = torch.Generator().manual_seed(4)
    for k in (60, 200, 24):
        w, b, x = torch.randn(40, k, generator=g), torch.randn(40, generator=g), torch.randn(5, k, generator=g)
        layer = Int8Linear.from_float(w, b, compute)
        y = layer(x, row_exact=True)  # [5, 40]
        xr = x.to(compute).float() if not layer.use_kernel else x
        assert rel_err(y, F.linear(xr, layer.dequantized_weight(), b)) < (1e-5 if compute == torch.float32 else 1e-2)
        assert all(torch.equal(layer(x[i:i + 1], row_exact=True)[0], y[i]) for i in range(5)), k


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_group_sizes_and_constant_groups(group_size):
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(1))
    w[3] = 0.25  # an all-equal row must decode exactly
    layer = Int4Linear.from_float(w, None, group_size, torch.float32)
    deq = layer.dequantized_weight()  # [32, 256]
    assert torch.equal(deq[3], w[3])
    step = (w.view(32, -1, group_size).amax(-1) - w.view(32, -1, group_size).amin(-1)) / 15  # [32, groups]
    assert ((deq - w).abs().view(32, -1, group_size) <= step[..., None] * 0.5 + 1e-6).all()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_many_rows_quantized_in_chunks(kind):
    w = torch.randn(8192 + 48, 64, generator=torch.Generator().manual_seed(2))  # two row chunks
    layer = Int8Linear.from_float(w) if kind == "int8" else Int4Linear.from_float(w, None, 32, torch.float32)
    err = (layer.dequantized_weight() - w).abs().amax(dim=1)  # [rows]
    assert (err <= w.abs().amax(dim=1) * (0.005 if kind == "int8" else 0.07)).all()


def test_int4_shape_constraints_are_errors():
    with pytest.raises(ConfigError, match="multiple of 16"):
        Int4Linear.from_float(torch.randn(24, 64))
    with pytest.raises(ConfigError, match="group size"):
        Int4Linear.from_float(torch.randn(32, 96), group_size=64)


# ------------------------------------------------------------------------------- whole model


@pytest.mark.parametrize("mode,bound", [("int8", 0.04), ("int4", 0.35)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_logits_close_to_float(mode, bound, arch):
    ref = tiny_model(arch, seed=2, **SHAPE)
    model = tiny_model(arch, seed=2, **SHAPE)
    report = quantize_(model, mode)
    assert report.kept_float == () and len(report.quantized) == 2 * 7 + 1
    assert not any(isinstance(m, Linear) for m in model.modules())
    ids = list(range(5, 25))
    caches = [KVCache(m.config, 1, 64, torch.float32) for m in (ref, model)]
    want, got = (run(m, c, c.allocate(), ids, 0) for m, c in zip((ref, model), caches))
    assert got.dtype == torch.float32 and rel_err(got, want) < bound


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_step_equals_row_of_block_bitwise(mode, dtype):
    model = tiny_model("qwen2", seed=5, dtype=dtype, **SHAPE)  # qwen2: q/k/v biases
    quantize_(model, mode)
    assert_block_rows_equal_steps(model, dtype)


def test_unknown_mode_names_valid_choices():
    model = tiny_model(**SHAPE)
    with pytest.raises(ConfigError, match="none, int8, int4"):
        quantize_(model, "int3")
    with pytest.raises(ConfigError, match="group size"):
        quantize_(model, "int4", group_size=16)
    assert quantize_(model, "none").bytes_after == weight_bytes(model)
    assert isinstance(model.lm_head, Linear)


@pytest.mark.parametrize("tie", [False, True])
def test_weight_bytes_shrink(tie):
    sizes = {}
    for mode in ("none", "int8", "int4"):
        model = tiny_model("qwen2", seed=1, tie=tie, **SHAPE)
        before = weight_bytes(model)
        params = {id(p): p for p in model.parameters()}  # tied weight counted once
        assert before == sum(p.numel() * p.element_size() for p in params.values())
        report = quantize_(model, mode)
        assert report.bytes_before == before and report.bytes_after == weight_bytes(model)
        sizes[mode] = report.bytes_after
    # linear weights dominate the tiny model; the float embedding (and lm_head when not tied) remains
    assert sizes["none"] / sizes["int8"] > (3.0 if tie else 3.4)
    assert sizes["none"] / sizes["int4"] > (4.0 if tie else 5.0)


def test_skip_lm_head_and_fallback_for_unsupported_shapes():
    model = tiny_model("llama", seed=3, vocab=100, **SHAPE)  # 100 output rows: not a multiple of 16
    report = quantize_(model, "int4")
    assert [n for n, _ in report.kept_float] == ["lm_head"] and "multiple of 16" in report.kept_float[0][1]
    assert isinstance(model.lm_head, Linear) and "lm_head" in str(report)
    model2 = tiny_model("llama", seed=3, **SHAPE)
    quantize_(model2, "int8", skip_lm_head=True)
    assert isinstance(model2.lm_head, Linear) and isinstance(model2.model.layers[0].mlp.up_proj, Int8Linear)
    cache = KVCache(model.config, 1, 32, torch.float32)
    assert torch.isfinite(run(model, cache, cache.allocate(), [1, 2, 3], 0)).all()


# ------------------------------------------------------------------------------ GGUF repacking


def _random_blocks(qtype, n: int, k: int, seed: int) -> np.ndarray:
    """Valid random GGUF blocks: random nibbles and packed scales, finite fp16 headers."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)  # [out, blocks, bytes]
    halves = 2 if qtype == T.Q4_0 else 4  # d (and m / dmin) as finite fp16
    hdr = rng.uniform(-0.02, 0.02, (n, k // block, halves // 2)).astype(np.float16)
    raw[..., :halves] = hdr.view(np.uint8)
    return raw.reshape(n, -1)


def _check_repack(qtype, raw, shape, whole_weight=True):
    deq = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)).reshape(shape)
    q, scales, zeros = int4_from_gguf_q4(qtype, raw, shape)  # [out, in] uint8, [out, in/32] x2
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scales.shape == (shape[0], shape[1] // 32)
    exact = Int4Linear.from_gguf(qtype, raw, shape, compute_dtype=torch.float32)
    if whole_weight:  # element by element (costs an [in, in] x W^T product)
        torch.testing.assert_close(exact.dequantized_weight(), deq, rtol=1e-6, atol=1e-7)
    x = torch.randn(3, shape[1], generator=torch.Generator().manual_seed(0))
    want = F.linear(x, deq)  # [3, out]
    assert rel_err(exact(x), want) < 1e-5
    fast = Int4Linear.from_gguf(qtype, raw, shape)  # bf16 scales / zeros / activations
    assert rel_err(fast(x), want) < 2e-2
    if whole_weight:
        assert rel_err(fast.dequantized_weight(), deq) < 1e-2


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1])
def test_repack_gguf_quantize_roundtrip(qtype):
    w = 0.05 * np.random.default_rng(4).standard_normal((48, 256)).astype(np.float32)
    _check_repack(qtype, gguf.quants.quantize(w, qtype), (48, 256))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K])
def test_repack_random_blocks(qtype):
    _check_repack(qtype, _random_blocks(qtype, 32, 512, seed=int(qtype)), (32, 512))


def test_repack_rejects_other_types():
    with pytest.raises(ValueError, match="Q4_0, Q4_1 or Q4_K"):
        int4_from_gguf_q4(T.Q8_0, np.zeros((16, 34), np.uint8), (16, 32))


def test_repack_real_q4k_tensor():
    from tokenleap.models.catalog import default_cache_dir
    path = default_cache_dir() / "gguf" / "qwen2.5-coder-1.5b-instruct.gguf"  # joined by the catalog
    if not path.exists():
        pytest.skip(f"{path} not present")
    from tokenleap.models.gguf import GGUFFile
    with GGUFFile(path) as f:
        qtype, raw, shape = f.raw_tensor("model.layers.0.self_attn.k_proj.weight")  # Q4_K [256, 1536]
        assert qtype == T.Q4_K
        _check_repack(qtype, np.array(raw), shape, whole_weight=False)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                                  "model.layers.0.mlp.down_proj.weight"])
def test_repack_real_q4_1_llama_tensor(smollm2_gguf, name):
    """SmolLM2 is llama: q/k rows come back un-permuted from raw_tensor and must still match."""
    from tokenleap.models.gguf import GGUFFile
    with GGUFFile(smollm2_gguf) as f:
        qtype, raw, shape = f.raw_tensor(name)
        assert qtype == T.Q4_1
        layer = Int4Linear.from_gguf(qtype, np.array(raw), shape, compute_dtype=torch.float32)
        x = torch.randn(2, shape[1], generator=torch.Generator().manual_seed(0))
        assert rel_err(layer(x), F.linear(x, f.tensor(name))) < 1e-5


class FakeGGUF:
    """The part of GGUFFile that quantize_from_gguf_ uses, holding blocks made by gguf.quants."""

    def __init__(self, weights: dict[str, torch.Tensor], types: dict[str, object]):
        self.raw = {n: (t, gguf.quants.quantize(weights[n].numpy(), t)) for n, t in types.items()}
        self.hf_to_gguf = {n: n for n in self.raw}

    def raw_tensor(self, name):
        qtype, raw = self.raw[name]
        return qtype, raw, tuple(int(s) for s in gguf.quants.quant_shape_from_byte_shape(raw.shape, qtype))

    def dequantized(self) -> dict[str, torch.Tensor]:
        return {n: torch.from_numpy(gguf.quants.dequantize(r, t).astype(np.float32)) for n, (t, r) in self.raw.items()}


@pytest.mark.parametrize("tie", [False, True])
def test_quantize_from_gguf_matches_dequantized_model(tie):
    cfg = tiny_config("qwen2", tie=tie, **SHAPE)
    weights = random_weights(cfg, seed=6)
    types = {n: (T.Q4_1 if ".mlp." in n else T.Q4_0) for n in weights if n.endswith("proj.weight")}
    types["model.layers.1.mlp.down_proj.weight"] = T.Q8_0  # not 4-bit: quantized again with `other`
    types["model.embed_tokens.weight" if tie else "lm_head.weight"] = T.Q4_0
    fake = FakeGGUF(weights, types)
    weights.update(fake.dequantized())
    ref = build_transformer(cfg, weights, torch.float32)
    model = build_transformer(cfg, weights, torch.float32)
    report = quantize_from_gguf_(model, fake, other="int8", compute_dtype=torch.float32)
    assert report.kept_float == () and isinstance(model.model.layers[1].mlp.down_proj, Int8Linear)
    assert isinstance(model.lm_head, Int4Linear) and isinstance(model.model.layers[0].self_attn.q_proj, Int4Linear)
    if tie:  # the embedding stays float and unchanged
        assert torch.equal(model.model.embed_tokens.weight, ref.model.embed_tokens.weight)
    layer = model.model.layers[0].self_attn.k_proj
    torch.testing.assert_close(layer.dequantized_weight(), weights["model.layers.0.self_attn.k_proj.weight"],
                               rtol=1e-6, atol=1e-7)
    ids = list(range(4, 20))
    caches = [KVCache(cfg, 1, 64, torch.float32) for _ in range(2)]
    want, got = (run(m, c, c.allocate(), ids, 0) for m, c in zip((ref, model), caches))
    assert rel_err(got, want) < 0.02  # only the Q8_0 layer is re-quantized (int8); the 4-bit ones are exact


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_bfloat16_computes_in_float32_activations(smollm2_gguf, tmp_path, monkeypatch, quant):
    """--dtype bfloat16 with tokenleap's kernels (any CPU: they take float32 activations, and round
    them to bf16 themselves on AMX tiles): the weights stay bf16 (or quantized), the activations
    (norms, KV cache) are float32, and a bf16 weight matrix is kept once, packed for the kernel --
    for AMX tiles where the CPU has them. Greedy decoding is unchanged by it."""
    from tokenleap.models import pretrained as loading
    from tokenleap.config import SamplingParams
    from tokenleap.spec.engine import Engine
    if not kernels.available():
        pytest.skip("tokenleap's kernels are not available here")
    loaded = loading.load_model(smollm2_gguf, dtype="bfloat16", quant=quant, cache_dir=tmp_path)
    model = loaded.model
    assert loaded.dtype == torch.bfloat16 and model.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    proj = model.model.layers[0].mlp.down_proj
    if quant == "none":
        assert isinstance(proj, Linear) and proj.weight.numel() == 0  # only the packed copy is left
        assert proj.__dict__["_packed"].dim() == (5 if kernels.amx_available() else 4)
    else:
        assert isinstance(proj, Int4Linear)
    monkeypatch.setattr(kernels, "available", lambda: False)  # the plain bf16 model, for reference
    ref = loading.load_model(smollm2_gguf, dtype="bfloat16", quant=quant, cache_dir=tmp_path).model
    monkeypatch.undo()
    assert ref.dtype == torch.bfloat16
    ids = loaded.tokenizer.encode("def fibonacci(n):")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    got = [s.generated for s, _ in Engine(model, loaded.tokenizer, max_len=64).generate(ids, params)][-1]
    want = [s.generated for s, _ in Engine(ref, loaded.tokenizer, max_len=64).generate(ids, params)][-1]
    assert len(got) == 12 and got[:6] == want[:6]  # float32 activations round differently late, if at all
