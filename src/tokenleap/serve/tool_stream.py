"""A streamed reply that may call tools: its content until a call begins, then each call as it is written.

Content is passed on until a ``<tool_call>`` begins (any end of the text that could be the start of
one is held back until it turns out otherwise). From there the calls go out in parts (``CallPart``),
as OpenAI's and Anthropic's APIs stream them: a call's first part names its function once the model
has written ``{"name": ..., "arguments": ``, and each later part carries the next characters of its
arguments' object exactly as written -- the text ``tools.arguments_text`` reads from the whole reply,
so a client joining the parts has the string the non-streamed reply gives. A call in another shape
(keys in another order, the doubled braces of Qwen's template example, arguments as a string) and a
reply that is a bare JSON call wait for the end and go out whole. ``finish`` parses the whole reply
(``tools.parse_tool_calls``) and sends what is left.

A call whose start was sent stands: if the reply then breaks off inside it (max_tokens) or turns
out malformed, ``finish`` leaves it out of the calls (as the non-streamed reply has it) and the
writer closes what it opened -- unless the writer keeps cut calls (OpenAI's chat completions at
max_tokens), whose non-streamed reply has the call as far as it was written, as the stream sent it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenleap.serve.tools import CLOSE, FENCE, OPEN, ObjectScan, new_call_id, parse_tool_calls, skip_space

_NAME = object()  # where the head of a call has the function's name (a JSON string)
_HEAD = ("{", '"name"', ":", _NAME, ",", '"arguments"', ":")  # a streamable call's opening, whitespace between
_MAX_HEAD = 1024  # characters a call's opening may take before it is taken for another shape


@dataclass(frozen=True)
class CallPart:
    """The next piece of the ``index``-th call of a reply: its first part has ``name``; ``arguments`` is
    the next text of its arguments; ``whole`` says the part is the call entire (sent at the end)."""

    index: int
    id: str
    name: str | None = None
    arguments: str = ""
    whole: bool = False


def merged(parts: list[CallPart]) -> list[CallPart]:
    """``parts`` with each run of one call's parts made one (a writer sends a call once an event)."""
    out: list[CallPart] = []
    for p in parts:
        if out and out[-1].index == p.index and p.name is None:
            q = out[-1]
            out[-1] = CallPart(q.index, q.id, q.name, q.arguments + p.arguments, q.whole)
        else:
            out.append(p)
    return out


class _Call(ObjectScan):
    """A call being streamed: its arguments' object starts at ``start`` of the reply's text (``ObjectScan``:
    how far it has been read); ``sent`` how far it has gone out."""

    def __init__(self, name: str, start: int) -> None:
        super().__init__(start)
        self.id, self.name, self.start = new_call_id(), name, start
        self.sent = start


class ToolStream:
    """One streamed choice of a request that may call tools (``prefix``: the text the reply was made
    to start with; ``names``: the functions offered; ``single``: its first call only)."""

    def __init__(self, prefix: str = "", names: tuple[str, ...] = (), single: bool = False) -> None:
        self.text, self.sent = prefix, 0  # the reply so far (forced prefix included); content characters sent
        self.names, self.single = names, single
        self.seek = prefix.find(OPEN)  # where the next call is looked for (-1: no call has begun)
        self.calls: list[_Call] = []  # the calls whose parts went out, the last maybe still being written
        self.held = False  # a call not in the streamable shape: the rest waits for the end

    @property
    def calling(self) -> bool:
        return self.seek >= 0

    def feed(self, piece: str) -> tuple[str, list[CallPart]]:
        """(content that can be sent now, parts of calls) after ``piece`` of the reply arrived."""
        self.text += piece
        content = "" if self.calling else self._content()
        return content, self._parts() if self.calling else []

    def finish(self, keep_cut: bool = False) -> tuple[str, list[dict[str, Any]], list[CallPart]]:
        """(content still to send, the reply's calls, their parts still to send) once it is complete
        (``keep_cut``: a call it broke off inside is one of them, ``parse_tool_calls``')."""
        content, calls = parse_tool_calls(self.text, self.names, keep_cut)
        calls = calls[:1] if self.single else calls
        if not self.calls:
            if calls:  # the content before the first block (none before a bare call), then the calls whole
                at = self.text.find(OPEN)
                rest, self.sent = self.text[self.sent:at] if at >= 0 else "", len(self.text)
                return rest, calls, [CallPart(j, c["id"], c["function"]["name"], c["function"]["arguments"], True)
                                     for j, c in enumerate(calls)]
            end = len(self.text) if content == self.text else self.text.find(OPEN)  # (a cut-off call: dropped)
            rest, self.sent = self.text[self.sent:end], len(self.text)
            return rest, [], []
        parts = []
        for j, call in enumerate(calls):
            fn = call["function"]
            if j >= len(self.calls):
                parts.append(CallPart(j, call["id"], fn["name"], fn["arguments"], True))
                continue
            s = self.calls[j]
            sent = self.text[s.start:s.sent]
            call["id"] = s.id
            if fn["name"] == s.name and fn["arguments"].startswith(sent):
                if len(fn["arguments"]) > len(sent):
                    parts.append(CallPart(j, s.id, None, fn["arguments"][len(sent):]))
            else:  # read otherwise from the whole reply (a repeated key): the text sent stands
                fn["name"], fn["arguments"] = s.name, sent
        return "", calls, parts

    def _content(self) -> str:
        if self.sent == 0 and self.names and OPEN not in self.text and _may_be_bare_call(self.text):
            return ""  # wait: the whole reply may be a bare JSON call (a reply with a block is not one)
        at = self.text.find(OPEN, max(0, self.sent - len(OPEN)))
        if at >= 0:
            self.seek = upto = at
        else:
            upto = len(self.text) - _partial_open(self.text)
        out = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return out

    def _parts(self) -> list[CallPart]:
        parts: list[CallPart] = []
        while not self.held:
            call = self.calls[-1] if self.calls else None
            if call is not None and call.done:
                if self.seek < call.pos:  # its closing tag not seen yet
                    close = self.text.find(CLOSE, call.pos)
                    if close < 0:
                        break
                    self.seek = close + len(CLOSE)
                call = None
            if call is None:  # between calls: the next one's head
                if self.single and self.calls:
                    break
                at = self.text.find(OPEN, self.seek)
                if at < 0:  # (text after a call: not searched again)
                    self.seek = max(self.seek, len(self.text) - len(OPEN) + 1)
                    break
                head = _head(self.text, at + len(OPEN))
                if head is None and len(self.text) - at > _MAX_HEAD:
                    head = False  # no name of a function runs this long
                if head is None:
                    break
                if head is False or self.text[head[1]] != "{":
                    self.held = True
                    break
                self.seek = at
                call = _Call(*head)
                self.calls.append(call)
                parts.append(CallPart(len(self.calls) - 1, call.id, call.name))
            end = call.read(self.text)
            if end > call.sent:
                parts.append(CallPart(len(self.calls) - 1, call.id, None, self.text[call.sent:end]))
                call.sent = end
            if call.bad:
                self.held = True
            if not call.done:
                break
        return parts


def _head(text: str, at: int) -> tuple[str, int] | bool | None:
    """(the function's name, where the arguments' value starts) if ``text`` from ``at`` opens a call
    as ``_HEAD`` has it and its value has begun; None if the text so far may still; False if not."""
    name = None
    for item in _HEAD:
        at = skip_space(text, at)
        if at >= len(text):
            return None
        if item is _NAME:
            end = _string_end(text, at)
            if end == 0:
                return False
            if end < 0:
                return None
            try:
                name = json.loads(text[at:end])
            except ValueError:
                return False
            at = end
            continue
        piece = text[at:at + len(item)]
        if not item.startswith(piece):
            return False
        if len(piece) < len(item):
            return None
        at += len(item)
    at = skip_space(text, at)
    return (name, at) if at < len(text) else None


def _string_end(text: str, at: int) -> int:
    """Just past the JSON string that starts at ``at``: 0 if none starts there, -1 if it is not closed yet."""
    if text[at] != '"':
        return 0
    i, escape = at + 1, False
    while i < len(text):
        c = text[i]
        if escape:
            escape = False
        elif c == "\\":
            escape = True
        elif c == '"':
            return i + 1
        i += 1
    return -1


def _may_be_bare_call(text: str) -> bool:
    """Whether a reply that begins with ``text`` may still turn out a bare JSON call: it opens an
    object, a list, or a fence whose language is json or none (other code streams at once)."""
    head = text.lstrip()
    if head.startswith(("{", "[")):  # a call object's first key, or a list's first call object, may follow
        after = head[1:].lstrip()
        return not after or after[0] in ('"{' if head[0] == "{" else "{")
    if not head.startswith(FENCE):
        return FENCE.startswith(head)
    info, newline, _ = head[len(FENCE):].partition("\n")
    tag = info.strip().lower()
    if tag[:4] == "json":
        tag = tag[4:].lstrip()
    if not tag or tag[0] in "{[":  # json (or no language), or the object on the fence's line
        return True
    return not newline and "json".startswith(tag)


def _partial_open(text: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0
