"""Shared-memory segments: files in /dev/shm mapped with mmap.

Not ``multiprocessing.shared_memory``: Python 3.11 registers every *attacher* with its
resource tracker, which unlinks the segment when that attacher exits and so pulls it from
under the other side. Here only the creator ever unlinks.

Names are ``ringserve-<creator pid>-<random hex>``: unguessable (another local user cannot
pre-create or open them; they are 0600 anyway), and the pid lets a later start find the
segments of a creator that died without cleaning up (:func:`remove_stale_segments`).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "ringserve-"
_NAME_RE = re.compile(r"^ringserve-(\d+)-[0-9a-f]{16,}$")


class Segment:
    """One mapped shared-memory segment. ``buf`` is a writable memoryview of all of it."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool):
        self.name = name
        self.size = len(mm)
        self.owner = owner
        self._mmap = mm
        self.buf = memoryview(mm)
        self._unlinked = False

    @classmethod
    def create(cls, size: int) -> Segment:
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        # O_EXCL | O_NOFOLLOW: never reuse or follow something someone else put there.
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # independent of the umask
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(SHM_DIR / name)
            raise
        finally:
            os.close(fd)
        return cls(name, mm, owner=True)

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


def remove_stale_segments() -> list[str]:
    """Unlink every ringserve segment whose creator process no longer exists; return their names."""
    removed = []
    for path in SHM_DIR.glob(PREFIX + "*"):
        m = _NAME_RE.match(path.name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        try:
            path.unlink()
            removed.append(path.name)
        except (FileNotFoundError, PermissionError):
            pass
    return removed


def list_segments() -> list[str]:
    return sorted(p.name for p in SHM_DIR.glob(PREFIX + "*"))
