"""Fill-in-the-middle: the FIM prompt of each known token set (and other files as repository
context), ``suffix`` in /v1/completions and llama.cpp's /infill (the reply equals the FIM prompt
generated alone, the FIM bookkeeping tokens end it, clear 400s otherwise), ``generate --suffix`` and
``LLM.infill``."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from tokenleap.api import LLM
from tokenleap.config import ConfigError, SamplingParams
from tokenleap.models.pretrained import LoadedModel
from tokenleap.serve.app import ServerConfig, create_app
from tokenleap.serve.scheduler import SchedulerConfig
from tokenleap.text.fim import encode_fim, fim_tokens

from serving_helpers import MAX_LEN, VOCAB, ChatToyTokenizer, LiveServer, alone, model, paged_engine

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


class RepoToy(FimToy):
    """FimToy with Qwen2.5-Coder's repository-level tokens too (ids 94, 95)."""

    SPECIAL = {**FimToy.SPECIAL, "<|file_sep|>": 94, "<|repo_name|>": 95}


def test_other_files_come_first_as_repository_context():
    tok = RepoToy(VOCAB)
    ids, fim = encode_fim(tok, "p", "s", [("a.py", "x = 1"), (None, "y")], middle="m")
    plain = tok.encode
    assert ids == [95, *plain("myproject\n"), 94, *plain("a.py\n"), *plain("x = 1"), 94, *plain("tmp\n"), *plain("y"),
                   94, *plain("filename\n"), 90, *plain("p"), 91, *plain("s"), 92, *plain("m")]
    assert (fim.repo, fim.file_sep, fim.stop_ids) == (95, 94, (93, 94, 95))
    snippets, _ = encode_fim(FimToy(VOCAB), "p", "s", [("a.py", "x")])  # no repository tokens: a text marker
    assert snippets == [*plain("\n\n--- snippet ---\n\n"), *plain("x"), 90, *plain("p"), 91, *plain("s"), 92]


def test_llamacpp_infill_endpoint():
    tok = RepoToy(VOCAB)
    body = {"input_prefix": "def fn(", "input_suffix": "):\n    pass", "prompt": "a",
            "input_extra": [{"filename": "util.py", "text": "def helper(): ..."}], "n_predict": 10, "temperature": 0}
    ids, fim = encode_fim(tok, "def fn(", "):\n    pass", [("util.py", "def helper(): ...")], "a")
    with fim_app(tok) as s:
        r = httpx.post(s.url + "/infill", json=body, timeout=60).json()
        ref = alone(ids, SamplingParams(max_tokens=10, stop_token_ids=fim.stop_ids))
        assert r["content"] == ref.text and r["stop"] is True and r["tokens_evaluated"] == len(ids)
        assert r["tokens_predicted"] == ref.num_generated and r["stop_type"] in ("eos", "limit")
        assert r["stopping_word"] == ""
        t = r["timings"]  # llama.cpp's: tokens and milliseconds of the prompt and of the generation
        assert (t["prompt_n"], t["predicted_n"], t["cache_n"]) == (len(ids), ref.num_generated, 0)
        assert t["prompt_ms"] > 0 and t["predicted_ms"] >= 0 and t["prompt_per_second"] > 0
        word = ref.text[2:4]  # a stop string: llama.cpp's "word" stop, naming it
        assert len(word) == 2
        r = httpx.post(s.url + "/infill", json={**body, "stop": ["@@@", word]}, timeout=60).json()
        assert r["content"] == ref.text[:ref.text.index(word)]
        assert (r["stop_type"], r["stopping_word"]) == ("word", word)
        events = []
        with httpx.stream("POST", s.url + "/infill", json={**body, "stream": True}, timeout=60) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        assert "".join(e["content"] for e in events) == ref.text and events[-1]["stop"] is True
        assert all(e["stop"] is False for e in events[:-1]) and events[-1]["tokens_predicted"] == ref.num_generated
        # llama.cpp's sampling defaults where a field is absent (top_k 40, top_p 0.95, min_p 0.05)
        seeded = httpx.post(s.url + "/infill", json={**body, "temperature": 0.7, "seed": 5}, timeout=60).json()
        want = alone(ids, SamplingParams(max_tokens=10, temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, seed=5,
                                         stop_token_ids=fim.stop_ids))
        assert seeded["content"] == want.text
        # n_predict 0: the prompt alone (editor plugins warm the cache so): nothing returned, streamed or not
        warm = httpx.post(s.url + "/infill", json={**body, "n_predict": 0}, timeout=60).json()
        assert (warm["content"], warm["tokens_predicted"], warm["stop"], warm["timings"]["predicted_n"]) == \
            ("", 0, True, 0) and warm["tokens_evaluated"] == len(ids)
        with httpx.stream("POST", s.url + "/infill", json={**body, "n_predict": 0, "stream": True}, timeout=60) as st:
            warm = [json.loads(line[6:]) for line in st.iter_lines() if line.startswith("data: ")]
        assert len(warm) == 1 and warm[0]["stop"] and warm[0]["content"] == "" and warm[0]["tokens_predicted"] == 0
        # a prompt over the context (128 tokens here) is cut as llama.cpp's /infill cuts it, not refused
        files = [(f"f{j}.py", "def helper_number(): return 1\n" * 3) for j in range(6)]
        long = {**body, "input_prefix": "x = 1\n" * 40 + "def fn(", "input_extra": [
            {"filename": n, "text": t} for n, t in files], "n_predict": 8}
        cut, _ = encode_fim(tok, long["input_prefix"], body["input_suffix"], files, "a", fit=(128, 8))
        assert len(encode_fim(tok, long["input_prefix"], body["input_suffix"], files, "a")[0]) > 128 >= len(cut) + 8
        at, near = cut.index(fim.suffix), tok.encode("def fn(")
        assert cut[at - len(near):at] == near and cut[at + 1:at + 3] == tok.encode("):")  # the cursor's surroundings
        r = httpx.post(s.url + "/infill", json=long, timeout=60).json()
        assert r["tokens_evaluated"] == len(cut) and r["truncated"] is True
        # response_fields (llama.vim's): the fields asked for, a nested one at the top under its path
        picked = httpx.post(s.url + "/infill", json={**body, "stop": "@@@", "response_fields": [
            "content", "timings/prompt_n", "nope", "truncated"]}, timeout=60).json()
        assert picked == {"content": ref.text, "timings/prompt_n": len(ids), "truncated": False}
        assert r["content"] == alone(cut, SamplingParams(max_tokens=8, stop_token_ids=fim.stop_ids)).text
        for extra in ([{"text": 5}], [{"filename": "util.py"}]):  # a chunk's text: a string, required
            bad = httpx.post(s.url + "/infill", json={**body, "input_extra": extra}, timeout=60)
            assert bad.status_code == 400 and "text" in bad.json()["error"]["message"], bad.text
        # llama.cpp's readings: n_predict past the context runs to its end ("limit"), a temperature below 0 is greedy
        long_run = httpx.post(s.url + "/infill", json={**body, "n_predict": 10**6}, timeout=60).json()
        assert long_run["stop_type"] in ("limit", "eos") and long_run["tokens_evaluated"] < MAX_LEN
        assert httpx.post(s.url + "/infill", json={**body, "temperature": -1}, timeout=60).json()["content"] == ref.text
    with fim_app(ChatToyTokenizer(VOCAB)) as s:
        bad = httpx.post(s.url + "/infill", json=body, timeout=60)
        assert bad.status_code == 400 and "fill-in-the-middle" in bad.json()["error"]["message"]
