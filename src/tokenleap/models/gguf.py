"""GGUF reading: header and metadata -> ModelConfig, tensors -> Hugging Face names, dequantization.

The header (metadata and tensor table) is parsed here with bounds checks on every read, so a
truncated or corrupt file fails in well under a second with a clear message, before any
dequantization starts (``gguf.GGUFReader`` needs ~16 s to parse the 150k-token Qwen
vocabularies, and fails late and obscurely on truncated files). The ``gguf`` package supplies the
type tables and the dequantization kernels (``gguf.quants.dequantize``).

llama.cpp's converter permutes the rows of the q and k projections of *llama* models (it
interleaves the two rotary halves of each head); ``GGUFFile`` undoes that so every tensor equals the
Hugging Face original (up to quantization error). Qwen2 / Qwen3 / Phi-3 / Gemma 3 files are not
permuted. Phi-3's fused ``attn_qkv`` and ``ffn_up`` (gate + up) are offered as the row ranges of
q/k/v and gate/up; Gemma 3's norm weights, stored by the converter as ``1 + weight``, are read back
as Hugging Face's ``weight``. RoPE scaling metadata and Llama 3's ``rope_freqs`` tensor become the
config's ``rope_scaling`` / ``rope_freq_factors``; a scaling tokenleap does not implement
(``longrope``'s factor tensors, unknown types) is refused. A split GGUF is read from its first shard,
the others beside it (``gguf_split.py``).
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, quants

from tokenleap.config import ConfigError, ModelConfig
from tokenleap.errors import ModelFormatError, ModelNotFoundError
from tokenleap.models.gguf_arch import arch_fields, rope_freq_factors, rope_scaling_from_gguf
from tokenleap.models.gguf_split import merged_tables, shard_count, shard_paths

GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_BLOCK_NAMES |= {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_ARCH_BLOCK_NAMES = {
    "gemma3": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
# fused GGUF tensors offered as row ranges: GGUF block name -> [(HF module, which part)]
_SPLIT_NAMES = {
    "phi3": {"attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "ffn_up": ("mlp.gate_proj", "mlp.up_proj")},
}
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3")  # llama also carries Mistral
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """Hugging Face name of a GGUF tensor name, or None for tensors tokenleap does not use (or
    that it splits: Phi-3's fused tensors, see ``GGUFFile``)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _SPLIT_NAMES.get(arch, {}):
        return None
    names = _BLOCK_NAMES | _ARCH_BLOCK_NAMES.get(arch, {})
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the GGUF tensor table."""

    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # row-major (PyTorch / HF) order, e.g. [out, in]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int
    file: int = 0  # which shard of a split GGUF holds it (``gguf_split.py``)

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """Shape of the raw data as uint8: rows stay rows, the last dim becomes bytes per row."""
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return (*self.shape[:-1], self.shape[-1] // block * type_size)


class _HeaderReader:
    """Bounds-checked little-endian reads over the file bytes."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.path, self.pos = buf, path, 0

    def fail(self, what: str) -> ModelFormatError:
        return ModelFormatError(
            f"{self.path} is not a valid GGUF file: it is truncated or corrupt ({what}). "
            "Re-download or reinstall the model."
        )

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise self.fail(f"header ends past the end of the file at byte {start + n:,}")
        self.pos += n
        return start

    def scalar(self, fmt: str) -> Any:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        return bytes(self.buf[self.take(n):self.pos]).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()
        raise self.fail(f"unknown metadata value type {vtype}")

    def array(self) -> list[Any]:
        itype, count = self.scalar("<I"), self.scalar("<Q")
        if itype in _SCALARS and itype != GGUFValueType.BOOL:
            dtype = np.dtype(_SCALARS[itype])
            start = self.take(count * dtype.itemsize)
            return np.frombuffer(self.buf, dtype, count, start).tolist()
        if count > len(self.buf):
            raise self.fail(f"array length {count:,} exceeds the file size")
        return [self.value(itype) for _ in range(count)]


def _parse_tensor_info(r: _HeaderReader) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int]:
    name = r.string()
    n_dims = r.scalar("<I")
    if n_dims > 8:
        raise r.fail(f"tensor {name!r} claims {n_dims} dimensions")
    dims = [r.scalar("<Q") for _ in range(n_dims)]  # ggml order: innermost first
    raw_type, rel_offset = r.scalar("<I"), r.scalar("<Q")
    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        raise r.fail(f"tensor {name!r} has unknown data type {raw_type}") from None
    return name, qtype, tuple(reversed(dims)), rel_offset


def read_header(path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """Metadata and tensor table of a GGUF file; checks magic, version and every tensor's data range."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(4)
        if head != GGUF_MAGIC:
            raise ModelFormatError(
                f"{path} is not a GGUF file (it starts with {head!r}, not b'GGUF'); it may be truncated or corrupt"
            )
        mm = np.memmap(f, dtype=np.uint8, mode="r")
    r = _HeaderReader(memoryview(mm), path)
    r.take(4)
    version = r.scalar("<I")
    if version not in (2, 3):
        raise ModelFormatError(f"{path}: GGUF version {version} is not supported (need 2 or 3)")
    n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
    if n_tensors > size or n_kv > size:
        raise r.fail("implausible tensor or metadata count")
    meta = {}
    for _ in range(n_kv):
        key = r.string()
        meta[key] = r.value(r.scalar("<I"))
    entries = [_parse_tensor_info(r) for _ in range(n_tensors)]
    align = meta.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise r.fail(f"invalid general.alignment {align!r}")
    data_start = -(-r.pos // align) * align
    return meta, _tensor_table(entries, data_start, size, r)


def _tensor_table(entries: list, data_start: int, size: int, r: _HeaderReader) -> dict[str, TensorInfo]:
    infos = {}
    for name, qtype, shape, rel_offset in entries:
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elems = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if shape and shape[-1] % block:
            raise r.fail(f"tensor {name!r} row size {shape[-1]} is not a multiple of {qtype.name}'s block {block}")
        info = TensorInfo(name, qtype, shape, data_start + rel_offset, n_elems // block * type_size)
        if info.offset + info.nbytes > size:
            raise r.fail(
                f"tensor {name!r} needs bytes up to {info.offset + info.nbytes:,} but the file has {size:,}"
            )
        infos[name] = info
    return infos


def _unpermute_rows(w: Any, n_head: int) -> Any:
    """Invert llama.cpp's q/k row permutation; works on torch tensors and numpy arrays alike."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _permute_rows(w: Any, n_head: int) -> Any:
    """llama.cpp's permutation (``LlamaModel.permute`` in convert_hf_to_gguf.py), for tests and writers."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    """A validated GGUF file: config, tensors under Hugging Face names, raw blocks, tokenizer metadata."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {self.path}")
        self.metadata, self.infos = read_header(self.path)
        self.shards = [self.path]  # the files of a split GGUF, in order
        if shard_count(self.metadata) > 1:
            self.shards = shard_paths(self.path, self.metadata)
            self.infos = merged_tables(self.shards, self.metadata, self.infos, read_header)
        self.architecture = str(self.metadata.get("general.architecture", ""))
        if self.architecture not in GGUF_ARCHITECTURES:
            raise ModelFormatError(
                f"{self.path}: architecture {self.architecture or 'unknown'!r} is not supported; "
                f"tokenleap runs GGUF files of {', '.join(GGUF_ARCHITECTURES)} models"
            )
        self._data = [np.memmap(p, dtype=np.uint8, mode="r") for p in self.shards]  # one map a shard
        self._rope_scaling = rope_scaling_from_gguf(self)  # refuses what tokenleap cannot compute exactly
        self._views: dict[str, TensorInfo] = {}  # HF name -> its tensor, or its rows of a fused tensor
        for n, info in self.infos.items():
            if (hf := gguf_to_hf_name(n, self.architecture)) is not None:
                self._views[hf] = info
            else:
                self._views |= self._split(info)
        self.hf_to_gguf = {hf: info.name for hf, info in self._views.items()}
        self.ignored = [n for n in self.infos if n not in set(self.hf_to_gguf.values())]

    def _split(self, info: TensorInfo) -> dict[str, TensorInfo]:
        """Phi-3's fused tensors as row ranges (whole rows, so quantization blocks stay intact)."""
        m = _BLOCK_RE.match(info.name)
        parts = _SPLIT_NAMES.get(self.architecture, {}).get(m.group(2)) if m else None
        if not parts:
            return {}
        if len(parts) == 3:
            heads, kv = int(self._meta("attention.head_count")), int(self._meta("attention.head_count_kv", 0))
            kv = kv or heads
            hd = info.shape[0] // (heads + 2 * kv)
            rows = [heads * hd, kv * hd, kv * hd]
        else:
            rows = [info.shape[0] // 2] * 2
        row_bytes = info.byte_shape[-1]
        out, start = {}, 0
        for module, n in zip(parts, rows):
            shape = (n, *info.shape[1:])
            out[f"model.layers.{m.group(1)}.{module}.{m.group(3)}"] = TensorInfo(
                info.name, info.qtype, shape, info.offset + start * row_bytes, n * row_bytes, info.file)
            start += n
        return out

    def _meta(self, key: str, default: Any = ...) -> Any:
        full = f"{self.architecture}.{key}"
        if full in self.metadata:
            return self.metadata[full]
        if default is ...:
            raise ModelFormatError(f"{self.path}: GGUF metadata lacks {full!r}; the file is incomplete")
        return default

    @cached_property
    def config(self) -> ModelConfig:
        """The model's shape, mapped from GGUF metadata to ModelConfig."""
        hidden, heads = int(self._meta("embedding_length")), int(self._meta("attention.head_count"))
        kv_heads = self._meta("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):
            raise ModelFormatError(f"{self.path}: per-layer KV head counts are not supported")
        if "token_embd.weight" not in self.infos:
            raise ModelFormatError(f"{self.path}: the file has no token_embd.weight tensor")
        eos = [self.metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        layers = int(self._meta("block_count"))
        head_dim = int(self._meta("attention.key_length", hidden // heads))
        try:
            return ModelConfig(
                **arch_fields(self, layers, heads, hidden, head_dim),
                vocab_size=self.infos["token_embd.weight"].shape[0],
                hidden_size=hidden,
                intermediate_size=int(self._meta("feed_forward_length")),
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=int(kv_heads),
                head_dim=head_dim,
                max_position_embeddings=int(self._meta("context_length", 4096)),
                rope_theta=float(self._meta("rope.freq_base", 10000.0)),
                rms_norm_eps=float(self._meta("attention.layer_norm_rms_epsilon", 1e-6)),
                tie_word_embeddings="output.weight" not in self.infos,
                attention_bias=self.architecture == "qwen2",
                bos_token_id=self.metadata.get("tokenizer.ggml.bos_token_id"),
                eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
                rope_scaling=tuple(sorted(self._rope_scaling.items())),
                rope_freq_factors=rope_freq_factors(self, head_dim),
            )
        except ConfigError as e:
            raise ModelFormatError(f"{self.path}: {e}") from None

    def hf_names(self) -> list[str]:
        """Hugging Face names of the tensors tokenleap uses, in file order."""
        return list(self.hf_to_gguf)

    def info(self, hf_name: str) -> TensorInfo:
        """The tensor (or, for a split fused tensor, its rows) holding ``hf_name``."""
        if hf_name not in self._views:
            raise KeyError(f"{self.path} has no tensor {hf_name!r}")
        return self._views[hf_name]

    def _heads_to_unpermute(self, hf_name: str) -> int | None:
        if self.architecture != "llama":
            return None
        if ".self_attn.q_proj." in hf_name:
            return self.config.num_attention_heads
        if ".self_attn.k_proj." in hf_name:
            return self.config.num_key_value_heads
        return None

    def raw_tensor(self, hf_name: str) -> tuple[GGMLQuantizationType, np.ndarray, tuple[int, ...]]:
        """(type, raw bytes, HF shape): bytes as uint8 [*shape[:-1], bytes_per_row], read-only.

        Rows are in Hugging Face order (llama's q/k permutation is undone on whole rows, which is
        exact: quantization blocks never cross rows); each row holds its quantization blocks.
        """
        info = self.info(hf_name)
        raw = self._bytes(info)  # [rows, bytes]
        n_head = self._heads_to_unpermute(hf_name)
        if n_head is not None:
            raw = _unpermute_rows(raw, n_head)
        return info.qtype, raw, info.shape

    def _bytes(self, info: TensorInfo) -> np.ndarray:
        """The tensor's stored bytes in file order, uint8 [*shape[:-1], bytes_per_row], read-only."""
        return self._data[info.file][info.offset:info.offset + info.nbytes].reshape(info.byte_shape)

    def _dequantize(self, info: TensorInfo, raw: np.ndarray) -> np.ndarray:
        try:
            return quants.dequantize(raw, info.qtype)  # float32
        except NotImplementedError:
            raise ModelFormatError(
                f"{self.path}: tensor {info.name!r} is stored as {info.qtype.name}, which tokenleap cannot "
                "dequantize; use a file quantized as Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ1..IQ4, TQ1_0, "
                "TQ2_0, MXFP4, F16, BF16 or F32") from None

    def check_types(self) -> None:
        """Refuse now, not part-way through a conversion, a tensor type that cannot be dequantized: the
        first row of one tensor of each type is dequantized (a 1-D tensor, small, whole)."""
        tried: set[GGMLQuantizationType] = set()
        for hf_name in self.hf_to_gguf:
            info = self.info(hf_name)
            if info.qtype not in tried:
                tried.add(info.qtype)
                raw = self._bytes(info)
                self._dequantize(info, raw.reshape(-1, raw.shape[-1])[:1] if raw.ndim > 1 else raw)

    def tensor(self, hf_name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized tensor in HF shape and order, e.g. [out, in] for projections."""
        info = self.info(hf_name)
        values = self._dequantize(info, self._bytes(info))  # float32, info.shape
        out = torch.from_numpy(np.array(values, dtype=np.float32, copy=True).reshape(info.shape))
        n_head = self._heads_to_unpermute(hf_name)
        if n_head is not None:
            out = _unpermute_rows(out, n_head).contiguous()
        if self.architecture == "gemma3" and hf_name.endswith("norm.weight"):
            out = out - 1.0  # llama.cpp stores Gemma's (1 + weight); Hugging Face stores weight
        return out.to(dtype)

    def iter_tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, dequantized tensor) pairs, one at a time to bound memory."""
        for hf_name in self.hf_to_gguf:
            yield hf_name, self.tensor(hf_name, dtype)

    def tokenizer_metadata(self) -> dict[str, Any]:
        """Every ``tokenizer.*`` metadata entry under its GGUF key, plus ``general.architecture``.

        Keys include ``tokenizer.ggml.model`` ("gpt2" for byte-level BPE, "llama" for SentencePiece),
        ``tokenizer.ggml.pre``, ``tokenizer.ggml.tokens`` (list[str]), ``tokenizer.ggml.token_type``
        (list[int]), ``tokenizer.ggml.merges`` (list[str], "a b"), ``tokenizer.ggml.bos_token_id``,
        ``tokenizer.ggml.eos_token_id``, ``tokenizer.ggml.padding_token_id``,
        ``tokenizer.ggml.add_bos_token`` and ``tokenizer.chat_template`` where the file has them.
        """
        out = {k: v for k, v in self.metadata.items() if k.startswith("tokenizer.")}
        out["general.architecture"] = self.architecture
        return out

    def close(self) -> None:
        maps, self._data = self._data or [], None
        for mm in (getattr(data, "_mmap", None) for data in maps):
            try:
                if mm is not None:
                    mm.close()
            except BufferError:  # views still alive elsewhere; the OS frees the map with them
                pass

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["GGUFFile", "TensorInfo", "gguf_to_hf_name", "read_header", "GGUF_MAGIC", "GGUF_ARCHITECTURES"]
