"""Engine processes and the asyncio engine client, all real: spawned engine processes running
EngineCore on the tiny Llama, clients in this process and in killed child processes."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest

from ringserve.engine.config import EngineConfig
from ringserve.engine.process import run_engine
from ringserve.gpu.loader.config import ModelConfig
from ringserve.gpu.loader.weights import load_weights
from ringserve.ipc import control
from ringserve.ipc.sampling_params import SamplingParams
from ringserve.ipc.stats import (
    GENERATION_TOKENS,
    NUM_PREEMPTIONS,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    PROMPT_TOKENS_COMPUTED,
    STEPS,
)
from ringserve.server.engine_client import EngineClient, EngineUnavailable
from ringserve.server.memory import tree_pss_bytes
from ringserve.server.metrics import RequestMetrics, render
from ringserve.server.worker import snapshots
from ringserve.tools.tiny_llama import make_tiny_llama

ctx = mp.get_context("spawn")
PROMPT = list(range(1, 20))
# Still running when the test acts on it: a decode step of the tiny model takes well under a
# millisecond, so "long" needs a long context (tens of seconds of steps; tests abort it).
LONG = SamplingParams(max_tokens=30000, ignore_eos=True)
NUM_BLOCKS = 4096


pytestmark = pytest.mark.usefixtures("no_segment_left_behind")


class Engines:
    """Engine processes for one test, stopped (SIGTERM: a clean close) at its end."""

    def __init__(self, model_dir: Path, tmp_path: Path):
        self.settings = dict(model=str(model_dir), num_gpu_blocks_override=NUM_BLOCKS)
        self.tmp_path = tmp_path
        self.procs: dict[str, mp.Process] = {}

    def start(self, name: str, max_slots: int = 4, overlap: bool | None = None, **config) -> str:
        """config: EngineConfig settings (flat names) to change for this engine."""
        path = str(self.tmp_path / f"{name}.sock")
        p = ctx.Process(target=run_engine, args=(EngineConfig.create(**{**self.settings, **config}), path),
                        kwargs={"max_slots": max_slots, "overlap": overlap})
        p.start()
        self.procs[name] = p
        return path

    def kill(self, name: str) -> None:
        p = self.procs.pop(name)
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)

    def stop_all(self) -> None:
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            p.join(30)
            assert p.exitcode == 0


@pytest.fixture(scope="module")
def long_context_model_dir(tmp_path_factory) -> Path:
    """The tiny Llama with room for LONG."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-32k"), max_position_embeddings=32768)


@pytest.fixture
def engines(long_context_model_dir, tmp_path):
    e = Engines(long_context_model_dir, tmp_path)
    yield e
    e.stop_all()


async def _until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_requests_stream_back_through_the_rings(engines):
    path = engines.start("a")

    async def body():
        client = EngineClient([path])
        await client.start()
        await client.wait_ready()
        streams = [await client.submit(f"r{i}", PROMPT, SamplingParams(max_tokens=5 + i, temperature=0.0))
                   for i in range(4)]
        bad = await client.submit("bad", [10**6], SamplingParams())
        for i, s in enumerate(streams):
            outs = [o async for o in s]
            assert sum(len(o.new_token_ids) for o in outs) == 5 + i
            assert outs[-1].finish_reason == "length" and outs[0].num_prompt_tokens == len(PROMPT)
        (err,) = [o async for o in bad]
        assert err.finish_reason == "error" and "vocabulary" in err.error
        # abort: the stream ends with "abort" and the engine drops the request
        s = await client.submit("gone", PROMPT, LONG)
        await s.__anext__()
        client.abort("gone")
        assert [o.finish_reason async for o in s][-1] == "abort"
        engine = client.engines[0]
        await _until(lambda: engine.stats.running == 0 and engine.stats.waiting == 0)
        await client.close()

    asyncio.run(body())


def _client_with_open_requests(path: str, count: int, conn) -> None:
    async def main():
        client = EngineClient([path])
        await client.start()
        await client.wait_ready()
        for i in range(count):
            await client.submit(f"r{i}", PROMPT, LONG)  # same ids as other clients: slots keep them apart
        engine = client.engines[0]
        conn.send((engine.welcome.slot, engine.welcome.generation))
        await asyncio.sleep(600)  # until SIGKILL

    asyncio.run(main())


def test_killed_client_has_its_requests_aborted_and_its_slot_reused(engines):
    path = engines.start("a", max_slots=2)

    async def body():
        watcher = EngineClient([path])
        await watcher.start()
        await watcher.wait_ready()
        stats = watcher.engines[0].stats
        mine = await watcher.submit("r0", PROMPT, LONG)  # another client's request must survive
        parent, child = ctx.Pipe()
        victim = ctx.Process(target=_client_with_open_requests, args=(path, 5, child))
        victim.start()
        slot, generation = await asyncio.to_thread(parent.recv)
        await _until(lambda: stats.running + stats.waiting == 6)
        assert stats[6] < NUM_BLOCKS  # NUM_FREE_BLOCKS: the requests hold blocks
        with pytest.raises(control.HandshakeError, match="slots are taken"):
            await asyncio.to_thread(control.connect, path)
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        await _until(lambda: stats.running + stats.waiting == 1)
        watcher.abort("r0")
        await _until(lambda: stats.running + stats.waiting == 0 and stats[6] == NUM_BLOCKS)
        assert [o.finish_reason async for o in mine][-1] == "abort"
        # the freed slot goes to the next worker, with a new generation
        sock, welcome, fds = await asyncio.to_thread(control.connect, path)
        assert (welcome.slot, welcome.generation) == (slot, generation + 1)
        sock.close()
        for fd in fds:
            os.close(fd)
        await watcher.close()

    asyncio.run(body())


def test_killed_engine_fails_open_requests_fast_and_comes_back(engines):
    path = engines.start("a")

    async def body():
        client = EngineClient([path], reconnect_interval=0.05)
        await client.start()
        await client.wait_ready()
        streams = [await client.submit(f"r{i}", PROMPT, LONG) for i in range(3)]
        for s in streams:
            await s.__anext__()  # running
        engines.kill("a")
        killed = time.monotonic()
        lasts = []
        for s in streams:
            lasts.append([o async for o in s][-1])
        elapsed = time.monotonic() - killed
        assert all(o.finish_reason == "error" and "died" in o.error for o in lasts)
        assert elapsed < 1.0, f"open requests failed {elapsed:.2f} s after the engine died"
        with pytest.raises(EngineUnavailable):
            await client.submit("refused", PROMPT, SamplingParams())
        engines.start("a")  # same control path; removes the dead engine's segment at start
        await client.wait_ready(timeout=60)
        outs = [o async for o in await client.submit("again", PROMPT, SamplingParams(max_tokens=3))]
        assert outs[-1].finish_reason == "length"
        await client.close()

    asyncio.run(body())


def _load_engine(path: str, count: int, conn) -> None:
    async def main():
        client = EngineClient([path])
        await client.start()
        await client.wait_ready()
        for i in range(count):
            await client.submit(f"load{i}", PROMPT, LONG)
        conn.send("loaded")
        await asyncio.sleep(600)

    asyncio.run(main())


def test_two_engines_receive_work_as_the_score_dictates(engines):
    paths = [engines.start("a"), engines.start("b")]

    async def body():
        client = EngineClient(paths)
        await client.start()
        await client.wait_ready(timeout=60)
        # idle engines tie: the first goes to engine 0; its own uncounted submission then
        # weighs 4 (or 1 once running), so the second goes to engine 1. NOTE: long enough that
        # the first is still running then (engines compile their kernels at start: a 2-token
        # request could finish before the second submit, leaving engine 0 idle again)
        first = await client.submit("first", PROMPT, SamplingParams(max_tokens=64, ignore_eos=True))
        second = await client.submit("second", PROMPT, SamplingParams(max_tokens=2))
        assert (first.engine, second.engine) == (0, 1)
        for s in (first, second):
            assert [o.finish_reason async for o in s][-1] == "length"
        # another process loads engine 0 with 8 long requests: score >= 8 there
        parent, child = ctx.Pipe()
        loader = ctx.Process(target=_load_engine, args=(paths[0], 8, child))
        loader.start()
        await asyncio.to_thread(parent.recv)
        a = client.engines[0].stats
        await _until(lambda: a.running + a.waiting == 8)
        assert client.loads()[0] >= 8
        # engine 1 scores 0, then at most 4 (our one uncounted submission): both go there
        placed = [await client.submit(f"n{i}", PROMPT, SamplingParams(max_tokens=2)) for i in range(2)]
        assert [s.engine for s in placed] == [1, 1]
        for s in placed:
            outs = [o async for o in s]
            assert outs[-1].finish_reason == "length"
        os.kill(loader.pid, signal.SIGKILL)
        loader.join(10)
        await client.close()

    asyncio.run(body())


def test_engine_counters_reach_the_metrics_page(engines, long_context_model_dir):
    # 8 blocks of 16 tokens: each request fits alone (19 + 60 tokens: 5 blocks), four at once
    # do not, so the engine must preempt; they share PROMPT's first block in the prefix cache.
    path = engines.start("a", num_gpu_blocks_override=8)

    async def body():
        client = EngineClient([path])
        await client.start()
        await client.wait_ready()
        stats = client.engines[0].stats
        params = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.0)
        streams = [await client.submit(f"r{i}", PROMPT, params) for i in range(4)]
        generated = 0
        for s in streams:
            outs = [o async for o in s]
            assert outs[-1].finish_reason == "length"
            generated += sum(len(o.new_token_ids) for o in outs)
        await _until(lambda: stats.running + stats.waiting == 0)
        assert generated == 4 * 60 and stats[GENERATION_TOKENS] == generated
        assert stats[NUM_PREEMPTIONS] > 0, "the 8-block pool should force preemption"
        assert stats[STEPS] >= 60
        # every prompt token is computed or found in the cache; recomputation adds more
        assert stats[PROMPT_TOKENS_COMPUTED] + stats[PREFIX_CACHE_HITS] >= 4 * len(PROMPT)
        assert 0 < stats[PREFIX_CACHE_HITS] <= stats[PREFIX_CACHE_QUERIES]

        page = render(RequestMetrics("tiny", 128), "tiny", snapshots(client), None).decode()
        labels = '{engine="0",model_name="tiny"}'
        assert f"ringserve:num_preemptions_total{labels} {float(stats[NUM_PREEMPTIONS])}" in page
        assert f"ringserve:prefix_cache_queries_total{labels} {float(stats[PREFIX_CACHE_QUERIES])}" in page
        assert f"ringserve:prefix_cache_hits_total{labels} {float(stats[PREFIX_CACHE_HITS])}" in page
        # What it holds: the float32 checkpoint's bytes (fused, the tied lm_head once) and the
        # 8-block pool, K and V of every layer in float32.
        c = ModelConfig.from_dir(long_context_model_dir)
        weights = sum(t.nbytes for t in load_weights(long_context_model_dir).values())
        kv = 8 * 16 * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4
        weight_labels = '{engine="0",model_name="tiny",type="F32"}'
        assert f"ringserve:model_weight_bytes{weight_labels} {float(weights)}" in page
        assert f"ringserve:kv_cache_bytes{labels} {float(kv)}" in page
        # The same by part, and what the machine counts: the engine's PSS holds its weights
        engines_now = snapshots(client)
        page = render(RequestMetrics("tiny", 128), "tiny", engines_now, None,
                      {"engine": tree_pss_bytes(engines_now[0].pid)}).decode()
        for part, n in (("weights_packed", 0), ("weights_float", weights), ("kv_cache", kv)):
            assert f'ringserve:memory_bytes{{engine="0",model_name="tiny",part="{part}"}} {float(n)}' in page
        pss = [float(line.split()[-1]) for line in page.splitlines()
               if line.startswith('ringserve:process_memory_pss_bytes{model_name="tiny",process="engine"}')]
        assert len(pss) == 1 and pss[0] > weights
        await client.close()

    asyncio.run(body())


def test_a_request_written_before_the_attach_is_served_once_attached(engines):
    """A client may write into its ring before the engine has read ATTACHED: the idle engine
    must not spin on that unattached slot's data and starve its control socket."""
    from ringserve.ipc.channel import Channel
    from ringserve.ipc.doorbell import Doorbell
    from ringserve.ipc.messages import AddRequest, decode_outputs, encode_request

    path, deadline = engines.start("a"), time.monotonic() + 30
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)  # the engine is still loading its model
    sock, welcome, (engine_bell_fd, output_bell_fd) = control.connect(path)
    channel = Channel.attach(welcome.segment, welcome.ring_capacity)
    engine_bell, output_bell = Doorbell(engine_bell_fd), Doorbell(output_bell_fd)
    try:
        channel.requests.write(encode_request(AddRequest("early", PROMPT, SamplingParams(max_tokens=3))))
        engine_bell.ring()
        time.sleep(0.3)  # the engine wakes, sees the record on a slot not yet attached
        sock.send(control.ATTACHED)
        deadline, tokens = time.monotonic() + 20, 0
        while tokens < 3 and time.monotonic() < deadline:
            record = channel.outputs.read()
            if record is None:
                output_bell.wait(0.1)
                continue
            tokens += sum(len(o.new_token_ids) for o in decode_outputs(record))
        assert tokens == 3
    finally:
        channel.close()
        engine_bell.close()
        output_bell.close()
        sock.close()


def test_overlapped_delivery_gives_the_same_outputs(engines):
    """The overlapped loop (CUDA's: step N-1 delivered while step N runs) against the plain one,
    on the same requests: greedy and seeded samples with logprobs, n = 2, a prompt chunked over
    steps that sample nothing, a refusal, an abort. Every output arrives, the last ones when
    the engine goes idle, and the pool is whole again."""
    chunked = dict(max_num_batched_tokens=32)
    paths = [engines.start("plain", overlap=False, **chunked),
             engines.start("overlap", overlap=True, **chunked)]
    requests = {
        "greedy": (PROMPT, {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "logprobs": 2}),
        "seeded": (PROMPT[:7], {"max_tokens": 9, "temperature": 0.9, "top_p": 0.9, "seed": 11,
                                "ignore_eos": True, "n": 2}),
        "chunked": (list(range(3, 103)), {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}),
        "refused": ([10**6], {}),
    }

    async def run(path):
        client = EngineClient([path])
        await client.start()
        await client.wait_ready(timeout=60)
        streams = {rid: await client.submit(rid, prompt, SamplingParams(**params))
                   for rid, (prompt, params) in requests.items()}
        gone = await client.submit("gone", PROMPT, LONG)
        await gone.__anext__()
        client.abort("gone")
        got = {}
        for rid, stream in streams.items():
            async for o in stream:
                tokens, reasons, logprobs = got.setdefault((rid, o.index), ([], [], []))
                tokens += o.new_token_ids
                reasons.append(o.finish_reason)
                logprobs += [sorted((t, round(lp, 3)) for t, lp, _ in pos) for pos in o.logprobs or ()]
        assert [o.finish_reason async for o in gone][-1] == "abort"
        stats = client.engines[0].stats
        await _until(lambda: stats.running + stats.waiting == 0 and stats[6] == NUM_BLOCKS)
        await client.close()
        return got

    async def body():
        return [await asyncio.wait_for(run(path), 60) for path in paths]

    plain, overlapped = asyncio.run(body())
    assert overlapped == plain
    assert plain[("greedy", 0)][1][-1] == "length" and len(plain[("greedy", 0)][2]) == 12
    assert {k for k in plain if k[0] == "seeded"} == {("seeded", 0), ("seeded", 1)}
    assert plain[("chunked", 0)][0] and plain[("refused", 0)][1] == ["error"]
