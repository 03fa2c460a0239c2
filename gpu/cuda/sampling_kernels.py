"""Sampling on the GPU in Numba CUDA (the semantics of gpu/sampling/sampler.py; references in
gpu/cuda/reference.py; the host side in gpu/cuda/sampler.py). One block per row, nothing
reduced across rows, so a row's token never depends on the rest of the batch.

- penalties_kernel: repetition / frequency / presence penalties and banned tokens, in place on a
  float32 copy of the logits, from per-row lists the host packed (ids seen, output-id counts,
  banned ids).
- sample_kernel: greedy (first argmax) or temperature + min_p + top_k + top_p, then inverse-CDF
  sampling with the row's one uniform number (drawn on the host from the request's own
  generator, exactly as the numpy sampler draws it). No sort: top_k and top_p are thresholds
  found by bisection over the order-preserving 32-bit keys of the float32 logits (32 passes
  each, exact: the threshold is an actual logit), min_p is a test per token. Tokens tied with
  the cutoff are all kept (numpy's argpartition/argsort keep an arbitrary subset of the ties).
  The CDF runs over the kept tokens in vocabulary order.
- bitmask_kernel: structured outputs, -inf at the tokens a row's grammar does not allow
  (first, on the copy the penalties work on).
- logprobs_kernel: log_softmax of the raw logits at the sampled token, its rank, and the top-N
  (by value, ties by lower id).

Simulator-friendly like numba_kernels.py: reductions through shared memory (gpu/cuda/block_reduce.py),
loops strided by blockDim (a power of two, at most SAMPLE_MAX_THREADS), float32 only.
"""
from __future__ import annotations

import math

import numpy as np
from numba import config, cuda, float32, int32, int64

from ringserve.gpu.cuda.block_reduce import block_argmax, block_sum
from ringserve.gpu.sampling.sampler import F32_MAX, GREEDY_EPS  # GREEDY_EPS: temperature below it is greedy

SAMPLE_MAX_THREADS = 1024


def _kernel(max_threads: int):
    """cuda.jit with launch bounds: the PTX says .maxntid max_threads, so ptxas (and the
    driver's JIT) keeps a thread's registers within 65536 / max_threads and a launch of that
    many threads cannot fail for registers ("too many resources requested"), whatever the
    compiler version. The simulator's jit takes no launch_bounds."""
    if config.ENABLE_CUDASIM:  # type: ignore[attr-defined]
        return cuda.jit
    return cuda.jit(launch_bounds=max_threads)  # type: ignore[call-arg]
_KEY_END = 1 << 32           # one past the largest key


@cuda.jit(device=True, inline=True)
def order_key(bits):  # pragma: no cover - device code
    """A float32's bits (uint32) -> an integer in the float's order (larger float, larger key)."""
    b = int64(bits)
    if b >= 0x80000000:
        return 0xFFFFFFFF - b
    return b + 0x80000000


@_kernel(SAMPLE_MAX_THREADS)
def bitmask_kernel(x, mask, rows):  # pragma: no cover - device code
    """Structured outputs: -inf, in place on x [B, V], at every token that row's llguidance
    bitmask (int32 [R, ceil(V/32)], bit t%32 of word t//32) does not allow. One block per
    constrained row (grid (R,)): mask row j belongs to x row rows[j]."""
    j = cuda.blockIdx.x
    row = rows[j]
    for t in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
        if (mask[j, t >> 5] >> (t & 31)) & 1 == 0:
            x[row, t] = -math.inf


@_kernel(SAMPLE_MAX_THREADS)
def penalties_kernel(x, seen_ids, seen_offsets, count_ids, counts, count_offsets, banned_ids,
                     banned_offsets, presence, frequency, repetition):  # pragma: no cover
    """In place on x [B, V] float32, row by row (grid (B,)), in gpu/sampling/sampler.py's order:
    repetition over the ids seen (prompt and output, each once), then frequency·count +
    presence over the output ids (each once, with its count), then banned ids -> -inf."""
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    rep = repetition[row]
    if rep != float32(1.0):
        for e in range(seen_offsets[row] + tid, seen_offsets[row + 1], nt):
            j = seen_ids[e]
            v = x[row, j]
            x[row, j] = min(v / rep, F32_MAX) if v > float32(0.0) else v * rep  # finite: sampler.py
    cuda.syncthreads()
    freq = frequency[row]
    pres = presence[row]
    if freq != float32(0.0) or pres != float32(0.0):
        for e in range(count_offsets[row] + tid, count_offsets[row + 1], nt):
            j = count_ids[e]
            x[row, j] -= freq * float32(counts[e]) + pres
    cuda.syncthreads()
    for e in range(banned_offsets[row] + tid, banned_offsets[row + 1], nt):
        x[row, banned_ids[e]] = float32(-math.inf)


@cuda.jit(device=True, inline=True)
def _prob(v, xmax, inv_t):  # pragma: no cover - device code
    """exp((v - max) / T): the unnormalized probability (0 for -inf)."""
    return math.exp((v - xmax) * inv_t)


@cuda.jit(device=True, inline=True)
def _weight(x, xbits, row, j, cut, xmax, inv_t, mp, q, qr, inv_z):  # pragma: no cover - device code
    """Token j's weight in the row's draw: its unnormalized probability if kept (key >= cut,
    min_p), else 0; with a draft's q (row qr >= 0), the residual max(p - q, 0) of the
    normalized p (inv_z: 1 / the kept mass)."""
    p = float32(0.0)
    if order_key(xbits[row, j]) >= cut:
        p = _prob(x[row, j], xmax, inv_t)
        if p < mp:
            p = float32(0.0)
    if qr < 0:
        return p
    return max(p * inv_z - q[qr, j], float32(0.0))


@_kernel(SAMPLE_MAX_THREADS)
def sample_kernel(x, xbits, temperature, top_k, top_p, min_p, uniforms, q, q_rows, drafts,  # noqa: C901
                  residual_uniforms, out):  # pragma: no cover
    """out[row] = the token sampled from x[row] (float32 [B, V]; xbits is the same memory as
    uint32). grid (B,). A row verifying a draft model's token drafts[row], drawn from q[q_rows[row]]
    (float32 [Q, V]; q_rows -1: none), is rejection-sampled as gpu/sampling/sampler.py
    accept_or_resample: kept when uniforms[row] * q(d) < p(d), else drawn from the residual
    normalize(max(p - q, 0)) (p where that is all 0) at residual_uniforms[row]."""
    fsh = cuda.shared.array(SAMPLE_MAX_THREADS, float32)
    ish = cuda.shared.array(SAMPLE_MAX_THREADS, int32)
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    V = x.shape[1]

    best_v = float32(-math.inf)
    best_i = int32(V)
    for j in range(tid, V, nt):
        v = x[row, j]
        if v > best_v:  # ascending j per thread: its first max wins ties
            best_v = v
            best_i = j
    xmax, argmax = block_argmax(best_v, best_i, fsh, ish)
    if argmax >= V:  # every logit is -inf (all banned): token 0, as numpy's argmax gives
        argmax = 0
    t = temperature[row]
    if t < float32(GREEDY_EPS):
        if tid == 0:
            out[row] = argmax
        return
    inv_t = float32(1.0) / t
    top_key = order_key(xbits[row, argmax]) + 1  # no token has this key or more

    # top_k: the largest key K with count(key >= K) >= k, i.e. the k-th largest logit.
    k = top_k[row]
    k_key = int64(0)
    if k > 0 and k < V:
        lo, hi = int64(0), top_key
        while hi - lo > 1:
            mid = (lo + hi) // 2
            c = int32(0)
            for j in range(tid, V, nt):
                if order_key(xbits[row, j]) >= mid:
                    c += 1
            if block_sum(c, ish) >= k:
                lo = mid
            else:
                hi = mid
        k_key = lo

    # min_p is a test per token; the mass left after top_k and min_p is what top_p divides.
    mp = min_p[row]
    cut = k_key
    p_top = top_p[row]
    if p_top < float32(1.0):
        z = float32(0.0)
        for j in range(tid, V, nt):
            if order_key(xbits[row, j]) >= k_key:
                p = _prob(x[row, j], xmax, inv_t)
                if p >= mp:
                    z += p
        target = p_top * block_sum(z, fsh)
        # The largest key K with mass(key >= K) >= top_p * mass: the p_m of the smallest
        # prefix of the sorted probabilities whose mass reaches top_p.
        lo, hi = k_key, top_key
        while hi - lo > 1:
            mid = (lo + hi) // 2
            m = float32(0.0)
            for j in range(tid, V, nt):
                if order_key(xbits[row, j]) >= mid:
                    p = _prob(x[row, j], xmax, inv_t)
                    if p >= mp:
                        m += p
            if block_sum(m, fsh) >= target:
                lo = mid
            else:
                hi = mid
        cut = lo

    # Speculative decoding with a draft model: keep the draft, or draw from the residual.
    qr = q_rows[row]
    u = uniforms[row]
    inv_z = float32(1.0)
    if qr >= 0:
        z = float32(0.0)
        for j in range(tid, V, nt):
            z += _weight(x, xbits, row, j, cut, xmax, inv_t, mp, q, -1, inv_z)
        inv_z = float32(1.0) / block_sum(z, fsh)
        d = drafts[row]
        # NOTE: every thread takes the same branch (block_sum gives every thread the same sum)
        if u * q[qr, d] < _weight(x, xbits, row, d, cut, xmax, inv_t, mp, q, -1, inv_z) * inv_z:
            if tid == 0:
                out[row] = d
            return
        r = float32(0.0)
        for j in range(tid, V, nt):
            r += _weight(x, xbits, row, j, cut, xmax, inv_t, mp, q, qr, inv_z)
        if block_sum(r, fsh) <= float32(0.0):  # p == q up to rounding: draw from p
            qr = -1
        u = residual_uniforms[row]

    # Inverse CDF over the kept tokens' weights in vocabulary order: each thread sums a
    # contiguous chunk, thread 0 scans the chunks and walks the one that holds u * total.
    chunk = (V + nt - 1) // nt
    start = tid * chunk
    stop = min(V, start + chunk)
    m = float32(0.0)
    for j in range(start, stop):
        m += _weight(x, xbits, row, j, cut, xmax, inv_t, mp, q, qr, inv_z)
    fsh[tid] = m
    cuda.syncthreads()
    if tid == 0:
        total = float32(0.0)
        for c in range(nt):
            total += fsh[c]
        target = u * total
        acc = float32(0.0)
        last = -1
        c = 0
        while c < nt:  # the first chunk whose end passes the target
            if fsh[c] > float32(0.0):
                last = c
                if acc + fsh[c] > target:
                    break
                acc += fsh[c]
            c += 1
        if c == nt:  # rounding ran past the end: the last kept token
            c = last
            acc -= fsh[c]
        picked = argmax
        for j in range(c * chunk, min(V, (c + 1) * chunk)):
            w = _weight(x, xbits, row, j, cut, xmax, inv_t, mp, q, qr, inv_z)
            if w > float32(0.0):
                picked = j
                acc += w
                if acc > target:
                    break
        out[row] = picked


@_kernel(SAMPLE_MAX_THREADS)
def logprobs_kernel(logits, token_ids, out_ids, out_vals, out_rank):  # noqa: C901  # pragma: no cover
    """Row r: out_ids[r, 0] = token_ids[r] with its log_softmax value and rank (1 + the number
    of larger logits), then the top N = out_ids.shape[1] - 1 tokens (value descending, ties by
    lower id). grid (B,)."""
    fsh = cuda.shared.array(SAMPLE_MAX_THREADS, float32)
    ish = cuda.shared.array(SAMPLE_MAX_THREADS, int32)
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    V = logits.shape[1]
    best_v = float32(-math.inf)
    best_i = int32(V)
    for j in range(tid, V, nt):
        v = float32(logits[row, j])
        if v > best_v:
            best_v = v
            best_i = j
    xmax, _ = block_argmax(best_v, best_i, fsh, ish)
    s = float32(0.0)
    for j in range(tid, V, nt):
        s += math.exp(float32(logits[row, j]) - xmax)
    lse = xmax + math.log(block_sum(s, fsh))
    chosen = token_ids[row]
    xc = float32(logits[row, chosen])
    above = int32(0)
    for j in range(tid, V, nt):
        if float32(logits[row, j]) > xc:
            above += 1
    above = block_sum(above, ish)
    if tid == 0:
        out_ids[row, 0] = chosen
        out_vals[row, 0] = xc - lse
        out_rank[row] = above + 1
    prev_v = float32(math.inf)
    prev_i = int32(-1)
    for n in range(1, out_ids.shape[1]):
        best_v = float32(-math.inf)
        best_i = int32(V)
        for j in range(tid, V, nt):
            v = float32(logits[row, j])
            if (v < prev_v or (v == prev_v and j > prev_i)) and (v > best_v or best_i == V):
                best_v = v
                best_i = j
        prev_v, prev_i = block_argmax(best_v, best_i, fsh, ish)
        if tid == 0:
            out_ids[row, n] = prev_i
            out_vals[row, n] = prev_v - lse


def _check_threads(threads: int) -> None:
    if threads & (threads - 1) or not 1 <= threads <= SAMPLE_MAX_THREADS:
        raise ValueError(f"sampling: threads {threads} must be a power of two <= {SAMPLE_MAX_THREADS}")


# Launchers: one place that knows each kernel's grid.

def bitmask(x, mask, rows, *, threads=256, stream=0):
    """mask int32 [R, words] for the rows `rows` (int32 [R]) of x float32 [B, V]."""
    if mask.shape[0]:
        bitmask_kernel[mask.shape[0], threads, stream](x, mask, rows)


def penalties(x, seen_ids, seen_offsets, count_ids, counts, count_offsets, banned_ids,
              banned_offsets, presence, frequency, repetition, *, threads=128, stream=0):
    if x.shape[0]:
        penalties_kernel[x.shape[0], threads, stream](
            x, seen_ids, seen_offsets, count_ids, counts, count_offsets, banned_ids,
            banned_offsets, presence, frequency, repetition)


def sample(x, temperature, top_k, top_p, min_p, uniforms, out, *, draft=None, threads=1024, stream=0):
    """x float32 [B, V], contiguous (its uint32 view is taken here). draft: speculative
    decoding with a draft model, (q float32 [Q, V], q_rows int32 [B], drafts int32 [B],
    residual_uniforms float32 [B]) (sample_kernel); None: no row verifies one (q_rows all -1:
    pass any [B] arrays and a [1, 1] q)."""
    _check_threads(threads)
    if x.shape[0]:
        q, q_rows, drafts, residual = draft if draft is not None else _no_draft(uniforms)
        sample_kernel[x.shape[0], threads, stream](x, x.view("uint32"), temperature, top_k, top_p,
                                                   min_p, uniforms, q, q_rows, drafts, residual, out)


def _no_draft(uniforms):
    """sample()'s draft arguments when no row verifies a draft: q_rows -1 (host arrays; the
    tests' calls: CudaSampler passes its own device arrays)."""
    B = len(uniforms)
    return np.zeros((1, 1), np.float32), np.full(B, -1, np.int32), np.zeros(B, np.int32), uniforms


def logprobs(logits, token_ids, out_ids, out_vals, out_rank, *, threads=1024, stream=0):
    _check_threads(threads)
    if logits.shape[0]:
        logprobs_kernel[logits.shape[0], threads, stream](logits, token_ids, out_ids, out_vals, out_rank)
