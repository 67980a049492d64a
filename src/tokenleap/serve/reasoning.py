"""A reasoning model's thinking, split from its reply as vLLM's reasoning parsers and llama.cpp's
``--reasoning-format`` split it: the text of a ``<think> ... </think>`` block at the start of the
reply (Qwen3, DeepSeek-R1 and their distills, SmolLM3) is the reply's ``reasoning_content``, the
rest its content.

The block either starts the reply or was opened by the chat template's generation prompt (templates
that end the prompt with ``<think>``); a reply that does not start with one has no reasoning. A
reply that ends inside the block (its budget ran out) is all reasoning. Whitespace around the
thinking and between it and the answer is dropped. ``ReasoningStream`` splits a streamed reply; the
whole reply is split by the same code (``split_reasoning``), so both give the same two texts.
"""
from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


def template_thinks(chat_template: str | None) -> bool:
    """Whether a chat template writes thinking blocks (it names the closing tag)."""
    return bool(chat_template) and CLOSE in chat_template


def opened_by(prompt_tail: str) -> bool:
    """Whether the prompt (its last tokens' text) leaves a thinking block open for the reply."""
    at = prompt_tail.rfind(OPEN)
    return at >= 0 and CLOSE not in prompt_tail[at:]


@dataclass(frozen=True)
class Reasoning:
    """How one chat request's replies are split: ``opened`` by the prompt; ``include``: the thinking
    is returned (vLLM's include_reasoning), else dropped."""

    opened: bool = False
    include: bool = True

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self.opened)

    def split(self, text: str) -> tuple[str | None, str]:
        return split_reasoning(text, self.opened)


class ReasoningStream:
    """Feed a reply's text as it comes; each ``feed`` gives the (reasoning, content) text that is
    certain so far, holding back what could still be part of a tag or trailing whitespace."""

    def __init__(self, opened: bool = False) -> None:
        self.state = "think" if opened else "start"  # start -> think -> answer -> plain, or start -> plain
        self.buf = ""
        self.thought = False  # some reasoning text was given out (leading whitespace is dropped before it)
        self.has_reasoning = opened  # a thinking block opened (by the prompt or the reply)

    def feed(self, piece: str) -> tuple[str, str]:
        self.buf += piece
        reasoning = content = ""
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(OPEN):
                    self.state, self.buf, self.has_reasoning = "think", head[len(OPEN):], True
                    continue
                if OPEN.startswith(head):  # (empty or a prefix of the tag: not decided yet)
                    return reasoning, content
                self.state = "plain"
            if self.state == "plain":
                content, self.buf = content + self.buf, ""
                return reasoning, content
            if self.state == "think":
                end = self.buf.find(CLOSE)
                if end >= 0:
                    reasoning += self._thought(self.buf[:end].rstrip())
                    self.state, self.buf = "answer", self.buf[end + len(CLOSE):]
                    continue
                keep = _held(self.buf)
                reasoning += self._thought(self.buf[:keep])
                self.buf = self.buf[keep:]
                return reasoning, content
            # answer: the whitespace between the block and the answer is dropped
            content, self.buf = self.buf.lstrip(), ""
            if content:
                self.state = "plain"
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, at the reply's end."""
        rest, self.buf = self.buf, ""
        if self.state == "think":
            return self._thought(rest.rstrip()), ""
        if self.state == "answer":
            return "", rest.lstrip()
        return "", rest

    def _thought(self, text: str) -> str:
        if not self.thought:
            text = text.lstrip()
            self.thought = bool(text)
        return text


def _held(buf: str) -> int:
    """Where the text a thinking block may still end in begins: a tail that is a prefix of the
    closing tag, and the whitespace before it."""
    keep = len(buf)
    for n in range(min(len(CLOSE) - 1, len(buf)), 0, -1):
        if CLOSE.startswith(buf[-n:]):
            keep = len(buf) - n
            break
    return len(buf[:keep].rstrip())


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning, content) of a whole reply; reasoning None when it has no thinking block."""
    stream = ReasoningStream(opened)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    return (r1 + r2 if stream.has_reasoning else None), c1 + c2
