"""Where a server's memory is, as the machine counts it: the proportional set size (PSS: a page
shared by n processes counts 1/n in each) of processes, read from /proc (Linux; 0 elsewhere).

/metrics shows it beside what the engines hold by design (server/metrics.py): the engine's PSS
against its weights and KV pool says what the rest costs (Python, Numba's compiled code, step
buffers), and the frontend's (launcher, Gunicorn master and workers) what serving HTTP costs.
tools/bench_llamacpp.py samples the same sums for a whole server tree.
"""
from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path


def pss_bytes(pid: int) -> int:
    """One process's PSS in bytes (0 if it is gone or cannot be read)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def process_tree(pid: int) -> list[int]:
    """pid and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def tree_pss_bytes(pid: int, exclude: frozenset[int] = frozenset()) -> int:
    """The PSS of pid's process tree, shared pages once, leaving out the trees of `exclude`."""
    skip = {p for e in exclude for p in process_tree(e)}
    return sum(pss_bytes(p) for p in process_tree(pid) if p not in skip)


def server_root() -> int:
    """The launcher of the server this Gunicorn worker serves: its master's parent."""
    try:
        stat = Path(f"/proc/{os.getppid()}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return os.getppid()


def release_free_heap() -> bool:
    """Hand the heap's free pages back to the system (glibc's malloc_trim, after a garbage
    collection): what parsing a tokenizer and importing the app left freed stays resident
    otherwise, and in Gunicorn's master it would be inherited by every worker it forks; a worker
    calls it again once it is connected (on Llama-3's tokenizer ~6 MB in the master and up to
    ~11 in a worker, measured with the same call made by a debugger). False where the C
    library has no malloc_trim (not glibc)."""
    gc.collect()
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
