"""What evaluation clients ask of the server, as lm-evaluation-harness's ``local-completions`` asks it:
the tokenizer through ``/tokenizer_info`` and ``/tokenize`` (no tokenizer files of its own), a
continuation's log-likelihood from an echoed prompt's logprobs (``max_tokens`` 1, or 0 as OpenAI's
older API and vLLM take it), and vLLM's ``prompt_logprobs`` field. Logprobs are checked against one
forward of the model over the whole text."""
from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from tokenleap.cache.contiguous import KVCache
from tokenleap.models.transformer import Segment
from tokenleap.serve.app import ServerConfig, create_app
from tokenleap.serve.scheduler import SchedulerConfig

from serving_helpers import VOCAB, ChatToyTokenizer, LiveServer, model, paged_engine

NAME = "tiny-qwen2"


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(model_name=NAME, scheduler=SchedulerConfig(log_interval=0))
    with LiveServer(create_app(paged_engine("ngram"), config)) as s:
        yield s


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def log_softmax(ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]: row i scores token i + 1
    target = model()
    cache = KVCache(target.config, 1, 128, torch.float32)
    logits = target(torch.tensor(ids), [Segment(cache.allocate(), 0, len(ids))], cache).logits
    return torch.log_softmax(logits.double(), dim=-1)


def test_tokenizer_info_lets_a_client_tokenize_through_the_server(server):
    info = httpx.get(server.url + "/tokenizer_info", timeout=10).json()
    tok = ChatToyTokenizer(VOCAB)
    assert "eos_token" in info and info["model_max_length"] == 128  # what lm-eval's probe looks for
    assert info["tokenizer_class"] and info["add_bos_token"] is False
    ids = post(server, "/tokenize", {"prompt": "some text", "add_special_tokens": False}).json()["tokens"]
    assert ids == tok.encode("some text")
    assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == tok.decode(ids)


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_loglikelihood_of_a_continuation(server, max_tokens):
    """lm-eval's loglikelihood request and its reading of the reply: the continuation's tokens are
    ``token_logprobs[ctxlen:-1]`` of the echoed context + continuation (the last: the decoded token),
    greedy where each is its position's top alternative. With max_tokens 0 nothing is decoded."""
    tok = ChatToyTokenizer(VOCAB)
    ctx, cont = tok.encode("the cat sat on"), tok.encode(" the mat")
    ids = ctx + cont
    body = {"model": NAME, "prompt": [ids, ids[:-2]], "temperature": 0, "max_tokens": max_tokens,
            "logprobs": 1, "echo": True, "seed": 1234}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    ref = log_softmax(ids)
    choice = sorted(out["choices"], key=lambda c: c["index"])[0]
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == len(ids) + max_tokens and lps["token_logprobs"][0] is None
    assert choice["text"].startswith(tok.decode(ids)) and (max_tokens or choice["text"] == tok.decode(ids))
    got = lps["token_logprobs"][len(ctx):len(ids)]
    want = [float(ref[p - 1, ids[p]]) for p in range(len(ctx), len(ids))]
    assert got == pytest.approx(want, abs=1e-4)
    assert sum(got) == pytest.approx(sum(want), abs=1e-3)
    greedy = all(t == max(top.values()) for t, top in zip(got, lps["top_logprobs"][len(ctx):len(ids)]))
    assert greedy == all(int(ref[p - 1].argmax()) == ids[p] for p in range(len(ctx), len(ids)))
    # each holds the token itself (OpenAI's "up to logprobs + 1") and the one likeliest alternative
    assert all(len(top) == (1 if top[t] == max(top.values()) else 2) and top[t] == v
               for t, v, top in zip(lps["tokens"][1:len(ids)], lps["token_logprobs"][1:len(ids)],
                                    lps["top_logprobs"][1:len(ids)]))
    if max_tokens == 0:
        assert [c["finish_reason"] for c in out["choices"]] == ["length", "length"]
        assert out["usage"]["completion_tokens"] == 0
        assert out["usage"]["prompt_tokens"] == 2 * len(ids) - 2


def test_max_tokens_zero_needs_echo_and_streams_the_prompt_alone(server):
    r = post(server, "/v1/completions", {"prompt": "abc", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "echo" in r.json()["error"]["message"]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": "abc def", "max_tokens": 0, "echo": True, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc def"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_vllm_prompt_logprobs(server):
    tok = ChatToyTokenizer(VOCAB)
    ids = tok.encode("one two three")
    r = post(server, "/v1/completions", {"prompt": "one two three", "max_tokens": 3, "temperature": 0,
                                         "prompt_logprobs": 2, "n": 2})
    assert r.status_code == 200, r.text
    ref = log_softmax(ids)
    for choice in r.json()["choices"]:
        plp = choice["prompt_logprobs"]
        assert choice["logprobs"] is None and len(plp) == len(ids) and plp[0] is None
        for p in range(1, len(ids)):
            entries = plp[p]
            own = entries[str(ids[p])]
            assert own["logprob"] == pytest.approx(float(ref[p - 1, ids[p]]), abs=1e-4)
            assert own["rank"] == 1 + int((ref[p - 1] > ref[p - 1, ids[p]]).sum())
            assert own["decoded_token"] == tok.decode([ids[p]])
            best = ref[p - 1].topk(2).indices.tolist()
            assert set(entries) == {str(ids[p]), *map(str, best)}
            assert [entries[str(t)]["rank"] for t in best] == [1, 2]
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                 "prompt_logprobs": 0}).json()
    rendered = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    plp = chat["prompt_logprobs"]
    assert len(plp) == len(rendered) and plp[0] is None and all(len(e) == 1 for e in plp[1:])
    assert math.fsum(e[str(t)]["logprob"] for e, t in zip(plp[1:], rendered[1:])) < 0


@pytest.mark.parametrize("body", [{"prompt_logprobs": 21}, {"prompt_logprobs": -1},
                                  {"prompt_logprobs": 1, "stream": True}])
def test_prompt_logprobs_refused_clearly(server, body):
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
