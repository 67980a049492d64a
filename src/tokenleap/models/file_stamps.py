"""Stamps that say a file was checked as it is now -- its resolved path, size and modification time,
written to a small file of their own -- so a costly check (a GGUF's SHA-256, a packed copy's CRC-32s)
runs again only once the file has changed. (No inode: a cache copied into an image, times kept, stays
checked.) Writing one is best effort: a cache that cannot be written (read-only) only means checking
again next time."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path


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
    """The stamp of ``path`` into ``marker`` (written aside, then renamed into place), where the cache
    can be written."""
    tmp = marker.with_name(f".{marker.name}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        marker.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.write_text(_stamp(path))
            os.replace(tmp, marker)
        finally:
            tmp.unlink(missing_ok=True)
