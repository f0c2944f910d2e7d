"""L2 tiers: dumb, blocking, thread-safe object stores behind the L1 pool.

An L2 tier stores opaque values under opaque byte keys. It makes no protocol decision: `core_sm`
plans which objects to read (prefetch) or write (write-behind) and the server's worker threads
call the tier and post the outcome back as `L2ReadFinished` / `L2WriteFinished` events.

Contract of every tier (`L2Tier`):

* `read(key) -> bytes | None`: the value, or `None` when the tier does not hold it (never
  stored, evicted, expired, or found damaged and discarded).
* `write(key, data) -> None`: stores `data` under `key`, replacing any previous value. Readers
  never see a partial value.
* `contains(key) -> bool`: whether a `read` now would most likely return a value.
* `read_many(keys)` / `write_many(items)`: the same, batched (on Redis: pipelined, spread over a few
  pooled connections; `read_many` may return `bytearray` values).
* `close()`: releases files, locks and connections; idempotent. Calls after `close` raise
  `L2Error`.
* `name`: a printable description for logs and metrics, with no password in it.
* Every method may be called from several threads at once.
* I/O failures raise `L2Error` (`L2Unavailable` when the backing service cannot be reached),
  with a message that names the tier; the caller turns them into a failed read/write.

Optional methods the L2 worker uses when a tier has them: `contains_many(keys)` (one round
trip), `delete(key)` (drop an object that failed its integrity check), `ping()` (reachability,
for the circuit breaker and the start check), `read_each(keys, on_value, limit)` (each value
handed over in a reused buffer as it arrives) and `read_into(keys, on_value)` (each value handed
over as a `ValueStream` before it is read, so the reader places it where it belongs: the L2
worker reads a Redis value straight into its L1 slot).

Values are opaque to a tier: the L2 worker seals them (size + keyed checksum, `l2_seal`) before
`write` and checks them after `read`.

Tiers are opened from a URL (`open_tier`):

* `disk:PATH[?max_bytes=N|max_gb=X][&fsync=1]`: one file per object under `PATH` (created with
  mode 0700; an existing `PATH` must not be group/other accessible). Writes go to a temporary file
  and are renamed into place. The least recently written or read objects are removed first when
  the tier is over its cap; without `max_bytes`/`max_gb` the cap is half of what the file system
  had available at start (free space plus the tier's own objects). One server process owns a
  directory at a time (an exclusive `flock` on `PATH/.lock`).
* `redis://[USER[:PASSWORD]@]HOST:PORT[/DB][?ttl=SECONDS][&prefix=P][&timeout=SECONDS][&pool=N]`
  `[&password_file=PATH]` (also `rediss://` for TLS with `&ca=PATH&cert=PATH&key=PATH`, and
  `valkey://`, `valkeys://`): keys are stored as `prefix + key` (default prefix `mpcache:`),
  values as binary strings, with an optional expiry. Several servers pointing at one Redis share
  its objects: that is mpcache's multi-node tier. Put the password in `password_file` (mode 0600)
  or in the `MPCACHE_L2` environment variable, not on a command line; every name and message
  shows the URL with its password replaced by `***`.
  For objects of megabytes (KV chunks), run the redis-server with its values on transparent huge
  pages: ``MALLOC_CONF=thp:always`` in its environment (``JE_MALLOC_CONF`` for a redis-server
  built with Redis's own jemalloc) and ``--disable-thp no``; with persistence off (``--save ""``,
  no AOF) it never forks, so huge pages cost it nothing. Without them it takes a page fault on
  every 4 KiB of each value it receives or sends, about half of its CPU per GB moved (0.45-0.50
  CPU s/GB instead of 0.19-0.26 for 32 MiB values, ``mpcache-bench l2`` and ``--redis-plain``).
* `redis+cluster://[USER@]HOST:PORT[,HOST:PORT...][?...]` (also `rediss+cluster://`,
  `valkey+cluster://`): a Redis Cluster / Valkey cluster through redis-py's cluster client, with
  the same parameters (see `runtime_zmq/l2_cluster.py`).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import itertools
import logging
import os
import re
import select
import stat
import struct
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar, runtime_checkable

from mpcache.runtime_zmq.l2_common import (
    DEFAULT_REDIS_POOL,
    DEFAULT_REDIS_PREFIX,
    DEFAULT_REDIS_TIMEOUT_S,
    L2Error,
    L2Unavailable,
    import_redis,
    param_bool,
    param_float,
    param_int,
    redact,
    redis_options,
    reject_unknown,
    split_params,
    translate_redis_error,
)

log = logging.getLogger("mpcache.l2")

__all__ = [
    "L2Error",
    "L2Unavailable",
    "L2Tier",
    "DiskTier",
    "RedisTier",
    "ValueStream",
    "open_tier",
]


_Blob = TypeVar("_Blob", bytes, memoryview)  # a disk object read whole, or into a reused buffer
_R = TypeVar("_R")


@runtime_checkable
class L2Tier(Protocol):
    name: str

    def read(self, key: bytes) -> bytes | None: ...

    def write(self, key: bytes, data: bytes) -> None: ...

    def contains(self, key: bytes) -> bool: ...

    def read_many(self, keys: Sequence[bytes]) -> Sequence[bytes | bytearray | None]: ...

    def write_many(self, items: Sequence[tuple[bytes, bytes]]) -> None: ...

    def close(self) -> None: ...


def open_tier(url: str) -> L2Tier:
    """Opens the tier that `url` names (see the module docstring for the forms).

    Raises `L2Error` for a malformed URL or an unusable directory, and `L2Unavailable` when a
    Redis server does not answer a PING within the connect timeout.
    """
    if url.startswith("disk:"):
        path, params = split_params(url[len("disk:"):])
        if not path:
            raise L2Error(f"L2 URL {url!r}: disk tier needs a path (disk:/some/dir)")
        max_bytes: int | None = None
        if "max_bytes" in params and "max_gb" in params:
            raise L2Error(f"L2 URL {url!r}: give max_bytes or max_gb, not both")
        if "max_bytes" in params:
            max_bytes = param_int(url, params, "max_bytes")
        elif "max_gb" in params:
            max_bytes = int(param_float(url, params, "max_gb") * (1 << 30))
        fsync = param_bool(url, params, "fsync", False)
        reject_unknown(url, params, {"max_bytes", "max_gb", "fsync"})
        return DiskTier(path, max_bytes=max_bytes, fsync=fsync)
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in ("redis", "rediss", "valkey", "valkeys"):
        return RedisTier.from_url(url)
    if scheme in ("redis+cluster", "rediss+cluster", "valkey+cluster", "valkeys+cluster"):
        from mpcache.runtime_zmq.l2_cluster import RedisClusterTier

        return RedisClusterTier.from_url(url)
    raise L2Error(
        f"L2 URL {redact(url)!r}: unknown tier; use disk:PATH, redis://HOST:PORT[/DB] or "
        f"redis+cluster://HOST:PORT,HOST:PORT"
    )


def split_l2_urls(text: str) -> list[str]:
    """Tier URLs from one string (the ``MPCACHE_L2`` variable): separated by commas or spaces.
    A comma inside a cluster URL (``redis+cluster://h1:p1,h2:p2``) separates its hosts, not two
    tiers: a piece that does not start a URL (``disk:``, ``python:``, ``SCHEME://``) continues
    the one before it."""
    urls: list[str] = []
    for piece in text.replace(",", " , ").split():
        if piece == ",":
            if urls:
                urls[-1] += ","
            continue
        if urls and urls[-1].endswith(",") and not re.match(r"^([a-z][a-z0-9+.-]*://|disk:|python:)", piece, re.I):
            urls[-1] += piece
        else:
            if urls and urls[-1].endswith(","):
                urls[-1] = urls[-1][:-1]
            urls.append(piece)
    if urls and urls[-1].endswith(","):
        urls[-1] = urls[-1][:-1]
    return [u for u in urls if u]


# --------------------------------------------------------------------------------------------
# URL helpers


# --------------------------------------------------------------------------------------------
# Disk tier

# File layout: magic, key length (u32), value length (u64), key, value. The stored key guards
# against name collisions of long (hashed) keys; the value length detects a file cut short.
_MAGIC = b"MPL2"
_HEADER = struct.Struct("<4sIQ")
# Keys up to this many bytes are hex-encoded into the file name (2 hex chars per byte; file
# names are limited to 255 bytes); longer keys are named by their blake2b digest.
_MAX_HEX_KEY = 100
# Without an explicit cap a disk tier takes at most this share of the file system's space.
DEFAULT_DISK_CAP_FRACTION = 0.5


class DiskTier:
    """One file per object under a private directory; optional byte cap with LRU eviction."""

    def __init__(self, path: str, *, max_bytes: int | None = None, fsync: bool = False,
                 default_cap_fraction: float | None = DEFAULT_DISK_CAP_FRACTION) -> None:
        """``max_bytes`` None: the cap is ``default_cap_fraction`` of the file system's available
        bytes plus the tier's own objects, measured at open (None as well: no cap)."""
        self._root = os.path.abspath(path)
        self._max_bytes = max_bytes
        self._fsync = fsync
        self.name = f"disk:{self._root}"
        self._lock = threading.Lock()
        # file name -> size in bytes, least recently used first.
        self._index: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0
        self._tmp_seq = itertools.count()
        self._closed = False
        # files whose header or stored key is not what a read expects (damaged, foreign, or
        # planted under a computed name): counted by reason, logged at most once per interval
        self.rejected: dict[str, int] = {"header": 0, "key": 0}
        self._rejects_pending: dict[str, int] = {}
        self._rejects_logged_at = -1e18
        self.reject_log_interval_s = 30.0
        self._buffers = _Buffers(keep=2)
        self._prepare_root()
        self._tmp_dir = os.path.join(self._root, ".tmp")
        self._lock_fd = self._take_ownership()
        try:
            os.makedirs(self._tmp_dir, mode=0o700, exist_ok=True)
            self._clear_tmp()
            self._scan()
            if self._max_bytes is None and default_cap_fraction is not None:
                st = os.statvfs(self._root)
                self._max_bytes = int((st.f_bavail * st.f_frsize + self._bytes) * default_cap_fraction)
            self._evict_over_cap()
        except BaseException:
            os.close(self._lock_fd)
            raise
        if self._max_bytes is not None:
            self.name += f", cap {self._max_bytes} B"

    # -- public API --------------------------------------------------------------------------

    @property
    def root(self) -> str:
        """The tier's directory (the server keeps its L2 secret file here by default)."""
        return self._root

    @property
    def max_bytes(self) -> int | None:
        return self._max_bytes

    @property
    def bytes_stored(self) -> int:
        """Total bytes of the object files this tier holds (headers included)."""
        with self._lock:
            return self._bytes

    @property
    def objects(self) -> int:
        with self._lock:
            return len(self._index)

    def stats(self) -> dict[str, int]:
        """``bytes`` and ``objects`` held (from the index: no I/O), for metrics."""
        with self._lock:
            return {"bytes": self._bytes, "objects": len(self._index),
                    "max_bytes": self._max_bytes if self._max_bytes is not None else -1,
                    "rejected_header": self.rejected["header"], "rejected_key": self.rejected["key"]}

    def read(self, key: bytes) -> bytes | None:
        self._check_open()
        name = self._file_name(key)
        path = self._object_path(name)
        try:
            with open(path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                blob = f.read()
        except FileNotFoundError:
            self._forget(name)
            return None
        except OSError as e:
            raise L2Error(f"{self.name}: reading {path}: {e}") from e
        return self._accept(key, name, path, inode, blob)

    def _forget(self, name: str) -> None:
        """Removed behind the index's back (a rare write/damage race): forget it."""
        with self._lock:
            size = self._index.pop(name, None)
            if size is not None:
                self._bytes -= size

    def _accept(self, key: bytes, name: str, path: str, inode: int, blob: _Blob) -> _Blob | None:
        """The value in a file read whole (``blob``), or None: a damaged or foreign file is
        dropped, so the slot is reusable and the next read is quick. A value read is made the
        most recently used."""
        value = self._decode(key, blob)
        if isinstance(value, str):
            self._note_rejection(value, path)
            self._remove_damaged(name, path, inode)
            return None
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
        return value

    def read_each(self, keys: Sequence[bytes], on_value: Callable[[int, memoryview | None], None],
                  limit: int | None = None) -> None:
        """Read each of ``keys`` into a receive buffer this thread reuses (``readinto``: no fresh
        allocation, no copy of the value out of the file's bytes) and hand it to
        ``on_value(index, view)`` (None: absent or refused); the view is valid only during the
        call. A file larger than ``limit`` bytes is a miss, left in place and never read."""
        self._check_open()
        try:
            for i, key in enumerate(keys):
                value = self._read_into(key, limit)
                try:
                    on_value(i, value)
                finally:
                    if value is not None:
                        value.release()
        finally:
            self._buffers.give()

    def _read_into(self, key: bytes, limit: int | None) -> memoryview | None:
        name = self._file_name(key)
        path = self._object_path(name)
        try:
            with open(path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                size = st.st_size
                if limit is not None and size > _HEADER.size + len(key) + limit:
                    return None
                buf = self._buffers.take(size)
                view = memoryview(buf)[:size]
                have = 0
                try:
                    while have < size:
                        got = f.readinto(view[have:])
                        if not got:
                            break  # cut short while we read: the header check refuses it
                        have += got
                    blob = view[:have]
                finally:
                    view.release()
        except FileNotFoundError:
            self._forget(name)
            return None
        except OSError as e:
            raise L2Error(f"{self.name}: reading {path}: {e}") from e
        try:
            return self._accept(key, name, path, st.st_ino, blob)
        finally:
            blob.release()  # the value, if any, is a view of its own

    def contains(self, key: bytes) -> bool:
        self._check_open()
        name = self._file_name(key)
        # The index is authoritative: it was built from the directory at open, and the directory
        # lock keeps every other mpcache server from writing into it.
        with self._lock:
            return name in self._index

    def write(self, key: bytes, data: bytes) -> None:
        self._check_open()
        key = bytes(key)
        size = _HEADER.size + len(key) + len(data)
        if self._max_bytes is not None and size > self._max_bytes:
            raise L2Error(
                f"{self.name}: object of {size} B does not fit in the tier's cap of "
                f"{self._max_bytes} B"
            )
        name = self._file_name(key)
        final = self._object_path(name)
        tmp = os.path.join(
            self._tmp_dir, f"{name[:32]}.{os.getpid()}.{threading.get_ident()}.{next(self._tmp_seq)}"
        )
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(_HEADER.pack(_MAGIC, len(key), len(data)))
                    f.write(key)
                    f.write(data)
                    if self._fsync:
                        f.flush()
                        os.fsync(f.fileno())
            except BaseException:
                _unlink_quietly(tmp)
                raise
            # Rename and index update happen under the lock, as do eviction's index update and
            # unlink, so the index and the directory never disagree about a name.
            with self._lock:
                try:
                    os.replace(tmp, final)
                except FileNotFoundError:
                    os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
                    os.replace(tmp, final)
                old = self._index.pop(name, None)
                if old is not None:
                    self._bytes -= old
                self._index[name] = size
                self._bytes += size
        except OSError as e:
            _unlink_quietly(tmp)
            if e.errno == errno.ENOSPC:
                raise L2Error(f"{self.name}: disk full writing {final}") from e
            raise L2Error(f"{self.name}: writing {final}: {e}") from e
        self._evict_over_cap()

    def read_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self.read(k) for k in keys]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def write_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        for key, data in items:
            self.write(key, data)

    def delete(self, key: bytes) -> None:
        """Removes the object under ``key`` (nothing if there is none)."""
        self._check_open()
        name = self._file_name(key)
        with self._lock:
            _unlink_quietly(self._object_path(name))
            size = self._index.pop(name, None)
            if size is not None:
                self._bytes -= size

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        finally:
            os.close(self._lock_fd)

    def __repr__(self) -> str:
        return f"<DiskTier {self.name}>"

    # -- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise L2Error(f"{self.name}: tier is closed")

    def _prepare_root(self) -> None:
        try:
            os.makedirs(self._root, mode=0o700, exist_ok=True)
            st = os.stat(self._root)
        except OSError as e:
            raise L2Error(f"disk tier: cannot create {self._root}: {e}") from e
        if not stat.S_ISDIR(st.st_mode):
            raise L2Error(f"disk tier: {self._root} is not a directory")
        if st.st_mode & 0o077:
            # KV data is as sensitive as the prompts it was computed from; never widen access,
            # and never silently narrow a directory the user shares with others.
            raise L2Error(
                f"disk tier: {self._root} has mode {stat.S_IMODE(st.st_mode):04o}; it must not be "
                f"accessible to group or others (chmod 700 it, or point at a new directory)"
            )
        if not os.access(self._root, os.W_OK | os.X_OK):
            raise L2Error(f"disk tier: {self._root} is not writable")

    def _take_ownership(self) -> int:
        lock_path = os.path.join(self._root, ".lock")
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise L2Error(f"disk tier: cannot open {lock_path}: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise L2Error(
                f"disk tier: {self._root} is in use by another mpcache server "
                f"(one directory per server; share objects between servers through Redis)"
            ) from None
        return fd

    def _clear_tmp(self) -> None:
        # Left over from a writer that died between create and rename.
        for entry in os.scandir(self._tmp_dir):
            _unlink_quietly(entry.path)

    def _scan(self) -> None:
        found: list[tuple[float, str, int]] = []
        for sub in os.scandir(self._root):
            if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
                continue
            for entry in os.scandir(sub.path):
                if not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime, entry.name, st.st_size))
        found.sort()
        with self._lock:
            for _, name, size in found:
                self._index[name] = size
                self._bytes += size

    def _evict_over_cap(self) -> None:
        if self._max_bytes is None:
            return
        while True:
            with self._lock:
                if self._bytes <= self._max_bytes or not self._index:
                    return
                name, size = self._index.popitem(last=False)
                self._bytes -= size
                _unlink_quietly(self._object_path(name))

    def _remove_damaged(self, name: str, path: str, inode: int) -> None:
        with self._lock:
            try:
                if os.stat(path).st_ino != inode:
                    return  # rewritten meanwhile: leave the new file alone
            except FileNotFoundError:
                pass
            else:
                _unlink_quietly(path)
            size = self._index.pop(name, None)
            if size is not None:
                self._bytes -= size

    @staticmethod
    def _file_name(key: bytes) -> str:
        if len(key) <= _MAX_HEX_KEY:
            return bytes(key).hex() or "empty"
        return "h" + hashlib.blake2b(key, digest_size=32).hexdigest()

    def _object_path(self, name: str) -> str:
        # Fan out over 256 subdirectories so no directory grows huge. The subdirectory comes from
        # a hash of the name, not from the key's bytes, because keys may share long prefixes or
        # suffixes (a chunk hash followed by a rank, say).
        sub = hashlib.blake2b(name.encode(), digest_size=1).hexdigest()
        return os.path.join(self._root, sub, name)

    def _note_rejection(self, reason: str, path: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.rejected[reason] += 1
            self._rejects_pending[reason] = self._rejects_pending.get(reason, 0) + 1
            if now - self._rejects_logged_at < self.reject_log_interval_s:
                return
            self._rejects_logged_at = now
            summary = ", ".join(f"{n} {r}" for r, n in sorted(self._rejects_pending.items()))
            self._rejects_pending.clear()
        log.warning("L2 %s: rejected files (bad header or another key; served as misses and deleted): %s; "
                    "latest %s (next report in %.0f s at most)", self.name, summary, path, self.reject_log_interval_s)

    @staticmethod
    def _decode(key: bytes, blob: _Blob) -> _Blob | str:
        """The value in ``blob``, or why it is refused: ``"header"`` (no magic, or lengths that
        disagree with the file's size: cut short, appended to, foreign), ``"key"`` (another key's
        object: a name collision, or a file planted under the name)."""
        if len(blob) < _HEADER.size:
            return "header"
        magic, key_len, data_len = _HEADER.unpack_from(blob)
        if magic != _MAGIC or len(blob) != _HEADER.size + key_len + data_len:
            return "header"
        if blob[_HEADER.size:_HEADER.size + key_len] != key:
            return "key"
        return blob[_HEADER.size + key_len:]


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        pass


# --------------------------------------------------------------------------------------------
# Redis tier

# Connections one batch is spread over (each carries a pipelined share): one connection moves a
# 32 MiB value at what one core can copy, and the L2 worker's threads share the pool, so a batch
# takes at most this many of its connections.
REDIS_SPREAD = 4
# GETs one read_into connection has outstanding: the next value is prepared by Redis while this
# one is read, and Redis holds at most this many values in reply buffers for the connection.
READ_WINDOW = 2
# read_into's per-thread buffer for the bytes of a value its consumer refused
_DRAIN_BYTES = 1 << 20


class _ReplyReader:
    """Reads RESP replies off a redis-py connection's socket: a bulk string lands in one buffer
    by ``recv_into`` (redis-py's own parser copies a large value through several Python buffers:
    it read 32 MiB values at a third of the socket's speed). Accepts RESP2 and RESP3 nulls."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._buf = bytearray()

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(b"\r\n")
            if end >= 0:
                line = bytes(self._buf[:end])
                del self._buf[: end + 2]
                return line
            chunk = self._sock.recv(65536)
            if not chunk:
                raise ConnectionError("connection closed by the server")
            self._buf += chunk

    def bulk_length(self) -> int | None:
        """The length of the next reply, a bulk string (None: a null), its bytes not read yet;
        a ``ValueError`` names an error reply."""
        line = self._line()
        kind = line[:1]
        if kind == b"_" or line == b"$-1":
            return None
        if kind == b"-":
            raise ValueError(line[1:].decode("utf-8", "replace"))
        if kind != b"$":
            raise ValueError(f"unexpected reply {line[:32]!r}")
        return int(line[1:])

    def bulk(self) -> bytearray | None:
        """The next reply as a value (None: a null), or a ``ValueError`` naming an error reply."""
        n = self.bulk_length()
        if n is None:
            return None
        out = bytearray(n + 2)  # the value and its CRLF
        have = min(len(self._buf), n + 2)
        out[:have] = self._buf[:have]
        del self._buf[:have]
        view = memoryview(out)
        try:
            while have < n + 2:
                got = self._sock.recv_into(view[have:])
                if not got:
                    raise ConnectionError("connection closed by the server")
                have += got
        finally:
            view.release()
        del out[n:]
        return out

    def bulk_into(self, buffers: _Buffers) -> memoryview | None:
        """The next reply read into a buffer taken from ``buffers`` (a view of its first bytes,
        valid until the buffer is given back), or None for a null; errors as ``bulk``."""
        n = self.bulk_length()
        if n is None:
            return None
        buf = buffers.take(n + 2)
        have = min(len(self._buf), n + 2)
        buf[:have] = self._buf[:have]
        del self._buf[:have]
        view = memoryview(buf)[: n + 2]
        while have < n + 2:
            got = self._sock.recv_into(view[have:])
            if not got:
                view.release()
                raise ConnectionError("connection closed by the server")
            have += got
        value = view[:n]
        view.release()
        return value

    def ready(self) -> bool:
        """Whether ``read_some`` returns at once (bytes buffered here or in the TLS layer)."""
        pending = getattr(self._sock, "pending", None)
        return bool(self._buf) or (pending is not None and pending() > 0)

    def wait(self) -> None:
        """Until the socket has bytes to read; ``TimeoutError`` after the socket's timeout."""
        if self.ready():
            return
        timeout = self._sock.gettimeout()
        readable, _, _ = select.select([self._sock], [], [], timeout)
        if not readable:
            raise TimeoutError("timed out waiting for the server's reply")

    def read_some(self, view: memoryview) -> int:
        """At least one and at most ``len(view)`` bytes of the reply into ``view``."""
        if self._buf:
            n = min(len(self._buf), len(view))
            view[:n] = self._buf[:n]
            del self._buf[:n]
            return n
        got: int = self._sock.recv_into(view, len(view))
        if not got:
            raise ConnectionError("connection closed by the server")
        return got


class ValueStream:
    """One value being read off its source, for ``read_into``'s consumer: ``size`` bytes in all,
    ``remaining`` of them not read yet. ``wait`` blocks until ``read_some`` will not (so a
    consumer can wait outside a lock and copy inside it); ``read_exact`` fills a view."""

    __slots__ = ("_reader", "size", "remaining")

    def __init__(self, reader: _ReplyReader, size: int) -> None:
        self._reader = reader
        self.size = size
        self.remaining = size

    def wait(self) -> None:
        self._reader.wait()

    def read_some(self, view: memoryview) -> int:
        """At least one byte (when any remains) and at most ``len(view)`` into ``view``."""
        n = min(len(view), self.remaining)
        if n == 0:
            return 0
        got = self._reader.read_some(view[:n] if n < len(view) else view)
        self.remaining -= got
        return got

    def read_exact(self, view: memoryview) -> None:
        if len(view) > self.remaining:
            raise ValueError(f"{len(view)} bytes asked, {self.remaining} left in the value")
        have = 0
        while have < len(view):
            self.wait()
            have += self.read_some(view[have:])

    def drain(self, scratch: bytearray) -> None:
        """Reads and drops what the consumer left (a refused value), through ``scratch``."""
        view = memoryview(scratch)
        try:
            while self.remaining:
                self.wait()
                self.read_some(view)
        finally:
            view.release()


class _Buffers:
    """Reusable receive buffers for ``RedisTier.read_each``: a large value is read into a buffer
    that was faulted in once, not into a fresh allocation (a fresh 32 MiB bytearray costs ~8k page
    faults and zeroing, ~a third of the time to read it). At most ``keep`` buffers stay between
    calls; the one a thread holds is handed back with ``give``."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: list[bytearray] = []
        self._lock = threading.Lock()
        self._local = threading.local()

    def take(self, n: int) -> bytearray:
        held: bytearray | None = getattr(self._local, "buf", None)
        if held is None:
            with self._lock:
                held = self._free.pop() if self._free else bytearray()
        if len(held) < n:
            held.extend(bytes(n - len(held)))
        self._local.buf = held
        return held

    def give(self) -> None:
        held: bytearray | None = getattr(self._local, "buf", None)
        self._local.buf = None
        if held is not None:
            with self._lock:
                if len(self._free) < self._keep:
                    self._free.append(held)


def _batch_error(error: str | None, e: ValueError) -> str | None:
    """The error a pipelined batch fails with after reply ``e``: a key holding another type is a
    miss (as MGET answers it); any other error reply (no permission, ...) fails the batch, the
    first one named."""
    return error if error is not None or str(e).startswith("WRONGTYPE") else str(e)


def _send_all(sock: Any, data: bytes | memoryview,
              guard: Callable[[], AbstractContextManager[object]] | None = None) -> None:
    """``sock.sendall`` in pieces of at most ``_SEND_PIECE_BYTES`` (each send copies what the
    socket buffer takes, the GIL released); with ``guard``, each send inside ``guard()`` after
    the socket was seen writable outside it."""
    view = memoryview(data)
    try:
        at = 0
        while at < len(view):
            piece = view[at:at + _SEND_PIECE_BYTES]
            if guard is None:
                at += sock.send(piece)
                continue
            _, writable, _ = select.select([], [sock], [], sock.gettimeout())
            if not writable:
                raise TimeoutError("timed out sending to the server")
            with guard():
                at += sock.send(piece)
    finally:
        view.release()


_SEND_PIECE_BYTES = 4 << 20


def _pack_command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
class RedisTier:
    """Objects in a Redis (or Valkey) database, shared by every server that points at it.

    Opening it does not connect: a Redis that is down at start makes the server start L1-only
    (the L2 worker pings it and retries with backoff) unless the tier is required."""

    def __init__(
        self,
        url: str,
        *,
        ttl_s: int | None = None,
        prefix: bytes = DEFAULT_REDIS_PREFIX,
        timeout_s: float = DEFAULT_REDIS_TIMEOUT_S,
        pool_size: int = DEFAULT_REDIS_POOL,
        connection_kwargs: dict[str, Any] | None = None,
    ) -> None:
        redis = import_redis()
        self._redis = redis
        self._ttl_s = ttl_s
        self._prefix = prefix
        self._closed = False
        scheme = url.split("://", 1)[0].lower()
        # valkey:// is spelled redis:// to redis-py; the protocol is the same.
        redis_url = url
        if scheme.startswith("valkey"):
            redis_url = "redis" + url[len("valkey"):]
        ttl = f", ttl {ttl_s} s" if ttl_s is not None else ""
        self.name = f"{redact(url)}{ttl}"
        try:
            self._pool = redis.BlockingConnectionPool.from_url(
                redis_url,
                max_connections=pool_size,
                timeout=timeout_s,  # waiting for a free pooled connection
                socket_connect_timeout=timeout_s,
                socket_timeout=timeout_s,
                health_check_interval=30,
                **(connection_kwargs or {}),
            )
        except ValueError as e:
            raise L2Error(f"redis tier {self.name}: bad URL: {e}") from e
        self._client = redis.Redis(connection_pool=self._pool)
        self._spread = max(1, min(REDIS_SPREAD, pool_size))
        self._executor: Any = None  # a ThreadPoolExecutor, made at the first spread batch
        self._executor_lock = threading.Lock()
        self._buffers = _Buffers(keep=self._spread)
        self._scratch = threading.local()  # per thread: where read_into drops what is not wanted

    @classmethod
    def from_url(cls, url: str) -> RedisTier:
        parts = urllib.parse.urlsplit(url)
        params = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
        options = redis_options(url, params)
        if not parts.hostname:
            raise L2Error(f"L2 URL {redact(url)!r}: redis tier needs a host (redis://HOST:PORT)")
        try:
            parts.port  # noqa: B018 - validates the port
        except ValueError as e:
            raise L2Error(f"L2 URL {redact(url)!r}: {e}") from None
        if parts.path not in ("", "/") and not parts.path.lstrip("/").isdigit():
            raise L2Error(f"L2 URL {redact(url)!r}: the database must be a number (/0, /1, ...)")
        bare = urllib.parse.urlunsplit(parts._replace(query=""))
        return cls(bare, **options)

    def ping(self) -> None:
        self._call("PING", lambda c: c.ping())

    def read(self, key: bytes) -> bytes | None:
        value = self._call("GET", lambda c: c.get(self._prefix + key))
        return None if value is None else bytes(value)

    def contains(self, key: bytes) -> bool:
        return bool(self._call("EXISTS", lambda c: c.exists(self._prefix + key)))

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []

        def run(c: Any) -> Any:
            pipe = c.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._prefix + key)
            return pipe.execute()

        return [bool(x) for x in self._call("EXISTS (pipelined)", run)]

    def write(self, key: bytes, data: bytes) -> None:
        self._call("SET", lambda c: c.set(self._prefix + key, data, ex=self._ttl_s))

    def delete(self, key: bytes) -> None:
        self._call("DEL", lambda c: c.delete(self._prefix + key))

    def read_many(self, keys: Sequence[bytes]) -> list[bytes | bytearray | None]:
        """The values of ``keys`` (bytearrays; None: absent): pipelined GETs spread over up to
        ``REDIS_SPREAD`` pooled connections at once, each value read off its socket into one
        buffer (``_ReplyReader``)."""
        if not keys:
            return []
        out: list[bytes | bytearray | None] = [None] * len(keys)

        def share(indexes: Sequence[int]) -> None:
            values = self._get_on_one_connection([keys[i] for i in indexes])
            for i, value in zip(indexes, values):
                out[i] = value

        self._spread_over_connections("GET (pipelined)", len(keys), share)
        return out

    def read_each(self, keys: Sequence[bytes], on_value: Callable[[int, memoryview | None], None],
                  limit: int | None = None) -> None:
        """GET ``keys`` as ``read_many`` does (pipelined, spread over connections), but hand each
        value to ``on_value(index, view)`` on its connection's thread as soon as it is read (None:
        absent). The view is into a receive buffer reused for the next value: valid only during
        the call. Checking and copying one value overlaps reading the others, and no value is
        allocated afresh. ``limit`` is not applied: Redis bounds a value itself
        (``proto-max-bulk-len``, 512 MB by default)."""
        if not keys:
            return

        def share(indexes: Sequence[int]) -> None:
            try:
                self._get_each_on_one_connection(keys, indexes, on_value)
            finally:
                self._buffers.give()

        self._spread_over_connections("GET (pipelined)", len(keys), share)

    def read_into(self, keys: Sequence[bytes], on_value: Callable[[int, ValueStream | None], None]) -> None:
        """GET ``keys`` as ``read_each`` does (pipelined, spread over connections), but hand each
        value over before it is read: ``on_value(index, stream)`` (None: absent) reads the value
        off the socket itself, wherever it belongs (an L1 slot), while it arrives. What the
        consumer leaves unread is read and dropped (through a small reused buffer) before the
        next reply; no value is ever held in a buffer of the tier. An exception from the
        consumer fails the read and drops its connection."""
        if not keys:
            return

        def share(indexes: Sequence[int]) -> None:
            self._get_into_on_one_connection(keys, indexes, on_value)

        self._spread_over_connections("GET (pipelined)", len(keys), share)

    def write_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """SET each item: pipelined, spread over up to ``REDIS_SPREAD`` pooled connections at once
        (redis-py sends a large value as its own buffer, uncopied)."""
        if not items:
            return

        def share(indexes: Sequence[int]) -> None:
            pipe = self._client.pipeline(transaction=False)
            for i in indexes:
                key, data = items[i]
                pipe.set(self._prefix + key, data, ex=self._ttl_s)
            pipe.execute()

        self._spread_over_connections("SET (pipelined)", len(items), share)

    def write_parts(self, items: Sequence[tuple[bytes, Callable[[], Sequence[bytes | memoryview]]]],
                    guard: Callable[[], AbstractContextManager[object]] | None = None) -> None:
        """SET each item as ``write_many`` does (pipelined, spread over connections), the value
        given as the buffers it is the concatenation of, made by a call on the connection's
        thread just before it is sent (so the values of one call are prepared in parallel, and
        sealing one overlaps sending another). The buffers are sent where they lie, never joined
        into a new one. A call that raises stops the pipeline and drops its connection: a value
        cut off mid-send is never stored (Redis discards an unfinished command). ``guard()``, when
        given, is entered around each send of a value's bytes (after waiting, outside it, until
        the socket takes more): a writer whose buffers may be taken back (an L1 slot at an
        effect's deadline) holds its lock there and raises to stop."""
        if not items:
            return

        def share(indexes: Sequence[int]) -> None:
            self._set_parts_on_one_connection(items, indexes, guard)

        self._spread_over_connections("SET (pipelined)", len(items), share)

    def _spread_over_connections(self, what: str, n: int, share: Any) -> None:
        """Run ``share(indexes)`` for ``n`` items dealt round-robin into at most ``_spread``
        shares, each on its own thread and connection (one share: on this thread); the first
        failure is raised as an ``L2Error``."""
        if self._closed:
            raise L2Error(f"redis tier {self.name}: tier is closed")
        k = min(n, self._spread)
        shares = [range(j, n, k) for j in range(k)]
        errors: list[BaseException | None]
        try:
            if k == 1:
                share(shares[0])
                return
            futures = [self._pool_executor().submit(share, s) for s in shares]
            errors = [f.exception() for f in futures]
        except Exception as exc:
            errors = [exc]
        for e in errors:
            if e is None:
                continue
            if isinstance(e, L2Error):
                raise e
            if isinstance(e, self._redis.exceptions.RedisError):
                raise translate_redis_error(self._redis, self.name, e, what) from e
            if isinstance(e, (OSError, ConnectionError)):
                raise L2Unavailable(f"redis tier {self.name}: unreachable ({what}): {e}") from e
            raise L2Error(f"redis tier {self.name}: {what} failed: {e}") from e

    def _pool_executor(self) -> Any:
        with self._executor_lock:
            if self._closed:
                raise L2Error(f"redis tier {self.name}: tier is closed")
            if self._executor is None:
                from concurrent.futures import ThreadPoolExecutor

                # shared by the L2 worker's threads: room for each of them to spread at once
                self._executor = ThreadPoolExecutor(max_workers=4 * self._spread,
                                                    thread_name_prefix="mpcache-l2-redis")
            return self._executor

    def _on_one_connection(self, work: Callable[[Any], tuple[_R, str | None]]) -> _R:
        """``work(conn)`` on one pooled connection: its result, or the ``ResponseError`` of the
        first error reply it met (the replies after it were read: the connection stays in step
        and is reused). A connection that failed mid-reply (``work`` raised) is dropped."""
        conn = self._pool.get_connection()
        try:
            result, error = work(conn)
        except BaseException:
            conn.disconnect()
            raise
        finally:
            self._pool.release(conn)
        if error is not None:
            raise self._redis.exceptions.ResponseError(error)
        return result

    def _get_on_one_connection(self, keys: Sequence[bytes]) -> list[bytearray | None]:
        """Pipelined GETs of ``keys`` on one pooled connection, replies read by ``_ReplyReader``."""
        def work(conn: Any) -> tuple[list[bytearray | None], str | None]:
            conn.send_packed_command([b"".join(_pack_command(b"GET", self._prefix + k) for k in keys)])
            reader = _ReplyReader(conn._sock)
            values: list[bytearray | None] = []
            error: str | None = None
            for _ in keys:
                try:
                    values.append(reader.bulk())
                except ValueError as e:  # an error reply: the others still follow on the socket
                    values.append(None)
                    error = _batch_error(error, e)
            return values, error
        return self._on_one_connection(work)

    def _get_each_on_one_connection(self, keys: Sequence[bytes], indexes: Sequence[int],
                                    on_value: Callable[[int, memoryview | None], None]) -> None:
        """``_get_on_one_connection`` for ``read_each``: each value to ``on_value`` as it is read."""
        def work(conn: Any) -> tuple[None, str | None]:
            conn.send_packed_command([b"".join(_pack_command(b"GET", self._prefix + keys[i]) for i in indexes)])
            reader = _ReplyReader(conn._sock)
            error: str | None = None
            for i in indexes:
                try:
                    value = reader.bulk_into(self._buffers)
                except ValueError as e:  # an error reply: the others still follow on the socket
                    value = None
                    error = _batch_error(error, e)
                try:
                    on_value(i, value)
                finally:
                    if value is not None:
                        value.release()
            return None, error
        self._on_one_connection(work)

    def _set_parts_on_one_connection(
            self, items: Sequence[tuple[bytes, Callable[[], Sequence[bytes | memoryview]]]], indexes: Sequence[int],
            guard: Callable[[], AbstractContextManager[object]] | None) -> None:
        def work(conn: Any) -> tuple[None, str | None]:
            sock = conn._sock
            expiry = b"" if self._ttl_s is None else b"$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(self._ttl_s)), self._ttl_s)
            for i in indexes:
                key, make = items[i]
                parts = [memoryview(p).cast("B") for p in make()]
                k = self._prefix + key
                size = sum(len(p) for p in parts)
                _send_all(sock, b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (5 if expiry else 3, len(k), k, size))
                for part in parts:
                    _send_all(sock, part, guard)
                    part.release()
                _send_all(sock, b"\r\n" + expiry)
            reader = _ReplyReader(sock)
            error: str | None = None
            for _ in indexes:
                line = reader._line()
                if line[:1] == b"-" and error is None:
                    error = line[1:].decode("utf-8", "replace")
            return None, error
        self._on_one_connection(work)

    def _get_into_on_one_connection(self, keys: Sequence[bytes], indexes: Sequence[int],
                                    on_value: Callable[[int, ValueStream | None], None]) -> None:
        """``_get_on_one_connection`` for ``read_into``: each value streamed to ``on_value``."""
        scratch: bytearray | None = getattr(self._scratch, "buf", None)
        if scratch is None:
            scratch = self._scratch.buf = bytearray(_DRAIN_BYTES)
        drain = scratch

        def work(conn: Any) -> tuple[None, str | None]:
            # At most READ_WINDOW GETs outstanding: Redis copies a value into its reply buffer
            # when it runs the GET, so a whole share sent at once would have it hold them all.
            conn.send_packed_command([b"".join(_pack_command(b"GET", self._prefix + keys[i])
                                               for i in indexes[:READ_WINDOW])])
            reader = _ReplyReader(conn._sock)
            crlf = memoryview(bytearray(2))
            error: str | None = None
            for j, i in enumerate(indexes):
                ahead = j - 1 + READ_WINDOW
                if j and ahead < len(indexes):  # the reply before is read: the next GET may run
                    _send_all(conn._sock, _pack_command(b"GET", self._prefix + keys[indexes[ahead]]))
                try:
                    n = reader.bulk_length()
                except ValueError as e:  # an error reply: the others still follow on the socket
                    n = None
                    error = _batch_error(error, e)
                if n is None:
                    on_value(i, None)
                    continue
                stream = ValueStream(reader, n)
                on_value(i, stream)
                stream.drain(drain)
                ValueStream(reader, 2).read_exact(crlf)  # the CRLF after the value
                if bytes(crlf) != b"\r\n":
                    raise ConnectionError("reply out of step (no CRLF after a value)")
            return None, error
        self._on_one_connection(work)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        self._pool.disconnect()

    def __repr__(self) -> str:
        return f"<RedisTier {self.name}>"

    def _call(self, what: str, fn: Any) -> Any:
        if self._closed:
            raise L2Error(f"redis tier {self.name}: tier is closed")
        try:
            return fn(self._client)
        except self._redis.exceptions.RedisError as e:
            raise translate_redis_error(self._redis, self.name, e, what) from e
