"""A model that writes scripts: a prompt ending with a script's mark makes it write that script, one
character a token, then EOS -- so a server's handling of a known reply (tool calls, thinking blocks)
can be tested end to end."""
from __future__ import annotations

import torch

from tokenleap.config import ModelConfig
from tokenleap.models.build import build_transformer

VOCAB = 320
EOS, FILLER = 2, VOCAB - 1
TOOLS_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }}"  # takes tools


class ScriptTokenizer:
    """A character per token: each script's characters have ids of their own, following its start.
    ``starts``: mark character -> (the script's first id, the script)."""

    eos_token_ids = (EOS,)
    vocab_size = VOCAB

    def __init__(self, starts: dict[str, tuple[int, str]], chat_template: str = TOOLS_TEMPLATE) -> None:
        self.starts, self.chat_template = starts, chat_template
        self.pieces = {EOS: "", FILLER: "?"}
        for mark, (start, script) in starts.items():
            self.pieces[start] = mark
            for j, ch in enumerate(script, start + 1):
                self.pieces[j] = ch
        self.seen_tools: list = []

    def piece(self, i: int) -> str:
        return self.pieces.get(i, "?")

    def encode(self, text: str) -> list[int]:
        return [self.starts[c][0] if c in self.starts else FILLER for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.piece(i) for i in ids)

    def detokenizer(self):
        from conftest import ToyDetokenizer
        return ToyDetokenizer(self)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None) -> str:
        self.seen_tools.append(tools)
        return "".join(m["content"] for m in messages)


def script_model(starts: dict[str, tuple[int, str]]):
    """Token t is followed by the next token of its script (the last by EOS): one-hot embeddings,
    layers that add nothing (zero output projections), a head that maps each token to its successor."""
    cfg = ModelConfig(architecture="qwen2", vocab_size=VOCAB, hidden_size=VOCAB, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=VOCAB // 4,
                      max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      attention_bias=True, bos_token_id=1, eos_token_ids=(EOS,))
    from conftest import random_weights
    w = {k: torch.zeros_like(v) if ("o_proj" in k or "down_proj" in k) else v for k, v in random_weights(cfg).items()}
    w["model.embed_tokens.weight"] = torch.eye(VOCAB)
    w["model.norm.weight"] = torch.ones(VOCAB)
    head = torch.zeros(VOCAB, VOCAB)
    spans = sorted((start, start + len(script)) for start, script in starts.values())
    assert spans[0][0] > EOS and spans[-1][1] < FILLER and all(a[1] < b[0] for a, b in zip(spans, spans[1:]))
    for start, end in spans:
        for t in range(start, end):
            head[t + 1, t] = 1.0  # logit of t + 1 when the current token is t
        head[EOS, end] = 1.0
    w["lm_head.weight"] = head
    return build_transformer(cfg, w, torch.float32)
