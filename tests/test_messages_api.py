"""/v1/messages (Anthropic's Messages API), exercised with the official ``anthropic`` client against a
real uvicorn server on a tiny model: the reply equals the same conversation run alone, streamed or
not; tool calls come back as tool_use blocks (a scripted model writes them); what the server cannot
do is a 400 in Anthropic's error form."""
from __future__ import annotations

import json
import threading

import anthropic
import httpx
import pytest

from tokenleap.config import SamplingParams
from tokenleap.serve.messages_api import MessagesRequest, chat_request
from tokenleap.serve.chat_render import chat_messages, chat_options
from tokenleap.serve.protocol import APIError

from serving_helpers import VOCAB, ChatToyTokenizer, alone
from test_server import KEY, NAME, start
from test_tools import CALL, TOOLS, scripted  # noqa: F401 (scripted: the fixture)

WEATHER = [{"name": t["function"]["name"], "description": t["function"].get("description"),
            "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.fixture(scope="module")
def server():
    with start(api_key=KEY) as s:
        yield s


def client(server, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def reference(messages: list[dict], max_tokens: int, **kw):
    tok = ChatToyTokenizer(VOCAB)
    prompt = tok.encode(tok.apply_chat_template(messages))
    return prompt, alone(prompt, SamplingParams(max_tokens=max_tokens, **kw))


def test_a_reply_equals_the_conversation_run_alone(server):
    c = client(server)
    # (the client's own parameters have no sampling settings any more: they go in the body as extras)
    m = c.messages.create(model=NAME, max_tokens=9, system="be brief", extra_body={"temperature": 0},
                          messages=[{"role": "user", "content": "hello there"}])
    prompt, ref = reference([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}], 9)
    assert m.type == "message" and m.role == "assistant" and m.model == NAME and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == ref.text
    assert m.stop_reason == ("max_tokens" if ref.finish_reason == "length" else "end_turn") and m.stop_sequence is None
    assert (m.usage.input_tokens, m.usage.output_tokens) == (len(prompt), ref.num_generated)
    turns = [{"role": "user", "content": [{"type": "text", "text": "first "}, {"type": "text", "text": "question"}]},
             {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "x"},
                                               {"type": "text", "text": "an answer"}]},
             {"role": "user", "content": "more"}]
    m = c.messages.create(model=NAME, max_tokens=10, messages=turns, system=[{"type": "text", "text": "rules"}],
                          extra_body={"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 5})
    _, ref = reference([{"role": "system", "content": "rules"}, {"role": "user", "content": "first question"},
                        {"role": "assistant", "content": "an answer"}, {"role": "user", "content": "more"}],
                       10, temperature=0.8, top_p=0.9, top_k=20, seed=5)
    assert m.content[0].text == ref.text  # seeded sampling: the same tokens as the conversation run alone


def test_stream_events_give_the_same_message(server):
    c = client(server)
    kw = dict(model=NAME, max_tokens=12, messages=[{"role": "user", "content": "stream me"}])
    whole = c.messages.create(**kw, extra_body={"temperature": 0})
    with c.messages.stream(**kw, extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert (final.stop_reason, final.usage.output_tokens, final.usage.input_tokens) == (
        whole.stop_reason, whole.usage.output_tokens, whole.usage.input_tokens)
    with httpx.stream("POST", server.url + "/v1/messages", json={**kw, "stream": True, "temperature": 0},
                      headers={"x-api-key": KEY},
                      timeout=60) as r:
        kinds = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences_end_the_reply_and_are_named(server):
    c = client(server)
    messages = [{"role": "user", "content": "say something long"}]
    _, ref = reference(messages, 20, temperature=0, ignore_eos=True)
    at = next(i for i in range(1, len(ref.text) - 1) if ref.text.find(ref.text[i:i + 2]) == i)  # its first match
    stop = ref.text[at:at + 2]
    m = c.messages.create(model=NAME, max_tokens=20, stop_sequences=[stop], messages=messages,
                          extra_body={"temperature": 0, "ignore_eos": True})
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop and m.content[0].text == ref.text[:at]


def test_count_tokens_is_the_prompt_length(server):
    c = client(server)
    messages = [{"role": "user", "content": "how long is this?"}]
    prompt, _ = reference([{"role": "system", "content": "sys"}, *messages], 1)
    assert c.messages.count_tokens(model=NAME, system="sys", messages=messages).input_tokens == len(prompt)


def test_errors_take_anthropics_form(server):
    c = client(server)
    with pytest.raises(anthropic.AuthenticationError):
        client(server, "wrong").messages.create(model=NAME, max_tokens=3, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.NotFoundError):
        c.messages.create(model="claude-other", max_tokens=3, messages=[{"role": "user", "content": "x"}])
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    for body, words in (({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
                        ({"max_tokens": 3, "messages": [{"role": "user", "content": [image]}]}, "images"),
                        ({"max_tokens": 3, "messages": [{"role": "system", "content": "x"}]}, "system parameter"),
                        ({"max_tokens": 3, "messages": []}, "at least one message"),
                        ({"max_tokens": 3, "messages": [{"role": "user", "content": ""}]}, "non-empty content"),
                        ({"max_tokens": 3, "messages": [{"role": "user", "content": []}]}, "non-empty content"),
                        ({"max_tokens": 3, "messages": [{"role": "user", "content": "x"}], "temperature": 1.5},
                         "0 <= temperature <= 1"),
                        ({"max_tokens": 3, "messages": [{"role": "user", "content": "x"}],
                          "mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers"),
                        ({"max_tokens": 3, "messages": [{"role": "user", "content": "x"}], "container": "c_1"},
                         "container"),
                        ({"max_tokens": 3, "messages": [{"role": "user", "content": "x"}],
                          "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
                        ({"max_tokens": 10_000, "messages": [{"role": "user", "content": "x"}]}, "context length"),
                        ({"model": None, "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}, "model"),
                        ({"max_tokens": 3, "messages": [{"role": "user", "content": "x"}],
                          "tools": [{"name": "get_weather"}]}, "tools.0.input_schema"),
                        ({"max_tokens": 3, "messages": [{"role": "user", "content": [
                            {"type": "tool_result", "tool_use_id": "toolu_9", "content": "sunny"}]}]}, "toolu_9"),
                        ({"max_tokens": 3, "messages": [
                            {"role": "user", "content": "weather?"},
                            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "w",
                                                               "input": {}}]},
                            {"role": "user", "content": [
                                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "sunny"}]}]},
                         "no tool_use block in the previous message")):
        body = {"model": NAME, **body}
        if body["model"] is None:
            del body["model"]
        r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
        err = r.json()
        assert r.status_code == 400 and err["type"] == "error", err
        assert err["error"]["type"] == "invalid_request_error" and words in err["error"]["message"], err
    r = httpx.post(server.url + "/v1/messages", content=b"{not json", headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # the OpenAI routes keep OpenAI's form
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 0},
                   headers={"authorization": "Bearer " + KEY}, timeout=30)
    assert r.status_code == 400 and "param" in r.json()["error"]


def test_tool_use_and_tool_result_turns_become_the_chat_turns_of_a_call():
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "text", "text": "and tomorrow?"}]}]})
    chat = chat_request(req)
    messages = chat_messages(chat)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "user"]
    assert messages[1]["content"] == "Let me look." and messages[1]["tool_calls"] == [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"}
    assert chat_options(chat)["add_generation_prompt"] is True
    # consecutive turns of one role are one turn to Anthropic's API: results may be split over user turns
    use = [{"type": "tool_use", "id": f"toolu_{i}", "name": "w", "input": {}} for i in (1, 2)]
    result = [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": "ok"} for i in (1, 2)]
    for turns in ([{"role": "assistant", "content": use}, {"role": "user", "content": result[:1]},
                   {"role": "user", "content": result[1:]}],
                  [{"role": "assistant", "content": use[:1]}, {"role": "assistant", "content": use[1:]},
                   {"role": "user", "content": result}]):
        req = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": "weather?"}, *turns]})
        joined = chat_request(req).messages  # (one assistant turn with both calls, then both results)
        assert [m.role for m in joined] == ["user", "assistant", "tool", "tool"]
        assert [c.id for c in joined[1].tool_calls] == ["toolu_1", "toolu_2"]
        assert [m.tool_call_id for m in joined[2:]] == ["toolu_1", "toolu_2"]
    # a reply split over assistant turns (its thinking apart) and a user turn split from its results: one each
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "weather?"}, {"role": "assistant", "content": use[:1]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": ""}]},
        {"role": "user", "content": "here:"}, {"role": "user", "content": result[:1]}]})
    joined = chat_request(req).messages
    assert [(m.role, m.content) for m in joined] == [("user", "weather?"), ("assistant", ""), ("tool", "ok"),
                                                     ("user", "here:")]
    # a final assistant turn is continued (Anthropic's prefill)
    prefill = chat_request(MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]}))
    assert chat_options(prefill) == {"add_generation_prompt": False, "continue_final_message": True}
    # output_config.format: the reply follows a JSON schema, as response_format json_schema makes it
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    shaped = chat_request(MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "x"}], "output_config": {"format": {"type": "json_schema", "schema": schema}}}))
    assert shaped.response_format.type == "json_schema" and shaped.response_format.json_schema.schema_ == schema
    with pytest.raises(APIError, match="output_config.format must be"):
        chat_request(MessagesRequest.model_validate({"model": "m", "max_tokens": 5,
                                                     "messages": [{"role": "user", "content": "x"}],
                                                     "output_config": {"format": {"type": "xml"}}}))
    # the structured-outputs beta's spelling, output_format, is the same format
    beta = chat_request(MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "x"}], "output_format": {"type": "json_schema", "schema": schema}}))
    assert beta.response_format == shaped.response_format
    with pytest.raises(APIError, match="not both"):
        chat_request(MessagesRequest.model_validate({"model": "m", "max_tokens": 5,
                                                     "messages": [{"role": "user", "content": "x"}],
                                                     "output_format": {"type": "json_schema", "schema": schema},
                                                     "output_config": {"format": {"type": "json_schema",
                                                                                  "schema": schema}}}))
    with pytest.raises(APIError, match="output_format must be"):
        chat_request(MessagesRequest.model_validate({"model": "m", "max_tokens": 5,
                                                     "messages": [{"role": "user", "content": "x"}],
                                                     "output_format": {"type": "json_schema"}}))


def ask_scripted(server, mark: str, **kw):
    c = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    return c.messages.create(model="m", max_tokens=200, extra_body={"temperature": 0},
                             messages=[{"role": "user", "content": "weather? " + mark}], **kw)


def test_tool_calls_come_back_as_tool_use_blocks(scripted):  # noqa: F811
    server, tok = scripted
    m = ask_scripted(server, "§", tools=WEATHER)
    [block] = m.content
    assert block.type == "tool_use" and block.id.startswith("toolu_") and m.stop_reason == "tool_use"
    assert (block.name, block.input) == ("get_weather", {"city": "Paris"}) and tok.seen_tools[-1] == TOOLS
    m = ask_scripted(server, "¶", tools=WEATHER, tool_choice={"type": "auto"})
    assert [b.type for b in m.content] == ["text", "tool_use", "tool_use"] and m.content[0].text == "Sure."
    assert [(b.name, b.input) for b in m.content[1:]] == [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    m = ask_scripted(server, "§", tools=WEATHER, tool_choice={"type": "none"})
    assert m.content[0].text == CALL and m.stop_reason == "end_turn" and tok.seen_tools[-1] is not None
    c = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    with c.messages.stream(model="m", max_tokens=200, extra_body={"temperature": 0}, tools=WEATHER,
                           messages=[{"role": "user", "content": "weather? ¶"}]) as stream:
        pieces: dict[int, list[str]] = {}  # each tool_use block's input JSON, as it was written
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                pieces.setdefault(event.index, []).append(event.delta.partial_json)
        streamed = stream.get_final_message()
    assert sorted(pieces) == [1, 2] and all(len(p) > 1 for p in pieces.values())
    assert [json.loads("".join(pieces[i])) for i in (1, 2)] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in streamed.content] == [
        ("text", None, None), ("tool_use", "add", {"a": 1, "b": 2}), ("tool_use", "add", {"a": 3, "b": 4})]
    assert streamed.content[0].text == "Sure.\n" and streamed.stop_reason == "tool_use"
    with pytest.raises(anthropic.BadRequestError, match="not among the tools"):
        ask_scripted(server, "§", tools=WEATHER, tool_choice={"type": "tool", "name": "nope"})


def test_models_in_anthropics_form_for_its_client(server):
    c = client(server)
    page = c.models.list()
    assert [m.id for m in page.data] == [NAME] and page.data[0].type == "model" and page.has_more is False
    assert page.data[0].display_name == NAME and page.data[0].created_at.year >= 2024
    card = c.models.retrieve(NAME)
    assert card.id == NAME and card.type == "model"
    plain = httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}, timeout=30).json()
    assert plain["object"] == "list" and plain["data"][0]["object"] == "model"  # OpenAI's form otherwise


def test_any_tool_choice_allows_several_calls_unless_parallel_use_is_disabled():
    from tokenleap.serve.messages_api import MessagesRequest, chat_request
    base = {"model": NAME, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}]}
    for choice, parallel in (({"type": "any"}, None), ({"type": "any", "disable_parallel_tool_use": True}, False)):
        chat = chat_request(MessagesRequest.model_validate({**base, "tool_choice": choice}))
        assert chat.tool_choice == "required" and chat.parallel_tool_calls is parallel
    from tokenleap.serve.protocol import APIError
    for choice in ({"type": "any"}, {"type": "tool", "name": "f"}):  # without tools: said in this API's terms
        with pytest.raises(APIError, match=f'tool_choice {{"type": "{choice["type"]}"}} needs tools'):
            chat_request(MessagesRequest.model_validate({**base, "tools": None, "tool_choice": choice}))


def test_a_busy_server_is_overloaded_in_anthropics_status():
    """The queue full: 529 ``overloaded_error`` on /v1/messages (the SDK's ``OverloadedError``, which it
    retries), while the OpenAI routes keep their 503."""
    from serving_helpers import LiveServer, paged_engine
    from test_server import GateProposer
    from tokenleap.serve.app import ServerConfig, create_app
    from tokenleap.serve.scheduler import SchedulerConfig
    eng = paged_engine("ngram", k=2)
    eng.proposer = held = GateProposer(eng.proposer)
    config = ServerConfig(NAME, scheduler=SchedulerConfig(log_interval=0, max_num_seqs=1, max_waiting=0))
    with LiveServer(create_app(eng, config)) as s:
        done = []
        t = threading.Thread(target=lambda: done.append(httpx.post(s.url + "/v1/completions", json={
            "prompt": "wait for me", "max_tokens": 20, "ignore_eos": True}, timeout=120)))
        t.start()
        try:
            assert held.entered.wait(60)  # the one slot is taken and nothing may wait
            with pytest.raises(anthropic.OverloadedError) as e:
                anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=60).messages.create(
                    model=NAME, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
            assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error", e.value.body
            assert e.value.response.headers["retry-after"] == "1"
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
        finally:
            held.gate.set()
            t.join(120)
        assert done and done[0].status_code == 200, done
