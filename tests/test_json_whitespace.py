"""A JSON reply's whitespace is bounded: one line break and an indentation between two tokens, so a
small model cannot pad a reply with newlines until its token limit; compact and pretty-printed JSON
both pass, and a schema that sets llguidance's own JSON options keeps them."""
from __future__ import annotations

import json

import pytest

from tokenleap.config import StructuredOutput
from tokenleap.spec.structured import Constraints

from test_structured import VOCAB, CharTokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
    "type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}}}, "required": ["name", "tags"]}
VALUE = {"name": "x y", "tags": [{"k": 1}, {"k": 22}]}


class LinesTokenizer(CharTokenizer):
    """The test tokenizer with token 0 a newline and token 98 a tab."""

    SPECIAL = {"\n": 0, "\t": 98}

    def piece(self, i):
        return {0: "\n", 98: "\t"}[i] if i in (0, 98) else CharTokenizer.piece(self, i)

    def encode(self, text):
        return [self.SPECIAL[c] if c in self.SPECIAL else CharTokenizer.encode(self, c)[0] for c in text]


def accepts(spec: StructuredOutput, text: str) -> bool:
    """Whether the grammar takes ``text`` whole and may end there."""
    tok = LinesTokenizer()
    constraint = Constraints(tok, VOCAB, (2,)).make(spec)
    for t in tok.encode(text):
        if not constraint.allowed()[t]:
            return False
        constraint.advance([t])
    return bool(constraint.allowed()[2])


@pytest.mark.parametrize("spec", [StructuredOutput(json=SCHEMA), StructuredOutput(json_object=True)])
def test_json_replies_take_one_line_break_and_its_indentation(spec):
    for indent in (None, 2, 4, "\t"):
        assert accepts(spec, json.dumps(VALUE, indent=indent)), indent
    assert accepts(spec, json.dumps(VALUE, separators=(",", ":")))
    assert not accepts(spec, '{\n\n"name": "x y", "tags": []}')  # a blank line: a run that could go on
    assert not accepts(spec, '{"name": "x y",' + "\n" + " " * 41 + '"tags": []}')
    assert accepts(spec, '{"name": "x y",' + "\n" + " " * 40 + '"tags": []}')


def test_a_schema_with_its_own_json_options_keeps_them():
    loose = StructuredOutput(json={**SCHEMA, "x-guidance": {"whitespace_flexible": True}})
    assert accepts(loose, '{\n\n\n\n"name": "x y", "tags": []}')
    tight = StructuredOutput(json={**SCHEMA, "x-guidance": {"whitespace_flexible": False}})
    assert not accepts(tight, '{\n"name": "x y", "tags": []}')
