"""Hugging Face model directories: config.json, *.safetensors (sharded or not), tokenizer files.

Weights are memory-mapped with ``safetensors`` and converted to the compute dtype only when the
stored dtype differs, so a directory saved in the compute dtype loads in about a second.
"""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tokenleap.config import ConfigError, ModelConfig
from tokenleap.errors import ModelFormatError

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_UNUSED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelFormatError(f"{path.parent} has no {path.name}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path} must hold a JSON object")
    return data


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def read_config(model_dir: str | Path) -> ModelConfig:
    """ModelConfig from config.json; eos ids of generation_config.json (if any) are merged in."""
    model_dir = Path(model_dir)
    raw = _read_json(model_dir / CONFIG_FILE)
    if isinstance(q := raw.get("quantization_config"), dict):  # GPTQ, AWQ, FP8, bitsandbytes ...
        raise ModelFormatError(f"{model_dir} holds {q.get('quant_method', 'pre-quantized')} weights, which tokenleap "
                               "does not read: load the unquantized model (and use --quant) or a GGUF file")
    try:
        config = ModelConfig.from_hf_dict(raw)
    except ConfigError as e:
        raise ModelFormatError(f"{model_dir / CONFIG_FILE}: {e}") from None
    except KeyError as e:
        raise ModelFormatError(f"{model_dir / CONFIG_FILE} lacks the required field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{model_dir / CONFIG_FILE} has a malformed value: {e}") from None
    gen_path = model_dir / GENERATION_CONFIG_FILE
    if gen_path.is_file():
        gen = _read_json(gen_path)
        merged = tuple(dict.fromkeys(config.eos_token_ids + _eos_ids(gen.get("eos_token_id"))))
        bos = config.bos_token_id if config.bos_token_id is not None else gen.get("bos_token_id")
        config = replace(config, eos_token_ids=merged, bos_token_id=bos)
    return config


def weight_files(model_dir: str | Path) -> list[Path]:
    """The model's weight files, sorted by name, as transformers picks them: the shards
    ``model.safetensors.index.json`` lists, else ``model.safetensors``, else every *.safetensors file
    (other files beside them -- an adapter, a ``consolidated.safetensors`` -- are not the model's)."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        hint = " (pytorch_model.bin checkpoints are not supported; save with safetensors)" if any(
            model_dir.glob("*.bin")) else ""
        raise ModelFormatError(f"{model_dir} has no *.safetensors weight files{hint}")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFormatError(f"{index} has no weight_map naming the model's shards")
        wanted = sorted(set(map(str, weight_map.values())))
        missing = [w for w in wanted if not (model_dir / w).is_file()]
        if missing:
            raise ModelFormatError(f"{model_dir} lacks the weight shard {missing[0]} listed in {index.name}")
        return [model_dir / w for w in wanted]
    single = model_dir / "model.safetensors"
    return [single] if single.is_file() else files


def read_weights(model_dir: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All tensors under their HF names, in ``dtype`` (memory-mapped when already stored in it)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        try:
            shard = load_file(path)
        except (SafetensorError, OSError) as e:
            raise ModelFormatError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}") from None
        for name, tensor in shard.items():
            if name.endswith(_UNUSED_SUFFIXES):
                continue
            if not tensor.is_floating_point() or tensor.element_size() == 1:  # int8, float8 ...: scales elsewhere
                raise ModelFormatError(f"tensor {name!r} of {path} is {str(tensor.dtype).removeprefix('torch.')}: "
                                       "tokenleap reads float weights (float32, float16, bfloat16) only")
            if name in weights:
                raise ModelFormatError(f"tensor {name!r} appears in more than one shard of {model_dir}")
            weights[name] = tensor if tensor.dtype == dtype else tensor.to(dtype)
    return weights


def read_tokenizer_config(model_dir: str | Path) -> dict[str, Any]:
    """tokenizer_config.json (chat_template, bos/eos tokens, ...) or {} when the file is absent."""
    path = Path(model_dir) / TOKENIZER_CONFIG_FILE
    return _read_json(path) if path.is_file() else {}


def has_tokenizer(model_dir: str | Path) -> bool:
    return (Path(model_dir) / TOKENIZER_FILE).is_file()


def load_hf_dir(model_dir: str | Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, weights) of a Hugging Face model directory."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelFormatError(f"{model_dir} is not a directory")
    config = read_config(model_dir)
    weights = read_weights(model_dir, dtype)
    return _tie_as_stored(config, weights, model_dir), weights


def _tie_as_stored(config: ModelConfig, weights: dict[str, torch.Tensor], model_dir: Path) -> ModelConfig:
    """``config`` untied where it says the output layer is the embedding matrix but the checkpoint
    stores an output layer of its own that differs from it (a merge's or fine-tune's config left
    tied): transformers then keeps the stored head, and so does tokenleap."""
    if not config.tie_word_embeddings:
        return config
    head = next((weights[k] for k in ("lm_head.weight", "language_model.lm_head.weight") if k in weights), None)
    embed = next((v for k, v in weights.items() if k.endswith("embed_tokens.weight")), None)
    if head is None or embed is None or (head.shape == embed.shape and torch.equal(head, embed)):
        return config
    log.warning("%s: config.json ties the output layer to the embeddings, but the checkpoint stores a "
                "different lm_head.weight; using the stored one (as transformers does)", model_dir)
    return replace(config, tie_word_embeddings=False)


__all__ = [
    "read_config", "read_weights", "weight_files", "read_tokenizer_config", "has_tokenizer", "load_hf_dir",
    "CONFIG_FILE", "TOKENIZER_FILE", "TOKENIZER_CONFIG_FILE", "GENERATION_CONFIG_FILE",
]
