"""A request's prompt as token ids: a text or ids (checked against the vocabulary), a completions
request's list of prompts, a conversation through the model's chat template -- each failure a 400
that names the request's field."""
from __future__ import annotations

from typing import Any

from tokenleap.config import ConfigError
from tokenleap.serve.protocol import MAX_PROMPTS, bad_request
from tokenleap.serve.tools import ToolPlan
from tokenleap.text.plain import encode_plain


class Prompts:
    """The encoder of one served model (``tokenizer``; ``vocab_size``: the model's, which token ids
    must fall under)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    def many(self, prompt: Any, encode=None) -> list[list[int]]:
        """A completion request's prompts, each encoded (``encode``: another encoder than ``encode``)."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request", "prompt")
        return [(encode or self.encode)(p) for p in prompt]

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True, param: str = "prompt",
               parse_special: bool = True) -> list[int]:
        """A prompt's ids (token ids: checked against the vocabulary); a 400 naming ``param`` when it
        cannot be tokenized. ``add_special_tokens`` false: none added (a tokenizer whose encode
        takes no such option adds none); ``parse_special`` false: special tokens' spellings are text."""
        if isinstance(prompt, list):
            if not prompt or not all(0 <= t < self.vocab_size for t in prompt):
                raise bad_request(f"token ids must be non-empty lists of ids in [0, {self.vocab_size})", param)
            return prompt
        try:
            if not parse_special:
                return self.tokenizer.encode(prompt, add_special_tokens, parse_special=False)
            return self.tokenizer.encode(prompt) if add_special_tokens else encode_plain(self.tokenizer, prompt)
        except (ValueError, TypeError, UnicodeError) as e:
            raise bad_request(f"the {param} could not be tokenized: {e}", param) from None

    def encode_chat(self, messages: list[dict[str, Any]], tools: ToolPlan,
                    options: dict[str, Any] | None = None) -> list[int]:
        """The rendered conversation's ids, ending with the start of the reply (and the opening of
        a tool call when ``tool_choice`` forces one); ``options``: ``chat_render.chat_options``."""
        return self._chat(messages, tools, options, encode=True)

    def render_chat(self, messages: list[dict[str, Any]], tools: ToolPlan,
                    options: dict[str, Any] | None = None) -> str:
        """The same conversation's prompt text (llama.cpp's /apply-template)."""
        return self._chat(messages, tools, options, encode=False)

    def _chat(self, messages: list[dict[str, Any]], tools: ToolPlan, options: dict[str, Any] | None,
              encode: bool) -> list[int] | str:
        """``encode_chat`` (``encode``) or ``render_chat``: the tokenizer's own ``encode_chat`` /
        ``render_chat`` where it has them, else its chat template's text (then encoded); a 400 that
        says why the messages cannot be rendered."""
        extra = {**(options or {}), **({"tools": tools.tools} if tools.tools is not None else {})}
        try:
            native = getattr(self.tokenizer, "encode_chat" if encode else "render_chat", None)
            if native is not None:
                return native(messages, reply_prefix=tools.prefix, **extra)
            if extra.pop("continue_final_message", False):
                raise bad_request("this tokenizer cannot continue a final message", "continue_final_message")
            extra.setdefault("add_generation_prompt", True)
            text = self.tokenizer.apply_chat_template(messages, **extra) + tools.prefix
            return self.tokenizer.encode(text) if encode else text
        except ConfigError as e:
            raise bad_request(str(e), "messages") from None
        except (ValueError, TypeError, UnicodeError) as e:
            raise bad_request(f"the messages could not be {'tokenized' if encode else 'rendered'}: {e}",
                              "messages") from None
