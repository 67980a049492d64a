"""Fill in the middle over HTTP for ``/v1/completions``' ``suffix`` (OpenAI's field): the prompts are
``text/fim.py``'s, the code before the gap being the prompt and ``suffix`` the code after it.
(llama.cpp's ``/infill`` is in ``llamacpp.py``.)
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenleap.config import ConfigError
from tokenleap.serve.protocol import CompletionRequest, bad_request
from tokenleap.text.fim import encode_fim, required_fim_tokens


def fim_encoder(tokenizer, req: CompletionRequest) -> Callable[[Any], list[int]]:
    """``/v1/completions`` with ``suffix``: what encodes each of its prompts (text only) as the code
    before the gap, ``suffix`` being the code after it. The FIM tokens' stop ids join the request's."""
    if req.echo:
        raise bad_request("echo cannot be combined with suffix", "echo")
    try:
        fim = required_fim_tokens(tokenizer)
    except ConfigError as e:
        raise bad_request(str(e), "suffix") from None
    req.stop_token_ids = [*(req.stop_token_ids or []), *fim.stop_ids]

    def encode(prompt: Any) -> list[int]:
        if not isinstance(prompt, str):
            raise bad_request("with suffix, the prompt must be text (a string or a list of strings)", "prompt")
        try:
            return encode_fim(tokenizer, prompt, req.suffix)[0]
        except (ValueError, TypeError, UnicodeError) as e:
            raise bad_request(f"the prompt could not be tokenized: {e}", "prompt") from None
    return encode
