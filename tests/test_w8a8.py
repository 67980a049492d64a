"""W8A8 (``--quant w8a8``): int8 weights and int8 activations per row and block, smoothed. The
AMX-INT8 kernel computes the torch reference's values bitwise; every row is computed on its own,
so verification reproduces plain decoding exactly; the smoothing keeps an outlier channel from
flattening the other activations of its block."""
from __future__ import annotations

import pytest
import torch

from tokenleap import kernels
from tokenleap.cache.contiguous import KVCache
from tokenleap.config import ConfigError, SamplingParams
from tokenleap.models.quant import fuse_projections_, quantize_
from tokenleap.models.transformer import Segment
from tokenleap.models.calibration import activation_maxima
from tokenleap.models.w8a8 import W8A8Linear, smoothing, w8a8_reference

from conftest import assert_block_rows_equal_steps, tiny_model

SHAPE = dict(hidden=128, intermediate=256)
tiles = pytest.mark.skipif(not kernels.w8a8_available(), reason="no AMX-INT8 tiles here")


def _layer(n: int, k: int, seed: int, kernel: bool, monkeypatch) -> tuple[W8A8Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    act = torch.rand(k, generator=g) * 3
    act[k // 3] = 150.0  # an outlier channel, as Qwen's activations have
    monkeypatch.setattr(kernels, "w8a8_available", lambda: kernel)
    lin = W8A8Linear.from_float(w, torch.randn(n, generator=g), smoothing([w], act))
    monkeypatch.undo()
    return lin, w


def test_reference_is_the_blockwise_int8_product():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (32, 256), generator=g, dtype=torch.int8)
    scale, inv = torch.rand(32, generator=g) * 0.01, torch.rand(256, generator=g) + 0.5
    x = torch.randn(3, 256, generator=g)
    got = w8a8_reference(x, q, scale, inv, 128)
    xs = (x * inv).view(3, 2, 128)
    d = xs.abs().amax(-1, keepdim=True) / 127
    want = (torch.round(xs / d).double() * d.double()).reshape(3, 256) @ q.double().T * scale.double()
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)  # (x * inv vs x / d rounding aside)
    assert (got - x @ (q.float() * scale[:, None] * inv).T).norm() < 0.02 * got.norm()


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=tiles)])
@pytest.mark.parametrize("n,k", [(32, 64), (96, 896), (40, 1536), (256, 8960)])
def test_rows_are_computed_on_their_own(kernel, n, k, monkeypatch):
    lin, _ = _layer(n, k, seed=n + k, kernel=kernel, monkeypatch=monkeypatch)
    x = torch.randn(37, k)
    y = lin(x)
    assert y.shape == (37, n)
    for i in range(37):
        assert torch.equal(lin(x[i:i + 1]), y[i:i + 1]), f"row {i} differs"
    assert torch.equal(lin(x[5:21]), y[5:21])


@tiles
@pytest.mark.parametrize("n,k", [(32, 64), (96, 896), (40, 1536), (1536, 8960)])
def test_tiles_compute_the_reference_bitwise(n, k, monkeypatch):
    lin, _ = _layer(n, k, seed=k, kernel=True, monkeypatch=monkeypatch)
    for rows in (1, 7, 16, 33):
        x = torch.randn(rows, k) * 3
        want = w8a8_reference(x, lin.int8_weight(), lin.scale[:n], lin.inv_smooth, lin.block) + lin.bias
        assert torch.equal(lin(x), want)


def test_smoothing_keeps_an_outlier_from_flattening_its_block(monkeypatch):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g) * 0.05
    x = torch.randn(16, 256, generator=g)
    x[:, 7] *= 80  # one channel 80x the others
    act = x.abs().amax(0)
    want = x @ w.T
    monkeypatch.setattr(kernels, "w8a8_available", lambda: False)
    plain = W8A8Linear.from_float(w, None, smoothing([w], None))(x)
    smooth = W8A8Linear.from_float(w, None, smoothing([w], act))(x)
    err = [float((y - want).norm() / want.norm()) for y in (plain, smooth)]
    assert err[1] < err[0] / 3, err


def test_quantized_model_joins_projections_and_verifies_as_it_decodes(monkeypatch):
    """The model quantized with calibrated smoothing: q/k/v and gate/up share their input's
    smoothing and are joined; a one-token step equals the row of a k-token block bitwise (what
    makes speculative output plain output), and its logits stay close to the float model's."""
    ref = tiny_model("qwen2", seed=4, **SHAPE)
    model = tiny_model("qwen2", seed=4, **SHAPE)
    act = activation_maxima(model, list(range(3, 60)))
    assert set(act) == {n for n, m in model.named_modules() if type(m).__name__ == "Linear"}
    report = quantize_(model, "w8a8", act_max=act)
    assert report.kept_float == () and len(report.quantized) == 2 * 7 + 1
    assert fuse_projections_(model) == 2 * 2
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv, W8A8Linear) and isinstance(layer.mlp.gate_up, W8A8Linear)
    assert_block_rows_equal_steps(model, torch.float32)
    ids = list(range(5, 25))
    got, want = (m(torch.tensor(ids), [Segment(0, 0, len(ids))], KVCache(m.config, 1, 64, torch.float32)).logits
                 for m in (model, ref))
    assert float((got - want).norm() / want.norm()) < 0.05


def test_speculation_over_a_w8a8_target_is_plain_decoding():
    from conftest import ToyTokenizer
    from tokenleap.spec.controller import ControllerConfig
    from tokenleap.spec.engine import Engine
    from tokenleap.spec.proposers.ngram import NgramProposer

    model = tiny_model("qwen2", seed=6, **SHAPE)
    quantize_(model, "w8a8", act_max=activation_maxima(model, list(range(2, 40))))
    fuse_projections_(model)
    tok = ToyTokenizer(model.config.vocab_size, ())
    prompt = [5, 9, 14, 3, 7, 9, 14, 3, 7, 9]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = Engine(model, tok, max_len=128)
    spec = Engine(model, tok, max_len=128, proposer=NgramProposer(3, 1), controller=ControllerConfig(max_k=4, fixed_k=4))
    want = [s.generated for s, _ in plain.generate(prompt, params)][-1]
    got = [s.generated for s, _ in spec.generate(prompt, params)][-1]
    assert got == want and len(got) == 24


def test_load_refuses_w8a8_without_the_tiles(smollm2_gguf, tmp_path, monkeypatch):
    from tokenleap.models import pretrained
    monkeypatch.setattr(kernels, "w8a8_available", lambda: False)
    with pytest.raises(ConfigError, match="AMX-INT8") as refused:
        pretrained.load_model(smollm2_gguf, dtype="bfloat16", quant="w8a8", cache_dir=tmp_path)
    # it names the model refused (a target's --quant or a draft's --draft-quant), not one flag
    assert str(smollm2_gguf.name) in str(refused.value) and "--quant" not in str(refused.value)


@tiles
def test_loaded_w8a8_model_decodes_like_its_float_model(smollm2_gguf, tmp_path, monkeypatch):
    """A real model (SmolLM2-135M) loaded with --quant w8a8: calibrated, joined, on the tiles, and
    greedy decoding starts as the bf16 model's does; loaded again, it reads its stored calibration."""
    from tokenleap.models import pretrained
    from tokenleap.spec.engine import Engine
    loaded = pretrained.load_model(smollm2_gguf, dtype="bfloat16", quant="w8a8", cache_dir=tmp_path)
    ref = pretrained.load_model(smollm2_gguf, dtype="bfloat16", quant="none", cache_dir=tmp_path)
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, W8A8Linear) and layer.mlp.down_proj.use_kernel
    assert isinstance(layer.mlp.gate_up, W8A8Linear)
    assert float(layer.mlp.down_proj.inv_smooth.std()) > 0  # calibrated, not the identity
    ids = loaded.tokenizer.encode("def fibonacci(n):")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    got = [s.generated for s, _ in Engine(loaded.model, loaded.tokenizer, max_len=64).generate(ids, params)][-1]
    want = [s.generated for s, _ in Engine(ref.model, ref.tokenizer, max_len=64).generate(ids, params)][-1]
    assert got[:4] == want[:4]
    from tokenleap.models import calibration
    monkeypatch.setattr(calibration, "activation_maxima", lambda *a: pytest.fail("the stored calibration was not read"))
    again = pretrained.load_model(smollm2_gguf, dtype="bfloat16", quant="w8a8", cache_dir=tmp_path)
    assert torch.equal(again.model.model.layers[0].mlp.down_proj.inv_smooth, layer.mlp.down_proj.inv_smooth)



def test_calibration_is_measured_once_then_read_from_disk(tmp_path, monkeypatch):
    """The first load measures the maxima and stores them; the next reads them (no forward) and
    gets the same tensors; an unreadable file or one measured on another model is measured again."""
    from tokenleap.models import calibration

    model = tiny_model("qwen2", seed=4, **SHAPE)
    tokens = list(range(3, 40))
    path = calibration.maxima_path(tmp_path, "tiny-float32-none", tokens)
    measured = []
    real = calibration.activation_maxima
    monkeypatch.setattr(calibration, "activation_maxima", lambda m, t: measured.append(1) or real(m, t))
    first = calibration.stored_activation_maxima(model, tokens, path)
    assert measured == [1] and path.is_file()
    again = calibration.stored_activation_maxima(model, tokens, path)
    assert measured == [1] and set(again) == set(first)
    assert all(torch.equal(again[n], first[n]) for n in first)
    assert calibration.maxima_path(tmp_path, "tiny-float32-none", tokens[1:]) != path  # another text, another file
    path.write_bytes(b"not a safetensors file")
    assert torch.equal(calibration.stored_activation_maxima(model, tokens, path)["lm_head"], first["lm_head"])
    assert measured == [1, 1]
    other = tiny_model("qwen2", seed=4, hidden=64, intermediate=256)  # other widths: the stored file does not fit
    assert calibration.load_maxima(path, other) is None
    calibration.stored_activation_maxima(other, tokens, path)
    assert measured == [1, 1, 1] and calibration.load_maxima(path, model) is None


def test_model_key_of_a_directory_follows_its_weight_files(tmp_path):
    import os
    from tokenleap.models.checkpoint import model_key

    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    before = model_key(f"hf:{tmp_path}", None, torch.bfloat16, "none")
    assert model_key(f"hf:{tmp_path}", None, torch.bfloat16, "none") == before
    os.utime(tmp_path / "model.safetensors", ns=(1, 1))
    assert model_key(f"hf:{tmp_path}", None, torch.bfloat16, "none") != before


@pytest.mark.parametrize("kernel", [False, True])
def test_dequantized_weight_is_what_the_int8_values_stand_for(kernel, monkeypatch):
    """Both layouts give back q [out, in] and q * scale / s, close to the float weight (a reduced
    draft head starts from it)."""
    if kernel and not kernels.w8a8_available():
        pytest.skip("no AMX-INT8 tiles here")
    monkeypatch.setattr(kernels, "w8a8_available", lambda: kernel)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 128, generator=g) * 0.05  # 40 outputs: padded to 64 inside
    s = torch.rand(128, generator=g) + 0.5
    lin = W8A8Linear.from_float(w, None, s)
    q = lin.int8_weight()
    assert q.shape == (40, 128) and q.dtype == torch.int8
    assert torch.equal(q, torch.round(w * s / lin.scale[:40, None]).clamp(-127, 127).to(torch.int8))
    back = lin.dequantized_weight()
    assert back.shape == w.shape and float((back - w).abs().max()) <= float((lin.scale[:40] / s.min()).max())
