"""L2 work: probes (which objects L2 holds), reads (L2 -> L1 prefetch for a job) and
write-behind (L1 -> L2 after a store).

An event addresses one piece of L2 work by its id (``read_id``/``probe_id``/``write_id``, drawn
from one counter so they never collide); its state is ``L2State`` (ABSENT once it completed or
expired). ``L2_TABLE`` is what ``handle`` runs. A read's or probe's completion hands its job
the result (core_sm/server_jobs.py). Every effect's slots stay pinned until its completion
event, even after the server gave up on it at its lease TTL (the runtime may still be copying);
a read's slots are pinned as its walk reserves them and unpinned as they land.

A job's L2 step is an ``L2Walk`` over its chunks, ``L2_SLICE_OBJECTS`` objects a loop turn
(server_jobs runs the slices): what to probe (``walk_probe``), what to read (``walk_read``, then
``emit_read``), a finished read landing (``land``).
"""
from __future__ import annotations

import enum
import itertools
import operator
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.effects import Effect, ProbeL2, ReadL2, StoredChunk, WriteL2
from mpcache.core_sm.l1_index import ReleaseReason
from mpcache.core_sm.messages import L2ProbeFinished, L2ReadFinished, L2WriteFinished
from mpcache.core_sm.server_core import L2ReadOwner, L2WriteOwner, RequestKey, ServerContext
from mpcache.core_sm.table import Table
from mpcache.core_sm.timers import Timer

from mpcache.core_sm.server_instances import InstanceMachine

if TYPE_CHECKING:
    from mpcache.core_sm.job_table import PrefetchJob


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


# Objects one loop turn walks for a job's L2 step (probe, read, landing).
L2_SLICE_OBJECTS = 1024


class WalkKind(enum.Enum):
    PROBE = "probe"  # gathering the keys to probe
    READ = "read"  # reserving the slots to read into
    LANDED = "landed"  # a finished read's objects landing, its job's extension being leased


@attrs.define(eq=False)
class L2Walk:
    """A job's L2 step walked a slice per loop turn (``JobMachine.continuing``): its chunks
    from ``chunk`` on, what it gathered (``keys``, ``chunks``), a READ's id and probe answer
    (``probe_keys``, ``present``, ``cursor`` into them), a LANDED walk's read (``present``: its
    loaded flags, ``cursor``: the items landed) and hits so far."""

    kind: WalkKind
    job: PrefetchJob | None  # None: a LANDED read whose job is gone
    serial: int
    now: float
    chunk: int
    model_name: str = ""
    world_size: int = 0
    keys: list[ObjectKey] = attrs.Factory(list)
    chunks: list[int] = attrs.Factory(list)
    items: list[tuple[ObjectKey, int]] = attrs.Factory(list)  # READ: (key, slot) reserved
    read_id: int = 0
    probe_keys: tuple[ObjectKey, ...] = ()
    present: Sequence[bool] = ()
    cursor: int = 0
    read: L2Read | None = None
    hits: int = 0
    leasing: bool = True  # LANDED: the job still takes the extension's leases


def _work_id(ev: Any) -> Hashable:
    if isinstance(ev, (L2ReadFinished, L2ReadDeadline)):
        return ev.read_id
    if isinstance(ev, (L2ProbeFinished, L2ProbeDeadline)):
        return ev.probe_id
    write_id: Hashable = ev.write_id  # L2WriteFinished, L2WriteDeadline
    return write_id


class JobsOfL2(Protocol):
    """What L2 work hands its results to: the jobs whose reads and probes it runs
    (``server_jobs.JobMachine``; LookupServer wires it in once both exist)."""

    def read_finished(self, read: L2Read, loaded: tuple[bool, ...], now: float, out: list[Effect]) -> None: ...

    def read_expired(self, read: L2Read, now: float, out: list[Effect]) -> None: ...

    def probe_finished(self, probe: L2Probe, present: tuple[bool, ...], now: float, out: list[Effect]) -> None: ...

    def probe_expired(self, probe: L2Probe, now: float, out: list[Effect]) -> None: ...


class L2Work:
    """The server's outstanding L2 work (see the module docstring)."""

    # What the server's ``state_values`` carries of this part, and the wiring it leaves out
    # (core_sm/values.py; tests/core_sm/test_state_values.py holds every attribute to one).
    STATE_FIELDS: tuple[str, ...] = ("reads", "probes", "writes", "write_chunks")
    WIRING_FIELDS: tuple[str, ...] = ("ctx", "instances", "dispatch", "jobs")

    def __init__(self, ctx: ServerContext, instances: InstanceMachine) -> None:
        self.ctx = ctx
        self.jobs: JobsOfL2  # set by LookupServer once both exist
        self.instances = instances
        self.reads: dict[int, L2Read] = {}
        self.probes: dict[int, L2Probe] = {}
        self.writes: dict[int, tuple[ObjectKey, ...]] = {}
        # kv_events: per write, the world size and the chunks it holds (reported once written)
        self.write_chunks: dict[int, tuple[int, dict[bytes, StoredChunk]]] = {}
        self.dispatch = L2_TABLE.bind(self, _work_id, self.state, ctx.counters, ctx.reply_error, self._set_state)

    def state(self, work_id: Hashable) -> L2State:
        if work_id in self.reads:
            return L2State.READING
        if work_id in self.probes:
            return L2State.PROBING
        if work_id in self.writes:
            return L2State.WRITING
        return L2State.ABSENT

    def _set_state(self, work_id: Hashable, state: L2State) -> None:
        """L2_TABLE's assignment. Every row ends its work (``ABSENT``): the read, probe or write
        of ``work_id`` is forgotten, with the chunks a write was to report. Work starts outside
        the table (``walk_probe``, ``emit_read``, ``write_behind`` file it)."""
        assert state is L2State.ABSENT, state
        if isinstance(work_id, int):
            self.reads.pop(work_id, None)
            self.probes.pop(work_id, None)
            self.writes.pop(work_id, None)
            self.write_chunks.pop(work_id, None)

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

    def per_turn(self, job: PrefetchJob) -> int:
        """Chunks one slice of ``job``'s L2 walk covers: ``L2_SLICE_OBJECTS`` objects."""
        return max(1, L2_SLICE_OBJECTS // max(1, len(job.rank_range())))

    def begin(self, kind: WalkKind, job: PrefetchJob, now: float, probe: L2Probe | None = None,
              present: Sequence[bool] = ()) -> L2Walk:
        """A walk of ``job``'s chunks after its L1 prefix: what to probe (PROBE), what to read
        (READ; after a probe, ``probe`` and its answer ``present``)."""
        work = job.pending()
        walk = L2Walk(kind, job, work.serial, now, work.l1_prefix, work.model_name, work.world_size)
        if kind is WalkKind.READ:
            walk.read_id = self.ctx.new_id()
            if probe is not None:
                walk.probe_keys, walk.present = probe.keys, present
        return walk

    def walk_probe(self, walk: L2Walk, out: list[Effect]) -> bool | None:
        """One slice of a PROBE walk: gather the keys not readable. At its end, emit the probe:
        returns whether it started one (None: the walk goes on)."""
        job = walk.job
        assert job is not None
        hashes = job.hashes
        stop = min(len(hashes), walk.chunk + self.per_turn(job))
        walk.keys += self.ctx.index.unreadable(hashes[walk.chunk:stop], job.rank_range())
        walk.chunk = stop
        if stop < len(hashes):
            return None
        if not walk.keys:
            return False
        ctx = self.ctx
        keys = tuple(walk.keys)
        probe = L2Probe(ctx.new_id(), job.key, walk.serial, keys)
        self.probes[probe.probe_id] = probe
        job.probe_id = probe.probe_id
        ctx.timers.push(walk.now + ctx.config.lease_ttl, L2ProbeDeadline(probe.probe_id))
        ctx.counters["l2_probes"] += 1
        out.append(ProbeL2(probe.probe_id, keys))
        return True

    def walk_read(self, walk: L2Walk) -> bool:
        """One slice of a READ walk: reserve slots for the objects missing after the L1 prefix,
        prefix order, stopping at a chunk the probe did not find whole (after a probe), at an
        object another writer holds, or when no slot is left. Returns whether the walk is over
        (then ``emit_read``). Its slots are pinned as they are reserved."""
        ctx = self.ctx
        job = walk.job
        assert job is not None
        hashes, ranks = job.hashes, job.rank_range()
        index = ctx.index
        start = walk.chunk
        stop = min(len(hashes), start + self.per_turn(job))
        probed = walk.probe_keys
        present: set[ObjectKey] | None = None
        if probed:  # the probe's keys of this slice's chunks: the next ones, in the same order
            wanted = set(hashes[walk.chunk:stop])
            first = end = walk.cursor
            while end < len(probed) and probed[end].chunk_hash in wanted:
                end += 1
            walk.cursor = end
            present = set(itertools.compress(probed[first:end], walk.present[first:end]))
        over = stop >= len(hashes)
        keys = index.unreadable(hashes[start:stop], ranks)
        if present is not None and keys:
            found = list(map(present.__contains__, keys))
            if False in found:  # the read ends before the first chunk the probe did not find whole
                cut = found.index(False)
                h = keys[cut].chunk_hash
                while cut > 0 and keys[cut - 1].chunk_hash == h:
                    cut -= 1
                del keys[cut:]
                over = True
        walk.chunk = stop
        if not keys:
            return over
        owner = L2ReadOwner(walk.read_id)
        nbytes = self.instances.object_bytes_for(job.model_name, job.world_size)
        slots = index.reserve_writes(keys, owner, nbytes, walk.now)
        if None in slots:  # stop at the first refused: what was reserved past it goes again
            cut = slots.index(None)
            index.abort_writes(keys[cut + 1:], owner, walk.now)
            del keys[cut:], slots[cut:]
            over = True
        reserved: list[int] = slots  # type: ignore[assignment]  # no None left
        index.pin_slots(reserved)
        ctx.pins[owner] = ctx.pins.get(owner, ()) + tuple(reserved)
        chunk_of = {h: i for i, h in enumerate(hashes[start:stop], start)}
        walk.chunks += map(chunk_of.__getitem__, map(operator.itemgetter(0), keys))
        walk.keys += keys
        walk.items += zip(keys, reserved)  # the effect's items, made a slice at a time
        return over

    def emit_read(self, walk: L2Walk, live: bool, out: list[Effect]) -> bool:
        """The READ walk is over (or its job went, ``live`` False: its loads land for no one):
        start the read of what it reserved. Returns whether there was anything to read."""
        if not walk.keys:
            return False
        ctx = self.ctx
        job = walk.job
        assert job is not None
        read = L2Read(walk.read_id, job.key if live else None, walk.serial, tuple(walk.chunks), tuple(walk.keys))
        if live:
            job.read_id = read.read_id
        self.reads[read.read_id] = read
        ctx.timers.push(walk.now + ctx.config.lease_ttl, L2ReadDeadline(read.read_id))
        ctx.counters["l2_reads"] += 1
        object_bytes = self.instances.registered_object_bytes(walk.model_name, walk.world_size)
        out.append(ReadL2(read.read_id, tuple(walk.items), object_bytes))
        walk.keys, walk.chunks, walk.items = [], [], []
        return True

    def land(self, walk: L2Walk) -> int:
        """One slice of a LANDED walk: finish the loaded objects of the next ``L2_SLICE_OBJECTS``
        items of the read (abort the others) and unpin their slots. Returns the first chunk not
        landed yet (past the last chunk once every item landed)."""
        read = walk.read
        assert read is not None
        ctx = self.ctx
        owner = L2ReadOwner(read.read_id)
        first, n = walk.cursor, len(read.keys)
        end = min(n, first + L2_SLICE_OBJECTS)
        if end > first:
            keys, loaded = read.keys[first:end], walk.present[first:end]
            ctx.index.finish_writes(itertools.compress(keys, loaded), owner, walk.now)
            if not all(loaded):
                ctx.index.abort_writes([k for k, ok in zip(keys, loaded) if not ok], owner, walk.now)
            pinned = ctx.pins.get(owner)
            if pinned is not None:  # a late duplicate of the completion may have unpinned them
                ctx.index.unpin_slots(pinned[:end - first])
                if len(pinned) > end - first:
                    ctx.pins[owner] = pinned[end - first:]
                else:
                    del ctx.pins[owner]
            walk.cursor = end
        return read.chunk_of_item[end] if end < n else 1 << 62

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
        # its objects land (and its job's leases are taken) a slice per loop turn (server_jobs)
        read = self.reads[ev.read_id]
        n = len(read.keys)
        loaded = tuple(map(bool, itertools.islice(ev.loaded, n)))  # what the answer leaves out: not loaded
        self.jobs.read_finished(read, loaded + (False,) * (n - len(loaded)), now, out)

    def _on_stale_read(self, ev: L2ReadFinished, now: float, out: list[Effect]) -> None:
        self.ctx.counters["stale_events"] += 1
        self.ctx.unpin(L2ReadOwner(ev.read_id))  # expired: its slots leave quarantine now

    def _on_probe_finished(self, ev: L2ProbeFinished, now: float, out: list[Effect]) -> None:
        probe = self.probes[ev.probe_id]
        n = len(probe.keys)
        present = tuple(map(bool, itertools.islice(ev.present, n)))
        self.jobs.probe_finished(probe, present + (False,) * (n - len(present)), now, out)

    def _on_stale(self, ev: L2ProbeFinished, now: float, out: list[Effect]) -> None:
        self.ctx.counters["stale_events"] += 1

    def _on_write_finished(self, ev: L2WriteFinished, now: float, out: list[Effect]) -> None:
        keys = self.writes[ev.write_id]
        owner = L2WriteOwner(ev.write_id)
        self.ctx.index.release_owner(owner, ReleaseReason.L2_WRITE, now)  # it leased exactly its keys
        self.ctx.unpin(owner)
        reported = self.write_chunks.get(ev.write_id)
        if self.ctx.held is not None and reported is not None and ev.ok:
            self.ctx.held.written_l2(keys, reported[1], reported[0], out)

    def _on_stale_write(self, ev: L2WriteFinished, now: float, out: list[Effect]) -> None:
        self.ctx.counters["stale_events"] += 1
        self.ctx.unpin(L2WriteOwner(ev.write_id))  # late (lease expired): the write is over now

    # ============================================================================= deadlines

    def _on_read_deadline(self, timer: L2ReadDeadline, now: float, out: list[Effect]) -> None:
        """Never answered within the lease TTL: its reservations are dropped (the index expired
        them already) and a job still waiting on it resolves with its L1 prefix."""
        read = self.reads[timer.read_id]
        self.ctx.counters["l2_reads_expired"] += 1
        self.ctx.index.abort_writes(read.keys, L2ReadOwner(read.read_id), now)
        self.jobs.read_expired(read, now, out)

    def _on_probe_deadline(self, timer: L2ProbeDeadline, now: float, out: list[Effect]) -> None:
        probe = self.probes[timer.probe_id]
        self.ctx.counters["l2_probes_expired"] += 1
        self.jobs.probe_expired(probe, now, out)

    def _on_write_deadline(self, timer: L2WriteDeadline, now: float, out: list[Effect]) -> None:
        self.ctx.counters["l2_writes_expired"] += 1
        owner = L2WriteOwner(timer.write_id)
        self.ctx.index.release_owner(owner, ReleaseReason.L2_WRITE, now)  # it leased exactly its keys

    def check_invariants(self) -> None:
        for owner in self.ctx.index.leases_by_owner():
            if isinstance(owner, L2WriteOwner):
                assert owner.write_id in self.writes, "lease of a finished L2 write"


# (state of the L2 work the event names, event type) -> (handler, next state), which the dispatcher
# assigns (L2Work._set_state). A completion or deadline for work of another kind under that id is
# stale (not listed: counted).
L2_TABLE: Table[L2State] = Table("LookupServer L2 work (read, probe, write of an id)", L2State, L2State.ABSENT, {
    (L2State.READING, L2ReadFinished): (L2Work._on_read_finished, L2State.ABSENT),
    (L2State.ABSENT, L2ReadFinished): (L2Work._on_stale_read, L2State.ABSENT),
    (L2State.READING, L2ReadDeadline): (L2Work._on_read_deadline, L2State.ABSENT),
    (L2State.PROBING, L2ProbeFinished): (L2Work._on_probe_finished, L2State.ABSENT),
    (L2State.ABSENT, L2ProbeFinished): (L2Work._on_stale, L2State.ABSENT),
    (L2State.PROBING, L2ProbeDeadline): (L2Work._on_probe_deadline, L2State.ABSENT),
    (L2State.WRITING, L2WriteFinished): (L2Work._on_write_finished, L2State.ABSENT),
    (L2State.ABSENT, L2WriteFinished): (L2Work._on_stale_write, L2State.ABSENT),
    (L2State.WRITING, L2WriteDeadline): (L2Work._on_write_deadline, L2State.ABSENT),
}, assigns=True)
L2_TIMERS = (L2ReadDeadline, L2ProbeDeadline, L2WriteDeadline)
