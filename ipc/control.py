"""The control socket: handshake and liveness between an engine and its clients (docs/design.md §4).

Each engine listens on a UNIX SOCK_SEQPACKET socket (message boundaries kept, file mode 0600).
A client connects; the engine answers with a :class:`Welcome` (its slot, the slot's generation,
the shared-memory names) and, in the same message, the two eventfds — the engine's doorbell and
this slot's output doorbell — passed with SCM_RIGHTS. The client maps the segment and sends
``ATTACHED``; the engine then unlinks the slot segment's name (both sides hold the mapping), so a
later crash leaves nothing behind in /dev/shm. The connection then stays open and silent: when
either process dies the kernel closes it, and the other side reads EOF. That is the liveness
signal; the heartbeat word in the stats segment catches an engine that is alive but hung. An
engine that detaches a slot (its client wrote something that is not a request, or stopped
reading its outputs) sends a ``Refused`` with the reason just before it closes the connection.
"""

from __future__ import annotations

import os
import socket

import msgspec

from ringserve.ipc.ring import DEFAULT_MAX_MESSAGE

ATTACHED = b"attached"
_MAX_MSG = 4096


class Welcome(msgspec.Struct, tag=True):
    slot: int
    generation: int
    engine_pid: int
    segment: str            # the slot's request ring + output ring
    stats_segment: str      # the engine's published load, heartbeat and per-slot counters
    ring_capacity: int
    max_message: int = DEFAULT_MAX_MESSAGE  # the most bytes of one message, either way (ipc/ring.py)


class Refused(msgspec.Struct, tag=True):
    reason: str


_decode = msgspec.msgpack.Decoder(Welcome | Refused).decode


class HandshakeError(ConnectionError):
    pass


def listen(path: str) -> socket.socket:
    """Bind the engine's control socket, replacing a leftover file nobody listens on."""
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # stale: its engine died
        else:
            raise OSError(f"an engine is already listening on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o177)  # the socket file is created 0600
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(128)
    sock.setblocking(False)
    return sock


def send_welcome(conn: socket.socket, welcome: Welcome, fds: list[int]) -> None:
    socket.send_fds(conn, [msgspec.msgpack.encode(welcome)], fds)


def send_refusal(conn: socket.socket, reason: str) -> None:
    """Refuse a connecting client, or (before closing it) tell an attached one why its slot
    is detached: its next read of the connection then sees why the EOF came."""
    conn.send(msgspec.msgpack.encode(Refused(reason)))


def recv_refusal(conn: socket.socket) -> str | None:
    """Read an attached client's control connection: the engine's reason when it detached the
    slot, None at EOF (the engine died or closed it). Raises BlockingIOError with nothing to read."""
    try:
        data = conn.recv(_MAX_MSG)
    except BlockingIOError:
        raise
    except OSError:
        return None
    if not data:
        return None
    try:
        msg = _decode(data)
    except msgspec.DecodeError:
        return "the engine sent an unreadable control message"
    return msg.reason if isinstance(msg, Refused) else "the engine sent an unexpected control message"


def connect(path: str, timeout: float = 5.0) -> tuple[socket.socket, Welcome, list[int]]:
    """Connect to an engine and take a slot: (connection, welcome, [engine doorbell fd, output
    doorbell fd]). The caller attaches the segment, then calls ``conn.send(ATTACHED)``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        data, fds, _, _ = socket.recv_fds(sock, _MAX_MSG, 2)
        if not data:
            raise HandshakeError(f"engine at {path} closed the connection during the handshake")
        msg = _decode(data)
        if isinstance(msg, Refused):
            for fd in fds:
                os.close(fd)
            raise HandshakeError(f"engine at {path} refused: {msg.reason}")
        if len(fds) != 2:
            raise HandshakeError(f"expected 2 eventfds from the engine, got {len(fds)}")
        sock.settimeout(None)
        return sock, msg, fds
    except BaseException:
        sock.close()
        raise
