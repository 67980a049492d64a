"""Fill-in-the-middle (FIM) prompts: code before and after a gap, for the model to write the gap, as
code models are trained to take them (OpenAI's ``suffix``, llama.cpp's ``/infill``).

A model takes FIM prompts when its vocabulary has a known set of FIM tokens:

- ``<|fim_prefix|>`` / ``<|fim_suffix|>`` / ``<|fim_middle|>`` (Qwen2.5-Coder, CodeGemma-style names),
- ``<fim_prefix>`` / ``<fim_suffix>`` / ``<fim_middle>`` (StarCoder, SantaCoder, Granite code),
- ``<｜fim▁begin｜>`` / ``<｜fim▁hole｜>`` / ``<｜fim▁end｜>`` (DeepSeek-Coder),

or the FIM tokens a GGUF file names (``tokenizer.ggml.fim_pre_token_id`` / ``fim_suf`` / ``fim_mid``,
with ``fim_pad`` / ``fim_rep`` / ``fim_sep``), which are taken first, as llama.cpp takes them; all in
prefix-suffix-middle order: ``PRE prefix SUF suffix MID``, the reply being the middle. The
prefix and suffix are tokenized on their own, with no special tokens added, and the FIM tokens are
placed between them by id (as llama.cpp builds its infill prompts). A middle ends at the model's end
of text, or at a FIM bookkeeping token (padding, file or repository separators) where the
vocabulary has one.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenleap.config import ConfigError

_FORMS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
          ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
          ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))
_REPO = ("<|repo_name|>", "<reponame>")  # repository-level context (Qwen2.5-Coder; StarCoder)
_FILE_SEP = ("<|file_sep|>", "<file_sep>")
_ENDS = ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<fim_pad>", "<file_sep>", "<reponame>", "<filename>",
         "<|endoftext|>", "<｜end▁of▁sentence｜>")


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    stop_ids: tuple[int, ...]  # tokens that end a middle besides the model's EOS
    repo: int | None = None  # opens repository-level context, where the vocabulary has it
    file_sep: int | None = None  # starts each file of that context


def fim_tokens(tokenizer) -> FimTokens | None:
    """The tokenizer's FIM tokens, or None when it has no known set."""
    lookup = getattr(tokenizer, "token_to_id", None)
    if lookup is None:
        return None
    named = _named(tokenizer, lookup)
    if named is not None:
        return named
    for names in _FORMS:
        ids = [lookup(n) for n in names]
        if all(i is not None for i in ids):
            ends = tuple(i for i in (lookup(n) for n in _ENDS) if i is not None)
            return FimTokens(*ids, stop_ids=ends, repo=_first(lookup, _REPO), file_sep=_first(lookup, _FILE_SEP))
    return None


def _named(tokenizer, lookup) -> FimTokens | None:
    """The FIM tokens the model file names (``Tokenizer.fim_token_names``: role -> token), if it
    names a whole set that the vocabulary has."""
    names = getattr(tokenizer, "fim_token_names", None) or {}
    ids = {role: lookup(name) for role, name in names.items()}
    if any(ids.get(role) is None for role in ("prefix", "suffix", "middle")):
        return None
    own = tuple(ids[r] for r in ("pad", "file_sep", "repo") if ids.get(r) is not None)
    ends = tuple(dict.fromkeys(own + tuple(i for i in map(lookup, _ENDS) if i is not None)))
    def given(role: str, names: tuple[str, ...]) -> int | None:
        return ids[role] if ids.get(role) is not None else _first(lookup, names)
    return FimTokens(ids["prefix"], ids["suffix"], ids["middle"], stop_ids=ends, repo=given("repo", _REPO),
                     file_sep=given("file_sep", _FILE_SEP))


def _first(lookup, names: tuple[str, ...]) -> int | None:
    return next((i for i in map(lookup, names) if i is not None), None)


def required_fim_tokens(tokenizer) -> FimTokens:
    """``fim_tokens``, or a ConfigError that says the model has none."""
    fim = fim_tokens(tokenizer)
    if fim is None:
        raise ConfigError("this model has no fill-in-the-middle tokens (such as <|fim_prefix|>, <|fim_suffix|>, "
                          "<|fim_middle|>): use a code model trained for infilling, e.g. Qwen2.5-Coder, or no suffix")
    return fim


def encode_fim(tokenizer, prefix: str, suffix: str, files: list[tuple[str, str]] = (),
               middle: str = "", fit: tuple[int, int] | None = None) -> tuple[list[int], FimTokens]:
    """The FIM prompt's ids for the gap between ``prefix`` and ``suffix``, and the tokens used (a
    ConfigError that says so when the model has none). ``files``: (file name, text) pairs of other
    code the gap may use, placed first -- as repository-level context where the vocabulary has its
    tokens (``REPO "myproject\n" SEP name "\n" text ... SEP "filename\n"``, the form Qwen2.5-Coder was
    trained on), else each after a plain-text snippet marker; ``middle``: text the middle starts with.
    ``fit`` (context length, tokens to predict; -1: no limit): the prompt is cut as llama.cpp's
    ``/infill`` cuts one that would not leave room for them (``_fit``; the caller decides when)."""
    fim = required_fim_tokens(tokenizer)
    extra = _context(tokenizer, fim, files) if files else []
    pre, suf, mid = _plain(tokenizer, prefix), _plain(tokenizer, suffix), _plain(tokenizer, middle)
    if fit is not None:
        extra, pre, suf = _fit(extra, pre, suf, len(mid), *fit)
    ids = [*extra, fim.prefix, *pre, fim.suffix, *suf, fim.middle, *mid]
    if getattr(tokenizer, "add_bos_token", False) and tokenizer.bos_token_id is not None:
        ids.insert(0, tokenizer.bos_token_id)
    return ids, fim


def _fit(extra: list[int], prefix: list[int], suffix: list[int], middle: int, n_ctx: int,
         n_predict: int) -> tuple[list[int], list[int], list[int]]:
    """llama.cpp's /infill budget, with its batch of 2048 tokens (at most half the context here): the
    prefix's last 3/4 batch tokens, the suffix's first 1/4 batch less the middle's and 2, and the other
    files' last tokens that fit the context less a batch and twice the tokens to predict."""
    batch = min(2048, n_ctx // 2)
    prefix = prefix[len(prefix) - min(len(prefix), 3 * batch // 4):]
    suffix = suffix[:max(0, batch // 4 - 2 - middle)]
    take = min(len(extra), max(0, n_ctx - batch - 2 * max(n_predict, 0)))
    return extra[len(extra) - take:], prefix, suffix


def _context(tokenizer, fim: FimTokens, files: list[tuple[str, str]]) -> list[int]:
    """Other files' code before the FIM prompt."""
    ids: list[int] = []
    if fim.repo is not None:
        ids += [fim.repo, *_plain(tokenizer, "myproject\n")]
    for name, text in files:
        if fim.file_sep is not None:
            ids += [fim.file_sep, *_plain(tokenizer, (name or "tmp") + "\n")]
        else:
            ids += _plain(tokenizer, "\n\n--- snippet ---\n\n")
        ids += _plain(tokenizer, text)
    if fim.file_sep is not None:
        ids += [fim.file_sep, *_plain(tokenizer, "filename\n")]
    return ids


def _plain(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []
