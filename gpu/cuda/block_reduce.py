"""Block-wide reductions for Numba CUDA kernels, through shared memory (no warp shuffles, so
Numba's CUDA simulator runs them; docs/design.md §8). blockDim must be a power of two and `sh` a
shared array of at least blockDim elements. Each ends with a barrier, so `sh` is free again and
every thread gets the result.
"""
from __future__ import annotations

from numba import cuda


@cuda.jit(device=True, inline=True)
def block_sum(v, sh):  # pragma: no cover - device code
    """The block's sum of v (a fixed tree: the same bits for the same blockDim), to every thread.
    v and sh share a dtype (float32 or int32): Numba compiles one version per type."""
    tid = cuda.threadIdx.x
    sh[tid] = v
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step > 0:
        if tid < step:
            sh[tid] += sh[tid + step]
        cuda.syncthreads()
        step //= 2
    total = sh[0]
    cuda.syncthreads()
    return total


@cuda.jit(device=True, inline=True)
def block_argmax(v, i, fsh, ish):  # pragma: no cover - device code
    """(max, first index of the max) over the block's (v, i) pairs, to every thread."""
    tid = cuda.threadIdx.x
    fsh[tid] = v
    ish[tid] = i
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step > 0:
        if tid < step:
            ov, oi = fsh[tid + step], ish[tid + step]
            if ov > fsh[tid] or (ov == fsh[tid] and oi < ish[tid]):
                fsh[tid] = ov
                ish[tid] = oi
        cuda.syncthreads()
        step //= 2
    best_v, best_i = fsh[0], ish[0]
    cuda.syncthreads()
    return best_v, best_i
