"""Issue 33 items 1-3: no constraint can crash a worker or freeze its neighbours. Every schema,
regex, choice list, grammar and tool schema is bounded (StructuredOutputsConfig's flags) and
compiled in the worker's grammar-compiler processes (server/grammar_compiler.py), off its
event loop, with a time budget and a cache; JSON given as text is parsed with a depth limit.

The bounds and the probe run in-process against the real tokenizer; the compiler's processes
are real (a crash is a real SIGSEGV); the hostile shapes of the issue go to a real server on
the default model beside live streams."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from conftest import child_pids, cmdline, descendants
from ringserve.ipc.structured import StructuredOutputsParams as S
from ringserve.server.config import StructuredOutputsConfig

pytestmark = pytest.mark.slow

DEEP = 50_000


# --- the shapes -----------------------------------------------------------------------------

def lark_chain(n: int) -> str:
    """A chain of n rules, each only the next one (the issue's 2,678 rules crashed a worker)."""
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "x"'


def ref_chain(n: int) -> dict:
    """$defs forming an n-link anyOf/$ref chain (the issue's 3,000 links crashed a worker)."""
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "null"}]} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def optional_properties(n: int, tag: str = "p") -> dict:
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string"} for i in range(n)}}


LARK_ALTERNATIVES = ("start: " + " | ".join(f"r{i}" for i in range(10_000)) + "\n"
                     + "\n".join(f'r{i}: "x{i}"' for i in range(10_000)))


# --- bounds and probe, in-process ----------------------------------------------------------------

@pytest.fixture(scope="module")
def compile_here(default_model_dir):
    """check_and_compile as a compiler process runs it (the same tokenizer, mask fill, config)."""
    from llguidance import LLExecutor

    from ringserve.ipc.structured import make_ll_tokenizer, tokenizer_json
    from ringserve.server.grammar_check import Job, check_and_compile
    tok = make_ll_tokenizer(tokenizer_json(default_model_dir), None, [2])
    executor = LLExecutor()

    def run(spec: S, cfg: StructuredOutputsConfig | None = None) -> str | None:
        """The refusal's message, or None when it compiles."""
        return check_and_compile(Job("f", spec), tok, executor, cfg or StructuredOutputsConfig()).error
    return run


REFUSED = [  # (constraint, what the 400 says) under the default limits
    (S(grammar=lark_chain(2678)), "--max-grammar-rules"),
    (S(grammar=lark_chain(500)), "--max-grammar-depth"),
    (S(grammar="start: " + "(" * 200 + '"a"' + ")" * 200), "--max-grammar-depth"),
    (S(json=ref_chain(3000)), "--max-grammar-items"),
    (S(json=ref_chain(100)), "--max-grammar-depth"),
    (S(json="[" * DEEP + "]" * DEEP), "--max-json-depth"),
    (S(json=json.dumps(ref_chain(3000))), "--max-grammar-items"),
    (S(grammar='start: "a" start'), "can never finish"),
    (S(grammar='root ::= "a" root'), "can never finish"),
    (S(grammar='start: x\nx: "a" x | "b" y\ny: y "c"'), "can never finish"),
    (S(grammar='start: "a" (start | "b" start)'), "can never finish"),
    (S(grammar=LARK_ALTERNATIVES), "--max-grammar-rules"),
    (S(json=optional_properties(5000)), "--max-grammar-items"),
    (S(json=optional_properties(600)), "Current row has"),  # llguidance's row limit, by the probe
    (S(json={"enum": list(range(3000))}), "--max-grammar-items"),
]


@pytest.mark.parametrize("spec, message", REFUSED)
def test_bounds_and_probe_refuse_before_the_engine(compile_here, spec, message):
    error = compile_here(spec)
    assert error is not None and message in error, error
    assert error.startswith("f ") or error.startswith("invalid f"), error  # names the field


def test_what_llguidance_only_refuses_once_generating_is_caught_by_the_probe(compile_here):
    """With the static limits raised, the probe still refuses what the engine would fail on
    (the issue's 500s: "Current row has 10001 items", "... 20007 items")."""
    loose = StructuredOutputsConfig(max_grammar_items=100_000, max_grammar_rules=100_000)
    for spec, items in ((S(grammar=LARK_ALTERNATIVES), "10001"),
                        (S(json=optional_properties(5000)), "20007")):
        error = compile_here(spec, loose)
        assert error is not None and f"Current row has {items} items" in error, error


ACCEPTED = [
    S(grammar='start: "a" start | "b"'),                  # right recursion that ends
    S(grammar='root ::= ("a" root) | "b"'),
    S(grammar='root ::= "a"* "b"'),
    S(grammar='start: greeting " " NAME "!"\ngreeting: "hello" | "hi"\nNAME: /[A-Z][a-z]{1,8}/'),
    S(grammar='start: item+\nitem: "x" ~ 0..3 ";"\n'),
    S(grammar='start: [ "a" start ] "b"'),
    S(grammar="start: x\nx: %json {\"type\": \"integer\"}"),
    S(grammar=lark_chain(100)),
    S(json=ref_chain(30)),
    S(json={"$defs": {"node": {"type": "object", "properties": {"kids": {
        "type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}}}, "$ref": "#/$defs/node"}),
    S(json=optional_properties(400)),
    S(json={"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1900)},
            "required": [f"p{i}" for i in range(1900)]}),
    S(choice=[f"c{i}" for i in range(1000)]),
    S(regex="[0-9]{3}-[a-z]{2,4}"),
]


@pytest.mark.parametrize("spec", ACCEPTED)
def test_usual_and_recursive_grammars_still_compile(compile_here, spec):
    assert compile_here(spec) is None


@pytest.mark.parametrize("field, low, high", [
    ("max_grammar_bytes", 0, 1 << 27), ("max_grammar_rules", -1, 1 << 21),
    ("max_grammar_depth", 0, 1001), ("max_grammar_items", 0, 1 << 21), ("max_choices", -5, 1 << 21),
    ("max_choice_bytes", 0, 1 << 27), ("max_json_depth", 0, 501),
    ("grammar_compile_processes", 0, 65), ("grammar_compile_queue", -1, 1 << 17),
    ("grammar_cache_size", -1, 1 << 21), ("grammar_compile_timeout", 0, 3601),
])
def test_each_limit_refuses_zero_negative_and_huge(field, low, high):
    flag = "--" + field.replace("_", "-")
    for value in (low, -1, high):
        with pytest.raises(ValueError, match=flag):
            StructuredOutputsConfig(**{field: value})


# --- the compiler's processes -------------------------------------------------------------------

def _compiler(default_model_dir, **cfg):
    from ringserve.server.grammar_compiler import GrammarCompiler
    from ringserve.server.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(default_model_dir)
    return GrammarCompiler(tok.to_json(), None, [tok.eos_token_id], StructuredOutputsConfig(**cfg))


def compiler_processes(root: int) -> list[int]:
    """The grammar-compiler processes under `root`."""
    return [p for p in descendants(root) if "ringserve.server.grammar_compiler" in cmdline(p)]


def test_compiler_caches_kills_slow_compiles_and_survives_a_crash(default_model_dir):
    from ringserve.server.errors import APIError
    gc = _compiler(default_model_dir, max_grammar_items=100_000, max_grammar_bytes=1 << 22,
                   grammar_compile_timeout=1.5, grammar_compile_queue=1)
    good = S(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})

    async def status(spec: S) -> tuple[int, str]:
        try:
            await gc.compile(spec, "f")
            return 200, ""
        except APIError as e:
            return e.status, e.message

    async def scenario() -> None:
        assert await status(good) == (200, "")
        assert await status(good) == (200, "") and gc.compiles == 1  # the second: a cache hit
        # Integers past 64 bits travel too (JSON between the processes, not msgpack).
        assert await status(S(json={"type": "integer", "maximum": 10**30})) == (200, "")
        # Slow (8,000 optional properties: ~10 s uncapped): killed at the budget, a 400.
        t = time.monotonic()
        code, message = await status(S(json=optional_properties(8000)))
        assert code == 400 and "--grammar-compile-timeout" in message, message
        assert 1.4 < time.monotonic() - t < 8
        t = time.monotonic()  # refused from the cache: no second compile
        assert (await status(S(json=optional_properties(8000))))[1] == message
        assert time.monotonic() - t < 0.5 and gc.compiles == 3
        # One compiling, one waiting (the queue holds 1): a third gets 503.
        slow = [asyncio.create_task(status(S(json=optional_properties(8000, tag)))) for tag in "xy"]
        await asyncio.sleep(0.3)
        assert (await status(S(json=optional_properties(8000, "z"))))[0] == 503
        assert [code for code, _ in await asyncio.gather(*slow)] == [400, 400]
        # A native crash (SIGSEGV) mid-compile: a 400 for that constraint, a new process after.
        sent = gc.compiles
        task = asyncio.create_task(status(S(json=optional_properties(8000, "q"))))
        while gc.compiles == sent:  # until it is sent to a (fresh) process
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        (proc,) = compiler_processes(os.getpid())
        os.kill(proc, signal.SIGSEGV)
        code, message = await task
        assert code == 400 and "SIGSEGV" in message, message
        assert await status(S(regex="[a-z]{3}")) == (200, "")
        assert compiler_processes(os.getpid()) not in ([], [proc])
    async def scenario_then_close() -> None:
        try:
            await scenario()
        finally:
            await gc.close()
    asyncio.run(scenario_then_close())


# --- a real server -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(serve, default_model_dir, no_segment_left_behind):
    # A short compile budget and room for the slow schemas (the default limits refuse them
    # before they compile); the issue's crashing shapes are refused by the other limits. The
    # engine keeps to one core and leaves the other to the compile: on the 2-core CI machine
    # the streams' gaps then show the event loop, not two processes sharing the cores.
    return serve(default_model_dir, "--workers", "1", "--max-model-len", "1024",
                 "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                 "--grammar-compile-timeout", "2",
                 "--max-grammar-items", "20000", "--max-grammar-bytes", "1000000",
                 "--cpu-threads", "1", timeout=300)


def worker_pids(server) -> list[int]:
    """The Gunicorn workers: processes whose parent is the Gunicorn master."""
    tree = descendants(server.proc.pid)
    masters = [p for p in tree if "gunicorn" in cmdline(p)
               and not any(p in child_pids(q) for q in tree if "gunicorn" in cmdline(q))]
    return sorted(c for m in masters for c in child_pids(m) if "gunicorn" in cmdline(c))


async def _stream(c: httpx.AsyncClient, tokens: int, i: int) -> tuple[list[float], bool]:
    """A streamed completion: arrival times of its chunks, and whether it ended whole (its
    last chunk's finish_reason "length", then [DONE])."""
    times, finish, done = [], None, False
    async with c.stream("POST", "/v1/completions", json={
            "prompt": f"Story {i}:", "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "temperature": 0.8, "seed": i}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
                finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
            done = line == "data: [DONE]" or (done and not line)
    return times, done and finish == "length"


def _chat(content: str = "Hi", **body) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **body}


def _named_tool(parameters) -> dict:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}}


CRASHING = [  # (path, body, the param the 400 names): the issue's table
    ("/v1/completions", {"prompt": "x", "guided_grammar": lark_chain(2678)}, "guided_grammar"),
    ("/v1/chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "r", "schema": ref_chain(3000)}}), "response_format.json_schema.schema"),
    ("/v1/chat/completions", _chat(**_named_tool(ref_chain(3000))), "tools[0].function.parameters"),
    ("/v1/completions", {"prompt": "x", "guided_json": "[" * DEEP + "]" * DEEP}, "guided_json"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": "[" * DEEP + "]" * DEEP}},
     "structured_outputs.json"),
    ("/v1/completions", {"prompt": "x", "guided_grammar": 'start: "a" start'}, "guided_grammar"),
    ("/v1/completions", {"prompt": "x", "n": 8, "guided_grammar": 'root ::= "a" root'},
     "guided_grammar"),
    ("/v1/completions", {"prompt": "x", "guided_grammar": LARK_ALTERNATIVES}, "guided_grammar"),
    ("/v1/completions", {"prompt": "x", "guided_choice": [f"c{i}" for i in range(50_000)]},
     "guided_choice"),
    ("/v1/chat/completions", _chat(**_named_tool(optional_properties(5000))),
     "tools[0].function.parameters"),
    ("/v1/chat/completions", {"max_tokens": 4, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "f", "arguments": "[" * DEEP + "]" * DEEP}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]},
     "messages[1].tool_calls[0].function.arguments"),
]


def test_crashing_shapes_are_400_beside_four_live_streams(server):
    workers = worker_pids(server)
    assert len(workers) == 1

    async def run() -> tuple[list, list]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            streams = [asyncio.create_task(_stream(c, 120, i)) for i in range(4)]
            await asyncio.sleep(1.0)
            answers = []
            for path, body, _ in CRASHING:
                answers.append(await c.post(path, json=body))
            return answers, await asyncio.gather(*streams)

    answers, streams = asyncio.run(run())
    for (_, _, param), r in zip(CRASHING, answers, strict=True):
        assert r.status_code == 400, (param, r.text[:300])
        assert r.json()["error"]["param"] == param, r.text[:300]
    for times, done in streams:
        assert done and len(times) > 60
    assert worker_pids(server) == workers  # no worker died or was restarted


def _nest(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


DEEP_BODIES = [  # every place the server parses client JSON: (path, raw body, param)
    ("/v1/completions", '{"prompt": "x", "guided_json": %s}' % _nest(DEEP), "guided_json"),
    ("/v1/completions", '{"prompt": "x", "guided_json": %s}' % json.dumps(_nest(DEEP)), "guided_json"),
    ("/v1/completions", '{"prompt": "x", "guided_json": {"type": "array", "items": %s}}'
     % ('{"type": "array", "items": ' * 200 + "{}" + "}" * 200), "guided_json"),
    ("/v1/completions", '{"prompt": "x", "structured_outputs": {"json": %s}}' % _nest(DEEP),
     "structured_outputs"),
    ("/v1/completions", '{"prompt": "x", "structured_outputs": {"json": %s}}'
     % json.dumps(_nest(DEEP)), "structured_outputs.json"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "response_format": '
     '{"type": "json_schema", "json_schema": {"name": "a", "schema": {"x": %s}}}}' % _nest(DEEP),
     "response_format"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "response_format": '
     '{"type": "json_schema", "json_schema": {"name": "a", "schema": {"x": %s}}}}' % _nest(100),
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "response_format": '
     '{"type": "json_schema", "json_schema": {"name": "a", "schema": %s}}}' % json.dumps(_nest(DEEP)),
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": '
     '"function", "function": {"name": "f", "parameters": {"x": %s}}}], "tool_choice": "none"}'
     % _nest(DEEP), "tools"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": '
     '"function", "function": {"name": "f", "parameters": {"x": %s}}}], "tool_choice": "auto"}'
     % _nest(100), "tools[0].function.parameters"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": '
     '"function", "function": {"name": "f", "parameters": {"x": %s}}}]}' % _nest(100),
     "tools[0].function.parameters"),
    ("/v1/chat/completions", '{"messages": [{"role": "assistant", "content": null, "tool_calls": '
     '[{"id": "a", "type": "function", "function": {"name": "f", "arguments": %s}}]}]}'
     % json.dumps(_nest(DEEP)), "messages[0].tool_calls[0].function.arguments"),
    ("/tokenize", '{"messages": [{"role": "assistant", "content": null, "tool_calls": '
     '[{"id": "a", "type": "function", "function": {"name": "f", "arguments": %s}}]}]}'
     % json.dumps(_nest(DEEP)), "messages[0].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", '{"messages": [{"role": "assistant", "content": null, "tool_calls": '
     '[{"id": "a", "type": "function", "function": {"name": "f", "arguments": %s}}]}]}'
     % _nest(DEEP), "messages[0].tool_calls[0].function.arguments"),  # typed: not a string
    ("/v1/completions", '{"prompt": "x", "logit_bias": %s}' % _nest(DEEP), "logit_bias"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {%s: 1}}' % json.dumps(_nest(DEEP)),
     "logit_bias"),
    ("/v1/completions", '{"prompt": "x", "guided_choice": %s}' % _nest(DEEP), "guided_choice[0]"),
    ("/v1/completions", '{"prompt": "x", "guided_grammar": %s}' % _nest(DEEP), "guided_grammar"),
    ("/v1/completions", '{"prompt": %s}' % _nest(DEEP), "prompt[0][0]"),
    ("/v1/chat/completions", '{"messages": %s}' % _nest(DEEP), "messages[0]"),
    ("/detokenize", '{"tokens": %s}' % _nest(DEEP), "tokens[0]"),
]


def test_json_nested_50000_deep_anywhere_is_a_400_naming_the_field(server):
    with httpx.Client(base_url=server.url, timeout=120,
                      headers={"content-type": "application/json"}) as c:
        got = []
        for path, body, param in DEEP_BODIES:
            r = c.post(path, content=body.encode())
            assert r.status_code == 400, (param, r.text[:300])
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"], err
            got.append(err["param"])
        want = [param for _, _, param in DEEP_BODIES]
        assert got == want, [(g, w) for g, w in zip(got, want, strict=True) if g != w]
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_a_slow_compile_never_stalls_the_other_streams(server):
    """Three streams, then one schema that compiles for longer than the budget (8,000 optional
    properties: ~10 s; on the event loop every stream would freeze that long): its 400 comes at
    the budget, and the streams' largest gap while it compiles stays under twice their largest
    gap in the 3 s before (or a third of the compile's time, which a stall would last). The
    refusal is cached: the same schema again is answered at once."""
    slow = {"prompt": "x", "max_tokens": 4, "guided_json": optional_properties(8000, "s")}
    times: list[list[float]] = [[], [], []]

    async def stream(c: httpx.AsyncClient, i: int) -> None:
        async with c.stream("POST", "/v1/completions", json={
                "prompt": f"Story {i}:", "max_tokens": 1000, "ignore_eos": True, "stream": True,
                "seed": i}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    times[i].append(time.monotonic())

    async def run() -> tuple[httpx.Response, float, float, httpx.Response, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            streams = [asyncio.create_task(stream(c, i)) for i in range(3)]
            begun = time.monotonic()
            while min(map(len, times)) < 5 or time.monotonic() - begun < 3.5:
                assert not any(task.done() for task in streams)
                await asyncio.sleep(0.05)  # prefills done, 3 s of decoding at its pace: the baseline
            sent = time.monotonic()
            r = await c.post("/v1/completions", json=slow)
            answered = time.monotonic()
            again = await c.post("/v1/completions", json=slow)
            cached = time.monotonic() - answered
            await asyncio.sleep(0.3)
            for task in streams:  # still decoding (1,000 tokens each): the client goes away
                assert not task.done()
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            return r, sent, answered, again, cached

    r, sent, answered, again, cached = asyncio.run(run())
    assert r.status_code == 400 and "--grammar-compile-timeout" in r.json()["error"]["message"], r.text
    assert answered - sent >= 2.0
    assert again.status_code == 400 and again.json() == r.json() and cached < 0.5
    before, during = [], []
    for t in times:
        gaps = [(b, b - a) for a, b in zip(t[4:], t[5:], strict=False)]  # after the prefill
        before += [g for at, g in gaps if sent - 3 < at <= sent]
        during += [g for at, g in gaps if sent < at <= answered + 0.3]
    assert before and during
    # NOTE: a compile on the event loop would stall every stream for all of it (answered - sent,
    # >= 2 s, asserted above; the stall this guards against was 8-10 s). The streams may see a
    # gap of up to a third of that: on 2 shared cores the compiler process's start, its work at
    # nice 19 and the 240 KB body's parse move a gap by tens of ms here (60-80 ms, ~1.7 s into a
    # 2.5 s compile), and CI's runs saw 0.10 and 0.56 s once each
    compile_s = answered - sent
    assert max(during) < max(2 * max(before), compile_s / 3), (max(during), max(before), compile_s)


def test_a_compiler_crash_is_a_400_and_the_worker_goes_on(server):
    """A native crash of the compiler process (SIGSEGV, sent while it compiles) is a 400 for
    that request alone; the stream beside it finishes, the worker is the same, and the next
    constraint compiles in a fresh process."""
    workers = worker_pids(server)

    async def run() -> tuple[httpx.Response, tuple, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            warm = await c.post("/v1/completions", json={  # a compiler process is up and idle
                "prompt": "x", "max_tokens": 2, "guided_regex": "[a-z]{2}"})
            assert warm.status_code == 200, warm.text
            stream = asyncio.create_task(_stream(c, 60, 99))
            crash = asyncio.create_task(c.post("/v1/completions", json={
                "prompt": "x", "max_tokens": 4, "guided_json": optional_properties(8000, "k")}))
            await asyncio.sleep(0.8)  # inside its 2 s budget
            procs = compiler_processes(server.proc.pid)
            assert len(procs) == 1, procs
            os.kill(procs[0], signal.SIGSEGV)
            r = await crash
            after = await c.post("/v1/completions", json={
                "prompt": "Code:", "max_tokens": 8, "guided_regex": "[0-9]{3}"})
            return r, await stream, after

    r, (times, done), after = asyncio.run(run())
    assert r.status_code == 400 and "SIGSEGV" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "guided_json"
    assert done and len(times) > 30
    assert after.status_code == 200 and len(after.json()["choices"][0]["text"]) == 3, after.text
    assert worker_pids(server) == workers
