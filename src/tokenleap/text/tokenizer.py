"""Tokenizer: encoding, chat templates, token bytes and streaming decode over a Hugging Face
``tokenizers`` backend, read from a model directory or from a GGUF file's metadata
(``gguf_tokenizer``, which also writes that metadata out as a directory's files).
"""
from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend
from tokenizers import models

from tokenleap.config import ConfigError
from tokenleap.text.detokenizer import IncrementalDetokenizer
from tokenleap.errors import ModelFormatError
from tokenleap.text.gguf_tokenizer import build_backend_tokenizer, char_to_byte, tokenizer_config_from_metadata
from tokenleap.text.sentencepiece import piece_bytes

# Tokens that end a chat turn (stop ids when the template uses them) and ones that end a document.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
_DOC_END_TOKENS = ("<|endoftext|>", "<|end_of_text|>")


class ChatTemplateError(ConfigError):
    """No chat template, bad messages, or a template that failed to render."""


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


_CONTINUE_TAG = "<tokenleap:continue_final_message> "


def _tag_final_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with ``_CONTINUE_TAG`` after the final message's text (its last text part, where
    its content is a list of parts)."""
    _check_messages(messages)
    final = dict(messages[-1])
    content = final.get("content")
    if isinstance(content, list):
        at = next((i for i in range(len(content) - 1, -1, -1) if isinstance(content[i], dict)
                   and isinstance(content[i].get("text"), str)), None)
        if at is None:
            raise ChatTemplateError("continue_final_message: the final message has no text to continue")
        content = list(content)
        content[at] = {**content[at], "text": content[at]["text"] + _CONTINUE_TAG}
    elif content is None or isinstance(content, str):
        content = (content or "") + _CONTINUE_TAG
    else:
        raise ChatTemplateError(f"continue_final_message: the final message's content must be text, "
                                f"got {type(content).__name__}")
    return [*messages[:-1], {**final, "content": content}]


class _GenerationBlocks(jinja2.ext.Extension):
    """``{% generation %} ... {% endgeneration %}``: training templates mark the assistant's tokens
    with it (transformers' assistant masks); rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[Any]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the model's chat template rejected the conversation: {message}")


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationBlocks])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the model's chat template does not parse: {e}") from e


def read_chat_template(value: str) -> str:
    """A ``--chat-template`` value as the template: the value itself where it reads as a Jinja template,
    else the text of the file it names (vLLM takes both), else an error that names it."""
    if "{{" in value or "{%" in value:  # (first: a long template is no path the file system can even look up)
        return _parsed(value)
    path = Path(value).expanduser()
    try:
        if not path.is_file():
            raise ChatTemplateError(f"chat template {value!r}: no such file, and not a Jinja template (no {{{{ "
                                    "or {%)")
        template = path.read_text(encoding="utf-8-sig")  # (an editor's byte-order mark is not template text)
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"cannot read the chat template file {str(path)!r}: {e}") from None
    return _parsed(template)  # (refused here, before a model loads)


def _parsed(template: str) -> str:
    """``template`` once it is known to parse; else a ``ChatTemplateError`` that says it is the given one."""
    try:
        _compile_template(template)
    except ChatTemplateError as e:
        raise ChatTemplateError(str(e).replace("the model's chat template", "the chat template given")) from None
    return template


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"message {i} must be a dict with a string 'role', got {m!r}")


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any) -> str | None:
    """A template string, or the 'default' one of a list of named templates."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None


# Tokenizer
class Tokenizer:
    """Text <-> token ids, chat templates, stop ids. Wraps a ``tokenizers.Tokenizer``."""

    def __init__(self, backend: _Backend, config: dict[str, Any] | None = None,
                 generation_config: dict[str, Any] | None = None) -> None:
        self._backend = backend
        config = dict(config or {})
        # tokenizer_config.json's settings, as vLLM's /tokenizer_info shows them (the added tokens' table left out)
        self.config = {k: v for k, v in config.items() if k != "added_tokens_decoder"}
        self.chat_template: str | None = _pick_template(config.get("chat_template"))
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        self.unk_token = _token_content(config.get("unk_token"))
        self.fim_token_names: dict[str, str] = dict(config.get("fim_tokens") or {})  # role -> token
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.eos_token_id = self.token_to_id(self.eos_token)
        with_specials = backend.encode("a", add_special_tokens=True).ids
        self.add_bos_token = self.bos_token_id is not None and with_specials[:1] == [self.bos_token_id]
        self._generation_config = dict(generation_config or {})
        self.eos_token_ids = self._own_stops = self._stop_ids(self._generation_config)
        # SentencePiece-style vocabulary (``▁`` for a space, ``<0xNN>`` byte pieces): token bytes
        # come from the spelling, since a decoder may strip a piece's leading space
        self._spm_pieces = isinstance(backend.model, models.BPE) and bool(backend.model.byte_fallback)
        self._added_ids: frozenset[int] | None = None
        self._literal: _Backend | None = None  # the backend reading special tokens' spellings as text

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load ``tokenizer.json`` (required) and, when present, ``tokenizer_config.json``,
        ``chat_template.jinja`` and ``generation_config.json`` from a directory. Without a
        ``generation_config.json``, config.json's end tokens (a list: every one of them) end a reply, as
        transformers and vLLM fall back to them (a converted GGUF's config.json holds the file's
        end-of-text, end-of-turn and end-of-message tokens)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            other = [n for n in ("tokenizer.model", "vocab.json", "merges.txt") if (path / n).is_file()]
            raise ModelFormatError(
                f"no tokenizer.json in {path}; " + (
                    f"tokenleap reads a tokenizer from tokenizer.json only, not {' + '.join(other)} -- transformers "
                    f"writes one: AutoTokenizer.from_pretrained({str(path)!r}).save_pretrained({str(path)!r})"
                    if other
                    else "the model directory is incomplete"))
        backend = _backend_of(path / "tokenizer.json")
        config = _read_json(path / "tokenizer_config.json")
        if not _pick_template(config.get("chat_template")) and (path / "chat_template.jinja").is_file():
            config["chat_template"] = (path / "chat_template.jinja").read_text(encoding="utf-8-sig")
        generation = _read_json(path / "generation_config.json")
        if not (path / "generation_config.json").is_file():
            from tokenleap.models.hf_config import config_eos
            model_eos = config_eos(_read_json(path / "config.json"))
            if model_eos is not None:
                generation["eos_token_id"] = model_eos
        return cls(backend, config, generation)

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> "Tokenizer":
        """Build in memory from GGUF tokenizer metadata (no files written)."""
        return cls(build_backend_tokenizer(metadata), tokenizer_config_from_metadata(metadata))

    # -- vocabulary ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (may be below the model's embedding rows)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> _Backend:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._backend

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def use_chat_template(self, template: str) -> None:
        """Render chats with ``template`` instead of the model's own (vLLM's ``--chat-template``): checked
        to parse now, and its turn-end token (``<|im_end|>``, ``<|eot_id|>`` ...) made a stop token
        beside the model's own template's."""
        if not isinstance(template, str) or not template.strip():
            raise ChatTemplateError("a chat template must be a non-empty Jinja template")
        self.chat_template = _parsed(template)  # the model's own turn-end stays a stop too (its tuning writes it)
        self.eos_token_ids = tuple(dict.fromkeys(self._own_stops + self._stop_ids(self._generation_config)))

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    def _stop_ids(self, generation_config: dict[str, Any]) -> tuple[int, ...]:
        ids: list[int | None] = [self.eos_token_id]
        gen_eos = generation_config.get("eos_token_id")
        ids += gen_eos if isinstance(gen_eos, list) else [gen_eos]
        template = self.chat_template or ""
        ids += [self.token_to_id(t) for t in _TURN_END_TOKENS if t in template]
        specials = {t.content for t in self._backend.get_added_tokens_decoder().values() if t.special}
        ids += [self.token_to_id(t) for t in _DOC_END_TOKENS if t in specials]
        return tuple(dict.fromkeys(int(i) for i in ids if isinstance(i, int)))

    # -- encode / decode ----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS/EOS where the model's config says so;
        without ``parse_special`` a special token's spelling in the text is plain text (llama.cpp's
        ``parse_special``), as transformers and vLLM otherwise read it as the token."""
        if not isinstance(text, str):
            raise ConfigError(f"text to encode must be a string, got {type(text).__name__}")
        backend = self._backend
        if not parse_special:
            if self._literal is None:  # a copy of the backend, read-only once built
                literal = _Backend.from_str(backend.to_str())
                literal.encode_special_tokens = True
                self._literal = literal
            backend = self._literal
        try:
            if len(text) > _DETACHED_CHARS:  # (tokenizers' encode holds the GIL throughout; encode_batch lets
                # it go, so a long prompt on a prompt thread leaves the event loop free)
                return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
            return backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate: from undecodable bytes, or a JSON escape
                raise ConfigError(f"the text is not valid Unicode (a lone surrogate at character {e.start}; "
                                  f"is its source UTF-8?)") from None
            raise

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token stands for -- exact also for a token that holds part of a
        multi-byte character (byte-level BPE spelling, or SentencePiece's ``<0xNN>`` byte tokens)."""
        if self._spm_pieces:
            if self._added_ids is None:
                self._added_ids = frozenset(self._backend.get_added_tokens_decoder())
            spelled = self.id_to_token(token_id) if int(token_id) not in self._added_ids else None
            if spelled:
                return piece_bytes(spelled) or b""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            spelled = self.id_to_token(token_id) or ""
            byte_of = char_to_byte()
            if spelled and all(c in byte_of for c in spelled):
                return bytes(byte_of[c] for c in spelled)
            hex_byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", spelled)
            if hex_byte:
                return bytes([int(hex_byte.group(1), 16)])
        return text.encode("utf-8")

    def detokenizer(self, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # -- chat -----------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, *, tokenize: bool = False,
                            continue_final_message: bool = False, **kwargs: Any) -> str | list[int]:
        """Render a conversation with the model's chat template, as transformers does (``tokenize=True``:
        the text's token ids, as transformers gives them; the default here is the text, and the generation
        prompt is added unless ``add_generation_prompt`` is false). OpenAI's ``developer`` messages (the
        instructions newer clients send instead of ``system``) are rendered as ``system`` where the
        template has no developer role of its own: templates that predate it drop such a message
        (Qwen2.5's) or write a turn the model never saw. ``continue_final_message``: the text stops right
        after the final message's content (no generation prompt), so a reply continues it (``render_chat``)."""
        if continue_final_message:
            text = self.render_chat(messages, False, continue_final_message=True, tools=tools, **kwargs)
            return self.encode(text, add_special_tokens=False) if tokenize else text
        if tokenize:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs),
                               add_special_tokens=False)
        if not self.chat_template:
            raise ChatTemplateError(
                "this model has no chat template, so it cannot format chat messages: give it a plain text "
                "prompt (generate without --chat, bench and calibrate with --no-chat; /v1/completions rather "
                "than a chat endpoint), or use an instruct / chat model")
        _check_messages(messages)
        if "developer" not in self.chat_template:
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        template = _compile_template(self.chat_template)
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token,
                     "unk_token": self.unk_token, "documents": None, **kwargs}  # (documents: as transformers')
        try:
            return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                   tools=tools, **variables)
        except ChatTemplateError:
            raise
        except Exception as e:  # jinja2 errors, or a template indexing a field a message lacks
            raise ChatTemplateError(f"the model's chat template failed on these messages: {e}") from e

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    reply_prefix: str = "", continue_final_message: bool = False, **kwargs: Any) -> str:
        """A conversation's prompt text, followed by ``reply_prefix`` (text the reply is made to start
        with); with ``continue_final_message`` the rendering stops right after the final message's
        content, so the reply continues it."""
        if continue_final_message:  # the rendering is cut where this tag, after the final content, lands
            messages = _tag_final_message(messages)
        kwargs.pop("tokenize", None)  # (a request's template variables cannot turn the text into ids)
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt and not continue_final_message,
                                        **kwargs)
        if continue_final_message:
            tagged = _CONTINUE_TAG.strip()
            at = text.rfind(tagged)
            if at < 0:
                raise ChatTemplateError("continue_final_message: the chat template dropped or changed the final "
                                        "message's content, so the reply cannot continue it")
            # a template that trims the content (Gemma's) trimmed the tag's space too: cut its trailing
            # spaces as well, so the prompt is the one the trimmed message makes
            text = text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()
        return text + reply_prefix

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    reply_prefix: str = "", continue_final_message: bool = False, **kwargs: Any) -> list[int]:
        """Token ids of ``render_chat``'s text; BOS is added only if the model wants one and the
        template did not already write it."""
        text = self.render_chat(messages, add_generation_prompt, reply_prefix, continue_final_message, **kwargs)
        ids = self.encode(text, add_special_tokens=False)
        if self.add_bos_token and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids


_DETACHED_CHARS = 20_000  # texts longer than this are encoded with the GIL released
_BACKENDS: dict[str, _Backend] = {}  # digest of a tokenizer.json -> its backend (read-only once built)
_BACKENDS_MAX = 8


def _backend_of(path: Path) -> _Backend:
    """``tokenizer.json``'s backend; a file with the bytes of one read before gives the same backend
    (a draft model of the target's family does not build its vocabulary a second time)."""
    data = path.read_bytes()
    key = hashlib.sha256(data).hexdigest()
    if key not in _BACKENDS:
        try:
            _BACKENDS[key] = _Backend.from_str(data.decode("utf-8"))
        except Exception as e:
            raise ModelFormatError(f"{path} could not be read: {e}") from e
        while len(_BACKENDS) > _BACKENDS_MAX:
            _BACKENDS.pop(next(iter(_BACKENDS)))
    return _BACKENDS[key]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{path} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}
