"""The kernel build: one line on stderr when it compiles and one with the time it took; a compiler
that cannot build the AMX files still gets the AVX2 kernels (the build retried without them).
The compiler is replaced by a stand-in, so nothing is compiled here."""
from __future__ import annotations

import struct

import pytest
import torch.utils.cpp_extension

import tokenleap.kernels.compiler as kernels


def _library(cut: int = 0) -> bytes:
    """A stand-in ELF library: a 64-byte header whose one-entry section table ends the file, less ``cut`` bytes."""
    head = bytearray(64)
    head[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", head, 0x28, 64)
    struct.pack_into("<HH", head, 0x3A, 64, 1)
    whole = bytes(head) + bytes(64)
    return whole[: len(whole) - cut]


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    calls: list[list[str]] = []

    def load(name, sources, build_directory, **kwargs):
        calls.append([s.rsplit("/", 1)[-1] for s in sources])
        if any(s.endswith("amx.cpp") for s in sources):
            raise RuntimeError("error: '__builtin_ia32_tileloadd64' was not declared (old compiler)")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    monkeypatch.setattr(kernels, "directory_for", lambda sources: tmp_path / str(len(sources)))
    for sources in (kernels.SOURCES, kernels.AVX2_ONLY):
        (tmp_path / str(len(sources))).mkdir(exist_ok=True)
    return calls


def test_amx_compile_failure_falls_back_to_avx2_kernels(fake_build, capsys):
    kernels.build()
    full, avx2 = fake_build
    assert "amx.cpp" in full and "amx_int.cpp" in full and "vnni.cpp" in full
    assert "amx.cpp" not in avx2 and "amx_int.cpp" not in avx2 and "vnni.cpp" not in avx2 and "amx_stub.cpp" in avx2
    assert {"products.cpp", "int4.cpp", "int6.cpp", "decoder.cpp", "layer.cpp"} <= set(avx2)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("tokenleap: compiling the CPU kernels") and "amx.cpp" in err[0]
    assert "retrying without the AMX files" in err[1]
    assert err[2].startswith("tokenleap: compiling the CPU kernels") and "amx.cpp" not in err[2]
    assert err[3].startswith("tokenleap: CPU kernels built in ") and err[3].endswith(" s")
    assert len(err) == 4


def test_a_cached_build_prints_nothing(fake_build, capsys, tmp_path):
    (tmp_path / str(len(kernels.AVX2_ONLY)) / "tokenleap_kernels_avx2.so").write_bytes(_library())
    (tmp_path / str(len(kernels.SOURCES)) / "tokenleap_kernels.so").write_bytes(_library())
    kernels.compile_sources(kernels.AVX2_ONLY, "tokenleap_kernels_avx2")
    assert capsys.readouterr().err == ""


def test_a_dead_builds_lock_is_removed_and_a_live_build_waited_for(fake_build, tmp_path, capsys):
    """torch's build waits for ever on ``build_dir/lock``. One left by a killed build (no process holds
    tokenleap's flock) is removed before building; while another process holds the flock -- it is
    building -- the build waits for it, saying so, and runs once it is released."""
    import subprocess
    import sys

    out = tmp_path / str(len(kernels.AVX2_ONLY))
    (out / "lock").touch()
    kernels.compile_sources(kernels.AVX2_ONLY, "tokenleap_kernels_avx2")
    assert not (out / "lock").exists() and len(fake_build) == 1
    assert "removing a kernel build lock left by an interrupted build" in capsys.readouterr().err

    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\n"
                               f"f = open({str(out / 'tokenleap.flock')!r}, 'a'); fcntl.flock(f, fcntl.LOCK_EX)\n"
                               "print('held', flush=True); time.sleep(1.0)\n"
                               f"open({str(tmp_path / 'done')!r}, 'w').close()"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    finished_first = []
    original = torch.utils.cpp_extension.load

    def load(**kw):
        finished_first.append((tmp_path / "done").exists())  # (written by the holder before it lets go)
        original(**kw)

    torch.utils.cpp_extension.load = load
    try:
        kernels.compile_sources(kernels.AVX2_ONLY, "tokenleap_kernels_avx2")
    finally:
        torch.utils.cpp_extension.load = original
        holder.wait()
    assert finished_first == [True]  # the build ran only after the holder let go
    assert "waiting for another process to finish building" in capsys.readouterr().err


def test_two_copies_of_the_same_sources_build_apart(monkeypatch, tmp_path):
    """torch's build file names the sources by absolute path: two checkouts of the same code sharing a
    build directory would rebuild it for each other at every load, so the location is in the key."""
    monkeypatch.setenv("TOKENLEAP_CACHE", str(tmp_path / "cache"))
    copies = []
    for where in ("one", "two"):
        (tmp_path / where).mkdir()
        copies.append([tmp_path / where / p.name for p in kernels.SOURCES])
        for p, q in zip(kernels.SOURCES, copies[-1]):
            q.write_bytes(p.read_bytes())
    one, two = (kernels.directory_for(c) for c in copies)
    assert one != two and one == kernels.directory_for(copies[0]) and one.parent == two.parent


def test_a_finished_build_in_a_read_only_cache_is_loaded_as_it_is(fake_build, tmp_path, monkeypatch):
    """torch's build takes a lock file in the build directory: where that cannot be written (a cache
    in an image, another user's), a finished build's library is loaded directly -- no lock, no
    build, no fall-back to the AVX2 files."""
    so = tmp_path / str(len(kernels.SOURCES)) / "tokenleap_kernels.so"
    so.write_bytes(_library())
    loaded: list[str] = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(kernels.os, "access", lambda path, mode: False)
    monkeypatch.setattr(kernels, "build_lock", lambda out: pytest.fail("a lock was taken"))
    kernels.build()
    assert loaded == [str(so)] and fake_build == []


@pytest.mark.parametrize("cut", [1, 64, 128])
def test_a_library_cut_short_is_linked_again(fake_build, tmp_path, capsys, cut):
    """A link step killed part-way leaves a truncated (or empty) library that the build tool counts as
    built; loading a truncated one kills the process with SIGBUS. It is removed and built again."""
    so = tmp_path / str(len(kernels.AVX2_ONLY)) / "tokenleap_kernels_avx2.so"
    so.write_bytes(_library(cut))
    kernels.compile_sources(kernels.AVX2_ONLY, "tokenleap_kernels_avx2")
    err = capsys.readouterr().err
    assert not so.exists() and len(fake_build) == 1  # the stand-in build writes nothing
    assert "is damaged (cut short); building it again" in err and "compiling the CPU kernels" in err


def test_a_library_cut_short_in_a_read_only_cache_is_refused(fake_build, tmp_path, monkeypatch):
    so = tmp_path / str(len(kernels.SOURCES)) / "tokenleap_kernels.so"
    so.write_bytes(_library(8))
    monkeypatch.setattr(torch.ops, "load_library", lambda path: pytest.fail("a damaged library was loaded"))
    monkeypatch.setattr(kernels.os, "access", lambda path, mode: False)
    with pytest.raises(kernels.DamagedBuild, match="cut short.*TOKENLEAP_CACHE"):
        kernels.build()
    assert fake_build == []  # no fall-back build into the read-only cache


def test_whole_library_reads_a_real_build(tmp_path):
    import tokenleap.kernels as k

    if not k.available():
        pytest.skip("no compiled kernels here")
    so = next(p for s in (kernels.SOURCES, kernels.AVX2_ONLY) for p in kernels.directory_for(s).glob("*.so"))
    assert kernels.whole_library(so)
    data = so.read_bytes()
    for cut in (1, len(data) // 2):
        (tmp_path / "cut.so").write_bytes(data[:-cut])
        assert not kernels.whole_library(tmp_path / "cut.so")
    assert not kernels.whole_library(tmp_path / "missing.so")
