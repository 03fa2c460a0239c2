"""An engine's published load and liveness, and the least-loaded choice among engines.

The engine owns one small segment and rewrites it every step; clients only read it. Each
word has a single writer (the engine) and is one aligned 8-byte store, so readers never see a
torn value; a reader may see counts from two adjacent steps, which is fine for routing.

Liveness is two words. HEARTBEAT_NS is written by a thread of its own (:class:`Heartbeat`), so it
goes on during a long step (the CPU kernels are Numba nogil and BLAS releases the GIL): a stale
heartbeat means the process is stopped or frozen, never that a step is long. STEP_STARTED_NS is
when the step now running began (0: idle), so a step that never ends can be told from a long
one. The launcher alone judges both against --engine-hang-timeout (:func:`hang_reason`).
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

# uint64 word indices. The first nine are the engine's state now; the rest are cumulative since
# the engine started, added once per step (/metrics counters); then the step start; then what
# the engine's memory holds, written once at start: the KV pool's bytes and the weights' bytes
# by type (one word per WEIGHT_TYPES entry; a type the engine does not know goes to "other").
(PID, HEARTBEAT_NS, STEPS, WAITING, RUNNING, NUM_BLOCKS, NUM_FREE_BLOCKS, BLOCK_SIZE, MAX_SLOTS,
 NUM_PREEMPTIONS, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, PROMPT_TOKENS_COMPUTED,
 GENERATION_TOKENS, STEP_STARTED_NS, KV_CACHE_BYTES) = range(16)
MAX_MODEL_LEN = 30  # written once at start: the engine's max_model_len (the KV pool may clamp it)
WEIGHT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                "Q4_K", "Q5_K", "Q6_K", "other")
WEIGHT_BYTES = 16  # WEIGHT_BYTES + i: the bytes of the weights of type WEIGHT_TYPES[i]
# Speculative decoding (vLLM's spec_decode counters, cumulative, written whole by the engine):
# K (0: off, no metrics), drafts, draft tokens, accepted tokens, steps that did not speculate
# for their batch size, then accepted tokens at each draft position (SPEC_PER_POS + i, i < K).
SPEC_K, SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED, SPEC_OFF_STEPS = range(31, 36)
SPEC_PER_POS = 36
SPEC_MAX_POS = 32   # engine/speculative.py MAX_SPECULATIVE_TOKENS
# A draft model's memory (speculative decoding), written once at start: its weights' bytes (all
# types together) and its KV pool's (0, 0: no draft model).
DRAFT_WEIGHT_BYTES, DRAFT_KV_CACHE_BYTES = SPEC_PER_POS + SPEC_MAX_POS, SPEC_PER_POS + SPEC_MAX_POS + 1
BEAT_INTERVAL_S = 0.5  # the heartbeat thread's period
HEADER_WORDS = DRAFT_KV_CACHE_BYTES + 1  # then one word per slot: AddRequest records the
                                            # engine has taken from that slot
assert WEIGHT_BYTES + len(WEIGHT_TYPES) <= MAX_MODEL_LEN < SPEC_K  # the header's words do not overlap


def stats_size(max_slots: int) -> int:
    return 8 * (HEADER_WORDS + max_slots)


def score(waiting: int, running: int, pending: int = 0) -> int:
    """A waiting request weighs four running ones (docs/design.md §4). ``pending``: the caller's own
    submissions the engine has not counted yet; they will be waiting, so they weigh as waiting."""
    return 4 * (waiting + pending) + running


def least_loaded(scores: Sequence[int | None]) -> int | None:
    """Index of the lowest score (the first on a tie); None entries are unavailable engines."""
    best, best_score = None, 0
    for i, s in enumerate(scores):
        if s is not None and (best is None or s < best_score):
            best, best_score = i, s
    return best


class EngineStats:
    """A view of an engine's stats segment (``buf`` of at least ``stats_size(max_slots)`` bytes)."""

    def __init__(self, buf: memoryview):
        self._words = buf[: len(buf) - len(buf) % 8].cast("Q")

    # -- engine side -----------------------------------------------------------------
    def init(self, pid: int, max_slots: int, num_blocks: int = 0, block_size: int = 0,
             kv_cache_bytes: int = 0, weight_bytes: dict[str, int] | None = None,
             max_model_len: int = 0, draft_weight_bytes: int = 0, draft_kv_cache_bytes: int = 0) -> None:
        w = self._words
        for i in range(HEADER_WORDS + max_slots):
            w[i] = 0
        w[PID], w[MAX_SLOTS], w[NUM_BLOCKS], w[BLOCK_SIZE] = pid, max_slots, num_blocks, block_size
        w[KV_CACHE_BYTES], w[MAX_MODEL_LEN] = kv_cache_bytes, max_model_len
        w[DRAFT_WEIGHT_BYTES], w[DRAFT_KV_CACHE_BYTES] = draft_weight_bytes, draft_kv_cache_bytes
        for kind, nbytes in (weight_bytes or {}).items():
            i = WEIGHT_TYPES.index(kind) if kind in WEIGHT_TYPES else len(WEIGHT_TYPES) - 1
            w[WEIGHT_BYTES + i] += nbytes
        self.beat()

    def publish(self, waiting: int, running: int, free_blocks: int) -> None:
        w = self._words
        w[WAITING], w[RUNNING], w[NUM_FREE_BLOCKS] = waiting, running, free_blocks

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

    def set_spec_decode(self, k: int, drafts: int, draft_tokens: int, accepted: int,
                        off_steps: int, accepted_per_pos: Sequence[int]) -> None:
        """The speculative-decoding counters, cumulative (the engine's own sums)."""
        w = self._words
        w[SPEC_K], w[SPEC_DRAFTS], w[SPEC_DRAFT_TOKENS] = k, drafts, draft_tokens
        w[SPEC_ACCEPTED], w[SPEC_OFF_STEPS] = accepted, off_steps
        for i, n in enumerate(accepted_per_pos[:SPEC_MAX_POS]):
            w[SPEC_PER_POS + i] = n

    def spec_decode(self) -> tuple[int, int, int, int, list[int]] | None:
        """(drafts, draft tokens, accepted tokens, steps off by batch size, accepted per
        position); None when the engine does not speculate."""
        w = self._words
        k = min(w[SPEC_K], SPEC_MAX_POS)
        if not k:
            return None
        return (w[SPEC_DRAFTS], w[SPEC_DRAFT_TOKENS], w[SPEC_ACCEPTED], w[SPEC_OFF_STEPS],
                [w[SPEC_PER_POS + i] for i in range(k)])

    def beat(self) -> None:
        self._words[HEARTBEAT_NS] = time.monotonic_ns()

    def step_began(self) -> None:
        self._words[STEP_STARTED_NS] = time.monotonic_ns()

    def went_idle(self) -> None:
        self._words[STEP_STARTED_NS] = 0

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

    def weight_bytes(self) -> dict[str, int]:
        """The engine's weights' bytes by type (types it holds none of left out)."""
        words = self._words
        return {kind: words[WEIGHT_BYTES + i] for i, kind in enumerate(WEIGHT_TYPES)
                if words[WEIGHT_BYTES + i]}

    def taken(self, slot: int) -> int:
        return self._words[HEADER_WORDS + slot]

    def heartbeat_age(self) -> float:
        """Seconds since the engine last beat (CLOCK_MONOTONIC is system-wide on Linux)."""
        return (time.monotonic_ns() - self._words[HEARTBEAT_NS]) / 1e9

    def step_age(self) -> float:
        """Seconds the step now running has run (0.0 when the engine is idle)."""
        started = self._words[STEP_STARTED_NS]
        return 0.0 if started == 0 else (time.monotonic_ns() - started) / 1e9

    def release(self) -> None:
        self._words.release()


class Heartbeat:
    """The engine's heartbeat thread: beats every BEAT_INTERVAL_S whatever the main thread does.

    It needs the GIL for a moment per beat; the main thread gives it up within the switch
    interval (5 ms) when running Python and at once inside nogil kernels and BLAS."""

    def __init__(self, stats: EngineStats, interval: float = BEAT_INTERVAL_S):
        self._stats = stats
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ringserve-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._stats.beat()


def hang_reason(stats: EngineStats, limit_s: float) -> str | None:
    """Why the engine behind ``stats`` counts as hung after ``limit_s`` seconds, or None.

    A stale heartbeat: the whole process has stopped (SIGSTOP, a debugger, a frozen host
    thread holding the GIL). A step running past the limit: an endless kernel or loop."""
    age = stats.heartbeat_age()
    if age > limit_s:
        return f"no heartbeat for {age:.0f} s"
    step = stats.step_age()
    if step > limit_s:
        return f"one step running for {step:.0f} s"
    return None


class ThroughputLog:
    """vLLM's periodic line for one engine, computed from its counters over an interval: prompt
    and generation tokens per second, requests running and waiting, KV-cache usage and the
    prefix cache's hit rate over the interval. The launcher calls `line` every
    RINGSERVE_LOG_STATS_INTERVAL seconds and logs what it returns (server/launch.py)."""

    def __init__(self, index: int, stats: EngineStats, kv_label: str = "KV cache"):
        self._index, self.stats, self._kv_label = index, stats, kv_label
        self._at, self._counts = time.monotonic(), self._read()

    def _read(self) -> tuple[int, int, int, int]:
        s = self.stats
        return (s[PROMPT_TOKENS_COMPUTED], s[GENERATION_TOKENS], s[PREFIX_CACHE_QUERIES],
                s[PREFIX_CACHE_HITS])

    def line(self) -> str | None:
        """The interval since the last call as one line; None when the engine was idle all of
        it and holds no request (silent when idle, as vLLM)."""
        now, counts = time.monotonic(), self._read()
        (prompt, generated, queries, hits) = (a - b for a, b in zip(counts, self._counts, strict=True))
        seconds = max(now - self._at, 1e-9)
        self._at, self._counts = now, counts
        s = self.stats
        if not (prompt or generated or s.running or s.waiting):
            return None
        blocks = s[NUM_BLOCKS]
        usage = 100.0 * (1 - s[NUM_FREE_BLOCKS] / blocks) if blocks else 0.0
        return (f"engine {self._index}: Avg prompt throughput: {prompt / seconds:.1f} tokens/s, "
                f"Avg generation throughput: {generated / seconds:.1f} tokens/s, "
                f"Running: {s.running} reqs, Waiting: {s.waiting} reqs, "
                f"{self._kv_label} usage: {usage:.1f}%, "
                f"Prefix cache hit rate: {100.0 * hits / queries if queries else 0.0:.1f}%")
