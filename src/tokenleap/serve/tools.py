"""Tool calling on the chat endpoint, as vLLM serves it with ``--tool-call-parser hermes``.

The request's ``tools`` go to the model's chat template, which tells the model how to call them;
Qwen2.5's template (and other hermes-style ones) asks for ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` blocks, and the blocks a reply contains come back as OpenAI ``tool_calls``
with ``finish_reason: "tool_calls"``. ``tool_choice``: "auto" (the default when tools are given)
parses whatever the model writes; "required" and a named function make the reply start with the
opening of a call and constrain it to a call of an offered (the named) function whose arguments
follow that function's parameters schema (``structured.py``), as vLLM guides them -- "required"
to one call or more (unless ``parallel_tool_calls`` is false), a named function to one (with
``parallel_tool_calls`` false and "auto" the reply's first call is its only one);
"none" shows the template the tools but parses no call (vLLM's default). A model whose template
takes no tools gets a clear 400 (with "none": the tools are left out).

Parsing is a pure function of the reply's text (``parse_tool_calls``); a call's arguments are the
model's own text of the object (``arguments_text``), which is what a stream sends piece by piece as
the model writes it (``tool_stream.ToolStream``), so both give the same string.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tokenleap.config import ConfigError, StructuredOutput
from pydantic import ValidationError

from tokenleap.serve.protocol import ChatRequest, FunctionDef, NamedToolChoice, ToolDef, bad_request, structured_output
from tokenleap.spec.structured import closed_objects, grammar_of

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE = "```"
# a reply that is one fenced block, ```json or bare ``` (any case: small models write ```JSON too)
_DECODER = json.JSONDecoder()
_FENCED = re.compile(r"```[ \t]*(?:json)?[ \t]*\n?(.*?)\n?[ \t]*```", re.IGNORECASE | re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request does with tools: ``tools`` for the chat template (None: none),
    ``prefix`` the text the reply is made to start with, ``parse`` whether calls are parsed."""

    tools: list[dict[str, Any]] | None = None
    prefix: str = ""
    parse: bool = False
    names: tuple[str, ...] = ()  # the functions offered
    grammar: StructuredOutput | None = None  # what a forced call must look like (required / named)
    single: bool = False  # parallel_tool_calls false: a reply's first call only

    def calls(self, text: str, keep_cut: bool = False) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, calls) of a reply's ``text`` (``parse_tool_calls`` of the forced prefix and it),
        the first call alone where the request asked for one at most."""
        content, calls = parse_tool_calls(self.prefix + text, self.names, keep_cut)
        return content, calls[:1] if self.single else calls


def reply_grammar(tools: ToolPlan, req: ChatRequest | Any) -> StructuredOutput | None:
    """The grammar a reply follows: a forced call's (``tools.prefix`` opens one; its grammar may
    be None where the schema did not compile) -- the request's response_format is then for the answer
    after the call, as OpenAI applies it -- else the request's own, if any."""
    return tools.grammar if tools.prefix else structured_output(req)


def arguments_object(call: dict[str, Any]) -> dict[str, Any]:
    """A parsed tool call's arguments (``parse_tool_calls``: JSON text) as an object, for the APIs that
    send them as one (Anthropic's tool_use input, Ollama's tool_calls); a model that wrote them as
    other than a JSON object keeps its text, under "arguments"."""
    text = call["function"]["arguments"]
    try:
        arguments = json.loads(text or "{}")
    except ValueError:
        arguments = None
    return arguments if isinstance(arguments, dict) else {"arguments": text}


def function_tool(where: str, fields: dict[str, Any]) -> ToolDef:
    """A function tool from another API's spelling of it (``fields``: FunctionDef's); a 400 that names
    ``where`` (the tool's place in the request) when the fields do not make one."""
    try:
        return ToolDef(type="function", function=FunctionDef.model_validate(fields))
    except ValidationError as e:
        err = e.errors()[0]
        raise bad_request(f"{where}: {err['msg']} ({'.'.join(map(str, err['loc']))})", "tools") from None


def plan_tools(req: ChatRequest, chat_template: str | None) -> ToolPlan:
    if req.functions is not None or req.function_call is not None:
        raise bad_request("functions and function_call are OpenAI's deprecated form of tools: send tools and "
                          "tool_choice", "functions")
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice 'required' or a named function needs tools", "tool_choice")
        return ToolPlan()
    takes_tools = bool(chat_template) and "tools" in chat_template
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if choice == "none":  # the model sees the tools (as vLLM and Anthropic show them) but nothing is a call
        return ToolPlan(tools if takes_tools else None)
    if not takes_tools:
        raise bad_request("this model's chat template does not take tools, so it cannot call them", "tools")
    names = [t.function.name for t in req.tools]
    single = req.parallel_tool_calls is False
    if choice != "required" and not isinstance(choice, NamedToolChoice):
        return ToolPlan(tools, "", True, tuple(names), single=single)
    forced = req.tools
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not among "
                              f"the tools ({', '.join(names)})", "tool_choice")
        forced = [t for t in req.tools if t.function.name == choice.function.name][:1]
    # the reply is one call of a forced function whose arguments follow its parameters' schema,
    # as vLLM guides it; a function whose schema the grammar compiler cannot take has any object as
    # its arguments, and if nothing compiles the reply gets a forced opening only
    arguments, defs = _lift_definitions([_arguments_schema(t.function.parameters) for t in forced])
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": args},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t, args in zip(forced, arguments)]
    loose = {"type": "object"}
    calls = [c if _compiles(StructuredOutput(json={**c, **defs}))
             else {**c, "properties": {**c["properties"], "arguments": loose}} for c in calls]
    # written as the template shows calls: one line, ", " and ": " (no run of whitespace to loop in)
    style = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    call = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), **defs, "x-guidance": style}
    grammar = StructuredOutput(json=call)
    if choice == "required" and req.parallel_tool_calls is not False:  # one call or more, as OpenAI's
        grammar = StructuredOutput(grammar=_several_calls(call))
    if not _compiles(grammar):
        one = len(forced) == 1
        prefix = OPEN + '\n{"name": ' + (json.dumps(forced[0].function.name, ensure_ascii=False) + ', "arguments": {'
                                         if one else '"')
        return ToolPlan(tools, prefix, True, tuple(names), single=single)
    return ToolPlan(tools, OPEN + "\n", True, tuple(names), grammar, single)


_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def _arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The schema a forced call's arguments follow: a function's ``parameters``, where a function
    without them -- or with an object schema whose ``properties`` are given empty and that says
    nothing of others, the usual spelling of a function that takes none -- takes an empty object
    (OpenAI: "omitting parameters defines a function with an empty parameter list"), not any object
    the model makes up. (A bare ``{"type": "object"}`` stays any object.)"""
    if not parameters:
        return dict(_NO_ARGUMENTS)
    others = ("additionalProperties", "patternProperties", "$ref", "anyOf", "oneOf", "allOf")
    if parameters.get("type") == "object" and parameters.get("properties") == {} and not any(
            k in parameters for k in others):
        return {**parameters, **_NO_ARGUMENTS}
    return parameters


def _lift_definitions(schemas: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The tools' parameter schemas without their ``$defs`` / ``definitions``, and those gathered for
    the root of the call schema they go into -- where their ``#/$defs/...`` references point once
    the parameters are one property deep (as vLLM lifts them). Two tools defining one name two
    ways are a 400."""
    lifted: dict[str, dict[str, Any]] = {}
    out = []
    for schema in schemas:
        schema = dict(schema) if isinstance(schema, dict) else schema
        for key in ("$defs", "definitions"):
            if isinstance(schema, dict) and isinstance(schema.get(key), dict):
                for name, value in schema.pop(key).items():
                    if lifted.setdefault(key, {}).setdefault(name, value) != value:
                        raise bad_request(f"two tools define {key} {name!r} differently: rename one", "tools")
        out.append(schema)
    return out, lifted


def _compiles(spec: StructuredOutput) -> bool:
    try:
        grammar_of(spec)
    except ConfigError:
        return False
    return True


def _several_calls(call: dict[str, Any]) -> str:
    """A Lark grammar (llguidance's, with ``%json``) for a reply that opens with a call of schema
    ``call`` (the opening tag already forced) and may close it and make more, each in its tags."""
    return (f'start: call ("\\n{CLOSE}" more*)?\n'
            f'more: "\\n{OPEN}\\n" call "\\n{CLOSE}"\n'
            f'call: %json {json.dumps(closed_objects(call), ensure_ascii=False)}\n')  # (as a json spec is)


def parse_tool_calls(text: str, names: tuple[str, ...] = (), keep_cut: bool = False
                     ) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a reply's text. Each ``<tool_call>`` block (the last may lack its
    closing tag: the reply ended inside it) must hold a JSON object with a string "name" (a closing
    tag inside one of its strings is part of it); the content is the text before the first block
    (None when only whitespace). A last block cut off inside its object (no closing tag, the JSON
    unfinished: the reply ran out of tokens) is dropped, so no call markup reaches the client --
    unless ``keep_cut`` (OpenAI's chat completions at ``finish_reason`` "length"), which keeps it as
    a call once its function's name is written, its arguments the unfinished text written so far
    (what a stream of it has sent); another block that does not parse means no calls: the whole
    text is the content, unchanged.
    Without blocks, a reply that is nothing but a JSON object (or a list of them), bare or in a
    ```json (or bare ```) fence, naming one of ``names`` with "arguments", is a call too: coder
    models often answer so."""
    start = text.find(OPEN)
    if start < 0:
        return _bare_calls(text, names)
    calls, pos = [], start
    while pos >= 0:
        call, end = _object_block(text, pos + len(OPEN))
        if call is None:  # not a call object alone: read between the tags (Qwen's doubled braces, ...)
            end = text.find(CLOSE, pos)
            body = text[pos + len(OPEN):end if end >= 0 else len(text)]
            call = _call(body)
            if call is None and end < 0 and body.lstrip().startswith("{"):
                cut = _cut_call(body) if keep_cut else None
                if cut is not None:
                    calls.append(cut)
                break  # cut off inside the call
            if call is None:
                return text, []
        calls.append(call)
        if end < 0:
            break
        pos = text.find(OPEN, end)
    return text[:start].strip() or None, calls


# the opening of a call object cut off after its name: the name, then the arguments' value if it has begun
_CUT_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")(?:\s*,\s*"arguments"\s*:\s*(?=\{))?', re.DOTALL)


def _cut_call(body: str) -> dict[str, Any] | None:
    """The call of a block cut off inside its object (``body``: from the opening tag to the reply's end)
    whose function's name is written: its arguments the text of their object so far ("" if not begun),
    read as a stream of it reads them (``ObjectScan``: up to where the object closes, if it did), so the
    stream has sent the same text."""
    m = _CUT_HEAD.match(body)
    if m is None:
        return None
    try:
        name = json.loads(m.group(1))
    except ValueError:
        return None
    start = m.end()
    arguments = body[start:ObjectScan(start).read(body)] if body[start:start + 1] == "{" else ""
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


_BARE = frozenset(" \t\r\n,:0123456789.+-eEtrufalsn")  # what JSON has outside strings besides brackets


class ObjectScan:
    """A JSON object's text read from ``start`` on, as far as it is known: ``pos`` is how far it has
    been read (bracket depth and string state kept between reads, so a stream reads each piece once);
    ``done`` once the object closed, ``bad`` at a character JSON does not allow there."""

    def __init__(self, start: int) -> None:
        self.pos = start
        self.depth, self.string, self.escape = 0, False, False
        self.done = self.bad = False

    def read(self, text: str) -> int:
        """Read on to the end of ``text`` or of the object; returns how far the object's text is known."""
        i = self.pos
        while i < len(text) and not (self.done or self.bad):
            c = text[i]
            if self.string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.string = False
            elif c == '"':
                self.string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                self.done = self.depth == 0
            elif c not in _BARE:
                self.bad = True
                break
            i += 1
        self.pos = i
        return i


def _object_block(text: str, at: int) -> tuple[dict[str, Any] | None, int]:
    """(the call, where its closing tag is: -1 if none) of a block whose body from ``at`` is a call
    object followed by nothing but whitespace up to the tag or the end -- read as JSON, so a
    ``</tool_call>`` inside one of its strings is part of the call, as a stream reads it; (None, -1)
    for any other body (``_call`` reads those between the tags)."""
    at = skip_space(text, at)
    try:
        obj, after = _DECODER.raw_decode(text, at)
    except ValueError:
        return None, -1
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, -1
    close = text.find(CLOSE, after)
    if text[after:close if close >= 0 else len(text)].strip():
        return None, -1
    return _call_from(obj, arguments_text(text[at:after])), close


def _bare_calls(text: str, names: tuple[str, ...]) -> tuple[str | None, list[dict[str, Any]]]:
    body = text.strip()
    fenced = _FENCED.fullmatch(body)
    obj = _loads(fenced.group(1) if fenced else body)
    if obj is None:
        return text, []
    objs = obj if isinstance(obj, list) else [obj]
    if not objs or not all(isinstance(o, dict) and o.get("name") in names and "arguments" in o for o in objs):
        return text, []
    return None, [_call_from(o) for o in objs]


def _loads(body: str) -> Any:
    """JSON text, or None (``_parsed``)."""
    return _parsed(body)[0]


def _parsed(body: str) -> tuple[Any, str]:
    """(the JSON value, the text it was read from) of ``body``, or (None, ""); Qwen's template shows
    the call format with doubled braces (``{{"name": ...}}``), which models sometimes copy: one
    doubled layer is accepted."""
    body = body.strip()
    for text in (body, body[1:-1] if body.startswith("{{") and body.endswith("}}") else None):
        if text is not None:
            try:
                return json.loads(text), text
            except ValueError:
                pass
    return None, ""


def _call(body: str) -> dict[str, Any] | None:
    obj, text = _parsed(body)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return _call_from(obj, arguments_text(text))


def arguments_text(text: str) -> str | None:
    """The arguments' object exactly as the model wrote it in the call object ``text`` (valid JSON),
    the last "arguments" member's (as ``json.loads`` keeps the last), or None where the arguments
    are not an object. A streamed call sends this text as it comes, so the whole reply gives the
    same string."""
    dec, at, found = _DECODER, skip_space(text, 1), None
    while at < len(text) and text[at] == '"':
        key, at = dec.raw_decode(text, at)
        at = skip_space(text, skip_space(text, at) + 1)  # past the colon
        value, end = dec.raw_decode(text, at)
        if key == "arguments":
            found = text[at:end] if isinstance(value, dict) else None
        at = skip_space(text, skip_space(text, end) + 1)  # past the comma (or the closing brace)
    return found


def skip_space(text: str, at: int) -> int:
    """The first position from ``at`` on that is not JSON whitespace."""
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _call_from(obj: dict[str, Any], raw: str | None = None) -> dict[str, Any]:
    """A call in OpenAI's form; its arguments the model's own text of them (``raw``) where known."""
    args = obj.get("arguments", obj.get("parameters", {}))
    text = raw if raw is not None and "arguments" in obj else (
        args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
    return {"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": text}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
