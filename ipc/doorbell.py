"""Doorbells: eventfds that wake a sleeping peer (docs/design.md §4).

One shared many-writer doorbell into each engine; one per worker for its outputs. The writer
publishes its ring record first and rings after, and the sleeper drains the doorbell *before*
it rechecks its rings, so a record is never left unseen: either the recheck finds it or the
ring comes after the drain and wakes the next wait. Non-blocking, so ring and drain never stall.
"""

from __future__ import annotations

import os
import select


class Doorbell:
    def __init__(self, fd: int | None = None):
        """A new eventfd, or a handle on one received from a peer (it then owns ``fd``)."""
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) if fd is None else fd

    def fileno(self) -> int:
        return self.fd

    def ring(self) -> None:
        try:
            os.eventfd_write(self.fd, 1)
        except BlockingIOError:  # counter at its maximum: the peer is already due to wake
            pass

    def drain(self) -> int:
        """Reset to zero; returns how many rings were pending (0 if none)."""
        try:
            return os.eventfd_read(self.fd)
        except BlockingIOError:
            return 0

    def wait(self, timeout: float | None) -> bool:
        """Block until rung (True) or ``timeout`` seconds pass (False). Does not drain."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        return bool(poller.poll(None if timeout is None else timeout * 1000))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
