"""/v1/responses (OpenAI's Responses API), exercised with the official ``openai`` client against a
real uvicorn server on a tiny model: the reply equals the same conversation run alone, streamed or
not, and what the server cannot do is a 400 that says why."""
from __future__ import annotations

import httpx
import openai
import pytest

from tokenleap.config import SamplingParams

from tokenleap.serve.app import ServerConfig, create_app
from tokenleap.serve.scheduler import SchedulerConfig

from serving_helpers import (MAX_LEN, VOCAB, ChatToyTokenizer, FailingProposer, LiveServer, alone, paged_engine,
                             wait_until)
from test_server import KEY, NAME, client, start


@pytest.fixture(scope="module")
def server():
    with start(api_key=KEY) as s:
        yield s


def reference(messages: list[dict], max_tokens: int, **kw):
    tok = ChatToyTokenizer(VOCAB)
    prompt = tok.encode(tok.apply_chat_template(messages))
    return prompt, alone(prompt, SamplingParams(max_tokens=max_tokens, **kw))


def check_status(r, ref) -> None:
    if ref.finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None


def test_text_input_and_instructions(server):
    c = client(server)
    r = c.responses.create(model=NAME, input="hello there", max_output_tokens=9, temperature=0)
    prompt, ref = reference([{"role": "user", "content": "hello there"}], 9)
    assert r.object == "response" and r.model == NAME and r.id.startswith("resp_") and r.output[0].id.startswith("msg_")
    assert r.output_text == ref.text and r.output[0].role == "assistant"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(prompt), ref.num_generated)
    assert r.usage.total_tokens == len(prompt) + ref.num_generated
    assert r.tool_choice == "auto" and r.tools == []  # (OpenAI's echo of a request without tools)
    check_status(r, ref)
    r = c.responses.create(model=NAME, instructions="be brief", input="why?", max_output_tokens=12, temperature=0,
                           metadata={"k": "v"})
    _, ref = reference([{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}], 12)
    assert r.output_text == ref.text and r.instructions == "be brief" and r.metadata == {"k": "v"}
    check_status(r, ref)


def test_message_items_with_text_parts(server):
    c = client(server)
    items = [{"role": "developer", "content": "rules"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "first "},
                                                             {"type": "input_text", "text": "question"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "an answer"}]},
             {"role": "user", "content": "more"}]
    r = c.responses.create(model=NAME, input=items, max_output_tokens=10, temperature=0.8, top_p=0.9,
                           extra_body={"seed": 5})
    _, ref = reference([{"role": "developer", "content": "rules"}, {"role": "user", "content": "first question"},
                        {"role": "assistant", "content": "an answer"}, {"role": "user", "content": "more"}],
                       10, temperature=0.8, top_p=0.9, seed=5)
    assert r.output_text == ref.text  # seeded sampling: the same tokens as the conversation run alone
    check_status(r, ref)


def test_streamed_events(server):
    c = client(server)
    events = list(c.responses.create(model=NAME, input="stream it", max_output_tokens=15, temperature=0, stream=True))
    _, ref = reference([{"role": "user", "content": "stream it"}], 15)
    kinds = [e.type for e in events]
    last = "response.incomplete" if ref.finish_reason == "length" else "response.completed"
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", last]
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == ref.text == events[-4].text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == ref.num_generated
    assert len({e.item_id for e in events if hasattr(e, "item_id")}) == 1


def test_a_client_leaving_a_stream_cancels_its_sequence():
    with start() as s:
        body = {"model": NAME, "input": "leave early", "max_output_tokens": 80, "stream": True,
                "temperature": 0, "ignore_eos": True}
        with httpx.stream("POST", s.url + "/v1/responses", json=body, timeout=60) as r:
            assert r.status_code == 200
            deltas = 0
            for line in r.iter_lines():
                deltas += line == "event: response.output_text.delta"
                if deltas == 2:
                    break
        assert deltas == 2
        assert wait_until(lambda: s.scheduler.idle)
        assert s.scheduler.stats.finished == {"abort": 1} and s.scheduler.engine.cache.num_used_blocks == 0


class FailingInChat(FailingProposer):
    """Proposals fail for sequences whose prompt holds token 66 anywhere (a chat prompt starts with
    the template's text)."""

    def begin(self, seq_id, prompt):
        if 66 in prompt:
            self.bad.add(seq_id)
        self.inner.begin(seq_id, prompt)


def test_a_failing_request_gets_an_error_streamed_or_not():
    eng = paged_engine("ngram", k=2)
    eng.proposer = FailingInChat(eng.proposer)
    with LiveServer(create_app(eng, ServerConfig(NAME, scheduler=SchedulerConfig(log_interval=0)))) as s:
        c = client(s)
        bad = "xy" + chr(66 + 96)  # encodes to token 66: its proposer raises
        with pytest.raises(openai.InternalServerError, match="boom in propose"):
            c.responses.create(model=NAME, input=bad, max_output_tokens=10, temperature=0)
        events = list(c.responses.create(model=NAME, input=bad, max_output_tokens=10, temperature=0, stream=True))
        assert [e.type for e in events][-2:] == ["error", "response.failed"]
        assert "boom in propose" in events[-2].message and events[-1].response.status == "failed"
        assert wait_until(lambda: s.scheduler.idle) and eng.cache.num_used_blocks == 0
        assert c.responses.create(model=NAME, input="fine", max_output_tokens=4, temperature=0).status


def test_what_cannot_be_done_is_a_clear_400(server):
    c = client(server)
    bad = [({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "does not take tools"),
           ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "'item_reference'"),
           ({"input": [{"type": "reasoning", "summary": []}]}, "holds no message"),
           ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "arguments must be a string"),
           ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "text part"),
           ({"input": [{"role": "tool", "content": "1"}]}, "role must be one of"),
           ({"input": []}, "non-empty list of items"),
           ({"input": "x", "n": 2}, "n is not"),
           ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}, "needs a schema"),
           ({"input": "x", "text": {"format": {"type": "json_object"}}, "response_format": {"type": "json_object"}},
            "not both"),
           ({"input": "x", "max_output_tokens": 0}, "max_output_tokens must be"),
           ({"input": "x" * 60, "max_output_tokens": 100}, "lower max_output_tokens"),
           ({"input": "x" * 200, "max_output_tokens": 5}, "shorten the prompt"),  # no budget would fit
           ({"input": "x", "temperature": -1}, "temperature"),
           ({"input": "x", "include": ["message.output_text.logprob"]}, "not one of the values include takes"),
           ({"input": "x", "conversation": "conv_1"}, "stored conversations"),
           ({"input": "x", "prompt": {"id": "pmpt_1"}}, "stored conversations and prompts"),
           ({"input": "x", "truncation": "oldest"}, "truncation must be 'auto' or 'disabled'"),
           ({"input": "x" * 200, "max_output_tokens": 5, "truncation": "auto"}, "shorten the prompt"),
           ({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "call_9",
                                                          "output": "sunny"}]}, "with call_id call_9"),
           ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "early"},
                       {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}]},
            "No tool call found")]
    for body, message in bad:
        r = httpx.post(server.url + "/v1/responses", json={"model": NAME, **body},
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)
    assert httpx.post(server.url + "/v1/responses", json={"input": "x"}).status_code == 401
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="other", input="x", max_output_tokens=3)
    assert c.responses.create(model=NAME, input="still here", max_output_tokens=3, temperature=0).output_text
    # include values for tools this server does not run (or for encrypted reasoning) ask for nothing more
    assert c.responses.create(model=NAME, input="still here", max_output_tokens=3, temperature=0,
                              include=["reasoning.encrypted_content", "file_search_call.results"]).output_text


def test_function_call_items_become_the_chat_turns_of_a_tool_call():
    from tokenleap.serve.chat_render import chat_messages
    from tokenleap.serve.protocol import ResponsesRequest
    from tokenleap.serve.responses_input import chat_request

    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "weather in Paris?"},
        {"type": "reasoning", "summary": []},  # written by other servers: skipped
        {"role": "assistant", "content": "Let me look."},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]}]})
    messages = chat_messages(chat_request(req))
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert messages[1]["content"] == "Let me look."
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in messages[1]["tool_calls"]] == [
        ("call_1", "get_weather", {"city": "Paris"}), ("call_2", "get_time", {})]
    assert [(m["tool_call_id"], m["content"]) for m in messages[2:]] == [("call_1", "sunny"), ("call_2", "noon")]
    req = ResponsesRequest.model_validate({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                                                      "arguments": "{}"}]})
    assert chat_messages(chat_request(req))[0] == {
        "role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                                                            "function": {"name": "f", "arguments": {}}}]}


def test_logprobs_match_the_chat_endpoints(server):
    c = client(server)
    messages = [{"role": "user", "content": "score me"}]
    chat = c.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                     top_logprobs=2).choices[0].logprobs.content
    want = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in chat]
    kw = dict(model=NAME, input="score me", max_output_tokens=6, temperature=0, top_logprobs=2,
              include=["message.output_text.logprobs"])
    part = c.responses.create(**kw).output[0].content[0]
    assert [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in part.logprobs] == want
    events = list(c.responses.create(**kw, stream=True))
    streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done").logprobs
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in done] == [w[:2] for w in want]
    # the end token adds no text: its logprob still reaches the stream (in a delta of no text)
    ended = {**kw, "extra_body": {"min_tokens": 3, "logit_bias": {"2": 100}}}
    events = list(c.responses.create(**ended, stream=True))
    streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done").logprobs
    assert len(done) == 4 and [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in done]
    assert c.responses.create(model=NAME, input="score me", max_output_tokens=6, temperature=0,
                              top_logprobs=2).output[0].content[0].logprobs == []  # not asked for in include
    with pytest.raises(openai.BadRequestError, match="top_logprobs must be"):
        c.responses.create(**{**kw, "top_logprobs": 21})


def test_truncation_auto_drops_the_oldest_turns(server):
    """Over the context, truncation "auto" answers the conversation without its fewest oldest turns
    that make room (instructions kept; cut before a user turn), as OpenAI's drops the oldest items;
    "disabled" (the default) is a 400."""
    c = client(server)
    turns = []
    for i in range(5):
        turns += [{"role": "user", "content": f"question {i} xxxx"}, {"role": "assistant", "content": f"answer {i} yy"}]
    turns.append({"role": "user", "content": "the last one"})
    args = dict(model=NAME, instructions="rules", input=turns, max_output_tokens=8, temperature=0)
    for truncation in (None, "disabled"):
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(**args, **({"truncation": truncation} if truncation else {}))
        assert e.value.body["code"] == "context_length_exceeded"
    r = c.responses.create(**args, truncation="auto")
    tok, system = ChatToyTokenizer(VOCAB), [{"role": "system", "content": "rules"}]
    fits = [n for n in range(0, len(turns), 2)  # (cuts before a user turn)
            if len(tok.encode(tok.apply_chat_template(system + turns[n:]))) + 8 <= MAX_LEN]
    assert 1 < fits[0] < len(turns) - 1  # (several turns must go, not all)
    prompt, ref = reference(system + turns[fits[0]:], 8)
    assert r.output_text == ref.text and r.usage.input_tokens == len(prompt) and r.truncation == "auto"
    assert c.responses.create(model=NAME, input="short", max_output_tokens=3, temperature=0).truncation == "disabled"
