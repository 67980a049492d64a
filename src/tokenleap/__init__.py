"""tokenleap: lossless speculative decoding for LLMs in PyTorch."""
from tokenleap.config import ModelConfig, SamplingParams, SpecConfig, StructuredOutput


def __getattr__(name):  # the API pulls in torch and the loaders: import it on first use
    if name == "LLM":
        from tokenleap import api
        return api.LLM
    if name in ("RequestOutput", "CompletionOutput", "StreamChunk"):
        from tokenleap import outputs
        return getattr(outputs, name)
    raise AttributeError(name)

__version__ = "0.1.0"

__all__ = ["LLM", "ModelConfig", "SamplingParams", "SpecConfig", "StructuredOutput", "__version__"]
