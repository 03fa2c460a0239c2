"""One constraint checked and compiled, as the grammar compiler's process does it
(server/grammar_compiler.py): bounded (server/grammar_bounds.py), made into an llguidance grammar
(ipc/structured.py `to_grammar`), compiled against the model's tokenizer, then probed: a matcher
walks a few tokens the way the engine will (the same parallel mask fill, then the lowest
allowed token), so a grammar llguidance only refuses once generation starts (a row of more
than 2,000 items, a grammar whose every token fast-forwards for ever) is refused here, not by
the engine mid-request."""
from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from ringserve.ipc.structured import GrammarError, StructuredOutputsParams, compile_grammar, to_grammar
from ringserve.server import json_text
from ringserve.server.config import StructuredOutputsConfig
from ringserve.server.grammar_bounds import Refused, check_grammar_text, check_schema

PROBE_TOKENS = 8  # tokens the probe walks (each a mask fill and an advance: ~0.1-1 ms)


class Job(msgspec.Struct, array_like=True):
    param: str                       # the request field, named in every refusal
    spec: StructuredOutputsParams


class Outcome(msgspec.Struct, array_like=True, omit_defaults=True):
    grammar: str | None = None       # the llguidance grammar for the engine, or
    error: str | None = None         # why the constraint is a 400


def bounded(spec: StructuredOutputsParams, param: str,
            cfg: StructuredOutputsConfig) -> StructuredOutputsParams:
    """`spec` within the limits, its JSON text (if any) parsed with the depth limit."""
    if spec.json is not None:
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json_text.loads(schema, cfg.max_json_depth, param)
            except json_text.NotJSON as e:
                raise Refused(f"{param}: the JSON schema is not JSON: {e}") from None
            except json_text.TooDeep as e:
                raise Refused(str(e)) from None
        check_schema(schema, param, cfg)
        return msgspec.structs.replace(spec, json=schema)
    if spec.grammar is not None:
        check_grammar_text(spec.grammar, param, cfg)
    return spec


def check_and_compile(job: Job, tokenizer: Any, executor: Any,
                      cfg: StructuredOutputsConfig) -> Outcome:
    param = job.param
    try:
        spec = bounded(job.spec, param, cfg)
        grammar = to_grammar(spec)
        probe(compile_grammar(grammar, tokenizer, param), tokenizer, executor, param)
    except (Refused, GrammarError) as e:
        return Outcome(error=str(e))
    except RecursionError:
        return Outcome(error=f"{param} is nested too deeply to compile")
    except (ValueError, TypeError) as e:  # llguidance's own refusal of a malformed input
        return Outcome(error=f"invalid {param}: {_first_line(str(e))}")
    except BaseException as e:
        # pyo3 turns a panic of llguidance's Rust into PanicException, a BaseException ("panic:
        # assertion failed" on a 16,000-property schema): a refusal like any other.
        if type(e).__name__ != "PanicException":
            raise
        return Outcome(error=f"invalid {param}: llguidance failed on it: {_first_line(str(e))}")
    return Outcome(grammar=grammar)


def probe(matcher: Any, tokenizer: Any, executor: Any, param: str) -> None:
    """Walk a fresh matcher PROBE_TOKENS tokens (the lowest allowed one that is not EOS each
    time) with the engine's mask fill; GrammarError if llguidance fails on the way or allows
    nothing."""
    import llguidance.numpy as lln

    vocab = tokenizer.vocab_size
    mask = np.zeros((1, (vocab + 31) // 32), np.int32)
    eos = set(tokenizer.eos_tokens)
    for _ in range(PROBE_TOKENS):
        if matcher.is_error() or matcher.is_stopped():
            break
        lln.fill_next_token_bitmask_par(executor, [(matcher, 0)], mask)
        if matcher.is_error():
            break
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab])
        tokens = [int(t) for t in allowed[:len(eos) + 1] if int(t) not in eos]
        if not tokens:
            if not len(allowed):
                raise GrammarError(f"invalid {param}: the grammar allows no token", param)
            break  # only EOS: the grammar is complete
        matcher.consume_token(tokens[0])
    if matcher.is_error():
        raise GrammarError(f"invalid {param}: llguidance refuses it once generation starts: "
                           f"{_first_line(matcher.get_error())}", param)


def _first_line(message: str) -> str:
    """llguidance's messages go on with the parser's state dump (the grammar, the tokens)."""
    return message.strip().split("\n", 1)[0][:500]
