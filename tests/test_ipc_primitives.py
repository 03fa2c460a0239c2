"""ipc/ primitives with real processes and real shared memory: segments, rings, wire messages,
doorbells, the control socket and the load score."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import stat
import threading
import time

import msgspec
import numpy as np
import pytest

from ringserve.ipc import control
from ringserve.ipc import ring as ring_mod
from ringserve.ipc.channel import Channel
from ringserve.ipc.doorbell import Doorbell
from ringserve.ipc.messages import (
    Abort,
    AddRequest,
    EngineOutput,
    RefusedRequest,
    decode_outputs,
    decode_request,
    encode_outputs,
    encode_request,
)
from ringserve.ipc.ring import RecordTooLarge, Ring
from ringserve.ipc.sampling_params import SamplingParams
from ringserve.ipc.shm import SHM_DIR, Segment, remove_stale_segments
from ringserve.ipc.stats import (
    GENERATION_TOKENS,
    NUM_PREEMPTIONS,
    PREFIX_CACHE_HITS,
    PREFIX_CACHE_QUERIES,
    PROMPT_TOKENS_COMPUTED,
    STEPS,
    EngineStats,
    Heartbeat,
    hang_reason,
    least_loaded,
    score,
    stats_size,
)

ctx = mp.get_context("spawn")


pytestmark = pytest.mark.usefixtures("no_segment_left_behind")


# -- segments ----------------------------------------------------------------------------


def _attach_and_write(name: str) -> None:
    seg = Segment.attach(name)
    seg.buf[:5] = b"hello"
    seg.close()  # an attacher's close never unlinks


def _create_and_die(conn) -> None:
    seg = Segment.create(4096)
    conn.send(seg.name)
    os.kill(os.getpid(), signal.SIGKILL)


def test_segment_is_private_shared_and_removed_by_its_creator():
    seg = Segment.create(8192)
    path = SHM_DIR / seg.name
    assert seg.name.startswith(f"ringserve-{os.getpid()}-") and len(seg.name.rsplit("-", 1)[1]) == 16
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    p = ctx.Process(target=_attach_and_write, args=(seg.name,))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    assert bytes(seg.buf[:5]) == b"hello"
    assert path.exists()  # the attacher's exit did not unlink it (unlike multiprocessing.shared_memory)
    seg.close()
    assert not path.exists()


def test_attach_refuses_foreign_names():
    with pytest.raises(ValueError):
        Segment.attach("../etc/passwd")


@pytest.mark.serial  # another worker's server start would sweep its stale segments
def test_stale_segments_of_dead_creators_are_removed():
    mine = Segment.create(4096)
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_create_and_die, args=(child,))
    p.start()
    stale = parent.recv()
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    assert (SHM_DIR / stale).exists()
    removed = remove_stale_segments()
    assert stale in removed and mine.name not in removed
    assert not (SHM_DIR / stale).exists() and (SHM_DIR / mine.name).exists()
    mine.close()


def _unused_pid() -> int:
    """A pid no process has here: what a creator in another PID namespace looks like."""
    pid = int(open("/proc/sys/kernel/pid_max").read()) - 1
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


def _hold_under_foreign_name(conn, foreign_pid: int) -> None:
    """Create a segment, rename it as if its creator were `foreign_pid` (the inode, and so the
    creator's lock, stays), and live until killed."""
    seg = Segment.create(4096)
    name = f"ringserve-{foreign_pid}-{seg.name.rsplit('-', 1)[1]}"
    os.rename(SHM_DIR / seg.name, SHM_DIR / name)
    conn.send(name)
    time.sleep(120)


@pytest.mark.serial  # another worker's server start would sweep its stale segments
def test_cleanup_spares_a_locked_segment_whatever_pid_its_name_carries():
    """Liveness is the creator's lock, not a pid: a live creator in another PID namespace
    (its pid does not exist here) keeps its segment; once it is gone, the segment goes."""
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_hold_under_foreign_name, args=(child, _unused_pid()))
    p.start()
    try:
        foreign = parent.recv()
        assert foreign not in remove_stale_segments()
        assert (SHM_DIR / foreign).exists()
    finally:
        p.kill()
        p.join(30)
    assert foreign in remove_stale_segments()
    assert not (SHM_DIR / foreign).exists()


@pytest.mark.serial  # another worker's server start would sweep its stale segments
def test_cleanup_removes_an_unlocked_segment_even_if_its_pid_is_alive():
    """A segment nobody holds is stale even when its name's pid is alive (reused by someone)."""
    path = SHM_DIR / f"ringserve-{os.getpid()}-{os.urandom(8).hex()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)
    assert path.name in remove_stale_segments()
    assert not path.exists()


# -- ring --------------------------------------------------------------------------------


def _ring_pair(capacity: int) -> tuple[Segment, Ring, Ring]:
    seg = Segment.create(Ring.region_size(capacity))
    return seg, Ring(seg.buf, 0, capacity), Ring(seg.buf, 0, capacity)


def test_records_wrap_around_the_end_intact():
    seg, w, r = _ring_pair(256)
    rng = np.random.default_rng(0)
    for _ in range(500):  # sizes chosen so that headers and payloads land on every offset
        payload = rng.integers(0, 256, int(rng.integers(0, 200)), dtype=np.uint8).tobytes()
        assert w.try_write(payload)
        assert r.read() == payload
    assert r.read() is None
    w.release(), r.release(), seg.close()


def test_full_ring_refuses_then_accepts_without_loss():
    seg, w, r = _ring_pair(1024)
    written = 0
    while w.try_write(written.to_bytes(8, "little") * 4):
        written += 1
    assert written == 1024 // 40  # 8-byte header + 32-byte payload each
    with pytest.raises(ring_mod.Full):
        w.write(bytes(32))
    assert int.from_bytes(r.read()[:8], "little") == 0
    assert w.try_write(written.to_bytes(8, "little") * 4)
    got = [int.from_bytes(m[:8], "little") for m in iter(r.read, None)]
    assert got == list(range(1, written + 1))
    w.release(), r.release(), seg.close()


def test_record_larger_than_the_ring_is_refused_clearly():
    seg, w, r = _ring_pair(1024)
    with pytest.raises(RecordTooLarge, match="exceeds"):
        w.try_write(bytes(1024))
    w.release(), r.release(), seg.close()


def test_weakly_ordered_cpu_is_refused_unless_overridden(monkeypatch):
    monkeypatch.setattr(ring_mod.platform, "machine", lambda: "aarch64")
    monkeypatch.delenv("RINGSERVE_ALLOW_WEAK_ORDERING", raising=False)
    with pytest.raises(RuntimeError, match="acquire/release"):
        ring_mod.check_memory_ordering()
    monkeypatch.setenv("RINGSERVE_ALLOW_WEAK_ORDERING", "1")
    ring_mod.check_memory_ordering()


def _produce(name: str, capacity: int, count: int, conn) -> None:
    ch = Channel.attach(name, capacity)
    stalls = 0
    for i in range(count):
        msg = i.to_bytes(8, "little") * (1 + i % 7)  # variable length
        while not ch.requests.try_write(msg):
            stalls += 1
    conn.send(stalls)
    ch.close()


def test_100k_messages_cross_in_order_with_backpressure():
    count = 100_000
    ch = Channel.create(capacity=16 * 1024)  # small: the producer must wait for the consumer
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_produce, args=(ch.segment.name, ch.capacity, count, child))
    p.start()
    expected = 0
    while expected < count:
        msg = ch.requests.read()
        if msg is None:
            if expected % 1000 == 0:
                time.sleep(0.0005)  # a slow consumer, now and then
            continue
        assert msg == expected.to_bytes(8, "little") * (1 + expected % 7)
        expected += 1
    stalls = parent.recv()
    p.join(30)
    assert p.exitcode == 0
    assert ch.requests.read() is None
    assert stalls > 0  # the full ring pushed back, and still nothing was lost
    ch.close()


def _send_prompt(name: str, capacity: int, n_tokens: int) -> None:
    ch = Channel.attach(name, capacity)
    ids = np.arange(n_tokens, dtype=np.int32) * 7 % 49152
    while not ch.requests.try_write(encode_request(AddRequest("long", ids, SamplingParams(max_tokens=1)))):
        pass
    ch.close()


def test_32k_token_prompt_crosses():
    ch = Channel.create()
    p = ctx.Process(target=_send_prompt, args=(ch.segment.name, ch.capacity, 32768))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    msg = decode_request(ch.requests.read())
    assert msg.request_id == "long" and msg.params == SamplingParams(max_tokens=1)
    assert msg.prompt_token_ids.dtype == np.int32
    assert np.array_equal(msg.prompt_token_ids, np.arange(32768) * 7 % 49152)
    ch.close()


def _echo_messages(name: str, capacity: int, count: int) -> None:
    """Read `count` messages from the request ring and write each back on the output ring, a
    fragment at a time as room appears (an engine's part, in another process)."""
    ch = Channel.attach(name, capacity)
    pending: list = []
    echoed = 0
    while echoed < count or pending:
        if echoed < count and (msg := ch.requests.read()) is not None:
            pending += ch.outputs.fragments(msg)
            echoed += 1
        while pending and ch.outputs.try_write(*pending[0]):
            pending.pop(0)
    ch.close()


def test_messages_several_rings_large_cross_both_ways_between_processes():
    """Messages up to 5x the ring (20 records' worth), interleaved with small ones, go to
    another process and back, each written in fragments as the reader makes room: all whole,
    in order, both ways."""
    ch = Channel.create(capacity=16 * 1024)
    rng = np.random.default_rng(1)
    sizes = [int(rng.integers(1, 200)) if i % 3 else int(rng.integers(20_000, 80_000)) for i in range(60)]
    messages = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    p = ctx.Process(target=_echo_messages, args=(ch.segment.name, ch.capacity, len(messages)))
    p.start()
    pending = [piece for m in messages for piece in ch.requests.fragments(m)]
    got: list[bytes] = []
    deadline = time.monotonic() + 60
    while len(got) < len(messages):
        assert time.monotonic() < deadline and (p.is_alive() or p.exitcode == 0)
        while pending and ch.requests.try_write(*pending[0]):
            pending.pop(0)
        if (msg := ch.outputs.read()) is not None:
            got.append(msg)
    p.join(30)
    assert p.exitcode == 0 and got == messages and ch.outputs.read() is None
    assert max(sizes) > 4 * ch.capacity
    ch.close()


# -- messages ----------------------------------------------------------------------------


def test_request_messages_round_trip():
    ids = [1, -2, 2**31 - 1, 0]
    add = AddRequest("req-é1", ids, SamplingParams(temperature=0.5, stop_token_ids=[2, 3]), trace=True)
    got = decode_request(encode_request(add))
    # the prompt comes back as an int32 array (what the engine takes), read-only: it views the record
    assert isinstance(got.prompt_token_ids, np.ndarray) and got.prompt_token_ids.dtype == np.int32
    assert got.prompt_token_ids.tolist() == ids and not got.prompt_token_ids.flags.writeable
    assert (got.request_id, got.params, got.trace) == (add.request_id, add.params, True)
    # an int32 array goes out as it is
    again = decode_request(encode_request(AddRequest("a", np.array(ids, np.int32), SamplingParams())))
    assert again.prompt_token_ids.tolist() == ids and again.trace is False
    empty = decode_request(encode_request(AddRequest("e", [], SamplingParams())))
    assert (empty.request_id, len(empty.prompt_token_ids), empty.params) == ("e", 0, SamplingParams())
    assert decode_request(encode_request(Abort("req-é1"))) == Abort("req-é1")
    # prompt ids are raw int32: 4 bytes each in one msgpack bin (3-byte header), plus the array
    # header, tag, id, params (all at their defaults: an empty map, whose header msgspec writes
    # as a map16, 3 bytes) and trace flag
    assert len(encode_request(AddRequest("r", list(range(1000)), SamplingParams()))) == \
        1 + 1 + 2 + 3 + 4000 + 3 + 1


def test_a_request_whose_params_are_refused_decodes_as_refused_not_as_garbage():
    """SamplingParams are built, so validated, when a record is decoded: a value out of range,
    of the wrong type or an unknown field refuses that request alone (the engine answers it
    with an error output); a params payload that is not a map is no request at all."""
    def record(params) -> bytes:
        return msgspec.msgpack.encode((1, "r", b"\x01\x00\x00\x00\x02\x00\x00\x00", params, False))

    for params, why in (({"top_p": 1e-46}, "top_p underflows"), ({"n": "x"}, "$[3].n"),
                        ({"bogus": 1}, "bogus"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens")):
        got = decode_request(record(params))
        assert isinstance(got, RefusedRequest), params
        assert (got.request_id, got.num_prompt_tokens) == ("r", 2) and why in got.error, got.error
    # the conversions happen once, when built: top_k's -1 is 0 and a stop string a list
    ok = decode_request(record({"top_k": -1, "stop": "x"}))
    assert isinstance(ok, AddRequest) and (ok.params.top_k, ok.params.stop) == (0, ["x"])
    with pytest.raises(msgspec.ValidationError):
        decode_request(record([1]))


def test_output_messages_round_trip():
    lps = [[(12, -0.5, 1), (40, -1.5, 2)], [(13, -0.25, 3), (7, -0.125, 1), (8, -3.0, 2)]]
    outs = [
        EngineOutput("a", [11], None, num_prompt_tokens=17, num_cached_tokens=16),
        EngineOutput("b", [12, 13], "stop", index=2, num_prompt_tokens=3, stop_reason=13, logprobs=lps),
        EngineOutput("c", [], "error", error="prompt too long: 40000 > 32768"),
        EngineOutput("d", [1, 2, 3], "length", logprobs=[[], [(2, -1.0, 1)], []]),
        EngineOutput("e", [], "abort"),
    ]
    assert decode_outputs(encode_outputs(outs)) == outs
    assert decode_outputs(encode_outputs([])) == []
    # one decode token of one request: 30 bytes (the step's int32 id block and int32 count
    # block, 4 bytes each, then an 11-field array holding the id and an empty list)
    assert len(encode_outputs([EngineOutput("abcd", [5])])) == 30


# -- load score --------------------------------------------------------------------------


def test_score_prefers_the_engine_design_md_names():
    a, b = score(waiting=2, running=10), score(waiting=0, running=14)
    assert (a, b) == (18, 14)
    assert least_loaded([a, b]) == 1
    assert least_loaded([None, a]) == 1 and least_loaded([None, None]) is None
    assert score(0, 14, pending=1) == 18  # the caller's own uncounted submission weighs as waiting


def test_stats_are_published_across_processes():
    seg = Segment.create(stats_size(4))
    st = EngineStats(seg.buf)
    st.init(pid=os.getpid(), max_slots=4, num_blocks=100, block_size=16)
    st.publish(waiting=2, running=10, free_blocks=60)
    st.set_taken(3, 42)
    for preemptions in (1, 2):  # counters add up step by step
        st.count_step(preemptions=preemptions, prefix_cache_queries=32, prefix_cache_hits=16,
                      prompt_tokens_computed=20, generation_tokens=3)
    reader = EngineStats(Segment.attach(seg.name).buf)
    assert (reader.waiting, reader.running, reader.taken(3)) == (2, 10, 42)
    counters = [reader[w] for w in (STEPS, NUM_PREEMPTIONS, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS,
                                    PROMPT_TOKENS_COMPUTED, GENERATION_TOKENS)]
    assert counters == [2, 3, 64, 32, 40, 6]
    assert 0 <= reader.heartbeat_age() < 5
    reader.release(), st.release(), seg.close()


# -- doorbells and the control socket ----------------------------------------------------


def _client(path: str, conn) -> None:
    sock, welcome, fds = control.connect(path)
    ch = Channel.attach(welcome.segment, welcome.ring_capacity)
    sock.send(control.ATTACHED)
    engine_bell, my_bell = Doorbell(fds[0]), Doorbell(fds[1])
    ch.requests.write(b"ping")
    engine_bell.ring()
    assert my_bell.wait(10)
    my_bell.drain()
    conn.send((welcome.slot, welcome.generation, ch.outputs.read()))
    ch.close()
    time.sleep(60)  # until killed


def test_hang_reason_tells_a_stopped_engine_and_an_endless_step_from_a_long_one():
    """The launcher's judge over a real stats segment: a beating engine in a step shorter than
    the limit is fine; a step past it is hung although the heartbeat is fresh; a heartbeat
    older than the limit (the process stopped) is hung even when idle."""
    seg = Segment.create(stats_size(2))
    stats = EngineStats(seg.buf)
    stats.init(os.getpid(), 2)
    beat = Heartbeat(stats, interval=0.02)
    beat.start()
    try:
        stats.step_began()
        assert hang_reason(stats, 0.5) is None  # a step under way, younger than the limit
        time.sleep(0.7)
        assert 0 <= stats.heartbeat_age() < 0.5
        assert "step running" in hang_reason(stats, 0.5)
        stats.went_idle()
        assert stats.step_age() == 0.0 and hang_reason(stats, 0.5) is None
    finally:
        beat.stop()
    time.sleep(0.7)  # no one beats now: as if the process were stopped
    assert "no heartbeat" in hang_reason(stats, 0.5)
    stats.release()
    seg.close()


def test_handshake_passes_fds_and_a_killed_peer_is_seen(tmp_path):
    path = str(tmp_path / "engine.sock")
    lsock = control.listen(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_client, args=(path, child))
    p.start()
    engine_bell, worker_bell = Doorbell(), Doorbell()
    ch = Channel.create()
    lsock.setblocking(True)
    conn, _ = lsock.accept()
    control.send_welcome(conn, control.Welcome(slot=3, generation=7, engine_pid=os.getpid(),
                                               segment=ch.segment.name, stats_segment="",
                                               ring_capacity=ch.capacity),
                         [engine_bell.fd, worker_bell.fd])
    assert conn.recv(64) == control.ATTACHED
    ch.segment.unlink()
    assert engine_bell.wait(10) and engine_bell.drain() == 1
    assert ch.requests.read() == b"ping"
    ch.outputs.write(b"pong")
    worker_bell.ring()
    assert parent.recv() == (3, 7, b"pong")
    os.kill(p.pid, signal.SIGKILL)
    conn.settimeout(5)
    assert conn.recv(64) == b""  # the kernel closed the dead client's end
    p.join(10)
    for x in (conn, lsock, engine_bell, worker_bell, ch):
        x.close()


def test_refused_handshake_is_reported_and_a_stale_socket_file_replaced(tmp_path):
    path = str(tmp_path / "engine.sock")
    lsock = control.listen(path)
    lsock.setblocking(True)
    refuse = threading.Thread(target=lambda: control.send_refusal(lsock.accept()[0], "all 2 slots are taken"))
    refuse.start()
    with pytest.raises(control.HandshakeError, match="slots are taken"):
        control.connect(path)
    refuse.join()
    with pytest.raises(OSError, match="already listening"):
        control.listen(path)
    lsock.close()  # the file stays, as after a crash
    with pytest.raises(OSError):
        control.connect(path, timeout=1)
    control.listen(path).close()
