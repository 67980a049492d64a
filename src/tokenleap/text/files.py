"""Text files a user hands in (prompts, datasets, grammars, predictions): UTF-8, a leading byte-order
mark dropped, with one message for each way it cannot be read."""
from __future__ import annotations

from pathlib import Path


def read_text_file(path: str | Path, what: str) -> str:
    """``path``'s text, or a ValueError naming ``what`` and why: missing, not a file, unreadable,
    not UTF-8."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} {path} " + ("is not a file" if p.exists() else "does not exist"))
    try:
        return p.read_text(encoding="utf-8-sig")
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {e.start})") from None


def decode_text(data: bytes, what: str) -> str:
    """``data`` (e.g. standard input's bytes) as ``read_text_file`` reads a file: UTF-8, a leading
    byte-order mark dropped, line ends as universal newlines; a ValueError naming ``what`` if not UTF-8."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not UTF-8 text (byte {e.start})") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


__all__ = ["decode_text", "read_text_file"]
