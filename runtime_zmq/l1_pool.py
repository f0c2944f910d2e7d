"""The L1 memory behind core_sm's slot ids: one shared-memory segment of fixed-size slots.

* The segment is a file in ``/dev/shm`` created with mode 0600 (only the server's user can map
  it) and a name that includes the server's pid and a random suffix. It is created sparse
  (``ftruncate``), so memory is committed page by page as slots are first written: a server with a
  large ``--l1-size-gb`` starts in milliseconds and costs nothing until it caches something.
* Slot ``s`` occupies bytes ``[s * slot_bytes, (s + 1) * slot_bytes)``. Slot ids and their
  lifetime come from core_sm; this module only turns an id into memory.
* Engine-driven clients (CPU engines) map the same file by path (``map_segment``) and copy into /
  out of the slots a ``TransferPlan`` names.
* tmpfs reports ENOSPC as SIGBUS on first touch, so the pool never promises more than the
  filesystem has free at creation (the slot count is clamped, with a warning).
* On a GPU host the kernels' transfer engine registers ``address``/``size`` with CUDA.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import secrets
from typing import Final

log = logging.getLogger("mpcache.l1")

SHM_DIR: Final = "/dev/shm"


class SharedMemoryPool:
    """``num_slots`` slots of ``slot_bytes`` in one shared-memory file. Not thread-safe for
    concurrent writes to the same slot (core_sm's leases guarantee there are none)."""

    def __init__(self, size_bytes: int, slot_bytes: int, *, directory: str = SHM_DIR, prefix: str = "mpcache") -> None:
        if slot_bytes <= 0:
            raise ValueError("slot_bytes must be > 0")
        # Keep slots page-aligned so a slot never shares a page with its neighbour.
        page = mmap.PAGESIZE
        self.slot_bytes = (slot_bytes + page - 1) // page * page
        wanted = max(0, size_bytes // self.slot_bytes)
        try:
            st = os.statvfs(directory)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = wanted * self.slot_bytes
        if wanted * self.slot_bytes > free:
            clamped = free // self.slot_bytes
            log.warning(
                "L1: %d slots of %d bytes requested but %s has %d bytes free; using %d slots",
                wanted, self.slot_bytes, directory, free, clamped,
            )
            wanted = clamped
        self.num_slots = int(wanted)
        self.size = self.num_slots * self.slot_bytes
        self.path = os.path.join(directory, f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}")
        self._mm: mmap.mmap | None = None
        self._fd = -1

    # Created on first use: the server's start-up path never touches the segment.
    def _open(self) -> mmap.mmap:
        if self._mm is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.fchmod(fd, 0o600)  # umask cannot widen it, but be explicit
                os.ftruncate(fd, max(self.size, mmap.PAGESIZE))
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
