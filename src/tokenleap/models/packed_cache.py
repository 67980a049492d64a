"""Quantized models kept on disk between runs, so a model loads in seconds after its first load.

Quantizing at load -- re-packing a GGUF's 4-bit blocks, quantizing its 6-bit tensors, or quantizing
float weights -- takes most of a load (about 6 of 10 s for Qwen2.5-Coder-1.5B at int4 on a 2-core
EPYC). The quantized model (before ``prepare_for_kernels_``, which adapts it to this machine and
process) is saved with ``torch.save`` under the cache directory's ``packed/`` on the first load and
memory-mapped from there on the next ones: the same tensors, so the same outputs, bit for bit.

A file's name holds what made it: the model's key (``checkpoint.model_key``: the weights' file,
dtype and quantization), how a GGUF's other tensors were quantized, and a digest of the code that
builds and quantizes models (``tokenleap/models`` and ``tokenleap/kernels``, tokenleap's and
torch's versions) and of what decides the packed layouts on this machine (whether the compiled
kernels run, the CPU's flags, ``TOKENLEAP_AMX``) -- a changed quantizer, or a cache directory shared
with another kind of machine, never reads a file made otherwise. One file is kept per model key:
storing a new one removes the others. A file that cannot be read is removed and rebuilt, and so is
one whose bytes changed on disk (its zip members' CRC-32s, checked where the stamp beside it --
``cache_files``: written when it was stored or last checked -- is missing or stale: a copy made
elsewhere, or a file changed since) or that holds another key's model (its name is stored in it: a
file copied over another). The files
are tokenleap's own, written to the user's cache; they are unpickled (``weights_only=False``: the
modules are tokenleap's classes), so the cache directory must be the user's. ``TOKENLEAP_PACKED_CACHE=0``
turns the cache off.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import zipfile
from functools import lru_cache
from pathlib import Path

import torch

import tokenleap
from tokenleap import kernels
from tokenleap.models.cache_files import remove_abandoned, stamped, write_stamp, written_aside
from tokenleap.models.transformer import Transformer

log = logging.getLogger("tokenleap.models")
_SUFFIX = ".pt"


def enabled() -> bool:
    return os.environ.get("TOKENLEAP_PACKED_CACHE", "1") not in ("0", "false", "no", "off")


@lru_cache(maxsize=1)
def _code_hash() -> str:
    """A digest of the code a packed model's tensors and classes come from."""
    root = Path(tokenleap.__file__).parent
    h = hashlib.sha256(f"{tokenleap.__version__}:{torch.__version__}".encode())
    for sub in ("models", "kernels"):
        for f in sorted((root / sub).iterdir()):
            if f.suffix in (".py", ".cpp", ".h"):
                h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def build_digest() -> str:
    """The code's digest and what chooses the packed layouts here (read each time: tests turn the
    kernels off within a process)."""
    on = kernels.available()
    machine = (on, on and kernels.vnni_supported(), on and kernels.amx_available(),
               torch.backends.cpu.get_cpu_capability(), sorted(kernels.cpu_flags()),
               os.environ.get("TOKENLEAP_AMX", "1"))
    return hashlib.sha256(f"{_code_hash()}:{machine}".encode()).hexdigest()[:16]


def path_for(cache_dir: Path, key: str) -> Path:
    return cache_dir / "packed" / f"{key}-{build_digest()}{_SUFFIX}"


def load(path: Path) -> Transformer | None:
    """The model stored at ``path`` (its tensors memory-mapped), or None: none there, or unreadable,
    changed on disk since it was written, or another model's (then removed, to be stored again)."""
    if not path.is_file():
        return None
    checked = stamped(_stamp_path(path), path)
    try:
        problem = None if checked else _bad_member(path)
        model = None if problem else torch.load(path, mmap=True, weights_only=False)
    except Exception as e:  # a torn or foreign file: rebuilt by the caller
        problem = str(e)
    if problem is None and (not isinstance(model, Transformer) or model.__dict__.get("_packed_name") != path.name):
        problem = "it holds another model or quantization"  # (copied or renamed into place)
    if problem is not None:
        log.warning("packed model %s could not be read (%s); quantizing again", path, problem)
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        return None
    if not checked:
        write_stamp(_stamp_path(path), path)
    model.__dict__.pop("_backend", None)  # (a choice made in another process: chosen again here)
    return model


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".ok")


def _bad_member(path: Path) -> str | None:
    """The first member of the file (a zip) whose CRC-32 does not match, or None: 0.5 GB/s on a busy
    2-core EPYC (0.45 s of CPU a GB), done where the file's stamp is missing or stale -- a copy made
    elsewhere, or one changed (its time or size) since it was stamped -- so its bytes are checked
    before they are loaded."""
    with zipfile.ZipFile(path) as z:
        bad = z.testzip()
    return None if bad is None else f"its member {bad} fails its CRC-32 check"


def store(model: Transformer, path: Path) -> None:
    """Save ``model`` at ``path`` (written aside, then renamed into place: a reader never sees half a
    file) and remove the files of the same model made by other code; a failure (a full disk, a module
    that cannot be pickled) only loses the cache."""
    remove_abandoned(path.parent, f"*{_SUFFIX}")  # stores killed part-way, up to a model's size each
    model.__dict__.pop("_backend", None)  # (this process's choice: not stored)
    model._packed_name = path.name  # load() refuses a file renamed or copied over another
    try:
        with written_aside(path) as tmp:  # (NAME.tTID.PID.tmp: what remove_abandoned looks for)
            torch.save(model, tmp)
        write_stamp(_stamp_path(path), path)
    except Exception as e:  # a full disk, a read-only cache, a module that cannot be pickled: uncached
        log.warning("could not keep the quantized model in %s (%s)", path.parent, e)
        return
    stem = path.name.removesuffix(f"-{build_digest()}{_SUFFIX}")
    for old in path.parent.glob(f"{stem}-*{_SUFFIX}"):
        if old != path and len(old.name) == len(path.name):  # (same key, another code digest)
            with contextlib.suppress(OSError):
                old.unlink(missing_ok=True)
                _stamp_path(old).unlink(missing_ok=True)


def stored(gguf: Path, cache_dir: Path | None = None) -> list[dict]:
    """The packed copies of this GGUF's model in the cache that this build reads: per copy its
    quantization (``others``: of the GGUF's tensors in other formats -- int8, or int4 as a draft loads
    them), dtype and size in bytes (``tokenleap models`` lists them). Listing compiles nothing: before
    this install's kernels are first built (its copies' digest names the build), none are listed."""
    from tokenleap.models.catalog import default_cache_dir
    from tokenleap.models.checkpoint import conversion_key
    if not kernels.ready():
        return []
    root = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "packed"
    digest, out = build_digest(), []
    for dtype in (torch.float32, torch.bfloat16):
        try:
            prefix = conversion_key(gguf, dtype) + "-"
        except OSError:
            return out
        for f in sorted(root.glob(f"{prefix}*-{digest}{_SUFFIX}")):
            quant, others = (f.name[len(prefix):].split("-") + [""])[:2]  # others: the GGUF's other tensors'
            out.append({"quant": quant, "others": others, "dtype": str(dtype).removeprefix("torch."),
                        "bytes": f.stat().st_size, "path": str(f)})
    return out
