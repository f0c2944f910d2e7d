"""L2 work: probes (which objects L2 holds), reads (L2 -> L1 prefetch for a job) and
write-behind (L1 -> L2 after a store).

An event addresses one piece of L2 work by its id (``read_id``/``probe_id``/``write_id``, drawn
from one counter so they never collide); its state is ``L2State`` (ABSENT once it completed or
expired). ``L2_TABLE`` is what ``handle`` runs. A read's or probe's completion hands its job
the result (core_sm/server_jobs.py). Every effect's slots stay pinned until its completion
event, even after the server gave up on it at its lease TTL (the runtime may still be copying).
"""
from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.effects import Effect, ProbeL2, ReadL2, StoredChunk, WriteL2
from mpcache.core_sm.l1_index import ReleaseReason
from mpcache.core_sm.messages import L2ProbeFinished, L2ReadFinished, L2WriteFinished
from mpcache.core_sm.server_core import L2ReadOwner, L2WriteOwner, RequestKey, ServerContext
from mpcache.core_sm.table import Table
from mpcache.core_sm.timers import Timer

if TYPE_CHECKING:
    from mpcache.core_sm.server_instances import InstanceMachine
    from mpcache.core_sm.job_table import PrefetchJob
    from mpcache.core_sm.server_jobs import JobMachine


class L2State(enum.Enum):
    """State of one piece of L2 work."""

    ABSENT = "absent"  # never started, completed, or expired
    READING = "reading"  # ReadL2 emitted, L2ReadFinished awaited
    PROBING = "probing"  # ProbeL2 emitted, L2ProbeFinished awaited
    WRITING = "writing"  # WriteL2 emitted, L2WriteFinished awaited


@attrs.frozen
class L2ReadDeadline(Timer):
    read_id: int


@attrs.frozen
class L2ProbeDeadline(Timer):
    probe_id: int


@attrs.frozen
class L2WriteDeadline(Timer):
    write_id: int


@attrs.define
class L2Read:
    read_id: int
    request: RequestKey | None  # None once its job is gone (ended, timed out): loads still land
    job_serial: int
    chunk_of_item: tuple[int, ...]
    keys: tuple[ObjectKey, ...]


@attrs.define
class L2Probe:
    probe_id: int
    request: RequestKey
    job_serial: int
    keys: tuple[ObjectKey, ...]


def _work_id(ev: Any) -> Hashable:
    if isinstance(ev, (L2ReadFinished, L2ReadDeadline)):
        return ev.read_id
    if isinstance(ev, (L2ProbeFinished, L2ProbeDeadline)):
        return ev.probe_id
    write_id: Hashable = ev.write_id  # L2WriteFinished, L2WriteDeadline
    return write_id


class L2Work:
    """The server's outstanding L2 work (see the module docstring)."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.jobs: JobMachine  # set by LookupServer once both exist
        self.instances: InstanceMachine
        self.reads: dict[int, L2Read] = {}
        self.probes: dict[int, L2Probe] = {}
        self.writes: dict[int, tuple[ObjectKey, ...]] = {}
        # kv_events: per write, the world size and the chunks it holds (reported once written)
        self.write_chunks: dict[int, tuple[int, dict[bytes, StoredChunk]]] = {}
        self.dispatch = L2_TABLE.bind(self, _work_id, self.state, ctx.counters, ctx.reply_error)

    def state(self, work_id: Hashable) -> L2State:
        if work_id in self.reads:
            return L2State.READING
        if work_id in self.probes:
            return L2State.PROBING
        if work_id in self.writes:
            return L2State.WRITING
        return L2State.ABSENT

    def timer_live(self, timer: Timer) -> bool:
        return self.state(_work_id(timer)) is not L2State.ABSENT

    def is_reading(self, read_id: int | None) -> bool:
        return read_id is not None and read_id in self.reads

    def is_probing(self, probe_id: int | None) -> bool:
        return probe_id is not None and probe_id in self.probes

    def detach_read(self, read_id: int) -> None:
        """The read's job is gone: its loads still land, for no one."""
        read = self.reads.get(read_id)
        if read is not None:
            read.request = None

    # ============================================================================= starting work

    def _missing_keys(self, job: PrefetchJob, upto: int) -> list[tuple[int, ObjectKey]]:
        """(chunk, key) of the objects not readable in chunks [l1_prefix, upto), prefix order."""
        index, ranks = self.ctx.index, job.rank_range()
        return [(i, ObjectKey(job.hashes[i], r)) for i in range(job.l1_prefix, upto) for r in ranks
                if not index.is_readable(ObjectKey(job.hashes[i], r))]

    def start_probe(self, job: PrefetchJob, now: float, out: list[Effect]) -> bool:
        ctx = self.ctx
        keys = tuple(k for _i, k in self._missing_keys(job, len(job.hashes)))
        if not keys:
            return False
        probe = L2Probe(ctx.new_id(), job.key, job.pending().serial, keys)
        self.probes[probe.probe_id] = probe
        job.probe_id = probe.probe_id
        ctx.timers.push(now + ctx.config.lease_ttl, L2ProbeDeadline(probe.probe_id))
        ctx.counters["l2_probes"] += 1
        out.append(ProbeL2(probe.probe_id, keys))
        return True

    def start_read(self, job: PrefetchJob, upto: int, now: float, out: list[Effect]) -> bool:
        ctx = self.ctx
        read = self._plan_read(job, upto, now)
        if read is None:
            return False
        job.read_id = read.read_id
        self.reads[read.read_id] = read
        ctx.timers.push(now + ctx.config.lease_ttl, L2ReadDeadline(read.read_id))
        ctx.counters["l2_reads"] += 1
        slots = tuple(ctx.index.slot_of(k) for k in read.keys)
        assert all(slot is not None for slot in slots)
        ctx.pin(L2ReadOwner(read.read_id), [slot for slot in slots if slot is not None])
        object_bytes = self.instances.registered_object_bytes(job.model_name, job.world_size)
        out.append(ReadL2(read.read_id, tuple(zip(read.keys, slots)), object_bytes))
        return True

    def _plan_read(self, job: PrefetchJob, upto: int, now: float) -> L2Read | None:
        """Reserve slots for the objects missing after the L1 prefix, prefix order, stopping at
        an object another writer holds or when no slot is left."""
        ctx = self.ctx
        read_id = ctx.new_id()
        owner = L2ReadOwner(read_id)
        nbytes = self.instances.object_bytes_for(job.model_name, job.world_size)
        keys: list[ObjectKey] = []
        chunks: list[int] = []
        stop = False
        for i in range(job.l1_prefix, upto):
            for r in job.rank_range():
                k = ObjectKey(job.hashes[i], r)
                if ctx.index.is_readable(k):
                    continue
                if ctx.index.reserve_write(k, owner, nbytes, now) is None:
                    stop = True
                    break
                keys.append(k)
                chunks.append(i)
            if stop:
                break
        if not keys:
            return None
        return L2Read(read_id, job.key, job.pending().serial, tuple(chunks), tuple(keys))

    def write_behind(self, keys: Sequence[ObjectKey], object_bytes: int, now: float,
                     out: list[Effect], chunks: tuple[int, Sequence[StoredChunk]] | None = None) -> None:
        """Copy freshly stored objects to L2; they stay leased until the write finishes.
        ``chunks`` (kv_events): the world size and the chunks, reported held in L2 once written."""
        ctx = self.ctx
        wid = ctx.new_id()
        owner = L2WriteOwner(wid)
        items = ctx.index.lease_slots(keys, owner, now)
        if not items:
            return
        self.writes[wid] = tuple(k for k, _ in items)
        if chunks is not None and chunks[1]:
            self.write_chunks[wid] = (chunks[0], {c.chunk_hash: c for c in chunks[1]})
        ctx.timers.push(now + ctx.config.lease_ttl, L2WriteDeadline(wid))
        ctx.counters["l2_writes"] += 1
        ctx.pin(owner, [slot for _k, slot in items])
        out.append(WriteL2(wid, tuple(items), object_bytes))

    # ============================================================================= completions

    def _on_read_finished(self, ev: L2ReadFinished, now: float, out: list[Effect]) -> None:
        ctx = self.ctx
        read = self.reads.pop(ev.read_id)
        owner = L2ReadOwner(read.read_id)
        loaded = ev.loaded
        ctx.index.finish_writes([k for i, k in enumerate(read.keys) if i < len(loaded) and loaded[i]], owner, now)
        ctx.index.abort_writes([k for i, k in enumerate(read.keys) if not (i < len(loaded) and loaded[i])],
                               owner, now)
        ctx.unpin(owner)
        self.jobs.read_finished(read, now, out)

    def _on_stale_read(self, ev: L2ReadFinished, now: float, out: list[Effect]) -> None:
        self.ctx.counters["stale_events"] += 1
        self.ctx.unpin(L2ReadOwner(ev.read_id))  # expired: its slots leave quarantine now

    def _on_probe_finished(self, ev: L2ProbeFinished, now: float, out: list[Effect]) -> None:
        probe = self.probes.pop(ev.probe_id)
        present = {k for i, k in enumerate(probe.keys) if i < len(ev.present) and ev.present[i]}
        self.jobs.probe_finished(probe, present, now, out)

    def _on_stale(self, ev: L2ProbeFinished, now: float, out: list[Effect]) -> None:
        self.ctx.counters["stale_events"] += 1

    def _on_write_finished(self, ev: L2WriteFinished, now: float, out: list[Effect]) -> None:
        keys = self.writes.pop(ev.write_id)
        owner = L2WriteOwner(ev.write_id)
        self.ctx.index.release_owner(owner, ReleaseReason.L2_WRITE, now)  # it leased exactly its keys
        self.ctx.unpin(owner)
        reported = self.write_chunks.pop(ev.write_id, None)
        if self.ctx.held is not None and reported is not None and ev.ok:
            self.ctx.held.written_l2(keys, reported[1], reported[0], out)

    def _on_stale_write(self, ev: L2WriteFinished, now: float, out: list[Effect]) -> None:
        self.ctx.counters["stale_events"] += 1
        self.ctx.unpin(L2WriteOwner(ev.write_id))  # late (lease expired): the write is over now

    # ============================================================================= deadlines

    def _on_read_deadline(self, timer: L2ReadDeadline, now: float, out: list[Effect]) -> None:
        """Never answered within the lease TTL: its reservations are dropped (the index expired
        them already) and a job still waiting on it resolves with its L1 prefix."""
        read = self.reads.pop(timer.read_id)
        self.ctx.counters["l2_reads_expired"] += 1
        self.ctx.index.abort_writes(read.keys, L2ReadOwner(read.read_id), now)
        self.jobs.read_expired(read, now, out)

    def _on_probe_deadline(self, timer: L2ProbeDeadline, now: float, out: list[Effect]) -> None:
        probe = self.probes.pop(timer.probe_id)
        self.ctx.counters["l2_probes_expired"] += 1
        self.jobs.probe_expired(probe, now, out)

    def _on_write_deadline(self, timer: L2WriteDeadline, now: float, out: list[Effect]) -> None:
        self.ctx.counters["l2_writes_expired"] += 1
        owner = L2WriteOwner(timer.write_id)
        self.write_chunks.pop(timer.write_id, None)
        del self.writes[timer.write_id]
        self.ctx.index.release_owner(owner, ReleaseReason.L2_WRITE, now)  # it leased exactly its keys

    def check_invariants(self) -> None:
        for owner in self.ctx.index.leases_by_owner():
            if isinstance(owner, L2WriteOwner):
                assert owner.write_id in self.writes, "lease of a finished L2 write"


L = L2State
# (state of the L2 work the event names, event type) -> (handler, next states). A completion or
# deadline for work of another kind under that id is stale (not listed: counted).
L2_TABLE: Table[L2State] = Table("LookupServer L2 work (read, probe, write of an id)", L2State, L.ABSENT, {
    (L.READING, L2ReadFinished): (L2Work._on_read_finished, {L.ABSENT}),
    (L.ABSENT, L2ReadFinished): (L2Work._on_stale_read, {L.ABSENT}),
    (L.READING, L2ReadDeadline): (L2Work._on_read_deadline, {L.ABSENT}),
    (L.PROBING, L2ProbeFinished): (L2Work._on_probe_finished, {L.ABSENT}),
    (L.ABSENT, L2ProbeFinished): (L2Work._on_stale, {L.ABSENT}),
    (L.PROBING, L2ProbeDeadline): (L2Work._on_probe_deadline, {L.ABSENT}),
    (L.WRITING, L2WriteFinished): (L2Work._on_write_finished, {L.ABSENT}),
    (L.ABSENT, L2WriteFinished): (L2Work._on_stale_write, {L.ABSENT}),
    (L.WRITING, L2WriteDeadline): (L2Work._on_write_deadline, {L.ABSENT}),
})
L2_TIMERS = (L2ReadDeadline, L2ProbeDeadline, L2WriteDeadline)
