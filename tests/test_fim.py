"""Fill-in-the-middle: the FIM prompt of each known token set, ``suffix`` in /v1/completions (the reply
equals the FIM prompt generated alone, the FIM bookkeeping tokens end it, clear 400s otherwise),
``generate --suffix`` and ``LLM.infill``."""
from __future__ import annotations

import httpx
import pytest
import torch

from tokenleap.api import LLM
from tokenleap.config import ConfigError, SamplingParams
from tokenleap.models.pretrained import LoadedModel
from tokenleap.serve.app import ServerConfig, create_app
from tokenleap.serve.scheduler import SchedulerConfig
from tokenleap.text.fim import encode_fim, fim_tokens

from serving_helpers import VOCAB, ChatToyTokenizer, LiveServer, alone, model, paged_engine

NAME = "tiny"


class FimToy(ChatToyTokenizer):
    """The toy tokenizer with Qwen2.5-Coder's FIM token names at ids 90-93 (90-92 never come from
    ``encode`` of lowercase text)."""

    SPECIAL = {"<|fim_prefix|>": 90, "<|fim_suffix|>": 91, "<|fim_middle|>": 92, "<|fim_pad|>": 93}

    def token_to_id(self, token):
        return self.SPECIAL.get(token)


class Named(ChatToyTokenizer):
    def __init__(self, names: dict[str, int], bos: int | None = None) -> None:
        super().__init__(VOCAB)
        self.names, self.add_bos_token, self.bos_token_id = names, bos is not None, bos

    def token_to_id(self, token):
        return self.names.get(token)


def test_each_known_token_set_builds_prefix_suffix_middle():
    tok = FimToy(VOCAB)
    ids, fim = encode_fim(tok, "ab", "c")
    assert ids == [90, *tok.encode("ab"), 91, *tok.encode("c"), 92] and fim.stop_ids == (93,)
    assert encode_fim(tok, "", "")[0] == [90, 91, 92]
    star = Named({"<fim_prefix>": 5, "<fim_suffix>": 6, "<fim_middle>": 7, "<file_sep>": 8}, bos=1)
    assert encode_fim(star, "a", "b")[0] == [1, 5, *star.encode("a"), 6, *star.encode("b"), 7]
    assert fim_tokens(star).stop_ids == (8,)
    deepseek = Named({"<｜fim▁begin｜>": 10, "<｜fim▁hole｜>": 11, "<｜fim▁end｜>": 12})
    assert encode_fim(deepseek, "x", "y")[0] == [10, *deepseek.encode("x"), 11, *deepseek.encode("y"), 12]
    assert fim_tokens(Named({"<|fim_prefix|>": 1, "<|fim_suffix|>": 2})) is None  # an incomplete set
    with pytest.raises(ConfigError, match="no fill-in-the-middle tokens"):
        encode_fim(ChatToyTokenizer(VOCAB), "a", "b")


def fim_app(tokenizer) -> LiveServer:
    engine = paged_engine("ngram")
    engine.tokenizer = tokenizer
    return LiveServer(create_app(engine, ServerConfig(NAME, scheduler=SchedulerConfig(log_interval=0))))


def test_completions_with_a_suffix_fill_the_middle():
    tok = FimToy(VOCAB)
    with fim_app(tok) as s:
        body = {"model": NAME, "prompt": "def fn(", "suffix": "):\n    pass", "max_tokens": 12, "temperature": 0}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()
        ids, _ = encode_fim(tok, "def fn(", "):\n    pass")
        ref = alone(ids, SamplingParams(max_tokens=12, stop_token_ids=(93,)))
        assert r["choices"][0]["text"] == ref.text and r["usage"]["prompt_tokens"] == len(ids)
        both = httpx.post(s.url + "/v1/completions", json={**body, "prompt": ["def fn(", "x = ("]}, timeout=60).json()
        assert [c["text"] for c in both["choices"]][0] == ref.text and len(both["choices"]) == 2
        for extra, message in (({"echo": True}, "echo cannot"), ({"prompt": [1, 2, 3]}, "must be text"),
                               ({"prompt": [[1, 2]]}, "must be text")):
            bad = httpx.post(s.url + "/v1/completions", json={**body, **extra}, timeout=60)
            assert bad.status_code == 400 and message in bad.json()["error"]["message"], bad.text
    with fim_app(ChatToyTokenizer(VOCAB)) as s:
        bad = httpx.post(s.url + "/v1/completions", json={"model": NAME, "prompt": "a", "suffix": "b"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "suffix"
        assert "fill-in-the-middle" in bad.json()["error"]["message"]


def test_a_fim_token_ends_the_middle():
    """The FIM padding token is a stop token: a model whose next token after the prompt is padding
    stops there (a logit bias makes it the argmax)."""
    tok = FimToy(VOCAB)
    with fim_app(tok) as s:
        body = {"model": NAME, "prompt": "ab", "suffix": "cd", "max_tokens": 12, "temperature": 0,
                "logit_bias": {"93": 100}}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()
        assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 1


def test_llm_infill_and_generate_suffix_refusals():
    llm = LLM.from_loaded(LoadedModel(model(1), FimToy(VOCAB), torch.float32, "none", "tiny", None),
                          max_model_len=128)
    out = llm.infill("def fn(", "): pass", SamplingParams(max_tokens=6))
    ids, params = llm.infill_request("def fn(", "): pass", SamplingParams(max_tokens=6))
    assert params.stop_token_ids == (93,) and out.prompt == "def fn("
    assert out.token_ids == llm.generate(ids, params)[0].token_ids
    from tokenleap.cli.main import main
    assert main(["generate", "--model", "x", "--prompt", "a", "--suffix", "b", "--chat"]) == 2
