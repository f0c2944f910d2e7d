"""Transfers: server-driven STORE/RETRIEVE (``StartTransfer`` ... ``TransferFinished``) and
engine-driven PREPARE/COMMIT plans, their ``not_after`` fences, answers to network duplicates,
stores that wait for other stores' writes, and the quarantine of expired plans' slots.

An event addresses one transfer by ``transfer_id`` (a creating request -- ``Store``,
``Retrieve``, ``PrepareStore``, ``PrepareRetrieve`` -- addresses none: ABSENT; the transfer it
prepares has its id only then, and begins by a row of its own); its state is ``TransferState``. ``TRANSFER_TABLE`` is what ``handle`` runs; a commit of a
transfer that is not a prepared plan is refused ``UNKNOWN_TRANSFER`` by the table itself.

The table *assigns*: each row names one next state, which ``_set_state`` gives the transfer after
the handler (``ABSENT``: it is forgotten, with its count and reservations against its instance).
A creating request is classified by a pure guard (``_classify_request``: late, a duplicate, a
stale resend, refused, else admitted) and stays ABSENT; the transfer an admitted one prepares
begins by a row of its own (``CopyBegins`` -> RUNNING, ``PlanBegins`` -> PREPARED) that
``TransferMachine.run`` runs right after (``run_reserving`` after a store's last slice). An
instance's end fails its plans by ``PlanOfGoneInstance`` rows; a commit of another peer's plan is
``ForeignCommit``. So no handler refuses or decides where a transfer goes.

Ownership and bounds: transfer ids are unguessable (``ServerContext.new_transfer_id``); a
transfer belongs to the peer (and instance) that created it, and a commit from another peer is
refused ``FORBIDDEN``. One instance holds at most ``max_transfers_per_instance`` transfers
(``TOO_LARGE`` beyond) and at most its ``slot_quota()`` of slots reserved by its in-flight stores (beyond,
chunks are skipped: no other tenant's ready object is evicted for them). Its committed objects
are charged to it in the L1 index, which shares L1 by the same quota: an instance at or over
its share that needs a slot evicts its own least recently used objects first, and never an
object of an instance within its share (mpcache.core_sm.l1_quota). An uncommitted plan
lives ``min(plan_ttl, lease_ttl)``; a ``not_after`` is held to at most ``now +
max_not_after_ahead`` (the copy's deadline and how long its answer is kept for duplicates).

A store's chunks are reserved as one batch of the L1 index. A store into a full L1 evicts an
object per chunk, ~5 us each: it makes at most ``STORE_EVICTION_SLICE`` evictions per loop turn
and reserves the rest on the turns after (``reserving``; ``LookupServer.handle`` and
``run_deferred`` run a slice each, ``next_deadline`` is due while one is left), then answers or
starts its copy. Meanwhile it counts as its instance's transfer, with its reservations; its
objects are WRITING (another store of them skips them, a lookup stops before them); if its
instance goes (or registers anew) between turns, what it reserved goes and it is refused
``NOT_REGISTERED``.
"""
from __future__ import annotations

import enum
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import attrs

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.effects import Effect, ErrorReply, Reply, ScrubSlots, StartTransfer, StoredChunk
from mpcache.core_sm.errors import ErrorKind, ProtocolError
from mpcache.core_sm.l1_index import ObjectState, ReleaseReason
from mpcache.core_sm.messages import (
    CommitTransfer,
    Peer,
    Placement,
    PrepareRetrieve,
    PrepareStore,
    RegisterInstance,
    ReplyTo,
    Retrieve,
    RetrieveResult,
    Store,
    StoreResult,
    TransferFinished,
    TransferKind,
    TransferPlan,
)
from mpcache.core_sm.holdings import HeldChunks
from mpcache.core_sm.server_core import RequestKey, ServerContext, TransferOwner
from mpcache.core_sm.table import Table
from mpcache.core_sm.timers import Timer

from mpcache.core_sm.server_instances import InstanceMachine
from mpcache.core_sm.server_l2 import L2Work

TransferRequest = Store | PrepareStore | Retrieve | PrepareRetrieve
# What identifies one server-driven op with a not_after (a network duplicate has the same):
# (instance, request, rank, start, end, blocks, skip (-1: a store), not_after, registration
# (None: not a resend; else the registration the resend follows, so a resend is not its original)).
# (peer, instance, request id, rank, start, end, blocks, skip, not_after, registration): an op is
# its sender's -- another peer repeating it byte for byte neither reads its answer nor plants one
OpIdent = tuple[Any, int, str, int | None, int, int, tuple[int, ...], int, float, int | None]


class TransferState(enum.Enum):
    """State of one transfer id."""

    ABSENT = "absent"
    RUNNING = "running"  # server-driven: StartTransfer emitted, TransferFinished awaited
    PREPARED = "prepared"  # engine-driven: TransferPlan sent, CommitTransfer awaited


@attrs.frozen
class TransferDeadline(Timer):
    """An uncommitted plan, or a completion the runtime never reported, at ``lease_ttl``."""

    transfer_id: int


@attrs.frozen
class PlanQuarantineEnd(Timer):
    """An expired plan's slots may be reused: its engine had one more lease TTL to finish."""

    transfer_id: int


# The events the guards classify a creating request into (``TransferMachine._classify_request``,
# each the event of a row of its own) and the internal events a transfer's start and a gone
# instance's plans run as.


@attrs.frozen
class LateTransfer:
    """A STORE/RETRIEVE (or PREPARE_STORE) handled after its ``not_after``, or with a malformed
    one: refused (``refusal``) before anything is reserved, leased or copied."""

    request: Store | PrepareStore | Retrieve
    refusal: ProtocolError

    @property
    def reply_to(self) -> ReplyTo:
        return self.request.reply_to


@attrs.frozen
class DuplicateTransfer:
    """A network duplicate of a server-driven op (the same ``OpIdent``) that is running or was
    answered: answered like the first copy, never copied twice."""

    request: Store | Retrieve

    @property
    def reply_to(self) -> ReplyTo:
        return self.request.reply_to


@attrs.frozen
class StaleResend:
    """A resend after ``NOT_REGISTERED`` naming a registration that is not its instance's
    current one: refused (``refusal``) before any work; the answer is kept for its duplicates."""

    request: Store | Retrieve
    refusal: ProtocolError

    @property
    def reply_to(self) -> ReplyTo:
        return self.request.reply_to


@attrs.frozen
class RefusedTransfer:
    """A creating request its instance refuses (not registered, another peer's, an invalid key
    or range) or over its instance's ``max_transfers_per_instance``: refused (``refusal``)."""

    request: Store | PrepareStore | Retrieve | PrepareRetrieve
    refusal: ProtocolError

    @property
    def reply_to(self) -> ReplyTo:
        return self.request.reply_to


@attrs.frozen
class AdmittedStore:
    """A STORE / PREPARE_STORE that runs: its instance's registration and the objects of its
    range (``keys``)."""

    request: Store | PrepareStore
    registration: RegisterInstance
    keys: tuple[ObjectKey, ...]

    @property
    def reply_to(self) -> ReplyTo:
        return self.request.reply_to


@attrs.frozen
class AdmittedRetrieve:
    """A RETRIEVE / PREPARE_RETRIEVE that runs (a miss or an empty range is answered at once)."""

    request: Retrieve | PrepareRetrieve
    registration: RegisterInstance
    keys: tuple[ObjectKey, ...]

    @property
    def reply_to(self) -> ReplyTo:
        return self.request.reply_to


@attrs.frozen
class CopyBegins:
    """A server-driven transfer a STORE/RETRIEVE prepared begins (``StartTransfer``): run right
    after the row that prepared it, or after a store's last reservation slice."""

    transfer_id: int


@attrs.frozen
class PlanBegins:
    """An engine-driven plan a PREPARE_* prepared begins (its ``TransferPlan`` is the reply)."""

    transfer_id: int


@attrs.frozen
class PlanOfGoneInstance:
    """The instance of an uncommitted plan went (reaped, failed, its registration dropped, its
    peer gone): the plan fails now."""

    transfer_id: int


@attrs.frozen
class ForeignCommit(CommitTransfer):
    """A commit of another peer's plan: refused ``FORBIDDEN``."""


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
    object_bytes: int  # of its instance's objects
    instance_id: int
    peer: Peer = None
    wait_id: int | None = None  # its reply waits for other stores' writes (StoreWait)
    # kv_events: the STORE's chunks, reported once their objects are ready on every rank
    chunks: tuple[StoredChunk, ...] = ()
    world_size: int = 1


# Evictions one loop turn of a store makes (module doc): past them its chunks wait for the next turn.
STORE_EVICTION_SLICE = 256


@attrs.define(eq=False)
class StoreSlices:
    """A store whose chunks are being reserved, a slice per loop turn: the request, its
    instance's registration then, its keys and how far it got (``offset``), what it reserved."""

    ev: Store | PrepareStore
    now: float
    inst: RegisterInstance
    registration: int | None
    keys: tuple[ObjectKey, ...]
    transfer_id: int
    room: int
    tenant: Hashable
    offset: int = 0
    placements: list[Placement] = attrs.Factory(list)
    reserved: list[ObjectKey] = attrs.Factory(list)
    skipped: int = 0
    awaited: dict[int, None] = attrs.Factory(dict)  # running server-driven stores writing its chunks


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


def _transfer_id(ev: Any) -> Hashable:
    tid = getattr(ev, "transfer_id", None)  # None for a creating request: it addresses none yet
    return tid if isinstance(tid, int) else None


class TransferHooks(Protocol):
    """The server's legacy-profile hook a transfer calls (``LookupServer`` binds its
    ``_release_after_retrieve``, which a profile may override)."""

    def release_after_retrieve(self, owner: RequestKey, keys: Sequence[ObjectKey], now: float) -> None: ...


class TransferMachine:
    """The server's transfers (see the module docstring)."""

    # What the server's ``state_values`` carries of this part, and the wiring it leaves out
    # (core_sm/values.py; tests/core_sm/test_state_values.py holds every attribute to one).
    STATE_FIELDS: tuple[str, ...] = ("transfers", "store_waits", "waits_on", "quarantined_plans", "per_instance", "reserved_of", "ops_done",
                    "ops_running", "op_of_reply", "reserving", "beginning", "begins")
    WIRING_FIELDS: tuple[str, ...] = ("ctx", "hooks", "instances", "l2", "dispatch")

    def __init__(self, ctx: ServerContext, hooks: TransferHooks, instances: InstanceMachine,
                 l2: L2Work) -> None:
        self.ctx = ctx
        self.hooks = hooks
        self.instances = instances
        self.l2 = l2
        self.transfers: dict[int, Transfer] = {}
        self.store_waits: dict[int, StoreWait] = {}
        self.waits_on: dict[int, list[int]] = {}  # transfer id -> store waits awaiting it
        self.quarantined_plans: dict[int, Peer] = {}  # expired plans whose slots stay out of use
        self.per_instance: dict[int, int] = {}  # live transfers of each instance
        self.reserved_of: dict[int, int] = {}  # slots reserved by each instance's live stores
        # Server-driven STORE/RETRIEVE ops that carry a not_after: answered -> (ok, answer,
        # until), kept until the not_after (later, the lateness refusal covers it); unanswered -> the
        # first copy's reply_to and the duplicates' reply_tos, all answered alike.
        self.ops_done: OrderedDict[OpIdent, tuple[bool, object, float]] = OrderedDict()
        self.ops_running: dict[OpIdent, tuple[ReplyTo, list[ReplyTo], float]] = {}
        self.op_of_reply: dict[ReplyTo, OpIdent] = {}
        # stores whose chunks are reserved a slice per loop turn (module doc), oldest first
        self.reserving: deque[StoreSlices] = deque()
        # transfers a row prepared, and their CopyBegins / PlanBegins, run right after it
        self.beginning: dict[int, tuple[Transfer, TransferRequest, bool]] = {}
        self.begins: list[CopyBegins | PlanBegins] = []
        self.dispatch = TRANSFER_TABLE.bind(self, _transfer_id, self.state, ctx.counters, ctx.reply_error,
                                            self._set_state)

    def state(self, transfer_id: Hashable) -> TransferState:
        t = self.transfers.get(transfer_id)  # type: ignore[call-overload]
        if t is None:
            return TransferState.ABSENT
        return TransferState.PREPARED if t.engine_driven else TransferState.RUNNING

    def _set_state(self, transfer_id: Hashable, state: TransferState) -> None:
        """TRANSFER_TABLE's assignment. ``ABSENT``: a transfer that ended is forgotten, with its
        count and reservations against its instance (a creating request addresses none: its
        transfer begins in a row of its own). ``RUNNING`` / ``PREPARED``: the transfer its begin
        row filed."""
        if state is TransferState.ABSENT:
            if transfer_id in self.transfers:
                assert isinstance(transfer_id, int)
                self._take(transfer_id)
            return
        assert self.state(transfer_id) is state, "a begun transfer that is not filed as its row says"

    def run(self, event: Any, now: float, out: list[Effect]) -> None:
        """Run ``event``'s row, then the begin rows of the transfers it prepared."""
        self.dispatch.run(event, now, out)
        if self.begins:
            self._run_begins(now, out)

    def _run_begins(self, now: float, out: list[Effect]) -> None:
        begins, self.begins = self.begins, []
        for event in begins:
            self.dispatch.run(event, now, out)

    def _name_begin(self, t: Transfer, request: TransferRequest, counted: bool = False) -> None:
        """``t`` begins by its own row (``CopyBegins`` / ``PlanBegins``) once this row is done."""
        self.beginning[t.transfer_id] = (t, request, counted)
        self.begins.append(PlanBegins(t.transfer_id) if t.engine_driven else CopyBegins(t.transfer_id))

    def timer_live(self, timer: Timer) -> bool:
        if isinstance(timer, PlanQuarantineEnd):
            return timer.transfer_id in self.quarantined_plans
        assert isinstance(timer, TransferDeadline)
        return timer.transfer_id in self.transfers

    # ============================================================================= guards
    # Pure: they read the machine and the raw event, and name the specific event whose row runs.

    def _classify_request(self, ev: TransferRequest, state: TransferState, now: float) -> Any:
        """What a creating request is, in the order the server has always checked it: late
        (``LateTransfer``), a duplicate of a running or answered op (``DuplicateTransfer``), a
        resend naming a registration gone (``StaleResend``), refused by its instance or its
        transfer cap (``RefusedTransfer``), else ``AdmittedStore`` / ``AdmittedRetrieve``."""
        if not isinstance(ev, PrepareRetrieve):
            late = self._lateness(ev, now)
            if late is not None:
                return LateTransfer(ev, late)
        ident, _until = self._op_ident(ev, now)
        if ident is not None and (ident in self.ops_running or self._kept_answer(ident, now) is not None):
            assert isinstance(ev, (Store, Retrieve))
            return DuplicateTransfer(ev)
        stale = self._stale_registration(ev)
        if stale is not None:
            assert isinstance(ev, (Store, Retrieve))
            return StaleResend(ev, stale)
        skip = ev.skip_first_n_tokens if isinstance(ev, (Retrieve, PrepareRetrieve)) else 0
        registration, keys_or_err = self.instances.worker_keys(ev.key, ev.instance_id, skip, ev.peer)
        if registration is None or isinstance(keys_or_err, ProtocolError):
            assert isinstance(keys_or_err, ProtocolError)
            return RefusedTransfer(ev, keys_or_err)
        if isinstance(ev, (Store, PrepareStore)):
            over = self._over_transfer_cap(ev)
            return RefusedTransfer(ev, over) if over is not None else AdmittedStore(ev, registration, keys_or_err)
        answered_at_once = (not all(self.ctx.index.is_readable(k) for k in keys_or_err)
                            or (not keys_or_err and not isinstance(ev, PrepareRetrieve)))
        over = None if answered_at_once else self._over_transfer_cap(ev)
        return RefusedTransfer(ev, over) if over is not None else AdmittedRetrieve(ev, registration, keys_or_err)

    def _classify_commit(self, ev: CommitTransfer, state: TransferState, now: float) -> CommitTransfer:
        if state is TransferState.PREPARED and self.transfers[ev.transfer_id].peer != ev.peer:
            return ForeignCommit(ev.transfer_id, ev.ok, reply_to=ev.reply_to, peer=ev.peer)
        return ev

    # ============================================================================= requests

    def _on_late(self, ev: LateTransfer, now: float, out: list[Effect]) -> None:
        if ev.refusal.kind is ErrorKind.TIMEOUT:
            self.ctx.counters["late_transfers_refused"] += 1
        self.ctx.reply_error(out, ev.reply_to, ev.refusal)

    def _on_duplicate(self, ev: DuplicateTransfer, now: float, out: list[Effect]) -> None:
        """Answered like the first copy: now when it was, else when it is."""
        ident, _until = self._op_ident(ev.request, now)
        assert ident is not None
        self._forget_answers(now)
        self.ctx.counters["duplicate_transfers"] += 1
        running = self.ops_running.get(ident)
        if running is not None:
            running[1].append(ev.reply_to)
            return
        ok, answer, _kept_until = self.ops_done[ident]
        if ok:
            out.append(Reply(ev.reply_to, answer))
        else:
            assert isinstance(answer, ProtocolError)
            self.ctx.reply_error(out, ev.reply_to, answer)

    def _on_stale_resend(self, ev: StaleResend, now: float, out: list[Effect]) -> None:
        def refuse(request: Any, now: float, out: list[Effect]) -> None:
            self.ctx.counters["resends_refused"] += 1
            self.ctx.reply_error(out, ev.reply_to, ev.refusal)

        self._once(ev.request, now, out, refuse)

    def _on_refused(self, ev: RefusedTransfer, now: float, out: list[Effect]) -> None:
        def refuse(request: Any, now: float, out: list[Effect]) -> None:
            self._count_resend(request)
            if self.instances.owns(request.instance_id, request.peer):
                self.instances.seen(request.instance_id, now)  # its traffic, refused or not
            self.ctx.reply_error(out, ev.reply_to, ev.refusal)

        self._once(ev.request, now, out, refuse)

    def _on_store(self, ev: AdmittedStore, now: float, out: list[Effect]) -> None:
        self._once(ev.request, now, out, lambda request, now, out: self._store(ev, now, out))

    def _on_retrieve(self, ev: AdmittedRetrieve, now: float, out: list[Effect]) -> None:
        self._once(ev.request, now, out, lambda request, now, out: self._retrieve(ev, now, out))

    def _count_resend(self, request: TransferRequest) -> None:
        if isinstance(request, (Store, Retrieve)) and request.registration is not None:
            self.ctx.counters["resends_run"] += 1

    def _store(self, admitted: AdmittedStore, now: float, out: list[Effect]) -> None:
        ev = admitted.request
        self._count_resend(ev)
        self.instances.seen(ev.instance_id, now)
        tid = self._new_transfer_id()
        room = self.instances.slot_quota(ev.instance_id) - self.reserved_of.get(ev.instance_id, 0)
        store = StoreSlices(ev, now, admitted.registration, self.instances.registration_id(ev.instance_id),
                            admitted.keys, tid, room, self.instances.tenant_of(ev.instance_id))
        # counted as the instance's transfer, and its reservations as its own, from now on
        self.per_instance[ev.instance_id] = self.per_instance.get(ev.instance_id, 0) + 1
        if self._reserve_slice(store):
            self._store_reserved(store, out)
        else:
            self.reserving.append(store)

    def _reserve_slice(self, store: StoreSlices) -> bool:
        """Reserve the store's chunks from where it stopped, making at most
        ``STORE_EVICTION_SLICE`` evictions; returns whether every chunk has been looked at."""
        ctx, ev = self.ctx, store.ev
        engine_driven = isinstance(ev, PrepareStore)
        owner = TransferOwner(store.transfer_id)
        keys, start = store.keys, store.offset
        first = ev.key.start // ctx.config.chunk_size
        placements, reserved, awaited, room = store.placements, store.reserved, store.awaited, store.room
        refusing = False  # admission refused a chunk: the ones after it are no prefix's hit either
        nbytes = store.inst.object_bytes
        # Without admission, the chunks are reserved in one batch up to the room left (one expiry
        # step and entry), stopping before an eviction past the slice's; the chunks past the
        # room are looked at one by one below.
        tried: list[int | None] = []
        evicted = False  # the slice stopped before an eviction past its own
        if ctx.admission is None:
            rest = keys[start:] if start else keys
            limit = max(0, room - len(reserved))
            tried = ctx.index.reserve_writes(rest, owner, nbytes, store.now, store.tenant, limit,
                                             STORE_EVICTION_SLICE)
            evicted = len(tried) < len(rest) and len(tried) - tried.count(None) < limit
        n_reserved = len(reserved)
        stop = start + len(tried) if evicted else len(keys)
        if tried and None not in tried:  # every chunk tried got a slot: no per-chunk branch
            end = start + len(tried)
            placements += zip(range(first + start, first + end), tried)  # type: ignore[arg-type]
            reserved += keys[start:end]
            start = end
        for offset in range(start, stop):
            k = keys[offset]
            if offset - store.offset < len(tried):
                slot = tried[offset - store.offset]
            elif ctx.admission is not None and ctx.index.state(k) is ObjectState.ABSENT and (
                    refusing or not ctx.admission.admits(k.chunk_hash)):
                # Not looked up often enough yet: its slot stays with what is reused.
                refusing = True
                store.skipped += 1
                ctx.counters["stores_not_admitted"] += 1
                continue
            elif len(reserved) >= room:
                if ctx.index.is_readable(k) or ctx.index.writer_of(k) is not None:
                    slot = None  # present or being written: skipped as always
                else:
                    ctx.counters["quota_skips"] += 1
                    store.skipped += 1
                    continue
            else:
                slot = ctx.index.reserve_write(k, owner, nbytes, store.now, store.tenant)
            if slot is None:
                store.skipped += 1
                writer = ctx.index.writer_of(k)
                if not engine_driven and isinstance(writer, TransferOwner):
                    other = self.transfers.get(writer.transfer_id)
                    if other is not None and not other.engine_driven:
                        awaited[other.transfer_id] = None
            else:
                placements.append((first + offset, slot))
                reserved.append(k)
        store.offset = stop
        if len(reserved) > n_reserved:
            iid = ev.instance_id
            self.reserved_of[iid] = self.reserved_of.get(iid, 0) + len(reserved) - n_reserved
        return stop == len(keys)

    def run_reserving(self, out: list[Effect]) -> None:
        """One slice of the oldest store reserving in slices (module doc)."""
        if not self.reserving:
            return
        store = self.reserving.popleft()
        ev = store.ev
        if self.instances.registration_id(ev.instance_id) != store.registration:
            # its instance went (or registered anew) meanwhile: nothing is copied
            self.ctx.index.abort_writes(store.reserved, TransferOwner(store.transfer_id), store.now)
            self._uncount(store)
            self.ctx.error(out, ev.reply_to, ErrorKind.NOT_REGISTERED,
                           f"instance {ev.instance_id!r} went while its store was being reserved")
            return
        try:
            done = self._reserve_slice(store)
        except Exception as exc:  # a fault of the server: the store must still be answered
            self.ctx.index.abort_writes(store.reserved, TransferOwner(store.transfer_id), store.now)
            self._uncount(store)
            self.ctx.counters["internal_errors"] += 1
            self.ctx.error(out, ev.reply_to, ErrorKind.INTERNAL, f"{type(exc).__name__}: {exc}")
            return
        if done:
            self._store_reserved(store, out)
            if self.begins:
                self._run_begins(store.now, out)
        else:
            self.reserving.append(store)

    def next_reserving(self) -> float | None:
        """When the oldest store reserving in slices has its next slice due (its own time)."""
        return self.reserving[0].now if self.reserving else None

    def _uncount(self, store: StoreSlices) -> None:
        iid = store.ev.instance_id
        n = self.per_instance[iid] - 1
        if n:
            self.per_instance[iid] = n
        else:
            del self.per_instance[iid]
        if store.reserved:
            r = self.reserved_of[iid] - len(store.reserved)
            if r:
                self.reserved_of[iid] = r
            else:
                del self.reserved_of[iid]

    def _store_reserved(self, store: StoreSlices, out: list[Effect]) -> None:
        """Every chunk of the store was looked at: answer it, or begin its copy or plan."""
        ctx, ev, now = self.ctx, store.ev, store.now
        engine_driven = isinstance(ev, PrepareStore)
        tid, placements, reserved, skipped = store.transfer_id, store.placements, store.reserved, store.skipped
        wait: StoreWait | None = None
        if store.awaited:
            # A duplicate (or a concurrent store of the same chunks): answering before those
            # writes end would let the worker free blocks an in-flight copy may still read.
            ctx.counters["stores_awaiting_writers"] += 1
            wait = StoreWait(ctx.new_id(), ev.reply_to, set(store.awaited), skipped=skipped)
            self.store_waits[wait.wait_id] = wait
            for other_tid in store.awaited:
                self.waits_on.setdefault(other_tid, []).append(wait.wait_id)
        if not engine_driven and not placements:
            self._uncount(store)
            if wait is None:
                out.append(Reply(ev.reply_to, StoreResult(True, 0, skipped)))
            return
        first = ev.key.start // ctx.config.chunk_size
        t = Transfer(
            tid, TransferKind.STORE, engine_driven, ev.key.request_id, ev.reply_to,
            tuple(reserved), tuple(placements), skipped, self._deadline(engine_driven, now),
            store.inst.object_bytes, ev.instance_id, ev.peer,
        )
        if ctx.held is not None and reserved:
            C = ctx.config.chunk_size
            hashes, _err = ctx.hashes(ev.key, ev.key.end // C)
            t.chunks = HeldChunks.describe(ev.key, hashes, C, first, len(store.keys))
            t.world_size = ev.key.world_size
        if wait is not None:
            t.wait_id = wait.wait_id
            wait.awaiting.add(tid)
        self._name_begin(t, ev, counted=True)

    def _retrieve(self, admitted: AdmittedRetrieve, now: float, out: list[Effect]) -> None:
        ev, inst, keys = admitted.request, admitted.registration, admitted.keys
        ctx = self.ctx
        engine_driven = isinstance(ev, PrepareRetrieve)
        self._count_resend(ev)
        self.instances.seen(ev.instance_id, now)
        if not all(ctx.index.is_readable(k) for k in keys):
            ctx.counters["retrieve_misses"] += 1
            if engine_driven:
                out.append(Reply(ev.reply_to, TransferPlan(-1, (), False, TransferKind.RETRIEVE,
                                                           ev.skip_first_n_tokens)))
            else:
                out.append(Reply(ev.reply_to, RetrieveResult(False, len(keys))))
            return
        if not keys and not engine_driven:
            out.append(Reply(ev.reply_to, RetrieveResult(True, 0)))
            return
        tid = self._new_transfer_id()
        owner = TransferOwner(tid)
        first = ev.key.start // ctx.config.chunk_size
        # one read count each, in one batch (a leased object is in no LRU set: nothing to touch)
        leased = ctx.index.lease_slots(keys, owner, now)
        assert len(leased) == len(keys)
        placements: list[Placement] = [(first + offset, slot) for offset, (_k, slot) in enumerate(leased)]
        t = Transfer(
            tid, TransferKind.RETRIEVE, engine_driven, ev.key.request_id, ev.reply_to,
            tuple(keys), tuple(placements), 0, self._deadline(engine_driven, now), inst.object_bytes,
            ev.instance_id, ev.peer,
        )
        self._name_begin(t, ev)

    def _new_transfer_id(self) -> int:
        while True:
            tid = self.ctx.new_transfer_id()
            if tid not in self.transfers and tid not in self.quarantined_plans:
                return tid

    def _deadline(self, engine_driven: bool, now: float) -> float:
        c = self.ctx.config
        return now + (min(c.plan_ttl, c.lease_ttl) if engine_driven else c.lease_ttl)

    def _over_transfer_cap(self, ev: TransferRequest) -> ProtocolError | None:
        cap = self.ctx.config.max_transfers_per_instance
        if self.per_instance.get(ev.instance_id, 0) < cap:
            return None
        return ProtocolError(ErrorKind.TOO_LARGE, f"instance has {cap} transfers in flight")

    def _take(self, tid: int) -> Transfer:
        """Remove a live transfer from the tables (its completion or expiry)."""
        t = self.transfers.pop(tid)
        n = self.per_instance[t.instance_id] - 1
        if n:
            self.per_instance[t.instance_id] = n
        else:
            del self.per_instance[t.instance_id]
        if t.kind is TransferKind.STORE and t.keys:
            r = self.reserved_of[t.instance_id] - len(t.keys)
            if r:
                self.reserved_of[t.instance_id] = r
            else:
                del self.reserved_of[t.instance_id]
        return t

    def _lateness(self, ev: Store | PrepareStore | Retrieve, now: float) -> ProtocolError | None:
        """Why a STORE/RETRIEVE handled at ``now`` is too late (after its ``not_after``: its
        worker may have given up on it and handed the blocks back to vLLM), or its ``not_after``
        malformed; None when it may run."""
        not_after = ev.not_after
        if not_after is None:
            return None
        if isinstance(not_after, bool) or not isinstance(not_after, (int, float)) or math.isnan(not_after):
            return ProtocolError(ErrorKind.VALIDATION, "not_after must be a number or None")
        if now <= not_after:
            return None
        return ProtocolError(ErrorKind.TIMEOUT, f"handled at {now:.6f}, after its not_after {not_after:.6f}")

    def _op_ident(self, ev: TransferRequest, now: float) -> tuple[OpIdent | None, float]:
        """A server-driven op with a ``not_after``: what identifies it (a network duplicate has
        the same) and until when its answer is kept for duplicates; else (None, 0.0)."""
        if not isinstance(ev, (Store, Retrieve)) or ev.not_after is None:
            return None, 0.0
        until = min(ev.not_after, now + self.ctx.config.max_not_after_ahead)
        skip = ev.skip_first_n_tokens if isinstance(ev, Retrieve) else -1
        return (ev.peer, ev.instance_id, ev.key.request_id, ev.key.worker_id, ev.key.start, ev.key.end,
                ev.block_ids, skip, ev.not_after, self._named_registration(ev)), until

    def _kept_answer(self, ident: OpIdent, now: float) -> tuple[bool, object, float] | None:
        """The answer kept for ``ident`` once ``_forget_answers(now)`` has run. Changes nothing."""
        left = len(self.ops_done)
        for oldest, (_ok, _result, kept_until) in self.ops_done.items():
            if kept_until >= now and left <= self.ctx.config.tombstone_cap:
                break
            if oldest == ident:
                return None
            left -= 1
        return self.ops_done.get(ident)

    def _forget_answers(self, now: float) -> None:
        """Answers whose not_after passed (or over the cap) go, oldest first."""
        while self.ops_done:
            oldest, (_ok, _result, kept_until) = next(iter(self.ops_done.items()))
            if kept_until >= now and len(self.ops_done) <= self.ctx.config.tombstone_cap:
                break
            del self.ops_done[oldest]

    def _once(self, ev: TransferRequest, now: float, out: list[Effect],
              run: Callable[[Any, float, list[Effect]], None]) -> None:
        """Run a STORE/RETRIEVE's row at most once per op. A server-driven one with a
        ``not_after`` that the network delivered twice (same instance, request, range, blocks,
        skip, ``not_after`` and ``registration``: the same op) never starts a second copy -- it
        could read or write blocks the worker got back after the first answer: its duplicates
        (``DuplicateTransfer``) are answered like the first copy, when that one is (its answer
        is kept until the ``not_after``; later, the lateness refusal covers it).

        A resend after ``NOT_REGISTERED`` repeats its original but names the registration it
        follows (``registration``), so it is another op: the original's remembered refusal does
        not answer it, while a late duplicate of the original still gets that refusal and never
        copies. A resend runs only while the registration it names is the instance's current
        one; else it is refused ``NOT_REGISTERED`` before any work (``StaleResend``, its answer
        kept for its duplicates like any other)."""
        ident, until = self._op_ident(ev, now)
        if ident is not None:
            self._forget_answers(now)
        mark = len(out)
        run(ev, now, out)
        if ident is None:
            return
        for e in out[mark:]:
            if isinstance(e, (Reply, ErrorReply)) and e.reply_to == ev.reply_to:
                self._remember_answer(ident, e, until)
                return
        self.ops_running[ident] = (ev.reply_to, [], until)
        self.op_of_reply[ev.reply_to] = ident

    @staticmethod
    def _named_registration(ev: Store | Retrieve) -> int | None:
        """The registration a resend names (None: not a resend); what is not an int names none
        that exists, and is refused as such."""
        reg = ev.registration
        if reg is None or (isinstance(reg, int) and not isinstance(reg, bool)):
            return reg
        return -1

    def _stale_registration(self, ev: TransferRequest) -> ProtocolError | None:
        """Why a resend may not run: the registration it names is not the instance's current one
        (the instance was reaped, unregistered or registered anew since, or the server
        restarted). None for a resend that may run, and for every request that is no resend."""
        if not isinstance(ev, (Store, Retrieve)) or ev.registration is None:
            return None
        named = self._named_registration(ev)
        current = self.instances.registration_id(ev.instance_id) if isinstance(ev.instance_id, int) else None
        if current is not None and current == named:
            return None
        now_is = "not registered" if current is None else "registered anew since"
        return ProtocolError(ErrorKind.NOT_REGISTERED,
                             f"resend for instance {ev.instance_id!r} names registration {ev.registration!r}: "
                             f"the instance is {now_is}")

    def _remember_answer(self, ident: OpIdent, answer: Reply | ErrorReply, until: float) -> None:
        ok = isinstance(answer, Reply)
        self.ops_done[ident] = (ok, answer.result if isinstance(answer, Reply) else answer.error, until)
        self.ops_done.move_to_end(ident)

    def answer_duplicates(self, out: list[Effect]) -> None:
        """A deferred STORE/RETRIEVE was answered in ``out``: answer its duplicates alike."""
        extra: list[Effect] = []
        for e in out:
            if isinstance(e, (Reply, ErrorReply)):
                ident = self.op_of_reply.pop(e.reply_to, None)
                if ident is None:
                    continue
                _first, duplicates, until = self.ops_running.pop(ident)
                self._remember_answer(ident, e, until)
                for reply_to in duplicates:
                    extra.append(attrs.evolve(e, reply_to=reply_to))
        out.extend(extra)

    def _on_begin(self, ev: CopyBegins | PlanBegins, now: float, out: list[Effect]) -> None:
        """The transfer a request prepared begins: filed (its row assigns RUNNING / PREPARED),
        counted against its instance, its deadline armed, its slots pinned; then its
        ``StartTransfer`` or the plan's reply."""
        t, request, counted = self.beginning.pop(ev.transfer_id)
        self._begin(t, request, now, out, counted)

    def _begin(self, t: Transfer, ev: TransferRequest, now: float, out: list[Effect], counted: bool = False) -> None:
        """Start the transfer (``counted``: a store, counted in ``per_instance`` and
        ``reserved_of`` while it reserved)."""
        ctx = self.ctx
        self.transfers[t.transfer_id] = t
        if not counted:
            self.per_instance[t.instance_id] = self.per_instance.get(t.instance_id, 0) + 1
            if t.kind is TransferKind.STORE and t.keys:
                self.reserved_of[t.instance_id] = self.reserved_of.get(t.instance_id, 0) + len(t.keys)
        ctx.counters["transfers_started"] += 1
        skip = getattr(ev, "skip_first_n_tokens", 0)
        assert t.deadline is not None
        ctx.timers.push(t.deadline, TransferDeadline(t.transfer_id))
        ctx.pin(TransferOwner(t.transfer_id), [slot for _c, slot in t.placements])
        if t.engine_driven:
            if t.kind is TransferKind.STORE and t.placements:  # written before served: no old bytes
                out.append(ScrubSlots([slot for _c, slot in t.placements], t.object_bytes or ctx.config.slot_bytes))
            out.append(Reply(ev.reply_to, TransferPlan(t.transfer_id, t.placements, True, t.kind, skip,
                                                       t.object_bytes)))
        else:
            assert isinstance(ev, (Store, Retrieve))
            not_after = ev.not_after
            if not_after is not None:
                not_after = min(not_after, now + ctx.config.max_not_after_ahead)
            out.append(StartTransfer(
                t.transfer_id, t.kind, ev.instance_id, t.request_id, ev.reply_to,
                ev.key.start, ev.key.end, t.placements, ev.block_ids, skip,
                not_after, t.object_bytes,
            ))

    # ============================================================================= completions

    def _on_transfer_finished(self, ev: TransferFinished, now: float, out: list[Effect]) -> None:
        t = self.transfers[ev.transfer_id]
        self._finish(t, bool(ev.ok), t.reply_to, now, out)
        self.ctx.unpin(TransferOwner(t.transfer_id))

    def _on_stale_finished(self, ev: TransferFinished, now: float, out: list[Effect]) -> None:
        self.ctx.counters["stale_events"] += 1
        if ev.transfer_id not in self.quarantined_plans:
            self.ctx.unpin(TransferOwner(ev.transfer_id))  # expired earlier: the copy is over now

    def _on_commit(self, ev: CommitTransfer, now: float, out: list[Effect]) -> None:
        t = self.transfers[ev.transfer_id]
        self._finish(t, bool(ev.ok), ev.reply_to, now, out)
        self.ctx.unpin(TransferOwner(t.transfer_id))

    def _on_foreign_commit(self, ev: ForeignCommit, now: float, out: list[Effect]) -> None:
        self.ctx.error(out, ev.reply_to, ErrorKind.FORBIDDEN, f"transfer {ev.transfer_id} belongs to another peer")

    def _on_commit_unknown(self, ev: CommitTransfer, now: float, out: list[Effect]) -> None:
        if ev.transfer_id in self.quarantined_plans and self.quarantined_plans[ev.transfer_id] == ev.peer:
            # An expired plan's engine finished its copy after all: quarantine over.
            del self.quarantined_plans[ev.transfer_id]
            self.ctx.unpin(TransferOwner(ev.transfer_id))
        self.ctx.error(out, ev.reply_to, ErrorKind.UNKNOWN_TRANSFER, f"no prepared transfer {ev.transfer_id}")

    def _on_deadline(self, timer: TransferDeadline, now: float, out: list[Effect]) -> None:
        """An uncommitted plan, or a completion the runtime never reported: fail it so the
        request is answered (server-driven) and the bookkeeping is bounded."""
        t = self.transfers[timer.transfer_id]
        self.ctx.counters["expired_plans" if t.engine_driven else "expired_transfers"] += 1
        self._expire(t, now, out)

    def instance_gone(self, instance_id: int, now: float, out: list[Effect]) -> None:
        """``instance_id`` was reaped: its uncommitted plans fail now. Its running server-driven
        copies end as always, by their ``TransferFinished`` (the runtime reports one for every
        ``StartTransfer``) or their deadline."""
        for t in [t for t in self.transfers.values() if t.instance_id == instance_id and t.engine_driven]:
            self.dispatch.run(PlanOfGoneInstance(t.transfer_id), now, out)

    def _on_plan_of_gone_instance(self, ev: PlanOfGoneInstance, now: float, out: list[Effect]) -> None:
        self.ctx.counters["plans_of_reaped_instances"] += 1
        self._expire(self.transfers[ev.transfer_id], now, out)

    def _expire(self, t: Transfer, now: float, out: list[Effect]) -> None:
        """Fail ``t`` (its row forgets it). An engine-driven plan's slots stay out of use one
        more lease TTL when an effect may still use them."""
        ctx, tid = self.ctx, t.transfer_id
        self._finish(t, False, None if t.engine_driven else t.reply_to, now, out)
        if t.engine_driven and TransferOwner(tid) in ctx.pins:
            # The engine may still be copying (its commit lost) or be gone: no event will say
            # which, so its slots stay out of use one more lease TTL.
            self.quarantined_plans[tid] = t.peer
            ctx.timers.push(now + ctx.config.lease_ttl, PlanQuarantineEnd(tid))

    def _on_quarantine_end(self, timer: PlanQuarantineEnd, now: float, out: list[Effect]) -> None:
        self.quarantined_plans.pop(timer.transfer_id, None)
        self.ctx.counters["plan_quarantines_ended"] += 1
        self.ctx.unpin(TransferOwner(timer.transfer_id))

    def _finish(self, t: Transfer, ok: bool, reply_to: ReplyTo, now: float, out: list[Effect]) -> None:
        """Complete a transfer; ``reply_to`` None (an expired plan) sends no reply."""
        ctx = self.ctx
        owner = TransferOwner(t.transfer_id)
        if not ok:
            ctx.counters["transfers_failed"] += 1
        if t.kind is TransferKind.STORE:
            stored: list[ObjectKey] = []
            if ok:
                stored = ctx.index.finish_writes(t.keys, owner, now)
            else:
                ctx.index.abort_writes(t.keys, owner, now)
            result: object = StoreResult(ok and len(stored) == len(t.keys), len(stored),
                                         t.skipped + len(t.keys) - len(stored))
            if ctx.held is not None and stored:
                ctx.report_drops(out)
                ctx.held.stored_l1(t.chunks, t.world_size, ctx.index.is_readable, out)
            if stored and ctx.config.write_behind:
                self.l2.write_behind(stored, t.object_bytes, now, out,
                                     (t.world_size, t.chunks) if ctx.held is not None else None)
            written = ok and len(stored) == len(t.keys)
            for wid in self.waits_on.pop(t.transfer_id, ()):
                self._end_awaited(wid, t.transfer_id, written, None, out)
            if t.wait_id is not None:
                assert isinstance(result, StoreResult)
                self._end_awaited(t.wait_id, t.transfer_id, result.ok, result, out)
                return
        else:
            # the copy's holder leased exactly its keys: releasing the holder releases them
            ctx.index.release_owner(owner, ReleaseReason.TRANSFER, now)
            if ok:
                self.hooks.release_after_retrieve(RequestKey(t.peer, t.request_id), t.keys, now)
            result = RetrieveResult(ok, len(t.keys))
        if reply_to is not None:
            out.append(Reply(reply_to, result))

    def _end_awaited(self, wait_id: int, transfer_id: int, ok: bool, own: StoreResult | None,
                     out: list[Effect]) -> None:
        """Transfer ``transfer_id``, which store wait ``wait_id`` awaits, ended (``own``: it is the
        waiting store's own transfer, with its result); the last one sends the reply."""
        wait = self.store_waits[wait_id]
        wait.awaiting.discard(transfer_id)
        wait.ok = wait.ok and ok
        if own is not None:
            wait.stored, wait.skipped = own.stored, own.skipped
        if not wait.awaiting:
            del self.store_waits[wait_id]
            out.append(Reply(wait.reply_to, StoreResult(wait.ok, wait.stored, wait.skipped)))

    def check_invariants(self) -> None:
        for owner in self.ctx.index.leases_by_owner():
            if isinstance(owner, TransferOwner):
                assert owner.transfer_id in self.transfers, "lease of a finished transfer"
        for wid, wait in self.store_waits.items():
            assert wait.wait_id == wid and wait.awaiting, "a store wait with nothing to wait for"
            for tid in wait.awaiting:
                assert tid in self.transfers, "a store waits for a finished transfer"
                assert wid in self.waits_on.get(tid, ()) or self.transfers[tid].wait_id == wid
        for tid in self.waits_on:
            assert tid in self.transfers, "waits registered on a finished transfer"
        assert len(self.ops_running) == len(self.op_of_reply), "deferred op tables out of sync"
        for reply_to, ident in self.op_of_reply.items():
            assert self.ops_running[ident][0] == reply_to
        for tid in self.quarantined_plans:
            assert TransferOwner(tid) in self.ctx.pins and tid not in self.transfers
        live: dict[int, int] = {}
        reserved: dict[int, int] = {}
        for store in self.reserving:  # stores reserving in slices count as their instance's
            iid = store.ev.instance_id
            live[iid] = live.get(iid, 0) + 1
            if store.reserved:
                reserved[iid] = reserved.get(iid, 0) + len(store.reserved)
        for t in self.transfers.values():
            live[t.instance_id] = live.get(t.instance_id, 0) + 1
            if t.kind is TransferKind.STORE and t.keys:
                reserved[t.instance_id] = reserved.get(t.instance_id, 0) + len(t.keys)
        assert live == self.per_instance and reserved == self.reserved_of, "per-instance transfer counts"


# (state of the transfer the event addresses, event type) -> (handler, next state), which the
# dispatcher assigns (TransferMachine._set_state). A creating request addresses no transfer yet
# (ABSENT): its guard classifies it, its row answers it or prepares a transfer, and the transfer
# begins by a row of its own (CopyBegins / PlanBegins: ABSENT -> RUNNING / PREPARED) right after.
# A completion of a plan is stale (not listed: counted); a commit of a running server-driven
# transfer is refused UNKNOWN_TRANSFER (not listed).
TRANSFER_TABLE: Table[TransferState] = Table(
    "LookupServer transfers (one transfer id)", TransferState, TransferState.ABSENT, {
        (TransferState.ABSENT, AdmittedStore): (TransferMachine._on_store, TransferState.ABSENT),
        (TransferState.ABSENT, AdmittedRetrieve): (TransferMachine._on_retrieve, TransferState.ABSENT),
        (TransferState.ABSENT, LateTransfer): (TransferMachine._on_late, TransferState.ABSENT),
        (TransferState.ABSENT, DuplicateTransfer): (TransferMachine._on_duplicate, TransferState.ABSENT),
        (TransferState.ABSENT, StaleResend): (TransferMachine._on_stale_resend, TransferState.ABSENT),
        (TransferState.ABSENT, RefusedTransfer): (TransferMachine._on_refused, TransferState.ABSENT),
        (TransferState.ABSENT, CopyBegins): (TransferMachine._on_begin, TransferState.RUNNING),
        (TransferState.ABSENT, PlanBegins): (TransferMachine._on_begin, TransferState.PREPARED),
        (TransferState.ABSENT, TransferFinished): (TransferMachine._on_stale_finished, TransferState.ABSENT),
        (TransferState.ABSENT, CommitTransfer): (TransferMachine._on_commit_unknown, TransferState.ABSENT),
        (TransferState.ABSENT, PlanQuarantineEnd): (TransferMachine._on_quarantine_end, TransferState.ABSENT),
        (TransferState.RUNNING, TransferFinished): (TransferMachine._on_transfer_finished, TransferState.ABSENT),
        (TransferState.RUNNING, TransferDeadline): (TransferMachine._on_deadline, TransferState.ABSENT),
        (TransferState.PREPARED, CommitTransfer): (TransferMachine._on_commit, TransferState.ABSENT),
        (TransferState.PREPARED, ForeignCommit): (TransferMachine._on_foreign_commit, TransferState.PREPARED),
        (TransferState.PREPARED, TransferDeadline): (TransferMachine._on_deadline, TransferState.ABSENT),
        (TransferState.PREPARED, PlanOfGoneInstance):
            (TransferMachine._on_plan_of_gone_instance, TransferState.ABSENT),
    }, illegal_kind=ErrorKind.UNKNOWN_TRANSFER, assigns=True, guards={
        Store: TransferMachine._classify_request,
        Retrieve: TransferMachine._classify_request,
        PrepareStore: TransferMachine._classify_request,
        PrepareRetrieve: TransferMachine._classify_request,
        CommitTransfer: TransferMachine._classify_commit,
    })
TRANSFER_CREATORS = (Store, Retrieve, PrepareStore, PrepareRetrieve)
TRANSFER_TIMERS = (TransferDeadline, PlanQuarantineEnd)
