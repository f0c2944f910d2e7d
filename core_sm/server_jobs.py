"""Prefetch jobs: one per request id -- lookup, status, wait, free, end session, tombstones and
the reaper of abandoned jobs.

An event addresses the job of its request id (``Lookup``/``FreeLookupLocks``: ``key.request_id``;
the typed timers name theirs). The job's state is ``JobState``: ABSENT (never seen, ended,
reaped, or tombstone expired), PENDING (its L2 work is outstanding), DONE (hit count known, not
yet answered), ANSWERED (a tombstone repeats the answer). ``JOB_TABLE`` is what ``handle`` runs.
L2 completions address the L2 work (core_sm/server_l2.py), which hands the job its result here.

The legacy-profile hooks (``_status_for_unknown``, ``_on_duplicate_lookup``, ``_lease_for_lookup``,
``_release_for_free_lookup_locks``, ``_tombstone_after_answer``, ``_end_session``,
``_reap_abandoned_jobs``, ``_reply_error``) are methods of ``LookupServer``: this machine calls
them there, so a profile overrides one method of the server.

Ownership: a request id belongs to the peer (``Lookup.peer``, set by the runtime) whose lookup
first named it, for as long as the server holds anything of it (job, tombstone, leases); a
lookup, status query, wait, free or end session naming it from another peer is refused
``FORBIDDEN`` and changes nothing. Bounds: ``max_jobs`` live jobs in total and
``max_jobs_per_peer`` per peer, ``max_lookups_per_request`` lookups of one id (each refreshes its
leases); over them a lookup is refused ``TOO_LARGE``.
"""
from __future__ import annotations

import enum
import math
import sys
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from core_sm.chunks import ObjectKey, pack_hashes
from core_sm.effects import Effect, Reply
from core_sm.errors import ErrorKind
from core_sm.l1_index import ReleaseReason
from core_sm.messages import (
    CacheKey,
    Peer,
    EndSession,
    FreeLookupLocks,
    Lookup,
    QueryPrefetchStatus,
    ReplyTo,
    WaitPrefetchStatus,
)
from core_sm.server_core import ServerContext
from core_sm.table import Table
from core_sm.timers import Timer

if TYPE_CHECKING:
    from core_sm.server import LookupServer
    from core_sm.server_l2 import L2Probe, L2Read, L2Work


class JobState(enum.Enum):
    """State of the prefetch job of one request id."""

    ABSENT = "absent"  # never seen, ended, reaped, or tombstone expired
    PENDING = "pending"  # an L2 read is outstanding
    DONE = "done"  # hit count known, not yet answered
    ANSWERED = "answered"  # answered at least once; the tombstone repeats the answer


@attrs.frozen
class ReapJob(Timer):
    """The job was never answered within ``abandoned_job_ttl``: reap it (its leases go)."""

    request_id: str
    serial: int


@attrs.frozen
class L2Timeout(Timer):
    """The job's L2 work is not back within ``l2_read_timeout``: resolve with its L1 prefix."""

    request_id: str
    serial: int


@attrs.frozen
class WaiterDeadline(Timer):
    """A ``WaitPrefetchStatus`` reached its timeout: answer ``None``."""

    waiter_id: int
    request_id: str


@attrs.frozen
class ForgetRequestId(Timer):
    """The id's tombstone is gone but it still held leases then: forget its owner once it holds
    none (checked again every lease TTL)."""

    request_id: str


@attrs.define
class RequestIdOwner:
    """Who owns a request id, and how often it was looked up."""

    peer: Peer
    lookups: int = 0


@attrs.define
class PrefetchJob:
    """One request id's lookup: the L1 prefix it leased, its L2 read, its answer.

    It keeps the chunk hashes, never the token ids (a job left to its TTL by a client that went
    away costs its hashes and a few fields, not its prompt: ``mpcache-bench jobs``); the model
    name is interned so live jobs share one string."""

    request_id: str
    serial: int
    model_name: str
    world_size: int
    hashes: Sequence[bytes]  # chunks.pack_hashes: one buffer, not a bytes object per chunk
    num_readers: int
    l1_prefix: int
    created: float
    reap_at: float
    read_id: int | None = None
    probe_id: int | None = None
    l2_deadline: float | None = None
    hits: int | None = None
    freed_chunks: set[int] | None = None  # chunks FreeLookupLocks released (made on first use)
    ranks: tuple[int, ...] | None = None  # the KV ranks this server holds (None: all)
    peer: Peer = None

    @property
    def state(self) -> JobState:
        return JobState.PENDING if self.hits is None else JobState.DONE

    def rank_range(self) -> Sequence[int]:
        """The ranks whose objects make a chunk a hit (leased, read from L2)."""
        return range(self.world_size) if self.ranks is None else self.ranks


@attrs.define
class Waiter:
    waiter_id: int
    request_id: str
    reply_to: ReplyTo
    deadline: float


def _request_id(ev: Any) -> Hashable:
    """The request id an event addresses (None when it is not a str: the handler refuses it)."""
    rid = ev.key.request_id if isinstance(ev, (Lookup, FreeLookupLocks)) and isinstance(ev.key, CacheKey) \
        else getattr(ev, "request_id", None)
    return rid if isinstance(rid, str) else None


class JobTable(dict[str, PrefetchJob]):
    """The live jobs, counted per peer however a job leaves (a legacy profile deletes directly)."""

    def __init__(self) -> None:
        super().__init__()
        self.per_peer: dict[Peer, int] = {}

    def __setitem__(self, rid: str, job: PrefetchJob) -> None:
        old = self.get(rid)
        if old is not None:
            self._drop(old)
        super().__setitem__(rid, job)
        self.per_peer[job.peer] = self.per_peer.get(job.peer, 0) + 1

    def __delitem__(self, rid: str) -> None:
        self._drop(self[rid])
        super().__delitem__(rid)

    def pop(self, rid: str, default: Any = None) -> Any:
        job = super().pop(rid, None)
        if job is None:
            return default
        self._drop(job)
        return job

    def _drop(self, job: PrefetchJob) -> None:
        n = self.per_peer[job.peer] - 1
        if n:
            self.per_peer[job.peer] = n
        else:
            del self.per_peer[job.peer]


class JobMachine:
    """The prefetch jobs of one server (see the module docstring)."""

    def __init__(self, ctx: ServerContext, server: LookupServer, l2: L2Work) -> None:
        self.ctx = ctx
        self.server = server
        self.l2 = l2
        self.jobs = JobTable()
        self.owners: dict[str, RequestIdOwner] = {}
        self.tombstones: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self.waiters: dict[str, dict[int, Waiter]] = {}
        self.waiter_by_id: dict[int, Waiter] = {}
        self.dispatch = JOB_TABLE.bind(self, _request_id, self.state, ctx.counters, ctx.reply_error)

    # ============================================================================= queries

    def state(self, request_id: Hashable) -> JobState:
        job = self.jobs.get(request_id)  # type: ignore[call-overload]
        if job is not None:
            state: JobState = job.state
            return state
        return JobState.ANSWERED if request_id in self.tombstones else JobState.ABSENT

    def timer_live(self, timer: Timer) -> bool:
        if isinstance(timer, ForgetRequestId):
            return timer.request_id in self.owners and self.state(timer.request_id) is JobState.ABSENT
        if isinstance(timer, WaiterDeadline):
            return timer.waiter_id in self.waiter_by_id
        assert isinstance(timer, (ReapJob, L2Timeout))
        job = self.jobs.get(timer.request_id)
        if job is None or job.serial != timer.serial:
            return False
        return job.hits is None if isinstance(timer, L2Timeout) else True

    def expire_tombstones(self, now: float) -> None:
        while self.tombstones:
            rid, (_hits, expiry) = next(iter(self.tombstones.items()))
            if expiry > now:
                break
            self.tombstones.popitem(last=False)
            self._forget_owner(rid, now)

    def _forget_owner(self, rid: str, now: float) -> None:
        """The server no longer holds a job or tombstone of ``rid``: forget its owner now if it
        holds no lease either, else once it holds none."""
        if rid not in self.owners:
            return
        if self.ctx.index.holds(rid):
            self.ctx.timers.push(now + self.ctx.config.lease_ttl, ForgetRequestId(rid))
        else:
            del self.owners[rid]

    def _foreign(self, rid: str, peer: Peer, reply_to: ReplyTo, out: list[Effect]) -> bool:
        """Refuse (FORBIDDEN) a request naming an id another peer owns."""
        owner = self.owners.get(rid) if isinstance(rid, str) else None
        if owner is None or owner.peer == peer:
            return False
        self.ctx.error(out, reply_to, ErrorKind.FORBIDDEN, f"request id {rid!r} belongs to another peer")
        return True

    def next_tombstone_expiry(self) -> float | None:
        return next(iter(self.tombstones.values()))[1] if self.tombstones else None

    # ============================================================================= requests

    def _on_lookup(self, ev: Lookup, now: float, out: list[Effect]) -> None:
        ctx = self.ctx
        ctx.counters["lookups"] += 1
        err = ctx.validate_key(ev.key, scheduler=True)
        if err is None and ev.key.start != 0:
            err = f"a lookup key starts at token 0, not {ev.key.start}"
        if err is None and ev.ranks is not None:
            ranks, ws = ev.ranks, ev.key.world_size
            if not ranks or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < ws
                                    for r in ranks) or len(set(ranks)) != len(ranks):
                err = f"ranks must be distinct ints in [0, {ws}), not {ranks!r}"
        hashes: tuple[bytes, ...] = ()
        if err is None:
            hashes, err = ctx.hashes(ev.key, ev.key.end // ctx.config.chunk_size)
        if err is not None:
            ctx.error(out, ev.reply_to, ErrorKind.VALIDATION, err)
            return
        rid = ev.key.request_id
        if self._foreign(rid, ev.peer, ev.reply_to, out):
            return
        owner = self.owners.get(rid)
        if owner is not None and owner.lookups >= ctx.config.max_lookups_per_request:
            ctx.error(out, ev.reply_to, ErrorKind.TOO_LARGE,
                      f"request id {rid!r} looked up {owner.lookups} times")
            return
        job = self.jobs.get(rid)
        if job is None:
            if len(self.jobs) >= ctx.config.max_jobs:
                ctx.error(out, ev.reply_to, ErrorKind.TOO_LARGE, f"{len(self.jobs)} prefetch jobs live")
                return
            if self.jobs.per_peer.get(ev.peer, 0) >= ctx.config.max_jobs_per_peer:
                ctx.error(out, ev.reply_to, ErrorKind.TOO_LARGE, "too many prefetch jobs of this peer")
                return
        if owner is None:
            owner = self.owners[rid] = RequestIdOwner(ev.peer)
        owner.lookups += 1
        if job is not None:
            self.server._on_duplicate_lookup(job, ev, now, out)
            return
        self.tombstones.pop(rid, None)
        if ctx.admission is not None:
            ctx.admission.record(hashes)
        self.start_job(ev, hashes, now, out)

    def start_job(self, ev: Lookup, hashes: tuple[bytes, ...], now: float, out: list[Effect]) -> None:
        ctx, key, rid = self.ctx, ev.key, ev.key.request_id
        ranks = range(key.world_size) if ev.ranks is None else ev.ranks
        prefix, prefix_keys = ctx.index.readable_prefix(hashes, ranks)
        if ev.num_readers > 0:
            self.server._lease_prefix_for_lookup(rid, prefix_keys, ev.num_readers, now)
        ctx.counters["lookup_chunks"] += len(hashes)
        job = PrefetchJob(
            request_id=rid, serial=ctx.new_id(), model_name=sys.intern(key.model_name),
            world_size=key.world_size, hashes=pack_hashes(hashes),
            num_readers=ev.num_readers, l1_prefix=prefix, created=now,
            reap_at=now + ctx.config.abandoned_job_ttl, ranks=ev.ranks, peer=ev.peer,
        )
        self.jobs[rid] = job
        ctx.timers.push(job.reap_at, ReapJob(rid, job.serial))
        out.append(Reply(ev.reply_to, None))
        if ctx.config.l2_enabled and prefix < len(hashes):
            started = (self.l2.start_probe(job, now, out) if ctx.config.l2_probe
                       else self.l2.start_read(job, len(hashes), now, out))
            if started:
                job.l2_deadline = now + ctx.config.l2_read_timeout
                ctx.timers.push(job.l2_deadline, L2Timeout(rid, job.serial))
                return
        self.complete(job, prefix, now, out)

    def _on_query(self, ev: QueryPrefetchStatus, now: float, out: list[Effect]) -> None:
        self.ctx.counters["status_queries"] += 1
        if self._foreign(ev.request_id, ev.peer, ev.reply_to, out):
            return
        out.append(Reply(ev.reply_to, self._status(ev.request_id, now)))

    def _status(self, rid: str, now: float) -> int | None:
        job = self.jobs.get(rid)
        if job is not None:
            if job.hits is None:
                return None
            hits = job.hits
            self._consume(job, now)
            return hits
        tomb = self.tombstones.get(rid)
        if tomb is not None:
            return tomb[0]
        self.ctx.counters["unknown_status"] += 1
        return self.server._status_for_unknown(rid)

    def _on_wait(self, ev: WaitPrefetchStatus, now: float, out: list[Effect]) -> None:
        ctx = self.ctx
        ctx.counters["status_queries"] += 1
        if not isinstance(ev.timeout, (int, float)) or math.isnan(ev.timeout):
            ctx.error(out, ev.reply_to, ErrorKind.VALIDATION, "timeout must be a number")
            return
        if self._foreign(ev.request_id, ev.peer, ev.reply_to, out):
            return
        job = self.jobs.get(ev.request_id)
        if job is None or job.hits is not None or ev.timeout <= 0:
            out.append(Reply(ev.reply_to, self._status(ev.request_id, now)))
            return
        if len(self.waiter_by_id) >= ctx.config.max_waiters:
            ctx.error(out, ev.reply_to, ErrorKind.TOO_LARGE, "too many status waiters")
            return
        w = Waiter(ctx.new_id(), ev.request_id, ev.reply_to, now + min(ev.timeout, 1e9))
        self.waiters.setdefault(ev.request_id, {})[w.waiter_id] = w
        self.waiter_by_id[w.waiter_id] = w
        ctx.timers.push(w.deadline, WaiterDeadline(w.waiter_id, w.request_id))

    def _on_free(self, ev: FreeLookupLocks, now: float, out: list[Effect]) -> None:
        ctx, key = self.ctx, ev.key
        err = ctx.validate_key(key, scheduler=True, aligned=False)
        C = ctx.config.chunk_size
        hashes: tuple[bytes, ...] = ()
        if err is None:
            first, last = key.start // C, key.end // C
            hashes, err = ctx.hashes(key, last)
        if err is not None:
            ctx.error(out, ev.reply_to, ErrorKind.VALIDATION, err)
            return
        if self._foreign(key.request_id, ev.peer, ev.reply_to, out):
            return
        keys = [ObjectKey(hashes[i], r) for i in range(first, last) for r in range(key.world_size)]
        self.server._release_for_free_lookup_locks(key.request_id, keys, now)
        job = self.jobs.get(key.request_id)
        if job is not None and job.hits is None:
            if job.freed_chunks is None:
                job.freed_chunks = set()
            job.freed_chunks.update(range(first, last))
        out.append(Reply(ev.reply_to, None))

    def _on_end_session(self, ev: EndSession, now: float, out: list[Effect]) -> None:
        if self._foreign(ev.request_id, ev.peer, ev.reply_to, out):
            return
        self.server._end_session(ev.request_id, now, out)
        out.append(Reply(ev.reply_to, None))

    # ============================================================================= timers

    def _on_reap(self, timer: ReapJob, now: float, out: list[Effect]) -> None:
        self.server._due_reaps = [timer.request_id]
        self.server._reap_abandoned_jobs(now, out)
        self.server._due_reaps = []

    def _on_forget_request_id(self, timer: ForgetRequestId, now: float, out: list[Effect]) -> None:
        self._forget_owner(timer.request_id, now)

    def _on_waiter_deadline(self, timer: WaiterDeadline, now: float, out: list[Effect]) -> None:
        w = self.waiter_by_id.pop(timer.waiter_id)
        waiters = self.waiters[w.request_id]
        del waiters[timer.waiter_id]
        if not waiters:
            del self.waiters[w.request_id]
        self.ctx.counters["waiter_timeouts"] += 1
        out.append(Reply(w.reply_to, None))

    def _on_l2_timeout(self, timer: L2Timeout, now: float, out: list[Effect]) -> None:
        job = self.jobs[timer.request_id]
        self.ctx.counters["l2_timeouts"] += 1
        if job.read_id is not None:
            self.l2.detach_read(job.read_id)
        self.complete(job, job.l1_prefix, now, out)

    # ============================================================================= L2 results

    def read_finished(self, read: L2Read, now: float, out: list[Effect]) -> None:
        """The L2 read ``read`` landed (its objects are written or aborted)."""
        job = self.jobs.get(read.request_id) if read.request_id is not None else None
        if job is None or job.serial != read.job_serial or job.read_id != read.read_id:
            return
        self._extend_and_complete(job, now, out)

    def read_expired(self, read: L2Read, now: float, out: list[Effect]) -> None:
        job = self.jobs.get(read.request_id) if read.request_id is not None else None
        if job is not None and job.read_id == read.read_id:
            self.complete(job, job.l1_prefix, now, out)

    def probe_finished(self, probe: L2Probe, present: set[ObjectKey], now: float,
                       out: list[Effect]) -> None:
        job = self.jobs.get(probe.request_id)
        if job is None or job.serial != probe.job_serial or job.probe_id != probe.probe_id:
            return
        job.probe_id = None
        index = self.ctx.index
        upto = job.l1_prefix
        for i in range(job.l1_prefix, len(job.hashes)):
            if not all(index.is_readable(k) or k in present
                       for k in (ObjectKey(job.hashes[i], r) for r in job.rank_range())):
                break
            upto = i + 1
        if upto > job.l1_prefix and self.l2.start_read(job, upto, now, out):
            return
        self._extend_and_complete(job, now, out)

    def probe_expired(self, probe: L2Probe, now: float, out: list[Effect]) -> None:
        job = self.jobs.get(probe.request_id)
        if job is not None and job.serial == probe.job_serial and job.probe_id == probe.probe_id:
            self.complete(job, job.l1_prefix, now, out)

    def _extend_and_complete(self, job: PrefetchJob, now: float, out: list[Effect]) -> None:
        """The job's hits: its L1 prefix, extended over the chunks now readable on every rank
        (contiguously), which it leases (except chunks already freed)."""
        index = self.ctx.index
        hits = job.l1_prefix
        for i in range(job.l1_prefix, len(job.hashes)):
            keys = [ObjectKey(job.hashes[i], r) for r in job.rank_range()]
            if not all(index.is_readable(k) for k in keys):
                break
            if job.num_readers > 0 and (job.freed_chunks is None or i not in job.freed_chunks):
                for k in keys:
                    self.server._lease_for_lookup(job.request_id, k, job.num_readers, now)
            hits += 1
        self.complete(job, hits, now, out)

    # ============================================================================= helpers

    def complete(self, job: PrefetchJob, hits: int, now: float, out: list[Effect]) -> None:
        job.hits = hits
        job.read_id = None
        job.probe_id = None
        job.l2_deadline = None
        self.ctx.counters["hit_chunks"] += hits
        if job.request_id in self.waiters:
            self.answer_waiters(job.request_id, hits, out)
            self._consume(job, now)

    def _consume(self, job: PrefetchJob, now: float) -> None:
        assert job.hits is not None
        del self.jobs[job.request_id]
        self.server._tombstone_after_answer(job.request_id, job.hits, now)
        if job.request_id not in self.tombstones:  # a legacy profile keeps none
            self._forget_owner(job.request_id, now)

    def answer_waiters(self, rid: str, result: int | None, out: list[Effect]) -> None:
        for w in self.waiters.pop(rid, {}).values():
            del self.waiter_by_id[w.waiter_id]
            out.append(Reply(w.reply_to, result))

    def tombstone(self, request_id: str, hits: int, now: float) -> None:
        """Remember an answered job's count for ``tombstone_ttl`` (bounded by ``tombstone_cap``)."""
        self.tombstones[request_id] = (hits, now + self.ctx.config.tombstone_ttl)
        self.tombstones.move_to_end(request_id)
        while len(self.tombstones) > self.ctx.config.tombstone_cap:
            dropped, _entry = self.tombstones.popitem(last=False)
            self.ctx.counters["tombstones_dropped"] += 1
            self._forget_owner(dropped, now)

    def end_session(self, request_id: str, now: float, out: list[Effect]) -> None:
        """Drop job, tombstone, waiters; release the id's leases."""
        job = self.jobs.pop(request_id, None)
        if job is not None and job.read_id is not None:
            self.l2.detach_read(job.read_id)
        self.tombstones.pop(request_id, None)
        self.answer_waiters(request_id, 0, out)
        self.ctx.index.release_owner(request_id, ReleaseReason.END_SESSION, now)
        self.owners.pop(request_id, None)

    def reap(self, request_ids: Sequence[str], now: float, out: list[Effect]) -> None:
        """Drop the jobs of ``request_ids`` whose reap time has come, releasing their leases."""
        for rid in request_ids:
            job = self.jobs.get(rid)
            if job is None or job.reap_at > now:
                continue
            del self.jobs[rid]
            self.ctx.counters["reaped_jobs"] += 1
            if job.read_id is not None:
                self.l2.detach_read(job.read_id)
            self.answer_waiters(rid, 0, out)
            self.ctx.index.release_owner(rid, ReleaseReason.REAP, now)
            self.owners.pop(rid, None)

    def check_invariants(self) -> None:
        assert len(self.tombstones) <= self.ctx.config.tombstone_cap, "tombstone cap"
        for rid, job in self.jobs.items():
            assert job.request_id == rid
            assert rid not in self.tombstones, "a live job and a tombstone for one id"
            if job.hits is None:
                assert self.l2.is_reading(job.read_id) != self.l2.is_probing(job.probe_id), \
                    "pending job: one L2 step"
            else:
                assert 0 <= job.hits <= len(job.hashes), "hits out of range"
        for rid, waiters in self.waiters.items():
            assert waiters, "empty waiter list"
            waited = self.jobs.get(rid)
            assert waited is not None and waited.hits is None, "a waiter for a job that is not pending"
            for wid, w in waiters.items():
                assert self.waiter_by_id[wid] is w
        assert sum(len(w) for w in self.waiters.values()) == len(self.waiter_by_id)
        assert sum(self.jobs.per_peer.values()) == len(self.jobs), "per-peer job counts"
        for rid in self.jobs:
            assert rid in self.owners, "a job whose id has no owner"


J = JobState
# (state of the job the event addresses, event type) -> (handler, next states). A refused
# request (ErrorReply) leaves the state unchanged. A reap may leave the job where it is only in
# a legacy profile without a reaper.
JOB_TABLE: Table[JobState] = Table("LookupServer jobs (prefetch job of a request id)", JobState, J.ABSENT, {
    (J.ABSENT, Lookup): (JobMachine._on_lookup, {J.PENDING, J.DONE}),
    (J.ABSENT, QueryPrefetchStatus): (JobMachine._on_query, {J.ABSENT}),
    (J.ABSENT, WaitPrefetchStatus): (JobMachine._on_wait, {J.ABSENT}),
    (J.ABSENT, FreeLookupLocks): (JobMachine._on_free, {J.ABSENT}),
    (J.ABSENT, EndSession): (JobMachine._on_end_session, {J.ABSENT}),
    (J.PENDING, Lookup): (JobMachine._on_lookup, {J.PENDING}),
    (J.PENDING, QueryPrefetchStatus): (JobMachine._on_query, {J.PENDING}),
    (J.PENDING, WaitPrefetchStatus): (JobMachine._on_wait, {J.PENDING}),
    (J.PENDING, FreeLookupLocks): (JobMachine._on_free, {J.PENDING}),
    (J.PENDING, EndSession): (JobMachine._on_end_session, {J.ABSENT}),
    (J.PENDING, ReapJob): (JobMachine._on_reap, {J.ABSENT, J.PENDING}),
    (J.PENDING, WaiterDeadline): (JobMachine._on_waiter_deadline, {J.PENDING}),
    (J.PENDING, L2Timeout): (JobMachine._on_l2_timeout, {J.DONE, J.ANSWERED}),
    (J.DONE, Lookup): (JobMachine._on_lookup, {J.DONE}),
    (J.DONE, QueryPrefetchStatus): (JobMachine._on_query, {J.ANSWERED}),
    (J.DONE, WaitPrefetchStatus): (JobMachine._on_wait, {J.ANSWERED}),
    (J.DONE, FreeLookupLocks): (JobMachine._on_free, {J.DONE}),
    (J.DONE, EndSession): (JobMachine._on_end_session, {J.ABSENT}),
    (J.DONE, ReapJob): (JobMachine._on_reap, {J.ABSENT, J.DONE}),
    (J.ANSWERED, Lookup): (JobMachine._on_lookup, {J.PENDING, J.DONE}),
    (J.ANSWERED, QueryPrefetchStatus): (JobMachine._on_query, {J.ANSWERED}),
    (J.ANSWERED, WaitPrefetchStatus): (JobMachine._on_wait, {J.ANSWERED}),
    (J.ANSWERED, FreeLookupLocks): (JobMachine._on_free, {J.ANSWERED}),
    (J.ANSWERED, EndSession): (JobMachine._on_end_session, {J.ABSENT}),
    (J.ABSENT, ForgetRequestId): (JobMachine._on_forget_request_id, {J.ABSENT}),
})
JOB_TIMERS = (ReapJob, WaiterDeadline, L2Timeout, ForgetRequestId)
