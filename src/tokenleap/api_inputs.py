"""What the Python API's calls take, read into one form: prompts as text, token ids or vLLM's prompt
dicts (one or a list), messages whose content is OpenAI's text parts, and ``SamplingParams`` under
either of its names."""
from __future__ import annotations

from typing import Any

from tokenleap.config import ConfigError, SamplingParams


def _text_content(message: Any) -> Any:
    """``message`` with OpenAI-style content parts (``[{"type": "text", "text": ...}]``) as the one
    string the template takes, joined as the server joins them; other parts are refused."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ConfigError(f"a message's content parts must be text parts ({{'type': 'text', 'text': ...}}); "
                              f"got {kind!r} (this engine reads text only)")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}  # (joined as the server's chat endpoint joins them)


def _checked(params: SamplingParams | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ConfigError(f"params must be a SamplingParams (or a list of them), got {type(params).__name__}")
    return params


def _shown(prompt: Any, ids: list[int]) -> Any:
    """What an output names as its prompt: the text or ids given, or a conversation's rendered ids."""
    return ids if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict) else prompt


def _one_of(params, sampling_params):
    """``generate``'s / ``chat``'s parameters, given under either name (not both)."""
    if params is not None and sampling_params is not None:
        raise ConfigError("give params or sampling_params, not both")
    return sampling_params if params is None else params


def _unwrapped(prompt: Any) -> Any:
    """vLLM's prompt dicts as their text or token ids; anything else as it is."""
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt) - {"prompt"} if "prompt_token_ids" in prompt else set(prompt)
    if keys == {"prompt_token_ids"}:  # (a "prompt" beside the ids is vLLM's text of them: the ids are read)
        return prompt["prompt_token_ids"]
    if keys == {"prompt"}:
        return prompt["prompt"]
    if "role" in prompt:
        raise ConfigError("a prompt is text or token ids, not a message: give a conversation (a list of messages) "
                          "to chat, or to stream / astream with chat=True")
    raise ConfigError(f"a prompt dict holds 'prompt' (text) or 'prompt_token_ids'; got keys {sorted(prompt)}")


def _prompt_list(prompts: str | list[int] | list[str] | list[list[int]]) -> list:
    """One prompt (text, token ids or a vLLM prompt dict) as a list of one; a ConfigError for none.
    Prompt dicts become their text or ids (an output's ``prompt``)."""
    if isinstance(prompts, dict):
        prompts = [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], dict):
        prompts = [_unwrapped(p) for p in prompts]
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    if not prompts:
        raise ConfigError("no prompts given")
    if not isinstance(prompts, (list, tuple)):
        raise ConfigError(f"prompts must be text, token ids or a list of either, got {type(prompts).__name__}")
    return list(prompts)
