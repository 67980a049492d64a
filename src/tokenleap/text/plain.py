"""Text to token ids with no special tokens added -- for stop words, grammars, request fields -- with
any tokenizer: one whose ``encode`` takes no ``add_special_tokens`` option adds none."""
from __future__ import annotations

from typing import Any


def encode_plain(tokenizer: Any, text: str) -> list[int]:
    try:
        return tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # an encode without the option
        return tokenizer.encode(text)


__all__ = ["encode_plain"]
