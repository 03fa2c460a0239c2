"""Shared-memory segments: files in /dev/shm mapped with mmap.

Not ``multiprocessing.shared_memory``: Python 3.11 registers every *attacher* with its
resource tracker, which unlinks the segment when that attacher exits and so pulls it from
under the other side. Here only the creator ever unlinks.

Names are ``ringserve-<creator pid>-<random hex>``: unguessable (another local user cannot
pre-create or open them; they are 0600 anyway); the pid only tells a reader who made it.

Liveness is a lock, not a pid: the creator keeps the segment's file open with an exclusive
flock(2) on it for as long as the segment lives, and the kernel drops the lock when the creator
exits, however it exits. :func:`remove_stale_segments` removes only segments whose lock it can
take. A pid check could not tell a dead creator from a live one in another PID namespace that
shares /dev/shm (a container), nor from an unrelated process that reused the pid.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import secrets
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "ringserve-"
_NAME_RE = re.compile(r"^ringserve-(\d+)-[0-9a-f]{16,}$")
EMPTY_GRACE_S = 60.0  # an empty, unlocked segment younger than this may be one being created


class Segment:
    """One mapped shared-memory segment. ``buf`` is a writable memoryview of all of it."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool, lock_fd: int | None = None):
        self.name = name
        self.size = len(mm)
        self.owner = owner
        self._mmap = mm
        self.buf = memoryview(mm)
        self._unlinked = False
        self._lock_fd = lock_fd  # creator: the open file whose flock says "alive"

    @classmethod
    def create(cls, size: int) -> Segment:
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        # O_EXCL | O_NOFOLLOW: never reuse or follow something someone else put there.
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            # Locked before it has a size: a cleaner that takes the lock first sees an empty
            # file, which it leaves alone (remove_stale_segments); this blocks until it is done.
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.fchmod(fd, 0o600)  # independent of the umask
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(SHM_DIR / name)
            os.close(fd)
            raise
        return cls(name, mm, owner=True, lock_fd=fd)

    @classmethod
    def attach(cls, name: str) -> Segment:
        if not _NAME_RE.match(name):
            raise ValueError(f"not a ringserve segment name: {name!r}")
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return cls(name, mm, owner=False)

    def unlink(self) -> None:
        """Remove the name from /dev/shm (creator only); mappings stay valid until closed."""
        if self.owner and not self._unlinked:
            self._unlinked = True
            try:
                os.unlink(SHM_DIR / self.name)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # drops the lock
            self._lock_fd = None
        self.buf.release()
        try:
            self._mmap.close()
        except BufferError:
            # A view derived from buf is still alive somewhere; the mapping goes away with it.
            pass

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (ours or someone else's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by someone else
    return True


def lock_abandoned(path: Path, flags: int = os.O_RDONLY) -> int | None:
    """An fd of `path` holding its exclusive flock, if no live owner holds the lock (its owner
    keeps it from creation to exit); None when the owner is alive, or the path is gone or not
    ours to open. Closing the fd releases the lock."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW)
    except OSError:  # gone meanwhile, or someone else's
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None  # its owner is alive
    return fd


def remove_stale_segments() -> list[str]:
    """Unlink every ringserve segment no live creator holds (its flock is free); return their
    names. Never touches a live instance's segment, whatever pid its name carries."""
    removed = []
    for path in SHM_DIR.glob(PREFIX + "*"):
        if _NAME_RE.match(path.name) is None or (fd := lock_abandoned(path)) is None:
            continue
        try:
            st = os.fstat(fd)
            if st.st_size == 0 and time.time() - st.st_ctime < EMPTY_GRACE_S:
                continue  # created this instant: its creator has not taken the lock yet
            path.unlink()
            removed.append(path.name)
        except (FileNotFoundError, PermissionError):
            pass
        finally:
            os.close(fd)  # unlocks
    return removed


def list_segments() -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(PREFIX + "*"))
