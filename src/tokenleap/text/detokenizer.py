"""Streaming detokenization: token ids in, text pieces out, never splitting a UTF-8 character."""
from __future__ import annotations

import bisect
import operator
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenleap.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces, never splitting a UTF-8 character.

    Only a small window is decoded per call: ``_prefix`` marks where the window starts (a clean
    character boundary, kept one chunk back as context), ``_read`` where already-emitted text ends,
    ``_pending`` how many characters past ``_read`` were emitted while a multi-byte character at
    the end was still incomplete. Concatenating every ``add`` result and ``flush`` equals
    ``tokenizer.decode(all_ids)``.
    """

    # Past this many tokens without a complete character the bytes are garbage, not a split char.
    MAX_PENDING_TOKENS = 16

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = self._pending = 0
        self._bounds = [0]  # the positions where the text decoded whole: characters' boundaries, ascending

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self.ids[start:end], skip_special_tokens=self._skip)

    def _context(self) -> str:
        """The window's already-emitted text, the window widened back while it decodes to nothing
        (skipped special tokens): a decoder that strips the text's first space (SentencePiece with a
        space prefix) would otherwise strip the first new piece's. It widens to the last boundary
        of whole characters before it, never into a character: a byte-fallback decoder reads a run
        of byte tokens as one UTF-8 sequence, and a stray byte of the character before would spoil
        the next one's."""
        prefix_text = self._decode(self._prefix, self._read)
        while not prefix_text and self._prefix > 0:
            self._prefix = self._bounds[bisect.bisect_left(self._bounds, self._prefix) - 1]
            prefix_text = self._decode(self._prefix, self._read)
        return prefix_text

    def add(self, ids: int | Iterable[int]) -> str:
        """Append token id(s); return the text they complete ("" while a character is partial).
        Several ids are taken one at a time: a window that ends inside a character at every call
        would never move on, and past ``MAX_PENDING_TOKENS`` its held-back bytes would go out."""
        try:
            one = operator.index(ids)
        except TypeError:
            return "".join(self._add_one(operator.index(i)) for i in ids)
        return self._add_one(one)

    def _add_one(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._context()
        text = self._decode(self._prefix)
        stable = len(text.rstrip("\ufffd"))
        if stable < len(text) and len(self.ids) - self._read > self.MAX_PENDING_TOKENS:
            stable = len(text)
        start = len(prefix_text) + self._pending
        piece = text[start:stable] if stable > start else ""
        if stable == len(text):
            self._prefix, self._read, self._pending = self._read, len(self.ids), 0
            self._bounds.append(self._read)
        else:
            self._pending += len(piece)
        self.text += piece
        return piece

    def flush(self) -> str:
        """Return whatever is held back (an incomplete character decodes as U+FFFD) and reset."""
        prefix_text = self._context()
        piece = self._decode(self._prefix)[len(prefix_text) + self._pending:]
        self._prefix = self._read = len(self.ids)
        self._pending = 0
        self._bounds.append(self._read)
        self.text += piece
        return piece
