"""Sampling on the GPU: gpu/sampling/sampler.py's semantics over device-resident logits, so that a step
copies B token ids to the host instead of B x V logits (the kernels: sampling_kernels.py).

The host does what needs the requests' state and is cheap: it draws each sampled row's one
uniform number from the row's own generator (the numpy sampler's exact draws, in the same row
order, so a seeded request gets the same random stream on either backend) and packs the
penalty inputs as flat per-row lists (ids seen once, output ids with their counts, banned ids).

Written against Numba's CUDA API, so the same code runs in the CUDA simulator in CI and on a
device, where the logits come from CuPy (numba.cuda.as_cuda_array) and the stream is the
runner's (numba.cuda.external_stream). Device and pinned buffers persist and only grow: no
allocation (no cudaFree and its implicit device sync) per step.

    sampler = CudaSampler(stream=nb_stream)
    pending = sampler.sample_async(logits_dev, metadata)   # enqueued: kernels, then D2H + event
    ...                                                    # the host is free meanwhile
    out = pending.result()                                 # SamplerOutput, as gpu/sampling/sampler.sample
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from numba import cuda

from ringserve.gpu.cuda import sampling_kernels as sk
from ringserve.gpu.sampling.sampler import GREEDY_EPS, Logprobs, SamplerOutput, SamplingMetadata


@dataclass
class PackedPenalties:
    """Per-row lists, flattened with offsets [B + 1] (row r: ids[offsets[r]:offsets[r + 1]])."""
    seen_ids: np.ndarray       # int32: prompt and output ids, each once (repetition penalty)
    seen_offsets: np.ndarray
    count_ids: np.ndarray      # int32: output ids, each once ...
    counts: np.ndarray         # int32: ... with its count (frequency, presence)
    count_offsets: np.ndarray
    banned_ids: np.ndarray     # int32: tokens that may not be sampled (min_tokens)
    banned_offsets: np.ndarray
    presence: np.ndarray       # float32 [B]
    frequency: np.ndarray
    repetition: np.ndarray


def _flatten(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(rows) + 1, np.int32)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    flat = np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, np.int32)
    return flat, offsets


def pack_penalties(meta: SamplingMetadata, num_rows: int) -> PackedPenalties | None:
    """What the penalties kernel needs, or None when no row has a penalty or a ban."""
    pen = meta.penalties()
    if pen is None and meta.banned_token_ids is None:
        return None
    empty = np.zeros(0, np.int64)
    seen: list[np.ndarray] = []
    count_ids: list[np.ndarray] = []
    counts: list[np.ndarray] = []
    if pen is not None:
        pres = np.asarray(pen.presence, np.float32)
        freq = np.asarray(pen.frequency, np.float32)
        rep = np.asarray(pen.repetition, np.float32)
        for i in range(num_rows):
            out = np.asarray(pen.output_token_ids[i], np.int64)
            if rep[i] != 1.0:
                seen.append(np.unique(np.concatenate(
                    [np.asarray(pen.prompt_token_ids[i], np.int64), out])))
            else:
                seen.append(empty)
            if freq[i] != 0.0 or pres[i] != 0.0:
                ids, n = np.unique(out, return_counts=True)
                count_ids.append(ids)
                counts.append(n)
            else:
                count_ids.append(empty)
                counts.append(empty)
    else:
        pres = freq = np.zeros(num_rows, np.float32)
        rep = np.ones(num_rows, np.float32)
        seen = count_ids = counts = [empty] * num_rows
    banned = [np.unique(np.asarray(b, np.int64)) if len(b) else empty
              for b in (meta.banned_token_ids or [()] * num_rows)]
    seen_ids, seen_off = _flatten(seen)
    count_flat, count_off = _flatten(count_ids)
    counts_flat, _ = _flatten(counts)
    banned_ids, banned_off = _flatten(banned)
    return PackedPenalties(seen_ids, seen_off, count_flat, counts_flat, count_off, banned_ids,
                           banned_off, pres, freq, rep)


def draw_uniforms(meta: SamplingMetadata) -> np.ndarray:
    """float32 [2, B]: per sampled (non-greedy) row, in row order, the generator.random()
    draws gpu/sampling/sampler.sample makes: one, or two for a row that verifies a draft
    model's token (accept_or_resample: [1] is the residual draw's); 0 where unused."""
    u = np.zeros((2, len(meta.temperature)), np.float32)
    qs = meta.draft_probs
    for i in np.flatnonzero(np.asarray(meta.temperature) >= GREEDY_EPS).tolist():
        gen = cast(np.random.Generator, meta.generators[i])  # not greedy: it has one
        u[0, i] = gen.random()
        if qs is not None and qs[i] is not None:
            u[1, i] = gen.random()
    return u


def pack_draft_probs(meta: SamplingMetadata, num_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A draft model's q rows for the device (float32 [Q, V]: the rows that verify one, a
    greedy row's none), each row's index into them (int32 [B], -1: none) and its draft token."""
    qs, drafts = meta.draft_probs, meta.draft_token_ids
    assert qs is not None and drafts is not None
    rows = [i for i in range(num_rows) if qs[i] is not None and meta.temperature[i] >= GREEDY_EPS]
    index = np.full(num_rows, -1, np.int32)
    index[rows] = np.arange(len(rows), dtype=np.int32)
    q = np.zeros((len(rows), len(cast(np.ndarray, qs[rows[0]])) if rows else 0), np.float32)
    for j, i in enumerate(rows):
        q[j] = qs[i]
    return q, index, np.asarray(drafts, np.int32)


class _Arena:
    """Named device (or pinned host) arrays that persist between calls and only grow."""

    def __init__(self, pinned: bool = False):
        self.pinned = pinned
        self.arrays: dict[str, Any] = {}  # Numba device (or pinned host) arrays

    def get(self, name: str, shape: tuple[int, ...], dtype) -> Any:
        have = self.arrays.get(name)
        if have is None or have.shape[0] < shape[0] or have.shape[1:] != shape[1:] or have.dtype != dtype:
            rows = 1 << max(0, int(shape[0]) - 1).bit_length()  # powers of two: few regrowths
            alloc = cuda.pinned_array if self.pinned else cuda.device_array
            have = self.arrays[name] = alloc((rows,) + tuple(shape[1:]), dtype=dtype)
        return have[:shape[0]]


class PendingSample:
    """A sample enqueued on the stream; result() waits for its copy to the host."""

    def __init__(self, event, token_ids, logprobs):
        self._event = event
        self._token_ids = token_ids          # pinned host views, valid once the event is done
        self._logprobs = logprobs            # (ids, vals, rank) pinned views, or None
        self._result: SamplerOutput | None = None

    @property
    def done(self) -> bool:
        return self._result is not None

    def result(self) -> SamplerOutput:
        if self._result is None:
            self._event.synchronize()
            lps = None
            if self._logprobs is not None:
                ids, vals, rank = self._logprobs
                lps = Logprobs(ids.copy(), vals.copy(), rank.copy())
            self._result = SamplerOutput(self._token_ids.copy(), lps)  # the pinned buffers are reused
        return self._result


def warmup_metadata(vocab_size: int = 32) -> list[SamplingMetadata]:
    """One-row metadata that together launch every sampling kernel (penalties with a ban,
    sampling with temperature, top-k, top-p and min-p, a draft model's token verified, greedy,
    logprobs): the runner samples with each at start-up so that no Numba kernel compiles on a
    request."""
    one = np.ones(1, np.float32)
    greedy = SamplingMetadata(0 * one, np.zeros(1, np.int32), one, 0 * one, [None],
                              max_num_logprobs=2)
    sampled = SamplingMetadata(0.8 * one, np.full(1, 5, np.int32), 0.9 * one, 0.05 * one,
                               [np.random.default_rng(0)], presence_penalty=0.1 * one,
                               frequency_penalty=0.1 * one, repetition_penalty=1.1 * one,
                               prompt_token_ids=[[0]], output_token_ids=[[0]],
                               banned_token_ids=[[1]], max_num_logprobs=2,
                               # allows tokens 0 and 1 (and 1 is banned)
                               allowed_token_bitmask=np.pad(np.full((1, 1), 3, np.int32),
                                                            ((0, 0), (0, (vocab_size - 1) // 32))),
                               draft_token_ids=[0], draft_probs=[np.full(vocab_size, 1.0 / vocab_size)])
    return [greedy, sampled]


class CudaSampler:
    def __init__(self, *, threads: int = 1024, stream=0):
        """threads: per row (a power of two <= 1024; 32 or fewer in the simulator)."""
        sk._check_threads(threads)
        self.threads = threads
        self.stream = stream
        self._dev = _Arena()
        self._host = _Arena(pinned=True)
        self._pending: PendingSample | None = None

    def _to_device(self, name: str, host: np.ndarray):
        """host copied to the device through a pinned buffer of the same name (from pageable
        memory the copy would wait for the stream: the step's forward). The pinned buffers are
        rewritten only after the previous sample's result(): its copies are done by then."""
        dev = self._dev.get(name, host.shape, host.dtype)
        if host.size:
            staged = self._host.get("in_" + name, host.shape, host.dtype)
            staged[...] = host
            dev.copy_to_device(staged, stream=self.stream)
        return dev

    def sample(self, logits, meta: SamplingMetadata) -> SamplerOutput:
        return self.sample_async(logits, meta).result()

    def sample_async(self, logits, meta: SamplingMetadata) -> PendingSample:
        """logits: float32 [B, V], contiguous, on the device as a Numba device array (a CuPy
        array through numba.cuda.as_cuda_array(x, sync=False)), left unchanged. One pending sample
        at a time: the previous one's result() must have been taken (its pinned buffers are reused)."""
        if self._pending is not None and not self._pending.done:
            raise RuntimeError("CudaSampler: take the previous sample's result() first")
        B, V = logits.shape
        kw = dict(threads=self.threads, stream=self.stream)
        packed = pack_penalties(meta, B)
        mask = meta.token_bitmask()  # NOTE: host work while the device runs the forward
        x = logits
        if packed is not None or mask is not None:  # on a copy: logprobs are the raw model's
            x = self._dev.get("work", (B, V), np.float32)
            x.copy_to_device(logits, stream=self.stream)
        if mask is not None:  # structured outputs: only the constrained rows travel
            rows = np.flatnonzero((mask != -1).any(axis=1)).astype(np.int32)
            sk.bitmask(x, self._to_device("mask", np.ascontiguousarray(mask[rows])),
                       self._to_device("mask_rows", rows), threads=min(self.threads, 256),
                       stream=self.stream)
        if packed is not None:
            p = packed
            sk.penalties(x, *(self._to_device(n, getattr(p, n)) for n in (
                "seen_ids", "seen_offsets", "count_ids", "counts", "count_offsets", "banned_ids",
                "banned_offsets", "presence", "frequency", "repetition")),
                threads=min(self.threads, 256), stream=self.stream)
        token_ids = self._dev.get("token_ids", (B,), np.int32)
        # The eight per-row parameters travel as one float32 block (one copy, not eight): rows
        # of B values, flat so that the arena grows with B; top_k's, q_rows' and drafts' rows
        # hold int32 bits.
        host = np.empty((8, B), np.float32)
        host[0], host[2], host[3] = meta.temperature, meta.top_p, meta.min_p
        host[4:6] = draw_uniforms(meta)
        host[1].view(np.int32)[:] = meta.top_k
        q = None
        if meta.draft_probs is not None:  # a draft model's q rows: only the rows that verify one travel
            q, host[6].view(np.int32)[:], host[7].view(np.int32)[:] = pack_draft_probs(meta, B)
        else:
            host[6].view(np.int32)[:] = -1
            host[7].view(np.int32)[:] = 0
        flat = self._to_device("sampling_rows", host.reshape(-1))
        temperature, top_k, top_p, min_p, uniforms, residual, q_rows, drafts = (
            flat[i * B:(i + 1) * B] for i in range(8))
        # NOTE: no q rows: an empty view of the arena's buffer (never read: q_rows all -1)
        q_dev = self._dev.get("draft_probs", (0, V), np.float32) if q is None or not len(q) else \
            self._to_device("draft_probs", q)
        sk.sample(x, temperature, top_k.view(np.int32), top_p, min_p, uniforms, token_ids,
                  draft=(q_dev, q_rows.view(np.int32), drafts.view(np.int32), residual), **kw)
        host_ids = self._host.get("token_ids", (B,), np.int32)
        token_ids.copy_to_host(host_ids, stream=self.stream)
        host_lps = None
        if meta.max_num_logprobs is not None:
            n = 1 + min(meta.max_num_logprobs, V)
            ids = self._dev.get("lp_ids", (B, n), np.int32)
            vals = self._dev.get("lp_vals", (B, n), np.float32)
            rank = self._dev.get("lp_rank", (B,), np.int32)
            sk.logprobs(logits, token_ids, ids, vals, rank, **kw)
            host_lps = (self._host.get("lp_ids", (B, n), np.int32),
                        self._host.get("lp_vals", (B, n), np.float32),
                        self._host.get("lp_rank", (B,), np.int32))
            for dev, host in zip((ids, vals, rank), host_lps, strict=True):
                dev.copy_to_host(host, stream=self.stream)
        event = cuda.event()
        event.record(self.stream)
        self._pending = PendingSample(event, host_ids, host_lps)
        return self._pending
