"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/embed``, the model routes), exercised with the
official ``ollama`` client against a real uvicorn server on a tiny model with speculation on: a reply
equals the same prompt run alone with Ollama's sampling defaults, streamed or not; tool calls and
thinking come back in Ollama's fields (a scripted model writes them); errors take Ollama's form."""
from __future__ import annotations

import dataclasses

import httpx
import ollama
import pytest
import torch

from tokenleap.config import SamplingParams
from tokenleap.serve.app import ServerConfig, create_app
from tokenleap.serve.context_window import fit_turns
from tokenleap.serve.ollama_api import ChatBody, GenerateBody, chat_request, fit_window, generate_request
from tokenleap.serve.chat_render import chat_messages, chat_options
from tokenleap.serve.protocol import APIError, sampling_params
from tokenleap.serve.scheduler import SchedulerConfig

from serving_helpers import MAX_LEN, VOCAB, ChatToyTokenizer, LiveServer, alone, paged_engine
from test_reasoning import thinking  # noqa: F401 (the fixture: a scripted thinking model)

NAME = "tiny-qwen2"
# Ollama's defaults for options a request leaves out
DEFAULTS = dict(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.1, repetition_last_n=64)


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(model_name=NAME, model_aliases=("/models/tiny.gguf",), embeddings="mean",
                          scheduler=SchedulerConfig(log_interval=0))
    with LiveServer(create_app(paged_engine("ngram"), config)) as s:
        yield s


def client(server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=180)


def chat_reference(messages: list[dict], **kw):
    tok = ChatToyTokenizer(VOCAB)
    prompt = tok.encode(tok.apply_chat_template(messages))
    return prompt, alone(prompt, SamplingParams(**kw))


def test_a_chat_reply_equals_the_conversation_run_alone(server):
    c = client(server)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    r = c.chat(model=NAME, messages=messages, options={"temperature": 0, "num_predict": 9})
    prompt, ref = chat_reference(messages, max_tokens=9, temperature=0, **{k: v for k, v in DEFAULTS.items()
                                                                          if k.startswith("rep")})
    assert r.model == NAME + ":latest" and r.done and r.message.role == "assistant"
    assert r.message.content == ref.text and r.done_reason == ("length" if ref.finish_reason == "length" else "stop")
    assert (r.prompt_eval_count, r.eval_count) == (len(prompt), ref.num_generated)
    assert r.total_duration >= r.prompt_eval_duration > 0 and r.eval_duration >= 0 and r.load_duration == 0
    parts = list(c.chat(model=NAME, messages=messages, options={"temperature": 0, "num_predict": 9}, stream=True))
    assert "".join(p.message.content for p in parts) == ref.text
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and parts[-1].eval_count == r.eval_count
    # Ollama's defaults where options are left out: sampling at 0.8 / top_k 40 / top_p 0.9 with a 1.1
    # repeat penalty over the last 64 tokens -- seeded, so token for token the same as alone
    r = c.chat(model=NAME + ":latest", messages=messages, options={"seed": 11, "num_predict": 12})
    _, ref = chat_reference(messages, max_tokens=12, seed=11, **DEFAULTS)
    assert r.message.content == ref.text
    _, unpenalized = chat_reference(messages, max_tokens=12, seed=11, **{**DEFAULTS, "repetition_penalty": 1.0})
    r = c.chat(model=NAME, messages=messages, options={"seed": 11, "num_predict": 12, "repeat_last_n": 0})
    assert r.message.content == unpenalized.text  # repeat_last_n 0: no penalty


def test_generate_continues_its_context_and_stops_where_asked(server):
    c = client(server)
    tok = ChatToyTokenizer(VOCAB)
    r = c.generate(model=NAME, prompt="abc", raw=True, options={"temperature": 0, "num_predict": 10})
    ref = alone(tok.encode("abc"), SamplingParams(max_tokens=10, repetition_penalty=1.1, repetition_last_n=64))
    assert r.response == ref.text and r.context == tok.encode("abc") + ref.generated
    # the next turn: the earlier context, then the new prompt
    more = c.generate(model=NAME, prompt="de", context=r.context, options={"temperature": 0, "num_predict": 6})
    ref2 = alone(r.context + tok.encode("de"), SamplingParams(max_tokens=6, repetition_penalty=1.1,
                                                              repetition_last_n=64))
    assert more.response == ref2.text and more.prompt_eval_count == len(r.context) + 2
    stop = ref.text[3:5]
    cut = c.generate(model=NAME, prompt="abc", options={"temperature": 0, "num_predict": 10, "stop": [stop]})
    assert cut.response == ref.text[:ref.text.find(stop)] and cut.done_reason == "stop"
    # its context holds the text returned, not the stop string's tokens (as Ollama's), streamed or not
    assert cut.context[cut.prompt_eval_count:] == tok.encode(cut.response)
    cut_lines = list(c.generate(model=NAME, prompt="abc", stream=True,
                                options={"temperature": 0, "num_predict": 10, "stop": [stop]}))
    assert cut_lines[-1].context == cut.context
    streamed = list(c.generate(model=NAME, prompt="abc", stream=True, options={"temperature": 0, "num_predict": 10}))
    assert "".join(p.response for p in streamed) == ref.text and streamed[-1].context == r.context
    # nothing to generate from: the model is loaded, as Ollama answers it
    assert c.generate(model=NAME).done_reason == "load" and c.chat(model=NAME, messages=[]).done_reason == "load"
    assert c.generate(model=NAME, keep_alive=0).done_reason == "unload"


def test_a_conversation_over_the_window_loses_its_oldest_turns(server):
    c = client(server)
    turns = [{"role": "system", "content": "be brief"}]
    for i in range(6):
        turns += [{"role": "user", "content": f"question {i} " + "q" * 12}, {"role": "assistant", "content": "a" * 14}]
    turns.append({"role": "user", "content": "and the last one?"})
    tok = ChatToyTokenizer(VOCAB)
    length = lambda messages: len(tok.encode(tok.apply_chat_template(messages)))  # noqa: E731
    assert length(turns) > 300
    # num_ctx 100: the system message, then the latest turns that fit with room for the reply
    r = c.chat(model=NAME, messages=turns, options={"temperature": 0, "num_ctx": 100, "num_predict": 6})
    kept = next(turns[:1] + turns[i:] for i in range(1, len(turns), 2) if length(turns[:1] + turns[i:]) < 100)
    assert kept != turns and kept[-1] == turns[-1]
    prompt, ref = chat_reference(kept, max_tokens=6, temperature=0, repetition_penalty=1.1, repetition_last_n=64)
    assert r.prompt_eval_count == len(prompt) and r.message.content == ref.text
    # without num_predict the reply may fill the window's room, and no more
    r = c.chat(model=NAME, messages=kept, options={"temperature": 0, "num_ctx": len(prompt) + 3})
    assert r.eval_count <= 3 and (r.eval_count < 3 or r.done_reason == "length")
    # truncate false, or a last message over the window with num_keep -1 (nothing to cut): a 400
    for body in ({"messages": turns, "options": {"num_ctx": 100}, "truncate": False},
                 {"messages": turns[-1:], "options": {"num_ctx": 10, "num_keep": -1}},
                 {"messages": turns[-1:], "options": {"num_ctx": 10}, "truncate": False},
                 {"messages": turns, "options": {"num_ctx": 0}}):
        r = httpx.post(f"{server.url}/api/chat", json={"model": NAME, "stream": False, **body}, timeout=30)
        assert r.status_code == 400 and "num_ctx" in r.json()["error"], r.text
    # generate: the oldest tokens of the context go
    context = tok.encode("0123456789" * 8)
    r = c.generate(model=NAME, prompt="abc", raw=True, context=context,
                   options={"temperature": 0, "num_ctx": 60, "num_predict": 4})
    cut = context[len(context) + 3 + 1 - 60:] + tok.encode("abc")
    assert r.prompt_eval_count == len(cut) == 59
    assert r.response == alone(cut, SamplingParams(max_tokens=1, repetition_penalty=1.1, repetition_last_n=64)).text


def test_a_message_over_the_window_keeps_its_first_tokens_and_its_end(server):
    """As Ollama's runner cuts a prompt over ``num_ctx``: its first ``num_keep`` tokens (4 by default)
    and its end, to half the window, or to the window less ``num_predict`` where that is more."""
    c, tok = client(server), ChatToyTokenizer(VOCAB)
    turn = [{"role": "user", "content": "tell me about " + "abcdefgh" * 12 + " in short"}]
    ids = tok.encode(tok.apply_chat_template(turn, add_generation_prompt=True))
    assert len(ids) > 100
    greedy = SamplingParams(max_tokens=1, repetition_penalty=1.1, repetition_last_n=64)
    for options, cut in (({"num_ctx": 40}, ids[:4] + ids[-18:]),  # 4 + (40 - 4) // 2
                         ({"num_ctx": 40, "num_keep": 10}, ids[:10] + ids[-15:]),
                         ({"num_ctx": 40, "num_predict": 5}, ids[:4] + ids[-31:]),  # 40 - 5
                         ({"num_ctx": 40, "num_predict": 30}, ids[:4] + ids[-18:])):  # half still
        r = c.chat(model=NAME, messages=turn, options={"temperature": 0, **options})
        assert r.prompt_eval_count == len(cut), options
        budget = min(options.get("num_predict", 40), 40 - len(cut))  # (the reply stops at the window)
        ref = alone(cut, dataclasses.replace(greedy, max_tokens=budget))
        assert r.message.content == ref.text and r.eval_count == len(ref.generated), options
    # generate cuts its prompt the same way; truncate false keeps it whole, so a 400
    raw = tok.encode("0123456789" * 10)
    r = c.generate(model=NAME, prompt="0123456789" * 10, raw=True,
                   options={"temperature": 0, "num_ctx": 50, "num_predict": 3})
    assert r.prompt_eval_count == 47 and r.context[:47] == raw[:4] + raw[-43:]
    r = httpx.post(f"{server.url}/api/generate", json={"model": NAME, "prompt": "0123456789" * 10, "raw": True,
                                                        "stream": False, "truncate": False,
                                                        "options": {"num_ctx": 50}}, timeout=30)
    assert r.status_code == 400 and "num_ctx" in r.json()["error"], r.text


def test_more_num_keep_never_keeps_fewer_tokens():
    ids = list(range(100))
    cut = {keep: fit_window(GenerateBody(model=NAME, options={"num_keep": keep}), ids, 10) for keep in range(0, 14)}
    assert cut[4] == ids[:4] + ids[-3:] and cut[9] == cut[13] == ids[:8] + ids[-1:]
    assert all(len(cut[k]) <= len(cut[k + 1]) for k in range(13)) and all(c[-1] == 99 for c in cut.values())
    assert fit_window(GenerateBody(model=NAME, options={"num_keep": -1}), ids, 10) == ids  # (then a 400)


def test_fit_turns_keeps_the_system_message_and_the_latest_turns():
    encode = lambda ms: [0] * sum(len(m["content"]) for m in ms)  # noqa: E731 (a token a character)
    turns = [{"role": "system", "content": "S" * 10}, {"role": "user", "content": "u" * 20},
             {"role": "assistant", "content": "a" * 20}, {"role": "user", "content": "v" * 20},
             {"role": "assistant", "content": "b" * 20}, {"role": "user", "content": "w" * 5}]
    assert fit_turns(turns, encode, 95) == (turns, [0] * 95)  # everything fits: unchanged
    kept, ids = fit_turns(turns, encode, 94)  # the first turn goes: system, then from the 2nd user
    assert kept == turns[:1] + turns[3:] and len(ids) == 55
    assert fit_turns(turns, encode, 54)[0] == [turns[0], turns[-1]]  # system and the last message
    assert len(fit_turns(turns, encode, 9)[1]) == 15  # nothing fits: the shortest (a 400 for the caller)
    # a system message anywhere stays
    mid = turns[:3] + [{"role": "system", "content": "T" * 3}] + turns[3:]
    assert len(fit_turns(mid, encode, 59)[1]) == 58


def test_logprobs_come_with_each_token(server):
    c = client(server)
    r = c.chat(model=NAME, messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2,
               options={"temperature": 0, "num_predict": 5})
    assert len(r.logprobs) == r.eval_count == 5
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in r.logprobs)
    assert "".join(e.token for e in r.logprobs) == r.message.content
    assert r.logprobs[0].logprob == max(t.logprob for t in r.logprobs[0].top_logprobs)  # greedy: the likeliest


def test_the_model_routes_describe_the_served_model(server):
    c = client(server)
    [m] = c.list().models
    assert m.model == NAME + ":latest" and m.details.family == "qwen2" and m.details.format == "gguf"
    assert m.size > 0 and len(m.digest) == 64 and m.details.quantization_level == "F32"
    shown = c.show(NAME)
    assert shown.modelinfo["qwen2.context_length"] == MAX_LEN and "embedding" in shown.capabilities
    assert shown.modelinfo["general.parameter_count"] > 0 and "tools" not in shown.capabilities
    [running] = c.ps().models
    assert running.model == m.model and running.context_length == MAX_LEN
    assert httpx.get(server.url + "/api/version").json()["version"]
    assert httpx.get(server.url + "/").text == "tokenleap is running"
    assert httpx.head(server.url + "/").status_code == 200
    assert c.pull(NAME).status == "success"
    with pytest.raises(ollama.ResponseError) as e:
        c.pull("llama3.2")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        c.delete(NAME)
    assert e.value.status_code == 501 and "cannot create" in e.value.error


def test_embeddings_are_the_openai_routes_vectors(server):
    c = client(server)
    texts = ["some text", "other words here"]
    got = c.embed(model=NAME, input=texts).embeddings
    want = httpx.post(server.url + "/v1/embeddings", json={"input": texts}, timeout=60).json()["data"]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w["embedding"]))
    raw = torch.tensor(c.embeddings(model=NAME, prompt="some text").embedding)  # the older route: not normalized
    torch.testing.assert_close(raw / raw.norm(), torch.tensor(got[0]), rtol=1e-4, atol=1e-5)
    assert abs(float(raw.norm()) - 1) > 1e-3
    long = "x" * (MAX_LEN + 20)
    assert len(c.embed(model=NAME, input=long).embeddings) == 1  # truncated by default, as Ollama does
    with pytest.raises(ollama.ResponseError, match="maximum context length"):
        c.embed(model=NAME, input=long, truncate=False)


def test_errors_take_ollamas_form(server):
    c = client(server)
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="llama3.2", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404 and NAME in e.value.error
    # names match whatever their case, as Ollama's do (the reply names the model as served)
    assert c.chat(model=NAME.upper() + ":Latest", messages=[{"role": "user", "content": "x"}],
                  options={"num_predict": 1}).model == NAME + ":latest"
    user = [{"role": "user", "content": "x"}]
    for path, body, words in (
            ("chat", {"messages": user, "options": {"mirostat": 2}}, "mirostat"),
            ("chat", {"messages": user, "options": {"typical_p": 0.5}}, "typical_p"),
            ("chat", {"messages": [{"role": "user", "content": "x", "images": ["AAAA"]}]}, "text only"),
            ("chat", {"messages": [{"role": "robot", "content": "x"}]}, "role"),
            ("chat", {"messages": ["hi"]}, "messages.0"),
            ("chat", {"messages": user, "tools": ["get_weather"]}, "tools.0"),
            ("chat", {"messages": user, "tools": [{"type": "function"}]}, "tools.0 must be"),
            ("chat", {"messages": user, "format": "yaml"}, "format"),
            ("chat", {"messages": user, "think": "very"}, "think"),
            ("chat", {"messages": user, "options": {"num_predict": 0}}, "num_predict"),
            ("chat", {"messages": user, "options": {"repeat_last_n": -5}}, "repeat_last_n"),
            ("chat", {"messages": user, "options": {"temperature": "hot"}}, "temperature"),
            ("generate", {"prompt": "x", "template": "{{ .Prompt }}"}, "Go templates"),
            ("generate", {"prompt": "x", "images": ["AAAA"]}, "text only"),
            ("generate", {"prompt": "x", "think": "very"}, "think"),
            ("chat", {"messages": user, "think": True}, '" does not support thinking'),  # (as Ollama)
            ("generate", {"prompt": "x", "think": "high"}, '" does not support thinking'),
            ("generate", {"prompt": "x" * (MAX_LEN + 1), "truncate": False}, "maximum context length"),
            ("generate", {"prompt": "x", "suffix": "y"}, "fill-in-the-middle")):
        r = httpx.post(f"{server.url}/api/{path}", json={"model": NAME, "stream": False, **body}, timeout=30)
        assert r.status_code == 400 and list(r.json()) == ["error"] and words in r.json()["error"], (body, r.text)
    r = httpx.post(server.url + "/api/chat", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    # the OpenAI routes keep OpenAI's form
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 0}, timeout=30)
    assert r.status_code == 400 and "param" in r.json()["error"]


def test_tool_calls_and_thinking_come_back_in_ollamas_fields(thinking):  # noqa: F811
    on, _ = thinking
    c = ollama.Client(host=on.url, timeout=180)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    r = c.chat(model="m", messages=[{"role": "user", "content": "q §"}], tools=tools, options={"temperature": 0})
    assert r.message.thinking == "I need the weather." and r.message.content == "" and r.done_reason == "stop"
    [call] = r.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", {"city": "Oslo"})
    parts = list(c.chat(model="m", messages=[{"role": "user", "content": "q §"}], tools=tools, stream=True,
                        options={"temperature": 0}))
    assert "".join(p.message.thinking or "" for p in parts) == "I need the weather."
    assert [p.message.tool_calls[0].function.arguments for p in parts if p.message.tool_calls] == [{"city": "Oslo"}]
    r = c.chat(model="m", messages=[{"role": "user", "content": "q ¤"}], options={"temperature": 0})
    assert (r.message.thinking, r.message.content) == ("Two and two.", "2 + 2 = 4.")
    # generate renders its prompt with the chat template, so a thinking model's block is split off too
    g = c.generate(model="m", prompt="q ¤", options={"temperature": 0})
    assert (g.thinking, g.response) == ("Two and two.", "2 + 2 = 4.")
    g = c.generate(model="m", prompt="q ¤", raw=True, options={"temperature": 0})
    assert g.thinking is None and g.response.startswith("<think>")


def test_ollama_bodies_become_chat_and_completion_requests():
    body = ChatBody.model_validate({"model": NAME, "messages": [
        {"role": "user", "content": "weather in Paris and Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"function": {"name": "get_time", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "12:00", "tool_name": "get_time"},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}],
        "think": True, "format": {"type": "object"}, "options": {"seed": -1, "num_predict": -1, "repeat_last_n": -1}})
    chat = chat_request(body)
    messages = chat_messages(chat)
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    calls = {c["function"]["name"]: c["id"] for c in messages[1]["tool_calls"]}
    assert [m.get("tool_call_id") for m in messages[2:]] == [calls["get_time"], calls["get_weather"]]
    assert chat_options(chat) == {"enable_thinking": True, "add_generation_prompt": True}
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == {"type": "object"}
    params = sampling_params(chat, 50, 0)
    assert params.seed is None and (params.repetition_penalty, params.repetition_last_n) == (1.1, 0)  # -1: all
    assert (params.temperature, params.top_k, params.top_p) == (0.8, 40, 0.9) and chat.max_tokens is None
    assert params.min_p_after_top_p  # (Ollama's sampler: top-k, temperature, top-p, then min-p)
    req = generate_request(GenerateBody.model_validate({"model": NAME, "prompt": "p", "format": "json",
                                                        "options": {"temperature": 0.2, "repeat_last_n": 0}}))
    params = sampling_params(req, 50, 0)
    assert params.repetition_penalty == 1.0 and params.temperature == 0.2 and req.response_format.type == "json_object"
    assert params.min_p_after_top_p
    params = sampling_params(generate_request(GenerateBody.model_validate({"model": NAME, "prompt": "p"})), 50, 0)
    assert (params.repetition_penalty, params.repetition_last_n, params.temperature) == (1.1, 64, 0.8)
    assert chat_options(chat_request(ChatBody.model_validate({"model": NAME, "messages": [], "think": False}))) == {
        "enable_thinking": False, "add_generation_prompt": True}
    # two calls of one function: their results answer them in order
    twice = chat_messages(chat_request(ChatBody.model_validate({"model": NAME, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}},
                                                            {"function": {"name": "f", "arguments": {"a": 2}}}]},
        {"role": "tool", "content": "one", "tool_name": "f"}, {"role": "tool", "content": "two", "tool_name": "f"}]})))
    assert [m["tool_call_id"] for m in twice[2:]] == [c["id"] for c in twice[1]["tool_calls"]]
    with pytest.raises(APIError, match="only assistant messages"):
        chat_request(ChatBody.model_validate({"model": NAME, "messages": [
            {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]}))
