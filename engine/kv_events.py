"""KV-cache events as vLLM publishes them (--kv-events-config), for KV-aware routers.

The KV-cache manager (engine/kv_cache.py) records what its prefix cache gains and loses: a
full block registered under its hash (BlockStored), a cached block evicted for reuse or made
unfindable after a failed step (BlockRemoved), a fresh pool (AllBlocksCleared, the first batch
of every engine process: a restarted engine has lost its cache). The engine process sends each
step's events as one KVEventBatch on a ZMQ PUB socket, with vLLM's three frames (topic, 8-byte
big-endian sequence number, msgpack payload), keeps the last `buffer_steps` batches for the
ROUTER replay socket, and offsets the endpoint's port by its data-parallel rank (one publisher
per engine, as vLLM has one per DP rank).

The encoding is the one vllm-router's kv_aware decodes (vllm_router 0.1.17, src/kv_index/wire.rs):
the batch a positional array [ts, events, data_parallel_rank] (array_like); each event a map
tagged with its class name under "type" (msgspec tag=True), fields in vLLM's order. Block
hashes are vLLM's ints: the last 8 bytes of our sha256 chain hash, big-endian (vLLM's
`maybe_convert_block_hash`). A router does not recompute them: it hashes the token ids the
BlockStored carries (block by block), and uses the engine's hashes only to chain and remove.

Nothing of this runs when events are off: the KV manager's event list is None (one test per
registered block, none per token) and no publisher exists. Only the engine process
(engine/process.py) turns recording on, as it is the one that takes the events every step.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Any

import msgspec

log = logging.getLogger("ringserve.engine")

MEDIUM_GPU = "GPU"  # vLLM's name for the engine's own KV pool (whatever its device)
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay stream's last frame


# -- the config (vLLM's KVEventsConfig keys) ---------------------------------------------------

@dataclass
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None          # "zmq" | "null"; None: "zmq" when enabled, as vLLM
    endpoint: str = "tcp://*:5557"        # bind when it has * or :: or is ipc://, else connect
    replay_endpoint: str | None = None    # a ROUTER socket answering replay requests
    buffer_steps: int = 10_000            # batches kept for replay
    hwm: int = 100_000                    # the PUB socket's send high-water mark
    max_queue_size: int = 100_000         # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f'--kv-events-config: publisher must be "zmq" or "null", '
                             f"got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--kv-events-config: {name} must be at least 1, "
                                 f"got {getattr(self, name)}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://")):
                raise ValueError(f"--kv-events-config: {name} must be tcp://HOST:PORT or "
                                 f"ipc://PATH, got {value!r}")

    @property
    def enabled(self) -> bool:
        """Are events recorded and sent (vLLM: enable_kv_cache_events and a zmq publisher)?"""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def for_rank(self, rank: int) -> KVEventsConfig:
        """This config as engine `rank` binds it: ports offset by the rank (vLLM's DP rule)."""
        return KVEventsConfig(**{**asdict(self), "endpoint": offset_endpoint(self.endpoint, rank),
                                 "replay_endpoint": offset_endpoint(self.replay_endpoint, rank)})


_TYPES = {f.name: str(f.type) for f in fields(KVEventsConfig)}  # "bool", "str | None", ...


def parse_kv_events_config(value: str | dict | KVEventsConfig | None) -> KVEventsConfig | None:
    """--kv-events-config's JSON (or a dict, or a config) checked as vLLM's keys; ValueError
    with one line saying what is wrong."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--kv-events-config must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_TYPES))
    if unknown:
        raise ValueError(f"--kv-events-config: unknown key(s) {', '.join(unknown)} "
                         f"(known: {', '.join(_TYPES)})")
    for key, v in value.items():
        if not _type_ok(_TYPES[key], v):
            raise ValueError(f"--kv-events-config: {key} must be {_TYPES[key]}, got {v!r}")
    return KVEventsConfig(**value)


def _type_ok(annotation: str, v: Any) -> bool:
    """Does v fit a field annotated `annotation` (a string: `from __future__ import annotations`)?"""
    if v is None:
        return "None" in annotation
    if annotation.startswith("bool"):
        return isinstance(v, bool)
    if annotation.startswith("int"):
        return isinstance(v, int) and not isinstance(v, bool)
    return isinstance(v, str)


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """vLLM's offset_endpoint_port: tcp://host:port -> port + rank; ipc://path -> path_dp<rank>."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def binds(endpoint: str) -> bool:
    """vLLM's rule: a PUB endpoint with a wildcard host (or ipc) is bound, any other connected
    (to a proxy that subscribers reach)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith("ipc://")


def bind_address(endpoint: str) -> tuple[str, int] | None:
    """(host, port) a tcp endpoint binds, for the launcher's port-in-use check; None otherwise."""
    if not (endpoint.startswith("tcp://") and binds(endpoint)):
        return None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    host = host.strip("[]")
    return ("0.0.0.0" if host == "*" else host), int(port)


# -- the events (vLLM's msgspec Structs) -------------------------------------------------------

class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A tagged map: {"type": "<class name>", field: value, ...}."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]           # a chain: block i's parent is block i-1
    parent_block_hash: int | None     # the first block's parent (None: the prompt's first block)
    token_ids: list[int]              # block_size tokens per block, all blocks
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def external_hash(block_hash: bytes) -> int:
    """The int a block hash travels as (vLLM: the last 8 bytes, big-endian: a u64)."""
    return int.from_bytes(block_hash[-8:], "big")


# -- the publisher -----------------------------------------------------------------------------

class ZmqEventPublisher:
    """PUB + optional ROUTER replay, served by one thread (vLLM's ZmqEventPublisher). The
    sockets are bound here, so a bad endpoint or a port in use fails the engine's start; after
    that only the thread touches them."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int):
        import zmq  # pyzmq: the `kv-events` extra (checked when the config is built)
        self._zmq = zmq
        self.rank = data_parallel_rank
        self.config = config = config.for_rank(data_parallel_rank)
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._encode = msgspec.msgpack.Encoder().encode
        self._dropped = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            (self._pub.bind if binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise KVEventsError(f"--kv-events-config: engine {data_parallel_rank} cannot open "
                                f"{config.endpoint}{'' if self._replay is None else ' / replay'}"
                                f": {e}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list) -> None:
        """Send one step's events (encoded here, on the engine's thread: one C call)."""
        payload = self._encode(KVEventBatch(time.time(), events, self.rank))
        try:
            self._queue.put_nowait(payload)
        except queue.Full:  # the thread is stuck: never block the engine's step on it
            self._dropped += 1
            if self._dropped == 1:
                log.warning("KV events: the publisher queue is full; dropping batches")

    def shutdown(self, timeout: float = 1.0) -> None:
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                payload = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if payload is None:
                return
            seq_bytes = seq.to_bytes(8, "big")
            try:
                self._pub.send_multipart((self._topic, seq_bytes, payload))
            except self._zmq.ZMQError as e:  # the batch stays in the replay buffer
                log.warning("KV events: send of batch %d failed: %s", seq, e)
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        """A request [identity, b"", start seq (8 bytes, big-endian)] gets every buffered batch
        from that seq as [identity, b"", seq, payload], then [identity, b"", -1, b""] (vLLM's)."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: bad replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


class KVEventsError(RuntimeError):
    """The publisher cannot start (its message is the one line the launcher prints)."""
