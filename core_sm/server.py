"""``LookupServer``: the server's whole protocol state, as one pure machine.

It owns the L1 index (``core_sm.l1_index.L1Index``), the prefetch job table keyed by
``request_id``, status tombstones, status waiters, registered instances, in-flight transfers and
L2 reads/writes. The runtime feeds it ``core_sm.messages`` server requests and internal events
and carries out the effects (``core_sm.effects``).

Contract highlights (docs/core_sm.md has the tables):

* Every request gets exactly one ``Reply`` or ``ErrorReply`` with its ``reply_to``: at once, or
  later (Store/Retrieve after ``TransferFinished``, CommitTransfer, WaitPrefetchStatus on
  completion or deadline). Internal events and timers never get a reply; an internal event with
  an unknown id is ignored and counted (``stats()["stale_events"]``).
* Read leases are owned by the request id that looked them up (``num_readers`` counts per object)
  and end by exactly one of: RETRIEVE (one count per object per successful retrieve), FREE, END
  SESSION, REAP (abandoned job), TTL, or a forced CLEAR.
* Status: ``None`` while pending, hit chunks when done (then a tombstone repeats it for
  ``tombstone_ttl``), ``0`` for an unknown id.
* Time-driven work (lease expiry, tombstone expiry, waiter deadlines, abandoned-job reaping, L2
  read timeouts, expiry of uncommitted engine-driven plans) runs at the start of every
  ``handle`` call, whatever the event; ``TimerFired`` only makes sure it runs.

Subclass hooks for legacy profiles (simulator) are the methods named in docs/core_sm.md under
"Extension points for legacy profiles"; they are small and have the fixed behaviour by default.
"""
from __future__ import annotations

import enum
import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import attrs

from core_sm.chunks import DEFAULT_CHUNK_SIZE, ObjectKey, identity_root, validate_cache_salt
from core_sm.keys import keyed_chunk_hashes, keyed_root, validate_extras
from core_sm.effects import Effect, ErrorReply, ProbeL2, ReadL2, Reply, StartTransfer, WriteL2
from core_sm.errors import ErrorKind, ProtocolError
from core_sm.l1_index import L1Index, Owner, ReleaseReason
from core_sm.messages import (
    CacheKey,
    Clear,
    CommitTransfer,
    EndSession,
    FreeLookupLocks,
    GetChunkSize,
    L2ProbeFinished,
    L2ReadFinished,
    L2WriteFinished,
    Lookup,
    Ping,
    Placement,
    PrepareRetrieve,
    PrepareStore,
    QueryPrefetchStatus,
    RegisterInstance,
    ReplyTo,
    Retrieve,
    RetrieveResult,
    ServerEvent,
    Store,
    StoreResult,
    TimerFired,
    TransferFinished,
    TransferKind,
    TransferPlan,
    UnregisterInstance,
    WaitPrefetchStatus,
)


@attrs.frozen
class ServerConfig:
    """Server knobs; defaults follow LMCache's where it has one."""

    chunk_size: int = DEFAULT_CHUNK_SIZE
    num_slots: int = 1024
    slot_bytes: int = 1 << 20
    lease_ttl: float = 300.0  # read/write leases and uncommitted engine-driven plans
    tombstone_ttl: float = 60.0
    tombstone_cap: int = 100_000
    abandoned_job_ttl: float = 60.0  # a job never queried is reaped (its leases released)
    l2_enabled: bool = False  # plan ReadL2 for what misses L1
    l2_read_timeout: float = 30.0  # a job whose L2 work is not back resolves with its L1 prefix
    # Ask L2 which objects it has (ProbeL2) before reserving L1 slots for a read: a miss then
    # evicts nothing. Off until every runtime answers ProbeL2 with L2ProbeFinished.
    l2_probe: bool = False
    write_behind: bool = False  # WriteL2 every store once it is ready
    high_watermark: float = 1.0
    low_watermark: float = 1.0
    max_waiters: int = 10_000
    max_chunks_per_request: int = 1 << 16


class JobState(enum.Enum):
    """State of the prefetch job of one request id."""

    ABSENT = "absent"  # never seen, ended, reaped, or tombstone expired
    PENDING = "pending"  # an L2 read is outstanding
    DONE = "done"  # hit count known, not yet answered
    ANSWERED = "answered"  # answered at least once; the tombstone repeats the answer


class TransferState(enum.Enum):
    """State of one transfer id."""

    ABSENT = "absent"
    RUNNING = "running"  # server-driven: StartTransfer emitted, TransferFinished awaited
    PREPARED = "prepared"  # engine-driven: TransferPlan sent, CommitTransfer awaited


_J = JobState
_T = TransferState
_ALL_JOB_STATES = frozenset(JobState)
# Stale timer entries the heap may hold beyond twice its live ones before it is rebuilt.
_TIMER_COMPACT_SLACK = 256
# The one transition table: (state of the entity the event addresses, event type) -> allowed next
# states. An event addresses the job of its request id, or the transfer of its transfer id
# (a new transfer starts ABSENT). A refused event (ErrorReply) leaves the state unchanged.
TRANSITIONS: dict[tuple[enum.Enum, type], frozenset[enum.Enum]] = {
    (_J.ABSENT, Lookup): frozenset({_J.PENDING, _J.DONE}),
    (_J.ABSENT, QueryPrefetchStatus): frozenset({_J.ABSENT}),
    (_J.ABSENT, WaitPrefetchStatus): frozenset({_J.ABSENT}),
    (_J.ABSENT, FreeLookupLocks): frozenset({_J.ABSENT}),
    (_J.ABSENT, EndSession): frozenset({_J.ABSENT}),
    (_J.ABSENT, L2ReadFinished): frozenset({_J.ABSENT}),
    (_J.ABSENT, TimerFired): frozenset({_J.ABSENT}),
    (_J.ABSENT, Clear): frozenset({_J.ABSENT}),
    (_J.ABSENT, L2ProbeFinished): frozenset({_J.ABSENT}),
    (_J.PENDING, L2ProbeFinished): frozenset({_J.PENDING, _J.DONE, _J.ANSWERED}),  # read next, or done
    (_J.DONE, L2ProbeFinished): frozenset({_J.DONE}),
    (_J.ANSWERED, L2ProbeFinished): frozenset({_J.ANSWERED}),
    (_J.PENDING, Lookup): frozenset({_J.PENDING}),
    (_J.PENDING, QueryPrefetchStatus): frozenset({_J.PENDING}),
    (_J.PENDING, WaitPrefetchStatus): frozenset({_J.PENDING}),
    (_J.PENDING, FreeLookupLocks): frozenset({_J.PENDING}),
    (_J.PENDING, EndSession): frozenset({_J.ABSENT}),
    (_J.PENDING, L2ReadFinished): frozenset({_J.PENDING, _J.DONE, _J.ANSWERED}),  # another read: stays
    (_J.PENDING, TimerFired): frozenset({_J.PENDING, _J.DONE, _J.ANSWERED, _J.ABSENT}),
    (_J.PENDING, Clear): frozenset({_J.PENDING}),
    (_J.DONE, Lookup): frozenset({_J.DONE}),
    (_J.DONE, QueryPrefetchStatus): frozenset({_J.ANSWERED}),
    (_J.DONE, WaitPrefetchStatus): frozenset({_J.ANSWERED}),
    (_J.DONE, FreeLookupLocks): frozenset({_J.DONE}),
    (_J.DONE, EndSession): frozenset({_J.ABSENT}),
    (_J.DONE, L2ReadFinished): frozenset({_J.DONE}),
    (_J.DONE, TimerFired): frozenset({_J.DONE, _J.ABSENT}),
    (_J.DONE, Clear): frozenset({_J.DONE}),
    (_J.ANSWERED, Lookup): frozenset({_J.PENDING, _J.DONE}),
    (_J.ANSWERED, QueryPrefetchStatus): frozenset({_J.ANSWERED}),
    (_J.ANSWERED, WaitPrefetchStatus): frozenset({_J.ANSWERED}),
    (_J.ANSWERED, FreeLookupLocks): frozenset({_J.ANSWERED}),
    (_J.ANSWERED, EndSession): frozenset({_J.ABSENT}),
    (_J.ANSWERED, L2ReadFinished): frozenset({_J.ANSWERED}),
    (_J.ANSWERED, TimerFired): frozenset({_J.ANSWERED, _J.ABSENT}),
    (_J.ANSWERED, Clear): frozenset({_J.ANSWERED}),
    (_T.ABSENT, Store): frozenset({_T.RUNNING, _T.ABSENT}),
    (_T.ABSENT, Retrieve): frozenset({_T.RUNNING, _T.ABSENT}),
    (_T.ABSENT, PrepareStore): frozenset({_T.PREPARED}),
    (_T.ABSENT, PrepareRetrieve): frozenset({_T.PREPARED, _T.ABSENT}),
    (_T.ABSENT, TransferFinished): frozenset({_T.ABSENT}),
    (_T.ABSENT, CommitTransfer): frozenset({_T.ABSENT}),
    (_T.ABSENT, TimerFired): frozenset({_T.ABSENT}),
    (_T.ABSENT, Clear): frozenset({_T.ABSENT}),
    (_T.RUNNING, TransferFinished): frozenset({_T.ABSENT}),
    (_T.RUNNING, CommitTransfer): frozenset({_T.RUNNING}),
    (_T.RUNNING, TimerFired): frozenset({_T.RUNNING, _T.ABSENT}),  # completion never reported
    (_T.RUNNING, Clear): frozenset({_T.RUNNING}),
    (_T.PREPARED, CommitTransfer): frozenset({_T.ABSENT}),
    (_T.PREPARED, TransferFinished): frozenset({_T.PREPARED}),
    (_T.PREPARED, TimerFired): frozenset({_T.PREPARED, _T.ABSENT}),
    (_T.PREPARED, Clear): frozenset({_T.PREPARED}),
}
# Events that address an existing entity (the walk checks every state against each of them);
# Store/Retrieve/Prepare* only ever create a transfer, from ABSENT.
JOB_EVENTS = (Lookup, QueryPrefetchStatus, WaitPrefetchStatus, FreeLookupLocks, EndSession,
              L2ReadFinished, L2ProbeFinished, TimerFired, Clear)
TRANSFER_EVENTS = (TransferFinished, CommitTransfer, TimerFired, Clear)
TRANSFER_CREATORS = (Store, Retrieve, PrepareStore, PrepareRetrieve)


@attrs.define
class PrefetchJob:
    """One request id's lookup: the L1 prefix it leased, its L2 read, its answer."""

    request_id: str
    serial: int
    key: CacheKey
    hashes: tuple[bytes, ...]
    num_readers: int
    l1_prefix: int
    created: float
    reap_at: float
    read_id: int | None = None
    probe_id: int | None = None
    l2_deadline: float | None = None
    hits: int | None = None
    freed_chunks: set[int] = attrs.Factory(set)
    ranks: tuple[int, ...] | None = None  # the KV ranks this server holds (None: all)

    @property
    def state(self) -> JobState:
        return JobState.PENDING if self.hits is None else JobState.DONE

    def rank_range(self) -> Sequence[int]:
        """The ranks whose objects make a chunk a hit (leased, read from L2)."""
        return range(self.key.world_size) if self.ranks is None else self.ranks


@attrs.define
class Transfer:
    transfer_id: int
    kind: TransferKind
    engine_driven: bool
    request_id: str
    reply_to: ReplyTo
    keys: tuple[ObjectKey, ...]  # one per placement, same order
    placements: tuple[Placement, ...]
    skipped: int
    deadline: float | None
    wait_id: int | None = None  # its reply waits for other stores' writes (StoreWait)


@attrs.define
class StoreWait:
    """The reply of a STORE some of whose chunks other in-flight server-driven stores are
    writing: sent once every transfer in ``awaiting`` (its own included) has ended, so a
    ``StoreResult`` never reaches the worker while a copy may still read its blocks."""

    wait_id: int
    reply_to: ReplyTo
    awaiting: set[int]  # transfer ids
    ok: bool = True
    stored: int = 0
    skipped: int = 0


@attrs.define
class L2Read:
    read_id: int
    request_id: str | None  # None once its job is gone (ended, timed out): loads still land
    job_serial: int
    chunk_of_item: tuple[int, ...]
    keys: tuple[ObjectKey, ...]


@attrs.define
class L2Probe:
    probe_id: int
    request_id: str
    job_serial: int
    keys: tuple[ObjectKey, ...]


@attrs.define
class Waiter:
    waiter_id: int
    request_id: str
    reply_to: ReplyTo
    deadline: float


class LookupServer:
    """The server machine. ``handle(event, now) -> list[Effect]``; ``next_deadline()``."""

    TRANSITIONS = TRANSITIONS

    def __init__(self, config: ServerConfig | None = None) -> None:
        self.config = config if config is not None else ServerConfig()
        c = self.config
        self.index = L1Index(c.num_slots, c.slot_bytes, c.lease_ttl, c.high_watermark, c.low_watermark)
        self._jobs: dict[str, PrefetchJob] = {}
        self._tombstones: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._waiters: dict[str, dict[int, Waiter]] = {}
        self._waiter_by_id: dict[int, Waiter] = {}
        self._instances: dict[int, RegisterInstance] = {}
        self._transfers: dict[int, Transfer] = {}
        self._reads: dict[int, L2Read] = {}
        self._probes: dict[int, L2Probe] = {}
        self._writes: dict[int, tuple[ObjectKey, ...]] = {}
        self._store_waits: dict[int, StoreWait] = {}
        self._waits_on: dict[int, list[int]] = {}  # transfer id -> store waits awaiting it
        # Slots pinned in the index by an in-flight effect, per effect: ("l2read", id),
        # ("l2write", id), ("transfer", id). Unpinned by the effect's completion event only
        # (an expired engine-driven plan: one more lease_ttl), whatever the TTLs did meanwhile.
        self._pins: dict[tuple[str, int], tuple[int, ...]] = {}
        self._quarantined_plans: set[int] = set()
        # Server-driven STORE/RETRIEVE ops that carry a not_after, by what identifies the op (a
        # network duplicate has the same): answered -> the answer, kept until the not_after
        # (later, _refuse_late covers it); unanswered -> the first copy's reply_to and the
        # duplicates' reply_tos, all answered alike.
        self._ops_done: OrderedDict[Hashable, tuple[bool, object, float]] = OrderedDict()
        self._ops_running: dict[Hashable, tuple[ReplyTo, list[ReplyTo]]] = {}
        self._op_of_reply: dict[ReplyTo, Hashable] = {}
        self._timers: list[tuple[float, int, str, Hashable]] = []
        # The heap is rebuilt from its live entries when it grows past this (see _push_timer).
        self._timers_compact_at = _TIMER_COMPACT_SLACK
        self._due_reaps: list[str] = []
        self._roots: dict[tuple[str, int, str, str], bytes] = {}
        self._next_id = 0
        self._counters: dict[str, int] = {
            name: 0
            for name in (
                "requests", "errors", "lookups", "duplicate_lookups", "status_queries",
                "unknown_status", "hit_chunks", "lookup_chunks", "reaped_jobs", "l2_timeouts",
                "l2_reads", "l2_probes", "l2_writes", "stale_events", "transfers_started", "transfers_failed",
                "retrieve_misses", "expired_plans", "expired_transfers", "l2_reads_expired", "l2_probes_expired",
                "l2_writes_expired", "waiter_timeouts", "internal_errors",
                "tombstones_dropped", "late_transfers_refused", "stores_awaiting_writers",
                "plan_quarantines_ended", "duplicate_transfers", "timer_compactions",
            )
        }

    # ============================================================================= public API

    def handle(self, event: ServerEvent, now: float) -> list[Effect]:
        """Feed one event at time ``now``; returns the effects, in order. Never raises."""
        out: list[Effect] = []
        try:
            self._advance(now, out)
            handler = _DISPATCH.get(type(event))
            if handler is None:
                self._counters["stale_events"] += 1
                reply_to = getattr(event, "reply_to", None)
                if reply_to is not None:
                    self._error(out, reply_to, ErrorKind.UNKNOWN_OP, type(event).__name__)
            else:
                if hasattr(event, "reply_to"):
                    self._counters["requests"] += 1
                getattr(self, handler)(event, now, out)
            if self._op_of_reply:  # a deferred STORE/RETRIEVE answered: its duplicates too
                self._answer_duplicates(out)
        except Exception as exc:  # a bug: answer the request so no client waits forever
            self._counters["internal_errors"] += 1
            reply_to = getattr(event, "reply_to", None)
            if reply_to is not None and not any(
                isinstance(e, (Reply, ErrorReply)) and e.reply_to == reply_to for e in out
            ):
                self._error(out, reply_to, ErrorKind.INTERNAL, f"{type(exc).__name__}: {exc}")
        return out

    def next_deadline(self) -> float | None:
        """The earliest time at which ``handle(TimerFired(), t)`` has work to do (may be early)."""
        while self._timers and not self._timer_live(self._timers[0]):
            heapq.heappop(self._timers)
        candidates = []
        if self._timers:
            candidates.append(self._timers[0][0])
        if self._tombstones:
            candidates.append(next(iter(self._tombstones.values()))[1])
        lease = self.index.next_expiry()
        if lease is not None:
            candidates.append(lease)
        return min(candidates) if candidates else None

    def job_state(self, request_id: str) -> JobState:
        job = self._jobs.get(request_id)
        if job is not None:
            return job.state
        return JobState.ANSWERED if request_id in self._tombstones else JobState.ABSENT

    def transfer_state(self, transfer_id: int) -> TransferState:
        t = self._transfers.get(transfer_id)
        if t is None:
            return TransferState.ABSENT
        return TransferState.PREPARED if t.engine_driven else TransferState.RUNNING

    def job(self, request_id: str) -> PrefetchJob | None:
        return self._jobs.get(request_id)

    def tombstone(self, request_id: str) -> int | None:
        entry = self._tombstones.get(request_id)
        return None if entry is None else entry[0]

    def leases_by_owner(self) -> dict[Owner, int]:
        return self.index.leases_by_owner()

    def stats(self) -> dict[str, int]:
        """A snapshot for metrics and simulator oracles (flat name → int)."""
        out = dict(self._counters)
        out.update(self.index.stats())
        out["jobs"] = len(self._jobs)
        out["jobs_pending"] = sum(1 for j in self._jobs.values() if j.hits is None)
        out["tombstones"] = len(self._tombstones)
        out["waiters"] = len(self._waiter_by_id)
        out["transfers"] = len(self._transfers)
        out["l2_reads_in_flight"] = len(self._reads)
        out["l2_probes_in_flight"] = len(self._probes)
        out["l2_writes_in_flight"] = len(self._writes)
        out["instances"] = len(self._instances)
        out["store_waits"] = len(self._store_waits)
        out["pinned_effects"] = len(self._pins)
        out["timers"] = len(self._timers)
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError if the state is inconsistent; cheap enough after every event."""
        self.index.check_invariants()
        assert len(self._tombstones) <= self.config.tombstone_cap, "tombstone cap"
        for rid, job in self._jobs.items():
            assert job.request_id == rid
            assert rid not in self._tombstones, "a live job and a tombstone for one id"
            if job.hits is None:
                assert (job.read_id is not None and job.read_id in self._reads) != (
                    job.probe_id is not None and job.probe_id in self._probes), "pending job: one L2 step"
            else:
                assert 0 <= job.hits <= len(job.hashes), "hits out of range"
        for rid, waiters in self._waiters.items():
            assert waiters, "empty waiter list"
            waited = self._jobs.get(rid)
            assert waited is not None and waited.hits is None, "a waiter for a job that is not pending"
            for wid, w in waiters.items():
                assert self._waiter_by_id[wid] is w
        assert sum(len(w) for w in self._waiters.values()) == len(self._waiter_by_id)
        for owner in self.index.leases_by_owner():
            if isinstance(owner, tuple):
                kind, ident = owner
                if kind == "transfer":
                    assert ident in self._transfers, "lease of a finished transfer"
                elif kind == "l2write":
                    assert ident in self._writes, "lease of a finished L2 write"
        for wid, wait in self._store_waits.items():
            assert wait.wait_id == wid and wait.awaiting, "a store wait with nothing to wait for"
            for tid in wait.awaiting:
                assert tid in self._transfers, "a store waits for a finished transfer"
                assert wid in self._waits_on.get(tid, ()) or self._transfers[tid].wait_id == wid
        for tid in self._waits_on:
            assert tid in self._transfers, "waits registered on a finished transfer"
        pinned = {slot for slots in self._pins.values() for slot in slots}
        assert self.index.stats()["pinned_slots"] == len(pinned), "slot pins out of sync"
        assert len(self._ops_running) == len(self._op_of_reply), "deferred op tables out of sync"
        for reply_to, ident in self._op_of_reply.items():
            assert self._ops_running[ident][0] == reply_to
        for tid in self._quarantined_plans:
            assert ("transfer", tid) in self._pins and tid not in self._transfers

    # ============================================================================= hooks

    def _reply_error(self, out: list[Effect], reply_to: ReplyTo, error: ProtocolError) -> None:
        """Answer the request behind ``reply_to`` with ``error``: every ``ErrorReply`` the server
        sends is built here and counted in ``stats()["errors"]`` (legacy: send nothing, so the
        request is never answered: F11)."""
        self._counters["errors"] += 1
        out.append(ErrorReply(reply_to, error))

    def _status_for_unknown(self, request_id: str) -> int | None:
        """Answer for a status query of an id with no job and no tombstone (legacy: None)."""
        return 0

    def _on_duplicate_lookup(self, job: PrefetchJob, event: Lookup, now: float, out: list[Effect]) -> None:
        """A Lookup for an id whose job is live: ack, take no second set of leases (legacy:
        replace the job and lease again, leaking the first set: F4)."""
        self._counters["duplicate_lookups"] += 1
        out.append(Reply(event.reply_to, None))

    def _lease_for_lookup(self, request_id: str, key: ObjectKey, num_readers: int, now: float) -> None:
        """Make ``request_id`` hold ``num_readers`` counts on ``key`` (tops up, never adds twice)."""
        need = num_readers - self.index.read_count(key, request_id)
        if need > 0:
            self.index.lease_read(key, request_id, need, now)
        self.index.touch(key)

    def _lease_prefix_for_lookup(
        self, request_id: str, keys: Sequence[ObjectKey], num_readers: int, now: float
    ) -> None:
        """``_lease_for_lookup`` for every object of a lookup's L1 prefix, as one batch of the
        index (a subclass overriding ``_lease_for_lookup`` has it called per object instead)."""
        if type(self)._lease_for_lookup is not LookupServer._lease_for_lookup:
            for key in keys:
                self._lease_for_lookup(request_id, key, num_readers, now)
            return
        # Top-up per object, as _lease_for_lookup (READY objects being leased leave the LRU set,
        # so its touch has nothing to move).
        self.index.lease_reads(keys, request_id, num_readers, now, top_up=True)

    def _release_for_free_lookup_locks(
        self, request_id: str, keys: Sequence[ObjectKey], now: float
    ) -> int:
        """FREE_LOOKUP_LOCKS: release this request's leases on ``keys`` only (legacy: one count of
        whoever holds each key: F9). Returns the counts released."""
        return self.index.release_reads(keys, request_id, None, ReleaseReason.FREE, now)

    def _release_after_retrieve(self, request_id: str, keys: Sequence[ObjectKey], now: float) -> None:
        """A successful RETRIEVE releases one of the request's counts per object."""
        self.index.release_reads(keys, request_id, 1, ReleaseReason.RETRIEVE, now)

    def _tombstone_after_answer(self, request_id: str, hits: int, now: float) -> None:
        """Remember an answered job's count (legacy: nothing, so repeats see an unknown id: F1)."""
        self._tombstones[request_id] = (hits, now + self.config.tombstone_ttl)
        self._tombstones.move_to_end(request_id)
        while len(self._tombstones) > self.config.tombstone_cap:
            self._tombstones.popitem(last=False)
            self._counters["tombstones_dropped"] += 1

    def _end_session(self, request_id: str, now: float, out: list[Effect]) -> None:
        """END_SESSION: drop job, tombstone, waiters; release the id's leases (legacy LMCache
        April: only the session goes, the job and its leases stay: F12)."""
        job = self._jobs.pop(request_id, None)
        if job is not None and job.read_id is not None:
            read = self._reads.get(job.read_id)
            if read is not None:
                read.request_id = None
        self._tombstones.pop(request_id, None)
        self._answer_waiters(request_id, 0, out)
        self.index.release_owner(request_id, ReleaseReason.END_SESSION, now)

    def _reap_abandoned_jobs(self, now: float, out: list[Effect]) -> None:
        """Drop the jobs due for reaping (``self._due_reaps``: never answered within
        ``abandoned_job_ttl``), releasing their leases (legacy: nothing; jobs and leases stay
        until TTL: F12). Called from the time step only when some job is due."""
        for rid in self._due_reaps:
            job = self._jobs.get(rid)
            if job is None or job.reap_at > now:
                continue
            del self._jobs[rid]
            self._counters["reaped_jobs"] += 1
            if job.read_id is not None and job.read_id in self._reads:
                self._reads[job.read_id].request_id = None
            self._answer_waiters(rid, 0, out)
            self.index.release_owner(rid, ReleaseReason.REAP, now)

    # ============================================================================= handlers

    def _on_ping(self, ev: Ping, now: float, out: list[Effect]) -> None:
        out.append(Reply(ev.reply_to, True))

    def _on_get_chunk_size(self, ev: GetChunkSize, now: float, out: list[Effect]) -> None:
        out.append(Reply(ev.reply_to, self.config.chunk_size))

    def _on_lookup(self, ev: Lookup, now: float, out: list[Effect]) -> None:
        self._counters["lookups"] += 1
        err = self._validate_key(ev.key, scheduler=True)
        if err is None and ev.key.start != 0:
            err = f"a lookup key starts at token 0, not {ev.key.start}"
        if err is None and ev.ranks is not None:
            ranks, ws = ev.ranks, ev.key.world_size
            if not ranks or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < ws
                                    for r in ranks) or len(set(ranks)) != len(ranks):
                err = f"ranks must be distinct ints in [0, {ws}), not {ranks!r}"
        hashes: tuple[bytes, ...] = ()
        if err is None:
            hashes, err = self._hashes(ev.key, ev.key.end // self.config.chunk_size)
        if err is not None:
            self._error(out, ev.reply_to, ErrorKind.VALIDATION, err)
            return
        rid = ev.key.request_id
        job = self._jobs.get(rid)
        if job is not None:
            self._on_duplicate_lookup(job, ev, now, out)
            return
        self._tombstones.pop(rid, None)
        self._start_job(ev, hashes, now, out)

    def _start_job(self, ev: Lookup, hashes: tuple[bytes, ...], now: float, out: list[Effect]) -> None:
        key, rid = ev.key, ev.key.request_id
        ranks = range(key.world_size) if ev.ranks is None else ev.ranks
        prefix, prefix_keys = self.index.readable_prefix(hashes, ranks)
        if ev.num_readers > 0:
            self._lease_prefix_for_lookup(rid, prefix_keys, ev.num_readers, now)
        self._counters["lookup_chunks"] += len(hashes)
        job = PrefetchJob(
            request_id=rid, serial=self._new_id(), key=key, hashes=hashes,
            num_readers=ev.num_readers, l1_prefix=prefix, created=now,
            reap_at=now + self.config.abandoned_job_ttl, ranks=ev.ranks,
        )
        self._jobs[rid] = job
        self._push_timer(job.reap_at, "reap", (rid, job.serial))
        out.append(Reply(ev.reply_to, None))
        if self.config.l2_enabled and prefix < len(hashes):
            started = (self._start_probe(job, now, out) if self.config.l2_probe
                       else self._start_read(job, len(hashes), now, out))
            if started:
                job.l2_deadline = now + self.config.l2_read_timeout
                self._push_timer(job.l2_deadline, "l2_timeout", (rid, job.serial))
                return
        self._complete_job(job, prefix, now, out)

    def _missing_keys(self, job: PrefetchJob, upto: int) -> list[tuple[int, ObjectKey]]:
        """(chunk, key) of the objects not readable in chunks [l1_prefix, upto), prefix order."""
        ranks = job.rank_range()
        return [(i, ObjectKey(job.hashes[i], r)) for i in range(job.l1_prefix, upto) for r in ranks
                if not self.index.is_readable(ObjectKey(job.hashes[i], r))]

    def _start_probe(self, job: PrefetchJob, now: float, out: list[Effect]) -> bool:
        keys = tuple(k for _i, k in self._missing_keys(job, len(job.hashes)))
        if not keys:
            return False
        probe = L2Probe(self._new_id(), job.request_id, job.serial, keys)
        self._probes[probe.probe_id] = probe
        job.probe_id = probe.probe_id
        self._push_timer(now + self.config.lease_ttl, "l2_probe", probe.probe_id)
        self._counters["l2_probes"] += 1
        out.append(ProbeL2(probe.probe_id, keys))
        return True

    def _start_read(self, job: PrefetchJob, upto: int, now: float, out: list[Effect]) -> bool:
        read = self._plan_l2_read(job, upto, now)
        if read is None:
            return False
        job.read_id = read.read_id
        self._reads[read.read_id] = read
        self._push_timer(now + self.config.lease_ttl, "l2_read", read.read_id)
        self._counters["l2_reads"] += 1
        slots = tuple(self.index.slot_of(k) for k in read.keys)
        assert all(slot is not None for slot in slots)
        self._pin("l2read", read.read_id, [slot for slot in slots if slot is not None])
        out.append(ReadL2(read.read_id, tuple(zip(read.keys, slots))))
        return True

    def _plan_l2_read(self, job: PrefetchJob, upto: int, now: float) -> L2Read | None:
        """Reserve slots for the objects missing after the L1 prefix, prefix order, stopping at
        an object another writer holds or when no slot is left."""
        read_id = self._new_id()
        owner = ("l2read", read_id)
        ws = job.key.world_size
        nbytes = self._object_bytes_for(job.key.model_name, ws)
        keys: list[ObjectKey] = []
        chunks: list[int] = []
        stop = False
        for i in range(job.l1_prefix, upto):
            for r in job.rank_range():
                k = ObjectKey(job.hashes[i], r)
                if self.index.is_readable(k):
                    continue
                if self.index.reserve_write(k, owner, nbytes, now) is None:
                    stop = True
                    break
                keys.append(k)
                chunks.append(i)
            if stop:
                break
        if not keys:
            return None
        return L2Read(read_id, job.request_id, job.serial, tuple(chunks), tuple(keys))

    def _complete_job(self, job: PrefetchJob, hits: int, now: float, out: list[Effect]) -> None:
        job.hits = hits
        job.read_id = None
        job.probe_id = None
        job.l2_deadline = None
        self._counters["hit_chunks"] += hits
        if job.request_id in self._waiters:
            self._answer_waiters(job.request_id, hits, out)
            self._consume(job, now)

    def _consume(self, job: PrefetchJob, now: float) -> None:
        assert job.hits is not None
        del self._jobs[job.request_id]
        self._tombstone_after_answer(job.request_id, job.hits, now)

    def _on_query(self, ev: QueryPrefetchStatus, now: float, out: list[Effect]) -> None:
        self._counters["status_queries"] += 1
        out.append(Reply(ev.reply_to, self._status(ev.request_id, now)))

    def _status(self, rid: str, now: float) -> int | None:
        job = self._jobs.get(rid)
        if job is not None:
            if job.hits is None:
                return None
            hits = job.hits
            self._consume(job, now)
            return hits
        tomb = self._tombstones.get(rid)
        if tomb is not None:
            return tomb[0]
        self._counters["unknown_status"] += 1
        return self._status_for_unknown(rid)

    def _on_wait(self, ev: WaitPrefetchStatus, now: float, out: list[Effect]) -> None:
        self._counters["status_queries"] += 1
        if not isinstance(ev.timeout, (int, float)) or math.isnan(ev.timeout):
            self._error(out, ev.reply_to, ErrorKind.VALIDATION, "timeout must be a number")
            return
        job = self._jobs.get(ev.request_id)
        if job is None or job.hits is not None or ev.timeout <= 0:
            out.append(Reply(ev.reply_to, self._status(ev.request_id, now)))
            return
        if len(self._waiter_by_id) >= self.config.max_waiters:
            self._error(out, ev.reply_to, ErrorKind.TOO_LARGE, "too many status waiters")
            return
        w = Waiter(self._new_id(), ev.request_id, ev.reply_to, now + min(ev.timeout, 1e9))
        self._waiters.setdefault(ev.request_id, {})[w.waiter_id] = w
        self._waiter_by_id[w.waiter_id] = w
        self._push_timer(w.deadline, "waiter", w.waiter_id)

    def _answer_waiters(self, rid: str, result: int | None, out: list[Effect]) -> None:
        for w in self._waiters.pop(rid, {}).values():
            del self._waiter_by_id[w.waiter_id]
            out.append(Reply(w.reply_to, result))

    def _on_free(self, ev: FreeLookupLocks, now: float, out: list[Effect]) -> None:
        key = ev.key
        err = self._validate_key(key, scheduler=True, aligned=False)
        C = self.config.chunk_size
        first, last = key.start // C, key.end // C
        hashes: tuple[bytes, ...] = ()
        if err is None:
            hashes, err = self._hashes(key, last)
        if err is not None:
            self._error(out, ev.reply_to, ErrorKind.VALIDATION, err)
            return
        keys = [ObjectKey(hashes[i], r) for i in range(first, last) for r in range(key.world_size)]
        self._release_for_free_lookup_locks(key.request_id, keys, now)
        job = self._jobs.get(key.request_id)
        if job is not None and job.hits is None:
            job.freed_chunks.update(range(first, last))
        out.append(Reply(ev.reply_to, None))

    def _on_end_session(self, ev: EndSession, now: float, out: list[Effect]) -> None:
        self._end_session(ev.request_id, now, out)
        out.append(Reply(ev.reply_to, None))

    def _on_clear(self, ev: Clear, now: float, out: list[Effect]) -> None:
        # In-flight copies and L2 writes keep their objects: their slots are in use right now.
        self.index.clear(bool(ev.force), protected=lambda owner: isinstance(owner, tuple))
        out.append(Reply(ev.reply_to, None))

    def _on_register(self, ev: RegisterInstance, now: float, out: list[Effect]) -> None:
        err = None
        if not isinstance(ev.world_size, int) or ev.world_size < 1:
            err = "world_size must be >= 1"
        elif not isinstance(ev.model_name, str):
            err = "model_name must be a str"
        elif not isinstance(ev.object_bytes, int) or ev.object_bytes < 0:
            err = "object_bytes must be >= 0"
        if err is not None:
            self._error(out, ev.reply_to, ErrorKind.VALIDATION, err)
            return
        if ev.object_bytes > self.config.slot_bytes:
            self._error(out,
                ev.reply_to, ErrorKind.TOO_LARGE,
                f"object of {ev.object_bytes} B > slot of {self.config.slot_bytes} B",
            )
            return
        self._instances[ev.instance_id] = attrs.evolve(ev, reply_to=None)
        out.append(Reply(ev.reply_to, None))

    def _on_unregister(self, ev: UnregisterInstance, now: float, out: list[Effect]) -> None:
        self._instances.pop(ev.instance_id, None)
        out.append(Reply(ev.reply_to, None))

    def _on_store(self, ev: Store | PrepareStore, now: float, out: list[Effect]) -> None:
        self._transfer_once(ev, now, out, self._store)

    def _on_retrieve(self, ev: Retrieve | PrepareRetrieve, now: float, out: list[Effect]) -> None:
        self._transfer_once(ev, now, out, self._retrieve)

    def _store(self, ev: Store | PrepareStore, now: float, out: list[Effect]) -> None:
        engine_driven = isinstance(ev, PrepareStore)
        inst, keys_or_err = self._worker_keys(ev.key, ev.instance_id, 0)
        if inst is None or isinstance(keys_or_err, ProtocolError):
            assert isinstance(keys_or_err, ProtocolError)
            self._reply_error(out, ev.reply_to, keys_or_err)
            return
        tid = self._new_id()
        owner = ("transfer", tid)
        first = ev.key.start // self.config.chunk_size
        placements: list[Placement] = []
        reserved: list[ObjectKey] = []
        skipped = 0
        awaited: dict[int, None] = {}  # running server-driven stores writing chunks of this one
        for offset, k in enumerate(keys_or_err):
            slot = self.index.reserve_write(k, owner, inst.object_bytes, now)
            if slot is None:
                skipped += 1
                writer = self.index.writer_of(k)
                if not engine_driven and isinstance(writer, tuple) and writer[0] == "transfer":
                    other = self._transfers.get(writer[1])
                    if other is not None and not other.engine_driven:
                        awaited[other.transfer_id] = None
            else:
                placements.append((first + offset, slot))
                reserved.append(k)
        wait: StoreWait | None = None
        if awaited:
            # A duplicate (or a concurrent store of the same chunks): answering before those
            # writes end would let the worker free blocks an in-flight copy may still read.
            self._counters["stores_awaiting_writers"] += 1
            wait = StoreWait(self._new_id(), ev.reply_to, set(awaited), skipped=skipped)
            self._store_waits[wait.wait_id] = wait
            for other_tid in awaited:
                self._waits_on.setdefault(other_tid, []).append(wait.wait_id)
        if not engine_driven and not placements:
            if wait is None:
                out.append(Reply(ev.reply_to, StoreResult(True, 0, skipped)))
            return
        t = Transfer(
            tid, TransferKind.STORE, engine_driven, ev.key.request_id, ev.reply_to,
            tuple(reserved), tuple(placements), skipped,
            now + self.config.lease_ttl,
        )
        if wait is not None:
            t.wait_id = wait.wait_id
            wait.awaiting.add(tid)
        self._begin_transfer(t, ev, out)

    def _refuse_late(self, ev: Store | PrepareStore | Retrieve, now: float, out: list[Effect]) -> bool:
        """A STORE/RETRIEVE handled after its ``not_after`` (or with a malformed one) is refused
        before anything is reserved, leased or copied: its worker may have given up on it and
        handed the blocks back to vLLM."""
        not_after = ev.not_after
        if not_after is None:
            return False
        if isinstance(not_after, bool) or not isinstance(not_after, (int, float)) or math.isnan(not_after):
            self._error(out, ev.reply_to, ErrorKind.VALIDATION, "not_after must be a number or None")
            return True
        if now <= not_after:
            return False
        self._counters["late_transfers_refused"] += 1
        self._error(out, ev.reply_to, ErrorKind.TIMEOUT,
                               f"handled at {now:.6f}, after its not_after {not_after:.6f}")
        return True

    def _retrieve(self, ev: Retrieve | PrepareRetrieve, now: float, out: list[Effect]) -> None:
        engine_driven = isinstance(ev, PrepareRetrieve)
        inst, keys_or_err = self._worker_keys(ev.key, ev.instance_id, ev.skip_first_n_tokens)
        if inst is None or isinstance(keys_or_err, ProtocolError):
            assert isinstance(keys_or_err, ProtocolError)
            self._reply_error(out, ev.reply_to, keys_or_err)
            return
        keys = keys_or_err
        if not all(self.index.is_readable(k) for k in keys):
            self._counters["retrieve_misses"] += 1
            if engine_driven:
                out.append(Reply(ev.reply_to, TransferPlan(-1, (), False, TransferKind.RETRIEVE,
                                                           ev.skip_first_n_tokens)))
            else:
                out.append(Reply(ev.reply_to, RetrieveResult(False, len(keys))))
            return
        if not keys and not engine_driven:
            out.append(Reply(ev.reply_to, RetrieveResult(True, 0)))
            return
        tid = self._new_id()
        owner = ("transfer", tid)
        first = ev.key.start // self.config.chunk_size
        placements: list[Placement] = []
        for offset, k in enumerate(keys):
            self.index.lease_read(k, owner, 1, now)
            self.index.touch(k)
            slot = self.index.slot_of(k)
            assert slot is not None
            placements.append((first + offset, slot))
        t = Transfer(
            tid, TransferKind.RETRIEVE, engine_driven, ev.key.request_id, ev.reply_to,
            tuple(keys), tuple(placements), 0,
            now + self.config.lease_ttl,
        )
        self._begin_transfer(t, ev, out)

    def _transfer_once(self, ev: Store | PrepareStore | Retrieve | PrepareRetrieve, now: float,
                       out: list[Effect], run: Callable[[Any, float, list[Effect]], None]) -> None:
        """Run a STORE/RETRIEVE handler at most once per op. A request handled after its
        ``not_after`` is refused. A server-driven one with a ``not_after`` that the network
        delivered twice (same instance, request, range, blocks, skip and ``not_after``: the same
        op) never starts a second copy -- it could read or write blocks the worker got back
        after the first answer: it is answered like the first copy, when that one is (its
        answer is kept until the ``not_after``; later, the refusal covers it)."""
        if not isinstance(ev, PrepareRetrieve) and self._refuse_late(ev, now, out):
            return
        ident: Hashable = None
        if isinstance(ev, (Store, Retrieve)) and ev.not_after is not None:
            skip = ev.skip_first_n_tokens if isinstance(ev, Retrieve) else -1
            ident = (ev.instance_id, ev.key.request_id, ev.key.worker_id, ev.key.start, ev.key.end,
                     ev.block_ids, skip, ev.not_after)
            while self._ops_done:  # answers whose not_after passed (or over the cap) go
                oldest, (_ok, _result, until) = next(iter(self._ops_done.items()))
                if until >= now and len(self._ops_done) <= self.config.tombstone_cap:
                    break
                del self._ops_done[oldest]
            running = self._ops_running.get(ident)
            if running is not None:
                self._counters["duplicate_transfers"] += 1
                running[1].append(ev.reply_to)
                return
            done = self._ops_done.get(ident)
            if done is not None:
                self._counters["duplicate_transfers"] += 1
                ok, answer = done[0], done[1]
                if ok:
                    out.append(Reply(ev.reply_to, answer))
                else:
                    assert isinstance(answer, ProtocolError)
                    self._reply_error(out, ev.reply_to, answer)
                return
        mark = len(out)
        run(ev, now, out)
        if ident is None:
            return
        for e in out[mark:]:
            if isinstance(e, (Reply, ErrorReply)) and e.reply_to == ev.reply_to:
                self._remember_answer(ident, e)
                return
        self._ops_running[ident] = (ev.reply_to, [])
        self._op_of_reply[ev.reply_to] = ident

    def _remember_answer(self, ident: Hashable, answer: Reply | ErrorReply) -> None:
        assert isinstance(ident, tuple)
        ok = isinstance(answer, Reply)
        self._ops_done[ident] = (ok, answer.result if isinstance(answer, Reply) else answer.error, ident[-1])
        self._ops_done.move_to_end(ident)

    def _answer_duplicates(self, out: list[Effect]) -> None:
        """A deferred STORE/RETRIEVE was answered in ``out``: answer its duplicates alike."""
        extra: list[Effect] = []
        for e in out:
            if isinstance(e, (Reply, ErrorReply)):
                ident = self._op_of_reply.pop(e.reply_to, None)
                if ident is None:
                    continue
                _first, duplicates = self._ops_running.pop(ident)
                self._remember_answer(ident, e)
                for reply_to in duplicates:
                    extra.append(attrs.evolve(e, reply_to=reply_to))
        out.extend(extra)

    def _begin_transfer(
        self, t: Transfer, ev: Store | PrepareStore | Retrieve | PrepareRetrieve, out: list[Effect]
    ) -> None:
        self._transfers[t.transfer_id] = t
        self._counters["transfers_started"] += 1
        skip = getattr(ev, "skip_first_n_tokens", 0)
        assert t.deadline is not None
        self._push_timer(t.deadline, "transfer", t.transfer_id)
        self._pin("transfer", t.transfer_id, [slot for _c, slot in t.placements])
        if t.engine_driven:
            out.append(Reply(ev.reply_to, TransferPlan(t.transfer_id, t.placements, True, t.kind, skip)))
        else:
            assert isinstance(ev, (Store, Retrieve))
            out.append(StartTransfer(
                t.transfer_id, t.kind, ev.instance_id, t.request_id, ev.reply_to,
                ev.key.start, ev.key.end, t.placements, ev.block_ids, skip,
                ev.not_after,
            ))

    def _on_transfer_finished(self, ev: TransferFinished, now: float, out: list[Effect]) -> None:
        t = self._transfers.get(ev.transfer_id)
        if t is None or t.engine_driven:
            self._counters["stale_events"] += 1
            if t is None and ev.transfer_id not in self._quarantined_plans:
                self._unpin("transfer", ev.transfer_id)  # expired earlier: the copy is over now
            return
        del self._transfers[ev.transfer_id]
        self._finish_transfer(t, bool(ev.ok), t.reply_to, now, out)
        self._unpin("transfer", t.transfer_id)

    def _on_commit(self, ev: CommitTransfer, now: float, out: list[Effect]) -> None:
        t = self._transfers.get(ev.transfer_id)
        if t is None or not t.engine_driven:
            if t is None and ev.transfer_id in self._quarantined_plans:
                # An expired plan's engine finished its copy after all: quarantine over.
                self._quarantined_plans.discard(ev.transfer_id)
                self._unpin("transfer", ev.transfer_id)
            self._error(out, ev.reply_to, ErrorKind.UNKNOWN_TRANSFER,
                                   f"no prepared transfer {ev.transfer_id}")
            return
        del self._transfers[ev.transfer_id]
        self._finish_transfer(t, bool(ev.ok), ev.reply_to, now, out)
        self._unpin("transfer", t.transfer_id)

    def _finish_transfer(
        self, t: Transfer, ok: bool, reply_to: ReplyTo, now: float, out: list[Effect]
    ) -> None:
        """Complete a transfer; ``reply_to`` None (an expired plan) sends no reply."""
        owner = ("transfer", t.transfer_id)
        if not ok:
            self._counters["transfers_failed"] += 1
        if t.kind is TransferKind.STORE:
            stored: list[ObjectKey] = []
            for k in t.keys:
                if ok:
                    if self.index.finish_write(k, owner, now):
                        stored.append(k)
                else:
                    self.index.abort_write(k, owner, now)
            result: object = StoreResult(ok and len(stored) == len(t.keys), len(stored),
                                         t.skipped + len(t.keys) - len(stored))
            if stored and self.config.write_behind:
                self._write_behind(stored, now, out)
            written = ok and len(stored) == len(t.keys)
            for wid in self._waits_on.pop(t.transfer_id, ()):
                self._end_awaited(wid, t.transfer_id, written, None, out)
            if t.wait_id is not None:
                assert isinstance(result, StoreResult)
                self._end_awaited(t.wait_id, t.transfer_id, result.ok, result, out)
                return
        else:
            for k in t.keys:
                self.index.release_read(k, owner, None, ReleaseReason.TRANSFER, now)
            if ok:
                self._release_after_retrieve(t.request_id, t.keys, now)
            result = RetrieveResult(ok, len(t.keys))
        if reply_to is not None:
            out.append(Reply(reply_to, result))

    def _end_awaited(self, wait_id: int, transfer_id: int, ok: bool, own: StoreResult | None,
                     out: list[Effect]) -> None:
        """Transfer ``transfer_id``, which store wait ``wait_id`` awaits, ended (``own``: it is the
        waiting store's own transfer, with its result); the last one sends the reply."""
        wait = self._store_waits[wait_id]
        wait.awaiting.discard(transfer_id)
        wait.ok = wait.ok and ok
        if own is not None:
            wait.stored, wait.skipped = own.stored, own.skipped
        if not wait.awaiting:
            del self._store_waits[wait_id]
            out.append(Reply(wait.reply_to, StoreResult(wait.ok, wait.stored, wait.skipped)))

    def _write_behind(self, keys: Sequence[ObjectKey], now: float, out: list[Effect]) -> None:
        wid = self._new_id()
        owner = ("l2write", wid)
        items = []
        for k in keys:
            if self.index.lease_read(k, owner, 1, now):
                slot = self.index.slot_of(k)
                assert slot is not None
                items.append((k, slot))
        if not items:
            return
        self._writes[wid] = tuple(k for k, _ in items)
        self._push_timer(now + self.config.lease_ttl, "l2_write", wid)
        self._counters["l2_writes"] += 1
        self._pin("l2write", wid, [slot for _k, slot in items])
        out.append(WriteL2(wid, tuple(items)))

    def _on_l2_write_finished(self, ev: L2WriteFinished, now: float, out: list[Effect]) -> None:
        keys = self._writes.pop(ev.write_id, None)
        if keys is None:
            self._counters["stale_events"] += 1
        else:
            for k in keys:
                self.index.release_read(k, ("l2write", ev.write_id), None, ReleaseReason.L2_WRITE, now)
        self._unpin("l2write", ev.write_id)  # late (lease expired) or not, the write is over

    def _on_l2_read_finished(self, ev: L2ReadFinished, now: float, out: list[Effect]) -> None:
        read = self._reads.pop(ev.read_id, None)
        if read is None:
            self._counters["stale_events"] += 1
            self._unpin("l2read", ev.read_id)  # expired: its slots leave quarantine now
            return
        owner = ("l2read", read.read_id)
        for i, k in enumerate(read.keys):
            if i < len(ev.loaded) and ev.loaded[i]:
                self.index.finish_write(k, owner, now)
            else:
                self.index.abort_write(k, owner, now)
        self._unpin("l2read", ev.read_id)
        job = self._jobs.get(read.request_id) if read.request_id is not None else None
        if job is None or job.serial != read.job_serial or job.read_id != read.read_id:
            return
        self._extend_and_complete(job, now, out)

    def _extend_and_complete(self, job: PrefetchJob, now: float, out: list[Effect]) -> None:
        """The job's hits: its L1 prefix, extended over the chunks now readable on every rank
        (contiguously), which it leases (except chunks already freed)."""
        hits = job.l1_prefix
        for i in range(job.l1_prefix, len(job.hashes)):
            keys = [ObjectKey(job.hashes[i], r) for r in job.rank_range()]
            if not all(self.index.is_readable(k) for k in keys):
                break
            if i not in job.freed_chunks and job.num_readers > 0:
                for k in keys:
                    self._lease_for_lookup(job.request_id, k, job.num_readers, now)
            hits += 1
        self._complete_job(job, hits, now, out)

    def _on_l2_probe_finished(self, ev: L2ProbeFinished, now: float, out: list[Effect]) -> None:
        probe = self._probes.pop(ev.probe_id, None)
        if probe is None:
            self._counters["stale_events"] += 1
            return
        job = self._jobs.get(probe.request_id)
        if job is None or job.serial != probe.job_serial or job.probe_id != probe.probe_id:
            return
        job.probe_id = None
        present = {k for i, k in enumerate(probe.keys) if i < len(ev.present) and ev.present[i]}
        upto = job.l1_prefix
        for i in range(job.l1_prefix, len(job.hashes)):
            if not all(self.index.is_readable(k) or k in present
                       for k in (ObjectKey(job.hashes[i], r) for r in job.rank_range())):
                break
            upto = i + 1
        if upto > job.l1_prefix and self._start_read(job, upto, now, out):
            return
        self._extend_and_complete(job, now, out)

    def _expire_read(self, read: L2Read, now: float, out: list[Effect]) -> None:
        """An L2 read never answered within the lease TTL: its reservations are dropped (the
        index expired them already) and a job still waiting on it resolves with its L1 prefix."""
        self._counters["l2_reads_expired"] += 1
        for k in read.keys:
            self.index.abort_write(k, ("l2read", read.read_id), now)
        job = self._jobs.get(read.request_id) if read.request_id is not None else None
        if job is not None and job.read_id == read.read_id:
            self._complete_job(job, job.l1_prefix, now, out)

    def _expire_probe(self, probe: L2Probe, now: float, out: list[Effect]) -> None:
        self._counters["l2_probes_expired"] += 1
        job = self._jobs.get(probe.request_id)
        if job is not None and job.serial == probe.job_serial and job.probe_id == probe.probe_id:
            self._complete_job(job, job.l1_prefix, now, out)

    def _on_timer(self, ev: TimerFired, now: float, out: list[Effect]) -> None:
        pass  # _advance already did the work

    # ============================================================================= time

    def _advance(self, now: float, out: list[Effect]) -> None:
        self.index.expire(now)
        while self._tombstones:
            rid, (_hits, expiry) = next(iter(self._tombstones.items()))
            if expiry > now:
                break
            del self._tombstones[rid]
        due_reaps = self._due_reaps = []
        while self._timers and self._timers[0][0] <= now:
            entry = heapq.heappop(self._timers)
            if not self._timer_live(entry):
                continue
            _deadline, _seq, kind, ident = entry
            if kind == "reap":
                assert isinstance(ident, tuple)
                due_reaps.append(ident[0])
            elif kind == "waiter":
                assert isinstance(ident, int)
                w = self._waiter_by_id.pop(ident)
                waiters = self._waiters[w.request_id]
                del waiters[ident]
                if not waiters:
                    del self._waiters[w.request_id]
                self._counters["waiter_timeouts"] += 1
                out.append(Reply(w.reply_to, None))
            elif kind == "l2_timeout":
                assert isinstance(ident, tuple)
                job = self._jobs[ident[0]]
                self._counters["l2_timeouts"] += 1
                if job.read_id is not None and job.read_id in self._reads:
                    self._reads[job.read_id].request_id = None
                self._complete_job(job, job.l1_prefix, now, out)
            elif kind == "transfer":
                # An uncommitted plan, or a completion the runtime never reported: fail it so
                # the request is answered (server-driven) and the bookkeeping is bounded.
                assert isinstance(ident, int)
                t = self._transfers.pop(ident)
                self._counters["expired_plans" if t.engine_driven else "expired_transfers"] += 1
                self._finish_transfer(t, False, None if t.engine_driven else t.reply_to, now, out)
                if t.engine_driven and ("transfer", ident) in self._pins:
                    # The engine may still be copying (its commit lost) or be gone: no event
                    # will say which, so its slots stay out of use one more lease TTL.
                    self._quarantined_plans.add(ident)
                    self._push_timer(now + self.config.lease_ttl, "plan_quarantine", ident)
            elif kind == "plan_quarantine":
                assert isinstance(ident, int)
                self._quarantined_plans.discard(ident)
                self._counters["plan_quarantines_ended"] += 1
                self._unpin("transfer", ident)
            elif kind == "l2_read":
                assert isinstance(ident, int)
                self._expire_read(self._reads.pop(ident), now, out)
            elif kind == "l2_probe":
                assert isinstance(ident, int)
                self._expire_probe(self._probes.pop(ident), now, out)
            elif kind == "l2_write":
                assert isinstance(ident, int)
                self._counters["l2_writes_expired"] += 1
                for k in self._writes.pop(ident):
                    self.index.release_read(k, ("l2write", ident), None, ReleaseReason.L2_WRITE, now)
        if due_reaps:
            self._reap_abandoned_jobs(now, out)
            self._due_reaps = []

    def _push_timer(self, deadline: float, kind: str, ident: Hashable) -> None:
        """Arm a timer. An entry whose subject ended first (a job ended, a waiter answered, a
        transfer finished) is not removed then: it goes stale, and is skipped when it comes
        due. So that stale entries cannot pile up for a whole TTL (memory would follow the
        request rate times the TTL), the heap is rebuilt from its live entries whenever it
        holds more than twice the live entries of the last rebuild plus a slack: amortised
        O(1) per timer, and the heap stays under ``2 * live + slack``. Entries are ordered by
        ``(deadline, seq)`` with a unique seq, so a rebuild changes no firing order."""
        heapq.heappush(self._timers, (deadline, self._new_id(), kind, ident))
        if len(self._timers) > self._timers_compact_at:
            self._timers = [e for e in self._timers if self._timer_live(e)]
            heapq.heapify(self._timers)
            self._timers_compact_at = 2 * len(self._timers) + _TIMER_COMPACT_SLACK
            self._counters["timer_compactions"] += 1

    def _timer_live(self, entry: tuple[float, int, str, Hashable]) -> bool:
        _deadline, _seq, kind, ident = entry
        if kind == "waiter":
            return ident in self._waiter_by_id
        if kind == "transfer":
            return ident in self._transfers
        if kind == "l2_read":
            return ident in self._reads
        if kind == "l2_probe":
            return ident in self._probes
        if kind == "l2_write":
            return ident in self._writes
        if kind == "plan_quarantine":
            return ident in self._quarantined_plans
        assert isinstance(ident, tuple)
        job = self._jobs.get(ident[0])
        if job is None or job.serial != ident[1]:
            return False
        if kind == "l2_timeout":
            return job.hits is None
        return True  # reap

    # ============================================================================= helpers

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _pin(self, kind: str, ident: int, slots: Sequence[int]) -> None:
        """An effect on ``slots`` is in flight: none of them goes to another object before
        ``_unpin`` (its completion event), even if its object is dropped meanwhile."""
        if not slots:
            return
        self._pins[(kind, ident)] = tuple(slots)
        for slot in slots:
            self.index.pin_slot(slot)

    def _unpin(self, kind: str, ident: int) -> None:
        for slot in self._pins.pop((kind, ident), ()):
            self.index.unpin_slot(slot)

    def _error(self, out: list[Effect], reply_to: ReplyTo, kind: ErrorKind, message: str) -> None:
        """Answer ``reply_to`` with a ``kind`` error (through ``_reply_error``)."""
        self._reply_error(out, reply_to, ProtocolError(kind, message))

    def _object_bytes_for(self, model_name: str, world_size: int) -> int:
        for inst in self._instances.values():
            if inst.model_name == model_name and inst.world_size == world_size:
                return inst.object_bytes
        return self.config.slot_bytes

    def _validate_key(self, key: CacheKey, *, scheduler: bool, aligned: bool = True) -> str | None:
        if not isinstance(key, CacheKey):
            return "key must be a CacheKey"
        if not isinstance(key.model_name, str):
            return "model_name must be a str"
        if not isinstance(key.world_size, int) or isinstance(key.world_size, bool) or key.world_size < 1:
            return f"world_size must be an int >= 1, not {key.world_size!r}"
        if not isinstance(key.request_id, str):
            return "request_id must be a str"
        salt_err = validate_cache_salt(key.cache_salt)
        if salt_err is not None:
            return salt_err
        extras_err = validate_extras(key.extras, self.config.max_chunks_per_request)
        if extras_err is not None:
            return extras_err
        if scheduler:
            if key.worker_id is not None:
                return "a scheduler key has worker_id None"
        elif not isinstance(key.worker_id, int) or not 0 <= key.worker_id < key.world_size:
            return f"worker_id must be in [0, {key.world_size}), not {key.worker_id!r}"
        if not isinstance(key.start, int) or not isinstance(key.end, int):
            return "start and end must be ints"
        if not 0 <= key.start <= key.end <= len(key.token_ids):
            return f"range [{key.start}, {key.end}) outside the {len(key.token_ids)} tokens"
        C = self.config.chunk_size
        if aligned and (key.start % C or key.end % C):
            return f"range [{key.start}, {key.end}) is not aligned to the chunk size {C}"
        if key.end // C > self.config.max_chunks_per_request:
            return "too many chunks in one request"
        return None

    def _hashes(self, key: CacheKey, num_chunks: int) -> tuple[tuple[bytes, ...], str | None]:
        ident = (key.model_name, key.world_size, key.cache_salt, key.extras.identity)
        root = self._roots.get(ident)
        if root is None:
            if len(self._roots) >= 1024:
                self._roots.clear()
            root = self._roots[ident] = keyed_root(identity_root(*ident[:3]), ident[3])
        try:
            return keyed_chunk_hashes(key.token_ids, self.config.chunk_size, root, num_chunks,
                                      key.extras.chunk_extras), None
        except (ValueError, TypeError, OverflowError) as exc:
            return (), f"token ids must be uint32: {exc}"

    def _worker_keys(
        self, key: CacheKey, instance_id: int, skip: int
    ) -> tuple[RegisterInstance | None, tuple[ObjectKey, ...] | ProtocolError]:
        inst = self._instances.get(instance_id)
        if inst is None:
            self._counters["errors"] += 1
            return None, ProtocolError(ErrorKind.NOT_REGISTERED, f"instance {instance_id!r} is not registered")
        err = self._validate_key(key, scheduler=False)
        if err is None and (key.model_name != inst.model_name or key.world_size != inst.world_size):
            err = "key model_name/world_size differ from the registered instance"
        if err is None and skip > key.end - key.start:
            err = "skip_first_n_tokens beyond the range"
        hashes: tuple[bytes, ...] = ()
        if err is None:
            hashes, err = self._hashes(key, key.end // self.config.chunk_size)
        if err is not None:
            self._counters["errors"] += 1
            return None, ProtocolError(ErrorKind.VALIDATION, err)
        assert key.worker_id is not None
        first = key.start // self.config.chunk_size
        return inst, tuple(ObjectKey(h, key.worker_id) for h in hashes[first:])


# Event type -> the name of its handler method, looked up on the instance so that a subclass
# (a simulator profile) can override one handler.
_DISPATCH: dict[type, str] = {
    Ping: "_on_ping",
    GetChunkSize: "_on_get_chunk_size",
    Lookup: "_on_lookup",
    QueryPrefetchStatus: "_on_query",
    WaitPrefetchStatus: "_on_wait",
    FreeLookupLocks: "_on_free",
    EndSession: "_on_end_session",
    Clear: "_on_clear",
    RegisterInstance: "_on_register",
    UnregisterInstance: "_on_unregister",
    Store: "_on_store",
    PrepareStore: "_on_store",
    Retrieve: "_on_retrieve",
    PrepareRetrieve: "_on_retrieve",
    CommitTransfer: "_on_commit",
    TransferFinished: "_on_transfer_finished",
    L2ReadFinished: "_on_l2_read_finished",
    L2ProbeFinished: "_on_l2_probe_finished",
    L2WriteFinished: "_on_l2_write_finished",
    TimerFired: "_on_timer",
}
