"""tokenleap: lossless speculative decoding for LLMs in PyTorch."""
from .config import ModelConfig, SamplingParams, SpecConfig

__version__ = "0.1.0"

__all__ = ["ModelConfig", "SamplingParams", "SpecConfig", "__version__"]
