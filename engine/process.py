"""The engine process: EngineCore behind shared-memory rings (docs/design.md §4).

Each step: take every new record from every worker's request ring (no system call: the rings
are plain memory), run one EngineCore step, write each worker's outputs as one record and
ring that worker's doorbell at most once, then publish waiting/running counts. The heartbeat
is a thread of its own (ipc/stats.Heartbeat), beating whatever the step does; the loop
publishes when each step starts (0 when idle) so the launcher can tell a stuck step from a
long one. On a device whose steps run asynchronously (CUDA), step N-1's outputs go out while
step N runs (launch_step, deliver N-1, finish_step): the host work hides behind the device's,
and results are the same because nothing delivered feeds the step in flight. With nothing to
do, the loop drains its doorbell, rechecks the rings, and blocks in epoll on the doorbell and
the control sockets; but while a slot's backlog holds outputs its ring had no room for (the last
fragments of a large output), it offers them again every BACKLOG_POLL_S instead.

Workers arrive on the control socket and get a slot; a slot's requests are named inside the
core as ``<slot>.<generation>.<request id>`` so that two workers may use the same ids. When a
worker's control connection closes (it died or left), its requests are aborted — their blocks
are free for the next step — and the slot is free for the next worker, with a new generation.

Nothing a slot writes is trusted (another process wrote it: a worker, the load generator, a
buggy or hostile client). A record that is not a request (undecodable, wrong shape, a ring
header that cannot be true) means the writer is broken: the record is logged and dropped and
the slot is detached (its control connection closed: its client sees the engine as lost for
that slot and reconnects to a new one). A request that decodes but cannot run gets an error
output; a request that fails later fails alone (engine/core.py). A step's outputs for one
worker are one message (halved if over the message limit, ipc/messages.encode_output_messages),
which the ring carries in fragments when it is larger than a record (ipc/ring.py); an output
that cannot be encoded or is over the limit alone ends its request with an error instead.
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import selectors
import signal
import socket
import time
from dataclasses import dataclass, field

from ringserve.engine.config import EngineConfig
from ringserve.engine.core import EngineCore
from ringserve.engine.kv_events import AllBlocksCleared, ZmqEventPublisher
from ringserve.engine.trace import DebugPublisher
from ringserve.gpu.runner import MemoryReport
from ringserve.ipc import control
from ringserve.ipc.channel import DEFAULT_RING_CAPACITY, Channel
from ringserve.ipc.doorbell import Doorbell
from ringserve.ipc.messages import (
    Abort,
    AddRequest,
    EngineOutput,
    FinishReason,
    RefusedRequest,
    decode_request,
    encode_output_messages,
)
from ringserve.ipc.ring import DEFAULT_MAX_MESSAGE
from ringserve.ipc.shm import Segment, remove_stale_segments
from ringserve.ipc.stats import EngineStats, Heartbeat, stats_size

log = logging.getLogger("ringserve.engine")

CONTROL_CHECK_S = 0.05   # while busy, look at the control sockets this often (one epoll call)
DEBUG_STEPS = 120        # with debug on: the recent steps kept for /debug/engines
IDLE_BEAT_S = 1.0        # while idle, wake this often (a missed wake-up costs at most this)
MAX_ERROR_CHARS = 1000   # a refusal's message is cut here (it may quote what the record held)
BACKLOG_RINGS = 8        # a slot may hold one message and this many rings' worth of unread outputs
BACKLOG_POLL_S = 0.002   # while idle with outputs waiting for room, offer them again this often


@dataclass(eq=False)
class _Slot:
    index: int
    generation: int
    conn: socket.socket
    channel: Channel
    bell: Doorbell                                            # the worker's output doorbell
    attached: bool = False
    taken: int = 0                                            # AddRequest records consumed
    open: dict[str, int] = field(default_factory=dict)       # request id -> unfinished samples
    # Output records (payload, flag: 0, or a fragment's MORE/END) its ring had no room for, in
    # order, and their bytes. A worker empties its ring whatever its HTTP clients do, so beyond
    # one large message this grows only if the worker stopped.
    backlog: collections.deque[tuple[bytes | memoryview, int]] = field(default_factory=collections.deque)
    backlog_bytes: int = 0

    def key(self, request_id: str) -> str:
        return f"{self.index}.{self.generation}.{request_id}"


class EngineProcess:
    def __init__(self, core: EngineCore, control_path: str, *, max_slots: int = 64,
                 ring_capacity: int = DEFAULT_RING_CAPACITY, max_message: int = DEFAULT_MAX_MESSAGE,
                 debug_path: str | None = None, overlap: bool | None = None,
                 data_parallel_rank: int = 0):
        """max_message: the most bytes of one message either way (ipc/ring.py), told to clients.
        debug_path: where to publish a snapshot (queues, block pool, recent steps) for
        /debug/engines (engine/trace.py); None: no snapshot, no step history.
        data_parallel_rank: this engine's index among the server's engines (its KV events'
        port offset and data_parallel_rank).
        overlap: deliver each step's outputs while the next step runs on the device; None:
        when the runner's submit returns before the device is done (CUDA). On the CPU, submit
        computes the step, so overlapping would only hold every token back one step."""
        remove_stale_segments()
        self.core = core
        # KV-cache events (engine/kv_events.py): bound first, so a port in use fails the start.
        self.kv_events: ZmqEventPublisher | None = None
        if (kv_config := core.config.kv_events) is not None and kv_config.enabled:
            self.kv_events = ZmqEventPublisher(kv_config, data_parallel_rank)
            core.kv.enable_events()
            self.kv_events.publish([AllBlocksCleared()])  # a new engine's pool is empty
        self.overlap = core.runner_is_asynchronous if overlap is None else overlap
        self.ring_capacity = ring_capacity
        self.max_message = max_message
        # Past this, a slot's backlog means a stopped worker: one whole message may wait there
        # (its fragments beyond what the ring holds) and BACKLOG_RINGS rings more.
        self.max_backlog = max_message + BACKLOG_RINGS * ring_capacity
        self.slots: list[_Slot | None] = [None] * max_slots
        self.generations = [0] * max_slots
        self.bell = Doorbell()
        self.stats_segment = Segment.create(stats_size(max_slots))
        self.stats = EngineStats(self.stats_segment.buf)
        memory = MemoryReport.of(core.runner)
        draft = None if core.draft_runner is None else MemoryReport.of(core.draft_runner)
        self.stats.init(os.getpid(), max_slots, core.kv.num_blocks, core.block_size,
                        memory.kv_cache_bytes, memory.weight_bytes, core.max_model_len,
                        draft_weight_bytes=0 if draft is None else sum(draft.weight_bytes.values()),
                        draft_kv_cache_bytes=0 if draft is None else draft.kv_cache_bytes)
        self.stats.publish(0, 0, core.kv.num_free_blocks)
        self.heartbeat = Heartbeat(self.stats)
        self.heartbeat.start()
        self.listener = control.listen(control_path)
        self.control_path = control_path
        self.selector = selectors.EpollSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        self.selector.register(self.bell.fd, selectors.EVENT_READ, None)
        self._stopping = False
        self.debug: DebugPublisher | None = None
        if debug_path is not None:
            core.tracer.keep_history(DEBUG_STEPS)
            self.debug = DebugPublisher(debug_path)

    # -- the loop ----------------------------------------------------------------------
    def serve_forever(self) -> None:
        last_check = time.monotonic()
        undelivered: list[EngineOutput] | None = None  # overlap: the last step's outputs
        while not self._stopping:
            self._take_requests()
            if self.core.has_unfinished_requests():
                self.stats.step_began()
                in_flight = self.core.launch_step()
                if self.overlap:
                    # The device runs step N while the host delivers step N-1 and reads new
                    # records (added requests wait for the next schedule, aborts for its end).
                    if undelivered is not None:
                        self._complete(undelivered)
                    self._take_requests()
                    undelivered = self.core.finish_step(in_flight)
                else:
                    self._complete(self.core.finish_step(in_flight))
                now = time.monotonic()
                if now - last_check >= CONTROL_CHECK_S:
                    self._handle_control(0)
                    last_check = now
                continue
            if undelivered is not None:  # the last step before going idle
                self._complete(undelivered)
                undelivered = None
                continue
            self.stats.went_idle()
            self._publish()
            if self._flush_backlogs():  # no step will: offer what waits while the worker reads
                self._handle_control(BACKLOG_POLL_S)
                last_check = time.monotonic()
                continue
            self.bell.drain()  # before the recheck: a record written after it rings again
            if any(s is not None and s.attached and s.channel.requests.has_data() for s in self.slots):
                continue
            self._handle_control(IDLE_BEAT_S)
            last_check = time.monotonic()

    def _complete(self, outputs: list[EngineOutput]) -> None:
        """A finished step's host work: count it, hand its outputs to the workers, publish."""
        self._count_step(outputs)
        self._deliver(outputs)
        self._publish()
        if self.kv_events is not None:  # PERF: the one test per step when events are off
            if events := self.core.kv.take_events():
                self.kv_events.publish(events)

    def stop(self) -> None:
        self._stopping = True

    def _count_step(self, outputs: list[EngineOutput]) -> None:
        """Add the step to the cumulative counters that /metrics reads."""
        s = self.core.stats
        self.stats.count_step(preemptions=s.num_preemptions,
                              prefix_cache_queries=s.prefix_cache_queries,
                              prefix_cache_hits=s.prefix_cache_hits,
                              prompt_tokens_computed=s.num_prefill_tokens,
                              generation_tokens=sum(len(o.new_token_ids) for o in outputs))
        spec = self.core.scheduler.speculation
        if spec is not None:
            st = spec.stats
            self.stats.set_spec_decode(spec.config.num_speculative_tokens, st.num_drafts,
                                       st.num_draft_tokens, st.num_accepted_tokens,
                                       st.num_off_steps, st.accepted_per_pos or [])

    def _publish(self) -> None:
        for s in self.slots:
            if s is not None:
                self.stats.set_taken(s.index, s.taken)
        self.stats.publish(self.core.num_waiting, self.core.num_running, self.core.kv.num_free_blocks)
        if self.debug is not None:
            self.debug.maybe_write(self.core, self.core.num_steps,
                                   idle=not self.core.has_unfinished_requests())

    # -- requests in -------------------------------------------------------------------
    def _take_requests(self) -> None:
        for slot in self.slots:
            if slot is None or not slot.attached:
                continue
            ring = slot.channel.requests
            try:  # PERF: one try per slot and call, none per record
                while (record := ring.read()) is not None:
                    msg = decode_request(record)
                    if isinstance(msg, Abort):
                        self.core.abort_request(slot.key(msg.request_id))
                    elif isinstance(msg, RefusedRequest):  # its params failed SamplingParams.validate
                        slot.taken += 1
                        self._refuse(slot, msg.request_id, msg.error, msg.num_prompt_tokens)
                    else:
                        slot.taken += 1
                        self._add(slot, msg)
            except Exception as e:  # noqa: BLE001 - not a request: its writer is broken
                self._drop(slot, f"sent a record that is not a request ({type(e).__name__}: {e})")

    def _add(self, slot: _Slot, msg: AddRequest) -> None:
        """msg.params were validated when the record was decoded (SamplingParams.__post_init__)."""
        try:
            if msg.request_id in slot.open:
                raise ValueError(f"request id {msg.request_id!r} is already open")
            self.core.add_request(slot.key(msg.request_id), msg.prompt_token_ids, msg.params,
                                  trace=msg.trace)
        except Exception as e:  # noqa: BLE001 - whatever the record holds, it fails alone
            if not isinstance(e, (TypeError, ValueError)):
                log.exception("request %r from slot %d refused", msg.request_id, slot.index)
            self._refuse(slot, msg.request_id, str(e) or type(e).__name__, len(msg.prompt_token_ids))
            return
        slot.open[msg.request_id] = msg.params.n

    def _refuse(self, slot: _Slot, request_id: str, error: str, num_prompt_tokens: int) -> None:
        """End a request that cannot be added with its one "error" output."""
        if len(error) > MAX_ERROR_CHARS:  # the message may quote a value of any size
            error = error[:MAX_ERROR_CHARS] + "..."
        self._write(slot, [EngineOutput(request_id, [], FinishReason.ERROR, error=error,
                                        num_prompt_tokens=num_prompt_tokens)])
        slot.bell.ring()

    # -- outputs out -------------------------------------------------------------------
    def _deliver(self, outputs: list[EngineOutput]) -> None:
        """Each slot's outputs in one write (a backlog first), its doorbell rung once."""
        per_slot = self._route(outputs)
        for slot in self.slots:
            if slot is None:
                continue
            wrote = self._flush_backlog(slot)
            outs = per_slot.get(slot.index)
            if outs:
                try:  # PERF: one try per slot and step
                    self._write(slot, [out for out, _ in outs])
                except Exception:  # noqa: BLE001 - find the output(s) at fault, end their requests
                    self._write_each(slot, outs)
                wrote = True
            if wrote:
                slot.bell.ring()  # once per step per worker
            if slot.backlog_bytes > self.max_backlog:
                # No unbounded queue: a worker that stopped reading loses its slot (its
                # requests are aborted, their blocks freed); it reconnects when it wakes.
                self._drop(slot, f"stopped reading its outputs ({slot.backlog_bytes} bytes waiting)")

    def _route(self, outputs: list[EngineOutput]) -> dict[int, list[tuple[EngineOutput, str]]]:
        """The outputs by slot, each with the engine's key; the worker's own request id goes
        on the output (the wire), and a finished sample is counted off its request."""
        per_slot: dict[int, list[tuple[EngineOutput, str]]] = {}
        for out in outputs:
            key = out.request_id
            index, generation, request_id = key.split(".", 2)
            slot = self.slots[int(index)]
            if slot is None or slot.generation != int(generation):
                continue  # its worker is gone
            if out.finished:
                if out.error is not None and len(out.error) > MAX_ERROR_CHARS:  # may quote the request
                    out.error = out.error[:MAX_ERROR_CHARS] + "..."
                left = slot.open.get(request_id, 1) - 1
                if left > 0:
                    slot.open[request_id] = left
                else:
                    slot.open.pop(request_id, None)
            out.request_id = request_id
            per_slot.setdefault(slot.index, []).append((out, key))
        return per_slot

    def _write(self, slot: _Slot, outs: list[EngineOutput]) -> None:
        """The outputs as messages, each one record or (larger than a quarter of the ring, so
        that none waits for an empty ring) fragments. MessageTooLarge for an output over the
        message limit alone."""
        ring = slot.channel.outputs
        for message in encode_output_messages(outs, self.max_message):
            if len(message) <= ring.max_fragment:  # PERF: the common case, one record
                if slot.backlog or not ring.try_write(message):
                    slot.backlog.append((message, 0))  # the worker is behind: keep order
                    slot.backlog_bytes += len(message)
                continue
            for piece, flag in ring.fragments(message):
                if slot.backlog or not ring.try_write(piece, flag):
                    slot.backlog.append((piece, flag))
                    slot.backlog_bytes += len(piece)

    def _write_each(self, slot: _Slot, outs: list[tuple[EngineOutput, str]]) -> None:
        """_write's rare path: one output at a time; one that cannot be sent becomes an error
        output (its sample) and ends its request's other samples."""
        for out, key in outs:
            try:
                self._write(slot, [out])
                continue
            except Exception as e:  # noqa: BLE001
                log.exception("the output of request %r could not be sent", out.request_id)
                error = f"the engine could not send this request's output: {type(e).__name__}: {e}"
                error = error[:MAX_ERROR_CHARS]
            self.core.abort_request(key, error=error)
            if out.finished:  # else the abort's own output ends this sample (next step)
                self._write(slot, [EngineOutput(out.request_id, [], FinishReason.ERROR, out.index,
                                                out.num_prompt_tokens, error=error)])

    def _flush_backlogs(self) -> bool:
        """Idle: write what waits in the slots' backlogs (the last fragments of a large output,
        which no step will now send); True while some still waits."""
        waiting = False
        for slot in self.slots:
            if slot is not None and slot.backlog:
                if self._flush_backlog(slot):
                    slot.bell.ring()
                waiting = waiting or bool(slot.backlog)
        return waiting

    def _flush_backlog(self, slot: _Slot) -> bool:
        wrote = False
        while slot.backlog and slot.channel.outputs.try_write(*slot.backlog[0]):
            slot.backlog_bytes -= len(slot.backlog.popleft()[0])
            wrote = True
        return wrote

    # -- control sockets ---------------------------------------------------------------
    def _handle_control(self, timeout: float) -> None:
        for key, _ in self.selector.select(timeout):
            if key.fileobj is self.listener:
                self._accept()
            elif key.data is not None:
                self._on_worker_message(key.data)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:
                return
            free = next((i for i, s in enumerate(self.slots) if s is None), None)
            if free is None:
                control.send_refusal(conn, f"all {len(self.slots)} worker slots are taken")
                conn.close()
                continue
            self.generations[free] += 1
            channel = Channel.create(self.ring_capacity, self.max_message)
            slot = _Slot(free, self.generations[free], conn, channel, Doorbell())
            try:
                control.send_welcome(conn, control.Welcome(
                    slot=free, generation=slot.generation, engine_pid=os.getpid(),
                    segment=channel.segment.name, stats_segment=self.stats_segment.name,
                    ring_capacity=self.ring_capacity, max_message=self.max_message),
                    [self.bell.fd, slot.bell.fd])
            except OSError:
                channel.close()
                slot.bell.close()
                conn.close()
                continue
            conn.setblocking(False)
            self.slots[free] = slot
            self.selector.register(conn, selectors.EVENT_READ, slot)

    def _on_worker_message(self, slot: _Slot) -> None:
        try:
            data = slot.conn.recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data == control.ATTACHED and not slot.attached:
            slot.attached = True
            slot.channel.segment.unlink()  # both sides have it mapped; nothing left to leak
        elif not data:
            self._drop(slot)

    def _drop(self, slot: _Slot, broken: str | None = None) -> None:
        """The worker is gone, or (broken: why) its slot is detached: abort its requests (their
        blocks free now) and free its slot. Closing the control connection tells the client."""
        if self.slots[slot.index] is not slot:
            return  # already dropped
        for request_id in slot.open:
            self.core.abort_request(slot.key(request_id))
        if broken is not None:  # the client's streams end with this reason, not "engine died"
            try:
                control.send_refusal(slot.conn, f"the engine detached this client's slot: it {broken}")
            except OSError:
                pass
        self.selector.unregister(slot.conn)
        slot.conn.close()
        slot.bell.close()
        slot.channel.close()
        self.slots[slot.index] = None
        if broken is None:  # news only when it cost requests (the launcher's probe at start leaves too)
            log.log(logging.INFO if slot.open else logging.DEBUG,
                    "worker in slot %d (generation %d) left; %d requests aborted",
                    slot.index, slot.generation, len(slot.open))
        else:
            log.warning("slot %d (generation %d) detached: it %s; %d requests aborted",
                        slot.index, slot.generation, broken, len(slot.open))

    def close(self) -> None:
        for slot in self.slots:
            if slot is not None:
                self._drop(slot)
        self.selector.close()
        self.listener.close()
        try:
            os.unlink(self.control_path)
        except FileNotFoundError:
            pass
        if self.debug is not None:
            try:
                os.unlink(self.debug.path)
            except FileNotFoundError:
                pass
        if self.kv_events is not None:
            self.kv_events.shutdown()
        self.bell.close()
        self.heartbeat.stop()
        self.stats.release()
        self.stats_segment.close()


def run_engine(config: EngineConfig, control_path: str, **kwargs) -> None:
    """Build the core, serve until SIGTERM/SIGINT, clean up (the target of an engine process)."""
    serve_engine(start_engine(config, control_path, **kwargs))


def start_engine(config: EngineConfig, control_path: str, *, max_slots: int = 64,
                 ring_capacity: int = DEFAULT_RING_CAPACITY, max_message: int = DEFAULT_MAX_MESSAGE,
                 debug_path: str | None = None, overlap: bool | None = None,
                 data_parallel_rank: int = 0) -> EngineProcess:
    """The engine, built and listening on control_path (its settings' errors raise here, before
    it serves: the launcher prints them as one line)."""
    engine = EngineProcess(EngineCore(config), control_path, max_slots=max_slots,
                           ring_capacity=ring_capacity, max_message=max_message,
                           debug_path=debug_path, overlap=overlap,
                           data_parallel_rank=data_parallel_rank)
    # What exists now (weights, the block pool's KVBlocks) lives as long as the process: keep it
    # out of the cyclic collector, whose full passes otherwise walk it (25-31 ms at 1024 running).
    gc.collect()
    gc.freeze()
    return engine


def serve_engine(engine: EngineProcess) -> None:
    """Serve until SIGTERM/SIGINT, then clean up."""
    def _stop(*_):
        engine.stop()
        engine.bell.ring()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        engine.serve_forever()
    finally:
        engine.close()

