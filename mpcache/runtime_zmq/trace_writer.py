"""``mpcache-server --trace FILE``: record the server machine's event stream (mpcache.core_sm.trace).

One JSON line per ``LookupServer.handle`` call (``[now, event, effects]``) after a header line;
token ids are recorded as chunk hashes unless ``--trace-tokens`` (no prompt text by default).
Bounded: past ``max_bytes`` the file is renamed ``FILE.1`` (replacing an older one) and a new
``FILE`` starts with a header saying it begins mid-run, so at most about twice ``max_bytes`` is
on disk. Replay: ``mpcache-sim replay-trace FILE``. A write that fails turns tracing off with one
log line; serving goes on.

**The file is this server's own.** ``FILE`` is opened without following a symlink and must be a
regular file of the server's uid with no other link (a planted symlink or hard link would have
the server overwrite, and chmod, whatever it points at): anything else refuses the start with
one line (``TraceFileError``). It is made 0600 through the open descriptor.

**The id seed only once it is harmless.** The header's ``ServerConfig`` carries ``id_seed``,
which keys the server's transfer and registration ids: replay needs it to reproduce them, but
while the server runs it lets a reader of the trace predict the ids it is about to hand out.
So the header is written with ``id_seed`` 0 and room for the real one, which ``close()`` (the
server's stop) writes into the header of ``FILE`` and of the ``FILE.1`` this run rotated, once no
id it keys is in use. A trace of a server that was killed keeps 0: it replays with divergences
at the first registration.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import stat
from typing import IO, Any

import attrs

from mpcache.core_sm.trace import TraceCodec, header

log = logging.getLogger("mpcache.trace")

_SEED_FIELD = '"id_seed":0'
_SEED_ROOM = 40  # a 128-bit seed has at most 39 decimal digits


class TraceFileError(ValueError):
    """The trace path is not a file this server may write (a symlink, another uid's, linked)."""


def _open_private(path: str) -> int:
    """A descriptor for writing ``path`` from its start (module doc: no symlink, regular, ours,
    one link), made 0600."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise TraceFileError(f"--trace {path} is a symlink: refusing to write through it (give a path of its own)") from None
        raise TraceFileError(f"--trace {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TraceFileError(f"--trace {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise TraceFileError(f"--trace {path} belongs to uid {st.st_uid}, not this server's {os.geteuid()}")
        if st.st_nlink != 1:
            raise TraceFileError(f"--trace {path} has {st.st_nlink} links: refusing to overwrite a file linked elsewhere")
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


class TraceWriter:
    def __init__(self, path: str, machine: Any, *, keep_tokens: bool = False, max_bytes: int = 256 << 20) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._config = machine.config
        self._keep_tokens = keep_tokens
        chunk = machine.config.chunk_size

        def hashes_of(key: Any) -> tuple[bytes, ...]:
            found, _err = machine.ctx.hashes(key, key.end // chunk)
            return tuple(found)

        self._codec = TraceCodec(keep_tokens=keep_tokens, hashes_of=hashes_of)
        self._part = 0
        self._file: IO[str] | None = None
        self._written = 0
        self._seed_at = -1  # where the header's id_seed digits go in the open file
        self._rotated: tuple[int, int, int] | None = None  # FILE.1 of this run: (dev, inode, offset)
        self.records = 0
        self._open()

    def _open(self) -> None:
        fd = _open_private(self.path)
        self._file = os.fdopen(fd, "w", encoding="utf-8")
        head = header(attrs.evolve(self._config, id_seed=0), self._keep_tokens, self._part)
        line = json.dumps(head, separators=(",", ":"))
        at = line.find(_SEED_FIELD)
        if at >= 0:  # JSON allows the blanks the seed is written over at close
            at += len(_SEED_FIELD) - 1
            line = line[:at + 1] + " " * _SEED_ROOM + line[at + 1:]
        self._seed_at = at
        line += "\n"
        self._file.write(line)
        self._file.flush()  # the header is on disk as soon as the file exists
        self._written = len(line)

    def record(self, now: float, event: Any, effects: list[Any]) -> None:
        if self._file is None:
            return
        try:
            line = json.dumps([now, self._codec.encode(event), self._codec.encode(effects)], separators=(",", ":")) + "\n"
            self._file.write(line)
            self._written += len(line)
            self.records += 1
            if self._written >= self.max_bytes:
                st = os.fstat(self._file.fileno())
                self._file.close()
                os.replace(self.path, self.path + ".1")
                self._rotated = (st.st_dev, st.st_ino, self._seed_at)
                self._part += 1
                self._open()
        except Exception:  # tracing is a diagnostic: never let it stop the server
            log.exception("trace %s: writing failed; tracing is off", self.path)
            self._stop()

    def _stop(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            finally:
                self._file = None

    def close(self) -> None:
        """The server stopped: write the id seed into the headers (module doc), close the file."""
        seed = str(self._config.id_seed).ljust(_SEED_ROOM + 1).encode()
        if self._file is not None:
            try:
                self._file.flush()
                if self._seed_at >= 0:
                    os.pwrite(self._file.fileno(), seed, self._seed_at)
            except OSError as e:
                log.warning("trace %s: could not complete its header: %s", self.path, e)
            self._stop()
        if self._rotated is not None:
            dev, ino, at = self._rotated
            try:
                fd = os.open(self.path + ".1", os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                return  # gone or replaced by a link: nothing of ours to complete
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) == (dev, ino) and at >= 0:
                    os.pwrite(fd, seed, at)
            finally:
                os.close(fd)
