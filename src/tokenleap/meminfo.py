"""The machine's memory figures from ``/proc/meminfo`` (Linux), in bytes; None where they cannot be read."""
from __future__ import annotations

from pathlib import Path


def meminfo(field: str) -> int | None:
    """``field`` (``MemTotal``, ``MemAvailable``, ``SwapFree`` ...) in bytes."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name == field:
                return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
