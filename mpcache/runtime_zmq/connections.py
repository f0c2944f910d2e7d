"""What the server knows of its connections below zmq: which ones closed, and how much each holds
in zmq's buffers that the loop has not read.

zmq hides connections from a ROUTER; two things need them anyway:

* **Anonymous peers.** A client without an explicit identity (LMCache's) gets a routing id that
  zmq made for that connection (5 bytes, first byte 0: an explicit identity cannot start with 0).
  Without CURVE such a peer cannot come back once its connection closes; ``gone()`` returns those
  identities, and the server tells core_sm (``PeerGone``) so the reconnected client registers
  again instead of finding its instance ids forbidden.
* **Messages that never end.** ``ZMQ_MAXMSGSIZE`` bounds one frame, and zmq delivers a multipart
  message whole: its frames wait in zmq's memory until the last one arrives, so one connection
  sending frames forever grows the server without bound (the frames are never visible to the
  loop). ``check()`` compares each TCP connection's received bytes (the kernel's
  ``tcpi_bytes_received``) with the bytes of the messages the loop read from it (``message()``):
  the difference is what zmq holds for it, and past ``limit_bytes`` the connection is shut down
  (zmq drops what it held; the caller trims the heap). Zero-length frames cost zmq 64 bytes each
  for 2 bytes on the wire, so the process's anonymous memory is watched too: grown by more than
  ``limit_bytes`` since a moment no connection held anything, the connection holding the most is
  cut. An ipc connection has no such counter: ipc admits only the server's uid.

Descriptors come from zmq's socket monitor (``EVENT_ACCEPTED`` / ``EVENT_DISCONNECTED``, in order)
and each message's ``SRCFD``; each accepted TCP connection is watched through a ``dup`` of its
descriptor (the same socket, whatever zmq does with its own number), closed at its disconnect.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import struct
from typing import Any

import attrs
import zmq

log = logging.getLogger("mpcache.server")

# struct tcp_info: tcpi_bytes_received (u64) at offset 128 (Linux >= 4.1)
_TCP_INFO_BYTES_RECEIVED = 128
_TCP_INFO_LEN = 256
# wire bytes zmq may have read for a connection beyond its messages' frames: the greeting and
# handshake (CURVE's is about 1 KiB), and each frame's header (9 bytes; a CURVE frame ~40)
HANDSHAKE_SLACK = 4096
FRAME_OVERHEAD = 48
# a connection holding less than this is "quiet" (the anonymous-memory baseline moves)
_QUIET_BYTES = 1 << 20


def anonymous_rss() -> int:
    """The process's anonymous resident memory in bytes (``RssAnon``; 0 when unknown)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@attrs.define
class _Connection:
    watch: socket.socket | None  # a dup of a TCP connection's descriptor (None: not TCP)
    delivered: int = 0  # wire bytes of the messages the loop read from it
    identity: bytes | None = None  # its anonymous routing id, once a message showed it


def _malloc_trim() -> None:
    """Hand the heap's free pages back to the OS (zmq's frames of a cut connection came from
    glibc's heaps, which keep them otherwise)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class ConnectionWatch:
    """One ROUTER socket's connections (module doc). Loop thread only."""

    def __init__(self, sock: zmq.Socket[Any], *, limit_bytes: int, anonymous_peers: bool) -> None:
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._sock = sock
        self.limit_bytes = limit_bytes
        self.anonymous_peers = anonymous_peers
        self._connections: dict[int, _Connection] = {}
        # anonymous identities by descriptor, and disconnects already accounted for (a message
        # from a new identity on a known descriptor came before the old one's disconnect event)
        self._identity: dict[int, bytes] = {}
        self._skip: dict[int, int] = {}
        self._gone: list[bytes] = []
        self._quiet_rss = anonymous_rss()
        self.cut = 0  # connections shut down for holding too much
        # a cut's frames are freed once zmq's threads have ended the connection: trim the heap at
        # each of the next checks (a second)
        self._trims_left = 0

    # ------------------------------------------------------------------ per message

    def message(self, fd: int, identity: bytes, wire_bytes: int) -> None:
        """The loop read a message of ``wire_bytes`` (frames and their headers) from ``fd``."""
        conn = self._connections.get(fd)
        if conn is not None:
            conn.delivered += wire_bytes
        if identity[:1] != b"\x00" or len(identity) != 5 or not self.anonymous_peers:
            return  # an explicit identity (the common case: one compare)
        known = self._identity.get(fd)
        if known == identity:
            return
        if known is not None:  # the descriptor's last anonymous connection closed
            self._skip[fd] = self._skip.get(fd, 0) + 1
            self._gone.append(known)
        self._identity[fd] = identity

    # ------------------------------------------------------------------ monitor

    def events(self) -> list[bytes]:
        """Read the monitor's events; the anonymous identities whose connection closed since."""
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) < 1 or len(frames[0]) != 6:
                continue
            # zmq's monitor event: u16 event, u32 value (the descriptor), then the endpoint
            # (parsed here: zmq.utils.monitor imports asyncio, which the start-up path avoids)
            kind, fd = struct.unpack("=HI", frames[0])
            if kind == zmq.EVENT_ACCEPTED:
                self._accepted(fd)
            elif kind == zmq.EVENT_DISCONNECTED:
                self._disconnected(fd)
        gone, self._gone = self._gone, []
        return gone

    def _accepted(self, fd: int) -> None:
        old = self._connections.pop(fd, None)
        if old is not None and old.watch is not None:
            old.watch.close()
        watch: socket.socket | None = None
        try:
            watch = socket.socket(fileno=os.dup(fd))
            if watch.family not in (socket.AF_INET, socket.AF_INET6):
                watch.close()
                watch = None
        except OSError:
            if watch is not None:
                watch.close()
            watch = None
        self._connections[fd] = _Connection(watch)

    def _disconnected(self, fd: int) -> None:
        conn = self._connections.pop(fd, None)
        if conn is not None and conn.watch is not None:
            conn.watch.close()
        if self._skip.get(fd):
            self._skip[fd] -= 1
            return
        identity = self._identity.pop(fd, None)
        if identity is not None:
            self._gone.append(identity)

    # ------------------------------------------------------------------ the bound

    def _held(self, conn: _Connection) -> int:
        assert conn.watch is not None
        info = conn.watch.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        if len(info) < _TCP_INFO_BYTES_RECEIVED + 8:
            return 0
        (received,) = struct.unpack_from("=Q", info, _TCP_INFO_BYTES_RECEIVED)
        return int(received) - conn.delivered - HANDSHAKE_SLACK

    def check(self) -> list[str]:
        """Shut down the connections zmq holds too much for; what was cut, for the log."""
        if self._trims_left:
            self._trims_left -= 1
            _malloc_trim()
        held: list[tuple[int, int]] = []
        for fd, conn in self._connections.items():
            if conn.watch is None:
                continue
            try:
                held.append((self._held(conn), fd))
            except OSError:
                continue
        over = [(n, fd) for n, fd in held if n > self.limit_bytes]
        rss = anonymous_rss()
        if not any(n >= _QUIET_BYTES for n, _fd in held):
            self._quiet_rss = rss
        elif not over and rss - self._quiet_rss > self.limit_bytes:
            over = [max(held)]  # many small frames: memory grows faster than the bytes held
        cut = []
        for n, fd in over:
            conn = self._connections[fd]
            assert conn.watch is not None
            try:
                conn.watch.shutdown(socket.SHUT_RDWR)  # zmq sees the end and drops what it held
            except OSError:
                continue
            self.cut += 1
            self._trims_left = 10
            cut.append(f"connection {fd} ({n >> 20} MiB unread in zmq's buffers, process anonymous memory "
                       f"{rss >> 20} MiB)")
        return cut

    def close(self) -> None:
        for conn in self._connections.values():
            if conn.watch is not None:
                conn.watch.close()
        self._connections.clear()
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
