"""Single-producer single-consumer ring of variable-length records in shared memory.

Layout (``Ring.region_size(capacity)`` bytes at some offset of a segment)::

    [0:8]     head  uint64  bytes consumed so far (written only by the consumer)
    [64:72]   tail  uint64  bytes published so far (written only by the producer)
    [128:..]  data  ``capacity`` bytes, a multiple of 8

Head and tail are monotonic byte counters (never wrapped; 2**64 bytes is centuries), on
separate cache lines so that the two sides do not bounce one line between cores. A record is
an 8-byte little-endian length followed by the payload, padded to 8 bytes; the header never
straddles the end of the data area, the payload may, and is then copied in two pieces. So any
record up to ``capacity - 8`` bytes fits; a larger one raises :class:`RecordTooLarge`. The reader
does not trust the writer: a header or tail that cannot be true raises :class:`CorruptRing`. A full
ring makes ``try_write`` return False (``write`` raises :class:`Full`): the writer backs off,
nothing is lost.

Messages of any size up to ``max_message``. A message larger than ``max_fragment`` (a quarter of
the ring, so that a writer never waits for an empty ring) goes as consecutive records
(``fragments``), flagged in the top bits of their headers: MORE on each but the last, END on the
last. No length comes near those bits, so the reader's check "the record ends at or before the
tail" fails on a flagged header and only then are the flags looked at: a message in one record
(the common path) costs nothing more. ``read`` returns whole messages: it gathers the fragments
as they come, across calls (the writer may be waiting for room), and raises
:class:`CorruptRing` once a message would exceed ``max_message``. The ring has one writer, so
one message's fragments are never interleaved with another's; a writer with several producers
(asyncio tasks) queues whole messages (server/engine_client.py).

Memory ordering. The producer copies the payload and only then stores the new tail; the
consumer loads the tail and only then reads the payload, and stores the head after copying
the record out. Each counter is one aligned 8-byte store/load (CPython's memoryview item
access compiles to one ``mov``), so it is never torn. On x86-64 this is enough: TSO keeps
stores in order with stores and loads in order with loads, and every CPython operation is an
opaque C call, so the compiler cannot reorder across it either. On a weakly ordered CPU
(ARM64/aarch64, POWER) the tail store needs *release* semantics (``stlr``) and the tail load
*acquire* semantics (``ldar``), likewise for the head; pure Python cannot issue those
barriers, so :class:`Ring` refuses to run there unless ``RINGSERVE_ALLOW_WEAK_ORDERING=1`` is
set, at your own risk (docs/ipc.md).
"""

from __future__ import annotations

import os
import platform

HEAD, TAIL = 0, 8  # indices into the uint64 view of the 128-byte header
HEADER_BYTES = 128
RECORD_HEADER = 8
MORE = 1 << 63  # record header flag: a fragment; its message goes on in the next record
END = 1 << 62   # record header flag: the last fragment of a message
_FLAGS = MORE | END
# The largest message either side sends or accepts, by default: a whole request (prompt ids,
# stop strings, a structured-output grammar) or one step's outputs for one worker
# (the largest: an echoed prompt's prompt logprobs, bounded by --max-response-logprobs).
DEFAULT_MAX_MESSAGE = 64 << 20
_STRONG_ORDER_MACHINES = {"x86_64", "amd64", "i386", "i686", "x86"}


class Full(Exception):
    """The ring has no room for this record now; retry after the consumer catches up."""


class RecordTooLarge(ValueError):
    """The record can never fit this ring."""


class MessageTooLarge(ValueError):
    """The message is larger than the ring's ``max_message``: it cannot be sent."""


class CorruptRing(ValueError):
    """The ring's counters or a record header say something impossible: its writer is broken
    (or hostile). Nothing more can be read from it; the reader should drop the ring."""


def check_memory_ordering() -> None:
    machine = platform.machine().lower()
    if machine in _STRONG_ORDER_MACHINES or os.environ.get("RINGSERVE_ALLOW_WEAK_ORDERING") == "1":
        return
    raise RuntimeError(
        f"the shared-memory ring relies on x86-64 store ordering (TSO); this CPU is {machine!r}, "
        "which needs acquire/release barriers that pure Python cannot issue (see docs/ipc.md). "
        "Set RINGSERVE_ALLOW_WEAK_ORDERING=1 to run anyway at your own risk."
    )


class Ring:
    """One side's handle on a ring living in ``buf[offset : offset + region_size(capacity)]``.

    Use one handle per process and role: the producer calls only ``try_write``/``write``, the
    consumer only ``read``. Each side caches its own counter, so it rereads only the other's.
    """

    def __init__(self, buf: memoryview, offset: int, capacity: int,
                 max_message: int = DEFAULT_MAX_MESSAGE):
        check_memory_ordering()
        if capacity % 8 or capacity < 64:
            raise ValueError(f"ring capacity must be a multiple of 8 and >= 64, got {capacity}")
        if offset % 64:
            raise ValueError("ring offset must be 64-byte aligned")
        self.capacity = capacity
        self.max_record = capacity - RECORD_HEADER
        self.max_fragment = capacity // 4 - RECORD_HEADER  # a record never waits for an empty ring
        self.max_message = max_message
        self._parts: list[bytes] = []  # reader: the fragments of a message not yet whole
        self._parts_bytes = 0
        self._counters = buf[offset : offset + HEADER_BYTES].cast("Q")
        self._data = buf[offset + HEADER_BYTES : offset + HEADER_BYTES + capacity]
        self._words = self._data.cast("Q")  # record headers: always at 8-byte aligned positions
        self._head = self._counters[HEAD]
        self._tail = self._counters[TAIL]
        # The other side's counter as last read: reread only when it would change the answer
        # (the producer's view of head can only be stale-low, the consumer's of tail stale-low,
        # so a stale value only ever makes a side wait, never overrun).
        self._head_seen = self._head
        self._tail_seen = self._tail

    @staticmethod
    def region_size(capacity: int) -> int:
        return HEADER_BYTES + capacity

    # -- producer --------------------------------------------------------------------
    def fragments(self, message) -> list[tuple[memoryview, int]]:
        """``message`` as (payload, flag) records of at most ``max_fragment`` bytes each, to be
        written in order with ``try_write(payload, flag)`` and nothing between them: one record
        (flag 0) when it fits, else fragments (MORE, ..., END). Raises MessageTooLarge over
        ``max_message``."""
        n = len(message)
        if n > self.max_message:
            raise MessageTooLarge(f"a message of {n} bytes is over the limit of {self.max_message} "
                                  "bytes for one message between a worker and an engine")
        view, size = memoryview(message).cast("B"), self.max_fragment
        if n <= size:
            return [(view, 0)]
        return [(view[i:i + size], MORE if i + size < n else END) for i in range(0, n, size)]

    def try_write(self, payload, flag: int = 0) -> bool:
        """Write one record (``flag``: MORE or END for a fragment of a larger message)."""
        if type(payload) is not bytes and not isinstance(payload, bytearray):
            payload = memoryview(payload).cast("B")
        n = len(payload)
        size = RECORD_HEADER + ((n + 7) & ~7)
        tail = self._tail
        cap = self.capacity
        if tail + size - self._head_seen > cap:
            if n > self.max_record:
                raise RecordTooLarge(f"record of {n} bytes exceeds this ring's limit of "
                                     f"{self.max_record} bytes")
            self._head_seen = self._counters[HEAD]
            if tail + size - self._head_seen > cap:
                return False
        data = self._data
        pos = tail % cap
        self._words[pos >> 3] = n | flag
        pos = (pos + RECORD_HEADER) % cap
        first = cap - pos
        if n <= first:
            data[pos : pos + n] = payload
        else:
            view = memoryview(payload)
            data[pos:cap] = view[:first]
            data[: n - first] = view[first:]
        self._tail = tail + size
        self._counters[TAIL] = tail + size  # publish: after the payload (see module docstring)
        return True

    def write(self, payload, flag: int = 0) -> None:
        if not self.try_write(payload, flag):
            raise Full(f"ring full ({self.used()} of {self.capacity} bytes in use)")

    # -- consumer --------------------------------------------------------------------
    def read(self) -> bytes | None:
        """The next whole message (a copy), or None when there is none yet (the ring is empty,
        or holds only the first fragments of a message)."""
        head = self._head
        if head == self._tail_seen:
            self._tail_seen = tail = self._counters[TAIL]
            if head == tail:
                return None
            if not head < tail <= head + self.capacity:
                raise CorruptRing(f"tail {tail} is not within one ring ({self.capacity} bytes) "
                                  f"after head {head}")
        cap, data = self.capacity, self._data
        pos = head % cap
        n = self._words[pos >> 3]
        # The writer publishes whole records, so a record ends at or before the tail; a header
        # or tail that says otherwise (2**40, or a tail behind the head) is corrupt. One
        # comparison: without it a bad header makes the reader copy garbage and loop for ever.
        # A fragment's header (its flag bits set) fails it too, and is told apart only then;
        # so does any record while a message's first fragments wait (a whole one there is corrupt).
        if n > self._tail_seen - head - RECORD_HEADER or self._parts:
            return self._read_fragments(n, head)
        pos = (pos + RECORD_HEADER) % cap  # NOTE: _take's copy, inlined on the common path
        first = cap - pos
        if n <= first:
            out = data[pos : pos + n].tobytes()
        else:
            out = data[pos:cap].tobytes() + data[: n - first].tobytes()
        self._head = head + RECORD_HEADER + ((n + 7) & ~7)
        self._counters[HEAD] = self._head  # release the space only after the copy
        return out

    def _take(self, head: int, n: int) -> bytes:
        """Copy out the record of n bytes at head and release its space."""
        cap, data = self.capacity, self._data
        pos = (head % cap + RECORD_HEADER) % cap
        first = cap - pos
        if n <= first:
            out = data[pos : pos + n].tobytes()
        else:
            out = data[pos:cap].tobytes() + data[: n - first].tobytes()
        self._head = head + RECORD_HEADER + ((n + 7) & ~7)
        self._counters[HEAD] = self._head  # release the space only after the copy
        return out

    def _read_fragments(self, header: int, head: int) -> bytes | None:
        """The rare path: fragments from head on, gathered until a message is whole (returned)
        or the ring is empty (None: the rest comes later). CorruptRing for a header that is no
        fragment either, or a message over max_message."""
        while True:
            n, flag = header & ~_FLAGS, header & _FLAGS
            if not flag or flag == _FLAGS or n > self._tail_seen - head - RECORD_HEADER:
                raise CorruptRing(f"record header of {header} bytes at {head}, but only "
                                  f"{self._tail_seen - head} bytes are published")
            self._parts_bytes += n
            if self._parts_bytes > self.max_message:
                raise CorruptRing(f"a message of more than {self.max_message} bytes (the limit) "
                                  "came in fragments")
            self._parts.append(self._take(head, n))
            if flag == END:
                whole = b"".join(self._parts)
                self._parts.clear()
                self._parts_bytes = 0
                return whole
            head = self._head
            if head == self._tail_seen:
                self._tail_seen = tail = self._counters[TAIL]
                if head == tail:
                    return None
                if not head < tail <= head + self.capacity:
                    raise CorruptRing(f"tail {tail} is not within one ring ({self.capacity} "
                                      f"bytes) after head {head}")
            header = self._words[(head % self.capacity) >> 3]

    def has_data(self) -> bool:
        return self._head != self._counters[TAIL]

    def used(self) -> int:
        return self._counters[TAIL] - self._counters[HEAD]

    def release(self) -> None:
        """Drop the views into the segment so that it can be unmapped."""
        self._words.release()
        self._counters.release()
        self._data.release()
