"""/v1/embeddings (``--embeddings``): vectors pooled from the final hidden states, the OpenAI
response format, its input forms and errors, and ``Scheduler.call`` that runs the work between steps."""
from __future__ import annotations

import base64
import concurrent.futures

import httpx
import numpy as np
import pytest
import torch

from tokenleap.cache.contiguous import KVCache
from tokenleap.models.embed import embed, embed_windows
from tokenleap.models.transformer import Segment
from tokenleap.serve.app import ServerConfig, create_app
from tokenleap.serve.scheduler import Scheduler, SchedulerConfig

from serving_helpers import (BOS, VOCAB, BosToyTokenizer, ChatToyTokenizer, LiveServer, model,
                             paged_engine)

NAME = "tiny-qwen2"


def final_hidden(ids: list[int]) -> torch.Tensor:  # [len(ids), hidden]: the final norm's output, one forward
    m = model()
    cache = KVCache(m.config, 1, len(ids), m.dtype)
    return m(torch.tensor(ids), [Segment(cache.allocate(), 0, len(ids))], cache).hidden[-1].float()


def test_pooling_last_and_mean_of_the_final_hidden_states():
    ids = [5, 9, 14, 3, 22, 7, 31, 8, 11, 40, 2, 17]
    h = final_hidden(ids)
    last, mean = embed(model(), [ids], "last", chunk=5)[0], embed(model(), [ids], "mean", chunk=5)[0]
    torch.testing.assert_close(last, h[-1] / h[-1].norm(), rtol=1e-4, atol=1e-5)  # windows of 5 vs one forward
    torch.testing.assert_close(mean, h.mean(0) / h.mean(0).norm(), rtol=1e-4, atol=1e-5)
    assert abs(float(last.norm()) - 1) < 1e-5 and not torch.allclose(last, mean)
    raw = embed(model(), [ids], "mean", normalize=False)[0]
    torch.testing.assert_close(raw, h.mean(0), rtol=1e-4, atol=1e-5)
    a, b, a2 = embed(model(), [ids, ids[:6], ids], "last")
    assert torch.equal(a, a2) and not torch.allclose(a, b)
    # llama.cpp's other poolings: the first token's state, and one normalized row a token
    cls, rows = embed(model(), [ids], "cls")[0], embed(model(), [ids], "none", chunk=5)[0]
    torch.testing.assert_close(cls, h[0] / h[0].norm(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(rows, h / h.norm(dim=-1, keepdim=True), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="pooling"):
        embed(model(), [ids], "max")
    with pytest.raises(ValueError, match="empty"):
        embed(model(), [[]])


def test_embed_windows_yields_after_each_window_then_the_vector():
    ids = list(range(3, 23))  # 20 tokens: windows of 8, 8 and 4
    out = list(embed_windows(model(), ids, "mean", chunk=8))
    assert out[:2] == [None, None] and len(out) == 3
    assert torch.equal(out[2], embed(model(), [ids], "mean", chunk=8)[0])


def test_scheduler_call_runs_one_call_an_iteration_and_passes_errors_on():
    sched = Scheduler(paged_engine(), SchedulerConfig(log_interval=0))
    ok = sched.call(lambda: 41 + 1)
    bad = sched.call(lambda: 1 / 0)
    skipped = sched.call(lambda: 7)
    skipped.cancel()  # a caller that went away before its call ran
    assert not sched.idle and not ok.done()
    sched.iterate()
    assert ok.result() == 42 and not bad.done()  # one call, then the step; the next call after it
    sched.run_until_idle()
    assert isinstance(bad.exception(), ZeroDivisionError) and skipped.cancelled() and sched.idle


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(model_name=NAME, scheduler=SchedulerConfig(log_interval=0), embeddings="mean")
    with LiveServer(create_app(paged_engine("ngram"), config)) as s:
        yield s


def post(server, body: dict, path: str = "/v1/embeddings") -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_embeddings_of_texts_and_token_ids(server):
    r = post(server, {"model": NAME, "input": ["hello there", "bye"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == NAME and body["id"].startswith("embd")
    assert [d["index"] for d in body["data"]] == [0, 1] and all(d["object"] == "embedding" for d in body["data"])
    ids = [ChatToyTokenizer(VOCAB).encode(t) for t in ("hello there", "bye")]
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    want = embed(model(), ids, "mean")
    for d, w in zip(body["data"], want):
        assert len(d["embedding"]) == model().config.hidden_size
        np.testing.assert_allclose(d["embedding"], w.numpy(), rtol=1e-6, atol=1e-6)
    one = post(server, {"input": ids[1]}).json()["data"][0]["embedding"]  # token ids, model left out
    assert one == body["data"][1]["embedding"]
    assert post(server, {"input": ids}).json()["data"][0]["embedding"] == body["data"][0]["embedding"]
    b64 = post(server, {"input": "bye", "encoding_format": "base64"}).json()["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(b64), dtype="<f4").tolist() == one
    same = post(server, {"input": "bye", "dimensions": model().config.hidden_size}).json()["data"][0]["embedding"]
    assert same == one
    # vLLM's truncate_prompt_tokens: each input's last N tokens, even one past the context
    long = ChatToyTokenizer(VOCAB).encode("x" * 150 + "the end")
    cut = post(server, {"input": "x" * 150 + "the end", "truncate_prompt_tokens": 12}).json()
    assert cut["usage"]["prompt_tokens"] == 12
    np.testing.assert_allclose(cut["data"][0]["embedding"], embed(model(), [long[-12:]], "mean")[0].numpy(),
                               rtol=1e-6, atol=1e-6)
    bad = post(server, {"input": "ok", "truncate_prompt_tokens": 0}).json()
    assert bad["error"]["param"] == "truncate_prompt_tokens"
    # vLLM's normalize false: the pooled vector as it is; embed_dtype and endianness: base64's numbers
    raw = post(server, {"input": "bye", "normalize": False}).json()["data"][0]["embedding"]
    pooled = embed(model(), [ids[1]], "mean", normalize=False)[0]
    np.testing.assert_allclose(raw, pooled.numpy(), rtol=1e-6, atol=1e-6)
    assert abs(np.linalg.norm(raw) - 1) > 1e-3  # (not unit length: the test can tell)
    for dtype, order, numpy_type in (("float16", "little", "<f2"), ("float32", "big", ">f4"),
                                     ("float16", "big", ">f2")):
        b64 = post(server, {"input": "bye", "encoding_format": "base64", "embed_dtype": dtype,
                            "endianness": order}).json()["data"][0]["embedding"]
        np.testing.assert_allclose(np.frombuffer(base64.b64decode(b64), dtype=numpy_type), one, rtol=1e-3, atol=1e-3)
    b64 = post(server, {"input": "bye", "encoding_format": "base64", "embed_dtype": "bfloat16"}).json()
    bits = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<u2").astype("<u4") << 16
    np.testing.assert_allclose(bits.view("<f4"), one, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["ok", ""]}, "input"),
    ({"input": [1, VOCAB + 3]}, "input"), ({"input": "x" * 200}, "input"),  # past the 128-token context
    ({"input": "ok", "dimensions": 3}, "dimensions"), ({"input": "ok", "encoding_format": "int8"}, None),
    ({"input": "ok", "model": "other"}, None), ({"input": 5}, None),
])
def test_bad_embedding_requests_get_4xx(server, body, param):
    r = post(server, body)
    assert 400 <= r.status_code < 500, (body, r.status_code)
    if param:
        assert r.json()["error"]["param"] == param


def test_generation_goes_on_beside_embeddings(server):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        gen = [pool.submit(httpx.post, server.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 8},
                           timeout=60) for _ in range(2)]
        emb = [pool.submit(post, server, {"input": ["abc", "defg"]}) for _ in range(2)]
        assert all(f.result().status_code == 200 for f in gen + emb)
    assert emb[0].result().json()["data"] == emb[1].result().json()["data"]


def test_embeddings_are_off_unless_asked_for():
    config = ServerConfig(model_name=NAME, scheduler=SchedulerConfig(log_interval=0))
    with LiveServer(create_app(paged_engine(), config)) as s:
        r = post(s, {"input": "hello"})
        assert r.status_code == 400 and "--embeddings" in r.json()["error"]["message"]


def test_llm_embed_takes_texts_and_ids_in_order():
    from tokenleap.api import LLM
    from tokenleap.config import ConfigError
    from tokenleap.models.pretrained import LoadedModel

    llm = LLM.from_loaded(LoadedModel(model(), ChatToyTokenizer(VOCAB), torch.float32, "none", "tiny", None),
                          max_model_len=64)
    ids = ChatToyTokenizer(VOCAB).encode("hello")
    one, two = llm.embed(["hello", "bye"], pooling="mean")
    assert one == llm.embed(ids, pooling="mean")[0] == llm.embed("hello", pooling="mean")[0]
    assert torch.allclose(torch.tensor(one), embed(model(), [ids], "mean")[0]) and one != two
    assert abs(sum(x * x for x in llm.embed("hello", normalize=False)[0]) - 1) > 1e-3
    for bad in ([], "", "x" * 65):
        with pytest.raises(ConfigError):
            llm.embed(bad)
    with pytest.raises(ConfigError, match="pooling"):
        llm.embed("hello", pooling="max")


def test_llamacpp_embedding_form_and_normalizations(server):
    ids = ChatToyTokenizer(VOCAB).encode("hello there")
    raw = embed(model(), [ids], "mean", normalize=False)[0]
    r = post(server, {"content": "hello there"}, "/embedding")
    assert r.status_code == 200, r.text
    [entry] = r.json()
    assert entry["index"] == 0 and len(entry["embedding"]) == 1  # one pooled vector, in a list
    np.testing.assert_allclose(entry["embedding"][0], (raw / raw.norm()).numpy(), rtol=1e-5, atol=1e-6)
    assert entry["embedding"][0] == post(server, {"input": "hello there"}).json()["data"][0]["embedding"]
    for norm, want in ((-1, raw), (1, raw / raw.abs().sum()), (0, raw * 32760 / raw.abs().max()),
                       (3, raw / raw.abs().pow(3).sum().pow(1 / 3))):
        got = post(server, {"content": ids, "embd_normalize": norm}, "/embeddings").json()[0]["embedding"][0]
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)
    two = post(server, {"content": ["hello there", "bye"]}, "/embedding").json()
    assert [e["index"] for e in two] == [0, 1] and two[0]["embedding"] == entry["embedding"]
    for body in ({}, {"content": "a", "input": "a"}, {"content": ""}):
        assert post(server, body, "/embedding").status_code == 400


def test_pooling_none_gives_a_vector_a_token_on_llamacpps_route_only():
    config = ServerConfig(model_name=NAME, scheduler=SchedulerConfig(log_interval=0), embeddings="none")
    with LiveServer(create_app(paged_engine(), config)) as s:
        ids = ChatToyTokenizer(VOCAB).encode("per token")
        [entry] = post(s, {"content": "per token"}, "/embedding").json()
        h = final_hidden(ids)
        np.testing.assert_allclose(entry["embedding"], (h / h.norm(dim=-1, keepdim=True)).numpy(), rtol=1e-4,
                                   atol=1e-5)
        r = post(s, {"input": "per token"})
        assert r.status_code == 400 and "/embedding" in r.json()["error"]["message"]


def test_embeddings_add_special_tokens_false_leaves_the_bos_out():
    from tokenleap.serve.embedding_routes import EmbeddingRoutes

    engine = paged_engine("ngram")
    engine.tokenizer = BosToyTokenizer(VOCAB)
    routes = EmbeddingRoutes(create_app(engine, ServerConfig(model_name=NAME, embeddings="mean")).state.server)
    assert routes.token_lists("hi") == [[BOS, *ChatToyTokenizer(VOCAB).encode("hi")]]
    assert routes.token_lists("hi", add_special_tokens=False) == [ChatToyTokenizer(VOCAB).encode("hi")]
