"""``LookupServer``: the server's protocol, as a thin composition of four entity machines.

An event addresses one entity, and that entity's machine handles it through its own executing
table (core_sm/table.py):

* prefetch jobs of a request id -- ``mpcache.core_sm.server_jobs`` (lookup, status, wait, free, end
  session, tombstones, reaping abandoned jobs);
* transfers of a transfer id -- ``mpcache.core_sm.server_transfers`` (store/retrieve, prepare/commit,
  ``not_after`` fences, answers to duplicates);
* L2 work of a read/probe/write id -- ``mpcache.core_sm.server_l2``;
* engine instances -- ``mpcache.core_sm.server_instances`` (register, unregister, heartbeats, reaping
  dead instances).

``LookupServer``'s own table (one state, SERVING) routes each event type to its machine and
answers what addresses the server itself (``Ping`` naming no instance, ``GetChunkSize``,
``Clear``, ``TimerFired``). Time-driven work runs at the start of every ``handle`` call: L1
lease expiry, tombstone expiry, then every due typed timer, each dispatched through the table of
the machine it belongs to; ``TimerFired`` only makes sure it runs.

Contract highlights (docs/core_sm.md has the tables):

* Every request gets exactly one ``Reply`` or ``ErrorReply`` with its ``reply_to``: at once, or
  later (Store/Retrieve after ``TransferFinished``, CommitTransfer, WaitPrefetchStatus on
  completion or deadline). Internal events and timers never get a reply; an internal event with
  an unknown id is ignored and counted (``stats()["stale_events"]``). ``handle`` never raises.
* Read leases are owned by the request that looked them up -- ``RequestKey(peer, request id)``:
  two peers naming one request id are two requests (``num_readers`` counts per object) -- and end
  by exactly one of: RETRIEVE (one count per object per successful retrieve), FREE, END SESSION,
  REAP (abandoned job), TTL, or a forced CLEAR.
* Status: ``None`` while pending, hit chunks when done (then a tombstone repeats it for
  ``tombstone_ttl``), ``0`` for an unknown id.

Subclass hooks for legacy profiles (simulator) are the methods named in docs/core_sm.md under
"Extension points for legacy profiles"; they are methods of this class, small, and have the
fixed behaviour by default. The entity machines never import this module: they reach the hooks
through the ``ServerHooks`` built here (``server_jobs.JobHooks``, ``server_transfers.TransferHooks``),
and one another through the small protocols their modules declare, so every import arrow points
one way: server -> jobs -> L2 work -> instances, server -> transfers -> (instances, L2 work), all
-> server_core.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.effects import Effect, ErrorReply, Reply
from mpcache.core_sm.errors import ErrorKind, ProtocolError
from mpcache.core_sm.l1_index import ReleaseReason
from mpcache.core_sm.l1_object import Owner
from mpcache.core_sm.messages import (
    Clear,
    CommitTransfer,
    EndSession,
    FreeLookupLocks,
    GetChunkSize,
    InstanceAttached,
    InstanceFailed,
    L2ProbeFinished,
    L2ReadFinished,
    L2WriteFinished,
    Lookup,
    PeerGone,
    Ping,
    PrepareRetrieve,
    PrepareStore,
    QueryPrefetchStatus,
    RegisterInstance,
    ReplyTo,
    Retrieve,
    ServerEvent,
    Store,
    TimerFired,
    TransferFinished,
    UnregisterInstance,
    WaitPrefetchStatus,
)
from mpcache.core_sm.server_core import EFFECT_OWNERS, RequestKey, ServerConfig, ServerContext
from mpcache.core_sm.server_instances import INSTANCE_TABLE, INSTANCE_TIMERS, InstanceMachine, InstanceState
from mpcache.core_sm.job_table import JobState, PrefetchJob
from mpcache.core_sm.server_jobs import JOB_TABLE, JOB_TIMERS, JobHooks, JobMachine, ReapJob
from mpcache.core_sm.server_l2 import L2_TABLE, L2_TIMERS, L2State, L2Work
from mpcache.core_sm.server_transfers import (
    TRANSFER_CREATORS,
    TRANSFER_TABLE,
    TRANSFER_TIMERS,
    TransferHooks,
    TransferMachine,
    TransferState,
)
from mpcache.core_sm.table import Dispatcher, Table
from mpcache.core_sm.timers import Timer
from mpcache.core_sm.values import parts_values, restore_parts

__all__ = [
    "LookupServer", "ServerConfig", "ServerState", "JobState", "TransferState", "L2State",
    "InstanceState", "PrefetchJob", "RequestKey", "SERVER_TABLE", "TABLES", "TRANSFER_CREATORS",
]


class ServerState(enum.Enum):
    """The server as the addressee of the events that name no entity."""

    SERVING = "serving"


_COUNTERS = (
    "requests", "errors", "lookups", "duplicate_lookups", "status_queries",
    "unknown_status", "hit_chunks", "lookup_chunks", "reaped_jobs", "l2_timeouts",
    "l2_reads", "l2_probes", "l2_writes", "stale_events", "transfers_started", "transfers_failed",
    "retrieve_misses", "expired_plans", "expired_transfers", "l2_reads_expired", "l2_probes_expired",
    "l2_writes_expired", "waiter_timeouts", "internal_errors",
    "tombstones_dropped", "late_transfers_refused", "stores_awaiting_writers",
    "plan_quarantines_ended", "duplicate_transfers", "table_violations",
    "heartbeats", "instances_reaped", "instances_failed", "plans_of_reaped_instances", "quota_skips", "clears_refused",
    "instances_of_gone_peers",
    "stores_not_admitted", "resends_run", "resends_refused", "lookup_work_failures", "lookups_answered_in_ack",
)

# check_invariants_after_event: the most quiet events in a row whose check is skipped.
FULL_CHECK_EVERY = 32


class LookupServer:
    """The server machine. ``handle(event, now) -> list[Effect]``; ``next_deadline()``."""

    def __init__(self, config: ServerConfig | None = None) -> None:
        self.config = config if config is not None else ServerConfig()
        self._counters: dict[str, int] = {name: 0 for name in _COUNTERS}
        self.ctx = ctx = ServerContext(self.config, self._counters, self._reply_error, self._timer_live)
        self.index = ctx.index
        # The arrows go one way: server -> jobs -> L2 work -> instances, server -> transfers ->
        # (instances, L2 work); the two that point back (an L2 result to its job, an instance's
        # end to its transfers) are wired here, typed by what their user needs.
        hooks = ServerHooks(self)
        self.instances = InstanceMachine(ctx)
        self.l2 = L2Work(ctx, self.instances)
        self.jobs = JobMachine(ctx, hooks, self.l2)
        self.transfers = TransferMachine(ctx, hooks, self.instances, self.l2)
        self.l2.jobs, self.instances.transfers = self.jobs, self.transfers
        self._timer_machine: dict[type, Any] = {
            **{t: self.jobs for t in JOB_TIMERS}, **{t: self.l2 for t in L2_TIMERS},
            **{t: self.transfers for t in TRANSFER_TIMERS}, **{t: self.instances for t in INSTANCE_TIMERS},
        }
        # The server's own table has one state, so its rows come down to event type -> handler
        # (bound on this instance: a subclass override runs); handle runs the row directly.
        dispatch = SERVER_TABLE.bind(self, lambda ev: None, lambda _entity: ServerState.SERVING,
                                     self._counters, self._reply_error)
        self._rows: dict[type, Callable[[Any, float, list[Effect]], object]] = {
            event_type: handler for (_s, event_type), (handler, _n) in dispatch.rows()}
        # A route row that is not overridden goes straight to its machine's dispatcher (one
        # Python call less per request on the lookup path).
        direct = {LookupServer._to_jobs: self.jobs.run,
                  LookupServer._to_transfers: self.transfers.run,
                  LookupServer._to_l2: self.l2.dispatch.run,
                  LookupServer._to_instances: self.instances.dispatch.run}
        for event_type, handler in list(self._rows.items()):
            func = getattr(handler, "__func__", None)
            if func in direct:
                self._rows[event_type] = direct[func]
        # Per-event checking (``check_invariants_after_event``): the rows that, not overridden,
        # change nothing check_invariants reads (a ping, a heartbeat, a timer tick); an event on
        # one is quiet when no deferred work ran and nothing was due.
        self._quiet_rows = frozenset(
            t for t, h in self._rows.items()
            if getattr(h, "__func__", None) in (LookupServer._on_ping, LookupServer._on_timer))
        self._clean = False  # the state is the one the last full check passed
        self._skipped = 0  # quiet events since that check

    # ============================================================================= public API

    def handle(self, event: ServerEvent, now: float) -> list[Effect]:
        """Feed one event at time ``now``; returns the effects, in order. Never raises."""
        out: list[Effect] = []
        quiet = type(event) in self._quiet_rows and self._nothing_due(now)
        if not quiet:
            self._clean = False
        try:
            if self.jobs.accepted is not None:  # an acknowledged lookup's work runs first
                self._run_accepted(out)
            elif self.jobs.continuing:  # else one slice of a big lookup's leasing (server_jobs)
                self._run_accepted(out)
            if self.index.releasing:  # and one slice of a big request's release (l1_index)
                self.index.release_slice()
            if self.transfers.reserving:  # and one slice of a store's reservations (server_transfers)
                self.transfers.run_reserving(out)
            self._advance(now, out)
            row = self._rows.get(type(event))
            if row is None:
                self._counters["stale_events"] += 1
                reply_to = getattr(event, "reply_to", None)
                if reply_to is not None:
                    self.ctx.error(out, reply_to, ErrorKind.UNKNOWN_OP, type(event).__name__)
            else:
                if hasattr(event, "reply_to"):
                    self._counters["requests"] += 1
                row(event, now, out)
            if self.transfers.op_of_reply:  # a deferred STORE/RETRIEVE answered: its duplicates too
                self.transfers.answer_duplicates(out)
            if self.ctx.held is not None:
                self.ctx.report_drops(out)
            if quiet and len(out) > 1:  # more than its one reply: something moved after all
                self._clean = False
        except Exception as exc:  # a bug: answer the request so no client waits forever
            self._clean = False
            self._counters["internal_errors"] += 1
            reply_to = getattr(event, "reply_to", None)
            if reply_to is not None and not any(
                isinstance(e, (Reply, ErrorReply)) and e.reply_to == reply_to for e in out
            ):
                self.ctx.error(out, reply_to, ErrorKind.INTERNAL, f"{type(exc).__name__}: {exc}")
        return out

    @property
    def deferred_work(self) -> bool:
        """Whether an acknowledged lookup's work waits for ``run_deferred`` (``ack_first``), or a
        big lookup's leasing or L2 step (server_jobs), a big request's release (l1_index) or a
        store's reservations (server_transfers) have slices left."""
        return (self.jobs.accepted is not None or bool(self.jobs.continuing) or self.index.releasing
                or bool(self.transfers.reserving))

    def run_deferred(self) -> list[Effect]:
        """Do the work an acknowledged lookup left (``ServerConfig.ack_first``) and return its
        effects; nothing when none waits. A runtime calls it once the ack is sent; otherwise the
        next ``handle`` runs it first, so no later event sees a difference. The work runs at
        the lookup's own ``now``. Never raises."""
        out: list[Effect] = []
        self._clean = False
        if self.jobs.accepted is not None or self.jobs.continuing:
            try:
                self._run_accepted(out)
            except Exception:  # a bug past run_accepted's own guard: counted, nothing waits on it
                self._counters["internal_errors"] += 1
        if self.index.releasing:
            try:
                self.index.release_slice()
            except Exception:  # a bug: counted; the next turn's slice tries again
                self._counters["internal_errors"] += 1
        if self.transfers.reserving:
            try:
                self.transfers.run_reserving(out)
                if self.transfers.op_of_reply:  # a deferred STORE answered: its duplicates too
                    self.transfers.answer_duplicates(out)
            except Exception:  # a bug: counted
                self._counters["internal_errors"] += 1
        return out

    def _run_accepted(self, out: list[Effect]) -> None:
        """The acknowledged lookup's work if one waits, else one slice of a sliced lookup's."""
        if self.jobs.accepted is not None:
            self.jobs.run_accepted(out)
        else:
            self.jobs.run_continuing(out)
        if self.ctx.held is not None:  # an L2 read's reservations may have evicted
            self.ctx.report_drops(out)

    def next_deadline(self) -> float | None:
        """The earliest time at which ``handle(TimerFired(), t)`` has work to do (may be early)."""
        candidates = [t for t in (self.ctx.timers.next_deadline(), self.jobs.next_tombstone_expiry(),
                                  self.jobs.reap_queue.next_deadline(), self.index.next_expiry(),
                                  self.jobs.next_continuation(), self.index.next_release(),
                                  self.transfers.next_reserving())
                      if t is not None]
        return min(candidates) if candidates else None

    def job_state(self, request_id: str, peer: Any = None) -> JobState:
        return self.jobs.state(RequestKey(peer, request_id))

    def transfer_state(self, transfer_id: int) -> TransferState:
        return self.transfers.state(transfer_id)

    def instance_state(self, instance_id: int) -> InstanceState:
        return self.instances.state(instance_id)

    def job(self, request_id: str, peer: Any = None) -> PrefetchJob | None:
        return self.jobs.jobs.get(RequestKey(peer, request_id))

    def tombstone(self, request_id: str, peer: Any = None) -> int | None:
        entry = self.jobs.tombstones.get(RequestKey(peer, request_id))
        return None if entry is None else entry[0]

    def leases_by_owner(self) -> dict[Owner, int]:
        """Owner (a ``RequestKey`` for lookup leases) -> the read counts it holds."""
        return self.index.leases_by_owner()

    def leases_of(self, request_id: str, peer: Any = None) -> int:
        """The lookup read counts the request ``(peer, request_id)`` holds."""
        return self.index.leases_by_owner().get(RequestKey(peer, request_id), 0)

    # What ``state_values`` carries of the server itself (beyond its counters and its parts'
    # STATE_FIELDS), and the wiring it leaves out (tests/core_sm/test_state_values.py).
    STATE_FIELDS: tuple[str, ...] = ("_clean", "_skipped")
    WIRING_FIELDS: tuple[str, ...] = ("config", "_counters", "ctx", "index", "instances", "l2", "jobs", "transfers",
                                      "_timer_machine", "_rows", "_quiet_rows")

    def state_parts(self) -> tuple[Any, ...]:
        """The server and the parts it is made of, each with its ``STATE_FIELDS``, in the order
        ``state_values`` writes them."""
        ctx = self.ctx
        jobs = self.jobs
        return (self, ctx, ctx.timers, *ctx.index.state_parts(), self.instances, self.l2, jobs, jobs.jobs,
                jobs.reap_queue, self.transfers)

    def state_values(self) -> tuple[Any, ...]:
        """The server's changing state as immutable values: its counters, and every part's state
        fields written by ``core_sm.values`` (an object held in several places written once);
        the wiring left out. ``restore`` on a server of the same configuration (and class) makes
        it this one. A model checker keeps a state this way and restores one server in place
        instead of copying it (its wiring -- four bound tables, the routes -- is most of a copy)."""
        return tuple(self._counters.values()), parts_values(self.state_parts(), {})

    def restore(self, values: tuple[Any, ...]) -> None:
        """Become, in place, the server whose ``state_values()`` gave ``values``: every part's
        state fields new objects decoded from them, the wiring as it is (the counters dict the
        tables share is updated)."""
        counters, parts = values
        own = self._counters
        own.update(zip(tuple(own), counters))
        restore_parts(self.state_parts(), parts, [])

    @property
    def counters(self) -> Mapping[str, int]:
        """The machine's own counters, live (read them; ``stats()`` is a copy with more)."""
        return self._counters

    def stats(self) -> dict[str, int]:
        """A snapshot for metrics and simulator oracles (flat name → int)."""
        out = dict(self._counters)
        out.update(self.index.stats())
        jobs, l2, transfers = self.jobs, self.l2, self.transfers
        out["jobs"] = len(jobs.jobs)
        out["jobs_pending"] = sum(1 for j in jobs.jobs.values() if j.hits is None)
        out["tombstones"] = len(jobs.tombstones)
        out["waiters"] = len(jobs.waiter_by_id)
        out["transfers"] = len(transfers.transfers)
        out["l2_reads_in_flight"] = len(l2.reads)
        out["l2_probes_in_flight"] = len(l2.probes)
        out["l2_writes_in_flight"] = len(l2.writes)
        out["instances"] = len(self.instances.instances)
        out["store_waits"] = len(transfers.store_waits)
        out["pinned_effects"] = len(self.ctx.pins)
        out["timers"] = len(self.ctx.timers)
        out["reap_queue"] = len(jobs.reap_queue)
        out["reap_queue_compactions"] = jobs.reap_queue.compactions
        out["timer_compactions"] = self.ctx.timers.compactions
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError if the state is inconsistent; cheap enough after every event."""
        self.index.check_invariants()
        self.jobs.check_invariants()
        self.l2.check_invariants()
        self.transfers.check_invariants()
        pinned = {slot for slots in self.ctx.pins.values() for slot in slots}
        assert self.index.pinned_count() == len(pinned), "slot pins out of sync"
        self._clean, self._skipped = True, 0

    def check_invariants_after_event(self, full_every: int = FULL_CHECK_EVERY) -> bool:
        """``check_invariants`` after one ``handle``, skipped when it cannot fail: the state is
        the one the last full check passed (every ``handle`` since was quiet: a ping, heartbeat
        or timer tick on its own row, with no deferred work and nothing due, answered by at
        most one effect, and no ``run_deferred`` ran). A full check still runs after
        ``full_every`` skipped events in a row, so state changed behind the machine's back (a
        bug outside ``handle``, a test's corruption) is found within that many events.
        Returns whether it checked."""
        if self._clean and self._skipped < full_every:
            self._skipped += 1
            return False
        self.check_invariants()
        return True

    def _nothing_due(self, now: float) -> bool:
        """No deferred work waits and no time-driven work is due at ``now`` (next_deadline may be
        early, never late, so a deadline after ``now`` means none)."""
        if self.deferred_work:
            return False
        deadline = self.next_deadline()
        return deadline is None or deadline > now

    # ============================================================================= hooks

    def _reply_error(self, out: list[Effect], reply_to: ReplyTo, error: ProtocolError) -> None:
        """Answer the request behind ``reply_to`` with ``error``: every ``ErrorReply`` the server
        sends is built here and counted in ``stats()["errors"]`` (legacy: send nothing, so the
        request is never answered: F11)."""
        self._counters["errors"] += 1
        out.append(ErrorReply(reply_to, error))

    def _status_for_unknown(self, key: RequestKey) -> int | None:
        """Answer for a status query of a request with no job and no tombstone (legacy: None)."""
        return 0

    def _overwrites_duplicate(self, job: PrefetchJob, event: Lookup) -> bool:
        """Whether a Lookup for an id whose job is live replaces the job and leases again,
        leaking the first set (legacy: F4); the server acks it and takes no second set."""
        return False

    def _lease_for_lookup(self, owner: RequestKey, key: ObjectKey, num_readers: int, now: float) -> None:
        """Make ``owner`` hold ``num_readers`` counts on ``key`` (tops up, never adds twice;
        renews a lease it holds)."""
        self.index.lease_reads((key,), owner, num_readers, now, top_up=True, refresh=True)
        self.index.touch(key)

    def _lease_prefix_for_lookup(
        self, owner: RequestKey, hashes: Sequence[bytes], ranks: Sequence[int], num_readers: int, now: float
    ) -> int:
        """A lookup's L1 prefix: how many leading chunks of ``hashes`` are readable for every
        rank of ``ranks``; ``owner`` takes ``_lease_for_lookup``'s leases on their objects, as
        one walk of the index (a subclass overriding ``_lease_for_lookup`` has it called per
        object instead)."""
        if num_readers > 0 and type(self)._lease_for_lookup is LookupServer._lease_for_lookup:
            # Top-up per object, as _lease_for_lookup (READY objects being leased leave the LRU
            # set, so its touch has nothing to move). Every lookup of a request also renews the
            # leases it already holds: a connector whose request waits in a deep queue looks it
            # up again before they expire (bounded by max_lookups_per_request).
            return self.index.lease_prefix(hashes, ranks, owner, num_readers, now)
        prefix, keys = self.index.readable_prefix(hashes, ranks)
        if num_readers > 0:
            for key in keys:
                self._lease_for_lookup(owner, key, num_readers, now)
        return prefix

    def _release_for_free_lookup_locks(
        self, owner: RequestKey, keys: Sequence[ObjectKey], now: float
    ) -> int:
        """FREE_LOOKUP_LOCKS: release this request's leases on ``keys`` only (legacy: one count of
        whoever holds each key: F9). Returns the counts released."""
        return self.index.release_reads(keys, owner, None, ReleaseReason.FREE, now)

    def _release_after_retrieve(self, owner: RequestKey, keys: Sequence[ObjectKey], now: float) -> None:
        """A successful RETRIEVE releases one of the request's lookup counts per object it copied.

        The retrieving peer's own count if it holds one (a peer that both looks up and retrieves,
        or engines sharing one CURVE key); else -- the scheduler that looked up and the worker that
        retrieves are different connections of one engine -- the count of the one other peer whose
        request of this id holds the object. When several do (two peers use the id), none is
        released: each keeps its leases until its own FREE, END_SESSION or TTL."""
        index = self.index
        rid = owner.request_id
        for key in keys:
            if index.read_count(key, owner) > 0:
                index.release_read(key, owner, 1, ReleaseReason.RETRIEVE, now)
                continue
            others = [o for o in index.owners_of(key) if isinstance(o, RequestKey) and o.request_id == rid]
            if len(others) == 1:
                index.release_read(key, others[0], 1, ReleaseReason.RETRIEVE, now)

    def _keeps_tombstones(self) -> bool:
        """Whether an answered job's count is remembered (legacy: not, so repeats see an unknown
        id: F1)."""
        return True

    def _end_session(self, key: RequestKey, now: float, out: list[Effect]) -> None:
        """END_SESSION: answer the waiters, release the request's leases (its row, which ends in
        ABSENT, forgets the job and tombstone; legacy LMCache April: the leases stay: F12)."""
        self.jobs.end_session(key, now, out)

    def _reaps_abandoned_jobs(self) -> bool:
        """Whether a job never answered within ``abandoned_job_ttl`` is dropped, its leases
        released (legacy: not; jobs and leases stay until TTL: F12)."""
        return True

    # ============================================================================= own rows

    def _on_ping(self, ev: Ping, now: float, out: list[Effect]) -> None:
        if ev.instance_id is None:  # LMCache's plain ping: the server is alive
            out.append(Reply(ev.reply_to, True))
        else:  # an instance's heartbeat
            self.instances.dispatch.run(ev, now, out)

    def _on_get_chunk_size(self, ev: GetChunkSize, now: float, out: list[Effect]) -> None:
        out.append(Reply(ev.reply_to, self.config.chunk_size))

    def _on_clear(self, ev: Clear, now: float, out: list[Effect]) -> None:
        if ev.admin is not True:  # the runtime sets it for a caller with the admin credential
            self._counters["clears_refused"] += 1
            self.ctx.error(out, ev.reply_to, ErrorKind.FORBIDDEN, "clear needs the admin credential")
            return
        # In-flight copies and L2 writes keep their objects: their slots are in use right now.
        self.index.clear(bool(ev.force), protected=lambda owner: isinstance(owner, EFFECT_OWNERS))
        if self.ctx.held is not None:
            assert self.index.dropped is not None
            self.index.dropped.clear()  # AllChunksCleared covers them
            self.ctx.held.cleared(out)
        out.append(Reply(ev.reply_to, None))

    def _on_peer_gone(self, ev: PeerGone, now: float, out: list[Effect]) -> None:
        self.instances.peer_gone(ev, now, out)

    def _on_timer(self, ev: TimerFired, now: float, out: list[Effect]) -> None:
        pass  # _advance already did the work

    def _to_jobs(self, ev: Any, now: float, out: list[Effect]) -> None:
        self.jobs.run(ev, now, out)

    def _to_transfers(self, ev: Any, now: float, out: list[Effect]) -> None:
        self.transfers.run(ev, now, out)

    def _to_l2(self, ev: Any, now: float, out: list[Effect]) -> None:
        self.l2.dispatch.run(ev, now, out)

    def _to_instances(self, ev: Any, now: float, out: list[Effect]) -> None:
        self.instances.dispatch.run(ev, now, out)

    # ============================================================================= time

    def _advance(self, now: float, out: list[Effect]) -> None:
        self.index.expire(now)
        jobs = self.jobs
        if jobs.tombstones:
            jobs.expire_tombstones(now, out)
        reap_at = jobs.reap_queue.next_deadline()
        if reap_at is not None and reap_at <= now:
            for key in jobs.due_reaps(now):
                jobs.dispatch.run(ReapJob(key), now, out)
        timers = self.ctx.timers
        if not timers.due(now):
            return
        timer = timers.pop_due(now)
        while timer is not None:
            self._timer_dispatcher(timer).run(timer, now, out)
            timer = timers.pop_due(now)

    def _timer_dispatcher(self, timer: Timer) -> Dispatcher[Any]:
        dispatcher: Dispatcher[Any] = self._timer_machine[type(timer)].dispatch
        return dispatcher

    def _timer_live(self, timer: Timer) -> bool:
        live: bool = self._timer_machine[type(timer)].timer_live(timer)
        return live



class ServerHooks(JobHooks, TransferHooks):
    """The legacy-profile hooks as the entity machines call them (``server_jobs.JobHooks``,
    ``server_transfers.TransferHooks``): each forwards to the server's method of that name,
    looked up at the call, so a profile's override (or a patch on one server) runs."""

    def __init__(self, server: LookupServer) -> None:
        self._server = server

    def status_for_unknown(self, key: RequestKey) -> int | None:
        return self._server._status_for_unknown(key)

    def overwrites_duplicate(self, job: PrefetchJob, event: Lookup) -> bool:
        return self._server._overwrites_duplicate(job, event)

    def keeps_tombstones(self) -> bool:
        return self._server._keeps_tombstones()

    def reaps_abandoned_jobs(self) -> bool:
        return self._server._reaps_abandoned_jobs()

    def lease_for_lookup(self, owner: RequestKey, key: ObjectKey, num_readers: int, now: float) -> None:
        self._server._lease_for_lookup(owner, key, num_readers, now)

    def lease_prefix_for_lookup(self, owner: RequestKey, hashes: Sequence[bytes], ranks: Sequence[int],
                                num_readers: int, now: float) -> int:
        return self._server._lease_prefix_for_lookup(owner, hashes, ranks, num_readers, now)

    def release_for_free_lookup_locks(self, owner: RequestKey, keys: Sequence[ObjectKey], now: float) -> int:
        return self._server._release_for_free_lookup_locks(owner, keys, now)

    def end_session(self, key: RequestKey, now: float, out: list[Effect]) -> None:
        self._server._end_session(key, now, out)

    def fixed_lease_for_lookup(self) -> bool:
        return type(self._server)._lease_for_lookup is LookupServer._lease_for_lookup

    def fixed_release_for_free(self) -> bool:
        return type(self._server)._release_for_free_lookup_locks is LookupServer._release_for_free_lookup_locks

    def release_after_retrieve(self, owner: RequestKey, keys: Sequence[ObjectKey], now: float) -> None:
        self._server._release_after_retrieve(owner, keys, now)


_ROUTES: dict[type, Any] = {
    **{t: LookupServer._to_jobs for t in (Lookup, QueryPrefetchStatus, WaitPrefetchStatus,
                                          FreeLookupLocks, EndSession)},
    **{t: LookupServer._to_transfers for t in (Store, Retrieve, PrepareStore, PrepareRetrieve,
                                               CommitTransfer, TransferFinished)},
    **{t: LookupServer._to_l2 for t in (L2ReadFinished, L2ProbeFinished, L2WriteFinished)},
    **{t: LookupServer._to_instances for t in (RegisterInstance, UnregisterInstance, InstanceFailed,
                                               InstanceAttached)},
}
# The server's own table: which machine each event goes to (the entity tables decide what it
# does there), and the rows of what addresses the server itself.
SERVER_TABLE: Table[ServerState] = Table("LookupServer (routing: which machine an event addresses)",
                                          ServerState, ServerState.SERVING, {
    (ServerState.SERVING, Ping): (LookupServer._on_ping, {ServerState.SERVING}),
    (ServerState.SERVING, GetChunkSize): (LookupServer._on_get_chunk_size, {ServerState.SERVING}),
    (ServerState.SERVING, Clear): (LookupServer._on_clear, {ServerState.SERVING}),
    (ServerState.SERVING, TimerFired): (LookupServer._on_timer, {ServerState.SERVING}),
    (ServerState.SERVING, PeerGone): (LookupServer._on_peer_gone, {ServerState.SERVING}),
    **{(ServerState.SERVING, t): (route, {ServerState.SERVING}) for t, route in _ROUTES.items()},
})
# Every executing table of the server, in the order docs/core_sm.md shows them.
TABLES: dict[str, Table[Any]] = {t.name: t for t in (SERVER_TABLE, JOB_TABLE, TRANSFER_TABLE, L2_TABLE,
                                                     INSTANCE_TABLE)}
