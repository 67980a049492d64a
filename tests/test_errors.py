"""The error classes a caller catches: every user-facing error, a bad value's ``ConfigError`` included,
is a ``TokenleapError``; and the spellings of a dtype, a quantization and a config's family that users
of vLLM and transformers write load as they expect."""
from __future__ import annotations

import pytest
import torch

import tokenleap.errors as errors
from tokenleap.config import ConfigError, SamplingParams
from tokenleap.models import pretrained
from tokenleap.models.checkpoint import as_dtype
from tokenleap.models.hf_config import config_from_hf_dict
from tokenleap.text.tokenizer import ChatTemplateError

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
