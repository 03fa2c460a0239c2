"""An engine's published load and liveness, and the least-loaded choice among engines.

The engine owns one small segment and rewrites it every step; clients only read it. Each
word has a single writer (the engine) and is one aligned 8-byte store, so readers never see a
torn value; a reader may see counts from two adjacent steps, which is fine for routing.
"""

from __future__ import annotations

import time
from typing import Sequence

# uint64 word indices. The first nine are the engine's state now; the rest are cumulative since
# the engine started, added once per step (/metrics counters).
(PID, HEARTBEAT_NS, STEPS, WAITING, RUNNING, NUM_BLOCKS, NUM_FREE_BLOCKS, BLOCK_SIZE, MAX_SLOTS,
 NUM_PREEMPTIONS, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, PROMPT_TOKENS_COMPUTED,
 GENERATION_TOKENS) = range(14)
HEADER_WORDS = 16  # then one word per slot: AddRequest records the engine has taken from that slot


def stats_size(max_slots: int) -> int:
    return 8 * (HEADER_WORDS + max_slots)


def score(waiting: int, running: int, pending: int = 0) -> int:
    """A waiting request weighs four running ones (DESIGN.md §4). ``pending``: the caller's own
    submissions the engine has not counted yet; they will be waiting, so they weigh as waiting."""
    return 4 * (waiting + pending) + running


def least_loaded(scores: Sequence[int | None]) -> int | None:
    """Index of the lowest score (the first on a tie); None entries are unavailable engines."""
    best = None
    for i, s in enumerate(scores):
        if s is not None and (best is None or s < scores[best]):
            best = i
    return best


class EngineStats:
    """A view of an engine's stats segment (``buf`` of at least ``stats_size(max_slots)`` bytes)."""

    def __init__(self, buf: memoryview):
        self._words = buf[: len(buf) - len(buf) % 8].cast("Q")

    # -- engine side -----------------------------------------------------------------
    def init(self, pid: int, max_slots: int, num_blocks: int = 0, block_size: int = 0) -> None:
        w = self._words
        for i in range(HEADER_WORDS + max_slots):
            w[i] = 0
        w[PID], w[MAX_SLOTS], w[NUM_BLOCKS], w[BLOCK_SIZE] = pid, max_slots, num_blocks, block_size
        self.beat()

    def publish(self, waiting: int, running: int, free_blocks: int) -> None:
        w = self._words
        w[WAITING], w[RUNNING], w[NUM_FREE_BLOCKS] = waiting, running, free_blocks
        w[HEARTBEAT_NS] = time.monotonic_ns()

    def count_step(self, *, preemptions: int, prefix_cache_queries: int, prefix_cache_hits: int,
                   prompt_tokens_computed: int, generation_tokens: int) -> None:
        """One engine step ran: add what it did. prefix_cache_*: prompt tokens looked up in the
        prefix cache and found; prompt_tokens_computed: prompt (or recomputed) tokens run through
        the model; generation_tokens: tokens sampled."""
        w = self._words
        w[STEPS] += 1
        w[NUM_PREEMPTIONS] += preemptions
        w[PREFIX_CACHE_QUERIES] += prefix_cache_queries
        w[PREFIX_CACHE_HITS] += prefix_cache_hits
        w[PROMPT_TOKENS_COMPUTED] += prompt_tokens_computed
        w[GENERATION_TOKENS] += generation_tokens

    def beat(self) -> None:
        self._words[HEARTBEAT_NS] = time.monotonic_ns()

    def set_taken(self, slot: int, count: int) -> None:
        self._words[HEADER_WORDS + slot] = count

    # -- client side -----------------------------------------------------------------
    def __getitem__(self, word: int) -> int:
        return self._words[word]

    @property
    def waiting(self) -> int:
        return self._words[WAITING]

    @property
    def running(self) -> int:
        return self._words[RUNNING]

    def taken(self, slot: int) -> int:
        return self._words[HEADER_WORDS + slot]

    def heartbeat_age(self) -> float:
        """Seconds since the engine last beat (CLOCK_MONOTONIC is system-wide on Linux)."""
        return (time.monotonic_ns() - self._words[HEARTBEAT_NS]) / 1e9

    def release(self) -> None:
        self._words.release()
