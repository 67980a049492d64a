"""Errors with messages meant for the user; the CLI prints them without a traceback."""
from __future__ import annotations

from tokenleap.config import ConfigError, TokenleapError  # (the base class; bad values: ConfigError)


class ModelNotFoundError(TokenleapError):
    """An unknown model name or a path that does not exist."""


class ModelFormatError(TokenleapError):
    """A model file that is truncated, corrupt, or of an unsupported architecture."""


class PromptTooLongError(TokenleapError):
    """A prompt that does not fit the context window."""


class GenerationCancelled(TokenleapError):
    """A blocking call whose caller gave up (a cancelled ``agenerate`` / ``achat``): it stopped between steps."""


class LLMClosedError(TokenleapError):
    """A call on an ``LLM`` after its ``close()``."""


__all__ = ["ConfigError", "TokenleapError", "ModelNotFoundError", "ModelFormatError", "PromptTooLongError",
           "GenerationCancelled", "LLMClosedError"]
