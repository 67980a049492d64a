"""GGUF tokenizer metadata -> a Hugging Face ``tokenizers`` backend and ``tokenizer_config.json``.

A GGUF file carries its tokenizer as metadata (vocabulary, merges, token types, special ids, chat
template). ``write_tokenizer_files`` turns that into ``tokenizer.json`` + ``tokenizer_config.json``,
the same pair a Hugging Face model directory has, so ``tokenizer.Tokenizer.from_dir`` serves both
sources; BPE vocabularies here, SentencePiece ones in ``sentencepiece``.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from tokenleap.errors import ModelFormatError, ModelNotFoundError
from tokenleap.text.sentencepiece import (SENTENCEPIECE_MODELS, build_sentencepiece_backend,
                                          sentencepiece_adds_bos, unsupported_model_error)

# Pre-tokenizer split patterns, keyed by GGUF ``tokenizer.ggml.pre`` (llama.cpp's names)
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_DIGIT_SPLIT = r"\p{N}"
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")

# llama.cpp's Llama 3 group: their text starts with BOS where the file does not say (older Llama 3
# GGUFs carry no tokenizer.ggml.add_bos_token, and the model expects <|begin_of_text|>)
_LLAMA3_PRES = ("llama-bpe", "llama3", "llama-v3", "falcon3")

# pre type -> (split patterns applied in order, BPE ignore_merges)
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    **{name: ((_GPT2_SPLIT,), False) for name in ("gpt2", "gpt-2", "mpt", "olmo")},
    **{name: ((_DIGIT_SPLIT, _GPT2_SPLIT), False)
       for name in ("smollm", "starcoder", "refact", "codeshell", "command-r")},
    **{name: ((_QWEN2_SPLIT,), False) for name in ("qwen2", "stablelm2", "deepseek-r1-qwen")},
    **{name: ((_LLAMA3_SPLIT,), True) for name in _LLAMA3_PRES},
}

_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4
def read_gguf_tokenizer_metadata(path: str | Path) -> dict[str, Any]:
    """The ``tokenizer.*`` (and ``general.architecture``) metadata of a GGUF file, keys as in GGUF."""
    from tokenleap.models.gguf import read_header  # the one GGUF header parser, with its corruption checks

    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file not found: {path}")
    metadata, _ = read_header(path)
    return {k: v for k, v in metadata.items() if k.startswith("tokenizer.") or k == "general.architecture"}


# GGUF metadata -> tokenizers.Tokenizer
@lru_cache(maxsize=1)
def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@lru_cache(maxsize=1)
def char_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet read back: a token's character -> the byte it stands for."""
    return {c: b for b, c in _byte_to_char().items()}


def _byte_level_spelling(token: str) -> str:
    """A token spelled in the byte alphabet (unchanged if it already is)."""
    table = _byte_to_char()
    if set(token) <= set(table.values()):
        return token
    return "".join(table[b] for b in token.encode("utf-8"))


def _require(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata or metadata[key] is None:
        raise ModelFormatError(f"GGUF tokenizer metadata lacks {key!r}; the file is incomplete")
    return metadata[key]


def _pre_tokenizer_spec(pre: str | None) -> tuple[tuple[str, ...], bool]:
    if pre is None or pre == "default":  # older byte-level conversions: plain GPT-2 splitting
        return _PRE_TOKENIZERS["gpt2"]
    if pre not in _PRE_TOKENIZERS:
        raise ModelFormatError(
            f"unsupported GGUF pre-tokenizer {pre!r}; tokenleap supports {', '.join(sorted(_PRE_TOKENIZERS))} "
            "-- load the model's Hugging Face directory instead (its tokenizer.json is read as it is)")
    return _PRE_TOKENIZERS[pre]


def build_backend_tokenizer(metadata: dict[str, Any]) -> _Backend:
    """A ``tokenizers.Tokenizer`` from GGUF tokenizer metadata: byte-level BPE ('gpt2') or
    SentencePiece ('llama', 'gemma4'; see ``tokenizer_spm``)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2" and kind not in SENTENCEPIECE_MODELS:
        raise unsupported_model_error(kind)
    tokens = [str(t) for t in _require(metadata, "tokenizer.ggml.tokens")]
    types = metadata.get("tokenizer.ggml.token_type")
    types = [int(k) for k in types] if types is not None else [_TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelFormatError("GGUF tokenizer metadata: token_type and tokens differ in length")
    if kind in SENTENCEPIECE_MODELS:
        backend = build_sentencepiece_backend(metadata, tokens, types)
        _set_post_processor(backend, metadata, tokens)
        return backend
    merges = [str(m) for m in _require(metadata, "tokenizer.ggml.merges")]
    splits, ignore_merges = _pre_tokenizer_spec(metadata.get("tokenizer.ggml.pre"))

    added = {_TOKEN_CONTROL, _TOKEN_USER_DEFINED}
    vocab: dict[str, int] = {}
    for i, (tok, kind_) in enumerate(zip(tokens, types)):
        vocab.setdefault(tok if kind_ in added else _byte_level_spelling(tok), i)
    pairs = [tuple(m.split(" ")) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise ModelFormatError("GGUF tokenizer metadata: a merge is not two space-separated tokens")
    try:
        backend = _Backend(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    except Exception as e:  # tokenizers raises plain Exceptions for merges naming unknown tokens
        raise ModelFormatError(f"GGUF tokenizer metadata is inconsistent: {e}") from e
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == _TOKEN_CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == _TOKEN_USER_DEFINED])
    _set_post_processor(backend, metadata, tokens)
    return backend


def _special(metadata: dict[str, Any], tokens: list[str], name: str) -> str | None:
    idx = metadata.get(f"tokenizer.ggml.{name}_token_id")
    if idx is None or isinstance(idx, bool) or not float(idx).is_integer():
        return None
    return tokens[int(idx)] if 0 <= int(idx) < len(tokens) else None


def _adds_bos(metadata: dict[str, Any]) -> bool:
    if metadata.get("tokenizer.ggml.model") in SENTENCEPIECE_MODELS:
        return sentencepiece_adds_bos(metadata)
    return bool(metadata.get("tokenizer.ggml.add_bos_token", metadata.get("tokenizer.ggml.pre") in _LLAMA3_PRES))


def _set_post_processor(backend: _Backend, metadata: dict[str, Any], tokens: list[str]) -> None:
    bos, eos = _special(metadata, tokens, "bos"), _special(metadata, tokens, "eos")
    head = [bos] if bos and _adds_bos(metadata) else []
    tail = [eos] if eos and metadata.get("tokenizer.ggml.add_eos_token") else []
    if not head and not tail:
        return
    single = " ".join([*head, "$A", *tail])
    pair = " ".join([*head, "$A", *tail, *head, "$B:1", *tail])
    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(head + tail)]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


_GGUF_FIM = (("prefix", "pre"), ("suffix", "suf"), ("middle", "mid"), ("pad", "pad"), ("repo", "rep"),
             ("file_sep", "sep"))  # FimTokens' roles and GGUF's tokenizer.ggml.fim_*_token_id keys


def tokenizer_config_from_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """The ``tokenizer_config.json`` content Hugging Face uses, from GGUF metadata."""
    tokens = [str(t) for t in metadata.get("tokenizer.ggml.tokens", [])]
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                              "clean_up_tokenization_spaces": False}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
        config[f"{name}_token"] = _special(metadata, tokens, key)
    config["add_bos_token"] = _adds_bos(metadata)
    config["add_eos_token"] = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    if metadata.get("tokenizer.chat_template"):
        config["chat_template"] = metadata["tokenizer.chat_template"]
    fim = {role: _special(metadata, tokens, f"fim_{key}") for role, key in _GGUF_FIM}
    if any(fim.values()):  # the FIM tokens the file names (text/fim.py prefers them to its known names)
        config["fim_tokens"] = {role: name for role, name in fim.items() if name}
    return config


def write_tokenizer_files(metadata: dict[str, Any], out_dir: Path, backend: _Backend | None = None) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for GGUF tokenizer metadata (``backend``:
    the tokenizer ``build_backend_tokenizer`` made of it, where the caller has it already)."""
    out_dir = Path(out_dir)
    backend = backend if backend is not None else build_backend_tokenizer(metadata)
    out_dir.mkdir(parents=True, exist_ok=True)
    backend.save(str(out_dir / "tokenizer.json"))
    config = json.dumps(tokenizer_config_from_metadata(metadata), indent=2, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")


# Chat templates (rendered like Hugging Face transformers does)
