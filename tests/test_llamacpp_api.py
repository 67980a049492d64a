"""llama.cpp's own server API against a live server (tiny random model, toy tokenizer): /completion's
prompt shapes (several prompts, ids mixed with text), n_probs, return_tokens and logit_bias;
/props, /apply-template and /tokenize's add_special. Every reply is compared with the same prompt
generated alone by a plain engine."""
from __future__ import annotations

import json

import httpx
import pytest

from tokenleap.config import SamplingParams
from tokenleap.serve.app import ServerConfig, create_app
from tokenleap.serve.scheduler import SchedulerConfig

from serving_helpers import (BOS, MAX_LEN, VOCAB, BosToyTokenizer, ChatToyTokenizer, LiveServer, alone,
                             paged_engine)

NAME = "tiny-qwen2"
@pytest.fixture(scope="module")
def server():
    engine = paged_engine("ngram")
    config = ServerConfig(model_name=NAME, model_aliases=("/models/tiny.gguf",),
                          scheduler=SchedulerConfig(log_interval=0))
    with LiveServer(create_app(engine, config)) as s:
        yield s


def ids_of(text: str) -> list[int]:
    return ChatToyTokenizer(VOCAB).encode(text)


def ref(ids: list[int], n: int, **kw):
    return alone(ids, SamplingParams(max_tokens=n, **kw))


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as s:
        assert s.status_code == 200
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]


def test_several_prompts_and_mixed_ids(server):
    """A list of prompts gets a list of results in order, each the prompt generated alone; a list of
    ids and text is one prompt (the text's ids in place); streamed events carry their prompt's index."""
    greedy = {"n_predict": 8, "temperature": 0, "ignore_eos": True}
    prompts = ["hello there", [5, 6, 7, 8, 9], [11, 12, "abc", 13]]
    wanted = [ids_of("hello there"), [5, 6, 7, 8, 9], [11, 12, *ids_of("abc"), 13]]
    refs = [ref(ids, 8, temperature=0, ignore_eos=True) for ids in wanted]
    results = post(server, "/completion", {**greedy, "prompt": prompts}).json()
    assert isinstance(results, list) and [r["index"] for r in results] == [0, 1, 2]
    assert [r["content"] for r in results] == [r.text for r in refs]
    assert [r["tokens_evaluated"] for r in results] == [len(ids) for ids in wanted]
    assert all(r["tokens_predicted"] == 8 and r["stop_type"] == "limit" for r in results)
    one = post(server, "/completion", {**greedy, "prompt": prompts[2]}).json()
    assert isinstance(one, dict) and one["content"] == refs[2].text and one["index"] == 0
    for listed in (["hello there"], [[5, 6, 7, 8, 9]]):  # a list of one prompt: one result, an object
        assert post(server, "/completion", {**greedy, "prompt": listed}).json()["content"] == refs[
            0 if isinstance(listed[0], str) else 1].text
    streamed = events(server, "/completion", {**greedy, "prompt": prompts})
    for i, r in enumerate(refs):
        mine = [e for e in streamed if e["index"] == i]
        assert "".join(e["content"] for e in mine) == r.text
        assert [t for e in mine for t in e["tokens"]] == r.generated  # stream events carry their ids
        assert mine[-1]["stop"] is True and all(e["stop"] is False for e in mine[:-1])
    for bad in ({"prompt": [[5, 6], 7]}, {"prompt": ["x"] * 17}, {"prompt": [[]]}, {"prompt": [5, VOCAB]},
                {"prompt": [["a", VOCAB]]}):
        assert post(server, "/completion", {**greedy, **bad}).status_code == 400, bad
    over = post(server, "/completion", {**greedy, "prompt": ["x", [5] * 5000]})  # the one that does not fit, named
    assert over.status_code == 400 and over.json()["error"]["message"].startswith("prompt 1 (of 2, counted from 0)")
    bad_budget = post(server, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": -1}).json()["error"]
    assert not bad_budget["message"].startswith("prompt")  # (the request's own: no prompt to blame)


def test_n_probs_and_return_tokens(server):
    """n_probs: each generated token's logprob and its N most likely alternatives, the same figures
    as /v1/completions' logprobs (the model's raw logits); return_tokens: the generated ids."""
    body = {"prompt": "score me", "n_predict": 10, "temperature": 0, "ignore_eos": True, "n_probs": 3,
            "return_tokens": True}
    r = ref(ids_of("score me"), 10, temperature=0, ignore_eos=True, logprobs=3)
    out = post(server, "/completion", body).json()
    assert out["tokens"] == r.generated
    probs = out["completion_probabilities"]
    assert [p["id"] for p in probs] == r.generated
    assert [p["logprob"] for p in probs] == pytest.approx([t.logprob for t in r.logprobs], abs=1e-6)
    tok = ChatToyTokenizer(VOCAB)
    for p, t in zip(probs, r.logprobs):
        assert p["token"] == tok.piece(p["id"]) and p["bytes"] == list(p["token"].encode())
        assert [a["id"] for a in p["top_logprobs"]] == [a for a, _ in t.top] and len(p["top_logprobs"]) == 3
        assert p["top_logprobs"][0]["id"] == p["id"]  # greedy: the most likely token was chosen
    streamed = events(server, "/completion", body)
    assert [p for e in streamed if not e["stop"] for p in e["completion_probabilities"]] == probs
    assert "completion_probabilities" not in post(server, "/completion", {**body, "n_probs": 0}).json()
    assert post(server, "/completion", {**body, "return_tokens": False}).json()["tokens"] == []
    for bad in ({"n_probs": -1}, {"n_probs": 21}, {"post_sampling_probs": True}, {"n_probs": "3"}):
        assert post(server, "/completion", {**body, **bad}).status_code == 400, bad


def test_logit_bias_forms(server):
    """llama.cpp's logit_bias: [id, bias] pairs, [text, bias] (every token of the text), false to
    ban, or an object; the reply equals the plain engine's under the same biases."""
    greedy = {"prompt": "again again", "n_predict": 5, "temperature": 0, "ignore_eos": True}
    first = ref(ids_of("again again"), 5, temperature=0, ignore_eos=True).generated[0]
    banned = ref(ids_of("again again"), 5, temperature=0, ignore_eos=True, logit_bias={first: -100.0})
    assert banned.generated[0] != first
    for bias in ([[first, False]], [[first, -100]], {str(first): False}, [[chr(first), False]]):
        out = post(server, "/completion", {**greedy, "logit_bias": bias}).json()
        assert out["content"] == banned.text, bias
    two = ids_of("ab")  # text: each of its tokens gets the bias
    both = ref(ids_of("again again"), 5, temperature=0, ignore_eos=True, logit_bias={t: 7.5 for t in two})
    assert post(server, "/completion", {**greedy, "logit_bias": [["ab", 7.5]]}).json()["content"] == both.text
    for bad in ([[first, 1, 2]], [[first, "x"]], [[first, True]], [[first, 500]], [[VOCAB, 1.0]], {"x": "y"}):
        assert post(server, "/completion", {**greedy, "logit_bias": bad}).status_code == 400, bad


def test_repeat_penalty_over_the_last_n_tokens(server):
    """``repeat_penalty`` looks back ``repeat_last_n`` tokens (64 by default, -1: all, 0: off), as the
    plain engine's ``repetition_last_n`` does."""
    prompt = "abcabcabcabcabcabcabcabc"
    body = {"prompt": prompt, "n_predict": 12, "temperature": 0, "ignore_eos": True, "repeat_penalty": 1.8}
    for last_n, want in ((3, dict(repetition_penalty=1.8, repetition_last_n=3)),
                         (None, dict(repetition_penalty=1.8, repetition_last_n=64)),
                         (-1, dict(repetition_penalty=1.8)), (0, {})):
        expected = ref(ids_of(prompt), 12, temperature=0, ignore_eos=True, **want).text
        sent = body if last_n is None else {**body, "repeat_last_n": last_n}
        assert post(server, "/completion", sent).json()["content"] == expected, last_n
    assert ref(ids_of(prompt), 12, temperature=0, ignore_eos=True, repetition_penalty=1.8, repetition_last_n=3).text \
        != ref(ids_of(prompt), 12, temperature=0, ignore_eos=True, repetition_penalty=1.8).text  # the window acts
    assert post(server, "/completion", {**body, "repeat_last_n": -2}).status_code == 400


def test_props_and_apply_template(server):
    props = httpx.get(server.url + "/props", timeout=30).json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == MAX_LEN and settings["speculative"] is True
    assert settings["params"]["temperature"] == 0.8 and settings["params"]["top_k"] == 40
    assert props["total_slots"] == 16 and props["model_alias"] == NAME and props["model_path"] == "/models/tiny.gguf"
    assert httpx.get(server.url + "/v1/health", timeout=30).json() == {"status": "ok"}
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    tok = ChatToyTokenizer(VOCAB)
    out = post(server, "/apply-template", {"messages": messages}).json()
    assert out == {"prompt": tok.apply_chat_template(messages)}
    out = post(server, "/apply-template", {"messages": messages, "add_generation_prompt": False}).json()
    assert out["prompt"] == tok.apply_chat_template(messages, add_generation_prompt=False)
    # the rendered prompt sent to /completion gives the chat endpoint's reply
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": NAME, "messages": messages, "max_tokens": 6, "temperature": 0}).json()
    done = post(server, "/completion", {"prompt": tok.apply_chat_template(messages), "n_predict": 6,
                                        "temperature": 0}).json()
    assert done["content"] == chat["choices"][0]["message"]["content"]
    for bad in ({}, {"messages": []}, {"messages": [{"role": "robot", "content": "x"}]}, {"messages": "hi"}):
        assert post(server, "/apply-template", bad).status_code == 400, bad
    assert post(server, "/apply-template", {"model": "other", "messages": messages}).status_code == 404


def test_tokenize_add_special():
    """vLLM's /tokenize adds the model's special tokens by default (add_special_tokens); llama.cpp's
    does not (add_special), and a "content" request takes llama.cpp's default."""
    engine = paged_engine()
    engine.tokenizer = BosToyTokenizer(VOCAB)
    with LiveServer(create_app(engine, ServerConfig(model_name=NAME, scheduler=SchedulerConfig(log_interval=0)))) as s:
        plain = ids_of("hello")
        for body, want in (({"prompt": "hello"}, [BOS, *plain]), ({"content": "hello"}, plain),
                           ({"content": "hello", "add_special": True}, [BOS, *plain]),
                           ({"prompt": "hello", "add_special_tokens": False}, plain),
                           ({"prompt": "hello", "add_special": False}, plain)):
            assert post(s, "/tokenize", body).json()["tokens"] == want, body
        bad = post(s, "/tokenize", {"prompt": "x", "add_special": True, "add_special_tokens": False})
        assert bad.status_code == 400
        # /completion: a BOS before a prompt that starts with text, none before text between ids
        greedy = {"n_predict": 4, "temperature": 0, "ignore_eos": True}
        assert post(s, "/completion", {**greedy, "prompt": "ab"}).json()["tokens_evaluated"] == 3
        assert post(s, "/completion", {**greedy, "prompt": [7, "ab"]}).json()["tokens_evaluated"] == 3


class SpecialToyTokenizer(BosToyTokenizer):
    """BOS spelled "<s>": in text it is the token (unless parse_special is off), decoding skips it
    unless asked to keep special tokens."""

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        parts = text.split("<s>") if parse_special else [text]
        ids = super().encode(parts[0], add_special_tokens)
        for part in parts[1:]:
            ids += [BOS] + super().encode(part, False)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if i == BOS and skip_special_tokens else "<s>" if i == BOS else self.piece(i) for i in ids)

    def token_bytes(self, i: int) -> bytes:
        return b"<s>" if i == BOS else super().token_bytes(i)


def test_special_tokens_through_tokenize_and_detokenize():
    """/detokenize spells special tokens, as vLLM's and llama.cpp's do (so does echo of a token-id prompt);
    llama.cpp's with_pieces spells each token; parse_special false reads "<s>" as text."""
    engine = paged_engine()
    engine.tokenizer = SpecialToyTokenizer(VOCAB)
    with LiveServer(create_app(engine, ServerConfig(model_name=NAME, scheduler=SchedulerConfig(log_interval=0)))) as s:
        ids = [BOS, *ids_of("hi")]
        assert post(s, "/detokenize", {"tokens": ids}).json()["content"] == "<s>" + engine.tokenizer.decode(ids[1:])
        pieces = post(s, "/tokenize", {"content": "<s>hi", "with_pieces": True}).json()["tokens"]
        assert pieces == [{"id": BOS, "piece": "<s>"}] + [{"id": t, "piece": engine.tokenizer.piece(t)}
                                                           for t in ids_of("hi")]
        assert post(s, "/tokenize", {"content": "<s>hi", "parse_special": False}).json()["tokens"] == ids_of("<s>hi")
        echo = post(s, "/v1/completions", {"prompt": ids, "max_tokens": 1, "echo": True, "temperature": 0}).json()
        assert echo["choices"][0]["text"].startswith("<s>" + engine.tokenizer.decode(ids[1:])), echo


def test_n_cmpl_completions_of_each_prompt(server):
    """n_cmpl: that many completions of each prompt, prompt by prompt; seeded ones at choice_seed(seed, i),
    each equal to its prompt sampled alone with that seed."""
    from tokenleap.spec.seeded import choice_seed
    body = {"prompt": ["hello there", [5, 6, 7]], "n_predict": 6, "seed": 3, "n_cmpl": 2, "ignore_eos": True}
    out = post(server, "/completion", body).json()
    sampled = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, ignore_eos=True, temperature_last=True)
    want = [ref(ids, 6, seed=choice_seed(3, c), **sampled).text for ids in (ids_of("hello there"), [5, 6, 7]) for c in range(2)]
    assert [r["index"] for r in out] == [0, 1, 2, 3] and [r["content"] for r in out] == want
    one = post(server, "/completion", {**body, "prompt": "hello there"}).json()
    assert [r["content"] for r in one] == want[:2]
    for bad in (0, 17, "2"):
        assert post(server, "/completion", {**body, "n_cmpl": bad}).status_code == 400, bad


def test_completion_samples_in_llama_cpps_order(server):
    """/completion filters the model's own distribution (top-k, top-p, min-p) and applies the temperature
    last, as llama.cpp's default sampler chain does; /v1/completions keeps the temperature first unless
    asked (temperature_last)."""
    hot = dict(temperature=3.0, min_p=0.3, top_k=0, top_p=1.0, seed=11, ignore_eos=True)
    ids = ids_of("hello there")
    last, first = (ref(ids, 12, temperature_last=b, **hot).text for b in (True, False))
    assert last != first
    body = {"prompt": "hello there", "n_predict": 12, **hot}
    assert post(server, "/completion", body).json()["content"] == last
    v1 = {"model": NAME, "prompt": "hello there", "max_tokens": 12, **hot}
    assert post(server, "/v1/completions", v1).json()["choices"][0]["text"] == first
    assert post(server, "/v1/completions", {**v1, "temperature_last": True}).json()["choices"][0]["text"] == last


def test_llama_cpps_readings_of_edge_values(server):
    """n_predict past the context runs to its end ("limit"); a temperature below 0 is greedy (llama.cpp's
    way to get n_probs with greedy tokens), top_p 0 keeps the most likely token, top_k <= 0 is off."""
    ids = ids_of("hello there")
    whole = post(server, "/completion", {"prompt": "hello there", "n_predict": 10**6, "temperature": 0,
                                         "ignore_eos": True}).json()
    assert whole["stop_type"] == "limit" and whole["tokens_predicted"] == MAX_LEN - len(ids)
    greedy = ref(ids, 6, temperature=0, ignore_eos=True).text
    for extra in ({"temperature": -1, "n_probs": 2}, {"temperature": 0.8, "top_p": 0, "seed": 4}):
        r = post(server, "/completion", {"prompt": "hello there", "n_predict": 6, "ignore_eos": True, **extra})
        assert r.status_code == 200 and r.json()["content"] == greedy, (extra, r.text)
    hot = dict(temperature=0.8, top_p=0.95, min_p=0.05, seed=9, ignore_eos=True, temperature_last=True)
    r = post(server, "/completion", {"prompt": "hello there", "n_predict": 6, "top_k": -5, **hot})
    assert r.json()["content"] == ref(ids, 6, top_k=0, **hot).text


def test_slots_show_the_requests_running():
    """/slots: total_slots entries; a running request's slot is processing, with its limit and the
    tokens decoded so far; fail_on_no_slot is a 503 only when every slot is busy."""
    import time

    engine = paged_engine()
    step = engine.step

    def slow_step(*args, **kwargs):  # 0.1 s a token: the requests are still running below
        time.sleep(0.1)
        return step(*args, **kwargs)
    engine.step = slow_step
    config = ServerConfig(model_name=NAME, scheduler=SchedulerConfig(max_num_seqs=2, log_interval=0))
    with LiveServer(create_app(engine, config)) as s:
        idle = httpx.get(s.url + "/slots", timeout=30).json()
        assert [(e["id"], e["is_processing"]) for e in idle] == [(0, False), (1, False)]
        body = {"prompt": "hello there", "n_predict": 60, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/completion", json=body, timeout=60) as stream:
            lines = stream.iter_lines()  # (kept: a dropped line iterator closes the stream)
            next(line for line in lines if line.startswith("data: "))
            busy = httpx.get(s.url + "/slots", timeout=30).json()
            assert busy[0]["is_processing"] and not busy[1]["is_processing"]
            assert busy[0]["params"]["n_predict"] == 60 and busy[0]["params"]["temperature"] == 0
            assert 1 <= busy[0]["next_token"]["n_decoded"] < 60 and busy[0]["n_ctx"] == MAX_LEN
            assert httpx.get(s.url + "/slots?fail_on_no_slot=1", timeout=30).status_code == 200  # one is free
            with httpx.stream("POST", s.url + "/completion", json=body, timeout=60) as second:
                more = second.iter_lines()
                next(line for line in more if line.startswith("data: "))
                full = httpx.get(s.url + "/slots?fail_on_no_slot=1", timeout=30)
                assert full.status_code == 503 and "no slot" in full.json()["error"]["message"]


def test_version_and_ping(server):
    """vLLM's probes: the version, and 200 while the scheduler runs."""
    from tokenleap import __version__
    assert httpx.get(server.url + "/version", timeout=30).json() == {"version": __version__}
    assert httpx.get(server.url + "/ping", timeout=30).status_code == 200
    assert httpx.post(server.url + "/ping", timeout=30).status_code == 200


def test_max_tokens_names_n_predict_and_unserved_samplers_are_refused(server):
    """llama.cpp takes OpenAI's max_tokens for n_predict (n_predict first where both are given); its
    samplers this server does not run are a 400 unless left at their neutral values."""
    body = {"prompt": "hello", "temperature": 0, "ignore_eos": True}
    r = post(server, "/completion", {**body, "max_tokens": 5}).json()
    assert r["tokens_predicted"] == 5 and r["content"] == ref(ids_of("hello"), 5, temperature=0, ignore_eos=True).text
    assert post(server, "/completion", {**body, "max_tokens": 5, "n_predict": 3}).json()["tokens_predicted"] == 3
    neutral = {"typical_p": 1.0, "mirostat": 0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "dynatemp_range": 0.0,
               "top_n_sigma": -1.0}
    assert post(server, "/completion", {**body, "n_predict": 2, **neutral}).status_code == 200
    for name, value in (("typical_p", 0.5), ("mirostat", 2), ("dry_multiplier", 0.8), ("xtc_probability", 0.5),
                        ("dynatemp_range", 0.5), ("top_n_sigma", 1.0)):
        r = post(server, "/completion", {**body, "n_predict": 2, name: value})
        assert r.status_code == 400 and name in r.json()["error"]["message"], name


def test_llama_cpps_routes_answer_errors_in_its_form(server):
    """/completion and /infill: llama.cpp's error object (``code`` the HTTP status; a prompt over the context
    its own type); /v1/completions keeps OpenAI's."""
    bad = post(server, "/completion", {"n_predict": 2})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == 400, bad.text
    assert bad.json()["error"]["type"] == "invalid_request_error" and bad.json()["error"]["message"]
    long = post(server, "/completion", {"prompt": [5] * (MAX_LEN + 4), "n_predict": 2})
    assert long.status_code == 400 and long.json()["error"]["type"] == "exceed_context_size_error", long.text
    assert post(server, "/infill", {"input_prefix": 3}).json()["error"]["code"] == 400
    openai = post(server, "/v1/completions", {"prompt": [5] * (MAX_LEN + 4), "max_tokens": 2}).json()["error"]
    assert openai["code"] == "context_length_exceeded" and openai["type"] == "invalid_request_error"
