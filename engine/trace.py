"""What the engine core records for a traced request, and its recent steps for /debug/engines.

A request asks to be traced with a flag in its AddRequest; only then does the core keep a
RequestTrace for it: when it was admitted and with which batch, the blocks it got and when,
each step it ran in (its positions and the slots their K/V went to, read from the very Batch
handed to the runner), preemptions, and the step that returned its blocks to the pool. The
journey leaves the engine once, as a small JSON blob on the request's finished output.

With no traced request and no debug history, the core pays one attribute test per step.
Times are time.monotonic() seconds (CLOCK_MONOTONIC is system-wide on Linux, so the frontend
can subtract its own arrival time).
"""
from __future__ import annotations

import itertools
import json
import os
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from ringserve.engine.request import Request
from ringserve.engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from ringserve.engine.core import EngineCore
    from ringserve.gpu.batch import Batch
    from ringserve.ipc.messages import EngineOutput

_encode = msgspec.json.Encoder().encode


class RequestTrace:
    """The journey of one sequence through the engine (one of a request's n samples)."""

    def __init__(self, req: Request, received: float):
        self.req = req
        self.received = received
        self.running = False                     # admitted and not preempted since
        self.block_table: list[int] = []
        self.admissions: list[dict] = []
        self.allocations: list[dict] = []
        self.preemptions: list[dict] = []
        self.steps: list[dict] = []
        self.finish: dict | None = None

    def to_json(self) -> bytes:
        return _encode({"received": self.received, "admissions": self.admissions,
                        "allocations": self.allocations, "preemptions": self.preemptions,
                        "steps": self.steps, "finish": self.finish})


class EngineTracer:
    def __init__(self, core: EngineCore):
        self.core = core
        self.traces: dict[str, RequestTrace] = {}        # Request.key -> its trace
        self.history: deque[dict] | None = None           # recent steps, when debugging

    @property
    def active(self) -> bool:
        return bool(self.traces) or self.history is not None

    def keep_history(self, num_steps: int) -> None:
        self.history = deque(maxlen=num_steps)

    def watch(self, req: Request) -> None:
        self.traces[req.key] = RequestTrace(req, time.monotonic())

    # -- hooks called by EngineCore.step -----------------------------------------------------
    def on_scheduled(self, step: int, start: float, sched: SchedulerOutput, batch: Batch) -> None:
        """The batch is built: record what each traced request got in it."""
        if not self.traces:
            return
        composition = None
        qsl = batch.query_start_loc
        for i, s in enumerate(sched.scheduled):
            trace = self.traces.get(s.request.key)
            if trace is None:
                continue
            if composition is None:
                composition = self._composition(sched)
            if not trace.running:
                trace.running = True
                trace.admissions.append({"step": step, "at": start, "batch": composition,
                                         "num_cached_tokens": s.num_computed_tokens})
            table = self.core.kv.block_ids(s.request)
            if table != trace.block_table:
                known = set(trace.block_table)
                trace.allocations.append({"step": step, "at": start,
                                          "blocks": [b for b in table if b not in known],
                                          "block_table": table})
                trace.block_table = table
            computed = s.num_computed_tokens
            prompt = s.request.num_prompt_tokens
            phase = ("decode" if s.num_new_tokens == 1 and computed >= prompt
                     else "verify" if s.draft_token_ids  # a decode token and its drafts
                     else "recompute" if s.request.num_output_tokens > 0 else "prefill")
            trace.steps.append({"step": step, "start": start, "end": None, "phase": phase,
                                "first_position": computed, "num_new_tokens": s.num_new_tokens,
                                "slots": batch.slot_mapping[qsl[i]:qsl[i + 1]].tolist(),
                                "batch": composition})

    def on_step_end(self, step: int, start: float, sched: SchedulerOutput,
                    outputs: list[EngineOutput]) -> None:
        end = time.monotonic()
        if self.history is not None:
            self.history.append({"step": step, "start": start, "end": end,
                                 "num_prefill_tokens": sched.num_prefill_tokens,
                                 "num_decode_tokens": sched.num_decode_tokens,
                                 "num_reqs": len(sched.scheduled),
                                 "num_preempted": len(sched.preempted),
                                 "num_free_blocks": self.core.kv.num_free_blocks})
        if not self.traces:
            return
        for req in sched.preempted:
            trace = self.traces.get(req.key)
            if trace is not None:
                trace.running = False
                trace.preemptions.append({"step": step, "at": start, "blocks_freed": trace.block_table})
                trace.block_table = []
        for s in sched.scheduled:
            trace = self.traces.get(s.request.key)
            if trace is not None and trace.steps and trace.steps[-1]["step"] == step:
                trace.steps[-1]["end"] = end
        for out in outputs:
            if not out.finished:
                continue
            key = out.request_id if out.index == 0 else f"{out.request_id}#{out.index}"
            trace = self.traces.pop(key, None)
            if trace is None:
                continue
            req = trace.req
            kv = self.core.kv
            trace.finish = {"step": step, "at": end, "reason": out.finish_reason,
                            "num_prompt_tokens": req.num_prompt_tokens,
                            "num_output_tokens": req.num_output_tokens,
                            # the last sampled token is never written to the cache
                            "num_tokens_in_cache": req.num_computed_tokens,
                            "block_size": kv.block_size,
                            "blocks_freed": trace.block_table,
                            "num_free_blocks_after": kv.num_free_blocks,
                            "num_blocks": kv.num_blocks}
            out.trace = trace.to_json()

    def _composition(self, sched: SchedulerOutput) -> dict:
        sch = self.core.scheduler
        return {"num_prefill_tokens": sched.num_prefill_tokens,
                "num_decode_tokens": sched.num_decode_tokens,
                "num_tokens": sched.total_num_scheduled_tokens,     # the super-sequence length
                "num_reqs": len(sched.scheduled),
                "max_num_batched_tokens": sch.max_num_batched_tokens,
                "max_num_seqs": sch.max_num_seqs,
                "num_waiting_after": len(sch.waiting)}

    # -- the debug snapshot ------------------------------------------------------------------
    def snapshot(self, num_steps: int) -> dict[str, Any]:
        """Queues, the block pool block by block, and the recent steps (for /debug/engines)."""
        core = self.core
        kv = core.kv
        sch = core.scheduler
        owners: list[str] = []
        # Per block: -1 free, -2 free but still holding a cached prefix, else an index into
        # owners. Work in proportion to cached and held blocks, never to the whole pool.
        state = np.full(kv.num_blocks, -1, np.int32)
        cached = [b.block_id for b in kv.pool.cached.values() if b.ref_cnt == 0]
        state[cached] = -2
        for req in sch.running:
            ids = [b for b in kv.block_ids(req) if state[b] < 0]   # a shared block: first holder
            state[ids] = len(owners)
            owners.append(_public_id(req.key))
        return {
            "pid": os.getpid(),
            "time": time.monotonic(),
            "num_steps": num_steps,
            "block_size": kv.block_size,
            "num_blocks": kv.num_blocks,
            "num_free_blocks": kv.num_free_blocks,
            "num_cached_free_blocks": len(cached),
            "max_num_seqs": sch.max_num_seqs,
            "max_num_batched_tokens": sch.max_num_batched_tokens,
            "waiting": [_queue_entry(r, kv) for r in list(sch.waiting)[:64]],
            "num_waiting": len(sch.waiting),
            "running": [_queue_entry(r, kv) for r in sch.running[:256]],
            "num_running": len(sch.running),
            "block_owners": owners,
            "blocks_rle": run_lengths(state),
            "steps": list(self.history or ()),
        }


def run_lengths(values: np.ndarray) -> list[list[int]]:
    """[-1, -1, 0, 0, 0, -2] -> [[-1, 2], [0, 3], [-2, 1]]: a pool of 100k blocks, mostly free,
    in a few hundred bytes."""
    if len(values) == 0:
        return []
    starts = np.flatnonzero(np.diff(values)) + 1
    edges = np.concatenate(([0], starts, [len(values)]))
    return [[int(values[a]), int(b - a)] for a, b in itertools.pairwise(edges)]


def _public_id(key: str) -> str:
    """The engine process names requests <slot>.<generation>.<id>; show the worker's id."""
    parts = key.split(".", 2)
    return parts[2] if len(parts) == 3 else key


def _queue_entry(req: Request, kv) -> dict:
    return {"id": _public_id(req.key), "num_tokens": req.num_tokens,
            "num_computed_tokens": req.num_computed_tokens,
            "num_output_tokens": req.num_output_tokens, "num_preemptions": req.num_preemptions,
            "num_blocks": len(kv.block_ids(req))}


class DebugPublisher:
    """Writes the engine's snapshot to a JSON file (atomically, by rename) in the server's
    private runtime folder, at most every `interval` seconds while busy and once more when it
    goes idle. Only with --enable-debug-endpoints."""

    def __init__(self, path: str, interval: float = 0.2):
        self.path = path
        self.interval = interval
        self._last_write = 0.0
        self._last_steps = -1

    def maybe_write(self, core: EngineCore, num_steps: int, idle: bool) -> None:
        if num_steps == self._last_steps:
            return
        now = time.monotonic()
        if not idle and now - self._last_write < self.interval:
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(core.tracer.snapshot(num_steps), f, separators=(",", ":"))
        os.replace(tmp, self.path)
        self._last_write, self._last_steps = now, num_steps
