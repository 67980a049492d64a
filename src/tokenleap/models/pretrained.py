"""Model + tokenizer from a name or path, in the chosen dtype and weight quantization."""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenleap import kernels
from tokenleap.config import QUANT_MODES, ConfigError
from tokenleap.errors import ModelFormatError
from tokenleap.models.build import build_transformer, float32_activations_, pack_bf16_weights_
from tokenleap.models.changes import modules_changed
from tokenleap.models import packed_cache
from tokenleap.models.hugepages import move_weights_
from tokenleap.models.checkpoint import Checkpoint, as_dtype, load_checkpoint
from tokenleap.models.transformer import Transformer
from tokenleap.text.tokenizer import Tokenizer, read_chat_template


DEFAULT_CONTEXT = 4096  # tokens of context when none is asked for (at most the model's positions)


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    dtype: torch.dtype
    quant: str
    source: str
    gguf_path: Path | None

    def context_length(self, requested: int | None) -> int:
        """The context window for a requested ``max_model_len`` (None: the default): at most the
        model's positions (``ModelConfig.max_context``), with a warning when a request for more is cut."""
        positions = self.model.config.max_context
        if requested is not None and requested > positions:
            logging.getLogger("tokenleap").warning(
                "max_model_len %d is more than the %d positions %s was trained for: using %d",
                requested, positions, self.source, positions)
        return min(requested or DEFAULT_CONTEXT, positions)


def _quantize_w8a8(model: Transformer, tokenizer: Tokenizer, ckpt: Checkpoint, dtype: torch.dtype,
                   cache_dir: Path | None) -> None:
    """W8A8 (models/w8a8.py): input maxima from a calibration forward of the float model (stored
    per model under the cache directory, so only the first load runs it), then int8 weights
    smoothed by them. Refused where the AMX-INT8 tiles are missing: the torch path computes the
    same values but far slower than int8 or int4 there."""
    from tokenleap.models.calibration import CALIBRATION_TEXT, maxima_path, stored_activation_maxima
    from tokenleap.models.checkpoint import model_key
    from tokenleap.models.quant import quantize_
    if not kernels.w8a8_available():
        raise ConfigError(f"w8a8 quantization ({ckpt.source}) needs AMX-INT8 tiles (an Intel Xeon since Sapphire "
                          "Rapids) and tokenleap's compiled kernels; this machine has none: use int4 or int8")
    tokens = tokenizer.encode(CALIBRATION_TEXT)
    path = maxima_path(cache_dir, model_key(ckpt.source, ckpt.gguf_path, dtype, "none"), tokens)
    quantize_(model, "w8a8", act_max=stored_activation_maxima(model, tokens, path))


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """AMX or AVX-512 BF16: bf16 matrix work runs in hardware, so it is the faster default."""
    flags = kernels.cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return as_dtype(dtype)


def _own_memory(model: Transformer) -> None:
    """Copy the float tensors left after quantization (embeddings, norms, biases) out of the
    memory-mapped checkpoint, so the mapping of the whole float file can be released."""
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point():
            t.data = t.data.clone()
    modules_changed()  # .data bypasses the modules' tracking (backend.py re-chooses)


def load_model(name_or_path: str | Path, dtype: str | torch.dtype = "auto", quant: str | None = "none",
               cache_dir: str | Path | None = None, gguf_other: str = "int8",
               chat_template: str | None = None) -> LoadedModel:
    """Load a catalog name, GGUF file or HF directory, quantized with ``quant``; ``chat_template``
    (a file or the template's text) replaces the model's own.

    With ``quant="int4"`` a GGUF's own 4-bit blocks are re-packed exactly and its other tensors
    (Q5/Q6/Q8, e.g. the LM head llama.cpp's Q4_K_M keeps at 6 bits) are quantized with
    ``gguf_other``: int8 by default, keeping their precision; drafts pass "int4", since a
    draft's precision moves only acceptance, never the output. A file with no 4-bit tensors
    becomes int4 throughout.
    """
    quant = "none" if quant is None else quant  # (as a draft's quant=None reads)
    if quant not in QUANT_MODES:
        raise ConfigError(f"unknown quantization {quant!r}; choose one of {', '.join(QUANT_MODES)}")
    if cache_dir and Path(cache_dir).expanduser().exists() and not Path(cache_dir).expanduser().is_dir():
        raise ConfigError(f"the cache directory {str(cache_dir)!r} is not a directory")
    dt = resolve_dtype(dtype)
    template = read_chat_template(chat_template) if chat_template is not None else None  # (before a long load)
    ckpt = load_checkpoint(str(name_or_path), dt, Path(cache_dir) if cache_dir else None)
    tokenizer = Tokenizer.from_dir(ckpt.tokenizer_dir)
    if template is not None:
        tokenizer.use_chat_template(template)
    keyed = ckpt.gguf_path is not None or ckpt.source.startswith("hf:")  # (model_key names its weight files)
    if quant in ("none", "w8a8") or not keyed or not packed_cache.enabled():
        model = _quantized(ckpt, tokenizer, dt, quant, cache_dir, gguf_other)
    else:  # quantized once, then memory-mapped from the cache (models/packed_cache.py)
        from tokenleap.models.checkpoint import model_key
        from tokenleap.models.catalog import default_cache_dir
        key = model_key(ckpt.source, ckpt.gguf_path, dt, quant) + (f"-{gguf_other}" if ckpt.gguf_path else "")
        path = packed_cache.path_for(Path(cache_dir) if cache_dir else default_cache_dir(), key)
        model = packed_cache.load(path)
        if model is None:
            model = _quantized(ckpt, tokenizer, dt, quant, cache_dir, gguf_other)
            packed_cache.store(model, path)
    prepare_for_kernels_(model, dt, quant)
    return LoadedModel(model, tokenizer, dt, quant, ckpt.source, ckpt.gguf_path)


def _quantized(ckpt: Checkpoint, tokenizer: Tokenizer, dt: torch.dtype, quant: str, cache_dir: str | Path | None,
               gguf_other: str) -> Transformer:
    """The checkpoint's model built and quantized with ``quant`` (see ``load_model``)."""
    try:
        model = build_transformer(ckpt.config, ckpt.weights, dt)
    except ModelFormatError as e:
        raise ModelFormatError(f"{ckpt.gguf_path or ckpt.tokenizer_dir}: {e}") from None
    if quant == "int4" and ckpt.gguf_path is not None:
        # re-pack the file's own 4-bit blocks (exact); its 5-8-bit tensors become gguf_other -- in a
        # file with no 4-bit tensors at all (F16, BF16, Q8_0, Q5_K_M...) every one becomes int4, as asked
        from tokenleap.models.gguf import GGUFFile
        from tokenleap.models.quant import has_4bit_blocks, quantize_from_gguf_
        gguf = GGUFFile(ckpt.gguf_path)
        quantize_from_gguf_(model, gguf, other=gguf_other if has_4bit_blocks(gguf) else "int4")
    elif quant == "w8a8":
        _quantize_w8a8(model, tokenizer, ckpt, dt, Path(cache_dir) if cache_dir else None)
    elif quant != "none":
        from tokenleap.models.quant import quantize_
        quantize_(model, quant)
    return model


def prepare_for_kernels_(model: Transformer, dt: torch.dtype, quant: str) -> None:
    """Make a built (and, unless ``quant`` is "none", quantized) model ready for tokenleap's kernels:
    float32 activations, fused projections, packed bf16 weights, weights on huge pages, and each
    layer's backend chosen."""
    # tokenleap's products take float32 activations whatever the weights (bf16 -- on AMX tiles
    # where the CPU has them, rounded to bf16 there -- or int4 / int6 / int8 after quantization),
    # so bf16 activations would only add casts and rule out the compiled layers (an int4 0.5B step:
    # 44 ms with bf16 activations, 24 with float32; the 1.5B on an AMX Xeon: 75 vs 62 ms)
    f32_activations = dt == torch.bfloat16 and kernels.available()
    if f32_activations:
        float32_activations_(model)  # bf16 weight matrices (or quantized ones), float32 everything else
    bf16_kernel = quant == "none" and f32_activations
    if quant != "none" or bf16_kernel:
        from tokenleap.models.quant import fuse_projections_
        fuse_projections_(model)  # q/k/v and gate/up in one call each
    if quant != "none":
        _own_memory(model)
    if f32_activations:
        pack_bf16_weights_(model)  # one copy of each bf16 weight matrix, in the kernel's layout
    move_weights_(model)  # the buffers every decode step streams, on transparent huge pages
    model.backend  # noqa: B018 -- each layer's path chosen now, for the modules as loaded (backend.py)
