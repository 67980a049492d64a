"""The error classes a caller catches: every user-facing error, a bad value's ``ConfigError`` included,
is a ``TokenleapError``; the spellings of a dtype, a quantization and a config's family that users of
vLLM and transformers write load as they expect; a GGUF that cannot load leaves no converted copy."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import tokenleap.errors as errors
from tokenleap.config import ConfigError, SamplingParams
from tokenleap.models import pretrained
from tokenleap.models.checkpoint import as_dtype, load_checkpoint
from tokenleap.models.hf_config import config_from_hf_dict
from tokenleap.text.tokenizer import ChatTemplateError

from test_gguf import tiny_state, write_tiny_gguf

# a tiny model's config.json fields (test_architectures.py's shape)
BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)


def test_every_user_facing_error_is_a_tokenleap_error():
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.TokenleapError), name
    assert issubclass(ConfigError, ValueError) and issubclass(ChatTemplateError, ConfigError)
    with pytest.raises(errors.TokenleapError, match="temperature"):
        SamplingParams(temperature=-1)


def test_vllms_dtype_spellings():
    assert as_dtype("half") is torch.float16 and as_dtype("float") is torch.float32
    with pytest.raises(ConfigError, match="unsupported dtype 'float64'"):
        as_dtype("float64")


def test_no_quantization_reads_as_none(smollm2_gguf, tmp_path):
    assert pretrained.load_model(smollm2_gguf, quant=None, cache_dir=tmp_path).quant == "none"


def test_a_config_without_model_type_reads_its_family_from_architectures():
    d = BASE | {"architectures": ["Qwen2ForCausalLM"]}  # (no model_type)
    assert config_from_hf_dict(d).architecture == "qwen2"
    d["architectures"] = ["FalconForCausalLM"]
    with pytest.raises(ConfigError, match="no model_type"):
        config_from_hf_dict(d)


def test_a_gguf_of_the_wrong_layout_is_refused_before_its_conversion_is_written(tmp_path):
    sd = tiny_state("llama")
    sd["model.norm.weight"] = np.concatenate([sd["model.norm.weight"]] * 2)  # twice the hidden size
    path = write_tiny_gguf(tmp_path / "wide.gguf", "llama", sd)
    with pytest.raises(errors.ModelFormatError, match=r"model.norm.weight has shape \(128,\), expected \(64,\)"):
        load_checkpoint(path, torch.float32, cache_dir=tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]  # no copy that can never load


def test_load_errors_say_which_file_and_what_to_do(tmp_path):
    """A GGUF whose weights and metadata disagree is named; a file inside a model directory points at the
    directory; a directory with a tokenizer only in another form says which form tokenleap reads."""
    from tokenleap.text.tokenizer import Tokenizer
    sd = tiny_state("llama")
    sd["model.norm.weight"] = np.concatenate([sd["model.norm.weight"]] * 2)
    path = write_tiny_gguf(tmp_path / "wide.gguf", "llama", sd)
    with pytest.raises(errors.ModelFormatError, match=r"wide\.gguf: tensor .* the weights and the config .* disagree"):
        load_checkpoint(path, torch.float32, cache_dir=tmp_path / "cache")
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(errors.ModelFormatError, match=re.escape(f"name the directory: {model_dir}")):
        load_checkpoint(model_dir / "config.json", torch.float32)
    (model_dir / "tokenizer.model").write_bytes(b"sp")
    with pytest.raises(errors.ModelFormatError, match="tokenizer.json only, not tokenizer.model -- transformers"):
        Tokenizer.from_dir(model_dir)


def test_a_model_directory_whose_config_disagrees_with_its_weights_is_named(tmp_path):
    import json

    from safetensors.torch import save_file

    from test_gguf import tiny_tokenizer_meta
    from tokenleap.text.gguf_tokenizer import write_tokenizer_files
    sd = tiny_state("llama")  # intermediate size 128
    save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}, str(tmp_path / "m.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(BASE | {"model_type": "llama", "intermediate_size": 256,
                                                            "tie_word_embeddings": "lm_head.weight" not in sd}))
    tok = tiny_tokenizer_meta(96)
    write_tokenizer_files({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tok["tokens"],
                           "tokenizer.ggml.merges": tok["merges"], "tokenizer.ggml.token_type": tok["types"],
                           "tokenizer.ggml.eos_token_id": 95}, tmp_path)
    with pytest.raises(errors.ModelFormatError,
                       match=re.escape(f"{tmp_path}: tensor model.layers.0.mlp.gate_proj.weight has shape")):
        pretrained.load_model(tmp_path, quant="none", cache_dir=tmp_path / "c")
