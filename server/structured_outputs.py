"""A request's structured-output constraint, from whichever field names it, compiled here.

The names a client may use (OpenAI's and vLLM's, completions and chat alike):
`response_format` `{"type": "json_object"}` / `{"type": "json_schema", "json_schema": {"name",
"schema", "strict"}}`; vLLM's `structured_outputs` object (json, regex, choice, grammar) and its
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. At most one of them.
The constraint's size is bounded here (--max-grammar-bytes, --max-choices, --max-choice-bytes:
len() checks, nothing that walks it), then the worker's grammar compiler
(server/grammar_compiler.py) bounds the rest, makes it one llguidance grammar (ipc/structured.py
`to_grammar`) and compiles it against the model's tokenizer in a process of its own, so that an
invalid or hostile schema, regex or grammar is a 400 naming the field before anything reaches an
engine; the engine enforces it token by token (engine/structured_outputs.py).
"""
from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct

from ringserve.ipc.structured import StructuredOutputsParams
from ringserve.server.config import StructuredOutputsConfig
from ringserve.server.errors import bad_request


class JsonSchemaFormat(Struct, kw_only=True, forbid_unknown_fields=False):
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | bool | None = None   # None: any JSON value... as OpenAI: an object
    strict: bool | None = None


class ResponseFormat(Struct, kw_only=True, forbid_unknown_fields=False):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# vLLM's older per-kind fields -> the StructuredOutputsParams field they fill.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def requested(req: Any) -> tuple[StructuredOutputsParams, str] | None:
    """The request's constraint and the field that asked for it (its `param` in a 400), or None."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    rf: ResponseFormat | None = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append((StructuredOutputsParams(json_object=True), "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise bad_request("response_format of type json_schema needs a json_schema object",
                              param="response_format.json_schema")
        schema = rf.json_schema.schema
        found.append((StructuredOutputsParams(json={"type": "object"} if schema is None else schema),
                      "response_format.json_schema.schema"))
    if req.structured_outputs is not None:
        so: StructuredOutputsParams = req.structured_outputs
        kinds = so.kinds()
        if len(kinds) != 1:
            raise bad_request("structured_outputs must set exactly one of json, regex, choice, "
                              f"grammar or json_object, got {kinds or 'none'}",
                              param="structured_outputs")
        found.append((so, f"structured_outputs.{kinds[0]}"))
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(req, name)
        if value is not None:
            found.append((StructuredOutputsParams(**{kind: value}), name))
    if len(found) > 1:
        raise bad_request(f"only one structured-output constraint may be given, got "
                          f"{', '.join(param for _, param in found)}", param=found[1][1])
    return found[0] if found else None


async def compile_request(req: Any, ctx: Any,
                          tools: tuple[StructuredOutputsParams, str] | None = None) -> str | None:
    """The llguidance grammar the engine is to enforce for `req` (None: unconstrained); `tools`:
    the constraint of a required or named tool choice and the field it comes from
    (server/tool_calls.py). ctx: the ServerContext (its limits and grammar compiler). Every
    failure is a 400 whose `param` names the field."""
    asked = requested(req)
    if tools is not None:
        if asked is not None:
            raise bad_request(f"{asked[1]} cannot be combined with a required or named "
                              "tool_choice (it constrains the output itself)", param=asked[1])
        asked = tools
    if asked is None:
        return None
    spec, param = asked
    check_size(spec, param, ctx.structured)
    return await ctx.grammars.compile(spec, param)


def check_size(spec: StructuredOutputsParams, param: str, cfg: StructuredOutputsConfig) -> None:
    """The bounds that cost a len(): the constraint's bytes, a choice list's length and bytes."""
    if spec.choice is not None:
        if len(spec.choice) > cfg.max_choices:
            raise bad_request(f"{param} has {len(spec.choice)} choices, more than the limit "
                              f"{cfg.max_choices} (--max-choices)", param=param)
        size = sum(len(c.encode()) for c in spec.choice)
        if size > cfg.max_choice_bytes:
            raise bad_request(f"{param} has {size} bytes of choices, more than the limit "
                              f"{cfg.max_choice_bytes} (--max-choice-bytes)", param=param)
        return
    text = spec.json if spec.json is not None else spec.regex or spec.grammar or ""
    size = len(text.encode() if isinstance(text, str) else msgspec.json.encode(text))
    if size > cfg.max_grammar_bytes:
        raise bad_request(f"{param} has {size} bytes, more than the limit "
                          f"{cfg.max_grammar_bytes} (--max-grammar-bytes)", param=param)
