"""The L1 memory behind core_sm's slot ids: one shared-memory segment of fixed-size slots.

* The segment is a file in ``/dev/shm`` created with mode 0600 (only the server's user can map
  it) and a name that includes the server's pid and a random suffix: ``mpcache-<pid>-<8 hex>``.
  The server holds a shared ``flock`` on it for its whole life.
* ``reserve=True`` (the server's default, ``--l1-reserve``): its pages are reserved when it is
  created (``posix_fallocate``; the server creates it at start-up), so a tmpfs without room fails
  that call with a clear error at start instead of a SIGBUS on the first write to a page the
  filesystem cannot back (tmpfs reports ENOSPC on a page fault as SIGBUS, in the server or in an
  engine that maps the segment). The memory is committed then (about 0.1 s per 256 MiB; the
  kernel zero-fills it). The server does that on a thread (``reserve_in_background``) while its
  loop already answers; a use of the segment meanwhile waits for the reservation to end.
  ``reserve=False`` (``--no-l1-reserve``): created sparse (``ftruncate``) on first use and
  committed page by page, a fast start for a huge L1 at the price of that SIGBUS risk if the
  filesystem fills up later.
* ``sweep_orphans`` (run when a pool is made) removes segments of mpcache servers that are gone:
  the pid in the name is not a live process **and** an exclusive ``flock`` on the file succeeds
  (no server holds it), the file is a regular file of this uid. ``kill -9`` leaves no lasting
  litter: the next server on the host removes it.
* Slot ``s`` occupies bytes ``[s * slot_bytes, (s + 1) * slot_bytes)``. Slot ids and their
  lifetime come from core_sm; this module only turns an id into memory.
* Engine-driven clients (CPU engines) map the same file by path (``map_segment``) and copy into /
  out of the slots a ``TransferPlan`` names.
* tmpfs reports ENOSPC as SIGBUS on first touch, and its pages are RAM (charged to the memory
  cgroup that touches them), so a pool larger than the filesystem's free space, the host's
  ``MemAvailable`` or the cgroup's ``memory.max`` (each but the first less a margin) is refused
  before anything is reserved (``L1TooLarge``), or clamped to it when asked (``clamp``).
* On a GPU host the kernels' transfer engine registers ``address``/``size`` with CUDA.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import threading
from collections.abc import Callable, Sequence
from typing import Final

log = logging.getLogger("mpcache.l1")

SHM_DIR: Final = "/dev/shm"
_SEGMENT_NAME: Final = re.compile(r"^(?P<prefix>[A-Za-z0-9_.]+)-(?P<pid>[0-9]+)-[0-9a-f]{8}$")


class ReservationError(OSError):
    """The L1 segment's memory could not be reserved (the filesystem has no room for it)."""


class L1TooLarge(ValueError):
    """The L1 asked for is more than the host (or the pod's cgroup) can give: refused before
    anything is reserved, unless the clamp was asked for (``--l1-clamp``)."""


# Memory L1 must leave to everything else (the server's own heap, the engine beside it): the larger
# of this and 5% of what the limit counts.
L1_MARGIN_BYTES: Final = 512 << 20
GiB_F: Final = float(1 << 30)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except (OSError, ValueError):
        return None


def _meminfo(text: str | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


def _cgroup_room(root: str, self_cgroup: str | None) -> tuple[int, int] | None:
    """(limit, usage) of this process's memory cgroup (v2 ``memory.max``/``memory.current``, or v1
    ``memory.limit_in_bytes``/``memory.usage_in_bytes``); None when it sets no limit. Shared
    memory (tmpfs pages) is charged to the cgroup that touches it: L1 counts against the pod."""
    for line in (self_cgroup or "").splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":  # v2: memory.max on the path and its ancestors
            here = path.strip().strip("/")
            parts = here.split("/") if here else []
            best: tuple[int, int] | None = None
            for i in range(len(parts), -1, -1):
                d = os.path.join(root, *parts[:i])
                limit, usage = _read(os.path.join(d, "memory.max")), _read(os.path.join(d, "memory.current"))
                if limit is None or usage is None or limit.strip() == "max":
                    continue
                room = (int(limit), int(usage))
                if best is None or room[0] - room[1] < best[0] - best[1]:
                    best = room
            return best
        if "memory" in controllers.split(","):  # v1
            for d in (os.path.join(root, "memory", path.strip().strip("/")), os.path.join(root, "memory")):
                limit, usage = _read(os.path.join(d, "memory.limit_in_bytes")), _read(os.path.join(d, "memory.usage_in_bytes"))
                if limit is not None and usage is not None and int(limit) < 1 << 60:
                    return int(limit), int(usage)
    return None


def memory_room(directory: str, *, meminfo: str | None = None, cgroup_root: str = "/sys/fs/cgroup",
                self_cgroup: str | None = None) -> list[tuple[str, int]]:
    """What each limit leaves for L1, in bytes: the free space of ``directory`` (tmpfs pages are
    RAM), the host's ``MemAvailable`` and the memory cgroup's ``memory.max`` less its usage, each
    of the last two less a margin. The arguments other than ``directory`` are for tests."""
    room: list[tuple[str, int]] = []
    try:
        st = os.statvfs(directory)
        room.append((f"{directory} has {st.f_bavail * st.f_frsize / GiB_F:.1f} GiB free", st.f_bavail * st.f_frsize))
    except OSError:
        pass
    info = _meminfo(_read("/proc/meminfo") if meminfo is None else meminfo)
    if "MemAvailable" in info:
        avail = info["MemAvailable"]
        margin = max(L1_MARGIN_BYTES, info.get("MemTotal", avail) // 20)
        room.append((f"the host has {avail / GiB_F:.1f} GiB available (MemAvailable) and keeps "
                     f"{margin / GiB_F:.1f} GiB for the rest", avail - margin))
    cg = _cgroup_room(cgroup_root, _read("/proc/self/cgroup") if self_cgroup is None else self_cgroup)
    if cg is not None:
        limit, usage = cg
        margin = max(L1_MARGIN_BYTES, limit // 20)
        room.append((f"the memory cgroup allows {limit / GiB_F:.1f} GiB (uses {usage / GiB_F:.1f}) and keeps "
                     f"{margin / GiB_F:.1f} GiB for the rest", limit - usage - margin))
    return room



def fit_l1(size_bytes: int, directory: str, *, clamp: bool, room: list[tuple[str, int]] | None = None) -> int:
    """The L1 size to use: ``size_bytes`` when every limit of ``memory_room`` leaves room for it;
    else ``L1TooLarge`` naming the tightest one, or, with ``clamp``, that limit's room (logged)."""
    limits = memory_room(directory) if room is None else room
    if not limits:
        return size_bytes
    why, fits = min(limits, key=lambda r: r[1])
    if size_bytes <= fits:
        return size_bytes
    if not clamp:
        raise L1TooLarge(f"L1 of {size_bytes / GiB_F:.1f} GiB does not fit: {why}, so at most "
                         f"{max(0, fits) / GiB_F:.1f} GiB; lower --l1-size-gb, or --l1-clamp to use what there is")
    log.warning("L1: %.1f GiB asked, %s: using %.1f GiB (--l1-clamp)", size_bytes / GiB_F, why, max(0, fits) / GiB_F)
    return max(0, fits)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def sweep_orphans(directory: str = SHM_DIR, prefix: str = "mpcache") -> list[str]:
    """Remove ``prefix-<pid>-<hex>`` segments in ``directory`` left by servers that are gone.
    A file is removed only when its pid is not a live process, it is a regular file owned by
    this uid, and no process holds a lock on it (a live server holds one). Returns the paths
    removed."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    me = os.geteuid()
    for name in names:
        mt = _SEGMENT_NAME.match(name)
        if mt is None or mt.group("prefix") != prefix:
            continue
        pid = int(mt.group("pid"))
        if pid == os.getpid() or _pid_alive(pid):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != me:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue  # held: a live server
                raise
            # still the file we locked (not replaced by a new one under the same name)?
            try:
                now = os.lstat(path)
            except FileNotFoundError:
                continue
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                continue
            os.unlink(path)
            removed.append(path)
        except OSError as e:
            log.warning("L1: could not check the old segment %s: %s", path, e)
        finally:
            os.close(fd)
    if removed:
        log.warning("L1: removed %d segment(s) of mpcache servers that are gone: %s", len(removed), ", ".join(removed))
    return removed


class SharedMemoryPool:
    """``num_slots`` slots of ``slot_bytes`` in one shared-memory file. Not thread-safe for
    concurrent writes to the same slot (core_sm's leases guarantee there are none)."""

    def __init__(self, size_bytes: int, slot_bytes: int, *, directory: str = SHM_DIR, prefix: str = "mpcache",
                 reserve: bool = True, clamp: bool = False, slots_follow_objects: bool = False) -> None:
        if slot_bytes <= 0:
            raise ValueError("slot_bytes must be > 0")
        # Keep slots page-aligned so a slot never shares a page with its neighbour.
        page = mmap.PAGESIZE
        self.slot_bytes = (slot_bytes + page - 1) // page * page
        # never more than the host, the cgroup and the filesystem can give (L1TooLarge, else clamped)
        fitted = fit_l1(size_bytes, directory, clamp=clamp)
        wanted = max(0, fitted // self.slot_bytes)
        self.reserve = reserve
        self.num_slots = int(wanted)
        # slots that follow the objects (core_sm.l1_slots): the segment is all of L1's bytes (whole
        # pages), cut again by ``recarve``; fixed slots: exactly num_slots of them
        self.size = max(0, fitted) // page * page if slots_follow_objects else self.num_slots * self.slot_bytes
        sweep_orphans(directory, prefix)
        self.path = os.path.join(directory, f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}")
        self._mm: mmap.mmap | None = None
        self._fd = -1
        self._create_lock = threading.Lock()  # one creation, even with a reservation thread

    # Created on first use (or by reserve_in_background): the start-up path never waits for it.
    def _open(self) -> mmap.mmap:
        mm = self._mm
        if mm is not None:
            return mm
        with self._create_lock:
            return self._create()

    def _new_file(self) -> int:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # "a server owns this": sweep_orphans keeps it
            os.fchmod(fd, 0o600)  # umask cannot widen it, but be explicit
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        return fd

    def _create(self) -> mmap.mmap:
        if self._mm is None:
            fd = self._fd if self._fd >= 0 else self._new_file()  # reserve_in_background made it
            self._fd = -1
            try:
                nbytes = max(self.size, mmap.PAGESIZE)
                try:
                    if self.reserve:
                        os.posix_fallocate(fd, 0, nbytes)
                    else:
                        os.ftruncate(fd, nbytes)
                except OSError as e:
                    if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                        raise
                    raise ReservationError(
                        e.errno,
                        f"L1: cannot reserve {nbytes} bytes in {os.path.dirname(self.path)} ({e.strerror}); "
                        "lower --l1-size-gb or free space there",
                    ) from None
                self._mm = mmap.mmap(fd, max(self.size, mmap.PAGESIZE), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                os.close(fd)
                os.unlink(self.path)
                raise
            self._fd = fd
            log.info("L1: created %s (%d slots x %d bytes)", self.path, self.num_slots, self.slot_bytes)
        return self._mm

    def ensure(self) -> str:
        """Create the segment if needed; return its path (for clients that map it)."""
        self._open()
        return self.path

    def reserve_in_background(self, on_error: Callable[[BaseException], None]) -> threading.Thread:
        """Create (and reserve) the segment on a thread, returned started; the caller joins it
        before ``close``. ``posix_fallocate`` releases the GIL, so the caller's loop runs
        meanwhile; any use of the segment waits for the creation to end. A failure (e.g.
        ``ReservationError``) is handed to ``on_error``, on that thread."""

        with self._create_lock:
            if self._mm is None and self._fd < 0:
                self._fd = self._new_file()  # the file exists (and is owned) from now on

        def reserve() -> None:
            try:
                self._open()
            except BaseException as e:
                on_error(e)

        thread = threading.Thread(target=reserve, name="mpcache-l1-reserve", daemon=True)
        thread.start()
        return thread

    def recarve(self, slot_bytes: int, num_slots: int) -> None:
        """core_sm cut L1 into ``num_slots`` slots of ``slot_bytes`` (``CarveL1``; it holds
        nothing then): slot ``s`` is at ``s * slot_bytes`` from now on. The segment stays."""
        if slot_bytes <= 0 or slot_bytes % mmap.PAGESIZE or num_slots < 0 or num_slots * slot_bytes > self.size:
            raise ValueError(f"{num_slots} slots of {slot_bytes} B do not cut a {self.size}-byte L1")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        log.info("L1: %d slots x %d bytes (the objects registered)", num_slots, slot_bytes)

    @property
    def created(self) -> bool:
        return self._mm is not None

    def offset(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        return slot * self.slot_bytes

    def view(self, slot: int, nbytes: int | None = None) -> memoryview:
        """A writable view of slot ``slot`` (its first ``nbytes`` bytes)."""
        mm = self._open()
        off = self.offset(slot)
        n = self.slot_bytes if nbytes is None else nbytes
        if not 0 <= n <= self.slot_bytes:
            raise ValueError(f"{n} bytes do not fit a slot of {self.slot_bytes}")
        return memoryview(mm)[off : off + n]

    def write(self, slot: int, data: bytes | memoryview) -> None:
        self.view(slot, len(data))[:] = data

    def read(self, slot: int, nbytes: int) -> bytes:
        return bytes(self.view(slot, nbytes))

    def copy_in(self, slot: int, data: memoryview) -> None:
        """Copy ``data`` (a writable, contiguous buffer, e.g. a view of a bytearray) into slot
        ``slot`` with ``memmove``, the GIL released: other threads (sockets, MAC checks) run
        while a large object is copied, where ``write`` holds the GIL for the whole copy."""
        n = len(data)
        if n == 0:
            return
        dst = self.view(slot, n)  # checks the slot and the size
        dst.release()
        src = (ctypes.c_char * n).from_buffer(data)
        ctypes.memmove(self.address + self.offset(slot), src, n)

    def zero(self, slots: Sequence[int], nbytes: int) -> None:
        """Zero the first ``nbytes`` of each slot (memset, the GIL released: about 3 GB/s on a
        shared 2-core box, 2.5-10 ms for a 32 MiB slot)."""
        if not 0 <= nbytes <= self.slot_bytes:
            raise ValueError(f"{nbytes} bytes do not fit a slot of {self.slot_bytes}")
        base = self.address
        for slot in slots:
            ctypes.memset(base + self.offset(slot), 0, nbytes)

    @property
    def address(self) -> int:
        """Host address of the segment's first byte (for CUDA host registration)."""
        mm = self._open()
        return ctypes.addressof(ctypes.c_char.from_buffer(mm))

    def unlink(self) -> None:
        """Remove the segment's name now (a forced exit); mappings stay valid until unmapped."""
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def close(self) -> None:
        """Unmap and unlink. Views still held elsewhere keep the mapping alive until released."""
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                log.warning("L1: segment still has exported views at close; leaving it mapped")
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class MappedSegment:
    """A client's mapping of the server's L1 segment (engine-driven copies)."""

    def __init__(self, path: str, slot_bytes: int, num_slots: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.path = path
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots

    def view(self, slot: int, nbytes: int | None = None) -> memoryview:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        n = self.slot_bytes if nbytes is None else nbytes
        off = slot * self.slot_bytes
        return memoryview(self._mm)[off : off + n]

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:
            pass
