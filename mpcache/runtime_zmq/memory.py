"""Giving memory back after a burst of prefetch jobs.

A burst of lookups whose clients went away leaves up to ``max_jobs`` jobs until the reaper drops
them at the job TTL. What they held is freed then, but the allocators keep it: glibc keeps freed
chunks of its heaps (the job table's and reap queue's large buffers, the I/O threads' messages)
until the top of a heap is free, and pymalloc keeps a 1 MiB arena while one block in it is live.
``TrimAfterReap`` watches the live job count (once a second, from the loop's stats refresh) and,
once it fell to half of its high-water mark and by at least ``min_jobs``, calls glibc's
``malloc_trim(0)``, which hands every wholly free page of glibc's heaps back to the OS
(``mpcache-bench jobs`` measures how much: the "after malloc_trim" column). pymalloc's share
stays in its arenas for the next jobs (the "2nd flood" column: it is reused, not added to).

Steady traffic never trims: the high-water mark follows the live count, and after a trim it
starts again from there, so another trim needs the count to rise and fall by ``min_jobs`` again.
"""
from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable

log = logging.getLogger("mpcache.server")


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc (musl, macOS): nothing to trim this way
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class TrimAfterReap:
    """Calls ``trim`` (glibc's ``malloc_trim``) once most of a large set of jobs is gone."""

    def __init__(self, min_jobs: int = 5000, trim: Callable[[int], int] | None = None) -> None:
        self.min_jobs = min_jobs
        self._trim = trim if trim is not None else _glibc_malloc_trim()
        self._high = 0  # live jobs' high-water mark since the last trim
        self.trims = 0

    def update(self, jobs: int) -> bool:
        """The live job count now; True when it trimmed."""
        if jobs >= self._high:
            self._high = jobs
            return False
        if self._high - jobs < self.min_jobs or 2 * jobs > self._high:
            return False
        high, self._high = self._high, jobs
        if self._trim is None:
            return False
        t0 = time.perf_counter()
        self._trim(0)
        self.trims += 1
        log.info("prefetch jobs fell from %d to %d: free heap pages given back (malloc_trim, %.1f ms)",
                 high, jobs, (time.perf_counter() - t0) * 1e3)
        return True
