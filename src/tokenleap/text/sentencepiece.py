"""SentencePiece GGUF tokenizers (``tokenizer.ggml.model`` ``"llama"`` / ``"gemma4"``) as ``tokenizers`` models.

A SentencePiece vocabulary in a GGUF is a list of pieces spelled with ``▁`` for a space, a score
per piece, a type per piece (normal, control, user-defined, byte) and usually no merges. It becomes
a BPE model with byte fallback (``<0x0A>`` pieces stand for bytes no other piece covers), built the
way transformers' GGUF conversion builds it, so ids and decoded text match its tokenizer exactly:

* merges come from the file when it lists them, else from the vocabulary: every split of a piece
  into two pieces that are both in the vocabulary is a merge, ranked by the piece's score (Gemma:
  by the piece's position, since its scores do not follow its merge order);
* Gemma files store runs of spaces as real spaces; they are respelled with ``▁`` so merges reach them;
* spaces become ``▁`` before the model sees the text: with a ``▁`` put in front of the text when the
  file asks for a space prefix (``add_space_prefix``, on unless the file says otherwise; Gemma has
  none; Phi-3 puts one in front of every stretch of text between special tokens);
* control pieces (and the bos / eos / unk / pad pieces) become special added tokens, user-defined
  pieces plain added tokens, so they are matched whole in the text.

T5's Unigram vocabularies (``"t5"``) belong to encoder-decoder models tokenleap does not run.
"""
from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from tokenleap.errors import ModelFormatError

SENTENCEPIECE_MODELS = ("llama", "gemma4")
_SPACE = "\u2581"  # SentencePiece's visible space
_GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})  # space runs stored as spaces, merges by position
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4
_ROLES = ("bos", "eos", "unknown", "padding")


def sentencepiece_adds_bos(metadata: dict[str, Any]) -> bool:
    """Whether encoding puts BOS first: the file's flag, on when absent (llama.cpp's default for
    SentencePiece); never for ``gemma4``, whose chat template writes ``<bos>`` itself."""
    if metadata.get("tokenizer.ggml.model") == "gemma4":
        return False
    return bool(metadata.get("tokenizer.ggml.add_bos_token", True))


def _style(metadata: dict[str, Any]) -> str:
    """'gemma' (spaces as-is, no prefix), 'phi3' (a prefix before every text stretch) or 'llama'."""
    arch = metadata.get("general.architecture")
    if metadata.get("tokenizer.ggml.model") == "gemma4":
        return "gemma4"
    if arch in _GEMMA_ARCHS:
        return "gemma"
    return "phi3" if arch == "phi3" else "llama"


def respell_pieces(tokens: list[str], style: str) -> list[str]:
    """The pieces as the BPE model looks them up: a Gemma piece of only spaces (``"   "``) is
    spelled ``"▁▁▁"``, as the text reaches the model after spaces become ``▁``."""
    if style != "gemma":
        return list(tokens)
    return [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def merges_from_vocab(tokens: list[str], rank: dict[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary without merge rules, best first.

    Each piece contributes every split into two in-vocabulary pieces (ordered by the two pieces'
    ids), all carrying the piece's ``rank``; merges are ordered by rank, highest first, then by the
    longer left and the longer right part. Equal keys keep ``rank``'s order (the sort is stable).
    """
    ids: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        ids[tok] = i  # a repeated piece keeps its last id, as the BPE vocabulary does
    entries: list[tuple[float, int, int, str, str]] = []
    for piece, score in rank.items():
        found = [(piece[:cut], piece[cut:]) for cut in range(1, len(piece))
                 if piece[:cut] in ids and piece[cut:] in ids]
        found.sort(key=lambda lr: (ids[lr[0]], ids[lr[1]]))
        entries.extend((score, len(left), len(right), left, right) for left, right in found)
    entries.sort(key=lambda e: e[:3], reverse=True)
    return [(left, right) for _, _, _, left, right in entries]


def _file_merges(metadata: dict[str, Any]) -> list[tuple[str, str]] | None:
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        return None
    pairs = [tuple(str(m).split(" ")) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise ModelFormatError("GGUF tokenizer metadata: a merge is not two space-separated tokens")
    return pairs  # type: ignore[return-value]


def _role_piece(metadata: dict[str, Any], tokens: list[str], role: str) -> str | None:
    idx = metadata.get(f"tokenizer.ggml.{role}_token_id")
    if idx is None or isinstance(idx, bool) or not float(idx).is_integer() or not 0 <= int(idx) < len(tokens):
        return None
    return tokens[int(idx)]


def _text_pipeline(backend: _Backend, style: str, prefix: bool) -> None:
    """Normalizer, pre-tokenizer and decoder: spaces <-> ``▁``, byte pieces -> bytes -> text."""
    decode = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if style in ("gemma", "gemma4"):
        backend.normalizer = normalizers.Replace(" ", _SPACE)
    elif style == "phi3":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)])
        decode.append(decoders.Strip(" ", 1, 0))
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPACE, prepend_scheme="first" if prefix else "never", split=False)
        if prefix:
            decode.append(decoders.Strip(" ", 1, 0))  # the space the prefix added, not the text's
    backend.decoder = decoders.Sequence(decode)


def build_sentencepiece_backend(metadata: dict[str, Any], tokens: list[str], types: list[int]) -> _Backend:
    """A BPE ``tokenizers.Tokenizer`` with byte fallback for a SentencePiece GGUF vocabulary
    (without the BOS / EOS post-processor, which the caller sets)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in SENTENCEPIECE_MODELS:
        raise ModelFormatError(f"not a SentencePiece tokenizer model: {kind!r}")
    style = _style(metadata)
    pieces = respell_pieces(tokens, style)
    merges = _file_merges(metadata)
    if merges is None:
        if style == "gemma":
            rank: dict[str, float] = {p: -float(i) for i, p in enumerate(pieces)}
        else:
            scores = metadata.get("tokenizer.ggml.scores")
            if scores is None or len(scores) != len(tokens):
                raise ModelFormatError("GGUF tokenizer metadata lacks 'tokenizer.ggml.scores' (one per token), "
                                       "which a SentencePiece vocabulary without merges needs; the file is incomplete")
            rank = dict(zip(pieces, (float(s) for s in scores)))
        merges = merges_from_vocab(pieces, rank)
    vocab = {p: i for i, p in enumerate(pieces)}
    unk = _role_piece(metadata, tokens, "unknown")
    try:
        backend = _Backend(models.BPE(vocab=vocab, merges=merges, unk_token=unk if unk in vocab else None,
                                      fuse_unk=True, byte_fallback=True))
    except Exception as e:  # tokenizers raises plain Exceptions for merges naming unknown pieces
        raise ModelFormatError(f"GGUF tokenizer metadata is inconsistent: {e}") from e
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    _text_pipeline(backend, style, prefix)

    roles = [p for p in (_role_piece(metadata, tokens, r) for r in _ROLES) if p is not None]
    control = [t for t, k in zip(tokens, types) if k == _TOKEN_CONTROL]
    special = list(dict.fromkeys(control + roles))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    # a user-defined piece the respelling changed (Gemma's space runs) is left to the merges
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == _TOKEN_USER_DEFINED and t in vocab])
    return backend


def unsupported_model_error(kind: Any) -> ModelFormatError:
    """The error for a ``tokenizer.ggml.model`` tokenleap cannot build."""
    if kind == "t5":
        return ModelFormatError(
            "GGUF tokenizer model 't5' (a Unigram vocabulary) belongs to T5-style encoder-decoder models, "
            "which tokenleap does not run; use a decoder-only model (Llama, Qwen, Gemma, Mistral, Phi-3)")
    return ModelFormatError(
        f"unsupported tokenizer model {kind!r} in GGUF metadata; tokenleap supports byte-level BPE ('gpt2', "
        "used by Qwen2, SmolLM2 and Llama 3) and SentencePiece ('llama', 'gemma4': Llama 2, Mistral, Gemma, Phi-3)")


def piece_bytes(spelled: str) -> bytes | None:
    """The bytes a SentencePiece piece stands for: ``<0xNN>`` is byte NN, ``▁`` a space; None for
    an empty spelling."""
    if not spelled:
        return None
    if len(spelled) == 6 and spelled.startswith("<0x") and spelled.endswith(">"):
        try:
            return bytes([int(spelled[3:5], 16)])
        except ValueError:
            pass
    return spelled.replace(_SPACE, " ").encode("utf-8")
