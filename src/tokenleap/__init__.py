"""tokenleap: lossless speculative decoding for LLMs in PyTorch."""
from tokenleap.config import ModelConfig, SamplingParams, SpecConfig, StructuredOutput


def __getattr__(name):  # the API pulls in torch and the loaders: import it on first use
    if name in ("LLM", "RequestOutput", "CompletionOutput", "StreamChunk"):
        from tokenleap import api
        return getattr(api, name)
    raise AttributeError(name)

__version__ = "0.1.0"

__all__ = ["LLM", "ModelConfig", "SamplingParams", "SpecConfig", "StructuredOutput", "__version__"]
