"""Files in tokenleap's cache: written aside then renamed into place, made by one process at a time,
and stamped once checked.

A stamp says a file was checked as it is now -- its resolved path, size and modification time, written
to a small file of its own -- so a costly check (a GGUF's SHA-256, a packed copy's CRC-32s) runs again
only once the file has changed. (No inode: a cache copied into an image, times kept, stays checked.)
Writing one is best effort: a cache that cannot be written (read-only) only means checking again next
time."""
from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's)
        return True
    return True


def abandoned(temp: Path, pid: str, min_age: float = 600.0) -> bool:
    """Whether ``temp`` (a file or a directory of files being written) was left by a writer killed
    part-way: its ``pid`` names no process here and nothing in it changed for ``min_age`` seconds (a
    cache shared with another machine or container may hold a live writer whose pid is not seen here)."""
    if not pid.isdigit() or _process_alive(int(pid)):
        return False
    try:
        newest = max([temp.stat().st_mtime, *(f.stat().st_mtime for f in temp.iterdir())] if temp.is_dir()
                     else [temp.stat().st_mtime])
    except OSError:
        return False
    return time.time() - newest > min_age


def remove_abandoned(directory: Path, pattern: str, min_age: float = 600.0) -> None:
    """Remove the temp files ``written_aside`` left in ``directory`` for the names matching ``pattern``
    (a glob such as ``*.pt``) whose writer was killed part-way (``abandoned``): each may be as large
    as the file it was to become, and nothing else ever removes it."""
    for tmp in directory.glob(f"{pattern}.*.tmp"):  # (NAME.tTID.PID.tmp; NAME.PID.tmp before)
        if abandoned(tmp, tmp.name.rsplit(".", 2)[-2], min_age):
            with contextlib.suppress(OSError):
                tmp.unlink()


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()} {st.st_size} {st.st_mtime_ns}\n"


def stamped(marker: Path, path: Path) -> bool:
    """Whether ``marker`` holds the stamp of ``path`` as the file is now."""
    try:
        return marker.read_text() == _stamp(path)
    except OSError:
        return False


def write_stamp(marker: Path, path: Path) -> None:
    """The stamp of ``path`` into ``marker``, where the cache can be written."""
    with contextlib.suppress(OSError), written_aside(marker) as tmp:
        tmp.write_text(_stamp(path))


@contextlib.contextmanager
def written_aside(path: Path) -> Iterator[Path]:
    """A temp name beside ``path`` (``NAME.tTID.PID.tmp``: one a thread, so two writers never mix) to write
    to; renamed over ``path`` when the block ends without an error (a reader sees the old file or the
    new one, never half of one), removed when it fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # (the thread too: two threads of one process must not write one file; the PID stays last but one,
    # where remove_abandoned reads it)
    tmp = path.with_name(f"{path.name}.t{threading.get_native_id()}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """``path`` (a lock file, made if missing) held by this process alone for the block: a second one
    waits. The system lets go of it when its holder dies, so a killed process leaves no stale lock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
