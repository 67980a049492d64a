"""Repetition penalties and logit bias as a pure function of a sequence's tokens -- applied to the
target's logits before greedy choice or sampling, so they are part of the target distribution that
speculation reproduces exactly.

* ``presence_penalty`` / ``frequency_penalty`` (OpenAI): subtract ``presence`` once from every token
  that occurs in the generated text and ``frequency`` once per occurrence.
* ``repetition_penalty`` (Hugging Face / vLLM): a token seen in the prompt or the generated text has
  its logit divided by the penalty when positive and multiplied by it when negative; with
  ``repetition_last_n`` (llama.cpp / Ollama), only the last n tokens before the row count as seen.
* ``logit_bias`` (OpenAI): a fixed amount added to the logits of given tokens -- first, so a repetition
  penalty scales the biased logit (vLLM's, transformers' and llama.cpp's order).
* ``allowed_token_ids`` (vLLM): every other token's logit at -inf.
* ``bad_word_ids`` (vLLM's ``bad_words`` once tokenized, HF's ``bad_words_ids``): a barred sequence's
  last token at -inf in a row whose generated history ends with the rest of the sequence.

In a verification step, row ``i`` of the logits is the distribution after the generated tokens and
the first ``i`` drafted tokens, so each row is penalized for its own history.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

import torch

from tokenleap.config import ConfigError, SamplingParams
from tokenleap.text.plain import encode_plain


def apply_penalties(
    logits: torch.Tensor,  # [k+1, vocab]
    params: SamplingParams,
    prompt: list[int],
    generated: list[int],
    draft: list[int],  # k drafted tokens; row i follows draft[:i]
) -> torch.Tensor:  # [k+1, vocab] float32, a new tensor
    rows, vocab = logits.shape
    assert len(draft) == rows - 1, f"{rows} logit rows need {rows - 1} drafted tokens, got {len(draft)}"
    out = logits.float().clone()
    if params.logit_bias:  # before the penalties, as vLLM, transformers and llama.cpp order them
        ids, biases = _bias_tensors(params.logit_bias, vocab)  # [n], [n]
        out.index_add_(1, ids, biases.expand(rows, -1))
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1:
        out = _penalize(out, params, prompt, generated, draft)
    if params.allowed_token_ids:
        allowed = _id_tensor(params.allowed_token_ids, vocab)  # [n]
        masked = torch.full_like(out, float("-inf"))
        masked[:, allowed] = out[:, allowed]
        out = masked
    if params.bad_word_ids:
        _bar_words(out, params.bad_word_ids, generated, draft)
    return out


@functools.lru_cache(maxsize=64)
def _bias_tensors(logit_bias: tuple[tuple[int, float], ...], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's logit bias as (ids [n], float32 amounts [n]), built once: one indexed addition a
    step, however many tokens it biases (a whole vocabulary's, looped in Python, cost 0.3 s a step)."""
    kept = [(t, b) for t, b in logit_bias if t < vocab]
    return (torch.tensor([t for t, _ in kept], dtype=torch.long),
            torch.tensor([b for _, b in kept], dtype=torch.float32))


def for_vocabulary(params: SamplingParams, tokenizer, vocab: int) -> SamplingParams:
    """``params`` checked against a vocabulary of ``vocab`` ids (its token-id fields) and with vLLM's
    ``bad_words`` tokenized into ``bad_word_ids``, beside any given as ids."""
    for name in ("allowed_token_ids", "stop_token_ids", "prediction"):
        if any(t >= vocab for t in getattr(params, name)):
            raise ConfigError(f"{name} must be token ids in [0, {vocab})")
    if any(t >= vocab for w in params.bad_word_ids for t in w):  # (one would never match: a word not barred)
        raise ConfigError(f"bad_word_ids must be token ids in [0, {vocab})")
    if any(t >= vocab for t, _ in params.logit_bias):  # (vLLM refuses them too, rather than ignore them)
        raise ConfigError(f"logit_bias must map token ids in [0, {vocab})")
    if not params.bad_words:
        return params
    return replace(params, bad_words=(), bad_word_ids=params.bad_word_ids + _tokenized(tokenizer, params.bad_words))


@functools.lru_cache(maxsize=32)
def _tokenized(tokenizer, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """``bad_word_sequences`` once per tokenizer and word list (a request of n choices asks n times)."""
    return bad_word_sequences(lambda text: encode_plain(tokenizer, text), words)


@functools.lru_cache(maxsize=64)
def _stop_tensor(stop_ids: tuple[int, ...], eos_ids: frozenset[int], vocab: int) -> torch.Tensor:  # [n] long
    return _id_tensor(tuple(sorted({*eos_ids, *stop_ids})), vocab)


@functools.lru_cache(maxsize=64)
def _id_tensor(ids: tuple[int, ...], vocab: int) -> torch.Tensor:  # [n] long: the ids in the vocabulary
    return torch.tensor([t for t in ids if t < vocab], dtype=torch.long)


def bad_word_sequences(encode: Callable[[str], list[int]], words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """The token sequences that spell each of ``words`` (vLLM's ``bad_words``): the word as written
    and with a leading space, since a word inside text usually starts with one; ``encode`` adds no
    special tokens."""
    out: dict[tuple[int, ...], None] = {}  # (in order, each once)
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(encode(text))
            if ids:
                out[ids] = None
    return tuple(out)


@functools.lru_cache(maxsize=32)
def _word_index(words: tuple[tuple[int, ...], ...],
                vocab: int) -> tuple[torch.Tensor, dict[int, dict[tuple, list[int]]]]:
    """Barred sequences as (last tokens barred everywhere [n], {prefix length: {prefix: last tokens}}),
    built once: a row then costs a lookup per prefix length, not a loop over every word."""
    always, by_prefix = set(), {}
    for *rest, last in words:
        if last >= vocab:
            continue
        if rest:
            by_prefix.setdefault(len(rest), {}).setdefault(tuple(rest), []).append(last)
        else:
            always.add(last)
    return torch.tensor(sorted(always), dtype=torch.long), by_prefix


def _bar_words(out: torch.Tensor, words: tuple[tuple[int, ...], ...], generated: list[int],
               draft: list[int]) -> None:  # out: [k+1, vocab] float32, changed in place
    always, by_prefix = _word_index(words, out.shape[1])
    if len(always):
        out[:, always] = float("-inf")
    longest = max(by_prefix, default=0)
    history = generated[-longest:] if longest else []
    for i in range(out.shape[0]):
        tail = history + draft[:i]  # row i's generated history (its last tokens)
        for n, prefixes in by_prefix.items():
            if len(tail) >= n and (lasts := prefixes.get(tuple(tail[len(tail) - n:]))):
                out[i, lasts] = float("-inf")


def _penalize(out: torch.Tensor, params: SamplingParams, prompt: list[int], generated: list[int],
              draft: list[int]) -> torch.Tensor:  # out: [k+1, vocab] float32
    rows, vocab = out.shape
    counts = torch.zeros(rows, vocab)  # [k+1, vocab]: occurrences in the generated text before each row
    if generated:
        counts += torch.bincount(torch.tensor(generated), minlength=vocab)[:vocab].float()
    for i, tok in enumerate(draft):
        counts[i + 1:, tok] += 1
    if params.repetition_penalty != 1:
        if params.repetition_last_n:
            seen = _recent(prompt + generated, draft, params.repetition_last_n, vocab)
        else:
            seen = counts > 0  # [k+1, vocab]
            if prompt:
                seen[:, torch.tensor(prompt)] = True
        r = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    if params.frequency_penalty:
        out -= params.frequency_penalty * counts
    if params.presence_penalty:
        out -= params.presence_penalty * (counts > 0).float()
    return out


def _recent(history: list[int], draft: list[int], n: int, vocab: int) -> torch.Tensor:
    """[k+1, vocab] bool: the tokens among the last ``n`` before each row (row i follows
    ``history`` and ``draft[:i]``)."""
    seen = torch.zeros(len(draft) + 1, vocab, dtype=torch.bool)
    tail = history[-n:]
    for i in range(len(draft) + 1):
        window = [t for t in (tail + draft[:i])[-n:] if t < vocab]
        if window:
            seen[i, torch.tensor(window)] = True
    return seen


def suppress_early_stops(logits: torch.Tensor, params: SamplingParams, generated: int,
                         eos_ids: frozenset[int]) -> torch.Tensor:
    """vLLM's ``min_tokens``: row i (generated token ``generated + i``) may not end the reply -- EOS
    and ``stop_token_ids`` at -inf -- while fewer than ``min_tokens`` tokens precede it; a row
    where nothing else is allowed (a grammar that is complete) keeps them."""
    if generated >= params.min_tokens:
        return logits
    out = logits.clone()  # [k+1, vocab]
    stops = _stop_tensor(params.stop_token_ids, frozenset(eos_ids), out.shape[1])  # [n]
    for i in range(min(out.shape[0], params.min_tokens - generated)):
        row = out[i].clone()
        row[stops] = float("-inf")
        if torch.isfinite(row).any():
            out[i] = row
    return out


__all__ = ["apply_penalties", "bad_word_sequences", "for_vocabulary", "suppress_early_stops"]
