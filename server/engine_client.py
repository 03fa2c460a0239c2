"""The asyncio engine client of one frontend process (HTTP worker or load generator).

It holds one slot on every engine that is up: a control connection (its closing means the
engine died), a ring pair, the engine's doorbell and its own output doorbell, registered with
the event loop. ``submit`` picks the least-loaded engine — ``4 * waiting + running`` from the
engine's published counts, plus this client's submissions the engine has not counted yet —
writes an AddRequest and rings the engine; outputs come back as an async iterator. A request
larger than a quarter of the ring goes in fragments (ipc/ring.py), queued whole behind what
waits for room so that no other record lands between them; one over the engine's message limit
is refused before anything is written (``MessageTooLarge``: HTTP 400).

When an engine dies, every open request on it ends at once with an ``error`` output, new work
goes to the other engines (``EngineUnavailable`` when there is none: HTTP 503), and a
background task reconnects when the engine is back. "Dies" means its control socket closed:
this client never judges an engine by its heartbeat. A hung engine is the launcher's to judge
(server/launch.py, --engine-hang-timeout); it kills it, which closes the socket. Two judges
with different limits would disagree, and a worker that gave up first would fail streams of
an engine that was only running a long step. Imports only ringserve.ipc.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import sys
import time
from typing import Any, Callable, Sequence

from ringserve.ipc import control
from ringserve.ipc.channel import Channel
from ringserve.ipc.doorbell import Doorbell
from ringserve.ipc.messages import (
    Abort,
    AddRequest,
    EngineOutput,
    FinishReason,
    decode_outputs,
    encode_request,
)
from ringserve.ipc.ring import MessageTooLarge
from ringserve.ipc.sampling_params import SamplingParams
from ringserve.ipc.shm import Segment
from ringserve.ipc.stats import EngineStats, least_loaded, score

log = logging.getLogger("ringserve.client")


class EngineUnavailable(Exception):
    """No engine can take work right now."""


class RequestStream:
    """The outputs of one request, in order; ends after its last sample finishes (or fails).

    More than ``max_backlog`` outputs waiting here while ``consumer_blocked()`` says the
    consumer cannot go on (an HTTP client that does not read its stream: the writer waits in
    ``send``) ends it: the client aborts the request, which frees its blocks in the engine, and
    calls ``on_backlog_full`` (the HTTP layer cuts the connection). The limit is on what is
    queued, never on time: a consumer that keeps up, however slowly its client reads, never
    reaches it; and a burst from one ring drain (the worker was busy) is no stall while the
    client still takes what was sent. Without ``consumer_blocked``, the size alone decides."""

    def __init__(self, request_id: str, engine: int, n: int, max_backlog: int,
                 on_full: Callable[[RequestStream], None] | None = None):
        self.request_id = request_id
        self.engine = engine                 # index of the engine it runs on
        self._unfinished = n
        self._items: collections.deque[EngineOutput] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._max_backlog = max_backlog
        self._on_full = on_full
        self.backlog_full = False            # it overflowed: aborted, not finished
        self.consumer_blocked: Callable[[], bool] | None = None  # set by the consumer
        self.on_backlog_full: Callable[[], None] | None = None   # set by the consumer
        self.route: dict[str, Any] | None = None  # traced requests: the choice and every score

    @property
    def done(self) -> bool:
        return self._unfinished == 0

    def _put(self, out: EngineOutput, final: bool = False) -> None:
        self._items.append(out)
        if out.finished:
            self._unfinished = 0 if final else self._unfinished - 1
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        # NOTE per output: one len() and compare, the only cost of the bound on the hot path.
        if (len(self._items) > self._max_backlog and not self.backlog_full
                and (self.consumer_blocked is None or self.consumer_blocked())):
            self.backlog_full = True
            if self._on_full is not None:
                self._on_full(self)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> EngineOutput:
        while not self._items:
            if self.done:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()


class _Engine:
    """This client's connection to one engine."""

    def __init__(self, index: int, sock, welcome: control.Welcome, fds: list[int]):
        self.index = index
        self.sock = sock
        self.welcome = welcome
        self.engine_bell, self.bell = Doorbell(fds[0]), Doorbell(fds[1])
        self.channel = Channel.attach(welcome.segment, welcome.ring_capacity, welcome.max_message)
        self.stats_segment = Segment.attach(welcome.stats_segment)
        self.stats = EngineStats(self.stats_segment.buf)
        self.submitted = 0                   # AddRequest records written to this engine
        self.streams: dict[str, RequestStream] = {}
        # Records waiting for room in the request ring, in order: (payload, flag: 0 or a
        # fragment's, the future of a submit waiting for its request's last record, or None).
        self.outbox: collections.deque[tuple[bytes | memoryview, int, asyncio.Future | None]] = \
            collections.deque()
        self.flush_due = False               # a retry of the outbox is scheduled
        self.alive = True
        self.detached: str | None = None     # why the engine detached this slot, if it did

    def score(self) -> int:
        pending = self.submitted - self.stats.taken(self.welcome.slot)
        return score(self.stats.waiting, self.stats.running, pending)

    def close(self) -> None:
        self.alive = False
        self.sock.close()
        self.engine_bell.close()
        self.bell.close()
        self.channel.close()
        self.stats.release()
        self.stats_segment.close()


class EngineClient:
    def __init__(self, control_paths: Sequence[str], *, reconnect_interval: float = 0.2,
                 connect_timeout: float = 5.0, max_stream_backlog: int | None = None):
        """max_stream_backlog: bound each stream's untaken outputs (the HTTP worker passes
        --max-stream-backlog); None, for a consumer in this process that reads at its own pace
        (the load generator, benchmarks): no bound."""
        self.control_paths = list(control_paths)
        self.engines: list[_Engine | None] = [None] * len(self.control_paths)
        self.streams: dict[str, RequestStream] = {}
        self.reconnect_interval = reconnect_interval
        self.connect_timeout = connect_timeout
        self.max_stream_backlog = sys.maxsize if max_stream_backlog is None else max_stream_backlog
        self._loop: asyncio.AbstractEventLoop  # set by start()
        self._watch: asyncio.Task | None = None
        self._connecting: set[int] = set()

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Connect to every engine that is up now; keep reconnecting the others in the background."""
        self._loop = asyncio.get_running_loop()
        await asyncio.gather(*(self._connect(i) for i in range(len(self.engines))))
        self._watch = self._loop.create_task(self._watchdog())

    async def wait_ready(self, count: int | None = None, timeout: float = 60.0) -> None:
        """Wait until ``count`` engines (default: all) are connected."""
        count = len(self.engines) if count is None else count
        deadline = self._loop.time() + timeout
        while sum(e is not None for e in self.engines) < count:
            if self._loop.time() > deadline:
                raise EngineUnavailable(f"only {sum(e is not None for e in self.engines)} of "
                                        f"{count} engines connected after {timeout} s")
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        for e in self.engines:
            if e is not None:
                self._lose(e, "the engine client closed", logging.DEBUG)  # our own close: no news

    @property
    def num_ready(self) -> int:
        return sum(e is not None for e in self.engines)

    def loads(self) -> list[int | None]:
        """Each engine's score (None: not connected)."""
        return [e.score() if e is not None else None for e in self.engines]

    # -- requests ----------------------------------------------------------------------
    async def submit(self, request_id: str, prompt_token_ids: Sequence[int],
                     params: SamplingParams, trace: bool = False) -> RequestStream:
        """Send a request to the least-loaded engine; iterate the returned stream for outputs.

        ``params``: validated when built; the engine validates them again and answers an
        invalid record with an error output. Raises EngineUnavailable when no engine is up,
        MessageTooLarge when the request is over the engine's message limit.
        ``trace``: the engine records the request's journey and returns it on the last output;
        the stream's ``route`` then holds the engine chosen and every engine's score."""
        if request_id in self.streams:
            raise ValueError(f"request id {request_id!r} is already open")
        record = encode_request(AddRequest(request_id, prompt_token_ids, params, trace))
        scores = self.loads() if trace else None
        engine = self._choose()
        if len(record) > engine.channel.max_message:
            raise MessageTooLarge(
                f"this request is {len(record)} bytes on its way to the engine (prompt token ids, "
                f"stop strings, structured-output grammar and the other parameters), "
                f"over the limit of {engine.channel.max_message} bytes for one message")
        stream = RequestStream(request_id, engine.index, params.n,
                               self.max_stream_backlog, self._on_backlog_full)
        route = None
        if trace:
            route = stream.route = {"engine": engine.index, "scores": scores,
                                    "chosen_at": time.monotonic()}
        self.streams[request_id] = engine.streams[request_id] = stream
        try:
            written = self._post(engine, record, wait=True)
            if written is not None:  # queued (the ring is full, or the request is in fragments)
                await written
        except EngineUnavailable:
            self.streams.pop(request_id, None)
            raise
        except asyncio.CancelledError:  # its client left: the abort goes in behind the request
            self.abort(request_id)
            raise
        engine.submitted += 1
        if route is not None:
            route["written_at"] = time.monotonic()
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request (e.g. its HTTP client left); its stream ends with an "abort" output."""
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return
        engine = self.engines[stream.engine]
        stream._put(EngineOutput(request_id, [], FinishReason.ABORT), final=True)
        if engine is not None and engine.alive:
            engine.streams.pop(request_id, None)
            self._post(engine, encode_request(Abort(request_id)), wait=False)

    def _on_backlog_full(self, stream: RequestStream) -> None:
        """A stream's consumer stopped taking outputs: abort its request (after the output
        record being read now: abort() changes the stream tables) and tell the consumer."""
        log.warning("request %s: %d outputs not taken (the client is not reading); aborting it",
                    stream.request_id, self.max_stream_backlog)

        def abort() -> None:
            self.abort(stream.request_id)
            if stream.on_backlog_full is not None:
                stream.on_backlog_full()
        self._loop.call_soon(abort)

    def _post(self, engine: _Engine, record: bytes, wait: bool) -> asyncio.Future | None:
        """Write a request or abort message now, or queue it (in fragments if it is larger than
        a quarter of the ring) behind what waits. wait: the future of its last record's write
        (EngineUnavailable if the engine is lost first); None when written now."""
        if not engine.alive:
            raise EngineUnavailable(f"engine {engine.index} died before taking the request")
        ring = engine.channel.requests
        if not engine.outbox and len(record) <= ring.max_fragment and ring.try_write(record):
            engine.engine_bell.ring()  # PERF: the common case, one record
            return None
        done = self._loop.create_future() if wait else None
        pieces = ring.fragments(record)
        engine.outbox.extend((piece, flag, None) for piece, flag in pieces[:-1])
        engine.outbox.append((*pieces[-1], done))
        self._flush(engine)
        return done

    def _flush(self, engine: _Engine) -> None:
        """Write what the outbox holds while the ring has room; retry in 1 ms if it is full."""
        if not engine.alive:
            return
        ring, outbox, wrote = engine.channel.requests, engine.outbox, False
        while outbox and ring.try_write(outbox[0][0], outbox[0][1]):
            done = outbox.popleft()[2]
            wrote = True
            if done is not None and not done.done():
                done.set_result(None)
        if wrote:
            engine.engine_bell.ring()
        if outbox and not engine.flush_due:  # full: the engine is behind
            engine.flush_due = True
            self._loop.call_later(0.001, self._retry, engine)

    def _retry(self, engine: _Engine) -> None:
        engine.flush_due = False
        self._flush(engine)

    def _choose(self) -> _Engine:
        up = [e for e in self.engines if e is not None]
        if not up:
            raise EngineUnavailable("no engine is available")
        best = least_loaded([e.score() for e in up])
        assert best is not None  # every connected engine has a score
        return up[best]

    # -- outputs -----------------------------------------------------------------------
    def _on_outputs(self, engine: _Engine) -> None:
        engine.bell.drain()  # before reading: an output written after this rings again
        ring = engine.channel.outputs
        while (record := ring.read()) is not None:
            for out in decode_outputs(record):
                stream = engine.streams.get(out.request_id)
                if stream is None:
                    continue  # aborted here already
                stream._put(out)
                if stream.done:
                    del engine.streams[out.request_id]
                    self.streams.pop(out.request_id, None)

    # -- engines coming and going ------------------------------------------------------
    async def _connect(self, index: int) -> None:
        if index in self._connecting:
            return
        self._connecting.add(index)
        try:
            sock, welcome, fds = await asyncio.to_thread(
                control.connect, self.control_paths[index], self.connect_timeout)
        except (OSError, control.HandshakeError):
            return  # not up (yet); the watchdog tries again
        finally:
            self._connecting.discard(index)
        try:
            engine = _Engine(index, sock, welcome, fds)
            sock.send(control.ATTACHED)
        except OSError:  # the engine died mid-handshake
            sock.close()
            for fd in fds:
                os.close(fd)
            return
        self.engines[index] = engine
        self._loop.add_reader(engine.bell.fd, self._on_outputs, engine)
        self._loop.add_reader(sock.fileno(), self._on_control, engine)
        log.info("connected to engine %d (slot %d, generation %d)", index, welcome.slot, welcome.generation)

    def _on_control(self, engine: _Engine) -> None:
        try:
            reason = control.recv_refusal(engine.sock)
        except BlockingIOError:
            return
        if reason is not None:  # the engine detached this slot; the EOF follows
            engine.detached = reason
            return
        self._lose(engine, engine.detached or (
            f"engine {engine.index} died (crashed, or killed by the launcher as hung); the "
            "request was lost, retry it"))

    def _lose(self, engine: _Engine, reason: str, level: int = logging.WARNING) -> None:
        """Fail every open request on the engine and forget it until it reconnects; `reason`
        is logged at `level`."""
        if not engine.alive:
            return
        self._on_outputs(engine)  # what it sent before dying still counts
        self._loop.remove_reader(engine.bell.fd)
        self._loop.remove_reader(engine.sock.fileno())
        for request_id, stream in engine.streams.items():
            stream._put(EngineOutput(request_id, [], FinishReason.ERROR, error=reason), final=True)
            self.streams.pop(request_id, None)
        engine.streams.clear()
        for _, _, done in engine.outbox:  # a submit still waiting to write its request
            if done is not None and not done.done():
                done.set_exception(EngineUnavailable(
                    f"engine {engine.index} died before taking the request"))
        engine.outbox.clear()
        self.engines[engine.index] = None
        engine.close()
        log.log(level, "%s", reason)

    async def _watchdog(self) -> None:
        """Reconnect engines that are gone (a hung one is the launcher's to kill, see above)."""
        while True:
            await asyncio.sleep(self.reconnect_interval)
            for i, engine in enumerate(self.engines):
                if engine is None:
                    self._loop.create_task(self._connect(i))
