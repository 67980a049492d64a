"""Tool calls at their edges: a call that max_tokens cuts off (OpenAI's chat completions keep it as far
as it was written, with finish_reason "length", streamed or not, and the two agree), and a forced call
of a function that takes no parameters (its arguments an empty object, not one the model makes up)."""
from __future__ import annotations

import json

from tokenleap.config import SamplingParams
from tokenleap.serve.tool_stream import ToolStream
from tokenleap.serve.tools import parse_tool_calls, plan_tools

from test_tools import CALL, TOOLS, ask, chat_req, joined, names, scripted  # noqa: F401 (scripted: a fixture)

CUT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'


def test_a_cut_call_is_kept_as_far_as_it_was_written_only_when_asked():
    assert parse_tool_calls(CUT) == (None, [])  # (the other APIs: dropped)
    content, [call] = parse_tool_calls("Sure. " + CUT, keep_cut=True)
    assert content == "Sure." and call["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    # cut before its arguments began: the call with none yet; before its name ended: no call
    assert parse_tool_calls('<tool_call>{"name": "add", "argu', keep_cut=True)[1][0]["function"] == {
        "name": "add", "arguments": ""}
    assert parse_tool_calls('<tool_call>{"name": "ad', keep_cut=True) == (None, [])
    # cut inside the closing tag, or past the arguments: the arguments end where their object closes
    call = '<tool_call>\n{"name": "add", "arguments": {"a": "}", "b": [1, {"c": 2}]}'
    for tail in ('}\n</tool_c', ', "x": "y', '}'):
        assert parse_tool_calls(call + tail, keep_cut=True)[1][0]["function"]["arguments"] == \
            '{"a": "}", "b": [1, {"c": 2}]}', tail
    # whole calls before it stay as they were
    whole = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
    assert [c["function"]["arguments"] for c in parse_tool_calls(whole + CUT, keep_cut=True)[1]] == [
        '{"a": 1}', '{"city": "Par']


def test_a_streamed_cut_call_ends_as_its_unstreamed_reply_has_it():
    closed = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_c'
    for pieces in (["Sure.\n<tool_call>", '\n{"name": "get_weather", "arguments": {"ci', 'ty": "Par'],
                   ['<tool_call>\n{"name": "get_weather", "argu'],  # (its head not yet sent)
                   list(closed),  # (a character at a time, cut inside the closing tag)
                   ['<tool_call>{"name": "add", "arguments": {"a": 1, ', "x"]):  # (not JSON: the stream stops there)
        s, parts = ToolStream("", ("get_weather",)), []
        for p in pieces:
            parts += s.feed(p)[1]
        _, calls, more = s.finish(keep_cut=True)
        [(call_id, name, arguments)] = joined(parts + more)
        unstreamed = parse_tool_calls("".join(pieces), keep_cut=True)[1][0]["function"]
        assert (name, arguments) == (unstreamed["name"], unstreamed["arguments"])
        assert [c["id"] for c in calls] == [call_id] and calls[0]["function"] == unstreamed


def test_the_server_sends_a_call_max_tokens_cut_with_finish_reason_length(scripted):  # noqa: F811
    server, _ = scripted
    full = ask(server, "§", tools=TOOLS).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.tool_calls[0].function.name == "get_weather"
    cut_at = None
    for max_tokens in range(4, 40):  # the first budget that ends inside the call's arguments
        choice = ask(server, "§", tools=TOOLS, max_completion_tokens=max_tokens).choices[0]
        if choice.message.tool_calls and choice.finish_reason == "length":
            cut_at = max_tokens
            break
    assert cut_at is not None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert '{"city": "Paris"}'.startswith(call.function.arguments) and call.function.arguments != '{"city": "Paris"}'
    streamed, reasons = {}, []
    for chunk in ask(server, "§", tools=TOOLS, max_completion_tokens=cut_at, stream=True):
        for c in chunk.choices[0].delta.tool_calls or []:
            streamed.setdefault(c.index, [c.function.name, ""])[1] += c.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert streamed == {0: ["get_weather", call.function.arguments]} and [r for r in reasons if r] == ["length"]


def test_a_forced_call_of_a_function_without_parameters_has_empty_arguments():
    """OpenAI: omitting parameters defines a function with an empty parameter list; so does an object
    schema with empty properties. A bare {"type": "object"} stays any object."""
    from test_structured import engine, run
    none = {"type": "object", "properties": {}, "additionalProperties": False}
    for given, want in ((None, none), ({"type": "object", "properties": {}}, none),
                        ({"type": "object", "properties": {}, "additionalProperties": True},
                         {"type": "object", "properties": {}, "additionalProperties": True}),
                        ({"type": "object"}, {"type": "object"})):
        function = {"name": "ping", **({"parameters": given} if given is not None else {})}
        plan = plan_tools(chat_req(tools=[{"type": "function", "function": function}],
                                   tool_choice={"type": "function", "function": {"name": "ping"}}), "{{ tools }}")
        assert json.loads(plan.grammar.json)["properties"]["arguments"] == want, given
    eng = engine()
    for prompt in ("hello", "abc", "{}", "tool"):  # a random model: only the grammar keeps its arguments empty
        seq = run(eng, prompt, SamplingParams(max_tokens=60, structured=plan_tools(
            chat_req(tools=[{"type": "function", "function": {"name": "ping"}}], tool_choice="required",
                     parallel_tool_calls=False), "{{ tools }}").grammar))
        assert names(parse_tool_calls("<tool_call>\n" + seq.text)[1]) == [("ping", {})], seq.text

