"""The prefetch jobs' records and the table that holds them (the state ``JobMachine`` in
core_sm/server_jobs.py works on).

``JobState``: the state of one request's job. ``PrefetchJob``: one request's lookup -- its hit
count once known, and while it is pending its ``JobWork`` (chunk hashes as one buffer, the L1
prefix it leased, its L2 read or probe). ``JobTable``: the live jobs, one dict per peer, every job
of a peer sharing one peer object (``canonical``), so an abandoned job costs a few references, not
its own copy of the peer or a key object. Memory per job: ``mpcache-bench jobs``.
"""
from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from mpcache.core_sm.messages import Peer
from mpcache.core_sm.server_core import RequestKey


class JobState(enum.Enum):
    """State of the prefetch job of one request (peer, request id)."""

    ABSENT = "absent"  # never seen, ended, reaped, or tombstone expired
    PENDING = "pending"  # an L2 read is outstanding
    DONE = "done"  # hit count known, not yet answered
    ANSWERED = "answered"  # answered at least once; the tombstone repeats the answer


@attrs.define(slots=True, weakref_slot=False, eq=False)
class JobWork:
    """What a job needs only until its hit count is known: its chunk hashes (one buffer, never
    the token ids), the L1 prefix it leased, its L2 read or probe."""

    serial: int
    model_name: str  # interned: live jobs share one string
    world_size: int
    hashes: Sequence[bytes]  # chunks.pack_hashes: one buffer, not a bytes object per chunk
    num_readers: int
    l1_prefix: int
    ranks: tuple[int, ...] | None  # the KV ranks this server holds (None: all)
    read_id: int | None = None
    probe_id: int | None = None
    l2_deadline: float | None = None
    freed_chunks: set[int] | None = None  # chunks FreeLookupLocks released (made on first use)
    # ``hashes`` as a tuple while L2 work walks them (made at the first ``PrefetchJob.hashes``,
    # dropped with the work): the L2 steps index them per chunk x rank, and a packed buffer's
    # Python-level indexing cost a loop of 65,536 objects tens of milliseconds.
    unpacked: tuple[bytes, ...] | None = None


@attrs.define(slots=True, weakref_slot=False, eq=False)
class PrefetchJob:
    """One request's lookup. While it is PENDING, ``work`` holds its hashes and L2 state; once its
    hit count is known ``work`` is dropped, so a job left to its TTL by a client that went away
    costs four references (and its entries in the job table and the reap queue), not its
    prompt: ``mpcache-bench jobs``. Its reap deadline is in the machine's ``ReapQueue``."""

    request_id: str
    peer: Peer
    hits: int | None = None
    work: JobWork | None = None

    @property
    def key(self) -> RequestKey:
        return RequestKey(self.peer, self.request_id)

    @property
    def state(self) -> JobState:
        return JobState.PENDING if self.hits is None else JobState.DONE

    @property
    def accepted(self) -> bool:
        """Acknowledged, its work not yet run (``ServerConfig.ack_first``): PENDING, no leases."""
        return self.hits is None and self.work is None

    def pending(self) -> JobWork:
        """The pending work (the job must be PENDING)."""
        work = self.work
        assert work is not None, "a done job has no pending work"
        return work

    # The pending work's fields, as the L2 machine (core_sm/server_l2.py) reads and sets them.
    @property
    def serial(self) -> int | None:
        return None if self.work is None else self.work.serial

    @property
    def hashes(self) -> Sequence[bytes]:
        work = self.pending()
        unpacked = work.unpacked
        if unpacked is None:
            hashes = work.hashes
            unpacked = work.unpacked = hashes if isinstance(hashes, tuple) else tuple(hashes)
        return unpacked

    @property
    def model_name(self) -> str:
        return self.pending().model_name

    @property
    def world_size(self) -> int:
        return self.pending().world_size

    @property
    def l1_prefix(self) -> int:
        return self.pending().l1_prefix

    @property
    def num_readers(self) -> int:
        return self.pending().num_readers

    @property
    def freed_chunks(self) -> set[int] | None:
        return None if self.work is None else self.work.freed_chunks

    @property
    def read_id(self) -> int | None:
        return None if self.work is None else self.work.read_id

    @read_id.setter
    def read_id(self, value: int | None) -> None:
        self.pending().read_id = value

    @property
    def probe_id(self) -> int | None:
        return None if self.work is None else self.work.probe_id

    @probe_id.setter
    def probe_id(self, value: int | None) -> None:
        self.pending().probe_id = value

    def rank_range(self) -> Sequence[int]:
        """The ranks whose objects make a chunk a hit (leased, read from L2)."""
        work = self.pending()
        return range(work.world_size) if work.ranks is None else work.ranks


class JobTable:
    """The live jobs: per peer, one dict of request id -> job (no key object per job), so a
    peer's job count is the size of its dict. Every job of a peer refers to one peer object
    (``canonical``): a runtime decodes the peer of each message afresh (its connection identity,
    a new ``bytes`` each time), and a job must not keep its own copy."""

    # What the server's ``state_values`` carries of this part, and the wiring it leaves out
    # (core_sm/values.py; tests/core_sm/test_state_values.py holds every attribute to one).
    STATE_FIELDS: tuple[str, ...] = ("by_peer", "_peers", "_count")
    WIRING_FIELDS: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.by_peer: dict[Peer, dict[str, PrefetchJob]] = {}
        self._peers: dict[Peer, Peer] = {}  # peer -> the object its jobs share (peers with jobs)
        self._count = 0

    def canonical(self, peer: Peer) -> Peer:
        """The peer object this peer's live jobs share (``peer`` itself when it has none)."""
        return self._peers.get(peer, peer)

    def __len__(self) -> int:
        return self._count

    def __contains__(self, key: RequestKey) -> bool:
        return self.get(key) is not None

    def get(self, key: RequestKey) -> PrefetchJob | None:
        jobs = self.by_peer.get(key[0])
        return None if jobs is None else jobs.get(key[1])

    def holds(self, job: PrefetchJob) -> bool:
        """Whether ``job`` is the live job of its request (not ended, reaped or replaced)."""
        jobs = self.by_peer.get(job.peer)
        return jobs is not None and jobs.get(job.request_id) is job

    def count_of(self, peer: Peer) -> int:
        jobs = self.by_peer.get(peer)
        return 0 if jobs is None else len(jobs)

    def __setitem__(self, key: RequestKey, job: PrefetchJob) -> None:
        assert job.peer == key[0] and job.request_id == key[1], "a job under another request's key"
        jobs = self.by_peer.get(key[0])
        if jobs is None:
            jobs = self.by_peer[key[0]] = {}
            self._peers[job.peer] = job.peer
        if key[1] not in jobs:
            self._count += 1
        jobs[key[1]] = job

    def pop(self, key: RequestKey, default: Any = None) -> Any:
        jobs = self.by_peer.get(key[0])
        job = None if jobs is None else jobs.pop(key[1], None)
        if job is None:
            return default
        self._count -= 1
        if not jobs:
            del self.by_peer[key[0]]
            del self._peers[key[0]]
        return job

    def __delitem__(self, key: RequestKey) -> None:
        if self.pop(key) is None:
            raise KeyError(key)

    def items(self) -> Iterator[tuple[RequestKey, PrefetchJob]]:
        for peer, jobs in self.by_peer.items():
            for rid, job in jobs.items():
                yield RequestKey(peer, rid), job

    def values(self) -> Iterator[PrefetchJob]:
        for jobs in self.by_peer.values():
            yield from jobs.values()

    def __iter__(self) -> Iterator[RequestKey]:
        for key, _job in self.items():
            yield key
