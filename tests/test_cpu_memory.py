"""gpu/cpu/memory.py: weights and the KV pool moved onto huge-page mappings keep every value,
dtype and shape, sit 64-byte aligned, never overlap, and the mappings carry the huge-page advice;
a library's code paged out leaves the process's memory and still runs."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ringserve.gpu.cpu.int8_kernels import has_vnni
from ringserve.gpu.cpu.memory import CHUNK, HugePageArena
from ringserve.gpu.cpu.packed import fuse_packed, packed_linear
from ringserve.gpu.loader.quant import random_raw
from ringserve.gpu.loader.weights import GGMLTensor


def test_arrays_and_packed_weights_keep_their_values_in_the_arena():
    rng = np.random.default_rng(0)
    arena = HugePageArena()
    small = [rng.standard_normal(n).astype(np.float32) for n in (1, 7, 576, 3000)]
    large = rng.standard_normal((CHUNK // 4 // 4 + 1,)).astype(np.float32)  # its own mapping
    placed = [arena.place(a) for a in (*small, large)]
    for a, b in zip((*small, large), placed, strict=True):
        assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)
        assert b.ctypes.data % 64 == 0 and not np.shares_memory(a, b)
    spans = sorted((b.ctypes.data, b.ctypes.data + b.nbytes) for b in placed)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))  # apart
    placed[0][...] = 5.0
    assert all(np.array_equal(a, b) for a, b in zip(small[1:], placed[1:4], strict=True))
    zeros = arena.zeros((4, 16, 3, 64), np.uint16)
    assert zeros.shape == (4, 16, 3, 64) and not zeros.any()

    # a fused packed weight of two types (a frozen dataclass of dataclasses of arrays)
    tensors = [GGMLTensor(kind, (rows, 512), random_raw(kind, (rows, 512), rng))
               for kind, rows in (("Q4_K", 32), ("Q6_K", 16))]
    for int8 in (False, True) if has_vnni() else (False,):
        fused = fuse_packed(tensors, int8)
        moved = arena.place(fused)
        assert type(moved) is type(fused)
        for before, after in zip(dataclasses.astuple(fused), dataclasses.astuple(moved), strict=True):
            assert type(before) is type(after)
        x = rng.standard_normal((3, 512)).astype(np.float32)
        want, got = np.empty((3, 48), np.float32), np.empty((3, 48), np.float32)
        packed_linear(x, fused, want, parallel=False)
        packed_linear(x, moved, got, parallel=False)
        assert np.array_equal(want, got)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_the_mappings_are_advised_huge():
    """VmFlags 'hg' marks a mapping advised MADV_HUGEPAGE (whether or not the kernel found huge
    pages for it at that moment): every mapping the arena makes has it."""
    arena = HugePageArena()
    a = arena.zeros((CHUNK,), np.uint8)          # a mapping of its own
    b = arena.zeros((1000,), np.float32)         # a chunk's
    vmas: list[tuple[int, int, list[str]]] = []   # (start, end, VmFlags) of every mapping
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            vmas.append((lo, hi, []))
        elif line.startswith("VmFlags:"):
            vmas[-1][2].extend(line.split()[1:])
    flags = [next(f for lo, hi, f in vmas if lo <= x.ctypes.data < hi) for x in (a, b)]
    if Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().find("[never]") < 0:
        assert all("hg" in f for f in flags), flags


_FREED_BLOCK = """
import sys
from pathlib import Path
import numpy as np
from ringserve.gpu.cpu.memory import map_large_blocks
if sys.argv[1] == "set":
    assert map_large_blocks()
def resident():  # this process's anonymous resident bytes
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("RssAnon:"))
    return int(line.split()[1]) << 10
del_me = np.ones(31 << 20, np.uint8)  # mapped, as any block >= 128 KiB at first ...
del del_me                           # ... and freed: glibc's own threshold rises to 31 MiB
step = np.ones(6 << 20, np.uint8)     # a 512-token step's activation, every page touched
before = resident()
del step
print(before - resident() >= 5 << 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, /proc/self/status")
def test_a_freed_step_sized_block_goes_back_to_the_system():
    """memory.map_large_blocks: after a 31 MiB block was freed, glibc's own (dynamic) threshold
    puts a 6 MiB block on the heap, whose pages stay resident once it is freed; with the fixed
    4 MiB threshold the block is a mapping of its own, and free unmaps it."""
    returned = [subprocess.run([sys.executable, "-c", _FREED_BLOCK, arg], capture_output=True,
                               text=True, check=True).stdout.split() for arg in ("default", "set")]
    assert returned == [["False"], ["True"]]


_PAGED_OUT = """
import ctypes, ctypes.util, os, shutil, sys, zlib
from ringserve.gpu.cpu.memory import page_out_library
# a private copy of zlib's library: no other process maps its pages (a shared page stays)
ctypes.CDLL(ctypes.util.find_library("z") or "libz.so.1")
real = next(line.split()[5] for line in open("/proc/self/maps") if "/libz.so" in line)
shutil.copy(real, sys.argv[1])
with open(sys.argv[1], "rb+") as f:
    os.fsync(f.fileno())  # NOTE: a dirty page of the file would wait for its write-back
lib = ctypes.CDLL(sys.argv[1])
lib.crc32.restype = ctypes.c_ulong
def mappings():  # (start, end, writable, resident bytes) of the copy's mappings
    out, cur = [], None
    for line in open("/proc/self/smaps"):
        f = line.split()
        if "-" in f[0] and not f[0].endswith(":"):
            cur = None
            if len(f) > 5 and f[5] == sys.argv[1]:
                lo, hi = (int(v, 16) for v in f[0].split("-"))
                cur = [lo, hi, "w" in f[1], 0]
                out.append(cur)
        elif cur is not None and f[0] == "Rss:":
            cur[3] = int(f[1]) << 10
    return out
read_only = [(lo, hi) for lo, hi, w, _ in mappings() if not w]
for lo, hi in read_only:
    ctypes.string_at(lo, hi - lo)   # every page resident
before = sum(r for _, _, w, r in mappings() if not w)
advised = page_out_library("libpageout.so")
after = sum(r for _, _, w, r in mappings() if not w)
works = lib.crc32(0, b"ringserve", 9) == zlib.crc32(b"ringserve")  # faulted back in as needed
print(advised == sum(hi - lo for lo, hi in read_only), before, after, works)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise, /proc/self/smaps")
def test_a_library_paged_out_leaves_resident_memory_and_still_runs(tmp_path):
    """memory.page_out_library (libllvmlite once the kernels are loaded): every read-only mapping
    of the named file is advised, its resident pages go, and a call into it faults back what
    it needs."""
    out = subprocess.run([sys.executable, "-c", _PAGED_OUT, str(tmp_path / "libpageout.so")],
                         capture_output=True, text=True, check=True).stdout.split()
    advised_all, before, after, works = out[0] == "True", int(out[1]), int(out[2]), out[3] == "True"
    if not advised_all and after == before:
        pytest.skip("this kernel has no MADV_PAGEOUT (Linux < 5.4)")
    assert advised_all and works
    assert before >= 32 << 10 and after <= before // 4, (before, after)
