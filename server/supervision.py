"""What ties the launcher's children to it, and what a dead launcher leaves for the next one.

- Every child (engines, the Gunicorn master, its workers) asks the kernel for SIGKILL when its
  parent dies (prctl PR_SET_PDEATHSIG), so a launcher killed by SIGKILL takes its whole tree
  with it. The kernel sends it when the *thread* that forked the child exits: the launcher and
  the Gunicorn master fork from their main thread only.
- The launcher's runtime folder, ``$TMPDIR/ringserve-run-<pid>-<random>``, is locked (flock on
  the folder itself) for the launcher's life. A later start removes every such folder whose lock
  it can take: its launcher is gone, whatever pid namespace it ran in. Shared-memory segments
  are cleaned the same way (ipc/shm.remove_stale_segments).
"""
from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import shutil
import signal
import tempfile
from pathlib import Path

from ringserve.ipc.shm import lock_abandoned

log = logging.getLogger("ringserve.launch")

RUNTIME_PREFIX = "ringserve-run-"
LAUNCHER_PID_ENV = "RINGSERVE_LAUNCHER_PID"  # tells the Gunicorn master whose death to follow
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent dies; exit now if the parent
    (``parent_pid``) is already gone (it died before the request took effect)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)


def make_runtime_dir() -> tuple[Path, int]:
    """A new 0700 runtime folder and the descriptor whose flock marks it as in use (keep it
    open for the launcher's life; it is not inherited by children)."""
    while True:
        path = tempfile.mkdtemp(prefix=f"{RUNTIME_PREFIX}{os.getpid()}-")
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a cleaner took it between mkdtemp and here: make another
            os.close(fd)
            continue
        try:  # a cleaner may have locked and removed it before we locked it
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return Path(path), fd
        except FileNotFoundError:
            pass
        os.close(fd)


def remove_stale_runtime_dirs(root: str | None = None) -> list[str]:
    """Remove every runtime folder (of this user) whose launcher no longer holds its lock."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(RUNTIME_PREFIX + "*"):
        try:
            if path.is_symlink() or path.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        if (fd := lock_abandoned(path, os.O_RDONLY | os.O_DIRECTORY)) is None:
            continue  # its launcher is alive (or it is gone)
        try:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d runtime folder(s) of dead launchers: %s", len(removed), ", ".join(removed))
    return removed
