"""One (worker, engine) pair's two rings in one segment: requests worker->engine, outputs
engine->worker. Each ring has exactly one writer, so no cross-process lock is ever needed.
A message (a request, a step's outputs) larger than a quarter of the ring goes in fragments, up
to ``max_message`` bytes (ipc/ring.py); the engine tells its clients both sizes (Welcome)."""

from __future__ import annotations

from ringserve.ipc.ring import DEFAULT_MAX_MESSAGE, Ring
from ringserve.ipc.shm import Segment

DEFAULT_RING_CAPACITY = 1 << 20  # 1 MiB each way: several 32k-token prompts (128 KiB each)


class Channel:
    def __init__(self, segment: Segment, capacity: int, max_message: int = DEFAULT_MAX_MESSAGE):
        self.segment = segment
        self.capacity = capacity
        self.max_message = max_message
        self.requests = Ring(segment.buf, 0, capacity, max_message)
        self.outputs = Ring(segment.buf, Ring.region_size(capacity), capacity, max_message)

    @staticmethod
    def size(capacity: int) -> int:
        return 2 * Ring.region_size(capacity)

    @classmethod
    def create(cls, capacity: int = DEFAULT_RING_CAPACITY,
               max_message: int = DEFAULT_MAX_MESSAGE) -> Channel:
        segment = Segment.create(cls.size(capacity))  # fresh file pages are zero: counters at 0
        try:
            return cls(segment, capacity, max_message)
        except BaseException:
            segment.close()
            raise

    @classmethod
    def attach(cls, name: str, capacity: int, max_message: int = DEFAULT_MAX_MESSAGE) -> Channel:
        segment = Segment.attach(name)
        if segment.size < cls.size(capacity):
            segment.close()
            raise ValueError(f"segment {name} is {segment.size} bytes, a channel of {capacity} "
                             f"needs {cls.size(capacity)}")
        return cls(segment, capacity, max_message)

    def close(self) -> None:
        self.requests.release()
        self.outputs.release()
        self.segment.close()
