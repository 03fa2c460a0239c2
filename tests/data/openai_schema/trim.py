"""Make schemas.json, the subset of OpenAI's published API schema that tests/test_openai_schema.py
validates our answers against, from openai/openai-openapi's openapi.json:

    python tests/data/openai_schema/trim.py OPENAPI_JSON COMMIT > tests/data/openai_schema/schemas.json

It keeps the schemas the test names (ROOTS) and what they reference, drops descriptions,
narrows the unions whose other branches we never send (UNIONS: only the listed branches are
kept: an answer valid against a narrowed union is valid against the whole one), and rewrites
OpenAPI 3.0's `nullable: true`, which the 3.1 document still uses in places and JSON Schema
ignores, as a `{"type": "null"}` branch.
"""
from __future__ import annotations

import json
import sys

ROOTS = ["CreateCompletionResponse", "CreateChatCompletionResponse", "CreateChatCompletionStreamResponse",
         "ListModelsResponse", "Model", "Response", "ResponseCreatedEvent", "ResponseInProgressEvent",
         "ResponseCompletedEvent", "ResponseIncompleteEvent", "ResponseOutputItemAddedEvent",
         "ResponseOutputItemDoneEvent", "ResponseContentPartAddedEvent", "ResponseContentPartDoneEvent",
         "ResponseTextDeltaEvent", "ResponseTextDoneEvent", "ResponseFunctionCallArgumentsDeltaEvent",
         "ResponseFunctionCallArgumentsDoneEvent", "ResponseReasoningTextDeltaEvent",
         "ResponseReasoningTextDoneEvent", "ErrorResponse"]
UNIONS = {"OutputItem": {"OutputMessage", "FunctionToolCall", "ReasoningItem"},
          "Tool": {"FunctionTool"},
          "ToolChoiceParam": {"ToolChoiceOptions", "ToolChoiceFunction"},
          "InputItem": {"EasyInputMessage"}, "InputContent": {"InputTextContent"}}
_DROP_KEYS = ("description", "example", "examples", "x-oaiMeta", "title")


def _refs(node, out: set[str]) -> None:
    if isinstance(node, dict):
        if "$ref" in node:
            out.add(node["$ref"].rsplit("/", 1)[-1])
        for v in node.values():
            _refs(v, out)
    elif isinstance(node, list):
        for v in node:
            _refs(v, out)


def _strip(node):
    if isinstance(node, dict):
        out = {k: _strip(v) for k, v in node.items()
               if (k not in _DROP_KEYS or not isinstance(v, str)) and k != "nullable"}
        return {"anyOf": [out, {"type": "null"}]} if node.get("nullable") is True else out
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def _narrow(name: str, schema: dict) -> dict:
    keep = UNIONS.get(name)
    if keep is None:
        return schema
    for key in ("oneOf", "anyOf"):
        if key in schema:
            schema = dict(schema, **{key: [b for b in schema[key]
                                            if b.get("$ref", "").rsplit("/", 1)[-1] in keep]})
    schema.pop("discriminator", None)
    return schema


def trim(spec: dict) -> dict:
    schemas = spec["components"]["schemas"]
    out: dict[str, dict] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out[name] = _strip(_narrow(name, schemas[name]))
        found: set[str] = set()
        _refs(out[name], found)
        todo += sorted(found)
    return dict(sorted(out.items()))


if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    print(json.dumps({"source": "https://github.com/openai/openai-openapi openapi.json",
                      "commit": sys.argv[2], "components": {"schemas": trim(spec)}}, indent=1))
