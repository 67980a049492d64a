"""Structured output: a reply constrained to a grammar -- a JSON schema, any JSON object, a regular
expression, a choice among strings or a Lark grammar -- with llguidance saying, token by token,
which tokens keep the text inside the grammar.

A constraint masks the target's logits before the greedy choice or sampling, so the masked
distribution *is* the target distribution speculation reproduces exactly. In a verification step
row i is masked for the grammar's state after the first i drafted tokens: a drafted token the
grammar forbids has probability zero there and is rejected, whatever the draft thought, and the
rows after it are never used. The matcher then advances by the tokens the sequence kept. Once the
grammar is complete only EOS remains allowed.
"""
from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from tokenleap.config import ConfigError, StructuredOutput
from tokenleap.text.plain import encode_plain


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # a dependency of the package; a broken install says what to do
        raise ConfigError("structured output needs the llguidance package: pip install llguidance") from e
    return llguidance


class Constraint:
    """One sequence's grammar state (an ``llguidance.LLMatcher``)."""

    def __init__(self, matcher: Any, vocab: int, eos_ids: tuple[int, ...]) -> None:
        self.matcher, self.vocab, self.eos_ids = matcher, vocab, eos_ids
        self._bits = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:  # [vocab] bool: the tokens the grammar takes next
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)  # [ceil(vocab / 32)]
        ok = ((words.unsqueeze(-1) >> self._bits) & 1).flatten()[:self.vocab].bool()
        if not ok.any():  # a grammar that takes nothing more (an error state): only the end
            ok[list(self.eos_ids)] = True
        return ok

    def mask(self, logits: torch.Tensor, draft: list[int]) -> torch.Tensor:
        """``logits`` [k+1, vocab] with forbidden tokens at -inf: row i for the state after
        ``draft[:i]``. The matcher is left as it was."""
        out = logits.float().clone()
        consumed = 0
        for i in range(out.shape[0]):
            out[i].masked_fill_(~self.allowed(), float("-inf"))
            if i == len(draft):
                break
            if self._ends(draft[i]):
                continue  # as in ``advance``: the state stays
            if self.matcher.try_consume_tokens([draft[i]]) != 1:
                break  # draft[i] is forbidden at row i: it is rejected there, later rows go unused
            consumed += 1
        if consumed:
            self.matcher.rollback(consumed)
        return out

    def advance(self, tokens: list[int]) -> None:
        """The sequence kept ``tokens`` (each allowed by its masked row)."""
        for t in tokens:
            if not self._ends(t) and not self.matcher.consume_token(t):
                raise RuntimeError(f"structured output: the grammar refused a chosen token: "
                                   f"{_short(self.matcher.get_error())}")

    def draft(self, logits: torch.Tensor) -> torch.Tensor:
        """A draft's ``logits`` [1, vocab] masked for the state after what it drafted so far (a
        draft head over a vocabulary subset may allow none of the grammar's tokens: then uniform
        over them, still a distribution the verification can use)."""
        ok = self.allowed()
        out = logits.float().masked_fill(~ok, float("-inf"))
        if not torch.isfinite(out).any():
            out = torch.zeros_like(out).masked_fill_(~ok, float("-inf"))
        return out

    def push(self, token: int) -> int:
        """Follow a drafted token (undone with ``rollback``); returns how many tokens that consumed."""
        return 0 if self._ends(token) else self.matcher.try_consume_tokens([token])

    def rollback(self, consumed: int) -> None:
        if consumed:
            self.matcher.rollback(consumed)

    def _ends(self, token: int) -> bool:
        """EOS where the reply may end is not consumed: the grammar is over (the sequence ends
        there, unless it ignores EOS -- then the state stays and so does what it allows)."""
        return token in self.eos_ids and (self.matcher.is_stopped() or self.matcher.is_accepting())


_CHOICES_AS_RULE = 1000  # a choice list longer than this is one lexeme (see grammar_of)
_TEMPLATES = 16  # grammar matchers kept for the next request of the same spec
_ERROR_CHARS = 500  # llguidance's messages can hold its whole parser state (hundreds of KB)


def _short(message: str) -> str:
    return message if len(message) <= _ERROR_CHARS else message[:_ERROR_CHARS] + " ..."


@functools.lru_cache(maxsize=64)
def grammar_of(spec: StructuredOutput) -> str:
    """``spec`` as an llguidance grammar, checked (no tokenizer needed: callers check early);
    an invalid schema, regex or grammar is a ConfigError that says what is wrong."""
    return on_compiler_stack(_grammar_of, spec)


def on_compiler_stack(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on a thread of its own with a ``COMPILER_STACK`` stack: llguidance's compiler
    recurses along a grammar's chains of rules and references, and a JSON schema chaining 1,000
    ``$ref``s overflowed a default 8 MiB stack (a segfault that took a whole server down). The stack
    is reserved address space, used only as deep as a grammar goes."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 -- raised again in the caller's thread
            result["error"] = e
    with _STACK_LOCK:  # (the stack size is the process's setting for threads started meanwhile)
        try:
            before = threading.stack_size(COMPILER_STACK)
        except (ValueError, RuntimeError):  # a platform that sets no thread stack sizes: here, as before
            return fn(*args)
        try:
            thread = threading.Thread(target=run, name="grammar-compiler", daemon=True)
            thread.start()
        except RuntimeError:  # no room for such a stack (a limit on address space): here, as before
            thread = None
        finally:
            threading.stack_size(before)
    if thread is None:
        return fn(*args)
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


COMPILER_STACK = 1 << 30
_STACK_LOCK = threading.Lock()
MAX_REFS = 2000  # a JSON schema's "$ref"s: chains of them recurse in the compiler (see on_compiler_stack)


def _grammar_of(spec: StructuredOutput) -> str:
    llg = _llguidance()
    try:
        if spec.json_object:
            grammar = llg.LLMatcher.grammar_from_json_schema(bounded_whitespace({"type": "object"}))
        elif spec.json is not None:
            if (refs := spec.json.count('"$ref"')) > MAX_REFS:
                raise ValueError(f"the schema has {refs} $refs; at most {MAX_REFS} are taken")
            grammar = llg.LLMatcher.grammar_from_json_schema(bounded_whitespace(closed_objects(json.loads(spec.json))))
        elif spec.regex is not None:
            grammar = llg.LLMatcher.grammar_from_regex(spec.regex)
        elif spec.choice is not None:
            options = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            # a long list as one lexeme: as rule alternatives, every option is an item of one parser row,
            # and llguidance's rows hold at most 2000
            grammar = llg.LLMatcher.grammar_from_lark(f"start: {options}" if len(spec.choice) <= _CHOICES_AS_RULE
                                                      else f"start: CHOICE\nCHOICE: {options}")
        else:  # Lark, or GBNF (llama.cpp's grammars, and vLLM's guided_grammar) converted to Lark
            grammar = llg.LLMatcher.grammar_from_lark(_lark(spec.grammar))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"invalid {spec.kind} for structured output: {e}") from None
    error = llg.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise ConfigError(f"invalid {spec.kind} for structured output: {_short(error.strip())}")
    return grammar


# the whitespace a JSON reply may have between two of its tokens: a line break and an indentation at most
JSON_WHITESPACE = r"\n?[ \t]{0,40}"


def bounded_whitespace(schema: Any) -> Any:
    """``schema`` with its whitespace bounded (``JSON_WHITESPACE``) where it does not set llguidance's
    JSON options itself (``x-guidance``): JSON may put any run of whitespace between its tokens, and a
    small model that starts one can write newlines until its token limit and leave the reply
    unfinished; one line break and its indentation keep compact and pretty-printed replies alike."""
    if not isinstance(schema, dict) or "x-guidance" in schema:
        return schema
    return {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}


# keywords whose value is one subschema / a list of them / a map of names to them
_SUB, _SUBS, _NAMED = (("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
                        "unevaluatedProperties", "unevaluatedItems"),
                       ("anyOf", "oneOf", "prefixItems", "items"),
                       ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"))


def closed_objects(schema: Any, in_all_of: bool = False) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that names its properties
    and says nothing of others -- vLLM's default (xgrammar's strict mode) and what OpenAI's strict
    structured outputs promise: a reply holds the keys the schema declares, not keys a small model
    invents until the token limit. An object without ``properties`` stays open (any object), and so
    do ``allOf``'s members (their properties add up; each closed, no object could satisfy them all)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUB:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _SUBS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(s, in_all_of=True) for s in out["allOf"]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if (isinstance(out.get("properties"), dict) and out["properties"] and not in_all_of and "allOf" not in out
            and not any(k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties"))):
        out["additionalProperties"] = False
    return out


def _lark(grammar: str) -> str:
    """``grammar`` in Lark syntax: as given, or converted from GBNF (``root ::= ...`` rules), with at
    most ``MAX_GRAMMAR_RULES`` rules: llguidance's compiler recurses along chains of rules (a chain of
    5,000 overflowed an 8 MiB stack: see ``on_compiler_stack``), and a body may hold a million."""
    from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark
    rules = len(_RULE.findall(grammar))  # (counted before the conversion, which slows with the rule count too)
    if rules > MAX_GRAMMAR_RULES:
        raise ValueError(f"the grammar has {rules} rules; at most {MAX_GRAMMAR_RULES} are taken")
    try:
        return any_to_lark(grammar)
    except GbnfToLarkError as e:
        raise ValueError(f"GBNF: {e}") from None


MAX_GRAMMAR_RULES = 5000  # (a chain of 5,000 compiles in ~18 s; llama.cpp's GBNF of a 300-property schema has 1,505)
# a rule's start: Lark's "name:" (terminals too, "?name.2:"), GBNF's "name ::="
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_-]*(?:\.-?\d+)?[ \t]*:", re.MULTILINE)


class Constraints:
    """Builds ``Constraint``s for one tokenizer: the llguidance tokenizer (token bytes for every id
    of the model's vocabulary) is made once, at the first structured request."""

    def __init__(self, tokenizer: Any, vocab: int, eos_ids: tuple[int, ...]) -> None:
        self.tokenizer, self.vocab, self.eos_ids = tokenizer, vocab, tuple(eos_ids)
        self._lltok: Any = None
        # spec -> a matcher at the grammar's start, copied for each sequence: a big schema's matcher takes
        # seconds to build, and a request of n replies needs n (the most recent specs kept)
        self._templates: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()  # (``prepare`` runs on a server's worker threads)

    def prepare(self, spec: StructuredOutput) -> None:
        """Build what ``make`` needs for ``spec`` ahead (a server does it off its event loop)."""
        self._template(spec)

    def make(self, spec: StructuredOutput) -> Constraint:
        """A fresh constraint for ``spec``; an invalid schema, regex or grammar is a ConfigError."""
        return Constraint(self._template(spec).deep_copy(), self.vocab, self.eos_ids)

    def _template(self, spec: StructuredOutput) -> Any:
        with self._lock:
            matcher = self._templates.get(spec)
            if matcher is not None:
                self._templates.move_to_end(spec)
                return matcher
        grammar = grammar_of(spec)
        matcher = on_compiler_stack(lambda: _llguidance().LLMatcher(self._tokenizer(), grammar, log_level=0))
        if matcher.is_error():
            raise ConfigError(f"invalid {spec.kind} for structured output: {_short(matcher.get_error())}")
        with self._lock:
            self._templates[spec] = matcher
            while len(self._templates) > _TEMPLATES:
                self._templates.popitem(last=False)
        return matcher

    def _tokenizer(self) -> Any:
        if self._lltok is None:
            llg = _llguidance()
            self._lltok = llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(self.tokenizer, self.vocab, self.eos_ids)),
                                          n_vocab=self.vocab, eos_token=list(self.eos_ids))
        return self._lltok


class _Vocabulary:
    """What llguidance needs of a tokenizer: every id's bytes, EOS / BOS, and encoding."""

    def __init__(self, tokenizer: Any, vocab: int, eos_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        as_bytes = getattr(tokenizer, "token_bytes", None)
        self.tokens = [as_bytes(i) if as_bytes else tokenizer.decode([i]).encode("utf-8") for i in range(vocab)]
        self.eos_token_id = eos_ids[0]
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        # special tokens (chat markers, FIM tokens ...) are never text a grammar may match: their
        # spelling is skipped when the reply is decoded, so the text would no longer follow it
        backend = getattr(tokenizer, "backend", None)
        added = backend.get_added_tokens_decoder() if backend is not None else {}
        special = {i for i, t in added.items() if t.special and i < vocab}
        self.special_token_ids = sorted((special | set(eos_ids)) - {self.bos_token_id})

    def __call__(self, text: str | bytes) -> list[int]:
        """Text the grammar forces, as tokens: a special token's spelling in it is text too."""
        text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        try:
            return self.tokenizer.encode(text, add_special_tokens=False, parse_special=False)
        except TypeError:  # a tokenizer without the option
            return encode_plain(self.tokenizer, text)
