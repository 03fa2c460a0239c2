"""JSON that a client sends as text inside a request (a schema string, an earlier tool call's
`arguments`) or as a value to be compiled (a schema, tool parameters): parsed and measured with
a depth limit (--max-json-depth), so that no nesting reaches a recursion limit anywhere (the
decoder's, llguidance's, a chat template's `tojson`). TooDeep's message names field and flag."""
from __future__ import annotations

from typing import Any

import msgspec


class NotJSON(ValueError):
    """The text is not JSON (the caller decides: a 400, or keep it as text)."""


class TooDeep(ValueError):
    """JSON nested deeper than --max-json-depth."""

    def __init__(self, param: str, depth: int | None, limit: int):
        got = "" if depth is None else f", got {depth}"
        super().__init__(f"{param} is JSON nested more than {limit} levels deep "
                         f"(--max-json-depth){got}")
        self.param = param


def loads(text: str, max_depth: int, param: str) -> Any:
    """The JSON value of `text`; NotJSON when it is not JSON, TooDeep when it nests deeper
    than `max_depth`."""
    try:
        value = msgspec.json.decode(text)  # C; refuses NaN/Infinity, which are not JSON
    except RecursionError:  # deeper than the interpreter's recursion limit: far over ours
        raise TooDeep(param, None, max_depth) from None
    except msgspec.DecodeError as e:
        raise NotJSON(str(e)) from None
    check_depth(value, max_depth, param)
    return value


def depth(value: Any) -> int:
    """Nesting of a decoded JSON value: 0 for a scalar, 1 for a flat list or object (no
    recursion: the value may be as deep as the decoder allowed)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if not isinstance(v, (dict, list)):
            continue
        children = v.values() if isinstance(v, dict) else v
        deepest = max(deepest, d)
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def check_depth(value: Any, max_depth: int, param: str) -> None:
    d = depth(value)
    if d > max_depth:
        raise TooDeep(param, d, max_depth)
