"""A request body read: JSON bytes to a validated request model (``protocol``'s), or a 400 that says
what is wrong -- which field, and why, in words rather than pydantic's union-member tags."""
from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

from pydantic import ValidationError

from tokenleap.serve.protocol import APIError, _Strict, bad_request

MAX_BODY_BYTES = 16 * 1024 * 1024


def parse_body(raw: bytes, model: type[_Strict]) -> Any:
    """JSON bytes -> a validated request model, or a 400 that says what is wrong."""
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"request body over {MAX_BODY_BYTES} bytes", "invalid_request_error")
    try:
        data = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = _most_telling(e.errors())
        loc = [str(p) for p in err["loc"] if isinstance(p, int) or _field_name(str(p))]  # no union member names
        param = loc[0] if loc else None
        raise bad_request(f"invalid value for {'.'.join(loc) or 'the body'}: {err['msg']}", param) from None


def _most_telling(errors: list[dict]) -> dict:
    """The validation error to report: a value of the right type but out of range says more than the
    union members' type mismatches; else the mismatch in the union member that failed least, deepest
    first ([1, "a"] for a prompt: item 1 is not an id, rather than "not a string")."""
    ranged = next((x for x in errors if not x["type"].endswith("_type")), None)
    if ranged is not None:
        return ranged

    def member(x: dict) -> tuple:  # the location up to its first union member's tag
        loc = x["loc"]
        i = next((i for i, p in enumerate(loc) if isinstance(p, str) and not _field_name(p)), len(loc))
        return tuple(loc[:i + 1])

    failures = Counter(member(x) for x in errors)
    return min(errors, key=lambda x: (failures[member(x)], -len(x["loc"])))


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "none", "list", "dict"})


def _field_name(part: str) -> bool:
    """Whether a validation error's location part is a field name, not a union member's tag (a type
    such as ``str`` or ``list[int]``, or a model class such as ``TextPart``)."""
    return part.isidentifier() and part not in _TYPE_TAGS and not part[0].isupper()


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a valid JSON number")


def _finite_float(text: str) -> float:
    """A JSON number with a fraction or exponent; one past the float64 range (``1e999``) is refused,
    as vLLM does, rather than becoming infinity."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range (not a finite 64-bit float)")
    return value
