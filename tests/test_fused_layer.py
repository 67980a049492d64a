"""The compiled whole-layer step (``kernels.decoder_layer``) is bitwise the Python layers."""
from __future__ import annotations

import pytest
import torch

from tokenleap import kernels
from tokenleap.cache.contiguous import CacheFullError, KVCache
from tokenleap.models.backend import Backend
from tokenleap.models.build import float32_activations_
from tokenleap.models.fused_layer import layer_plan
from tokenleap.models.hugepages import move_weights_, on_huge_pages
from tokenleap.models.int6 import Int6Linear
from tokenleap.models.linear import Linear
from tokenleap.models.qlinear import Int4Linear, Int8Linear
from tokenleap.models.quant import fuse_projections_, quantize_
from tokenleap.models.transformer import Segment

from conftest import tiny_model

needs_kernel = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                  reason="the kernels need AVX2 + FMA")


def _model(arch: str, mode: str, join: bool, seed: int = 3):
    model = tiny_model(arch, seed=seed, hidden=64, intermediate=256, layers=3)  # down_proj: in % 256 for int6
    if mode == "mixed":  # int4 with an int8 v_proj and a 6-bit down_proj, as Q4_K_M files mix them
        quantize_(model, "int4")
        for i, block in enumerate(model.model.layers):
            attn, mlp = block.self_attn, block.mlp
            attn.v_proj = Int8Linear.from_float(attn.v_proj.dequantized_weight(), attn.v_proj.bias)
            n, k = mlp.down_proj.out_features, mlp.down_proj.in_features
            g = torch.Generator().manual_seed(i)
            mlp.down_proj = Int6Linear(torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=g),
                                       torch.randint(-64, 64, (n, k // 16), generator=g).to(torch.int8),
                                       torch.full((n, k // 256), 2e-3))
    elif mode == "bf16":  # bf16 weights, float32 activations (what --dtype bfloat16 loads on AVX2 CPUs)
        model = float32_activations_(tiny_model(arch, seed=seed, hidden=64, intermediate=256, layers=3,
                                                dtype=torch.bfloat16))
    else:
        quantize_(model, mode)
    if join:
        fuse_projections_(model)
    return model


def _steps(model, fused: bool, cache=None):
    """Prefill two sequences, then a one-row step, a row-exact block and a two-sequence block."""
    model.use_fused_layers = fused
    return _run(model, cache)


def _run(model, cache=None):
    """``_steps`` on the model as it stands (its use_fused_layers untouched)."""
    cache = cache if cache is not None else KVCache(model.config, 2, 64, torch.float32)
    a, b = cache.allocate(), cache.allocate()
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, model.config.vocab_size, (40,), generator=g)
    outs = [model(toks[:20], [Segment(a, 0, 12), Segment(b, 0, 8, 12)], cache).logits]
    outs.append(model(toks[20:21], [Segment(a, 12, 1)], cache).logits)
    outs.append(model(toks[21:26], [Segment(a, 13, 5)], cache, row_exact=True).logits)
    outs.append(model(toks[26:33], [Segment(a, 18, 3), Segment(b, 8, 4, 3)], cache, row_exact=True).logits)
    return outs, cache


@needs_kernel
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("mode,join", [("int4", True), ("int4", False), ("int8", True), ("mixed", True),
                                       ("bf16", False), ("bf16", True), ("w8a8", True), ("w8a8", False)])
def test_fused_layers_bitwise_equal_python_layers(arch, mode, join):
    if mode == "w8a8" and not kernels.w8a8_available():
        pytest.skip("W8A8 products need AMX-INT8 tiles")
    model = _model(arch, mode, join)
    assert all(layer_plan(b) is not None for b in model.model.layers)
    ref, ref_cache = _steps(model, fused=False)
    got, got_cache = _steps(model, fused=True)
    for r, o in zip(ref, got):
        assert torch.equal(r, o)
    for r, o in zip(ref_cache.k + ref_cache.v, got_cache.k + got_cache.v):
        assert torch.equal(r, o)


@needs_kernel
def test_fused_path_is_taken_for_decode_rows(monkeypatch):
    """The kernel runs for one-row and row-exact steps (not for prefill windows); a float layer
    has no plan, so a float model keeps the Python layers."""
    from tokenleap import kernels

    calls = []
    real = kernels.decoder_layer
    monkeypatch.setattr(kernels, "decoder_layer", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = _model("qwen2", "int4", True)
    cache = KVCache(model.config, 1, 32, torch.float32)
    slot = cache.allocate()
    model(torch.arange(6), [Segment(slot, 0, 6)], cache)
    assert calls == []
    model(torch.tensor([7]), [Segment(slot, 6, 1)], cache)
    assert len(calls) == model.config.num_hidden_layers
    assert layer_plan(tiny_model("qwen2").model.layers[0]) is None


@needs_kernel
def test_plan_follows_replaced_modules():
    model = _model("qwen2", "int4", join=False)
    block = model.model.layers[0]
    before = layer_plan(block)
    assert before.ints[3:5] == (3, 2)  # separate q/k/v and gate/up
    fuse_projections_(model)
    after = layer_plan(block)
    assert after.ints[3:5] == (1, 1) and after is not before


@needs_kernel
def test_fused_step_past_the_cache_raises_cache_full():
    model = _model("llama", "int4", True)
    cache = KVCache(model.config, 1, 8, torch.float32)
    slot = cache.allocate()
    model(torch.arange(8), [Segment(slot, 0, 8)], cache)
    with pytest.raises(CacheFullError):
        model(torch.tensor([1]), [Segment(slot, 8, 1)], cache)


@needs_kernel
@pytest.mark.parametrize("block_size,mode", [(16, "mixed"), (5, "mixed"), (5, "w8a8")])
def test_fused_layers_on_a_paged_cache_equal_the_contiguous_cache(block_size, mode):
    """The paged path (keys / values addressed through block tables) gives bitwise the logits of
    the contiguous cache, with several sequences, including across block boundaries."""
    from tokenleap.cache.paged import PagedKVCache

    if mode == "w8a8" and not kernels.w8a8_available():
        pytest.skip("W8A8 products need AMX-INT8 tiles")
    model = _model("qwen2", mode, True)
    ref, _ = _steps(model, fused=False)
    cache = PagedKVCache(model.config, num_blocks=40, max_len=64, dtype=torch.float32, block_size=block_size)
    got, _ = _steps(model, fused=True, cache=cache)
    for r, o in zip(ref, got):
        assert torch.equal(r, o)
    assert cache.lengths[0] == 21 and cache.lengths[1] == 12


def test_huge_page_copies_are_exact_and_aligned():
    t = torch.randn(3, 1000)
    h = on_huge_pages(t)
    assert torch.equal(h, t) and h.data_ptr() % (2 << 20) == 0 and h.dtype == t.dtype


@needs_kernel
@pytest.mark.parametrize("mode", ["mixed", "bf16"])
def test_weights_on_huge_pages_compute_the_same(mode):
    model = _model("qwen2", mode, join=mode != "bf16")
    ref, _ = _steps(model, fused=True)
    assert move_weights_(model, min_bytes=0) > 0
    for block in model.model.layers:  # the compiled layers now read the moved copies
        packed = layer_plan(block).weights[2::3]  # each product's packed weight
        assert all(t.data_ptr() % (2 << 20) == 0 for t in packed)
    got, _ = _steps(model, fused=True)
    assert all(torch.equal(r, o) for r, o in zip(ref, got))


@needs_kernel
def test_joining_bf16_projections_changes_nothing():
    model = _model("qwen2", "bf16", join=False)
    ref, _ = _steps(model, fused=True)
    assert fuse_projections_(model) == 2 * len(model.model.layers)  # q/k/v and gate/up of every layer
    assert model.model.layers[0].self_attn.qkv.weight.dtype == torch.bfloat16
    got, _ = _steps(model, fused=True)
    assert all(torch.equal(r, o) for r, o in zip(ref, got))


def _spy_decoder_layer(monkeypatch) -> list:
    from tokenleap import kernels

    calls: list = []
    real = kernels.decoder_layer
    monkeypatch.setattr(kernels, "decoder_layer", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@needs_kernel
def test_backend_follows_quantization_and_the_switch(monkeypatch):
    """The choice made for the float model is replaced once it is quantized (no call in between
    re-chooses it), and turning the fused layers off and on again follows too; the fused layers'
    rows stay bitwise the Python layers'."""
    calls = _spy_decoder_layer(monkeypatch)
    model = tiny_model("qwen2", seed=3, hidden=64, intermediate=256, layers=3)
    _run(model)  # a float32 Linear has no plan: compiled attention, no fused layer
    assert model.backend.layers == (Backend.COMPILED_ATTENTION,) * 3 and calls == []
    quantize_(model, "int4")
    got, _ = _run(model)
    assert len(calls) == 3 * 3  # the one-row step and both row-exact blocks, every layer
    assert model.backend.layers == (Backend.FUSED_LAYER,) * 3
    assert model.backend.describe() == "fused layer (3 layers)"
    model.use_fused_layers = False
    assert model.backend.layers == (Backend.COMPILED_ATTENTION,) * 3
    ref, _ = _run(model)
    assert len(calls) == 9  # the Python layers only
    assert all(torch.equal(r, o) for r, o in zip(ref, got))
    model.use_fused_layers = True
    assert model.backend.layers == (Backend.FUSED_LAYER,) * 3


@needs_kernel
def test_backend_follows_a_replaced_projection(monkeypatch):
    """A projection swapped for another int4 layer after the choice was made: the fused layers run
    the new weights (a stale plan would run the old ones), bitwise what the Python layers give."""
    calls = _spy_decoder_layer(monkeypatch)
    model = _model("qwen2", "int4", join=False)
    before, _ = _run(model)
    n = len(calls)
    mlp = model.model.layers[1].mlp
    g = torch.Generator().manual_seed(9)
    mlp.down_proj = Int4Linear.from_float(0.08 * torch.randn(64, 256, generator=g), None, 32, torch.bfloat16)
    got, _ = _run(model)
    assert len(calls) > n and model.backend.layers == (Backend.FUSED_LAYER,) * 3
    assert not torch.equal(before[1], got[1])  # the new weights move the rows
    model.use_fused_layers = False
    ref, _ = _run(model)
    assert all(torch.equal(r, o) for r, o in zip(ref, got))
    model.use_fused_layers = True
    mlp.down_proj = Int4Linear.from_float(mlp.down_proj.dequantized_weight(), None, 32, torch.bfloat16)
    mlp.gate_proj = Linear(64, 256)  # a float32 product: the kernel cannot run this layer, so no layer runs fused
    mlp.gate_proj.weight.copy_(0.08 * torch.randn(256, 64, generator=g))
    assert model.backend.layers == (Backend.FUSED_LAYER, Backend.COMPILED_ATTENTION, Backend.FUSED_LAYER)
    n = len(calls)
    _run(model)
    assert len(calls) == n


def test_backend_follows_the_dtype():
    """Converting the model re-chooses: bf16 activations never reach the compiled attention."""
    from tokenleap import kernels

    model = tiny_model("llama", layers=2)
    compiled = Backend.COMPILED_ATTENTION if kernels.available() else Backend.PYTHON
    assert model.backend.layers == (compiled,) * 2
    model.to(torch.bfloat16)
    assert model.backend.layers == (Backend.PYTHON,) * 2
    assert all(b.self_attn.backend is Backend.PYTHON for b in model.model.layers)
    cache = KVCache(model.config, 1, 16, torch.bfloat16)
    logits = model(torch.arange(3), [Segment(cache.allocate(), 0, 3)], cache, row_exact=True).logits
    assert logits.shape == (3, model.config.vocab_size)
    model.float()
    assert model.backend.layers == (compiled,) * 2
    assert all(b.self_attn.backend is compiled for b in model.model.layers)
