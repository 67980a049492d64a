"""The single entry point for model weights: ``load_checkpoint(name_or_path, dtype, cache_dir)``.

Resolution: a catalog short name -> its verified GGUF; an existing ``.gguf`` file; an existing
Hugging Face directory (config.json + *.safetensors). A GGUF is dequantized once into
``<cache_dir>/converted/<key>/`` (model.safetensors in the compute dtype, config.json, tokenizer
files); later loads memory-map that directory and take about a second. Its ``source.json`` holds the
CRC-32 of every file written there: the small files are checked at each load, the weights where their
stamp (``cache_files``) is missing or stale -- once after they changed on disk -- and a copy that
fails is converted again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer as TokenizerBackend

from tokenleap.config import ConfigError, ModelConfig
from tokenleap.errors import ModelFormatError, ModelNotFoundError
from tokenleap.models import hf
from tokenleap.models.catalog import CATALOG, default_cache_dir, resolve_gguf
from tokenleap.models.cache_files import abandoned, stamped, write_stamp, written_aside
from tokenleap.models.build import check_layout
from tokenleap.models.gguf import GGUF_MAGIC, GGUFFile
from tokenleap.models.gguf_split import named_shards

log = logging.getLogger(__name__)

CONVERTER_VERSION = 1  # bump when the converted layout or numerics change: old caches are then ignored
# bump when the tokenizer files a GGUF's metadata gives change (a pre-tokenizer's BOS default): a copy
# converted before has only its tokenizer files written again, keeping its weights and the keys of its
# packed copies and calibrations
TOKENIZER_VERSION = 2
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_HEADER_BYTES = 1 << 20  # how much of the GGUF the cache key hashes
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
                "half": torch.float16}  # (vLLM's --dtype spellings too)


@dataclass
class Checkpoint:
    """Everything needed to build a model and its tokenizer."""

    config: ModelConfig
    weights: dict[str, torch.Tensor] = field(repr=False)  # HF names, in the requested dtype
    tokenizer_dir: Path  # holds tokenizer.json + tokenizer_config.json
    source: str  # e.g. "catalog:qwen2.5-coder-1.5b-instruct", "gguf:/path/x.gguf", "hf:/path/dir"
    gguf_path: Path | None = None  # the GGUF the weights came from (raw quantized blocks live there)


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A supported compute dtype from a torch dtype or its name."""
    if isinstance(dtype, str):
        if dtype.lower() not in _DTYPE_NAMES:
            raise ConfigError(f"unsupported dtype {dtype!r}; choose float32, bfloat16 or float16")
        return _DTYPE_NAMES[dtype.lower()]
    if dtype not in _ST_DTYPES:
        raise ConfigError(f"unsupported dtype {dtype}; choose torch.float32, torch.bfloat16 or torch.float16")
    return dtype


def load_checkpoint(name_or_path: str | Path, dtype: torch.dtype | str,
                    cache_dir: Path | None = None) -> Checkpoint:
    """Load a catalog model, a GGUF file or a Hugging Face directory, with weights in ``dtype``."""
    dtype = as_dtype(dtype)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = str(name_or_path)
    if not key.strip():
        raise ModelNotFoundError("no model named: give a catalog name, a GGUF file or a model directory")
    if key in CATALOG:
        return _load_gguf(resolve_gguf(key, cache_dir), dtype, cache_dir, source=f"catalog:{key}")
    path = Path(key).expanduser()
    if path.is_file():
        if not _looks_like_gguf(path):
            inside = (path.parent / hf.CONFIG_FILE).is_file()
            hint = f" (to load the model directory it is in, name the directory: {path.parent})" if inside else ""
            raise ModelFormatError(f"{path} is neither a GGUF file nor a model directory{hint}")
        return _load_gguf(path, dtype, cache_dir, source=f"gguf:{path.resolve()}")
    if path.is_dir():
        if not (path / hf.CONFIG_FILE).is_file():
            ggufs = sorted(path.glob("*.gguf"))
            hint = f" (to load a GGUF file, name the file itself: {ggufs[0]})" if ggufs else ""
            raise ModelFormatError(
                f"{path} has no config.json; a model directory needs config.json and *.safetensors{hint}")
        config, weights = hf.load_hf_dir(path, dtype)
        return Checkpoint(config, weights, path, source=f"hf:{path.resolve()}")
    raise ModelNotFoundError(
        f"unknown model {key!r}: not a catalog name ({', '.join(CATALOG)}), GGUF file or model directory")


def _looks_like_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def _load_gguf(path: Path, dtype: torch.dtype, cache_dir: Path, source: str) -> Checkpoint:
    """The GGUF's converted checkpoint; one found damaged (truncated, emptied, a config that does not
    parse: tokenleap's own copy, which nothing else writes) is converted again, once."""
    out = convert_gguf(path, dtype, cache_dir)
    try:
        _refresh_tokenizer(out, path)
        _check_converted(out)
        config, weights = hf.load_hf_dir(out, dtype)
    except ModelFormatError as e:
        log.warning("the converted copy of %s is damaged (%s); converting it again", path.name, e)
        shutil.rmtree(out, ignore_errors=True)
        out = convert_gguf(path, dtype, cache_dir)
        _check_converted(out)  # where the cache is read-only, the damaged copy is still there: refused
        config, weights = hf.load_hf_dir(out, dtype)
    return Checkpoint(config, weights, out, source=source, gguf_path=path)


def _refresh_tokenizer(out: Path, gguf_path: Path) -> None:
    """Write the tokenizer files of the converted copy ``out`` again where an older tokenleap wrote them
    (``TOKENIZER_VERSION``), with their CRC-32s; a read-only cache keeps what it has."""
    source_file = out / "source.json"
    try:
        source = json.loads(source_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # (``_check_converted`` refuses it)
    if not isinstance(source, dict) or source.get("tokenizer_version", 1) >= TOKENIZER_VERSION:
        return
    if not os.access(out, os.W_OK):
        return
    from tokenleap.text.gguf_tokenizer import write_tokenizer_files

    gg = GGUFFile(gguf_path)
    fresh = out / f".tokenizer-{os.getpid()}"
    sums = source.get("crc32") if isinstance(source.get("crc32"), dict) else {}
    try:
        write_tokenizer_files(gg.tokenizer_metadata(), fresh)
        for name in _TOKENIZER_FILES:
            sums[name] = _crc32(fresh / name)
            os.replace(fresh / name, out / name)  # (each file whole: a reader sees the old one or the new)
    finally:
        gg.close()
        shutil.rmtree(fresh, ignore_errors=True)
    source.update(crc32=sums, tokenizer_version=TOKENIZER_VERSION)
    with written_aside(source_file) as tmp:
        tmp.write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
    log.info("wrote the tokenizer files of %s's converted copy again (tokenizer version %d)",
             gguf_path.name, TOKENIZER_VERSION)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _weights_stamp(out: Path) -> Path:
    return out / ".model.checked"


def _check_converted(out: Path) -> None:
    """Raise ``ModelFormatError`` where a file of the converted copy ``out`` no longer has the CRC-32
    written at its conversion (a copy from before checksums were written passes unchecked). The
    weights (gigabytes) are checked where their stamp is stale and can be written again, so once:
    in a read-only cache they would be read in full at every start, quantized loads included."""
    try:
        sums = json.loads((out / "source.json").read_text(encoding="utf-8")).get("crc32", {})
        if not isinstance(sums, dict):
            raise ValueError("no table of CRC-32s")
    except (OSError, ValueError, AttributeError) as e:
        raise ModelFormatError(f"{out / 'source.json'} is unreadable ({e})") from e
    weights = out / "model.safetensors"
    for name, want in sorted(sums.items()):
        f = out / name
        if f == weights and (stamped(_weights_stamp(out), weights) or not os.access(out, os.W_OK)):
            continue
        try:
            got = _crc32(f)
        except OSError as e:
            raise ModelFormatError(f"{f} is unreadable ({e})") from e
        if got != want:
            raise ModelFormatError(f"{f} has changed since it was converted (its CRC-32 does not match)")
        if f == weights:
            write_stamp(_weights_stamp(out), weights)


def conversion_key(gguf_path: Path, dtype: torch.dtype) -> str:
    """Cache key: file stem, dtype, and a digest of size, mtime and the first MiB of the file (and the
    sizes and mtimes of a split GGUF's other shards)."""
    digest = hashlib.sha256(f"v{CONVERTER_VERSION}:".encode())  # (an unsplit file's key as it always was)
    for i, path in enumerate(named_shards(gguf_path)):
        st = path.stat()
        digest.update(f"{path.name + ':' if i else ''}{st.st_size}:{st.st_mtime_ns}:".encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(_HEADER_BYTES))
    return f"{gguf_path.stem}-{str(dtype).removeprefix('torch.')}-{digest.hexdigest()[:16]}"


def model_key(source: str, gguf_path: Path | None, dtype: torch.dtype, quant: str) -> str:
    """A file stem naming a loaded model in per-model stores (calibrations, packed copies): a GGUF's
    conversion key (file stem, dtype, digest of the file) or, for a model directory, a digest of its
    path, of its weight files' sizes and times (weights replaced in place make another key) and of
    its config files' contents (an edited rope setting or EOS id too); plus the quantization."""
    if gguf_path is not None:
        return f"{conversion_key(Path(gguf_path), dtype)}-{quant}"
    path = Path(source.removeprefix("hf:")).expanduser().resolve()
    h = hashlib.sha256(str(path).encode())
    for f in sorted(path.glob("*.safetensors")) if path.is_dir() else ():
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    for name in (hf.CONFIG_FILE, hf.GENERATION_CONFIG_FILE):
        if (f := path / name).is_file():
            h.update(name.encode() + b":" + f.read_bytes())
    return f"{path.name}-{str(dtype).removeprefix('torch.')}-{h.hexdigest()[:16]}-{quant}"


def converted_dtypes(gguf: Path, cache_dir: Path | None = None) -> list[str]:
    """The dtypes this GGUF has been converted to in the cache (what loads in about a second)."""
    root = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "converted"
    found = []
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        try:
            if (root / conversion_key(gguf, dtype) / "model.safetensors").is_file():
                found.append(name)
        except OSError:  # the GGUF itself unreadable
            pass
    return found


def _is_complete(out: Path) -> bool:
    return all((out / n).is_file() for n in ("model.safetensors", hf.CONFIG_FILE, hf.TOKENIZER_FILE))


def convert_gguf(gguf_path: Path, dtype: torch.dtype, cache_dir: Path | None = None) -> Path:
    """Directory with the GGUF dequantized to ``dtype`` as a HF checkpoint; converts on first use."""
    gguf_path = Path(gguf_path)
    dtype = as_dtype(dtype)
    root = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "converted"
    out = root / conversion_key(gguf_path, dtype)
    if _is_complete(out):
        return out
    gg = GGUFFile(gguf_path)  # validates header and tensor ranges before the long work
    try:
        # what can be refused is refused before the disk check and the long write: a layout that can
        # never load, a tokenizer tokenleap cannot build, a tensor type it cannot dequantize
        from tokenleap.text.gguf_tokenizer import build_backend_tokenizer  # lazy: only conversions need it
        try:
            check_layout(gg.config, {name: gg.info(name).shape for name in gg.hf_names()})
            backend = build_backend_tokenizer(gg.tokenizer_metadata())
        except ModelFormatError as e:
            raise ModelFormatError(f"{gguf_path}: {e}") from None
        gg.check_types()
        _remove_dead_conversions(root, out.name)  # first: what they hold counts against the space check
        _check_disk_space(gg, dtype, root)
        tmp = root / f".tmp-{out.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            _write_converted(gg, dtype, tmp, backend)
            if not _is_complete(out):  # else a concurrent conversion finished first: keep its result
                shutil.rmtree(out, ignore_errors=True)  # an incomplete leftover, if any
                try:
                    os.rename(tmp, out)
                    write_stamp(_weights_stamp(out), out / "model.safetensors")  # just written: checked
                except OSError:
                    if not _is_complete(out):
                        raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        gg.close()
    return out


def _remove_dead_conversions(root: Path, name: str) -> None:
    """Temp directories of conversions killed part-way (up to the model's size each)."""
    for old in root.glob(f".tmp-{name}-*"):
        if abandoned(old, old.name.rsplit("-", 1)[-1]):
            shutil.rmtree(old, ignore_errors=True)


def _converted_nbytes(gg: GGUFFile, dtype: torch.dtype) -> int:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return sum(math.prod(gg.info(name).shape) * itemsize for name in gg.hf_names())


def _check_disk_space(gg: GGUFFile, dtype: torch.dtype, root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    need, free = _converted_nbytes(gg, dtype), shutil.disk_usage(root).free
    if need > free:
        raise ModelFormatError(
            f"converting {gg.path.name} to {dtype} needs {need / 2**30:.1f} GiB in {root}, "
            f"but only {free / 2**30:.1f} GiB is free; free space or set TOKENLEAP_CACHE elsewhere")


def _write_converted(gg: GGUFFile, dtype: torch.dtype, out: Path, backend: TokenizerBackend) -> None:
    """Tokenizer files (``backend``: the tokenizer built from the file's metadata), model.safetensors
    (streamed, one tensor in memory at a time), config.json, and source.json: where they came from,
    and their CRC-32s."""
    from tokenleap.text.gguf_tokenizer import write_tokenizer_files  # lazy: only conversions need it

    write_tokenizer_files(gg.tokenizer_metadata(), out, backend)
    crc = _write_safetensors(gg, dtype, out / "model.safetensors")
    config = gg.config.to_hf_dict()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / hf.CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    st = gg.path.stat()
    sums = {f.name: _crc32(f) for f in sorted(out.iterdir()) if f.is_file() and f.name != "model.safetensors"}
    source = {"gguf": str(gg.path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
              "dtype": str(dtype), "converter_version": CONVERTER_VERSION, "tokenizer_version": TOKENIZER_VERSION,
              "crc32": {**sums, "model.safetensors": crc}}
    (out / "source.json").write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")


def _write_safetensors(gg: GGUFFile, dtype: torch.dtype, path: Path) -> int:
    """Write a safetensors file tensor by tensor: header from the GGUF shapes, then the data; its CRC-32."""
    from tqdm import tqdm

    names = gg.hf_names()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    header: dict[str, object] = {"__metadata__": {"format": "pt", "source": gg.path.name}}
    offset = 0
    for name in names:
        shape = list(gg.info(name).shape)
        nbytes = itemsize * math.prod(shape)
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned
    head = struct.pack("<Q", len(blob)) + blob
    crc = zlib.crc32(head)
    with open(path, "wb") as f:
        f.write(head)
        for name in tqdm(names, desc=f"converting {gg.path.name} to {dtype}", unit="tensor",
                         disable=None, leave=False):
            data = gg.tensor(name, dtype).contiguous().reshape(-1).view(torch.uint8).numpy().data  # HF shape
            crc = zlib.crc32(data, crc)
            f.write(data)
    if path.stat().st_size != 8 + len(blob) + offset:
        raise ModelFormatError(f"writing {path} produced a file of the wrong size; is the disk full?")
    return crc


__all__ = ["Checkpoint", "load_checkpoint", "convert_gguf", "conversion_key", "as_dtype"]
