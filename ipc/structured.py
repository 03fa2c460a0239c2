"""Structured outputs: what a constraint is, and its one canonical form, an llguidance grammar.

vLLM's `StructuredOutputsParams` names (json, regex, choice, grammar, json_object) are the
request's; `to_grammar` turns any of them into the llguidance grammar string that travels to the
engine in `SamplingParams.structured_outputs` (a ring record: the engine compiles it again and
trusts nothing), and `compile_grammar` compiles it against a tokenizer. Both sides use these, the
way both apply ipc/limits.py: the frontend answers 400 naming the field before anything reaches
an engine (its grammar compiler's processes run them, server/grammar_compiler.py), the engine
refuses what still does not compile (engine/structured_outputs.py). `make_ll_tokenizer` is the
one way to build llguidance's view of a model's tokenizer.json, for the frontend's check and for
the engine's matchers.

llguidance (PyPI `llguidance`: Rust, no PyTorch; what vLLM and llama.cpp use) computes the
allowed next tokens as a bitmask over the vocabulary, one int32 word per 32 tokens.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, cast

import msgspec

# JSON is written without free whitespace: a small model could otherwise fill max_tokens with
# spaces and newlines inside a valid document (vLLM's guidance backend turns it off the same way
# when asked). Separators are OpenAI's compact ones.
_JSON_OPTIONS = {"whitespace_flexible": False}


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True,
                              forbid_unknown_fields=True):
    """One constraint on a request's output (vLLM's names; exactly one may be set)."""
    json: Any = None                  # a JSON schema: an object, or its JSON text
    regex: str | None = None          # the whole output full-matches it
    choice: list[str] | None = None   # the output is exactly one of these
    grammar: str | None = None        # a Lark grammar (llguidance's dialect) or a GBNF one
    json_object: bool | None = None   # any JSON object (response_format json_object)

    def kinds(self) -> list[str]:
        return [k for k in ("json", "regex", "choice", "grammar", "json_object")
                if getattr(self, k) not in (None, False)]


class GrammarError(ValueError):
    """A constraint that cannot be compiled; `field` names the part at fault."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def to_grammar(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for `spec` (not yet compiled: compile_grammar does that).
    Raises GrammarError naming the field."""
    import llguidance
    from llguidance import LLMatcher

    kinds = spec.kinds()
    if len(kinds) != 1:
        raise GrammarError("exactly one of json, regex, choice, grammar or json_object must be "
                           f"given, got {kinds or 'none'}", kinds[1] if len(kinds) > 1 else "json")
    kind = kinds[0]
    if kind in ("json", "json_object"):
        return _json_grammar({"type": "object"} if kind == "json_object" else spec.json, kind)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(cast(str, spec.regex))
    if kind == "choice":
        choices = spec.choice or []
        if not choices or any(c == "" for c in choices):
            raise GrammarError("choice must be a non-empty list of non-empty strings", kind)
        # One alternative per choice, each a JSON-escaped Lark string literal.
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    try:  # Lark, or GBNF (llama.cpp's), which llguidance converts to Lark
        return llguidance.grammar_from("grammar", cast(str, spec.grammar))
    except ValueError as e:
        raise GrammarError(str(e), kind) from None


def _json_grammar(schema: Any, kind: str) -> str:
    from llguidance import LLMatcher

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not JSON: {e}", kind) from None
        except RecursionError:
            raise GrammarError("the JSON schema is nested too deeply", kind) from None
    if isinstance(schema, bool):  # JSON Schema's true (anything) and false (nothing)
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object", kind)
    try:
        if not _finite(schema):
            raise GrammarError("the JSON schema holds a number that is not finite", kind)
        options = schema.get("x-guidance")
        schema = {**schema, "x-guidance": {**_JSON_OPTIONS,
                                           **(options if isinstance(options, dict) else {})}}
        return LLMatcher.grammar_from_json_schema(json.dumps(schema))
    except RecursionError:
        raise GrammarError("the JSON schema is nested too deeply", kind) from None


def compile_grammar(grammar: str, tokenizer: Any, field: str) -> Any:
    """`grammar` compiled against an LLTokenizer: a fresh llguidance LLMatcher at its start;
    GrammarError naming `field` if it does not compile. One compile: the matcher is the check
    (its error is validate_grammar's message, which would compile it a second time)."""
    from llguidance import LLMatcher

    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(f"invalid {field}: {matcher.get_error().strip()}", field)
    return matcher


def make_ll_tokenizer(tokenizer_json: str, vocab_size: int | None,
                      eos_token_ids: list[int] | int | None) -> Any:
    """llguidance's LLTokenizer for a model's tokenizer.json (its text). vocab_size: the width
    of the model's logits (the bitmask's), eos_token_ids: the ids that end a finished grammar.
    ~0.2 s for a 49k vocabulary: made once per process, when first needed."""
    from llguidance import LLTokenizer

    return LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids)


def tokenizer_json(model_dir: str | Path) -> str:
    return (Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8")


def _finite(x: Any) -> bool:
    if isinstance(x, float):
        return math.isfinite(x)
    if isinstance(x, dict):
        return all(_finite(v) for v in x.values())
    if isinstance(x, list):
        return all(_finite(v) for v in x)
    return True
