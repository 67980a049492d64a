"""Tool calling on the chat endpoint: parsing hermes-style <tool_call> blocks (and bare JSON calls),
streaming that holds a call back, the request plan (tool_choice), the messages a template gets,
and a real server whose scripted model writes tool calls, exercised with the openai client."""
from __future__ import annotations

import json
import re

import openai
import pytest
import torch

from tokenleap.spec.engine import Engine
from tokenleap.cache.paged import PagedKVCache
from tokenleap.spec.proposers.ngram import NgramProposer
from tokenleap.serve.chat_render import chat_messages, chat_options
from tokenleap.serve.protocol import APIError, ChatRequest
from tokenleap.serve.scheduler import SchedulerConfig
from tokenleap.serve.app import ServerConfig, create_app
from tokenleap.serve.tool_stream import ToolStream
from tokenleap.serve.tools import parse_tool_calls, plan_tools, reply_grammar
from tokenleap.spec.structured import closed_objects

from script_helpers import ScriptTokenizer, script_model
from serving_helpers import LiveServer

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO = ('Sure.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
       '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def names(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_parse_hermes_blocks():
    content, calls = parse_tool_calls(CALL)
    assert content is None and names(calls) == [("get_weather", {"city": "Paris"})]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    content, calls = parse_tool_calls(TWO)
    assert content == "Sure." and names(calls) == [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    assert len({c["id"] for c in calls}) == 2
    # the reply ended inside the last block (EOS before the closing tag)
    assert names(parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}')[1]) == [("f", {})]
    # the doubled braces of Qwen's template example, copied by the model
    assert names(parse_tool_calls('<tool_call>\n{{"name": "f", "arguments": {"x": 1}}}\n</tool_call>')[1]) == [
        ("f", {"x": 1})]
    # arguments given as a string stay that string
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')[1][0][
        "function"]["arguments"] == '{"x": 1}'


def test_text_that_is_not_a_call_stays_content():
    for text in ("plain answer", "<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                 CALL + '<tool_call>{"name": "f", "arguments": </tool_call>'):  # one bad block: no calls
        assert parse_tool_calls(text) == (text, [])


def test_bare_json_calls_need_a_known_name():
    fenced = '```json\n{"name": "add", "arguments": {"a": 1}}\n```'
    assert names(parse_tool_calls(fenced, ("add",))[1]) == [("add", {"a": 1})]
    assert parse_tool_calls(fenced, ("add",))[0] is None
    assert names(parse_tool_calls(' [{"name": "add", "arguments": {}}, {"name": "add", "arguments": {"a": 2}}]',
                                  ("add",))[1]) == [("add", {}), ("add", {"a": 2})]
    assert parse_tool_calls(fenced, ("other",)) == (fenced, [])  # not an offered function
    assert parse_tool_calls('{"name": "add"}', ("add",)) == ('{"name": "add"}', [])  # no arguments
    assert parse_tool_calls(fenced) == (fenced, [])  # no functions offered
    for fence in ("```JSON\n", "```\n", "``` json \n", "```json "):  # other spellings small models write
        text = fence + '{\n  "name": "add",\n  "arguments": {"a": 1}\n}\n```'
        assert parse_tool_calls(text, ("add",))[0] is None, fence
        assert names(parse_tool_calls(text, ("add",))[1]) == [("add", {"a": 1})], fence
    python = '```python\n{"name": "add", "arguments": {}}\n```'  # code in another language is content
    assert parse_tool_calls(python, ("add",)) == (python, [])


def stream(pieces, prefix="", offered=("add", "get_weather"), parts=None):
    """(content sent after each piece, content sent at the end, the calls); ``parts`` (a list)
    collects every call part, those sent at the end last."""
    s = ToolStream(prefix, offered)
    sent = []
    for p in pieces:
        content, more = s.feed(p)
        sent.append(content)
        (parts if parts is not None else []).extend(more)
    rest, calls, more = s.finish()
    (parts if parts is not None else []).extend(more)
    return sent, rest, calls


def joined(parts):
    """Each call's (id, name, arguments) from its parts, as a client joins them."""
    calls = {}
    for p in parts:
        if p.name is not None:
            assert p.index not in calls, "a call is named once"
            calls[p.index] = [p.id, p.name, ""]
        assert calls[p.index][0] == p.id
        calls[p.index][2] += p.arguments
    return [tuple(calls[i]) for i in sorted(calls)]


def test_stream_holds_back_from_the_tag_on():
    sent, rest, calls = stream(["Sure.\n<to", "ol_call>{\"name\": \"add\", ", "\"arguments\": {}}</tool_call>"])
    assert sent == ["Sure.\n", "", ""] and rest == "" and names(calls) == [("add", {})]
    # a possible start of a tag is held back until it turns out to be something else
    sent, rest, calls = stream(["a <tool", "box> b"])
    assert sent == ["a ", "<toolbox> b"] and rest == "" and calls == []
    # a reply that ends inside a held-back tag start sends it at the end
    sent, rest, calls = stream(["x <tool_"])
    assert sent == ["x "] and rest == "<tool_" and calls == []
    # a malformed call: everything from the tag on comes at the end, as content
    sent, rest, calls = stream(["ok <tool_call>{oops", "</tool_call>"])
    assert "".join(sent) + rest == "ok <tool_call>{oops</tool_call>" and calls == []


def test_stream_of_a_bare_json_call_and_of_code():
    sent, rest, calls = stream(["```", "json\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}", "\n```"])
    assert sent == ["", "", ""] and rest == "" and names(calls) == [("add", {"a": 1})]
    sent, rest, calls = stream(["```", "python\nprint(1)", "\n```"])  # code is streamed once it differs
    assert sent[0] == "" and "".join(sent) + rest == "```python\nprint(1)\n```" and calls == []
    assert sent[1] == "```python\nprint(1)"
    sent, rest, calls = stream(["```J", "SON\n{\"name\": \"add\", \"arguments\": {}}\n", "```"])
    assert sent == ["", "", ""] and rest == "" and names(calls) == [("add", {})]
    sent, rest, calls = stream(["```\n", "{\"name\": \"add\", \"arguments\": {}}\n```"])
    assert sent == ["", ""] and rest == "" and names(calls) == [("add", {})]
    sent, rest, calls = stream(['```json {"name": "add", ', '"arguments": {}}```'])  # the object on the fence's line
    assert sent == ["", ""] and rest == "" and names(calls) == [("add", {})]
    sent, rest, calls = stream(["``", "`js", "on5"])  # not json after all: sent once that shows
    assert sent == ["", "", "```json5"] and rest == "" and calls == []


def test_a_forced_opening_is_part_of_the_reply():
    sent, rest, calls = stream(['add", "arguments": {"a": 5}}'], prefix='<tool_call>\n{"name": "')
    assert sent == [""] and names(calls) == [("add", {"a": 5})]
    # a forced call cut off (max_tokens) shows no markup, the prefix the server wrote least of all
    sent, rest, calls = stream(["junk"], prefix='<tool_call>\n{"name": "')
    assert sent == [""] and rest == "" and calls == []
    content, calls = parse_tool_calls('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
                                      '<tool_call>\n{"name": "add", "argu')
    assert content == "Sure." and names(calls) == [("add", {"a": 1})]  # the whole call kept, the cut one dropped
    assert parse_tool_calls("<tool_call>\nnot a call") == ("<tool_call>\nnot a call", [])  # not cut: kept


def test_calls_stream_as_the_model_writes_them():
    pieces = [TWO[i:i + 3] for i in range(0, len(TWO), 3)]  # three characters a step
    parts = []
    s = ToolStream("", ("add",))
    seen = []  # (step, call index, name) of each call's first part
    for step, piece in enumerate(pieces):
        _, more = s.feed(piece)
        parts += more
        seen += [(step, p.index, p.name) for p in more if p.name is not None]
    rest, calls, more = s.finish()
    parts += more
    assert rest == "" and [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1, "b": 2},
                                                                                      {"a": 3, "b": 4}]
    # each call is named as soon as its name and the start of its arguments are written, long before the end
    first_end = TWO.index("</tool_call>") // 3
    assert [(i, n) for _, i, n in seen] == [(0, "add"), (1, "add")] and seen[0][0] < first_end < seen[1][0]
    # the arguments come in pieces, and joined they are the calls the whole reply gives, ids included
    assert len([p for p in parts if p.index == 0 and p.arguments]) > 3 and not any(p.whole for p in parts)
    assert joined(parts) == [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
    # the arguments as written (no re-spacing), streamed or not
    text = '<tool_call>{"name":"add","arguments":{"a":1,"s":"}\\"{"}}</tool_call>'
    parts = []
    _, _, calls = stream([text[:30], text[30:]], parts=parts)
    unstreamed = parse_tool_calls(text)[1][0]["function"]["arguments"]
    assert calls[0]["function"]["arguments"] == '{"a":1,"s":"}\\"{"}' == unstreamed
    assert joined(parts)[0][1:] == ("add", '{"a":1,"s":"}\\"{"}')


def test_a_reply_that_opens_like_json_still_streams_its_text_and_calls():
    # held back while it may be a bare JSON call; a block shows it is not one
    text = '[Searching] I will call it.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    parts = []
    sent, rest, calls = stream(list(text), parts=parts)
    assert "".join(sent) + rest == "[Searching] I will call it.\n" and sent[1] == "[S"  # ("[S" is no JSON list)
    assert joined(parts) == [(calls[0]["id"], "add", '{"a": 1}')] and not any(p.whole for p in parts)
    text = '{"note": 1}\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    parts = []
    sent, rest, calls = stream([text[:12], text[12:]], parts=parts)
    assert "".join(sent) + rest == '{"note": 1}\n' and joined(parts)[0][1:] == ("add", '{"a": 1}')


def test_a_closing_tag_inside_an_argument_is_part_of_it():
    text = '<tool_call>{"name": "add", "arguments": {"s": "a </tool_call> b"}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content is None and calls[0]["function"]["arguments"] == '{"s": "a </tool_call> b"}'
    parts = []
    _, rest, streamed = stream([text[i:i + 5] for i in range(0, len(text), 5)], parts=parts)
    assert rest == "" and joined(parts) == [(streamed[0]["id"], "add", '{"s": "a </tool_call> b"}')]


def test_parallel_tool_calls_false_keeps_the_first_call():
    s = ToolStream("", ("add",), single=True)
    parts = []
    for piece in [TWO[i:i + 4] for i in range(0, len(TWO), 4)]:
        parts += s.feed(piece)[1]
    rest, calls, more = s.finish()
    parts += more
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1, "b": 2}]
    assert joined(parts) == [(calls[0]["id"], "add", '{"a": 1, "b": 2}')]  # the second call never went out


def test_calls_in_other_shapes_come_whole_at_the_end():
    for text in ('<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>',  # keys the other way round
                 '<tool_call>\n{{"name": "add", "arguments": {"a": 1}}}\n</tool_call>',  # the template's doubled braces
                 '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'):  # arguments as a string
        s = ToolStream("", ("add",))
        assert all(s.feed(c) == ("", []) for c in text)
        rest, calls, parts = s.finish()
        assert rest == "" and [(p.name, p.whole) for p in parts] == [("add", True)], text
        assert json.loads(parts[0].arguments) == {"a": 1} and parts[0].id == calls[0]["id"]


def test_a_streamed_call_the_reply_breaks_off_in():
    parts = []
    sent, rest, calls = stream(["Sure.\n<tool_call>", '{"name": "add", "arguments": {"a": ', "1"], parts=parts)
    assert "".join(sent) + rest == "Sure.\n" and calls == []  # dropped from the calls, as unstreamed
    assert joined(parts)[0][1:] == ("add", '{"a": 1')  # what went out stands
    # text JSON does not allow in the arguments stops the streaming; the rest waits for the end
    parts = []
    sent, rest, calls = stream(['<tool_call>{"name": "add", "arguments": {"a": ', "1</tool_call>"], parts=parts)
    assert joined(parts)[0][1:] == ("add", '{"a": 1') and calls == [] and rest == ""


def chat_req(**kw) -> ChatRequest:
    return ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


def test_plan_follows_tool_choice():
    template = "{{ tools }} {{ messages }}"
    assert plan_tools(chat_req(), template).tools is None
    plan = plan_tools(chat_req(tools=TOOLS), template)
    assert plan.parse and plan.prefix == "" and [t["function"]["name"] for t in plan.tools] == ["get_weather", "add"]
    assert plan.names == ("get_weather", "add")
    none = plan_tools(chat_req(tools=TOOLS, tool_choice="none"), template)  # shown to the model, never parsed
    assert [t["function"]["name"] for t in none.tools] == ["get_weather", "add"] and not none.parse
    assert plan_tools(chat_req(tools=TOOLS, tool_choice="none"), "{{ messages }}").tools is None  # no 400
    required = plan_tools(chat_req(tools=TOOLS, tool_choice="required"), template)
    assert required.prefix == "<tool_call>\n" and required.grammar is not None
    lark = required.grammar.grammar  # one call or more, each of either function, arguments by its schema
    assert 'more: "\\n<tool_call>\\n" call "\\n</tool_call>"' in lark
    schema = json.loads(lark.split("%json ", 1)[1])
    one = plan_tools(chat_req(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), template)
    # parallel_tool_calls false: exactly one; the arguments' objects closed either way (as a json spec is:
    # keys the schema declares, not ones a small model copies in, such as "required")
    assert closed_objects(json.loads(one.grammar.json)) == schema
    assert [c["properties"]["name"]["const"] for c in schema["anyOf"]] == ["get_weather", "add"]
    assert schema["anyOf"][0]["properties"]["arguments"] == {**TOOLS[0]["function"]["parameters"],
                                                             "additionalProperties": False}
    named = plan_tools(chat_req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}), template)
    assert named.prefix == "<tool_call>\n" and json.loads(named.grammar.json)["properties"]["name"] == {"const": "add"}
    # parameters the grammar compiler cannot take: that function's arguments are any object, the others'
    # keep their schemas
    odd = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}]
    mixed = plan_tools(chat_req(tools=odd + TOOLS, tool_choice="required", parallel_tool_calls=False), template)
    arguments = [c["properties"]["arguments"] for c in json.loads(mixed.grammar.json)["anyOf"]]
    assert arguments == [{"type": "object"}] + [t["function"]["parameters"] for t in TOOLS]
    # $defs (pydantic's schemas) and definitions are lifted to the root, where their references point
    loc = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    for key in ("$defs", "definitions"):
        params = {"type": "object", "properties": {"loc": {"$ref": f"#/{key}/Loc"}}, "required": ["loc"],
                  key: {"Loc": loc}}
        defs = [{"type": "function", "function": {"name": "g", "parameters": params}}]
        plan = plan_tools(chat_req(tools=defs, tool_choice={"type": "function", "function": {"name": "g"}}), template)
        schema = json.loads(plan.grammar.json)
        assert schema[key] == {"Loc": loc} and key not in schema["properties"]["arguments"], schema
        clash = [defs[0], {"type": "function", "function": {"name": "h", "parameters": {**params, key: {"Loc": {}}}}}]
        with pytest.raises(APIError, match=f"define {re.escape(key)} 'Loc' differently"):
            plan_tools(chat_req(tools=clash, tool_choice="required"), template)
    with pytest.raises(APIError, match="not among the tools"):
        plan_tools(chat_req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}), template)
    with pytest.raises(APIError, match="needs tools"):
        plan_tools(chat_req(tool_choice="required"), template)
    with pytest.raises(APIError, match="does not take tools"):
        plan_tools(chat_req(tools=TOOLS), "{{ messages }}")


def test_a_forced_call_takes_the_reply_and_response_format_the_answer_after_it():
    template, fmt = "{{ tools }} {{ messages }}", {"type": "json_object"}
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        req = chat_req(tools=TOOLS, tool_choice=choice, response_format=fmt)
        plan = plan_tools(req, template)
        assert reply_grammar(plan, req) is plan.grammar is not None
    for kw in ({"tools": TOOLS}, {}):  # no call forced: the request's own format
        req = chat_req(response_format=fmt, **kw)
        assert reply_grammar(plan_tools(req, template), req).json_object


def test_a_forced_call_follows_the_functions_schema():
    """tool_choice required on a random model: the grammar makes its reply one call of an offered
    function with arguments by that function's schema."""
    from test_structured import engine, run
    from tokenleap.config import SamplingParams
    pick = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer"}},
            "required": ["color"], "additionalProperties": False}
    offered = [{"type": "function", "function": {"name": "pick", "parameters": pick}},
               {"type": "function", "function": {"name": "halt", "parameters": {"type": "object", "properties": {},
                                                                                 "additionalProperties": False}}}]
    plan = plan_tools(chat_req(tools=offered, tool_choice="required", parallel_tool_calls=False), "{{ tools }}")
    several = plan_tools(chat_req(tools=offered, tool_choice="required"), "{{ tools }}")
    eng = engine()
    for prompt in ("hello", "abc", "{}", "tool"):
        seq = run(eng, prompt, SamplingParams(max_tokens=60, structured=plan.grammar))
        content, calls = parse_tool_calls(plan.prefix + seq.text, plan.names)
        assert seq.finish_reason == "stop" and content is None and len(calls) == 1, seq.text
        name, args = names(calls)[0]
        assert (name == "pick" and args["color"] in ("red", "green") and set(args) <= {"color", "n"}) or \
            (name == "halt" and args == {})
        seq = run(eng, prompt, SamplingParams(max_tokens=200, structured=several.grammar))
        content, more = parse_tool_calls(several.prefix + seq.text, several.names)
        assert content is None and len(more) >= 1 and all(c["function"]["name"] in ("pick", "halt") for c in more)
    # the grammar of "required" takes further calls, each in its tags, and an end after any of them
    from test_structured import VOCAB, CharTokenizer
    from tokenleap.spec.structured import Constraints

    class LinesTokenizer(CharTokenizer):  # token 0 is a newline
        def piece(self, i):
            return "\n" if i == 0 else super().piece(i)

        def encode(self, text):
            return [0 if c == "\n" else i for c, i in zip(text, super().encode(text.replace("\n", " ")))]
    tok = LinesTokenizer()
    first, second = '{"name": "pick", "arguments": {"color": "red"}}', '{"name": "halt", "arguments": {}}'
    more = "\n</tool_call>\n<tool_call>\n"
    for reply, ends in ((first, True), (first + "\n</tool_call>", True), (first + more, False),
                        (first + more + second + "\n</tool_call>", True)):
        constraint = Constraints(tok, VOCAB, (2,)).make(several.grammar)
        constraint.advance(tok.encode(reply))
        assert bool(constraint.allowed()[2]) == ends, reply
    content, calls = parse_tool_calls(several.prefix + first + more + second, ())
    assert [c["function"]["name"] for c in calls] == ["pick", "halt"]


def test_messages_carry_tool_calls_and_results():
    req = ChatRequest.model_validate({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'}]})
    msgs = chat_messages(req)
    assert msgs[1]["tool_calls"] == [{"id": "call_1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
    assert msgs[1]["content"] == "" and msgs[2] == {"role": "tool", "content": '{"temp": 3}', "tool_call_id": "call_1"}
    bad = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{nope"}}
    [msg] = chat_messages(ChatRequest.model_validate({"messages": [{"role": "assistant", "tool_calls": [bad]}]}))
    assert msg["tool_calls"][0]["function"]["arguments"] == "{nope"  # not JSON: the text as sent, as OpenAI takes it
    # a message's name and an assistant turn's reasoning reach the template, as vLLM passes them
    named = chat_messages(ChatRequest.model_validate({"messages": [
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": "4", "reasoning_content": "2 + 2"}]}))
    assert named[0]["name"] == "ann" and named[1]["reasoning_content"] == "2 + 2" and "name" not in named[1]
    # vLLM's documents and OpenAI's reasoning_effort are template variables (chat_template_kwargs win)
    docs = [{"title": "a", "text": "b"}]
    options = chat_options(ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                       "documents": docs, "reasoning_effort": "low"}))
    assert options == {"documents": docs, "reasoning_effort": "low", "add_generation_prompt": True}
    options = chat_options(ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                       "reasoning_effort": "low",
                                                       "chat_template_kwargs": {"reasoning_effort": "high"}}))
    assert options["reasoning_effort"] == "high"
    with pytest.raises(APIError, match="only assistant"):
        chat_messages(ChatRequest.model_validate({"messages": [{"role": "user", "content": "x", "tool_calls": [bad]}]}))


# -- a server whose model writes a script ---------------------------------------------------------
STARTS = {"§": (3, CALL), "¶": (100, TWO)}  # a prompt ending with this character -> the model writes that


@pytest.fixture(scope="module")
def scripted():
    tok = ScriptTokenizer(STARTS)
    model = script_model(STARTS)
    cache = PagedKVCache(model.config, 64, 256, torch.float32, block_size=16, num_slots=4)
    eng = Engine(model, tok, max_len=256, prefill_chunk=8, cache=cache, proposer=NgramProposer(3, 1))
    with LiveServer(create_app(eng, ServerConfig("m", scheduler=SchedulerConfig(log_interval=0)))) as s:
        yield s, tok


def ask(server, mark: str, **kw):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    return c.chat.completions.create(model="m", messages=[{"role": "user", "content": "weather? " + mark}],
                                     max_tokens=200, temperature=0, **kw)


def test_server_returns_tool_calls(scripted):
    server, tok = scripted
    r = ask(server, "§", tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert tok.seen_tools[-1] == TOOLS  # the template got the tools
    r = ask(server, "¶", tools=TOOLS)
    assert r.choices[0].message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls] == [
        ("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    # parallel_tool_calls false: at most one call, as OpenAI's (the model wrote two), streamed or not
    r = ask(server, "¶", tools=TOOLS, parallel_tool_calls=False)
    assert [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls] == [{"a": 1, "b": 2}]
    streamed = [c for chunk in ask(server, "¶", tools=TOOLS, parallel_tool_calls=False, stream=True)
                for c in chunk.choices[0].delta.tool_calls or []]
    assert {c.index for c in streamed} == {0}
    # without tools (or with tool_choice "none": the template shows them, as vLLM's does) the same reply
    # is plain content
    for kw, shown in (({}, None), ({"tools": TOOLS, "tool_choice": "none"}, TOOLS)):
        r = ask(server, "§", **kw)
        assert r.choices[0].message.content == CALL and r.choices[0].message.tool_calls is None
        assert r.choices[0].finish_reason == "stop" and tok.seen_tools[-1] == shown


def test_server_streams_tool_calls(scripted):
    server, _ = scripted
    for mark, content, expected in (("§", "", [("get_weather", {"city": "Paris"})]),
                                    ("¶", "Sure.\n", [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})])):
        text, calls, reasons, pieces = "", {}, [], {}
        for chunk in ask(server, mark, tools=TOOLS, stream=True):
            delta = chunk.choices[0].delta
            text += delta.content or ""
            for call in delta.tool_calls or []:
                if call.index not in calls:  # a call's first delta names it; the later ones carry its arguments
                    assert call.id.startswith("call_") and call.type == "function" and call.function.name
                    calls[call.index] = [call.function.name, ""]
                else:
                    assert call.id is None and call.function.name is None
                calls[call.index][1] += call.function.arguments
                pieces[call.index] = pieces.get(call.index, 0) + bool(call.function.arguments)
            reasons.append(chunk.choices[0].finish_reason)
        assert text == content and [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))] == expected
        assert min(pieces.values()) > 1  # the arguments came as the model wrote them, in several chunks
        assert [r for r in reasons if r] == ["tool_calls"] and reasons[-1] == "tool_calls"
        # the SDK's stream helper closes each call's arguments (the finish reason comes in a chunk after them)
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        with c.chat.completions.stream(model="m", messages=[{"role": "user", "content": "weather? " + mark}],
                                       max_tokens=200, temperature=0, tools=TOOLS) as stream:
            done = [(e.name, json.loads(e.arguments)) for e in stream if e.type == "tool_calls.function.arguments.done"]
        assert done == expected


def test_server_streams_calls_of_several_choices(scripted):
    server, _ = scripted
    calls: dict[int, dict] = {0: {}, 1: {}}
    reasons: dict[int, str] = {}
    for chunk in ask(server, "¶", tools=TOOLS, stream=True, n=2):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.function.name:
                    calls[choice.index][call.index] = call.function.name
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert calls == {0: {0: "add", 1: "add"}, 1: {0: "add", 1: "add"}} and reasons == {0: "tool_calls", 1: "tool_calls"}


def test_server_rejects_tools_it_cannot_honour(scripted):
    server, _ = scripted
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        ask(server, "§", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        ask(server, "§", tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="sometimes")
    with pytest.raises(openai.BadRequestError, match="functions"):  # the deprecated form: tools instead
        ask(server, "§", extra_body={"functions": [{"name": "f", "parameters": {"type": "object"}}]})


# -- the same calls through /v1/responses (OpenAI's Responses API) ---------------------------------
RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's flat form


def respond(server, mark: str, **kw):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    return c.responses.create(model="m", input="weather? " + mark, max_output_tokens=200, temperature=0, **kw)


def calls_of(items):
    return [(i.name, json.loads(i.arguments)) for i in items if i.type == "function_call"]


def test_responses_return_function_calls(scripted):
    server, tok = scripted
    r = respond(server, "§", tools=RESPONSE_TOOLS)
    [item] = r.output
    assert item.type == "function_call" and item.call_id.startswith("call_") and item.id.startswith("fc_")
    assert calls_of(r.output) == [("get_weather", {"city": "Paris"})] and r.status == "completed"
    assert tok.seen_tools[-1] == TOOLS  # the template got them in the chat form
    r = respond(server, "¶", tools=RESPONSE_TOOLS, tool_choice="auto")
    assert [i.type for i in r.output] == ["message", "function_call", "function_call"]
    assert r.output_text == "Sure." and calls_of(r.output) == [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    r = respond(server, "§", tools=RESPONSE_TOOLS, tool_choice="none")
    assert r.output_text == CALL and calls_of(r.output) == [] and tok.seen_tools[-1] == TOOLS


def test_responses_stream_function_calls(scripted):
    server, _ = scripted
    events = list(respond(server, "¶", tools=RESPONSE_TOOLS, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.completed" and [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Sure.\n"
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["message", "function_call", "function_call"]
    args = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert args == [i.arguments for i in done[1:]] and calls_of(done) == calls_of(events[-1].response.output)
    assert calls_of(done) == [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    # each call's arguments come in deltas as the model writes them, after the message's item is done
    deltas: dict[str, list[str]] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            deltas.setdefault(e.item_id, []).append(e.delta)
    assert {k: "".join(v) for k, v in deltas.items()} == {i.id: i.arguments for i in done[1:]}
    assert all(len(v) > 1 for v in deltas.values())
    assert kinds.index("response.function_call_arguments.delta") > kinds.index("response.output_item.done")
    events = list(respond(server, "§", tools=RESPONSE_TOOLS, stream=True))  # a call alone: no message item
    assert [e.item.type for e in events if e.type == "response.output_item.added"] == ["function_call"]
    assert calls_of(events[-1].response.output) == [("get_weather", {"city": "Paris"})]
    assert "response.output_text.delta" not in [e.type for e in events]


def test_responses_refuse_tools_they_cannot_run(scripted):
    server, _ = scripted
    for kw, message in (({"tools": [{"type": "web_search"}]}, "only function tools"),
                        ({"tools": RESPONSE_TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
                         "not among the tools"),
                        ({"tools": RESPONSE_TOOLS, "tool_choice": {"type": "allowed_tools"}}, "tool_choice must be")):
        with pytest.raises(openai.BadRequestError, match=message):
            respond(server, "§", **kw)


def test_responses_chain_a_function_call_to_its_output(scripted):
    """previous_response_id after a call: the stored conversation holds the call as the assistant's
    tool call, so a function_call_output item answers it as the chat path's tool message."""
    import asyncio
    server, _ = scripted
    r1 = respond(server, "§", tools=RESPONSE_TOOLS)
    [call] = r1.output
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    r2 = c.responses.create(model="m", previous_response_id=r1.id, tools=RESPONSE_TOOLS, max_output_tokens=20,
                            temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                   "output": "sunny"}])
    stored = asyncio.run(server.app.state.server.response_store.get(r2.id)).messages
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[0] == {"role": "user", "content": "weather? §"}
    assert stored[1]["tool_calls"] == [{"id": call.call_id, "type": "function",
                                        "function": {"name": "get_weather", "arguments": call.arguments}}]
    assert stored[2] == {"role": "tool", "content": "sunny", "tool_call_id": call.call_id}
    assert stored[3]["content"] == r2.output_text
