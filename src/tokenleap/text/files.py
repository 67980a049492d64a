"""Text files a user hands in (prompts, datasets, grammars, predictions): UTF-8, a leading byte-order
mark dropped, with one message for each way it cannot be read."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path


def read_text_file(path: str | Path, what: str) -> str:
    """``path``'s text, or a ValueError naming ``what`` and why: missing, a directory or a device,
    unreadable, not UTF-8. ``-`` is standard input; a pipe (``/dev/stdin``, a shell's ``<(...)``) and a
    terminal read as a file does (a device that never ends, such as /dev/zero, is refused)."""
    if str(path) == "-":
        return decode_text(sys.stdin.buffer.read(), f"{what}: standard input")
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise ValueError(f"{what} {path} does not exist") from None
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror}") from None
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or (stat.S_ISCHR(mode) and _is_terminal(p))):
        raise ValueError(f"{what} {path} is not a file")
    try:
        return p.read_text(encoding="utf-8-sig")
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {e.start})") from None


def _is_terminal(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return os.isatty(fd)
    finally:
        os.close(fd)


def decode_text(data: bytes, what: str) -> str:
    """``data`` (e.g. standard input's bytes) as ``read_text_file`` reads a file: UTF-8, a leading
    byte-order mark dropped, line ends as universal newlines; a ValueError naming ``what`` if not UTF-8."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not UTF-8 text (byte {e.start})") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def jsonl_lines(text: str) -> list[str]:
    """A JSON Lines text's lines: split at line feeds only -- ``str.splitlines`` also splits at U+2028,
    U+2029 and U+0085, which JSON writers leave raw inside strings."""
    return text.split("\n")


__all__ = ["decode_text", "jsonl_lines", "read_text_file"]
