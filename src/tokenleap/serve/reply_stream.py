"""A streamed reply's text as the API writers need it, whatever their event format: a thinking
model's reasoning split off (``reasoning.py``), the content held back from where a tool call may
begin, the calls in parts as the model writes them (``tool_stream.ToolStream``), and the calls
whole once the reply is complete."""
from __future__ import annotations

from tokenleap.serve.reasoning import Reasoning
from tokenleap.serve.tool_stream import CallPart, ToolStream
from tokenleap.serve.tools import ToolPlan


class ReplyStream:
    """One reply's splitter (``reasoning``: how the request's replies are split, or None; ``tools``:
    its tool plan)."""

    def __init__(self, reasoning: Reasoning | None, tools: ToolPlan) -> None:
        self.thinking = reasoning.stream() if reasoning is not None else None
        self.include = reasoning is not None and reasoning.include
        self.calling = ToolStream(tools.prefix, tools.names, tools.single) if tools.parse else None

    def feed(self, piece: str, last: bool, keep_cut: bool = False) -> tuple[str, str, list[CallPart], list[dict]]:
        """(reasoning to send, content to send, parts of calls to send, the calls: only with ``last``)
        for the reply's next ``piece`` of text (``last``: the reply ends with it; ``keep_cut``: a call
        it ends inside is one of the calls, ``tools.parse_tool_calls``')."""
        thought = ""
        if self.thinking is not None:
            thought, piece = self.thinking.feed(piece)
            if last:
                more, rest = self.thinking.finish()
                thought, piece = thought + more, piece + rest
        calls: list[dict] = []
        parts: list[CallPart] = []
        if self.calling is not None:
            piece, parts = self.calling.feed(piece)
            if last:
                rest, calls, more = self.calling.finish(keep_cut)
                piece, parts = piece + rest, parts + more
        return (thought if self.include else ""), piece, parts, calls
