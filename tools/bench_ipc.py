"""Benchmark the frontend<->engine transports in one run (docs/design.md §4).

    .venv/bin/python -m ringserve.tools.bench_ipc [--quick] [--repeats 3] [--json FILE]

Every transport carries the same thing: an AddRequest whose prompt is a Python list of ints
(what the tokenizer gives; 16 tokens ~ 64 B, or 4096 tokens = 16 KiB of ids) in, and on the
other side token ids that EngineCore.add_request takes as they are, each with its natural
encoding: our ring and os.pipe the binary wire format of ringserve.ipc.messages (int32 bytes
in, an int32 array out), multiprocessing.Queue pickle (a list out), pyzmq PUSH/PULL msgspec
msgpack (a list out, as vLLM's EngineCoreRequest travels). Encoding and decoding are inside
the timings. Throughput: one process sends N requests, the other decodes them all (the median
of --repeats runs). Round trip: a request goes to an engine-like process, which decodes it and
answers with one step's output (one token, each transport's natural encoding again). Wake-up:
the engine writes a record and rings the doorbell of an idle asyncio frontend, which notes the
delay when its reader callback runs. Codec: the encode and decode cost alone, in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import pickle
import struct
import tempfile
import time
import timeit
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import numpy as np

from ringserve.ipc.channel import Channel
from ringserve.ipc.doorbell import Doorbell
from ringserve.ipc.messages import (
    AddRequest,
    EngineOutput,
    FinishReason,
    decode_outputs,
    decode_request,
    encode_outputs,
    encode_request,
)
from ringserve.ipc.sampling_params import SamplingParams
from ringserve.tools.bench_report import BenchRun, Column, add_json_argument, table

ctx = mp.get_context("fork")  # transports are created first and inherited; nothing here holds CUDA
T = TypeVar("T")


class ZmqRequest(msgspec.Struct, array_like=True):  # as vLLM's EngineCoreRequest travels
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class ZmqOutput(msgspec.Struct, array_like=True):  # as vLLM's EngineCoreOutput travels
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None


class ZmqOutputs(msgspec.Struct, array_like=True):
    outputs: list[ZmqOutput]


# -- transports: two ends, each with send(msg) and recv() -> msg ------------------------


class RecordEnd:
    """An end that moves whole records (ring, pipe) and speaks the ring's wire format."""

    def _put(self, record: bytes) -> None:
        raise NotImplementedError

    def _get(self) -> bytes:
        raise NotImplementedError

    def send(self, msg: AddRequest) -> None:
        self._put(encode_request(msg))

    def recv(self) -> AddRequest:
        # The benchmark sends only AddRequests (no Abort): no check in the measured loop.
        return decode_request(self._get())  # type: ignore[return-value]

    def send_outputs(self, outs: list[EngineOutput]) -> None:
        self._put(encode_outputs(outs))

    def recv_outputs(self) -> list[EngineOutput]:
        return decode_outputs(self._get())


class RingEnd(RecordEnd):
    def __init__(self, name: str, capacity: int, parent: bool):
        self.ch = Channel.attach(name, capacity)
        ends = (self.ch.requests, self.ch.outputs)
        self.tx, self.rx = ends if parent else ends[::-1]

    def _put(self, record: bytes) -> None:
        while not self.tx.try_write(record):  # spin: the busy engine's mode
            pass

    def _get(self) -> bytes:
        while (record := self.rx.read()) is None:
            pass
        return record



class PipeEnd(RecordEnd):
    def __init__(self, fds: tuple[int, int]):
        self.rfd, self.wfd = fds

    def _put(self, data: bytes) -> None:
        view = memoryview(struct.pack("<I", len(data)) + data)
        while view:
            view = view[os.write(self.wfd, view):]

    def _read(self, n: int) -> bytes:
        parts = []
        while n:
            chunk = os.read(self.rfd, n)
            parts.append(chunk)
            n -= len(chunk)
        return b"".join(parts)

    def _get(self) -> bytes:
        (n,) = struct.unpack("<I", self._read(4))
        return self._read(n)



class QueueEnd:
    def __init__(self, tx, rx):
        self.tx, self.rx = tx, rx

    def send(self, msg: Any) -> None:  # requests and lists of outputs alike, pickled
        self.tx.put(msg)

    def recv(self) -> Any:
        return self.rx.get()

    send_outputs = send
    recv_outputs = recv

    def flush(self) -> None:  # put() hands off to a feeder thread: let it finish
        self.tx.close()
        self.tx.join_thread()


class ZmqEnd:
    def __init__(self, tx_addr: str, rx_addr: str):
        import zmq

        self.zctx = zmq.Context()
        self.tx = self.zctx.socket(zmq.PUSH)
        self.tx.bind(tx_addr)
        self.rx = self.zctx.socket(zmq.PULL)
        self.rx.connect(rx_addr)
        self.enc = msgspec.msgpack.Encoder()
        self.dec = msgspec.msgpack.Decoder(ZmqRequest)
        self.dec_out = msgspec.msgpack.Decoder(ZmqOutputs)

    def send(self, msg: AddRequest) -> None:
        record = self.enc.encode(ZmqRequest(msg.request_id, msg.prompt_token_ids, msg.params))
        self.tx.send(record, copy=False)

    def recv(self) -> AddRequest:
        m = self.dec.decode(self.rx.recv(copy=False).buffer)
        return AddRequest(m.request_id, m.prompt_token_ids, m.params)

    def send_outputs(self, outs: list[EngineOutput]) -> None:
        wire = ZmqOutputs([ZmqOutput(o.request_id, o.new_token_ids, o.finish_reason) for o in outs])
        self.tx.send(self.enc.encode(wire), copy=False)

    def recv_outputs(self) -> list[EngineOutput]:
        m = self.dec_out.decode(self.rx.recv(copy=False).buffer)
        return [EngineOutput(o.request_id, o.new_token_ids, o.finish_reason) for o in m.outputs]

    def flush(self) -> None:  # sends go out on zmq's I/O thread: wait for them, then stop it
        self.tx.close(linger=5000)
        self.rx.close(linger=0)
        self.zctx.term()


class Transport:
    """Builds the parent's end now and the child's end after the fork."""

    def __init__(self, kind: str, tmp: str):
        self.kind = kind
        self.parent: Callable[[], RecordEnd | QueueEnd | ZmqEnd]
        self.child: Callable[[], RecordEnd | QueueEnd | ZmqEnd]
        if kind == "ring":
            self.channel = Channel.create()
            args = (self.channel.segment.name, self.channel.capacity)
            self.parent = lambda: RingEnd(*args, parent=True)
            self.child = lambda: RingEnd(*args, parent=False)
        elif kind == "os.pipe":
            a, b = os.pipe(), os.pipe()
            self.parent = lambda: PipeEnd((b[0], a[1]))
            self.child = lambda: PipeEnd((a[0], b[1]))
        elif kind == "mp.Queue":
            q1, q2 = ctx.Queue(), ctx.Queue()
            self.parent = lambda: QueueEnd(q1, q2)
            self.child = lambda: QueueEnd(q2, q1)
        elif kind == "zmq+msgspec":
            to_child, to_parent = f"ipc://{tmp}/to_child", f"ipc://{tmp}/to_parent"
            self.parent = lambda: ZmqEnd(to_child, to_parent)
            self.child = lambda: ZmqEnd(to_parent, to_child)
        else:
            raise ValueError(kind)

    def close(self) -> None:
        if self.kind == "ring":
            self.channel.close()


def _child(transport: Transport, role: str, count: int) -> None:
    end = transport.child()
    if role == "engine":  # answer each request with one step's output: its first token
        for _ in range(count):
            msg = end.recv()
            end.send_outputs([EngineOutput(msg.request_id, [int(msg.prompt_token_ids[-1])])])
    else:  # sink: take `count`, then say so
        for _ in range(count):
            msg = end.recv()
        ids = msg.prompt_token_ids
        assert len(ids) == 0 or int(ids[-1]) == len(ids) - 1
        end.send_outputs([EngineOutput("done", [])])
    if hasattr(end, "flush"):
        end.flush()
    os._exit(0)  # skip atexit handlers inherited through fork


def _run(transport: Transport, role: str, count: int, body: Callable[[Any], T]) -> T:
    p = ctx.Process(target=_child, args=(transport, role, count))
    p.start()
    end = transport.parent()
    try:
        return body(end)
    finally:
        if hasattr(end, "flush"):
            end.flush()
        p.join(60)


def measure(kind: str, tokens: int, n_msgs: int, n_rtt: int, tmp: str,
            repeats: int) -> tuple[float, float, float]:
    """(msgs/s, the median of ``repeats`` runs; round trip p50 and p99 in us)."""
    msg = AddRequest("cmpl-0123456789", list(range(tokens)), SamplingParams(max_tokens=16))
    warm = 200

    def throughput(end) -> float:
        for _ in range(warm):
            end.send(msg)
        t0 = time.perf_counter()
        for _ in range(n_msgs):
            end.send(msg)
        end.recv_outputs()
        return n_msgs / (time.perf_counter() - t0)

    def round_trips(end) -> np.ndarray:
        times = np.empty(n_rtt)
        for i in range(warm + n_rtt):
            t0 = time.perf_counter_ns()
            end.send(msg)
            (out,) = end.recv_outputs()
            if i >= warm:
                times[i - warm] = time.perf_counter_ns() - t0
        assert out.new_token_ids == [tokens - 1]  # the ids crossed intact
        return times / 1000

    rates = []
    for _ in range(repeats):  # on a shared machine one run can be unlucky; all transports alike
        t = Transport(kind, tmp)
        rates.append(_run(t, "sink", warm + n_msgs, throughput))
        t.close()
    rate = float(np.median(rates))
    t = Transport(kind, tmp)
    rtt = _run(t, "engine", warm + n_rtt, round_trips)
    t.close()
    return rate, float(np.percentile(rtt, 50)), float(np.percentile(rtt, 99))


# -- wake-up latency of an idle asyncio frontend -----------------------------------------


def _idle_frontend(name: str, capacity: int, bell_fd: int, count: int, result) -> None:
    ch = Channel.attach(name, capacity)
    bell = Doorbell(bell_fd)
    delays: list[float] = []
    loop = asyncio.new_event_loop()
    done = loop.create_future()

    def on_ring() -> None:
        bell.drain()
        while (record := ch.outputs.read()) is not None:
            delays.append((time.perf_counter_ns() - int.from_bytes(record, "little")) / 1000)
        if len(delays) >= count and not done.done():
            done.set_result(None)

    loop.add_reader(bell.fd, on_ring)
    loop.run_until_complete(done)
    result.send(delays)
    os._exit(0)


def wakeup_latency(count: int) -> tuple[float, float]:
    ch = Channel.create()
    bell = Doorbell()
    rx, tx = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_idle_frontend, args=(ch.segment.name, ch.capacity, bell.fd, count, tx))
    p.start()
    time.sleep(0.5)
    for _ in range(count):
        time.sleep(0.002)  # let the frontend go back to sleep in epoll
        ch.outputs.write(time.perf_counter_ns().to_bytes(8, "little"))
        bell.ring()
    delays = np.array(rx.recv())
    p.join(30)
    ch.close()
    bell.close()
    return float(np.percentile(delays, 50)), float(np.percentile(delays, 99))


# -- codec cost alone ---------------------------------------------------------------------


def codec_costs(tokens: int, number: int) -> dict[str, tuple[float, float, float]]:
    """Per codec: (encode us, decode us, us for EngineCore.add_request to turn the decoded ids
    into its int32 array: np.asarray, free for an int32 array)."""
    msg = AddRequest("cmpl-0123456789", list(range(tokens)), SamplingParams(max_tokens=16))
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(ZmqRequest)
    codecs = {
        "ring wire": (lambda: encode_request(msg), decode_request),
        "msgspec": (lambda: enc.encode(ZmqRequest(msg.request_id, msg.prompt_token_ids, msg.params)),
                    dec.decode),
        "pickle": (lambda: pickle.dumps(msg, pickle.HIGHEST_PROTOCOL), pickle.loads),
    }
    return {name: _one_codec(encode, decode, number) for name, (encode, decode) in codecs.items()}


def _one_codec(encode, decode, number: int) -> tuple[float, float, float]:
    """Microseconds per encode, decode and ids-to-int32 of one codec's record."""
    data = encode()
    ids = decode(data).prompt_token_ids
    encode_us, decode_us, ids_us = (
        min(timeit.repeat(f, number=number, repeat=5)) / number * 1e6
        for f in (encode, lambda: decode(data), lambda: np.asarray(ids).astype(np.int32, copy=False)))
    return encode_us, decode_us, ids_us


TRANSPORT_COLUMNS = [Column("transport", "transport", align="<"), Column("message", "message", align="<"),
                     Column("msgs_per_s", "msgs/s", ",.0f"), Column("rtt_p50_us", "rtt p50 us", ".1f"),
                     Column("rtt_p99_us", "rtt p99 us", ".1f"),
                     Column("throughput_vs_zmq", "msgs/s / zmq's", ".2f"),
                     Column("rtt_p50_zmq_over", "zmq's rtt p50 / this", ".2f")]
CODEC_COLUMNS = [Column("codec", "codec", align="<"), Column("message", "message", align="<"),
                 Column("encode_us", "encode us", ".1f"), Column("decode_us", "decode us", ".1f"),
                 Column("to_int32_us", "to int32 us", ".1f")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer messages (a smoke run)")
    ap.add_argument("--repeats", type=int, default=3, help="throughput runs per transport (median)")
    add_json_argument(ap)
    args = ap.parse_args(argv)
    run = BenchRun.start("bench_ipc", args)
    scale = 0.1 if args.quick else 1.0
    sizes = [("64 B (16 tok)", 16, int(100_000 * scale), int(20_000 * scale)),
             ("16 KiB (4096 tok)", 4096, int(10_000 * scale), int(5_000 * scale))]
    kinds = ["ring", "os.pipe", "mp.Queue", "zmq+msgspec"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, tokens, n_msgs, n_rtt in sizes:
            results = {kind: measure(kind, tokens, n_msgs, n_rtt, tmp, args.repeats) for kind in kinds}
            zmq = results["zmq+msgspec"]
            for kind, (rate, p50, p99) in results.items():
                rows.append({"transport": kind, "message": label, "tokens": tokens, "msgs_per_s": rate,
                             "rtt_p50_us": p50, "rtt_p99_us": p99, "throughput_vs_zmq": rate / zmq[0],
                             "rtt_p50_zmq_over": zmq[1] / p50, "rtt_p99_zmq_over": zmq[2] / p99})
    p50, p99 = wakeup_latency(int(2000 * scale))
    codec = [{"codec": name, "message": label, "tokens": tokens, "encode_us": e, "decode_us": d,
              "to_int32_us": i}
             for label, tokens, *_ in sizes
             for name, (e, d, i) in codec_costs(tokens, max(20, int(2000 * scale))).items()]
    run.finish()
    print(run.header())
    print(f"throughput: median of {args.repeats} runs; ratios against zmq+msgspec in the same run "
          f"(higher is better for both)")
    print(table(rows, TRANSPORT_COLUMNS))
    print(f"\neventfd wake-up of an idle asyncio frontend: p50 {p50:.1f} us, p99 {p99:.1f} us\n")
    print(table(codec, CODEC_COLUMNS))
    run.write(args.json, rows, wakeup_us={"p50": p50, "p99": p99}, codec=codec)


if __name__ == "__main__":
    main()
