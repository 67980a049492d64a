"""A thinking model's reply split into reasoning_content and content (vLLM's reasoning parsers,
llama.cpp's --reasoning-format): the pure split, streamed pieces that add up to the whole reply's
split, and a real server whose scripted model thinks before it answers (or calls a tool)."""
from __future__ import annotations

import random

import openai
import pytest
import torch

from tokenleap.cache.paged import PagedKVCache
from tokenleap.serve.app import ServerConfig, create_app
from tokenleap.serve.reasoning import ReasoningStream, opened_by, split_reasoning, template_thinks
from tokenleap.serve.scheduler import SchedulerConfig
from tokenleap.spec.engine import Engine
from tokenleap.spec.proposers.ngram import NgramProposer

from script_helpers import ScriptTokenizer, script_model
from serving_helpers import LiveServer

THINK = "<think>\nTwo and two.\n</think>\n\n2 + 2 = 4."
CALLS = ('<think>I need the weather.</think>\n'
         '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
STARTS = {"¤": (3, THINK), "¢": (60, "Just 4."), "§": (80, CALLS)}
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}{{ tools }}{% endif %}</think>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("text, opened, want", [
    (THINK, False, ("Two and two.", "2 + 2 = 4.")),
    ("Two and two.\n</think>\n\nFour.", True, ("Two and two.", "Four.")),  # the prompt opened the block
    ("  plain answer", False, (None, "  plain answer")),
    ("<think>the budget ran out", False, ("the budget ran out", "")),
    ("x<think>y</think>z", False, (None, "x<think>y</think>z")),  # not at the start: no reasoning
    ("<think>a</thinkb</think>  c ", False, ("a</thinkb", "c ")),
    ("<thi", False, (None, "<thi")), ("", False, (None, "")), ("", True, ("", "")),
])
def test_split_and_every_streamed_cut_agree(text, opened, want):
    assert split_reasoning(text, opened) == want
    for seed in range(40):
        rng, stream, got, at = random.Random(seed), ReasoningStream(opened), ["", ""], 0
        while at < len(text):
            step = rng.randint(1, 5)
            for k, part in enumerate(stream.feed(text[at:at + step])):
                got[k] += part
            at += step
        for k, part in enumerate(stream.finish()):
            got[k] += part
        assert (got[0] if stream.has_reasoning else None, got[1]) == want


def test_which_templates_and_prompts_think():
    assert template_thinks("{{ '<think>\\n\\n</think>\\n\\n' }}") and not template_thinks("{{ m.content }}")
    assert not template_thinks(None)
    assert opened_by("<|im_start|>assistant\n<think>\n") and not opened_by("<think>\n\n</think>\n\n")
    assert not opened_by("<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def thinking():
    tok = ScriptTokenizer(STARTS, TEMPLATE)
    model = script_model(STARTS)

    def serve(**config):
        cache = PagedKVCache(model.config, 64, 256, torch.float32, block_size=16, num_slots=4)
        eng = Engine(model, tok, max_len=256, prefill_chunk=8, cache=cache, proposer=NgramProposer(3, 1))
        return LiveServer(create_app(eng, ServerConfig("m", scheduler=SchedulerConfig(log_interval=0), **config)))
    with serve() as on, serve(reasoning=False) as off:
        yield on, off


def ask(server, mark: str, **kw):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    return c.chat.completions.create(model="m", messages=[{"role": "user", "content": "q " + mark}],
                                     **{"max_tokens": 200, "temperature": 0, **kw})


def streamed(server, mark: str, **kw) -> tuple[str, str, list]:
    thought, content, reasons = "", "", []
    for chunk in ask(server, mark, stream=True, **kw):
        delta = chunk.choices[0].delta
        thought += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        reasons.append(chunk.choices[0].finish_reason)
    return thought, content, [r for r in reasons if r]


def test_the_server_returns_thinking_apart(thinking):
    on, off = thinking
    message = ask(on, "¤").choices[0].message
    assert (message.reasoning_content, message.content) == ("Two and two.", "2 + 2 = 4.")
    assert streamed(on, "¤") == ("Two and two.", "2 + 2 = 4.", ["stop"])
    message = ask(on, "¢").choices[0].message  # a reply without a block
    assert (message.reasoning_content, message.content) == (None, "Just 4.")
    r = ask(on, "¤", max_tokens=10)  # the budget ends inside the block
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content is None
    assert r.choices[0].message.reasoning_content == THINK[len("<think>\n"):10]
    # vLLM's include_reasoning false drops it; llama.cpp's reasoning_format none (or the server's
    # --reasoning-format none) leaves the block in the content
    message = ask(on, "¤", extra_body={"include_reasoning": False}).choices[0].message
    assert (message.reasoning_content, message.content) == (None, "2 + 2 = 4.")
    assert streamed(on, "¤", extra_body={"include_reasoning": False}) == ("", "2 + 2 = 4.", ["stop"])
    for server, kw in ((on, {"extra_body": {"reasoning_format": "none"}}), (off, {})):
        message = ask(server, "¤", **kw).choices[0].message
        assert message.content == THINK and getattr(message, "reasoning_content", None) is None
        assert streamed(server, "¤", **kw) == ("", THINK, ["stop"])


def test_thinking_before_a_tool_call(thinking):
    on, _ = thinking
    choice = ask(on, "§", tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "I need the weather."
    assert choice.message.content is None and choice.message.tool_calls[0].function.name == "get_weather"
    thought, content, reasons = streamed(on, "§", tools=TOOLS)
    assert (thought, content, reasons) == ("I need the weather.", "", ["tool_calls"])


def test_anthropic_messages_get_a_thinking_block(thinking):
    import anthropic
    from tokenleap.serve.messages_api import MessagesRequest, chat_request

    on, _ = thinking
    c = anthropic.Anthropic(base_url=on.url, api_key="none", max_retries=0, timeout=60)
    kw = dict(model="m", max_tokens=200, messages=[{"role": "user", "content": "q ¤"}], extra_body={"temperature": 0})
    m = c.messages.create(**kw)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", "Two and two."), ("text", "2 + 2 = 4.")]
    with c.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(include={"type", "thinking", "text"}) for b in final.content] == [
        b.model_dump(include={"type", "thinking", "text"}) for b in m.content]
    m = c.messages.create(**{**kw, "messages": [{"role": "user", "content": "q §"}]},
                          tools=[{"name": "get_weather", "input_schema": {"type": "object"}}])
    assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
    with c.messages.stream(**{**kw, "messages": [{"role": "user", "content": "q §"}]},
                           tools=[{"name": "get_weather", "input_schema": {"type": "object"}}]) as stream:
        assert [b.type for b in stream.get_final_message().content] == ["thinking", "tool_use"]
    # the request's thinking switch reaches the template as Qwen3's enable_thinking
    for kind, flag in (("enabled", True), ("disabled", False)):
        req = MessagesRequest.model_validate({"model": "m", "max_tokens": 5,
                                              "messages": [{"role": "user", "content": "x"}],
                                              "thinking": {"type": kind, "budget_tokens": 1024}})
        assert chat_request(req).chat_template_kwargs == {"enable_thinking": flag}


def test_responses_get_a_reasoning_item(thinking):
    on, _ = thinking
    c = openai.OpenAI(base_url=on.url + "/v1", api_key="none", max_retries=0, timeout=60)
    kw = dict(model="m", input="q ¤", max_output_tokens=200, temperature=0)
    r = c.responses.create(**kw)
    assert [i.type for i in r.output] == ["reasoning", "message"] and r.output_text == "2 + 2 = 4."
    assert r.output[0].content[0].text == "Two and two."
    events = list(c.responses.create(**kw, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Two and two."
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [(e.output_index, e.item.type) for e in done] == [(0, "reasoning"), (1, "message")]
    assert {e.output_index for e in events if e.type == "response.output_text.delta"} == {1}
    assert {e.output_index for e in events if e.type.startswith("response.reasoning_text.")} == {0}
    assert events[-1].response.model_dump()["output"] == [e.item.model_dump() for e in done]
    r = c.responses.create(**{**kw, "input": "q §"}, tools=[{"type": "function", "name": "get_weather",
                                                            "parameters": {"type": "object"}}])
    assert [i.type for i in r.output] == ["reasoning", "function_call"]
