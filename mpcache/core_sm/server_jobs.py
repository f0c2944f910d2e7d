"""Prefetch jobs: one per request -- lookup, status, wait, free, end session, tombstones and
the reaper of abandoned jobs.

A request is a ``RequestKey``: the peer that sent it (``Lookup.peer`` etc., set by the runtime)
and the request id it names. An event addresses the job of its request (``Lookup`` /
``FreeLookupLocks``: ``(peer, key.request_id)``; the typed timers name theirs). The job's state
is ``JobState``: ABSENT (never seen, ended, reaped, or tombstone expired), PENDING (its L2 work is
outstanding), DONE (hit count known, not yet answered), ANSWERED (a tombstone repeats the
answer). ``JOB_TABLE`` is what ``handle`` runs, and it *assigns*: every row names one next
state, which ``_set_state`` gives the job after the row's handler (ABSENT: its job and tombstone
forgotten); guards classify each raw event into the row it takes before anything changes (a
lookup's plan: refused, a duplicate, accepted, started). A started lookup's work runs right after
its row (``run``), and whatever resolves a pending job -- that work, an L2 completion (the L2 work,
core_sm/server_l2.py, hands the job its result here), a slice, an L2 timeout, a failure --
does so through a row of its own (``JobResolved``, ``L2Timeout``).

The legacy-profile hooks (``_status_for_unknown``, ``_overwrites_duplicate``, ``_lease_for_lookup``,
``_release_for_free_lookup_locks``, ``_keeps_tombstones``, ``_end_session``,
``_reaps_abandoned_jobs``, ``_reply_error``) are methods of ``LookupServer``, so a profile
overrides one method of the server; this machine reaches them through the ``JobHooks`` the
server gives it (and ``ServerContext.reply_error``), never through the server itself. The
hooks that decide a job's next state are predicates the guards read (``_overwrites_duplicate``,
``_keeps_tombstones``, ``_reaps_abandoned_jobs``), so a legacy server's flaw is a row of the
table (``OverwritingLookup``, ``ForgettingQuery`` ..., ``KeptAbandonedJob``), not a state no row
names.

Ownership: everything of a request -- its job, tombstone, waiters, lookup count and lookup read
leases -- is keyed by (peer, request id). Two peers naming the same request id are two
independent requests: a status query, wait, free or end session sees and changes only the
sender's own, so no peer can read, free, end or squat another's (a lookup of an id another peer
uses is simply a lookup of the sender's own). Bounds: ``max_jobs`` live jobs in total and
``max_jobs_per_peer`` per peer, ``max_lookups_per_request`` lookups of one request while the
server holds anything of it (each refreshes its leases); over them a lookup is refused
``TOO_LARGE``.

Acknowledge first (``ServerConfig.ack_first``): a lookup's reply carries nothing, so
``_on_lookup`` makes every check that can fail (key shape and bounds, salt, ranks, token ids,
the repeat cap, the job caps, a duplicate of a live job), registers the job -- *accepted*: PENDING
with no work yet, nothing leased -- and emits the ack; the rest (hashes, admission count, L1
prefix leases, L2 probe or read, or the hit count) is held in ``accepted`` and done by
``run_accepted``: ``LookupServer.run_deferred`` (the runtime, once the ack is sent) or the start
of the next ``handle``, whichever comes first. No event ever reaches an accepted job, so every
later message sees what it would have seen had the work run with the ack, and the work runs at
the lookup's own ``now``. What can still fail after the ack is a fault of the server itself (an
exception in hashing or leasing, e.g. ``MemoryError``): the job then resolves as 0 hits, the
lookup's leases go, ``stats()["lookup_work_failures"]`` counts it and a ``LookupWorkFailed``
effect tells the runtime to log it -- never a hang or a status left unanswered.

**A big prefix is leased in slices.** Leasing costs the loop about a microsecond per object, and
a lookup may name 65,536 (2,048 chunks x 32 ranks): a lookup whose chunks x ranks exceed
``LEASE_SLICE_OBJECTS`` leases at most that many objects per loop turn. Its job stays PENDING
(status ``None``) with its leasing cursor in ``continuing``; each ``handle`` first runs one slice
of the oldest (``run_continuing``), ``LookupServer.run_deferred`` one more, and
``next_deadline`` is due while any is left, so a quiet server finishes it on timer turns. Events
meanwhile see the job as they see one waiting on L2: a free of its range skips those chunks
(they still count as hits, as after an L2 read), an end session or reap drops it (its leases so
far go with it, the rest is never taken), the prefix ends where an object went meanwhile. Once
the prefix is leased the job goes on as any (L2 step, or its hit count).

**Its L2 step is walked in slices too** (``L2Walk``, core_sm/server_l2.py), in the same
``continuing`` queue: gathering the keys to probe, reserving the slots to read into (after the
probe answered: up to the first chunk it did not find whole), and landing a finished read while
the job's extension -- the chunks from its L1 prefix on readable on every rank -- is leased, at
most ``L2_SLICE_OBJECTS`` objects a slice. The first slice runs with the message, so a small
step is done at once. Between slices the job is PENDING as while L2 works; a job ended, reaped
or timed out meanwhile stops its walk: a probe is not sent, a read is sent for what was
reserved and lands for no one, a landing read finishes landing and leases nothing more.

The job records (``JobState``, ``PrefetchJob``, ``JobWork``) and the table of live jobs
(``JobTable``) are in core_sm/job_table.py.

Memory: a job whose hit count is known keeps no hashes (``PrefetchJob.work`` is dropped), and
its reap deadline is an entry of one ``ReapQueue`` (all jobs share ``abandoned_job_ttl``, so
they come due in the order they started) rather than a timer on the heap.
"""
from __future__ import annotations

import math
import sys
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import attrs

from mpcache.core_sm.chunks import ObjectKey, pack_hashes
from mpcache.core_sm.effects import Effect, LookupWorkFailed, Reply
from mpcache.core_sm.errors import ErrorKind
from mpcache.core_sm.l1_index import ReleaseReason
from mpcache.core_sm.messages import (
    CacheKey,
    EndSession,
    FreeLookupLocks,
    Lookup,
    QueryPrefetchStatus,
    ReplyTo,
    WaitPrefetchStatus,
)
from mpcache.core_sm.job_table import JobState, JobTable, JobWork, PrefetchJob
from mpcache.core_sm.server_core import RequestKey, ServerContext
from mpcache.core_sm.table import Table
from mpcache.core_sm.timers import ReapQueue, Timer

from mpcache.core_sm.server_l2 import L2Probe, L2Read, L2Walk, L2Work, WalkKind


# Objects one loop turn leases for a lookup (module doc); a lookup of at most this many is leased
# whole, as before.
LEASE_SLICE_OBJECTS = 2048


@attrs.define
class LeaseSlices:
    """A lookup whose prefix is being leased a slice per loop turn: the next chunk to lease."""

    job: PrefetchJob
    serial: int
    next_chunk: int
    now: float  # the lookup's: its leases expire as if taken with it


@attrs.frozen
class ReapJob(Timer):
    """The job was never answered within ``abandoned_job_ttl``: reap it (its leases go). Made
    when the reap queue says the job is due (the queue holds the job, not a timer)."""

    key: RequestKey


@attrs.frozen
class L2Timeout(Timer):
    """The job's L2 work is not back within ``l2_read_timeout``: resolve with its L1 prefix."""

    key: RequestKey
    serial: int


@attrs.frozen
class WaiterDeadline(Timer):
    """A ``WaitPrefetchStatus`` reached its timeout: answer ``None``."""

    waiter_id: int
    key: RequestKey


@attrs.frozen
class ForgetRequestId(Timer):
    """The request's job and tombstone are gone but it still held leases then: forget its lookup
    count once it holds none (checked again every lease TTL)."""

    key: RequestKey


# The specific events the guards classify into (each its own row, one next state), and the
# internal events a lookup's outcome runs as rows of its own.


@attrs.frozen
class RefusedLookup:
    """A Lookup refused (a malformed key, the repeat cap, the job caps): nothing changes."""

    lookup: Lookup
    kind: ErrorKind
    message: str


@attrs.frozen
class DuplicateLookup:
    """A Lookup of a request whose job is live: acknowledged, no second set of leases."""

    lookup: Lookup
    key: RequestKey
    lookups: int  # the request's lookups so far, this one included (0: it held nothing)


@attrs.frozen
class OverwritingLookup:
    """A legacy server's duplicate Lookup (F4): the live job is replaced and started again."""

    lookup: Lookup
    key: RequestKey
    lookups: int
    hashes: tuple[bytes, ...]


@attrs.frozen
class AcceptedLookup:
    """A new lookup acknowledged first, its work run after the ack (``ServerConfig.ack_first``)."""

    lookup: Lookup
    key: RequestKey
    lookups: int


@attrs.frozen
class StartedLookup:
    """A new lookup whose work runs right after its row (its chunk hashes made already)."""

    lookup: Lookup
    key: RequestKey
    lookups: int
    hashes: tuple[bytes, ...]


@attrs.frozen
class JobResolved:
    """The pending job's hit count is known (its work resolved), no waiter waiting: DONE."""

    key: RequestKey
    hits: int


@attrs.frozen
class ResolvedForWaiters:
    """``JobResolved`` with waiters: answered to them at once (ANSWERED)."""

    resolved: JobResolved


@attrs.frozen
class ResolvedForgotten:
    """``JobResolved`` with waiters, on a server that keeps no tombstone: ABSENT."""

    resolved: JobResolved


@attrs.frozen
class L2TimeoutForWaiters:
    """``L2Timeout`` with waiters: resolved with its L1 prefix and answered (ANSWERED)."""

    timeout: L2Timeout


@attrs.frozen
class L2TimeoutForgotten:
    """``L2Timeout`` with waiters, on a server that keeps no tombstone: ABSENT."""

    timeout: L2Timeout


@attrs.frozen
class AckDue:
    """The ack of a lookup that asked for its answer in it, after its work: ``None`` while the
    job is not DONE."""

    key: RequestKey
    reply_to: ReplyTo


@attrs.frozen
class AnswerInAck:
    """``AckDue`` of a DONE job: the ack carries the count, and answers the job (ANSWERED)."""

    ack: AckDue


@attrs.frozen
class AnswerInAckForgotten:
    """``AnswerInAck`` on a server that keeps no tombstone: ABSENT."""

    ack: AckDue


@attrs.frozen
class ForgettingQuery:
    """A status query of a DONE job on a server that keeps no tombstone: answered, ABSENT."""

    query: QueryPrefetchStatus


@attrs.frozen
class RefusedWait:
    """A WaitPrefetchStatus refused (no number for a timeout, or ``max_waiters`` reached)."""

    wait: WaitPrefetchStatus
    kind: ErrorKind
    message: str


@attrs.frozen
class ForgettingWait:
    """A wait on a DONE job on a server that keeps no tombstone: answered, ABSENT."""

    wait: WaitPrefetchStatus


@attrs.frozen
class RefusedFree:
    """A FreeLookupLocks of a malformed range: refused, nothing changes."""

    free: FreeLookupLocks
    kind: ErrorKind
    message: str


@attrs.frozen
class AdmittedFree:
    """A FreeLookupLocks with its range's chunk hashes (chunks ``first`` to ``last``)."""

    free: FreeLookupLocks
    hashes: tuple[bytes, ...]
    first: int
    last: int


@attrs.frozen
class TombstoneExpired:
    """The request's tombstone reached its ``tombstone_ttl`` (made by the time step)."""

    key: RequestKey


@attrs.frozen
class TombstoneDropped:
    """The request's tombstone, the oldest, makes room under ``tombstone_cap`` for a newer one."""

    key: RequestKey


@attrs.frozen
class KeptAbandonedJob:
    """A ``ReapJob`` on a legacy server that reaps nothing (F12): the job stays."""

    reap: ReapJob


@attrs.define
class Waiter:
    waiter_id: int
    key: RequestKey
    reply_to: ReplyTo
    deadline: float


def _request_key(ev: Any) -> Hashable:
    """The request an event addresses: (its peer, its request id), or the key a timer names
    (None when the request id is not a str: the handler refuses it)."""
    rid: object
    if isinstance(ev, (Lookup, FreeLookupLocks)):
        rid = ev.key.request_id if isinstance(ev.key, CacheKey) else None
    else:
        rid = getattr(ev, "request_id", None)
        if rid is None:
            return getattr(ev, "key", None)  # a timer
    return RequestKey(ev.peer, rid) if isinstance(rid, str) else None


class JobHooks(Protocol):
    """The server's legacy-profile hooks a job calls (module doc): ``LookupServer`` forwards
    each to its method of that name (``_status_for_unknown`` ...), which a profile overrides.
    What decides a job's next state is a predicate (``overwrites_duplicate``,
    ``keeps_tombstones``, ``reaps_abandoned_jobs``): the guards read it to pick the row."""

    def status_for_unknown(self, key: RequestKey) -> int | None: ...

    def overwrites_duplicate(self, job: PrefetchJob, event: Lookup) -> bool:
        """Whether a Lookup of a live job replaces it and starts again (legacy: F4), rather
        than being acknowledged with nothing taken."""

    def keeps_tombstones(self) -> bool:
        """Whether an answered job leaves a tombstone (legacy: none, F1/F2)."""

    def reaps_abandoned_jobs(self) -> bool:
        """Whether a job due for reaping is reaped (legacy: never, F12)."""

    def lease_for_lookup(self, owner: RequestKey, key: ObjectKey, num_readers: int, now: float) -> None: ...

    def lease_prefix_for_lookup(self, owner: RequestKey, hashes: Sequence[bytes], ranks: Sequence[int],
                                num_readers: int, now: float) -> int: ...

    def release_for_free_lookup_locks(self, owner: RequestKey, keys: Sequence[ObjectKey], now: float) -> int: ...

    def end_session(self, key: RequestKey, now: float, out: list[Effect]) -> None: ...

    def fixed_lease_for_lookup(self) -> bool:
        """Whether ``lease_for_lookup`` is the server's own (no profile overrides it): the
        lease walks may then lease many objects at once instead of calling it per object."""

    def fixed_release_for_free(self) -> bool:
        """Whether ``release_for_free_lookup_locks`` is the server's own: a free may then
        release in slices of what the request holds."""


class JobMachine:
    """The prefetch jobs of one server (see the module docstring)."""

    # What the server's ``state_values`` carries of this part, and the wiring it leaves out
    # (core_sm/values.py; tests/core_sm/test_state_values.py holds every attribute to one).
    STATE_FIELDS: tuple[str, ...] = ("repeats", "tombstones", "waiters", "waiter_by_id", "accepted", "continuing", "working")
    WIRING_FIELDS: tuple[str, ...] = ("ctx", "hooks", "l2", "jobs", "reap_queue", "dispatch")

    def __init__(self, ctx: ServerContext, hooks: JobHooks, l2: L2Work) -> None:
        self.ctx = ctx
        self.hooks = hooks
        self.l2 = l2
        self.jobs = JobTable()
        # jobs in the order their reap deadlines come (one TTL: a FIFO, no timer per job)
        self.reap_queue: ReapQueue[PrefetchJob] = ReapQueue(self.jobs.holds)
        # Lookups beyond the first of a request that is still held (job, tombstone or leases),
        # for max_lookups_per_request: a request looked up once costs no entry here.
        self.repeats: dict[RequestKey, int] = {}
        self.tombstones: OrderedDict[RequestKey, tuple[int, float]] = OrderedDict()
        self.waiters: dict[RequestKey, dict[int, Waiter]] = {}
        self.waiter_by_id: dict[int, Waiter] = {}
        # ack_first: the acknowledged lookup whose work has not run (job, event, its now). At
        # most one: every handle runs it before anything else.
        self.accepted: tuple[PrefetchJob, Lookup, float] | None = None
        # lookups whose prefix is leased, and L2 steps walked, in slices (module doc), oldest first
        self.continuing: deque[LeaseSlices | L2Walk] = deque()
        # the lookup a row just started: its work runs right after the row (``run``)
        self.working: tuple[PrefetchJob, Lookup, tuple[bytes, ...], float] | None = None
        self.dispatch = JOB_TABLE.bind(self, _request_key, self.state, ctx.counters, ctx.reply_error,
                                       self._set_state)

    # ============================================================================= queries

    def state(self, key: Hashable) -> JobState:
        if not isinstance(key, RequestKey):
            return JobState.ABSENT
        job = self.jobs.get(key)
        if job is not None:
            return job.state
        return JobState.ANSWERED if key in self.tombstones else JobState.ABSENT

    def timer_live(self, timer: Timer) -> bool:
        if isinstance(timer, ForgetRequestId):
            return timer.key in self.repeats and self.state(timer.key) is JobState.ABSENT
        if isinstance(timer, WaiterDeadline):
            return timer.waiter_id in self.waiter_by_id
        if isinstance(timer, ReapJob):
            return timer.key in self.jobs
        assert isinstance(timer, L2Timeout)
        job = self.jobs.get(timer.key)
        return job is not None and job.hits is None and job.serial == timer.serial

    def held(self, key: RequestKey) -> bool:
        """Whether the server holds anything of the request: a job, a tombstone or a lease."""
        return key in self.jobs or key in self.tombstones or self.ctx.index.holds(key)

    def expire_tombstones(self, now: float, out: list[Effect]) -> None:
        """The tombstones whose ``tombstone_ttl`` passed go, each by its row (``TombstoneExpired``)."""
        while self.tombstones:
            key, (_hits, expiry) = next(iter(self.tombstones.items()))
            if expiry > now:
                break
            self.dispatch.run(TombstoneExpired(key), now, out)

    def due_reaps(self, now: float) -> list[RequestKey]:
        """The requests whose jobs reached their reap deadline at ``now``, taken off the queue."""
        due: list[RequestKey] = []
        job = self.reap_queue.pop_due(now)
        while job is not None:
            due.append(job.key)
            job = self.reap_queue.pop_due(now)
        return due

    def _forget_repeats(self, key: RequestKey, now: float) -> None:
        """The server no longer holds a job or tombstone of ``key``: forget its lookup count now
        if it holds no lease either, else once it holds none."""
        if key not in self.repeats:
            return
        if self.ctx.index.holds(key):
            self.ctx.timers.push(now + self.ctx.config.lease_ttl, ForgetRequestId(key))
        else:
            del self.repeats[key]

    def next_tombstone_expiry(self) -> float | None:
        return next(iter(self.tombstones.values()))[1] if self.tombstones else None

    # ============================================================================= requests

    def _classify_lookup(self, ev: Lookup, state: JobState, now: float) -> Any:
        """The lookup's plan, made before anything changes (the checks ``_on_lookup`` once made as
        it went, in the same order): refused (``RefusedLookup``), a duplicate of a live job
        (``DuplicateLookup``, or ``OverwritingLookup`` where the server's hook says a duplicate
        replaces the job), accepted to run after its ack (``AcceptedLookup``, ``ack_first``) or
        started now (``StartedLookup``, carrying its chunk hashes)."""
        ctx = self.ctx
        err = ctx.validate_key(ev.key, scheduler=True)
        if err is None and ev.key.start != 0:
            err = f"a lookup key starts at token 0, not {ev.key.start}"
        if err is None and ev.ranks is not None:
            ranks, ws = ev.ranks, ev.key.world_size
            if not ranks or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < ws
                                    for r in ranks) or len(set(ranks)) != len(ranks):
                err = f"ranks must be distinct ints in [0, {ws}), not {ranks!r}"
        num_chunks = ev.key.end // ctx.config.chunk_size if err is None else 0
        if err is None:
            err = ctx.token_error(ev.key, num_chunks)
        if err is not None:
            return RefusedLookup(ev, ErrorKind.VALIDATION, err)
        key = RequestKey(ev.peer, ev.key.request_id)
        job = self.jobs.get(key)
        held = job is not None or self.held(key)
        lookups = 1 + self.repeats.get(key, 0) if held else 0
        if lookups >= ctx.config.max_lookups_per_request:
            return RefusedLookup(ev, ErrorKind.TOO_LARGE, f"request id {key.request_id!r} looked up {lookups} times")
        if job is None:
            if len(self.jobs) >= ctx.config.max_jobs:
                return RefusedLookup(ev, ErrorKind.TOO_LARGE, f"{len(self.jobs)} prefetch jobs live")
            if self.jobs.count_of(ev.peer) >= ctx.config.max_jobs_per_peer:
                return RefusedLookup(ev, ErrorKind.TOO_LARGE, "too many prefetch jobs of this peer")
        if job is not None:
            if self.hooks.overwrites_duplicate(job, ev):
                hashes, _err = ctx.hashes(ev.key, num_chunks)
                return OverwritingLookup(ev, key, lookups, hashes)
            return DuplicateLookup(ev, key, lookups)
        if ctx.config.ack_first and not ev.answer_in_ack:
            return AcceptedLookup(ev, key, lookups)
        hashes, err = ctx.hashes(ev.key, num_chunks)
        if err is not None:  # token_error checked it already: kept as a guard
            return RefusedLookup(ev, ErrorKind.VALIDATION, err)
        return StartedLookup(ev, key, lookups, hashes)

    def _count_lookup(self, key: RequestKey, lookups: int) -> None:
        """A lookup that is not refused: counted, and (``lookups``: the server held something of
        the request) its repeats with it."""
        self.ctx.counters["lookups"] += 1
        if lookups:
            self.repeats[key] = lookups
        else:
            self.repeats.pop(key, None)  # a count left from before everything of it went

    def _on_refused_lookup(self, ev: RefusedLookup, now: float, out: list[Effect]) -> None:
        self.ctx.counters["lookups"] += 1
        self.ctx.error(out, ev.lookup.reply_to, ev.kind, ev.message)

    def _on_duplicate_lookup(self, ev: DuplicateLookup, now: float, out: list[Effect]) -> None:
        """A Lookup for an id whose job is live: ack, take no second set of leases."""
        self._count_lookup(ev.key, ev.lookups)
        self.ctx.counters["duplicate_lookups"] += 1
        out.append(Reply(ev.lookup.reply_to, None))

    def _on_overwriting_lookup(self, ev: OverwritingLookup, now: float, out: list[Effect]) -> None:
        """A legacy server's duplicate Lookup (F4): the live job is replaced (its leases, its L2
        read and its reap entry left as they are) and the lookup starts again, at once."""
        self._count_lookup(ev.key, ev.lookups)
        self.ctx.counters["duplicate_lookups"] += 1
        del self.jobs[ev.key]
        self.start_job(ev.lookup, ev.hashes, now, out)

    def _on_accepted_lookup(self, ev: AcceptedLookup, now: float, out: list[Effect]) -> None:
        """Acknowledged now, its work run after the ack (module doc)."""
        self._count_lookup(ev.key, ev.lookups)
        self.tombstones.pop(ev.key, None)
        job = self._register(ev.lookup, now, out)
        self.accepted = (job, ev.lookup, now)

    def _on_started_lookup(self, ev: StartedLookup, now: float, out: list[Effect]) -> None:
        """Registered now; its work runs right after this row (``run``)."""
        self._count_lookup(ev.key, ev.lookups)
        self.tombstones.pop(ev.key, None)
        admission = self.ctx.admission
        if admission is not None:
            admission.record(ev.hashes)
        self.start_job(ev.lookup, ev.hashes, now, out)

    def _register(self, ev: Lookup, now: float, out: list[Effect], *, ack: bool = True) -> PrefetchJob:
        """Make the request's job (no work yet), queue its reap and (``ack``) acknowledge the
        lookup."""
        key = RequestKey(ev.peer, ev.key.request_id)
        job = PrefetchJob(key.request_id, self.jobs.canonical(ev.peer))
        self.jobs[key] = job
        self.reap_queue.push(now + self.ctx.config.abandoned_job_ttl, job)
        if ack:
            out.append(Reply(ev.reply_to, None))
        return job

    def start_job(self, ev: Lookup, hashes: tuple[bytes, ...], now: float, out: list[Effect]) -> None:
        """Register the job and acknowledge the lookup; its work (the whole lookup at once) runs
        right after the row (``run``). A lookup that asks for its answer in the ack
        (``Lookup.answer_in_ack``) is acknowledged after its work, by a row of its own
        (``AckDue``), with ``ack_answer``'s value."""
        job = self._register(ev, now, out, ack=not ev.answer_in_ack)
        self.working = (job, ev, hashes, now)

    def run(self, event: Any, now: float, out: list[Effect]) -> None:
        """Run ``event``'s row; then the work of the lookup that row started, if any -- its
        outcome a row of its own (``JobResolved``, from wherever the work resolves), as an L2
        completion's is -- and the ack of a lookup that asks for its answer in it."""
        self.working = None
        self.dispatch.run(event, now, out)
        working = self.working
        if working is None:
            return
        self.working = None
        job, ev, hashes, started = working
        if not ev.answer_in_ack:
            self._work(job, ev, hashes, started, out)
            return
        try:
            self._work(job, ev, hashes, started, out)
        except Exception as exc:  # a fault of the server: the job resolves as 0, answered so
            self._work_failed(job, f"{type(exc).__name__}: {exc}", started, out)
        self.dispatch.run(AckDue(job.key, ev.reply_to), started, out)

    def ack_answer(self, key: RequestKey, now: float) -> int | None:
        """What the ack of a lookup asking for its answer in the ack carries, right after its
        work: the hit count when it is final already -- its prefix leased from L1 and no L2 step
        needed or possible (none enabled, the whole key in L1, or nothing to probe or read) --
        and the job is then answered exactly as a status query answers it (a tombstone repeats
        the count; the leases stay until the retrieve, free or end session): the rows
        ``AnswerInAck`` / ``AnswerInAckForgotten`` (its job DONE). ``None`` (the ordinary ack,
        ``AckDue``) while anything is left: an L2 probe or read, a prefix leased in slices; the
        client then asks for the status as with any lookup."""
        self.ctx.counters["lookups_answered_in_ack"] += 1
        return self._status(key, now)

    def _classify_ack(self, ev: AckDue, state: JobState, now: float) -> Any:
        if state is not JobState.DONE:
            return ev
        return AnswerInAck(ev) if self._keeps_tombstone() else AnswerInAckForgotten(ev)

    def _on_ack(self, ev: AckDue, now: float, out: list[Effect]) -> None:
        out.append(Reply(ev.reply_to, None))

    def _on_answer_in_ack(self, ev: AnswerInAck | AnswerInAckForgotten, now: float, out: list[Effect]) -> None:
        out.append(Reply(ev.ack.reply_to, self.ack_answer(ev.ack.key, now)))

    def run_accepted(self, out: list[Effect]) -> None:
        """Do the work of the acknowledged lookup, if one waits (module docstring)."""
        accepted = self.accepted
        if accepted is None:
            return
        self.accepted = None
        job, ev, now = accepted
        ctx = self.ctx
        try:
            hashes, err = ctx.hashes(ev.key, ev.key.end // ctx.config.chunk_size)
            if err is not None:
                raise ValueError(err)
            if ctx.admission is not None:
                ctx.admission.record(hashes)
            self._work(job, ev, hashes, now, out)
        except Exception as exc:  # a fault of the server: the job must still resolve
            self._work_failed(job, f"{type(exc).__name__}: {exc}", now, out)

    def _work_failed(self, job: PrefetchJob, reason: str, now: float, out: list[Effect]) -> None:
        """The accepted job's work raised: resolve it as 0 hits, with none of its leases."""
        ctx = self.ctx
        ctx.counters["lookup_work_failures"] += 1
        out.append(LookupWorkFailed(job.request_id, reason[:500]))
        if not self.jobs.holds(job) or job.hits is not None:
            return
        if job.work is not None and job.read_id is not None:
            self.l2.detach_read(job.read_id)
        job.work = None
        ctx.index.release_owner(job.key, ReleaseReason.FREE, now)
        self.complete(job, 0, now, out)

    def _work(self, job: PrefetchJob, ev: Lookup, hashes: tuple[bytes, ...], now: float,
              out: list[Effect]) -> None:
        """A registered job's lookup work: lease its L1 prefix, then start its L2 step or know
        its hit count."""
        ctx, ckey = self.ctx, ev.key
        key = job.key
        ranks = range(ckey.world_size) if ev.ranks is None else ev.ranks
        per_turn = max(1, LEASE_SLICE_OBJECTS // max(1, len(ranks)))
        sliced = (len(hashes) * len(ranks) > LEASE_SLICE_OBJECTS and ev.num_readers > 0
                  and self.hooks.fixed_lease_for_lookup())
        first = hashes[:per_turn] if sliced else hashes
        prefix = self.hooks.lease_prefix_for_lookup(key, first, ranks, ev.num_readers, now)
        ctx.counters["lookup_chunks"] += len(hashes)
        job.work = JobWork(
            serial=ctx.new_id(), model_name=sys.intern(ckey.model_name), world_size=ckey.world_size,
            hashes=pack_hashes(hashes), num_readers=ev.num_readers, l1_prefix=prefix, ranks=ev.ranks,
        )
        if sliced and prefix == len(first) < len(hashes):
            self.continuing.append(LeaseSlices(job, job.work.serial, prefix, now))
            return
        self._after_l1(job, now, out)

    def run_continuing(self, out: list[Effect]) -> None:
        """One slice of the oldest lookup leasing in slices, or of the oldest L2 walk (module
        doc)."""
        if not self.continuing:
            return
        cont = self.continuing.popleft()
        if isinstance(cont, L2Walk):
            try:
                if not self._walk_slice(cont, out):
                    self.continuing.append(cont)
            except Exception as exc:  # a fault of the server: the job must still resolve
                if cont.job is not None and self._live(cont.job, cont.serial):
                    self._work_failed(cont.job, f"{type(exc).__name__}: {exc}", cont.now, out)
            return
        job = cont.job
        if self.jobs.get(job.key) is not job or job.serial != cont.serial:
            return  # ended or reaped meanwhile: what it leased went with it
        try:
            self._lease_slice(cont, out)
        except Exception as exc:  # a fault of the server: the job must still resolve
            self._work_failed(job, f"{type(exc).__name__}: {exc}", cont.now, out)

    def _live(self, job: PrefetchJob, serial: int | None) -> bool:
        """Whether ``job`` is still the pending job of its request, with that work."""
        return job.hits is None and job.serial == serial and self.jobs.get(job.key) is job

    def _walk_slice(self, walk: L2Walk, out: list[Effect]) -> bool:
        """Run one slice of ``walk`` (core_sm/server_l2.py), and what follows when it is over;
        returns whether it is over."""
        job, l2 = walk.job, self.l2
        live = job is not None and self._live(job, walk.serial)
        if walk.kind is WalkKind.PROBE:
            if not live:
                return True  # ended, reaped or timed out meanwhile: nothing was taken
            assert job is not None
            started = l2.walk_probe(walk, out)
            if started is None:
                return False
            if not started:
                self.complete(job, job.l1_prefix, walk.now, out)
            return True
        if walk.kind is WalkKind.READ:
            if live and not l2.walk_read(walk):
                return False
            if l2.emit_read(walk, live, out) or not live:
                return True
            assert job is not None
            if not walk.probe_keys:
                self.complete(job, job.l1_prefix, walk.now, out)
                return True
            # after a probe, nothing to read: the hits are what is readable now, leased
            walk.kind, walk.hits, walk.chunk = WalkKind.LANDED, job.l1_prefix, job.l1_prefix
        return self._land_slice(walk, live and walk.leasing, out)

    def _land_slice(self, walk: L2Walk, leasing: bool, out: list[Effect]) -> bool:
        """One slice of a LANDED walk: the read's next objects land, then (``leasing``: its job
        is live) the job's extension -- the chunks from its L1 prefix on readable on every rank,
        contiguously -- is leased over the chunks landed so far (except chunks freed)."""
        job = walk.job
        upto = self.l2.land(walk) if walk.read is not None else 1 << 62
        if leasing:
            assert job is not None
            work = job.pending()
            hashes, ranks = job.hashes, job.rank_range()
            start = walk.chunk
            end = min(upto, len(hashes), start + self.l2.per_turn(job))
            if end > start:
                index = self.ctx.index
                chunks, keys = index.readable_prefix(hashes[start:end], ranks)
                freed = work.freed_chunks
                if freed and keys:
                    n = max(1, len(ranks))
                    keys = [k for j, k in enumerate(keys) if start + j // n not in freed]
                if work.num_readers > 0 and keys:
                    if self.hooks.fixed_lease_for_lookup():
                        # one batch a slice: one expiry entry, not one per object (a leased object
                        # leaves its LRU set, so the hook's touch has nothing to move)
                        index.lease_reads(keys, job.key, work.num_readers, walk.now, top_up=True, refresh=True)
                    else:
                        for k in keys:
                            self.hooks.lease_for_lookup(job.key, k, work.num_readers, walk.now)
                walk.chunk = start + chunks
                walk.hits += chunks
                if chunks < end - start:
                    walk.leasing = leasing = False
        read = walk.read
        if read is not None and walk.cursor < len(read.keys):
            return False
        if leasing:
            assert job is not None
            if walk.chunk < len(job.hashes):
                return False
        if job is not None and self._live(job, walk.serial) and (read is None or job.read_id == read.read_id):
            self.complete(job, walk.hits, walk.now, out)
        return True

    def _lease_slice(self, cont: LeaseSlices, out: list[Effect]) -> None:
        job = cont.job
        work = job.pending()
        hashes, ranks = job.hashes, job.rank_range()
        per_turn = max(1, LEASE_SLICE_OBJECTS // max(1, len(ranks)))
        start = cont.next_chunk
        chunk_hashes = hashes[start:start + per_turn]
        index = self.ctx.index
        freed = work.freed_chunks
        if freed is None or not any(start + i in freed for i in range(len(chunk_hashes))):
            prefix = index.lease_prefix(chunk_hashes, ranks, job.key, work.num_readers, cont.now)
        else:  # a free of this range came meanwhile: those chunks count, unleased
            prefix, keys = index.readable_prefix(chunk_hashes, ranks)
            n = len(ranks)
            index.lease_reads([k for j, k in enumerate(keys) if start + j // n not in freed], job.key,
                              work.num_readers, cont.now, top_up=True, refresh=True)
        work.l1_prefix = start + prefix
        if prefix == len(chunk_hashes) and work.l1_prefix < len(hashes):
            cont.next_chunk = work.l1_prefix
            self.continuing.append(cont)
            return
        self._after_l1(job, cont.now, out)

    def next_continuation(self) -> float | None:
        """When the oldest sliced lookup's next slice is due (its lookup's time), or None."""
        return self.continuing[0].now if self.continuing else None

    def _after_l1(self, job: PrefetchJob, now: float, out: list[Effect]) -> None:
        """The job's L1 prefix is leased: start its L2 step or know its hit count."""
        ctx = self.ctx
        key = job.key
        prefix = job.l1_prefix
        hashes = job.pending().hashes
        if ctx.config.l2_enabled and prefix < len(hashes):
            # what to probe or read is walked a slice per loop turn (server_l2): the first now
            work = job.pending()
            walk = self.l2.begin(WalkKind.PROBE if ctx.config.l2_probe else WalkKind.READ, job, now)
            over = self._walk_slice(walk, out)
            if over and job.hits is not None:
                return  # nothing to probe or read: complete already
            work.l2_deadline = now + ctx.config.l2_read_timeout
            ctx.timers.push(work.l2_deadline, L2Timeout(key, work.serial))
            if not over:
                self.continuing.append(walk)
            return
        self.complete(job, prefix, now, out)

    def _classify_query(self, ev: QueryPrefetchStatus, state: JobState, now: float) -> Any:
        """A DONE job's status answers it: ANSWERED, or forgotten where the server keeps no
        tombstone (``ForgettingQuery``)."""
        return ForgettingQuery(ev) if state is JobState.DONE and not self._keeps_tombstone() else ev

    def _on_query(self, ev: QueryPrefetchStatus | ForgettingQuery, now: float, out: list[Effect]) -> None:
        if isinstance(ev, ForgettingQuery):
            ev = ev.query
        self.ctx.counters["status_queries"] += 1
        out.append(Reply(ev.reply_to, self._status(RequestKey(ev.peer, ev.request_id), now)))

    def _status(self, key: RequestKey, now: float) -> int | None:
        job = self.jobs.get(key)
        if job is not None:
            if job.hits is None:
                return None
            hits = job.hits
            self._answer(job, now)
            return hits
        tomb = self.tombstones.get(key)
        if tomb is not None:
            return tomb[0]
        self.ctx.counters["unknown_status"] += 1
        return self.hooks.status_for_unknown(key)

    def _classify_wait(self, ev: WaitPrefetchStatus, state: JobState, now: float) -> Any:
        """A wait with no number for a timeout, or one more than ``max_waiters`` would hold, is
        refused (``RefusedWait``); a DONE job's is answered as a query answers it."""
        if not isinstance(ev.timeout, (int, float)) or math.isnan(ev.timeout):
            return RefusedWait(ev, ErrorKind.VALIDATION, "timeout must be a number")
        if state is JobState.DONE:
            return ev if self._keeps_tombstone() else ForgettingWait(ev)
        if state is JobState.PENDING and ev.timeout > 0 and len(self.waiter_by_id) >= self.ctx.config.max_waiters:
            return RefusedWait(ev, ErrorKind.TOO_LARGE, "too many status waiters")
        return ev

    def _on_refused_wait(self, ev: RefusedWait, now: float, out: list[Effect]) -> None:
        self.ctx.counters["status_queries"] += 1
        self.ctx.error(out, ev.wait.reply_to, ev.kind, ev.message)

    def _on_wait(self, ev: WaitPrefetchStatus | ForgettingWait, now: float, out: list[Effect]) -> None:
        if isinstance(ev, ForgettingWait):
            ev = ev.wait
        ctx = self.ctx
        ctx.counters["status_queries"] += 1
        key = RequestKey(ev.peer, ev.request_id)
        job = self.jobs.get(key)
        if job is None or job.hits is not None or ev.timeout <= 0:
            out.append(Reply(ev.reply_to, self._status(key, now)))
            return
        w = Waiter(ctx.new_id(), key, ev.reply_to, now + min(ev.timeout, 1e9))
        self.waiters.setdefault(key, {})[w.waiter_id] = w
        self.waiter_by_id[w.waiter_id] = w
        ctx.timers.push(w.deadline, WaiterDeadline(w.waiter_id, key))

    def _classify_free(self, ev: FreeLookupLocks, state: JobState, now: float) -> Any:
        """A free of a malformed range is refused (``RefusedFree``); else its plan: the chunk
        hashes of the range (``AdmittedFree``)."""
        ctx, ckey = self.ctx, ev.key
        err = ctx.validate_key(ckey, scheduler=True, aligned=False)
        if err is not None:
            return RefusedFree(ev, ErrorKind.VALIDATION, err)
        C = ctx.config.chunk_size
        first, last = ckey.start // C, ckey.end // C
        hashes, err = ctx.hashes(ckey, last)
        if err is not None:
            return RefusedFree(ev, ErrorKind.VALIDATION, err)
        return AdmittedFree(ev, hashes, first, last)

    def _on_refused_free(self, ev: RefusedFree, now: float, out: list[Effect]) -> None:
        self.ctx.error(out, ev.free.reply_to, ev.kind, ev.message)

    def _on_free(self, ev: AdmittedFree, now: float, out: list[Effect]) -> None:
        ctx, ckey = self.ctx, ev.free.key
        hashes, first, last = ev.hashes, ev.first, ev.last
        key = RequestKey(ev.free.peer, ckey.request_id)
        if self.hooks.fixed_release_for_free():
            # the fixed hook, in walks of what the request holds (no key per object named): a
            # slice now, the rest a slice per loop turn (l1_index), so the reply does not wait
            ctx.index.release_chunks_in_slices(key, hashes[first:last], ckey.world_size, ReleaseReason.FREE, now)
        else:
            keys = [ObjectKey(hashes[i], r) for i in range(first, last) for r in range(ckey.world_size)]
            self.hooks.release_for_free_lookup_locks(key, keys, now)
        job = self.jobs.get(key)
        if job is not None and job.work is not None:
            work = job.work
            if work.freed_chunks is None:
                work.freed_chunks = set()
            work.freed_chunks.update(range(first, last))
        out.append(Reply(ev.free.reply_to, None))

    def _on_end_session(self, ev: EndSession, now: float, out: list[Effect]) -> None:
        self.hooks.end_session(RequestKey(ev.peer, ev.request_id), now, out)
        out.append(Reply(ev.reply_to, None))

    # ============================================================================= timers

    def _classify_reap(self, timer: ReapJob, state: JobState, now: float) -> Any:
        """A job due for reaping is reaped, or kept where the server's hook says it reaps none
        (``KeptAbandonedJob``, the legacy no-reaper)."""
        return timer if self.hooks.reaps_abandoned_jobs() else KeptAbandonedJob(timer)

    def _on_reap(self, timer: ReapJob, now: float, out: list[Effect]) -> None:
        """The job (its reap deadline came) goes (the row's ABSENT), with its waiters answered 0
        and its leases released."""
        key = timer.key
        self.ctx.counters["reaped_jobs"] += 1
        self.answer_waiters(key, 0, out)
        self.ctx.index.release_owner_in_slices(key, ReleaseReason.REAP, now)
        self.repeats.pop(key, None)

    def _on_kept_abandoned_job(self, ev: KeptAbandonedJob, now: float, out: list[Effect]) -> None:
        pass

    def _on_forget_request_id(self, timer: ForgetRequestId, now: float, out: list[Effect]) -> None:
        self._forget_repeats(timer.key, now)

    def _on_waiter_deadline(self, timer: WaiterDeadline, now: float, out: list[Effect]) -> None:
        w = self.waiter_by_id.pop(timer.waiter_id)
        waiters = self.waiters[w.key]
        del waiters[timer.waiter_id]
        if not waiters:
            del self.waiters[w.key]
        self.ctx.counters["waiter_timeouts"] += 1
        out.append(Reply(w.reply_to, None))

    def _classify_l2_timeout(self, timer: L2Timeout, state: JobState, now: float) -> Any:
        """The job resolves with its L1 prefix: DONE, or answered at once where waiters wait
        (``L2TimeoutForWaiters``; ``L2TimeoutForgotten`` where the server keeps no tombstone)."""
        return self._resolution(timer.key, timer, L2TimeoutForWaiters, L2TimeoutForgotten)

    def _on_l2_timeout(self, timer: L2Timeout | L2TimeoutForWaiters | L2TimeoutForgotten, now: float,
                       out: list[Effect]) -> None:
        if not isinstance(timer, L2Timeout):
            timer = timer.timeout
        job = self.jobs.get(timer.key)
        assert job is not None
        self.ctx.counters["l2_timeouts"] += 1
        if job.read_id is not None:
            self.l2.detach_read(job.read_id)
        self._settle(job, job.l1_prefix, now, out)

    # ============================================================================= L2 results

    def _job_of(self, key: RequestKey | None, serial: int) -> PrefetchJob | None:
        """The pending job an L2 read or probe was started for, if it is still that job."""
        job = self.jobs.get(key) if key is not None else None
        return job if job is not None and job.serial == serial else None

    def read_finished(self, read: L2Read, loaded: tuple[bool, ...], now: float, out: list[Effect]) -> None:
        """The L2 read ``read`` finished (``loaded``: per item): its objects land and its job's
        extension is leased, a slice per loop turn (``_land_slice``); a read whose job went lands
        for no one."""
        job = self._job_of(read.request, read.job_serial)
        if job is not None and job.read_id != read.read_id:
            job = None
        walk = L2Walk(WalkKind.LANDED, job, read.job_serial, now, job.l1_prefix if job is not None else 0,
                      read=read, present=loaded, hits=job.l1_prefix if job is not None else 0,
                      leasing=job is not None)
        if not self._walk_slice(walk, out):
            self.continuing.append(walk)

    def read_expired(self, read: L2Read, now: float, out: list[Effect]) -> None:
        job = self._job_of(read.request, read.job_serial)
        if job is not None and job.read_id == read.read_id:
            self.complete(job, job.l1_prefix, now, out)

    def probe_finished(self, probe: L2Probe, present: tuple[bool, ...], now: float,
                       out: list[Effect]) -> None:
        """The probe answered (``present``: per probed key): its job's read is walked from its L1
        prefix over the chunks found whole, a slice per loop turn."""
        job = self._job_of(probe.request, probe.job_serial)
        if job is None or job.probe_id != probe.probe_id:
            return
        job.probe_id = None
        walk = self.l2.begin(WalkKind.READ, job, now, probe, present)
        if not self._walk_slice(walk, out):
            self.continuing.append(walk)

    def probe_expired(self, probe: L2Probe, now: float, out: list[Effect]) -> None:
        job = self._job_of(probe.request, probe.job_serial)
        if job is not None and job.probe_id == probe.probe_id:
            self.complete(job, job.l1_prefix, now, out)

    # ============================================================================= helpers

    def complete(self, job: PrefetchJob, hits: int, now: float, out: list[Effect]) -> None:
        """The live pending job's hit count is known (its work resolved: at once, an L2 step
        ended or expired, a slice finished, the work failed): its row runs (``JobResolved``)."""
        self.dispatch.run(JobResolved(job.key, hits), now, out)

    def _resolution(self, key: RequestKey, event: Any, for_waiters: type, forgotten: type) -> Any:
        """How a pending job's hit count resolves it: DONE (``event``), or answered at once to
        the waiters (``for_waiters``: ANSWERED; ``forgotten``: ABSENT, no tombstone kept)."""
        if key not in self.waiters:
            return event
        return for_waiters(event) if self._keeps_tombstone() else forgotten(event)

    def _classify_resolved(self, ev: JobResolved, state: JobState, now: float) -> Any:
        assert state is JobState.PENDING, "a resolution of a job that is not pending"
        return self._resolution(ev.key, ev, ResolvedForWaiters, ResolvedForgotten)

    def _on_resolved(self, ev: JobResolved | ResolvedForWaiters | ResolvedForgotten, now: float,
                     out: list[Effect]) -> None:
        if not isinstance(ev, JobResolved):
            ev = ev.resolved
        job = self.jobs.get(ev.key)
        assert job is not None and job.hits is None, "a resolution of a job that is not pending"
        self._settle(job, ev.hits, now, out)

    def _settle(self, job: PrefetchJob, hits: int, now: float, out: list[Effect]) -> None:
        """The job drops its pending work (hashes, L2 state) and keeps its count until it is
        answered, ended or reaped -- answered now if waiters wait."""
        job.hits = hits
        job.work = None
        self.ctx.counters["hit_chunks"] += hits
        key = job.key
        if key in self.waiters:
            self.answer_waiters(key, hits, out)
            self._answer(job, now)

    def _keeps_tombstone(self) -> bool:
        """Whether an answered job leaves a tombstone (ANSWERED), not nothing (ABSENT): the
        server's hook (a legacy profile keeps none) and room for one."""
        return self.hooks.keeps_tombstones() and self.ctx.config.tombstone_cap > 0

    def _answer(self, job: PrefetchJob, now: float) -> None:
        """The DONE job is answered: its tombstone repeats the count (ANSWERED), or -- the server
        keeps none -- the row's ABSENT forgets it, and its lookup count goes once it holds no
        lease."""
        assert job.hits is not None
        key = job.key
        if self.hooks.keeps_tombstones():
            del self.jobs[key]
            self.tombstone(key, job.hits, now)  # a cap of 0 drops it at once
        if key not in self.tombstones:
            self._forget_repeats(key, now)

    def answer_waiters(self, key: RequestKey, result: int | None, out: list[Effect]) -> None:
        for w in self.waiters.pop(key, {}).values():
            del self.waiter_by_id[w.waiter_id]
            out.append(Reply(w.reply_to, result))

    def tombstone(self, key: RequestKey, hits: int, now: float) -> None:
        """Remember an answered job's count for ``tombstone_ttl`` (bounded by ``tombstone_cap``)."""
        self.tombstones[key] = (hits, now + self.ctx.config.tombstone_ttl)
        self.tombstones.move_to_end(key)
        out: list[Effect] = []
        while len(self.tombstones) > self.ctx.config.tombstone_cap:  # the oldest go, each by its row
            self.dispatch.run(TombstoneDropped(next(iter(self.tombstones))), now, out)
        assert not out, "a dropped tombstone answers nothing"

    def _on_tombstone_gone(self, ev: TombstoneExpired | TombstoneDropped, now: float, out: list[Effect]) -> None:
        """The tombstone goes (the row's ABSENT), and the request's lookup count once it holds no
        lease."""
        if isinstance(ev, TombstoneDropped):
            self.ctx.counters["tombstones_dropped"] += 1
        self._forget_repeats(ev.key, now)

    def _drop(self, key: RequestKey) -> PrefetchJob | None:
        """Take the request's job out of the table (its L2 read, if any, lands for nobody)."""
        job: PrefetchJob | None = self.jobs.pop(key, None)
        if job is not None:
            if job.read_id is not None:
                self.l2.detach_read(job.read_id)
            job.work = None  # its entry in the reap queue is stale now: keep it small
        return job

    def _set_state(self, key: Hashable, state: JobState) -> None:
        """JOB_TABLE's assignment. ``ABSENT``: the request's job (its L2 read then lands for
        nobody) and tombstone are forgotten. ``PENDING`` / ``DONE`` / ``ANSWERED``: the job or
        tombstone its row's handler filed or kept is the one."""
        if state is JobState.ABSENT:
            if isinstance(key, RequestKey):
                self._drop(key)
                self.tombstones.pop(key, None)
            return
        assert self.state(key) is state, f"a job left {self.state(key).name}, its row assigns {state.name}"

    def end_session(self, key: RequestKey, now: float, out: list[Effect]) -> None:
        """END_SESSION: answer the waiters, release the request's leases, forget its lookup count
        (its job and tombstone go with the row's ABSENT)."""
        self.answer_waiters(key, 0, out)
        # a big request's leases go a slice per loop turn (l1_index): the reply does not wait
        self.ctx.index.release_owner_in_slices(key, ReleaseReason.END_SESSION, now)
        self.repeats.pop(key, None)

    def check_invariants(self) -> None:
        assert len(self.tombstones) <= self.ctx.config.tombstone_cap, "tombstone cap"
        count = 0
        for key, job in self.jobs.items():
            count += 1
            assert job.key == key
            assert key not in self.tombstones, "a live job and a tombstone for one request"
            if job.accepted:
                assert self.accepted is not None and self.accepted[0] is job, "an accepted job not waiting to run"
            elif job.hits is None and any(c.job is job and c.serial == job.serial for c in self.continuing):
                assert not self.l2.is_reading(job.read_id) and not self.l2.is_probing(job.probe_id), \
                    "a job leasing its prefix in slices has no L2 step yet"
            elif job.hits is None:
                assert self.l2.is_reading(job.read_id) != self.l2.is_probing(job.probe_id), \
                    "pending job: one L2 step"
            else:
                assert job.work is None, "a done job keeps its pending work"
                assert job.hits >= 0, "hits out of range"
        assert count == len(self.jobs), "job count"
        for key, waiters in self.waiters.items():
            assert waiters, "empty waiter list"
            waited = self.jobs.get(key)
            assert waited is not None and waited.hits is None, "a waiter for a job that is not pending"
            for wid, w in waiters.items():
                assert self.waiter_by_id[wid] is w and w.key == key
        assert sum(len(w) for w in self.waiters.values()) == len(self.waiter_by_id)
        assert all(n >= 1 for n in self.repeats.values()), "lookup counts"


# (state of the job the event addresses, event type) -> (handler, the one next state, which the
# dispatcher assigns: JobMachine._set_state). The guards classify the raw events first.
_A, _P, _D, _N = JobState.ABSENT, JobState.PENDING, JobState.DONE, JobState.ANSWERED
JOB_TABLE: Table[JobState] = Table("LookupServer jobs (prefetch job of a request id)", JobState, JobState.ABSENT, {
    (_A, RefusedLookup): (JobMachine._on_refused_lookup, _A),
    (_A, AcceptedLookup): (JobMachine._on_accepted_lookup, _P),
    (_A, StartedLookup): (JobMachine._on_started_lookup, _P),
    (_A, AckDue): (JobMachine._on_ack, _A),
    (_A, QueryPrefetchStatus): (JobMachine._on_query, _A),
    (_A, WaitPrefetchStatus): (JobMachine._on_wait, _A),
    (_A, RefusedWait): (JobMachine._on_refused_wait, _A),
    (_A, AdmittedFree): (JobMachine._on_free, _A),
    (_A, RefusedFree): (JobMachine._on_refused_free, _A),
    (_A, EndSession): (JobMachine._on_end_session, _A),
    (_A, ForgetRequestId): (JobMachine._on_forget_request_id, _A),
    (_P, RefusedLookup): (JobMachine._on_refused_lookup, _P),
    (_P, DuplicateLookup): (JobMachine._on_duplicate_lookup, _P),
    (_P, OverwritingLookup): (JobMachine._on_overwriting_lookup, _P),
    (_P, JobResolved): (JobMachine._on_resolved, _D),
    (_P, ResolvedForWaiters): (JobMachine._on_resolved, _N),
    (_P, ResolvedForgotten): (JobMachine._on_resolved, _A),
    (_P, AckDue): (JobMachine._on_ack, _P),
    (_P, QueryPrefetchStatus): (JobMachine._on_query, _P),
    (_P, WaitPrefetchStatus): (JobMachine._on_wait, _P),
    (_P, RefusedWait): (JobMachine._on_refused_wait, _P),
    (_P, AdmittedFree): (JobMachine._on_free, _P),
    (_P, RefusedFree): (JobMachine._on_refused_free, _P),
    (_P, EndSession): (JobMachine._on_end_session, _A),
    (_P, ReapJob): (JobMachine._on_reap, _A),
    (_P, KeptAbandonedJob): (JobMachine._on_kept_abandoned_job, _P),
    (_P, WaiterDeadline): (JobMachine._on_waiter_deadline, _P),
    (_P, L2Timeout): (JobMachine._on_l2_timeout, _D),
    (_P, L2TimeoutForWaiters): (JobMachine._on_l2_timeout, _N),
    (_P, L2TimeoutForgotten): (JobMachine._on_l2_timeout, _A),
    (_D, RefusedLookup): (JobMachine._on_refused_lookup, _D),
    (_D, DuplicateLookup): (JobMachine._on_duplicate_lookup, _D),
    (_D, OverwritingLookup): (JobMachine._on_overwriting_lookup, _P),
    (_D, AnswerInAck): (JobMachine._on_answer_in_ack, _N),
    (_D, AnswerInAckForgotten): (JobMachine._on_answer_in_ack, _A),
    (_D, QueryPrefetchStatus): (JobMachine._on_query, _N),
    (_D, ForgettingQuery): (JobMachine._on_query, _A),
    (_D, WaitPrefetchStatus): (JobMachine._on_wait, _N),
    (_D, ForgettingWait): (JobMachine._on_wait, _A),
    (_D, RefusedWait): (JobMachine._on_refused_wait, _D),
    (_D, AdmittedFree): (JobMachine._on_free, _D),
    (_D, RefusedFree): (JobMachine._on_refused_free, _D),
    (_D, EndSession): (JobMachine._on_end_session, _A),
    (_D, ReapJob): (JobMachine._on_reap, _A),
    (_D, KeptAbandonedJob): (JobMachine._on_kept_abandoned_job, _D),
    (_N, RefusedLookup): (JobMachine._on_refused_lookup, _N),
    (_N, AcceptedLookup): (JobMachine._on_accepted_lookup, _P),
    (_N, StartedLookup): (JobMachine._on_started_lookup, _P),
    (_N, AckDue): (JobMachine._on_ack, _N),
    (_N, QueryPrefetchStatus): (JobMachine._on_query, _N),
    (_N, WaitPrefetchStatus): (JobMachine._on_wait, _N),
    (_N, RefusedWait): (JobMachine._on_refused_wait, _N),
    (_N, AdmittedFree): (JobMachine._on_free, _N),
    (_N, RefusedFree): (JobMachine._on_refused_free, _N),
    (_N, EndSession): (JobMachine._on_end_session, _A),
    (_N, TombstoneExpired): (JobMachine._on_tombstone_gone, _A),
    (_N, TombstoneDropped): (JobMachine._on_tombstone_gone, _A),
}, assigns=True, guards={
    Lookup: JobMachine._classify_lookup,
    QueryPrefetchStatus: JobMachine._classify_query,
    WaitPrefetchStatus: JobMachine._classify_wait,
    FreeLookupLocks: JobMachine._classify_free,
    ReapJob: JobMachine._classify_reap,
    L2Timeout: JobMachine._classify_l2_timeout,
    JobResolved: JobMachine._classify_resolved,
    AckDue: JobMachine._classify_ack,
})
JOB_TIMERS = (ReapJob, WaiterDeadline, L2Timeout, ForgetRequestId)
