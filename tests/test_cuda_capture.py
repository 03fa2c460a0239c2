"""The CUDA runner's capture and upload logic without a GPU (issue 15 items 2 and 3):
gpu/cuda/capture.py over a stand-in of cupy.cuda.Stream's capture API that keeps the state
CUDA keeps (capturing or not; an invalidated capture's end_capture raises, as
cudaErrorStreamCaptureInvalidated does), and gpu/cuda/buffers.py PinnedStaging over numpy
"pinned" buffers and stand-in events.
"""
from __future__ import annotations

import contextlib
import logging

import numpy as np
import pytest

from ringserve.gpu.batch import Batch
from ringserve.gpu.cuda import capture, plan
from ringserve.gpu.cuda.buffers import PinnedStaging


class StandInStream:
    def __init__(self):
        self.capturing = False
        self.invalidated = False
        self.begun = self.ended = 0

    def begin_capture(self):
        assert not self.capturing, "begin_capture on a capturing stream"
        self.capturing, self.invalidated = True, False
        self.begun += 1

    def end_capture(self):
        assert self.capturing, "end_capture without a capture"
        self.capturing = False
        self.ended += 1
        if self.invalidated:
            raise RuntimeError("cudaErrorStreamCaptureInvalidated")
        return f"graph {self.begun}"

    def is_capturing(self):
        return self.capturing


class Allocator:
    """What cupy.cuda.using_allocator(capture.refuse_allocation) does: while it is in force,
    an allocation calls the refusing allocator."""

    def __init__(self):
        self.current = None

    @contextlib.contextmanager
    def using(self, allocator):
        prev, self.current = self.current, allocator
        try:
            yield
        finally:
            self.current = prev

    def empty(self, nbytes):
        if self.current is not None:
            self.current(nbytes)
        return bytearray(nbytes)


def test_a_capture_that_raises_still_ends_and_reports_its_own_error():
    stream = StandInStream()

    def forward():
        stream.invalidated = True  # what a failing launch does to a capture
        raise ValueError("kernel launch failed")

    with pytest.raises(ValueError, match="kernel launch failed"):
        capture.capture(stream, forward, contextlib.nullcontext)
    assert not stream.is_capturing() and stream.ended == 1
    assert capture.capture(stream, lambda: None, contextlib.nullcontext) == "graph 2"  # usable again


def test_an_allocation_during_capture_raises_and_the_allocator_comes_back():
    stream, alloc = StandInStream(), Allocator()
    with pytest.raises(capture.AllocationDuringCapture, match="1024-byte device allocation"):
        capture.capture(stream, lambda: alloc.empty(1024),
                        lambda: alloc.using(capture.refuse_allocation))
    assert not stream.is_capturing() and alloc.current is None
    assert len(alloc.empty(16)) == 16  # after the capture, allocation works again


def decode(n: int) -> Batch:
    return Batch(np.zeros(n, np.int32), np.zeros(n, np.int32), np.full(n, -1, np.int32),
                 np.arange(n + 1, dtype=np.int32), np.ones(n, np.int32), np.zeros((n, 1), np.int32))


def capture_failing_at(stream: StandInStream, bad: int):
    """capture_ladder's capture_size over `stream`: every size captures an empty forward but
    `bad`, whose forward raises mid-capture (the stream invalidated, as CUDA leaves it)."""
    def capture_size(size):
        def forward():
            if size == bad:
                stream.invalidated = True
                raise RuntimeError("an op that cannot be captured")
        return capture.capture(stream, forward, contextlib.nullcontext)
    return capture_size


def test_a_failed_size_runs_eager_and_the_others_keep_their_graphs(caplog):
    stream = StandInStream()
    table = plan.GraphTable([1, 2, 4, 8])
    with caplog.at_level(logging.WARNING, logger="ringserve.gpu.cuda.capture"):
        failed = capture.capture_ladder(table, capture_failing_at(stream, 4))
    assert failed == {4: "RuntimeError: an op that cannot be captured"}
    assert sorted(table.graphs) == [1, 2, 8] and not stream.is_capturing()
    assert "batch size 4 failed, that size runs eager: RuntimeError: an op that cannot" in caplog.text
    assert table.pick(decode(3)) is None          # padded to 4: no graph, eager
    assert table.pick(decode(2)) == 2 and table.pick(decode(5)) == 8


def verify(drafts: list[int]) -> Batch:
    """Speculative decoding's verify step: request r computes its last token and drafts[r]
    draft tokens, logits at each of them (engine/inputs.py)."""
    counts = 1 + np.array(drafts, np.int32)
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    T = int(qsl[-1])
    req = np.repeat(np.arange(len(drafts)), counts)
    return Batch(np.zeros(T, np.int32), (np.arange(T) - qsl[req]).astype(np.int32),
                 np.full(T, -1, np.int32), qsl, counts, np.zeros((len(drafts), 1), np.int32),
                 sample_indices=np.arange(T, dtype=np.int32))


def test_speculative_decoding_adds_a_verify_ladder_its_steps_replay():
    """--speculative-config on CUDA (K = 3, disable_by_batch_size 8): beside the decode ladder
    up to max_num_seqs, a verify graph per size up to 8 requests, each of n x 4 tokens and
    rows of logits (n + 1 request slots); captured as the decode ladder is (a failed size runs
    eager, the others keep theirs). A verify step replays the smallest verify graph that holds
    it; a decode step its decode graph; a step of more requests than 8 runs eager."""
    from ringserve.engine.config import EngineConfig

    limits = EngineConfig.create(speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                                 device="cuda", max_num_seqs=64).step_limits
    decode_table, verify_table = plan.graph_tables(limits)
    assert decode_table.sizes == plan.graph_batch_sizes(64) and decode_table.query_len == 1
    assert verify_table.sizes == [1, 2, 4, 8] and verify_table.query_len == 4
    assert [verify_table.shape(n) for n in verify_table.sizes] == [(4, 2, 4), (8, 3, 8), (16, 5, 16),
                                                                   (32, 9, 32)]
    assert plan.shared_shape([decode_table, verify_table]) == (64, 64, 64)
    stream = StandInStream()
    capture_size = capture_failing_at(stream, 2)
    failed = {2: "RuntimeError: an op that cannot be captured"}
    assert capture.capture_ladder(decode_table, capture_size) == failed
    assert capture.capture_ladder(verify_table, capture_size) == failed
    assert sorted(verify_table.graphs) == [1, 4, 8] and not stream.is_capturing()
    assert verify_table.pick(verify([3])) == 1 and verify_table.pick(verify([3, 0, 2])) == 4
    assert verify_table.pick(verify([1, 1])) is None           # size 2 failed: eager
    assert verify_table.pick(verify([3] * 8)) == 8 and verify_table.pick(verify([1] * 9)) is None
    assert decode_table.pick(verify([3])) is None and decode_table.pick(decode(5)) == 8
    plain = EngineConfig.create(device="cuda", max_num_seqs=64).step_limits
    assert plan.graph_tables(plain)[1].sizes == []             # no speculation: no verify graphs


class Event:
    def __init__(self, log):
        self.log, self.recorded = log, None

    def record(self, stream):
        self.recorded = stream
        self.log.append(("record", id(self), stream))

    def synchronize(self):
        self.log.append(("synchronize", id(self)))


def test_pinned_staging_copies_into_its_buffers_and_waits_before_reuse():
    log: list = []
    allocated: list[np.ndarray] = []

    def alloc(nbytes):
        allocated.append(np.zeros(nbytes, np.uint8))
        return allocated[-1]

    staging = PinnedStaging(alloc, lambda: Event(log), slots=2)
    a = np.arange(10, dtype=np.int32)
    host = staging.stage(a)
    assert host is not a and np.array_equal(host, a) and host.dtype == a.dtype
    assert any(np.shares_memory(host, buf) for buf in allocated)  # the copy reads pinned memory
    staging.issued("stream")
    corner = np.arange(12, dtype=np.int32).reshape(3, 4)
    host2 = staging.stage(corner)
    assert host2.shape == (3, 4) and np.array_equal(host2, corner)
    assert not np.shares_memory(host, host2)  # the first may still be in flight
    staging.issued("stream")
    assert not [e for e in log if e[0] == "synchronize"]
    big = np.arange(5000, dtype=np.int32)
    host3 = staging.stage(big)  # slot 0 again: its copy is waited for, and it grows
    assert log[-1] == ("synchronize", log[0][1])
    assert np.array_equal(host3, big) and len(allocated) == 3
