"""Drafting with a model of another tokenizer (universal assisted generation, text at the boundary).

The draft model works in its own tokens, through an inner :class:`DraftModelProposer` (its KV cache,
batching across sequences, catch-up, an optional cascade). Each proposal:

1. the sequence's committed target tokens become text (their exact bytes), and the text the draft's
   tokenizer makes of it becomes the draft's context; the draft cache keeps the longest common
   prefix of those ids with the ids it holds and is rolled back to it (after a rejection, the
   accepted text re-tokenized), so the draft recomputes only what changed;
2. the draft drafts greedily, in its own tokens, about as many as the target tokens wanted;
3. its new text is re-tokenized by the target's tokenizer in context (the last few committed tokens'
   text before it, which must come back as those same tokens), and the last target token is
   dropped: the draft's text may end inside it.

The proposal is a chain of target tokens without draft distributions (``probs`` None: a point mass
on each token). That keeps every kind of verification exact whatever the draft did: greedy accepts
the target's argmax, seeded requests go through the drafter-invariant race (the tokens plain seeded
sampling emits), and unseeded rejection sampling with a point-mass ``q`` accepts ``x`` with
probability ``p(x)`` and otherwise samples ``p`` without ``x`` -- exactly ``p`` for any ``x`` chosen
independently of the verifier's randomness (the draft drafts greedily and draws nothing).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenleap.config import SamplingParams
from tokenleap.spec.proposers.base import Draft, DraftRequest

_CONTEXT_TOKENS = 4  # committed target tokens re-tokenized with the draft's text (their text anchors it)
_GREEDY = SamplingParams(max_tokens=1)  # the draft always drafts its argmax (see the module docstring)


_PROBE = ("def f(x):\n    return {'a': [1, 2.5]}  # naïve café ñ 😀\n<|im_start|>user\nHello, World!<|im_end|>\n"
          "The quick brown fox jumps over the lazy dog. 1234567890 <s></s> \t\r\n  x")


def same_tokenizer(a, b) -> bool:
    """Whether two ``text.tokenizer.Tokenizer`` map text to the same ids: the same spelling of every
    61st id both hold (where both can spell ids), the same ids for a probe text. Sizes may differ: a
    GGUF of a model whose embedding matrix is padded (Qwen2.5 7B and larger) lists the padding rows
    as tokens. (Comparing whole vocabularies costs seconds for 150k tokens; a false 'same' could
    only cost acceptance, never exactness -- the target verifies every token.)"""
    if a is b:
        return True
    spell_a, spell_b = getattr(a, "id_to_token", None), getattr(b, "id_to_token", None)
    if spell_a and spell_b and any(spell_a(i) != spell_b(i) for i in range(0, min(a.vocab_size, b.vocab_size), 61)):
        return False
    return all(a.encode(t, add_special_tokens=s) == b.encode(t, add_special_tokens=s)
               for t in (_PROBE, _PROBE.upper()) for s in (False, True))


@dataclass
class _Seq:
    """One sequence's view in the draft's tokens."""

    text: bytearray = field(default_factory=bytearray)  # bytes of the committed target tokens converted
    converted: int = 0  # target tokens whose bytes ``text`` holds
    draft_ids: list[int] = field(default_factory=list)  # ids fed to (or about to be fed to) the draft cache
    memo: tuple[int, list[int]] | None = None  # (target length, draft context) of the last conversion
    ratio: float = 1.0  # draft tokens per target token, from the prompt


class CrossTokenizerProposer:
    """A draft model of another tokenizer behind the target's proposer protocol (chains only)."""

    @property
    def name(self) -> str:
        """The inner proposer's: "draft", or "cascade" where n-gram lookup speculates the draft's steps."""
        return getattr(self.inner, "name", "draft")

    def __init__(self, inner, target_tokenizer, draft_tokenizer) -> None:
        self.inner = inner  # a DraftModelProposer (or cascade) over the draft's own vocabulary
        self.target_tok, self.draft_tok = target_tokenizer, draft_tokenizer
        self._seqs: dict[int, _Seq] = {}
        self._target_bytes: dict[int, bytes] = {}
        self._draft_bytes: dict[int, bytes] = {}
        # a BOS the target's tokenizer adds is no text (a chat template's own special tokens are)
        self._skip = {target_tokenizer.bos_token_id} if getattr(target_tokenizer, "add_bos_token", False) else set()
        target_specials = target_tokenizer.backend.get_added_tokens_decoder()
        self._target_special_text = {t.content for t in target_specials.values()}
        self._draft_special = {i: t.content for i, t in draft_tokenizer.backend.get_added_tokens_decoder().items()
                               if t.special}
        self._draft_bos = draft_tokenizer.bos_token_id if getattr(draft_tokenizer, "add_bos_token", False) else None

    # -- text <-> ids ---------------------------------------------------------------------------
    def _tbytes(self, token: int) -> bytes:
        b = self._target_bytes.get(token)
        if b is None:
            b = self._target_bytes[token] = self.target_tok.token_bytes(token)
        return b

    def _dbytes(self, token: int) -> bytes:
        b = self._draft_bytes.get(token)
        if b is None:
            b = self._draft_bytes[token] = self.draft_tok.token_bytes(token)
        return b

    def _context(self, seq_id: int, tokens: list[int]) -> list[int] | None:
        """The draft's ids for the text of ``tokens`` (None while that text ends inside a character)."""
        s = self._seqs[seq_id]
        if s.memo is not None and s.memo[0] == len(tokens):
            return s.memo[1]
        if len(tokens) < s.converted:  # never within a sequence (its tokens only grow); rebuild
            s.text, s.converted = bytearray(), 0
        for t in tokens[s.converted:]:
            if not (s.converted == 0 and t in self._skip):
                s.text += self._tbytes(t)
            s.converted += 1
        try:
            text = s.text.decode("utf-8")
        except UnicodeDecodeError:
            return None
        ids = self.draft_tok.encode(text, add_special_tokens=False)
        if self._draft_bos is not None:
            ids = [self._draft_bos] + ids
        s.memo = (len(tokens), ids)
        return ids

    def _rewind(self, seq_id: int, ids: list[int]) -> None:
        """Keep in the draft cache only the longest common prefix of what it holds and ``ids``."""
        s = self._seqs[seq_id]
        held, common = s.draft_ids, 0
        limit = min(self.inner.fed(seq_id), len(held), len(ids))
        while common < limit and held[common] == ids[common]:
            common += 1
        self.inner.rewind(seq_id, common)
        s.draft_ids = list(ids)

    def _target_tokens(self, tokens: list[int], new: bytes) -> list[int]:
        """Target tokens for the draft's new text ``new`` after ``tokens``, the last one dropped."""
        for w in (min(_CONTEXT_TOKENS, len(tokens)), 0):
            left = b"".join(self._tbytes(t) for t in tokens[len(tokens) - w:]) if w else b""
            text = _utf8_prefix(left + new)
            if text is None or len(text.encode("utf-8")) <= len(left):
                continue
            ids = self.target_tok.encode(text, add_special_tokens=False)
            if ids[:w] == tokens[len(tokens) - w:]:
                return ids[w:-1]
        return []

    # -- the proposer protocol ------------------------------------------------------------------
    def begin(self, seq_id: int, prompt: list[int]) -> None:
        self._seqs[seq_id] = s = _Seq()
        ids = self._context(seq_id, prompt) or []
        s.ratio = max(0.5, len(ids) / max(1, len(prompt)))
        s.draft_ids = list(ids)
        self.inner.begin(seq_id, ids)

    def prefill(self, seq_id: int, tokens: list[int]) -> None:
        ids = self._context(seq_id, tokens)
        if ids:
            self._rewind(seq_id, ids)
            self.inner.prefill(seq_id, ids)

    def backlog(self, seq_id: int, tokens: list[int]) -> int:
        ids = self._context(seq_id, tokens)
        return self.inner.backlog(seq_id, ids) if ids else 0

    def propose(self, seq_id: int, tokens: list[int], k: int, params: SamplingParams, generator) -> Draft | None:
        return self.propose_many([DraftRequest(seq_id, tokens, k, params, generator)])[0]

    def propose_many(self, requests: list[DraftRequest]) -> list[Draft | None]:
        """Every sequence's draft from one batched inner proposal (in the draft's tokens)."""
        out: list[Draft | None] = [None] * len(requests)
        inner_reqs, where = [], []
        for i, r in enumerate(requests):
            ids = self._context(r.seq_id, r.tokens) if r.k > 0 else None
            if not ids:
                continue
            self._rewind(r.seq_id, ids)
            n = math.ceil((r.k + 1) * self._seqs[r.seq_id].ratio)  # the last target token is dropped
            inner_reqs.append(DraftRequest(r.seq_id, ids, n, _GREEDY))
            where.append(i)
        if not inner_reqs:
            return out
        for i, ir, d in zip(where, inner_reqs, self.inner.propose_many(inner_reqs)):
            if d is None:
                continue
            r = requests[i]
            self._seqs[r.seq_id].draft_ids = ir.tokens + d.tokens
            tokens = self._target_tokens(r.tokens, self._new_text(d.tokens))[: r.k] if d.tokens else []
            out[i] = Draft(tokens=tokens, probs=None, catch_up_seconds=d.catch_up_seconds,
                           catch_up_tokens=d.catch_up_tokens)
        return out

    def _new_text(self, drafted: list[int]) -> bytes:
        """The drafted ids' bytes, up to the first special token (included if the target's tokenizer
        knows it: an end of turn, say); what the draft writes after one is not worth verifying."""
        out = bytearray()
        for t in drafted:
            special = self._draft_special.get(t)
            if special is not None:
                if special in self._target_special_text:
                    out += special.encode("utf-8")
                break
            out += self._dbytes(t)
        return bytes(out)

    def accept(self, seq_id: int, num_accepted: int, path: list[int] | None = None) -> None:
        pass  # the next proposal re-tokenizes the accepted text and rolls the draft cache back to it

    def end(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        self.inner.end(seq_id)


def _utf8_prefix(data: bytes) -> str | None:
    """``data`` decoded without an incomplete last character (None if it does not start on one)."""
    for cut in range(0, min(4, len(data) + 1)):
        try:
            return data[: len(data) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return None


__all__ = ["CrossTokenizerProposer", "same_tokenizer"]
