"""Building tokenleap's C++ kernels with the PyTorch C++ extension tools, once per machine.

The sources compile into ``<tokenleap cache>/kernels/<key>``, the key a digest of the sources,
headers, flags, torch version and the sources' location. A compiler that cannot build the AMX
files (an older GCC) still gets the AVX2 kernels: the build is retried with ``amx_stub.cpp`` in
their place, which reports that no tile may run. A build prints one line to stderr when it starts
and one with the time it took; a lock left by a killed build is removed (torch's build would wait
on it for ever), one held by a live build waited on. A library cut short on disk (a link step
killed part-way leaves one that the build tool counts as finished) is removed and linked again:
loading a truncated one kills the process with SIGBUS.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import struct
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DIR = Path(__file__).parent
AMX_SOURCES = [DIR / "amx.cpp", DIR / "amx_int.cpp", DIR / "vnni.cpp", DIR / "w8a8.cpp", DIR / "attention512.cpp"]  # ISA extensions; stubbed by amx_stub.cpp
SOURCES = [DIR / "products.cpp", DIR / "int4.cpp", DIR / "int6.cpp", DIR / "attention.cpp", DIR / "decoder.cpp",
           DIR / "layer.cpp", DIR / "tree.cpp", *AMX_SOURCES]
AVX2_ONLY = [p for p in SOURCES if p not in AMX_SOURCES] + [DIR / "amx_stub.cpp"]
HEADERS = [DIR / "simd.h", DIR / "ops.h", DIR / "amx.h", DIR / "attention_unit.h"]
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]


def directory_for(sources: list[Path]) -> Path:
    """The build directory of ``sources``: keyed by their code, the headers, the flags, torch's version
    and where the sources lie -- torch's build file names them by absolute path, so two copies of
    the same code (two checkouts, two environments) sharing one directory would each see the
    other's build file as a changed build and compile everything again, each time either loads."""
    from tokenleap.models.catalog import default_cache_dir

    code = b"".join(p.read_bytes() for p in sources + HEADERS)
    where = "\n".join(str(p.resolve()) for p in sources).encode()
    key = hashlib.sha256(code + " ".join(FLAGS).encode() + torch.__version__.encode() + where)
    d = default_cache_dir() / "kernels" / key.hexdigest()[:16]
    d.mkdir(parents=True, exist_ok=True)
    return d


class DamagedBuild(RuntimeError):
    """A kernel library on disk is cut short where it cannot be rebuilt (a read-only cache)."""


def whole_library(so: Path) -> bool:
    """Whether ``so`` is a whole 64-bit ELF library: its header's section table, which the linker
    writes last, at the end of the file, lies inside the file."""
    try:
        with open(so, "rb") as f:
            head, size = f.read(64), os.fstat(f.fileno()).st_size
    except OSError:
        return False
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2:
        return False
    order = "<" if head[5] == 1 else ">"
    (table,) = struct.unpack_from(order + "Q", head, 0x28)
    entry, count = struct.unpack_from(order + "HH", head, 0x3A)
    return count > 0 and table + entry * count <= size


@contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Hold ``build_dir``'s build to this process. torch's own lock (``build_dir/lock``) is a plain
    file its build waits on, silently and for ever -- one left by a process killed mid-build would
    hang every later load. tokenleap's builds take an ``flock`` first, which the system releases
    when its holder dies: whoever holds it is the only tokenleap process building there, so a torch
    lock it finds is a dead build's and is removed. A build in progress elsewhere is waited on,
    with a message saying so."""
    with open(build_dir / "tokenleap.flock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("tokenleap: waiting for another process to finish building or checking the CPU kernels in "
                  f"{build_dir}", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                print(f"tokenleap: removing a kernel build lock left by an interrupted build ({stale})",
                      file=sys.stderr, flush=True)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def compile_sources(sources: list[Path], name: str) -> None:
    """Build (or load the cached build of) ``sources`` as the ``tokenleap`` ops; a build that has
    to compile says so on stderr, then how long it took."""
    from torch.utils.cpp_extension import load

    out = directory_for(sources)
    so = out / f"{name}.so"
    if so.is_file() and not os.access(out, os.W_OK):  # a read-only cache (an image's, another user's):
        if not whole_library(so):                      # torch's build would take its lock file there
            raise DamagedBuild(f"the CPU kernel library {so} is damaged (cut short) and its directory is read-only; "
                               "remove it, or point TOKENLEAP_CACHE at a writable directory")
        torch.ops.load_library(str(so))
        return
    with build_lock(out):
        if so.is_file() and not whole_library(so):
            print(f"tokenleap: the CPU kernel library {so} is damaged (cut short); building it again",
                  file=sys.stderr, flush=True)
            so.unlink()
        fresh = not any(out.glob("*.so"))
        if fresh:
            print(f"tokenleap: compiling the CPU kernels ({', '.join(p.name for p in sources)}) into {out}, "
                  "once per machine (30 s to a few minutes, by CPU)...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        load(name=name, sources=[str(p) for p in sources], extra_cflags=FLAGS, extra_include_paths=[str(DIR)],
             extra_ldflags=["-fopenmp"], is_python_module=False, build_directory=str(out))
        if fresh:
            print(f"tokenleap: CPU kernels built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


def built() -> bool:
    """A build of these sources (the full one or the AVX2 one) is on disk: loading it compiles nothing."""
    return any(any(directory_for(s).glob("*.so")) for s in (SOURCES, AVX2_ONLY))


def build() -> None:
    """The full build; where the AMX files do not compile, the AVX2 kernels without them."""
    try:
        compile_sources(SOURCES, "tokenleap_kernels")
    except DamagedBuild:
        raise
    except Exception as e:  # e.g. a compiler without AMX intrinsics: keep the AVX2 kernels
        log.warning("tokenleap CPU kernels: the full build failed (%s); building them without the AMX files",
                    f"{type(e).__name__}: {str(e).strip()[-200:]}")
        print("tokenleap: the kernel build failed; retrying without the AMX files (AVX2 kernels only)",
              file=sys.stderr, flush=True)
        compile_sources(AVX2_ONLY, "tokenleap_kernels_avx2")
