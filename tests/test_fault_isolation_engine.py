"""Fault isolation through real engine processes and rings, and through a real server: a slot
that writes garbage is detached (and its client reconnects), a request that raises ends alone,
an output larger than the ring arrives whole. Nothing a client sends stops the engine or hurts
another client's streams."""
from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import random
import select
import threading
import time
from collections import Counter

import httpx
import msgspec
import pytest

from ringserve.engine.config import EngineConfig
from ringserve.engine.process import run_engine
from ringserve.ipc import control
from ringserve.ipc.channel import Channel
from ringserve.ipc.doorbell import Doorbell
from ringserve.ipc.messages import (
    Abort,
    AddRequest,
    EngineOutput,
    decode_outputs,
    encode_outputs,
    encode_request,
)
from ringserve.ipc.ring import RECORD_HEADER, TAIL
from ringserve.ipc.sampling_params import SamplingParams
from ringserve.ipc.stats import NUM_FREE_BLOCKS
from ringserve.server.engine_client import EngineClient
from ringserve.server.memory import process_tree

ctx = mp.get_context("spawn")
PROMPT = list(range(1, 20))
NUM_BLOCKS = 512
GREEDY = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}

pytestmark = pytest.mark.usefixtures("no_segment_left_behind")


@pytest.fixture
def engine(tiny_model_dir, tmp_path):
    """One engine process on the tiny Llama: (control path, process). Stopped cleanly (exit 0)."""
    yield from _engine_process(tiny_model_dir, tmp_path)


def _engine_process(model_dir, tmp_path, **kwargs):
    path = str(tmp_path / "e.sock")
    config = EngineConfig.create(model=str(model_dir), num_gpu_blocks_override=NUM_BLOCKS,
                                 max_model_len=256)
    p = ctx.Process(target=run_engine, args=(config, path), kwargs={"max_slots": 4, **kwargs})
    p.start()
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        assert p.is_alive() and time.monotonic() < deadline, "the engine did not start"
        time.sleep(0.05)
    yield path, p
    p.terminate()
    p.join(30)
    assert p.exitcode == 0


class RawSlot:
    """A client slot driven by hand: it writes whatever bytes it likes into its request ring
    (what a buggy or hostile process attached to the engine can do)."""

    def __init__(self, path: str):
        self.sock, self.welcome, (engine_fd, output_fd) = control.connect(path)
        self.channel = Channel.attach(self.welcome.segment, self.welcome.ring_capacity,
                                      self.welcome.max_message)
        self.engine_bell, self.bell = Doorbell(engine_fd), Doorbell(output_fd)
        self.sock.send(control.ATTACHED)

    def send(self, record: bytes) -> None:
        self.channel.requests.write(record)
        self.engine_bell.ring()

    def send_header(self, length: int) -> None:
        """A record header saying `length` bytes, with 8 bytes published after it."""
        ring = self.channel.requests
        pos = ring._tail % ring.capacity
        ring._words[pos >> 3] = length
        ring._tail += RECORD_HEADER + 8
        ring._counters[TAIL] = ring._tail
        self.engine_bell.ring()

    def detached(self) -> bool:
        """Has the engine detached this slot? (It sends why, then closes the connection: either
        makes the connection readable; nothing else is ever sent on it.)"""
        if not select.select([self.sock], [], [], 0)[0]:
            return False
        self.why = control.recv_refusal(self.sock)
        return True

    def outputs(self) -> list[EngineOutput]:
        got = []
        while (record := self.channel.outputs.read()) is not None:
            got += decode_outputs(record)
        return got

    def wait_for(self, request_id: str, timeout: float = 30.0) -> list[EngineOutput] | None:
        """The outputs up to request_id's finished one; None if the slot was detached first."""
        got, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            got += self.outputs()
            if any(o.request_id == request_id and o.finished for o in got):
                return got
            if self.detached():
                return None
            self.bell.wait(0.05)
        raise AssertionError(f"no answer for {request_id} in {timeout} s")

    def close(self) -> None:
        self.channel.close()
        self.engine_bell.close()
        self.bell.close()
        self.sock.close()


def _add(rid: str, prompt=PROMPT, **params) -> bytes:
    """A record as a raw writer may write it: its params a map of whatever it likes."""
    return encode_request(AddRequest(rid, prompt, params))  # type: ignore[arg-type]


# Decodable requests that must fail alone (an error output) and leave their slot attached.
BAD_REQUESTS = {
    "stop-id": dict(max_tokens=5, min_tokens=1, stop_token_ids=[1000000000]),
    "top-p": dict(temperature=1.0, top_p=1e-46, max_tokens=5),
    "top-p-300": dict(temperature=1.0, top_p=1e-300, max_tokens=5),
    "n-text": dict(n="x"),
    "bogus": dict(bogus=1),
    "logprobs": dict(logprobs=10**9, max_tokens=2),
    "seed": dict(seed=2**63, temperature=1.0),  # past int64 (seed -1 is valid, as in vLLM)
    "huge-value": dict(n="x" * 600_000),   # its message would quote 600 KB: cut, not too large
    "inf-stop-id": dict(stop_token_ids=[float("inf")]),  # int(inf): OverflowError
    "n-huge": dict(n=10**12),                # 10**12 samples would never be made
}


def test_requests_that_raise_fail_alone_beside_a_running_stream(engine):
    """The issue's examples as raw ring records (no frontend to catch them): each gets an
    error output, its slot stays attached, the engine lives, a stream on another slot is
    unharmed (the exact tokens it gets alone)."""
    path, proc = engine

    async def body():
        client = EngineClient([path])
        await client.start()
        await client.wait_ready()
        alone = [o async for o in await client.submit("ref", PROMPT, SamplingParams(**GREEDY))]
        beside = await client.submit("beside", PROMPT, SamplingParams(**GREEDY))
        raw = await asyncio.to_thread(RawSlot, path)
        try:
            for rid, params in BAD_REQUESTS.items():
                raw.send(_add(rid, **params))
                outs = await asyncio.to_thread(raw.wait_for, rid)
                assert outs is not None, f"{rid}: the slot was detached"
                (last,) = [o for o in outs if o.request_id == rid and o.finished]
                assert last.finish_reason == "error" and last.error, rid
            for rid, prompt in (("empty", []), ("out-of-vocab", [5, 10**6])):
                raw.send(_add(rid, prompt, max_tokens=2))
                (last,) = [o for o in await asyncio.to_thread(raw.wait_for, rid) if o.finished]
                assert last.finish_reason == "error"
            raw.send(_add("fine", max_tokens=3))  # the slot still serves
            outs = await asyncio.to_thread(raw.wait_for, "fine")
            assert sum(len(o.new_token_ids) for o in outs if o.request_id == "fine") == 3
        finally:
            raw.close()
        got = [o async for o in beside]
        assert [t for o in got for t in o.new_token_ids] == [t for o in alone for t in o.new_token_ids]
        assert got[-1].finish_reason == "length"
        assert client.engines[0].welcome.engine_pid == proc.pid and proc.is_alive()
        await client.close()

    asyncio.run(body())


def _valid_records(rng: random.Random, k: int) -> list[bytes]:
    return [_add(f"f{k}", max_tokens=2, temperature=0.0),
            _add(f"f{k}", PROMPT[:5], max_tokens=3, temperature=0.7, top_p=0.9, seed=5, logprobs=2,
                 stop_token_ids=[3]),
            encode_request(Abort(f"f{k}"))]


WRONG_SHAPES = [[1, "x"], [3, "x", b"", {}, False], {"a": 1}, "text", 7, None, [],
                [1, "x", "text", {}, False], [1, "x", b"\x01\x02\x03", {}, False],
                [1, 5, b"\x01\x00\x00\x00", {}, False], [1, "x", b"\x01\x00\x00\x00", [1], False],
                [2], [2, 9], [1, "x", b"\x01\x00\x00\x00", {"n": 1}, "yes"]]
HUGE_HEADERS = [2**40, 2**63, 2**64 - 1, 1 << 21]


def _fuzz_cases(seed: int = 0):
    """(kind, record or header length) in a shuffled order."""
    rng = random.Random(seed)
    cases = []
    for _ in range(40):
        cases.append(("random", rng.randbytes(rng.randrange(0, 200))))
    for k in range(40):
        rec = rng.choice(_valid_records(rng, k))
        cases.append(("truncated", rec[:rng.randrange(0, len(rec))]))
    for k in range(80):
        rec = bytearray(rng.choice(_valid_records(rng, 100 + k)))
        for _ in range(rng.randrange(1, 4)):
            bit = rng.randrange(len(rec) * 8)
            rec[bit // 8] ^= 1 << (bit % 8)
        cases.append(("flipped", bytes(rec)))
    cases += [("shape", msgspec.msgpack.encode(s)) for s in WRONG_SHAPES]
    cases += [("header", n) for n in HUGE_HEADERS]
    cases += [("bad-request", _add(f"bad-{rid}", **params)) for rid, params in BAD_REQUESTS.items()]
    rng.shuffle(cases)
    return cases


def _fuzz(path: str, engine_pid: int, report: dict) -> None:
    """Each case, then a probe request on the same slot: the probe's answer means the case was
    taken as a request (or an error output), the slot closing means it was detached; then a
    new slot. Records every outcome in report."""
    raw = RawSlot(path)
    try:
        for i, (kind, case) in enumerate(_fuzz_cases()):
            if kind == "header":
                raw.send_header(case)
            else:
                raw.send(case)
            raw.send(_add(f"probe{i}", max_tokens=1))
            outs = raw.wait_for(f"probe{i}")
            report.setdefault(kind, []).append("detached" if outs is None else "kept")
            if kind == "bad-request" and outs is not None:
                report.setdefault("bad-request-errors", []).extend(
                    o.finish_reason for o in outs if o.request_id.startswith("bad-") and o.finished)
            if outs is None:
                raw.close()
                raw = RawSlot(path)
                assert raw.welcome.engine_pid == engine_pid
    finally:
        raw.close()


def test_fuzzed_records_detach_only_their_slot(engine):
    """Random, truncated, bit-flipped, wrong-shaped records and impossible ring headers from
    one slot while streams run on another: zero failed streams (each gets the tokens it gets
    alone), the engine never restarts, every undecodable record detaches the slot that sent
    it, every decodable bad request gets an error output, and the pool is whole at the end."""
    path, proc = engine
    report: dict = {}

    async def body():
        client = EngineClient([path])
        await client.start()
        await client.wait_ready()
        first = client.engines[0]
        prompts = [PROMPT, PROMPT[3:], list(range(40, 90))]
        alone = {}
        for j, prompt in enumerate(prompts):
            alone[j] = [t async for o in await client.submit(f"ref{j}", prompt, SamplingParams(**GREEDY))
                        for t in o.new_token_ids]
        fuzzer = asyncio.ensure_future(asyncio.to_thread(_fuzz, path, proc.pid, report))
        streams = 0
        while not fuzzer.done() or streams < 6:
            batch = [await client.submit(f"s{streams + j}", prompts[j], SamplingParams(**GREEDY))
                     for j in range(3)]
            for j, stream in enumerate(batch):
                outs = [o async for o in stream]
                assert outs[-1].finish_reason == "length", outs[-1]
                assert [t for o in outs for t in o.new_token_ids] == alone[j]
            streams += 3
        await fuzzer  # re-raises what failed in the fuzzing thread
        assert client.engines[0] is first and first.alive, "the client lost its engine"
        stats = first.stats
        deadline = time.monotonic() + 30
        while not (stats.running == stats.waiting == 0 and stats[NUM_FREE_BLOCKS] == NUM_BLOCKS):
            assert time.monotonic() < deadline, "the pool is not whole again"
            await asyncio.sleep(0.05)
        await client.close()
        return streams

    streams = asyncio.run(body())
    print({kind: dict(Counter(outcomes)) for kind, outcomes in report.items()}, streams, "streams")
    assert proc.is_alive()
    assert streams >= 6
    assert set(report["header"]) == {"detached"}
    assert set(report["shape"]) == {"detached"}
    assert set(report["bad-request"]) == {"kept"}
    assert report["bad-request-errors"] == ["error"] * len(BAD_REQUESTS)
    for kind in ("random", "truncated", "flipped"):
        assert "detached" in report[kind], kind
    assert "kept" in report["flipped"]  # some mutations still decode: answered, not detached


def test_a_client_whose_slot_is_detached_reconnects_and_serves_again(engine):
    """The engine detaches a slot that wrote garbage; the worker's engine client sees its slot
    closed, ends the requests it had there with an error, reconnects on a new slot (same engine
    process) and new requests work."""
    path, proc = engine

    async def body():
        client = EngineClient([path], reconnect_interval=0.05)
        await client.start()
        await client.wait_ready()
        old = client.engines[0]
        open_stream = await client.submit("open", PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
        await open_stream.__anext__()
        old.channel.requests.write(b"\xc1 not msgpack")  # what a broken writer leaves
        old.engine_bell.ring()
        last = [o async for o in open_stream][-1]
        assert last.finish_reason == "error"
        assert "detached this client's slot" in last.error and "not a request" in last.error, last.error
        await client.wait_ready(timeout=30)
        new = client.engines[0]
        assert new is not old and new.welcome.engine_pid == proc.pid
        assert (new.welcome.slot, new.welcome.generation) != (old.welcome.slot, old.welcome.generation)
        outs = [o async for o in await client.submit("after", PROMPT, SamplingParams(max_tokens=4))]
        assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 4
        await client.close()

    asyncio.run(body())
    assert proc.is_alive()


def test_an_output_that_cannot_be_sent_ends_its_request_not_the_engine(tiny_model_dir, tmp_path):
    """One slot's step outputs raise while encoded (a token id that is not an int32): the
    engine loop (here driven by hand, in this process) sends the slot's other outputs, ends
    that request with an error output, and goes on."""
    from ringserve.engine.core import EngineCore
    from ringserve.engine.process import EngineProcess

    config = EngineConfig.create(model=str(tiny_model_dir), num_gpu_blocks_override=NUM_BLOCKS,
                                 max_model_len=256)
    engine = EngineProcess(EngineCore(config), str(tmp_path / "e.sock"), max_slots=2)
    raw: list[RawSlot] = []
    connecting = threading.Thread(target=lambda: raw.append(RawSlot(engine.control_path)))
    connecting.start()
    try:
        deadline = time.monotonic() + 20
        while not (engine.slots[0] is not None and engine.slots[0].attached):
            assert time.monotonic() < deadline
            engine._handle_control(0.05)
        connecting.join()
        slot = engine.slots[0]
        for rid in ("bad", "good"):
            engine.core.add_request(slot.key(rid), PROMPT, SamplingParams(**GREEDY))
            slot.open[rid] = 1
        outputs = engine.core.step()
        bad = next(o for o in outputs if o.request_id.endswith("bad"))
        bad.new_token_ids = [2**40]        # cannot travel as int32: encoding the step raises
        engine._deliver(outputs)
        while engine.core.has_unfinished_requests():
            engine._deliver(engine.core.step())
        got = raw[0].outputs()
        good = [t for o in got if o.request_id == "good" for t in o.new_token_ids]
        assert len(good) == GREEDY["max_tokens"]
        (last,) = [o for o in got if o.request_id == "bad"]
        assert last.finish_reason == "error" and "could not send" in last.error
        assert engine.core.kv.num_free_blocks == NUM_BLOCKS and not slot.open
    finally:
        for r in raw:
            r.close()
        engine.close()


# -- through a real server --------------------------------------------------------------------

def _descendants(pid: int) -> set[int]:
    """Every process below pid (the server's engines, Gunicorn master and workers)."""
    return set(process_tree(pid)) - {pid}


def _stream_text(client: httpx.Client, url: str, body: dict) -> tuple[str, str | None]:
    text, reason = "", None
    with client.stream("POST", url + "/v1/completions", json=dict(body, stream=True)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = msgspec.json.decode(line[6:])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
                reason = chunk["choices"][0]["finish_reason"] or reason
    return text, reason


def test_http_requests_that_used_to_kill_the_engine(serve, tiny_model_dir):
    """The issue's examples over HTTP while a stream runs: each is answered 200 or a 400 error
    JSON (the frontend refuses them; the raw-ring tests above show the engine's own checks),
    the stream completes, no process of the server is replaced."""
    server = serve(tiny_model_dir, "--workers", "1", "--max-model-len", "256", "--device", "cpu")
    url = server.url
    before = _descendants(server.proc.pid)
    bad = [{"prompt": "Hi", "max_tokens": 5, "min_tokens": 1, "stop_token_ids": [1000000000]},
           {"prompt": "Hi", "max_tokens": 5, "top_p": 1e-46},
           {"prompt": "Hi", "max_tokens": 5, "top_p": 1e-300},
           {"prompt": "Hi", "max_tokens": 5, "stop_token_ids": [-1]}]
    with httpx.Client(timeout=120) as client:
        model = client.get(url + "/v1/models").json()["data"][0]["id"]
        beside: dict = {}
        runner = threading.Thread(target=lambda: beside.update(zip(("text", "reason"), _stream_text(
            client, url, {"model": model, "prompt": "Once", "max_tokens": 150, "ignore_eos": True,
                          "temperature": 0.0}), strict=True)))
        runner.start()
        for body in bad:
            r = client.post(url + "/v1/completions", json=dict(body, model=model))
            assert r.status_code in (200, 400), (body, r.status_code, r.text)
            if r.status_code != 200:
                err = r.json()["error"]
                assert err["message"] and {"type", "param", "code"} <= set(err), r.text
        runner.join(120)
        assert beside["reason"] == "length"
        assert client.get(url + "/health").status_code == 200
        r = client.post(url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert _descendants(server.proc.pid) == before, "a server process was replaced"
    assert "died" not in server.log.read_text()



def test_a_request_the_pool_can_never_hold_is_a_400_streamed_or_not(serve, tiny_model_dir):
    """A pool of 4 blocks (64 tokens) clamps max_model_len to 64 (none was given: engine/config.py
    fit_max_model_len), so a request that could never fit is the frontend's 400 naming the limit,
    streamed or not, never an engine's 500. The server goes on."""
    server = serve(tiny_model_dir, "--workers", "1", "--device", "cpu", "--num-gpu-blocks-override", "4")
    body = {"prompt": "Hi", "max_tokens": 200, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for stream in (False, True):
            r = client.post("/v1/completions", json=dict(body, stream=stream))
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
            assert "maximum context length is 64 tokens" in error["message"]
        ok = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


WORDS = ("the of and to in is was for on that with as by at from his her it an were are which "
         "this be or has had not but all when there one their been who they more new some "
         "time year people way day man thing woman life child world school state family").split()


def test_a_long_echo_with_logprobs_is_larger_than_the_ring_and_completes(serve, default_model_dir):
    """echo + logprobs 100 (--max-logprobs 100) on a 1,000-word prompt with the real default
    model: the prompt logprobs (~1.4 MB encoded, more than the 1 MiB ring) arrive in fragments,
    whole: one entry per prompt token and per generated token. A request of ~1.5 MB (its
    grammar) crosses the other way in fragments. A request beside them is unharmed."""
    server = serve(default_model_dir, "--workers", "1", "--device", "cpu",
                   "--max-num-batched-tokens", "512", "--max-body-bytes", str(4 << 20),
                   # the 1.5 MB choice below is over the constraint limits' defaults on purpose
                   "--max-choice-bytes", str(2 << 20), "--max-grammar-bytes", str(2 << 20),
                   # 101 entries a position: the ring is outgrown in 1,000 prompt tokens, not
                   # 4,000 at logprobs 20 (the prefill was most of this test's time)
                   "--max-logprobs", "100", timeout=300)
    url = server.url
    rng = random.Random(0)
    prompt = " ".join(rng.choice(WORDS) for _ in range(1000))
    with httpx.Client(timeout=600) as client:
        model = client.get(url + "/v1/models").json()["data"][0]["id"]
        ids = client.post(url + "/tokenize", json={"model": model, "prompt": prompt}).json()["tokens"]
        assert len(ids) >= 1000
        beside: dict = {}
        runner = threading.Thread(target=lambda: beside.update(zip(("text", "reason"), _stream_text(
            client, url, {"model": model, "prompt": "Tell me a story.", "max_tokens": 40,
                          "ignore_eos": True, "temperature": 0.0}), strict=True)))
        runner.start()
        r = client.post(url + "/v1/completions", json={
            "model": model, "prompt": prompt, "echo": True, "logprobs": 100, "max_tokens": 2,
            "temperature": 0.0})
        # The other way: a request whose grammar (one choice of 1.5 MB) is larger than the
        # ring; the answer follows it, streamed or not.
        choices = ["yes", "no", "y" * 1_500_000]
        for stream in (False, True):
            asked = client.post(url + "/v1/completions", json={
                "model": model, "prompt": "Answer yes or no:", "max_tokens": 4, "stream": stream,
                "temperature": 0.0, "guided_choice": choices})
            assert asked.status_code == 200, asked.text[:500]
            if stream:
                assert asked.text.endswith("data: [DONE]\n\n") and '"error"' not in asked.text
                text = "".join(json.loads(line[6:])["choices"][0]["text"]
                               for line in asked.text.splitlines()
                               if line.startswith("data: {"))
            else:
                text = asked.json()["choices"][0]["text"]
            assert any(c.startswith(text) for c in choices) and text, text
        runner.join(600)
    assert r.status_code == 200, r.text
    body = r.json()
    choice, usage = body["choices"][0], body["usage"]
    assert usage["prompt_tokens"] == len(ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + usage["completion_tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    scored = lp["token_logprobs"][1:]
    assert all(isinstance(v, float) and v <= 0.0 for v in scored)
    assert all(100 <= len(top) <= 101 for top in lp["top_logprobs"][1:])
    assert choice["text"].startswith(prompt[:100])
    assert beside["reason"] == "length"
    assert "died" not in server.log.read_text()


SMALL_RING = 64 << 10     # a slot may then hold one message and BACKLOG_RINGS x 64 KiB of
SMALL_MESSAGE = 128 << 10  # unread outputs


@pytest.fixture
def small_ring_engine(tiny_model_dir, tmp_path):
    yield from _engine_process(tiny_model_dir, tmp_path, ring_capacity=SMALL_RING,
                               max_message=SMALL_MESSAGE)


def test_a_slot_that_stops_reading_its_outputs_is_detached_not_queued_forever(small_ring_engine):
    """A slot whose outputs nobody reads (a stopped worker) holds at most one message and
    BACKLOG_RINGS rings of them in the engine: past that it is detached, its requests aborted
    (the pool whole again), and a client on another slot is served as before."""
    from ringserve.engine.process import BACKLOG_RINGS
    path, proc = small_ring_engine
    params = dict(max_tokens=230, temperature=0.0, ignore_eos=True, logprobs=20)
    # 12 x 230 tokens x 21 logprobs: about 1 MB of outputs, over 128 KiB + 8 x 64 KiB

    async def body():
        client = EngineClient([path])
        await client.start()
        await client.wait_ready()
        alone = [o async for o in await client.submit("ref", PROMPT, SamplingParams(**GREEDY))]
        raw = await asyncio.to_thread(RawSlot, path)
        try:
            for k in range(12):
                raw.send(_add(f"big{k}", **params))
            deadline = time.monotonic() + 120
            while not raw.detached():       # it never reads: the engine must let it go
                assert time.monotonic() < deadline, "the slot was never detached"
                assert proc.is_alive()
                await asyncio.sleep(0.1)
            assert "stopped reading its outputs" in raw.why, raw.why
        finally:
            raw.close()
        engine = client.engines[0]
        stats = engine.stats
        deadline = time.monotonic() + 30
        while not (stats.running == stats.waiting == 0 and stats[NUM_FREE_BLOCKS] == NUM_BLOCKS):
            assert time.monotonic() < deadline, "the detached slot's requests still hold blocks"
            await asyncio.sleep(0.05)
        again = [o async for o in await client.submit("again", PROMPT, SamplingParams(**GREEDY))]
        assert [t for o in again for t in o.new_token_ids] == [t for o in alone for t in o.new_token_ids]
        assert engine.alive and engine.welcome.engine_pid == proc.pid
        await client.close()

    assert SMALL_MESSAGE + BACKLOG_RINGS * SMALL_RING < 12 * 230 * 21 * 12  # outputs exceed the bound
    asyncio.run(body())


TINY_RING = 32 << 10


@pytest.fixture
def tiny_ring_engine(tiny_model_dir, tmp_path):
    yield from _engine_process(tiny_model_dir, tmp_path, ring_capacity=TINY_RING,
                               max_message=SMALL_MESSAGE)


def test_messages_larger_than_the_ring_cross_both_ways_beside_small_ones(tiny_ring_engine):
    """On 32 KiB rings (records of 8 KiB), through a real engine process: requests of ~100 KiB
    (a long stop string: the engine takes it, the frontend applies it) and outputs of ~55 KiB
    (prompt logprobs 20 of a 200-token prompt), both larger than the ring, go in fragments,
    interleaved with small requests written at the same time; every answer is whole and the
    small ones are what they are alone. Such an output as the last of a request, the engine
    then idle, still arrives whole. A request over the 128 KiB message limit is refused before
    it is written; a writer that sends fragments past the limit has its slot detached."""
    from ringserve.ipc.ring import MORE, MessageTooLarge
    path, proc = tiny_ring_engine
    long_prompt = [(7 * i) % 380 + 1 for i in range(200)]
    big = dict(max_tokens=3, temperature=0.0, prompt_logprobs=20, stop=["x" * 100_000])

    async def body():
        client = EngineClient([path])
        await client.start()
        await client.wait_ready()
        assert client.engines[0].channel.max_message == SMALL_MESSAGE  # told in the Welcome
        alone = [t async for o in await client.submit("ref", PROMPT, SamplingParams(**GREEDY))
                 for t in o.new_token_ids]

        async def run(rid: str, prompt, params) -> list[EngineOutput]:
            return [o async for o in await client.submit(rid, prompt, SamplingParams(**params))]

        jobs = [run(f"big{k}", long_prompt, big) if k % 3 == 0 else run(f"small{k}", PROMPT, GREEDY)
                for k in range(9)]
        results = await asyncio.gather(*jobs)
        firsts = []
        for k, outs in enumerate(results):
            assert outs[-1].finished and outs[-1].error is None, outs[-1]
            tokens = [t for o in outs for t in o.new_token_ids]
            if k % 3:
                assert tokens == alone
                continue
            assert len(tokens) == 3
            (out,) = [o for o in outs if o.prompt_logprobs is not None]
            plp = out.prompt_logprobs
            assert len(plp) == len(long_prompt) - 1 and all(20 <= len(p) <= 21 for p in plp)
            assert len(encode_outputs([out])) > TINY_RING  # more than the ring
            firsts.append(plp)
        assert len(firsts) == 3 and firsts[0] == firsts[1] == firsts[2]  # whole, and the same
        # alone, its large output the last: what the ring could not hold goes out while idle
        last = await asyncio.wait_for(run("last", long_prompt, dict(big, max_tokens=1)), 30)
        assert last[-1].finished and last[-1].prompt_logprobs == firsts[0]
        with pytest.raises(MessageTooLarge, match=str(SMALL_MESSAGE)):
            await client.submit("huge", PROMPT, SamplingParams(**dict(GREEDY, stop=["x" * SMALL_MESSAGE])))
        assert "huge" not in client.streams
        assert [t async for o in await client.submit("after", PROMPT, SamplingParams(**GREEDY))
                for t in o.new_token_ids] == alone
        await client.close()

    asyncio.run(body())
    raw = RawSlot(path)  # a writer that ignores the limit: fragments without end
    try:
        deadline = time.monotonic() + 30
        while not raw.detached():
            assert time.monotonic() < deadline, "the slot was never detached"
            if raw.channel.requests.try_write(bytes(16_000), MORE):
                raw.engine_bell.ring()
            else:
                time.sleep(0.01)
        assert "not a request" in raw.why and str(SMALL_MESSAGE) in raw.why, raw.why
    finally:
        raw.close()
    assert proc.is_alive()
