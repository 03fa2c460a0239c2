"""KV-cache events (--kv-events-config, engine/kv_events.py) from a real `ringserve serve`,
read with plain pyzmq as a router reads them: vLLM's frames (topic, 8-byte big-endian sequence
number, msgpack [ts, events, data_parallel_rank] with events tagged by "type"), one publisher
per engine on the rank-offset port, the replay socket, and every event checked against what
the server was asked to do: the blocks a prompt stores (their chain hashes recomputed here with
the KV manager's own hash), their removal when a tiny pool evicts them, a fresh pool's
AllBlocksCleared."""
from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import httpx
import msgspec
import pytest

from conftest import engine_pids, free_port
from ringserve.engine.kv_cache import hash_block, root_hash
from ringserve.engine.kv_events import offset_endpoint

zmq = pytest.importorskip("zmq", reason="pyzmq is the kv-events extra (make test installs it)")

BS = 16
POOL = 12  # blocks per engine: a few prompts evict the first one's blocks
TOPIC = b"kv"


class Stream:
    """A SUB socket on one engine's publisher; every batch received, decoded, by seq."""

    def __init__(self, ctx, endpoint: str):
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sock.connect(endpoint)
        self.batches: list[tuple[int, bytes, list]] = []  # (seq, payload, decoded batch)

    def drain(self, wait_s: float = 0.0) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            if self.sock.poll(max(0, int(1000 * (deadline - time.monotonic())))):
                topic, seq, payload = self.sock.recv_multipart()
                assert topic == TOPIC and len(seq) == 8
                self.batches.append((int.from_bytes(seq, "big"), payload,
                                     msgspec.msgpack.decode(payload)))
            elif time.monotonic() >= deadline:
                return

    def events(self, kind: str) -> list[dict]:
        return [e for _, _, b in self.batches for e in b[1] if e["type"] == kind]


def external_hash(block_hash: bytes) -> int:
    """vLLM's int form of a block hash (maybe_convert_block_hash): the last 8 bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


def _chain(tokens: list[int], parent: bytes | None = None) -> list[bytes]:
    """The KV manager's chain hashes of full blocks of tokens (engine/kv_cache.py)."""
    out, parent = [], parent or root_hash(None)
    for i in range(0, len(tokens) - len(tokens) % BS, BS):
        parent = hash_block(parent + struct.pack(f"{BS}i", *tokens[i:i + BS]))
        out.append(parent)
    return out


def _port_pair(avoid: tuple[int, ...] = ()) -> int:
    """A free port p with p + 1 free too (engine 1 binds p + 1)."""
    while True:
        port = free_port()
        if {port, port + 1} & set(avoid):
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port + 1))
            except OSError:
                continue
        return port


@pytest.fixture(scope="module")
def server(serve, tiny_model_dir, no_segment_left_behind):
    pub = _port_pair()
    replay = _port_pair((pub, pub + 1))
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "kv", "buffer_steps": 1000}
    proc = serve(tiny_model_dir, "--workers", "1", "--device", "cpu", "--drain-timeout", "2",
                 "--engines", "2", "--max-model-len", "128", "--block-size", str(BS),
                 "--num-gpu-blocks-override", str(POOL), "--kv-events-config", json.dumps(config))
    return proc.url, config, proc.proc.pid


@pytest.fixture(scope="module")
def streams(server):
    url, *_ = server
    sources = httpx.get(url + "/kv_event_sources").json()
    ctx = zmq.Context()
    # the router rewrites the bind host (*) to the worker's host, as here
    out = {int(rank): Stream(ctx, s["endpoint"].replace("*", "127.0.0.1"))
           for rank, s in sources.items()}
    time.sleep(1.0)  # PUB/SUB: a subscriber gets only what is sent after it joined
    yield out
    for s in out.values():
        s.sock.close()
    ctx.term()


def _complete(url: str, prompt: list[int], max_tokens: int = 1) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                  "ignore_eos": True, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text


def test_sources_and_server_info_name_each_engines_publisher(server):
    url, config, _ = server
    port = int(config["endpoint"].rsplit(":", 1)[1])
    replay = int(config["replay_endpoint"].rsplit(":", 1)[1])
    sources = httpx.get(url + "/kv_event_sources").json()
    assert sorted(sources) == ["0", "1"]
    for rank in (0, 1):  # vLLM's data-parallel rule: ports offset by the rank
        s = sources[str(rank)]
        assert s["endpoint"] == f"tcp://*:{port + rank}"
        assert s["replay_endpoint"] == f"tcp://*:{replay + rank}"
        assert s["topic"] == "kv" and s["data_parallel_rank"] == rank
    info = httpx.get(url + "/get_server_info").json()
    assert info["kv_events_config"] == {**config, "hwm": 100_000, "max_queue_size": 100_000}


def test_a_prompt_stores_its_blocks_with_the_engines_hashes(server, streams):
    url, *_ = server
    prompt = list(range(3, 43))  # 40 tokens: 2 full blocks, then 8 + 8 generated fill a third
    _complete(url, prompt, max_tokens=9)
    time.sleep(0.5)
    for s in streams.values():
        s.drain(0.5)
    rank, stream = next((r, s) for r, s in streams.items() if s.events("BlockStored"))
    first, second = stream.events("BlockStored")[:2]
    hashes = _chain(prompt[:32])
    assert first["block_hashes"] == [external_hash(h) for h in hashes]
    assert first["parent_block_hash"] is None and first["token_ids"] == prompt[:32]
    assert first["block_size"] == BS and first["medium"] == "GPU" and first["lora_id"] is None
    # the third block (8 prompt tokens + 8 generated ones) is stored when it fills, chained
    assert second["parent_block_hash"] == first["block_hashes"][-1]
    assert second["token_ids"][:8] == prompt[32:40] and len(second["token_ids"]) == BS
    assert second["block_hashes"] == [external_hash(_chain(second["token_ids"], hashes[-1])[0])]
    seqs = [seq for seq, _, _ in stream.batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # one batch per step, no gap
    assert all(b[2] == rank and isinstance(b[0], float) for _, _, b in stream.batches)
    other = streams[1 - rank]
    assert not other.events("BlockStored")  # the other engine ran nothing


def test_a_tiny_pool_evicts_and_says_so(server, streams):
    url, *_ = server
    for i in range(8):  # 8 prompts of 5 blocks (4 full) on 2 pools of 12 blocks
        _complete(url, [100 + 3 * i + j % 5 for j in range(65)])
    time.sleep(0.5)
    removed = 0
    for rank, stream in streams.items():
        stream.drain(0.5)
        held: set[int] = set()
        for _, _, batch in stream.batches:
            for e in batch[1]:
                if e["type"] == "BlockStored":
                    assert not held & set(e["block_hashes"])  # stored once while held
                    held |= set(e["block_hashes"])
                elif e["type"] == "BlockRemoved":
                    assert set(e["block_hashes"]) <= held, rank  # only what it said it stored
                    held -= set(e["block_hashes"])
                    removed += 1
        assert len(held) <= POOL  # what is still announced fits the pool
    assert removed > 0  # 32 full blocks stored in 24: some were evicted, and said so


def _replay(endpoint: str, start: int = 0, wait_ms: int = 10_000) -> list[tuple[int, bytes]]:
    """vLLM's replay request from a DEALER: [b"", start seq]; (seq, payload) until seq -1."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint.replace("*", "127.0.0.1"))
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    replayed = []
    try:
        while True:
            assert dealer.poll(wait_ms), "no replay answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                return replayed
            replayed.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close()


def test_replay_returns_the_missed_batches(server, streams):
    url, config, _ = server
    stream = streams[0]
    stream.drain(0.2)
    replayed = _replay(config["replay_endpoint"])
    # seq 0, sent before any subscriber joined: a new engine's pool is empty
    assert replayed[0][0] == 0
    assert msgspec.msgpack.decode(replayed[0][1])[1] == [{"type": "AllBlocksCleared"}]
    assert [s for s, _ in replayed] == list(range(len(replayed)))
    live = {seq: payload for seq, payload, _ in stream.batches}
    assert live and all(dict(replayed)[seq] == payload for seq, payload in live.items())


@pytest.mark.parametrize("config, message", [
    ("{not json", "--kv-events-config is not JSON"),
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown key(s) endpont"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be bool"),
    ('{"enable_kv_cache_events": true, "hwm": 0}', "hwm must be at least 1"),
    ("PORT_IN_USE", "cannot bind tcp://*:"),
    ("NO_PYZMQ", 'publisher "zmq" needs pyzmq'),
])
def test_a_bad_config_is_one_line_at_start(tiny_model_dir, tmp_path, config, message):
    env = None
    with socket.socket() as busy:
        if config == "PORT_IN_USE":
            busy.bind(("0.0.0.0", 0))
            busy.listen()
            config = json.dumps({"enable_kv_cache_events": True,
                                 "endpoint": f"tcp://*:{busy.getsockname()[1]}"})
        elif config == "NO_PYZMQ":  # a Python where `import zmq` fails, as without the extra
            (tmp_path / "zmq.py").write_text("raise ImportError(\"No module named 'zmq'\")\n")
            env = dict(os.environ, PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
            config = '{"enable_kv_cache_events": true}'
        r = subprocess.run([sys.executable, "-m", "ringserve.tools.cli", "serve", "--model",
                            str(tiny_model_dir), "--device", "cpu", "--port", str(free_port()),
                            "--kv-events-config", config],
                           capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1 and r.stderr.startswith("error: --kv-events-config"), r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_restarted_engine_says_its_pool_is_empty(server):
    """The one reset ringserve has: an engine that dies is restarted with an empty pool. Its
    publisher starts again at seq 0 with AllBlocksCleared (a router also sees the seq go back)."""
    url, config, launcher = server
    replay = {rank: offset_endpoint(config["replay_endpoint"], rank) for rank in (0, 1)}
    first = {rank: _replay(e)[0] for rank, e in replay.items()}  # each one's seq 0 (its own ts)
    engines = engine_pids(launcher)
    assert len(engines) == 2
    os.kill(engines[0], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:  # the launcher restarts it: a new publisher, a new seq 0
        time.sleep(0.5)
        try:
            now = {rank: _replay(e, wait_ms=1000) for rank, e in replay.items()}
        except AssertionError:  # the dead engine's replay socket is not bound yet
            assert time.monotonic() < deadline
            continue
        if changed := [rank for rank in now if now[rank][0] != first[rank]]:
            break
        assert time.monotonic() < deadline
    (rank,) = changed
    (seq, payload), = now[rank]  # nothing else since: its pool is empty and untouched
    assert seq == 0 and msgspec.msgpack.decode(payload)[1] == [{"type": "AllBlocksCleared"}]
    assert now[1 - rank][0] == first[1 - rank]  # the other engine went on
    deadline = time.monotonic() + 60
    while httpx.get(url + "/health").status_code != 200:  # the module's server stops cleanly
        assert time.monotonic() < deadline
        time.sleep(0.3)
