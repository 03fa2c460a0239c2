"""Memory for what a CPU decode step streams (packed weights, the KV cache) on 2 MiB transparent
huge pages where Linux offers them (``madvise`` mode, the common default).

numpy's arrays come from malloc on 4 KiB pages. A decode step reads every weight once: on 4 KiB
pages it takes a TLB miss every 4 KiB and the hardware prefetchers stop at each page boundary, so
the many small matrices of a small model stream at 14-20 GB/s where one large one streams at 30
(docs/bench_forward.md has the figures). Anonymous mappings advised ``MADV_HUGEPAGE`` *before*
they are touched are faulted in as huge pages instead. The arrays keep their dtypes and shapes:
only where their bytes live changes. Where the advice does not exist (not Linux) or is refused,
the mappings are plain anonymous memory, which is what malloc would have given.
"""
from __future__ import annotations

import ctypes
import dataclasses
import mmap
from typing import Any

import numpy as np

HUGE_PAGE = 2 << 20
CHUNK = 16 * HUGE_PAGE   # a bump chunk: small tensors share one; a tensor above it gets its own
ALIGN = 64               # a cache line: what the kernels' vector loads like


def _mapping(size: int) -> mmap.mmap:
    """An anonymous mapping of size bytes (a whole number of huge pages), advised huge."""
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            m.madvise(advice)
        except OSError:  # NOTE: THP "never", or a kernel without it: plain pages, as malloc's
            pass
    return m


class HugePageArena:
    """Bump allocation of arrays in huge-page mappings, kept alive as long as the arena is. The
    last chunk's tail is the only waste (< CHUNK)."""

    def __init__(self) -> None:
        self._maps: list[mmap.mmap] = []
        self._free: np.ndarray | None = None   # the current chunk's unused bytes

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dt.itemsize
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        if size > CHUNK // 4:  # NOTE: a large tensor gets a mapping of its own, not a chunk's tail
            m = _mapping(-(-size // HUGE_PAGE) * HUGE_PAGE)
            self._maps.append(m)
            return np.frombuffer(m, np.uint8, nbytes).view(dt).reshape(shape)
        if self._free is None or self._free.size < size:
            m = _mapping(CHUNK)
            self._maps.append(m)
            self._free = np.frombuffer(m, np.uint8)
        block, self._free = self._free[:size], self._free[size:]
        return block[:nbytes].view(dt).reshape(shape)

    def zeros(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return self.empty(shape, dtype)  # NOTE: fresh anonymous memory reads as zeros

    def copy(self, a: np.ndarray) -> np.ndarray:
        out = self.empty(a.shape, a.dtype)
        out[...] = a
        return out

    def place(self, value: Any) -> Any:
        """value with every numpy array in it (an array, or a frozen dataclass of arrays and
        of such dataclasses, as gpu/cpu/packed.py's weights are) copied into the arena; what
        holds no array is returned as it is."""
        if isinstance(value, np.ndarray):
            return self.copy(value)
        if isinstance(value, tuple):
            placed = tuple(self.place(v) for v in value)
            return value if all(a is b for a, b in zip(placed, value, strict=True)) else placed
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes = {}
            for f in dataclasses.fields(value):
                old = getattr(value, f.name)
                if (new := self.place(old)) is not old:
                    changes[f.name] = new
            return dataclasses.replace(value, **changes) if changes else value
        return value


M_MMAP_THRESHOLD = -3           # glibc's mallopt parameter (malloc.h)
STEP_MMAP_THRESHOLD = 4 << 20   # a block at least this large gets a mapping of its own


def map_large_blocks() -> bool:
    """glibc's malloc, for this process from now on: every block of at least
    STEP_MMAP_THRESHOLD bytes a mapping of its own, unmapped when freed. glibc's own threshold
    starts at 128 KiB and rises to the largest block freed so far (up to 32 MiB), so after one
    long prefill the activations of every later step (a 512-token step's are 4-8 MB each) come
    from the heap, and what they leave free there stays resident, scattered between live blocks:
    a 1B serving engine held ~60 MB of such heap after mixed step sizes (docs/bench_quant.md).
    Decode steps' activations are smaller and stay on the heap, where mapping them per step
    would cost page faults. False where the C library has no mallopt (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, STEP_MMAP_THRESHOLD) == 1


MADV_PAGEOUT = 21   # Linux 5.4+ (asm-generic/mman-common.h); older kernels answer EINVAL


def page_out_library(filename: str) -> int:
    """Ask the kernel to reclaim the resident pages of this process's read-only mappings of the
    shared library named `filename` (its code and constants: clean pages of the file, nothing
    to write back), now. For libllvmlite once a runner's kernels are loaded: loading Numba's
    cache runs LLVM's static constructors, which are spread over its whole text, and ~68 MB of
    it stays resident for the engine's life although nothing calls LLVM again unless a kernel
    must be compiled, which faults what it needs back in. Pages that another process maps too
    (a second engine) stay. The bytes of the mappings advised; 0 where madvise is missing or
    refuses (not Linux, a kernel before 5.4)."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:  # NOTE: not Linux
        return 0
    advised = 0
    for line in lines:
        fields = line.split(maxsplit=5)  # the path last, spaces and all
        # NOTE: only mappings without "w": a written private page is the process's own
        # copy, which paging out would send to swap, not drop
        if len(fields) < 6 or "w" in fields[1] or not fields[5].rstrip("\n").endswith("/" + filename):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if madvise(start, end - start, MADV_PAGEOUT) == 0:
            advised += end - start
    return advised
