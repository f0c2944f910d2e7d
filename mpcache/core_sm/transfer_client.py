"""``TransferClient``: the worker side of STORE / RETRIEVE, as one pure machine.

Operations are keyed by ``OpId = (request_id, seq)``: every submit gets the next ``seq`` of its
request, so a later op never overwrites an earlier one (F15). One op's life::

    server-driven:  SubmitX -> SENT (Store / Retrieve sent) -> reply -> done
    engine-driven:  SubmitX -> SENT (PrepareStore / PrepareRetrieve) -> TransferPlan
                    -> COPYING (CopyBlocks effect) -> CopyFinished -> COMMITTING (CommitTransfer)
                    -> reply -> done

Reporting (``finished() -> (sending, recving)``, each id at most once per set, memory bounded):

* ``recving``: when a request's retrieve ops are all done -- success or failure. A failed
  retrieve (``ok=False``, error reply, unhealthy server, bad plan) adds its block ids (minus the
  blocks wholly inside ``skip_first_n_tokens``) to ``load_errors()`` so vLLM recomputes them
  (F10); the request is still reported once. A request the engine already finished or aborted
  is not reported in ``recving`` (F16: no double completion).
* ``sending``: once the engine finished the request (``EngineFinished``/``Abort``) **and** every
  op of the request is done -- an abort mid-transfer holds the blocks until the copy's completion
  is observed. So an engine-driven STORE whose plan arrives after the engine finished or aborted
  the request is still copied and committed (the blocks are the request's until ``sending``),
  while a RETRIEVE's late plan is committed ``ok=False`` without a copy (nobody reads it).
  Every engine-finished id is reported exactly once (the connector's
  ``request_finished`` must therefore always delay freeing, as LMCache's does).

Health: while the server is unhealthy, new stores are skipped (done at once) and new retrieves
fail at once into load errors; on becoming unhealthy, ops waiting on the server fail now, ops
whose engine copy is running wait for ``CopyFinished`` and then fail without a commit (their
transfer id belongs to a server that may have restarted). A new epoch of the server
(``ServerEpoch`` with an epoch other than the last one fed: a restart, F13) acts as
``ServerHealth(False)`` then ``ServerHealth(True)``.

Registration: the first ``ServerHealth(server, True)`` (the runtime feeds one at start) sends
``RegisterInstance`` once -- the instance's introduction to its connection's
``mpcache.core_sm.server_link.ServerLink``, which remembers it and alone decides every
registration after it (a new epoch, recovery, ``not_registered``, a failed registration's
retries). An op answered ``NOT_REGISTERED`` (the link already registered again and resent it
once, or gave up) just fails.

Late-copy fence: a server-driven STORE or RETRIEVE carries ``not_after = now + window`` (the
``transfer_timeout``; else ``op_timeout``; else 30 s), and the server refuses one it handles later
(TIMEOUT, no copy). This assumes the worker's ``now`` and the server's are one clock: one host's
monotonic clock in production (server and workers share the host), virtual time in the
simulator. A DMA cannot be cancelled and the worker cannot know whether an op it gave up on
(server unhealthy, new epoch, ``op_timeout``, a request the transport lost: ``UNHEALTHY``) is
still in flight -- nor tell the transport's own request timeout from the server's refusal of a
late request (both ``TIMEOUT``) -- so the request's blocks stay fenced until ``not_after + copy_grace`` (a copy
the server began by ``not_after`` has ended by then) -- but for ``NOT_SENT``, a frame the transport
would not take (no connection), which no server can act on: it is reported in ``sending`` (vLLM frees
the blocks) or in ``recving`` with its load errors (vLLM recomputes into them) only then, never
earlier; ``next_deadline()`` covers it. An op the server answered (result or error) needs no
fence; engine-driven ops need none (the worker runs their copies itself).

Dispatch (``mpcache.core_sm.table``): ``handle`` runs the typed timers now due, then the event, each
through one of three tables it executes -- ``LINK_TABLE`` (its server: ``ServerHealth``,
``ServerEpoch``, the registration's answer), ``REQUEST_TABLE``
(one request id: submits, ``RequestEnded`` for ``Abort`` and each id of ``EngineFinished``, the
fence's end, ``InFlightEnded``) and ``OP_TABLE`` (one op: replies by their correlation,
``CopyFinished``, its timeout, ``OpServerLost``). ``TimerFired`` only makes the due timers run.

The three tables *assign*: each row names one next state, which the dispatcher gives the entity
after the handler (``_set_link_state``, ``_set_request_state``, ``_set_op_state``), and handlers
only change data and append effects. Guards tell a raw event apart first where the next state
depends on more than its type (``_classify_health``, ``_classify_ended``, ``_classify_reply``,
``_classify_copy``, ``_classify_in_flight_ended``: see ``transfer_ops``). A row that changes
what another entity is in names it, and that entity's row runs after its own (``_settle``): a
row that ends an op or a fence names the request (its ``InFlightEnded`` row reports it in
``sending`` or forgets it once nothing of it is in flight), a server's loss names the ops
waiting on it (their ``OpServerLost`` rows).
"""
from __future__ import annotations

import math

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Any

from mpcache.core_sm.effects import CopyBlocks, Effect, SendRequest
from mpcache.core_sm.guarded import GuardedMachine
from mpcache.core_sm.errors import ErrorKind, ProtocolError
from mpcache.core_sm.messages import (
    Abort,
    CacheKey,
    ClientEvent,
    CommitTransfer,
    CopyFinished,
    EngineFinished,
    OpId,
    PrepareRetrieve,
    PrepareStore,
    RegisterInstance,
    ReplyReceived,
    RequestFailed,
    Retrieve,
    RetrieveResult,
    ServerEpoch,
    ServerHealth,
    ServerRequest,
    Store,
    StoreResult,
    SubmitRetrieve,
    SubmitStore,
    TimerFired,
    TransferKind,
    TransferPlan,
)
from mpcache.core_sm.table import Dispatcher, Table
from mpcache.core_sm.timers import Timer, TimerHeap
from mpcache.core_sm.transfer_ops import (
    DEFAULT_STORE_WINDOW,
    EVENTS,
    CopyOfLostServer,
    CopyPlanned,
    CopySkipped,
    FenceEnd,
    InFlightEnded,
    LinkState,
    OpServerLost,
    OpState,
    OpTimeout,
    RegistrationAnswered,
    RepeatedEnd,
    ReportedRequestIdle,
    RequestDrained,
    RequestEnded,
    RequestIdle,
    RequestRecord,
    ServerDown,
    ServerUp,
    TransferClientConfig,
    TransferOp,
    TransferRequestState,
)

__all__ = ["DEFAULT_STORE_WINDOW", "EVENTS", "LINK_TABLE", "OP_TABLE", "REQUEST_TABLE", "TABLES", "LinkState",
           "OpState", "RequestRecord", "TransferClient", "TransferClientConfig", "TransferOp",
           "TransferRequestState"]


class TransferClient(GuardedMachine[ClientEvent]):
    """Worker-side transfer bookkeeping. ``handle``, ``next_deadline``, ``finished``,
    ``load_errors``."""

    def __init__(self, config: TransferClientConfig | None = None) -> None:
        self.config = config if config is not None else TransferClientConfig()
        self._requests: dict[str, RequestRecord] = {}
        self._by_correlation: dict[int, OpId] = {}
        self._ops: dict[OpId, TransferOp] = {}
        self._registration_correlation: int | None = None  # the introduction, until answered
        self._introduced = False  # RegisterInstance sent once; the link registers again, never this
        self._incarnation = 0  # bumped whenever the server is lost (unhealthy, new epoch)
        self._epoch: int | str | None = None
        self._healthy = True
        self._next_correlation = 0
        self._next_seq = 0  # client-wide, so an OpId is never reused
        self._sending: dict[str, None] = {}
        self._recving: dict[str, None] = {}
        self._load_errors: dict[int, None] = {}
        self._failed_retrieves: dict[str, None] = {}
        self._reported_sending: OrderedDict[str, None] = OrderedDict()
        # request id -> time before which its blocks may still be read by a STORE given up on
        self._fences: dict[str, float] = {}
        self._counters = {
            name: 0
            for name in ("stores", "retrieves", "stores_failed", "retrieves_failed",
                         "stores_skipped_unhealthy", "stale_replies", "stale_copies",
                         "duplicate_finishes", "bad_replies", "timeouts", "registrations",
                         "internal_errors", "registration_failures", "not_registered", "server_restarts",
                         "store_fences", "retrieves_skipped_finished")
        }
        self._timers = TimerHeap(self._timer_live)
        # What a row names to run after it (_settle): the requests whose op or fence ended (their
        # InFlightEnded rows), the ops a lost server fails (their OpServerLost rows).
        self._in_flight_ended: list[str] = []
        self._ops_lost: list[OpId] = []
        self._link: Dispatcher[LinkState] = LINK_TABLE.bind(
            self, self._link_address, self._link_state, self._counters, self._refuse, self._set_link_state)
        self._request_d: Dispatcher[TransferRequestState] = REQUEST_TABLE.bind(
            self, _request_id, self.request_state, self._counters, self._refuse, self._set_request_state)
        self._op_d: Dispatcher[OpState] = OP_TABLE.bind(self, self._op_address, self.op_state,
                                                        self._counters, self._refuse, self._set_op_state)
        self._timer_route: dict[type, Dispatcher[Any]] = {FenceEnd: self._request_d, OpTimeout: self._op_d}
        # What the runtime feeds goes to the table of the entity it addresses.
        self._routes: dict[type, Any] = {
            ServerHealth: self._link, ServerEpoch: self._link, CopyFinished: self._op_d,
            SubmitStore: self._request_d, SubmitRetrieve: self._request_d}

    # ============================================================================= public API

    def _dispatch(self, event: ClientEvent, now: float, out: list[Effect]) -> None:
        route = self._routes.get(type(event))
        if route is not None:
            self._run(route, event, now, out)
        elif type(event) is ReplyReceived or type(event) is RequestFailed:
            self._route_reply(event, now, out)
        elif type(event) is Abort or type(event) is EngineFinished:
            self._route_ended(event, now, out)
        elif type(event) is not TimerFired:  # TimerFired: the due timers ran in _advance
            self._counters["stale_replies"] += 1

    def finished(self) -> tuple[frozenset[str], frozenset[str]]:
        """``(sending, recving)`` newly finished since the last call (each id once)."""
        sending, recving = frozenset(self._sending), frozenset(self._recving)
        self._sending.clear()
        self._recving.clear()
        return sending, recving

    def load_errors(self) -> frozenset[int]:
        """Block ids whose load failed since the last call (vLLM recomputes them); clears."""
        errors = frozenset(self._load_errors)
        self._load_errors.clear()
        return errors

    def failed_retrieves(self) -> frozenset[str]:
        """Request ids reported in ``recving`` since the last call whose retrieves (some of
        them) failed -- their failed blocks are in ``load_errors()``; clears. Like ``recving``,
        never holds a request the engine already finished or aborted; at most ``reported_cap``
        ids are kept (the oldest go first)."""
        failed = frozenset(self._failed_retrieves)
        self._failed_retrieves.clear()
        return failed

    def stores_reading_blocks(self) -> bool:
        """Whether a store may still read engine blocks: a STORE (server-driven: the server
        answers once its copy completed) or a PrepareStore (engine-driven: the plan brings the
        copy, which runs before the commit) not answered yet. The worker waits for False before
        vLLM reuses blocks (preemption)."""
        return any(op.kind is TransferKind.STORE and op.state is OpState.SENT for op in self._ops.values())

    def op_state(self, op: object) -> OpState:
        record = self._ops.get(op)  # type: ignore[call-overload]
        return OpState.ABSENT if record is None else record.state

    def loading(self, request_ids: Iterable[str]) -> bool:
        """Whether a load of any of ``request_ids`` has not landed yet: an op still in flight, or
        retrieves given up on while the server may still copy (fenced: their blocks and load
        errors are held until the fence ends). The worker's wait for the step's synchronous loads
        (``SubmitRetrieve.synchronous``) ends when this is False, and ``load_errors()`` then holds
        every block that did not load."""
        for rid in request_ids:
            record = self._requests.get(rid)
            if record is not None and (record.ops or record.recving_fenced):
                return True
        return False

    def settled_by(self, request_ids: Iterable[str]) -> float | None:
        """By when the loads ``loading(request_ids)`` waits on are settled at the latest, by this
        machine's own timers: each op's timeout (an op given up on while the server may still
        copy then holds its blocks until ``not_after + copy_grace``) and each receiving fence's
        end. None when nothing of them is loading; ``math.inf`` when an op has no timeout
        (``op_timeout`` None). It moves later as an op advances (a commit re-arms its timeout),
        so a shell that waits for ``loading`` asks again each time it looks: past this bound
        (plus the shell's own pump interval), a load still unsettled is a bug of the machine."""
        latest: float | None = None
        c = self.config
        for rid in request_ids:
            record = self._requests.get(rid)
            if record is None or not (record.ops or record.recving_fenced):
                continue
            bounds = []
            if record.recving_fenced:
                if rid not in self._fences:
                    return math.inf  # (a receiving fence always has its end: check_invariants)
                bounds.append(self._fences[rid])
            for op in record.ops.values():
                if c.op_timeout is None:
                    return math.inf
                bound = op.sent_at + c.op_timeout
                if not c.engine_driven and op.not_after is not None:
                    bound = max(bound, op.not_after + c.copy_grace)
                bounds.append(bound)
            for bound in bounds:
                latest = bound if latest is None else max(latest, bound)
        return latest

    def ops_of(self, request_id: str) -> tuple[OpId, ...]:
        record = self._requests.get(request_id)
        return () if record is None else tuple(record.ops)

    def next_deadline(self) -> float | None:
        return self._timers.next_deadline()

    def request_state(self, request_id: object) -> TransferRequestState:
        rid = str(request_id)
        record = self._requests.get(rid)
        if record is not None:
            return TransferRequestState.FINISHING if record.engine_finished else TransferRequestState.ACTIVE
        return TransferRequestState.REPORTED if rid in self._reported_sending else TransferRequestState.ABSENT

    def stats(self) -> dict[str, int]:
        out = dict(self._counters)
        out["requests"] = len(self._requests)
        out["ops_in_flight"] = len(self._ops)
        out["correlations"] = len(self._by_correlation)
        out["reported_remembered"] = len(self._reported_sending)
        out["pending_sending"] = len(self._sending)
        out["pending_recving"] = len(self._recving)
        out["load_errors_pending"] = len(self._load_errors)
        out["failed_retrieves_pending"] = len(self._failed_retrieves)
        out["fenced_requests"] = len(self._fences)
        out["timers"] = len(self._timers)
        return out

    def check_invariants(self) -> None:
        for corr, op_id in self._by_correlation.items():
            op = self._ops.get(op_id)
            assert op is not None and op.correlation == corr, "orphan correlation"
        n = 0
        for rid, record in self._requests.items():
            for op_id, op in record.ops.items():
                assert self._ops.get(op_id) is op, "op table out of sync"
                assert op.state is not OpState.ABSENT
                if op.state is OpState.COPYING:
                    assert op.correlation is None
                n += 1
            # (a row that ends the last op or the fence is followed by the request's
            # InFlightEnded row, which forgets or reports it)
            assert record.ops or rid in self._fences, "a request kept with nothing in flight"
        for rid in self._fences:
            assert rid in self._requests, "a fence for a forgotten request"
        assert n == len(self._ops), "an op outside its request"
        assert len(self._reported_sending) <= self.config.reported_cap
        assert len(self._failed_retrieves) <= self.config.reported_cap
        assert self._introduced or self._registration_correlation is None
        live = {t for t in self._timers.timers() if self._timer_live(t)}
        for rid, until in self._fences.items():
            assert FenceEnd(rid, until) in live, "a fence without its end"
        if self.config.op_timeout is not None:
            for op in self._ops.values():
                if op.state in (OpState.SENT, OpState.COMMITTING):
                    assert OpTimeout(op.op, op.sent_at) in live, "an op waiting without its timeout"
        for op in self._ops.values():  # the state assigned agrees with the op's data
            assert (op.correlation is None) == (op.state is OpState.COPYING), "an op's state disagrees with its reply owed"
        assert not self._in_flight_ended and not self._ops_lost, "a row's follow-ups left unrun"

    # ============================================================================= hooks

    def _op_key(self, record: RequestRecord) -> OpId:
        """The key of the next op of ``record`` (legacy: ``(request_id, 0)`` for every op, so a
        later op overwrites the earlier one: F15)."""
        self._next_seq += 1
        record.next_seq += 1
        return (record.request_id, self._next_seq)

    def _report_recving_after_finish(self, record: RequestRecord) -> bool:
        """Whether a retrieve completing after the engine finished/aborted the request is still
        reported in recving (legacy: True, the double completion of F16)."""
        return False

    def _errors_for_failed_retrieve(self, op: TransferOp) -> tuple[int, ...]:
        """Block ids to report when a retrieve fails (legacy: none, so vLLM decodes over
        unwritten KV: F10)."""
        blocks = op.block_ids
        span = op.key.end - op.key.start
        if not blocks or span <= 0 or span % len(blocks):
            return blocks
        tokens_per_block = span // len(blocks)
        return blocks[op.skip_first_n_tokens // tokens_per_block:]

    # ============================================================================= table plumbing

    def _op_address(self, event: object) -> OpId | None:
        if isinstance(event, (ReplyReceived, RequestFailed)):
            return self._by_correlation.get(event.correlation)
        op: OpId = getattr(event, "op")
        return op

    def _refuse(self, out: list[Effect], reply_to: object, error: ProtocolError) -> None:
        raise AssertionError("client events carry no reply_to")  # pragma: no cover

    def _set_link_state(self, server: Hashable, state: LinkState) -> None:
        """LINK_TABLE's assignment: this client's server is now up or down (another server's
        index stays OTHER)."""
        if state is not LinkState.OTHER:
            self._healthy = state is LinkState.UP

    def _set_request_state(self, request_id: Hashable, state: TransferRequestState) -> None:
        """REQUEST_TABLE's assignment. ACTIVE / FINISHING: the record a row filed or kept, the
        engine done with it or not; ABSENT: the record is forgotten; REPORTED: forgotten too, its
        id remembered as reported (at most ``reported_cap`` ids, the oldest forgotten first)."""
        rid = str(request_id)
        if state is TransferRequestState.ACTIVE or state is TransferRequestState.FINISHING:
            self._requests[rid].engine_finished = state is TransferRequestState.FINISHING
            return
        self._requests.pop(rid, None)
        if state is TransferRequestState.REPORTED and rid not in self._reported_sending:
            self._reported_sending[rid] = None
            while len(self._reported_sending) > self.config.reported_cap:
                self._reported_sending.popitem(last=False)

    def _set_op_state(self, op_id: Hashable, state: OpState) -> None:
        """OP_TABLE's assignment: the op is now SENT, COPYING or COMMITTING, or done (ABSENT:
        dropped from its request, its reply no longer expected). A submit files an op SENT."""
        op = self._ops.get(op_id)  # type: ignore[call-overload]
        if op is None:
            return
        if state is OpState.ABSENT:
            self._drop_op(self._requests.get(op.op[0]), op)
        else:
            op.state = state

    def _run(self, dispatcher: Dispatcher[Any], event: object, now: float, out: list[Effect]) -> None:
        """Run ``event``'s row, then what the row named to run after it (``_settle``)."""
        dispatcher.run(event, now, out)
        self._settle(now, out)

    def _settle(self, now: float, out: list[Effect]) -> None:
        """The rows a row names, in order, once its own state is assigned: a request whose op or
        fence ended runs ``InFlightEnded`` (which reports or forgets it when nothing of it is in
        flight any more), and each op a lost server leaves waiting runs ``OpServerLost`` (and
        then its request's ``InFlightEnded``)."""
        while True:
            if self._in_flight_ended:
                self._request_d.run(InFlightEnded(self._in_flight_ended.pop(0)), now, out)
            elif self._ops_lost:
                op_id = self._ops_lost.pop(0)
                if op_id in self._ops:
                    self._op_d.run(OpServerLost(op_id), now, out)
            else:
                return

    def _route_reply(self, event: ReplyReceived | RequestFailed, now: float, out: list[Effect]) -> None:
        """A reply answers the registration in flight, or the op its correlation names."""
        if event.correlation == self._registration_correlation:
            error = event.error if isinstance(event, RequestFailed) else None
            self._run(self._link, RegistrationAnswered(error), now, out)
        else:
            self._run(self._op_d, event, now, out)

    def _route_ended(self, event: Abort | EngineFinished, now: float, out: list[Effect]) -> None:
        for rid in (event.request_id,) if isinstance(event, Abort) else event.request_ids:
            self._run(self._request_d, RequestEnded(rid), now, out)

    def _timer_live(self, timer: Timer) -> bool:
        if isinstance(timer, OpTimeout):
            # By the op's data, not its state: the row that sends a commit arms its timeout
            # before the op is assigned COMMITTING (a compaction then must keep it). An op waits
            # on the server -- SENT or COMMITTING -- exactly while a reply is owed.
            op = self._ops.get(timer.op)
            return op is not None and op.correlation is not None and op.sent_at == timer.sent_at
        assert isinstance(timer, FenceEnd)
        return self._fences.get(timer.request_id) == timer.until

    def _advance(self, now: float, out: list[Effect]) -> None:
        """The timers due, in firing order, each through its table's row and what that row
        names (``_settle``) before the next; a row may arm more, even due ones: they run too."""
        if not self._timers.due(now):
            return
        timer = self._timers.pop_due(now)
        while timer is not None:
            self._run(self._timer_route[type(timer)], timer, now, out)
            timer = self._timers.pop_due(now)

    # ============================================================================= guards
    # Pure: they read the machine and the raw event and name the specific event whose row runs.

    def _classify_ended(self, event: RequestEnded, state: TransferRequestState, now: float) -> RequestEnded:
        """An id already reported in ``sending`` finished again (``RepeatedEnd``: counted, never
        reported twice)."""
        if event.request_id in self._reported_sending:
            return RepeatedEnd(event.request_id)
        return event

    def _classify_in_flight_ended(self, event: InFlightEnded, state: TransferRequestState,
                                  now: float) -> InFlightEnded:
        """Nothing of the request in flight any more (no op, no fence): ``RequestDrained`` once
        the engine finished it (reported in ``sending``), else ``RequestIdle`` (forgotten) or, for
        an id reported before, ``ReportedRequestIdle``. Still in flight: as it came."""
        record = self._requests.get(event.request_id)
        if record is None or record.ops or event.request_id in self._fences:
            return event
        if record.engine_finished:
            return RequestDrained(event.request_id)
        if event.request_id in self._reported_sending:
            return ReportedRequestIdle(event.request_id)
        return RequestIdle(event.request_id)

    def _classify_reply(self, event: ReplyReceived, state: OpState, now: float) -> ReplyReceived:
        """An engine-driven op's plan (SENT, ``TransferPlan(ok=True)``): ``CopyPlanned``, or
        ``CopySkipped`` for a retrieve the engine already finished (nobody reads its blocks).
        Any other reply is the op's answer, as it came."""
        if state is OpState.SENT and self.config.engine_driven and isinstance(event.result, TransferPlan) \
                and event.result.ok:
            op = self._ops[self._by_correlation[event.correlation]]
            fields = (event.server, event.correlation, event.result)
            if self._requests[op.op[0]].engine_finished and op.kind is TransferKind.RETRIEVE:
                return CopySkipped(*fields)
            return CopyPlanned(*fields)
        return event

    def _classify_copy(self, event: CopyFinished, state: OpState, now: float) -> CopyFinished:
        """An engine copy that finished after the server that planned it was lost (unhealthy, or
        lost since the op was submitted): ``CopyOfLostServer``, never committed."""
        if state is OpState.COPYING:
            op = self._ops[event.op]
            if not self._healthy or op.incarnation != self._incarnation:
                return CopyOfLostServer(event.op, event.ok)
        return event

    def _classify_health(self, event: ServerHealth, state: LinkState, now: float) -> ServerHealth:
        """This client's server reported up (``ServerUp``) or down (``ServerDown``)."""
        if state is LinkState.OTHER:
            return event
        return (ServerUp if event.healthy else ServerDown)(event.server, event.healthy)

    # ============================================================================= request rows
    # Handlers change the records' data and append effects; the row's next state is assigned
    # after them. Where the old machine dropped a request whose last op ended, the handler names
    # it (``_in_flight_ended``) and its InFlightEnded row decides.

    def _on_submit(self, ev: SubmitStore | SubmitRetrieve, now: float, out: list[Effect]) -> None:
        """A store or retrieve: its op is filed SENT and its request sent; with the server down,
        it fails at once (its request's InFlightEnded runs after)."""
        c = self.config
        is_store = isinstance(ev, SubmitStore)
        kind = TransferKind.STORE if is_store else TransferKind.RETRIEVE
        self._counters["stores" if is_store else "retrieves"] += 1
        record = self._requests.get(ev.request_id)
        if record is None:
            record = self._requests[ev.request_id] = RequestRecord(ev.request_id)
        if isinstance(ev, SubmitRetrieve):
            record.synchronous = ev.synchronous
        key = CacheKey(c.model_name, c.world_size, c.worker_id, ev.token_ids, ev.start, ev.end,
                       ev.request_id, ev.cache_salt, ev.extras.prefix(ev.end // c.chunk_size))
        skip = 0 if isinstance(ev, SubmitStore) else ev.skip_first_n_tokens
        op = TransferOp(self._op_key(record), kind, key, ev.block_ids, skip, OpState.SENT, None, now,
                        incarnation=self._incarnation)
        if not self._healthy:
            self._complete(record, op, False, now)
            if is_store:
                self._counters["stores_skipped_unhealthy"] += 1
            return
        request: ServerRequest
        if is_store or not c.engine_driven:
            op.not_after = now + c.transfer_window()
        if c.engine_driven:
            request = PrepareStore(key, c.instance_id, not_after=op.not_after) if is_store else PrepareRetrieve(
                key, c.instance_id, skip)
        else:
            request = Store(key, c.instance_id, ev.block_ids, not_after=op.not_after) if is_store else Retrieve(
                key, c.instance_id, ev.block_ids, skip, not_after=op.not_after)
        old = record.ops.get(op.op)
        if old is not None:  # only a legacy _op_key can collide: the old op is lost (F15)
            self._drop_op(record, old)
        record.ops[op.op] = op
        self._ops[op.op] = op
        op.correlation = self._send(request, op.op, out)
        self._arm_op_timeout(op)

    def _on_request_ended(self, ev: RequestEnded, now: float, out: list[Effect]) -> None:
        """The engine finished (or aborted) the request: it is reported in ``sending`` once
        nothing of it is in flight (its InFlightEnded row, after this one makes it FINISHING)."""
        rid = ev.request_id
        if rid not in self._requests:
            self._requests[rid] = RequestRecord(rid)
        if not self._report_recving_after_finish(self._requests[rid]):
            self._recving.pop(rid, None)  # not reported yet: the request is gone from vLLM
            self._failed_retrieves.pop(rid, None)
        self._in_flight_ended.append(rid)

    def _on_repeated_end(self, ev: RepeatedEnd, now: float, out: list[Effect]) -> None:
        self._counters["duplicate_finishes"] += 1

    def _on_fence_end(self, ev: FenceEnd, now: float, out: list[Effect]) -> None:
        """The late-copy fence is over: a recving it held is reported (its request's
        InFlightEnded runs after)."""
        rid = ev.request_id
        del self._fences[rid]
        record = self._requests[rid]
        if record.recving_fenced:
            record.recving_fenced = False
            if not any(o.kind is TransferKind.RETRIEVE for o in record.ops.values()):
                self._report_recving(record)
        self._in_flight_ended.append(rid)

    def _on_still_in_flight(self, ev: InFlightEnded, now: float, out: list[Effect]) -> None:
        """Other ops, or the fence, of the request are still in flight."""

    def _on_request_drained(self, ev: RequestDrained, now: float, out: list[Effect]) -> None:
        """The engine finished the request and nothing of it is in flight: reported in
        ``sending`` (vLLM frees its blocks); its row forgets it, remembering the id."""
        self._sending[ev.request_id] = None

    def _on_request_idle(self, ev: RequestIdle | ReportedRequestIdle, now: float, out: list[Effect]) -> None:
        """Nothing of a request the engine still runs is in flight: its row forgets the record."""

    # ============================================================================= op rows

    def _on_stale_reply(self, ev: ReplyReceived | RequestFailed, now: float, out: list[Effect]) -> None:
        self._counters["stale_replies"] += 1

    def _on_reply(self, ev: ReplyReceived, now: float, out: list[Effect]) -> None:
        """The op's answer: a server-driven op's or a commit's result, or an engine-driven op's
        plan that brings nothing to copy (not ok, or not a plan). The op is done."""
        op = self._ops[self._by_correlation[ev.correlation]]
        record = self._requests[op.op[0]]
        if op.state is OpState.SENT and self.config.engine_driven:
            if not isinstance(ev.result, TransferPlan):
                self._counters["bad_replies"] += 1
            self._complete(record, op, False, now)
            return
        expected = StoreResult if op.kind is TransferKind.STORE else RetrieveResult
        if not isinstance(ev.result, expected):
            self._counters["bad_replies"] += 1
            self._complete(record, op, False, now)
        else:
            self._complete(record, op, bool(ev.result.ok) and op.copy_ok, now)

    def _on_copy_planned(self, ev: CopyPlanned, now: float, out: list[Effect]) -> None:
        """An engine-driven op's plan: the worker copies (``CopyBlocks``)."""
        op = self._ops[self._by_correlation.pop(ev.correlation)]
        plan = ev.result
        assert isinstance(plan, TransferPlan)
        op.correlation = None
        op.transfer_id = plan.transfer_id
        out.append(CopyBlocks(op.op, op.kind, op.transfer_id, op.key.start, op.key.end, plan.placements,
                              op.block_ids, op.skip_first_n_tokens))

    def _on_copy_skipped(self, ev: CopySkipped, now: float, out: list[Effect]) -> None:
        """A retrieve's plan after the engine finished the request: nobody will read the loaded
        blocks any more, so no copy; the plan is released now (committed not ok). A STORE's plan
        still copies (``CopyPlanned``): the engine holds a finished (or aborted) request's blocks
        until it is reported in ``sending``, which waits for this op's commit. (Its OpTimeout
        still counts from the PrepareRetrieve.)"""
        op = self._ops[self._by_correlation.pop(ev.correlation)]
        plan = ev.result
        assert isinstance(plan, TransferPlan)
        op.transfer_id = plan.transfer_id
        self._counters["retrieves_skipped_finished"] += 1
        op.copy_ok = False
        op.correlation = self._send(CommitTransfer(op.transfer_id, False), op.op, out)

    def _on_failure(self, ev: RequestFailed, now: float, out: list[Effect]) -> None:
        """The op's request (or its commit) was refused or lost: the op fails."""
        op = self._ops[self._by_correlation[ev.correlation]]
        record = self._requests[op.op[0]]
        kind = getattr(ev.error, "kind", None)
        if kind is ErrorKind.NOT_REGISTERED:
            self._on_not_registered(op, now, out)
        elif kind in (ErrorKind.UNHEALTHY, ErrorKind.TIMEOUT):
            # UNHEALTHY: the transport lost it, it may still arrive. TIMEOUT: the transport's
            # own request timeout (it may still be copying, a resend too) looks like the
            # server's refusal of a late request (no copy, and its not_after has passed):
            # fenced alike, which costs that refusal at most copy_grace. NOT_SENT (the transport
            # would not take the frame) is not fenced: the server never saw it, no copy can run
            self._fence_abandoned(record, op)
        self._complete(record, op, False, now)

    def _on_stale_copy(self, ev: CopyFinished, now: float, out: list[Effect]) -> None:
        self._counters["stale_copies"] += 1

    def _on_copy_finished(self, ev: CopyFinished, now: float, out: list[Effect]) -> None:
        """The engine copy is done: the transfer is committed (its result, ok or not)."""
        op = self._ops[ev.op]
        op.copy_ok = bool(ev.ok)
        op.sent_at = now
        op.correlation = self._send(CommitTransfer(op.transfer_id, op.copy_ok), op.op, out)
        self._arm_op_timeout(op)

    def _on_copy_of_lost_server(self, ev: CopyOfLostServer, now: float, out: list[Effect]) -> None:
        """The server that planned this transfer is gone (or may be): its transfer id could name
        another client's transfer on a restarted server, so it is never committed; the op fails."""
        op = self._ops[ev.op]
        op.copy_ok = bool(ev.ok)
        self._complete(self._requests[op.op[0]], op, False, now)

    def _on_op_timeout(self, ev: OpTimeout, now: float, out: list[Effect]) -> None:
        self._counters["timeouts"] += 1
        self._give_up(self._ops[ev.op], now)

    def _on_server_lost(self, ev: OpServerLost, now: float, out: list[Effect]) -> None:
        self._give_up(self._ops[ev.op], now)

    def _on_copy_outlives_server(self, ev: OpServerLost, now: float, out: list[Effect]) -> None:
        """The engine copy runs on: it fails without a commit when it finishes."""

    # ============================================================================= link rows

    def registration_request(self) -> RegisterInstance:
        c = self.config
        return RegisterInstance(c.instance_id, c.model_name, c.world_size, c.object_bytes, c.engine_driven)

    def link_state(self) -> LinkState:
        return self._link_state(self.config.server)

    def _link_address(self, event: object) -> object:
        return getattr(event, "server", self.config.server)

    def _link_state(self, server: object) -> LinkState:
        if server != self.config.server:
            return LinkState.OTHER
        return LinkState.UP if self._healthy else LinkState.DOWN

    def _on_other_server(self, ev: ServerHealth | ServerEpoch, now: float, out: list[Effect]) -> None:
        """Another server's health or epoch: not this client's."""

    def _on_server_up(self, ev: ServerUp, now: float, out: list[Effect]) -> None:
        """Up (again): new ops go to it. The first time, the instance introduces itself."""
        if not self._introduced:
            self._introduced = True
            self._counters["registrations"] += 1
            self._registration_correlation = self._send(self.registration_request(), None, out)

    def _on_server_down(self, ev: ServerDown, now: float, out: list[Effect]) -> None:
        self._lose_server()

    def _on_still_down(self, ev: ServerDown, now: float, out: list[Effect]) -> None:
        """Down already: what waited on the server failed then."""

    def _on_epoch(self, ev: ServerEpoch, now: float, out: list[Effect]) -> None:
        """A new epoch is a restart: what waited on the old server fails (its link registers
        again). The first epoch is only remembered."""
        old, self._epoch = self._epoch, ev.epoch
        if old is None or old == ev.epoch:
            return
        self._counters["server_restarts"] += 1
        if self._healthy:
            self._lose_server()

    def _on_registration_answer(self, ev: RegistrationAnswered, now: float, out: list[Effect]) -> None:
        self._registration_correlation = None
        if ev.error is not None:
            self._counters["registration_failures"] += 1

    def _on_not_registered(self, op: TransferOp, now: float, out: list[Effect]) -> None:
        """``op`` was answered NOT_REGISTERED: its link's verdict, after it registered again and
        resent it once (or gave up); the op fails, and registering again stays the link's (a
        legacy client that also registers here is the second registerer of double-register)."""
        self._counters["not_registered"] += 1

    def _lose_server(self) -> None:
        """The server is unhealthy (or restarted): the ops waiting on it fail (their
        OpServerLost rows run after this row); ops whose engine copy runs fail when it finishes."""
        self._incarnation += 1
        self._ops_lost.extend(self._ops)

    # ============================================================================= internals

    def _give_up(self, op: TransferOp, now: float) -> None:
        """``op`` waited on the server in vain: it fails (fenced if a copy may still run)."""
        record = self._requests[op.op[0]]
        self._fence_abandoned(record, op)
        self._complete(record, op, False, now)

    def _arm_op_timeout(self, op: TransferOp) -> None:
        if self.config.op_timeout is not None:
            self._timers.push(op.sent_at + self.config.op_timeout, OpTimeout(op.op, op.sent_at))

    def _fence_abandoned(self, record: RequestRecord, op: TransferOp) -> None:
        """``op`` is given up on without an answer: if it is a server-driven STORE/RETRIEVE
        still in flight, its request's blocks stay with it until the server can no longer copy."""
        if op.state is not OpState.SENT or self.config.engine_driven or op.not_after is None:
            return
        until = op.not_after + self.config.copy_grace
        self._counters["store_fences"] += 1
        old = self._fences.get(record.request_id)
        if old is None or until > old:
            self._fences[record.request_id] = until
            self._timers.push(until, FenceEnd(record.request_id, until))

    def _complete(self, record: RequestRecord, op: TransferOp, ok: bool, now: float) -> None:
        """Op done (its row makes it ABSENT; an op failed at submit was never filed): report a
        retrieve's outcome, and name the request for its InFlightEnded row."""
        self._in_flight_ended.append(record.request_id)
        if op.kind is TransferKind.STORE:
            if not ok:
                self._counters["stores_failed"] += 1
            return
        if not ok:
            self._counters["retrieves_failed"] += 1
        if record.engine_finished and not self._report_recving_after_finish(record):
            return  # the blocks go back to vLLM through `sending`; no errors, no recving
        if not ok:
            record.retrieve_failed = True
            fenced = record.request_id in self._fences  # reported with recving, after the fence
            for b in self._errors_for_failed_retrieve(op):
                if fenced:
                    record.fenced_load_errors.append(b)
                else:
                    self._load_errors[b] = None
        if not any(o.kind is TransferKind.RETRIEVE and o is not op for o in record.ops.values()):
            if record.request_id in self._fences:
                record.recving_fenced = True  # a late copy may still write its blocks
            else:
                self._report_recving(record)

    def _report_recving(self, record: RequestRecord) -> None:
        fenced_errors, record.fenced_load_errors = record.fenced_load_errors, []
        if record.engine_finished and not self._report_recving_after_finish(record):
            return
        for b in fenced_errors:
            self._load_errors[b] = None
        if not record.synchronous:  # vLLM waited for a synchronous load in its step, not here
            self._recving[record.request_id] = None
        if record.retrieve_failed:
            record.retrieve_failed = False
            self._failed_retrieves.pop(record.request_id, None)
            self._failed_retrieves[record.request_id] = None
            while len(self._failed_retrieves) > self.config.reported_cap:
                del self._failed_retrieves[next(iter(self._failed_retrieves))]

    def _drop_op(self, record: RequestRecord | None, op: TransferOp) -> None:
        if op.correlation is not None:
            self._by_correlation.pop(op.correlation, None)
            op.correlation = None
        if record is not None and record.ops.get(op.op) is op:
            del record.ops[op.op]
        if self._ops.get(op.op) is op:
            del self._ops[op.op]
        op.state = OpState.ABSENT

    def _send(self, request: ServerRequest, op: OpId | None, out: list[Effect]) -> int:
        self._next_correlation += 1
        corr = self._next_correlation
        if op is not None:
            self._by_correlation[corr] = op
        out.append(SendRequest(self.config.server, corr, request))
        return corr


def _request_id(event: object) -> str:
    return str(getattr(event, "request_id"))


_UP_OR_DOWN = (LinkState.DOWN, LinkState.UP)
_IN_FLIGHT = (TransferRequestState.ACTIVE, TransferRequestState.FINISHING)
_WAITING = (OpState.SENT, OpState.COMMITTING)

# Each table: (the entity's state, event) -> (handler, the one next state), which the dispatcher
# assigns after the handler (_set_link_state, _set_request_state, _set_op_state).

# Its server, as its link reports it.
LINK_TABLE: Table[LinkState] = Table("TransferClient (its server, as its link reports it)", LinkState,
                                     LinkState.OTHER, {
    (LinkState.OTHER, ServerHealth): (TransferClient._on_other_server, LinkState.OTHER),
    (LinkState.OTHER, ServerEpoch): (TransferClient._on_other_server, LinkState.OTHER),
    **{(state, ServerUp): (TransferClient._on_server_up, LinkState.UP) for state in _UP_OR_DOWN},
    (LinkState.UP, ServerDown): (TransferClient._on_server_down, LinkState.DOWN),
    (LinkState.DOWN, ServerDown): (TransferClient._on_still_down, LinkState.DOWN),
    # A new epoch is a restart: what waited on the server fails; its health is the monitor's.
    **{(state, ServerEpoch): (TransferClient._on_epoch, state) for state in _UP_OR_DOWN},
    **{(state, RegistrationAnswered): (TransferClient._on_registration_answer, state) for state in _UP_OR_DOWN},
}, assigns=True, guards={ServerHealth: TransferClient._classify_health})

# One request id. A row that ends an op or the fence of a request is followed by the request's
# InFlightEnded row, which reports (FINISHING) or forgets (ACTIVE) it once nothing is in flight.
REQUEST_TABLE: Table[TransferRequestState] = Table("TransferClient (one request id)", TransferRequestState,
                                                   TransferRequestState.ABSENT, {
    **{(state, submit): (TransferClient._on_submit, after)
       for state, after in ((TransferRequestState.ABSENT, TransferRequestState.ACTIVE),
                            (TransferRequestState.ACTIVE, TransferRequestState.ACTIVE),
                            (TransferRequestState.FINISHING, TransferRequestState.FINISHING),
                            (TransferRequestState.REPORTED, TransferRequestState.ACTIVE))
       for submit in (SubmitStore, SubmitRetrieve)},
    **{(state, RequestEnded): (TransferClient._on_request_ended, TransferRequestState.FINISHING)
       for state in (TransferRequestState.ABSENT, *_IN_FLIGHT)},
    # A repeat finish of an id already reported (it may have ops again: ACTIVE).
    (TransferRequestState.ACTIVE, RepeatedEnd): (TransferClient._on_repeated_end, TransferRequestState.ACTIVE),
    (TransferRequestState.REPORTED, RepeatedEnd): (TransferClient._on_repeated_end, TransferRequestState.REPORTED),
    **{(state, FenceEnd): (TransferClient._on_fence_end, state) for state in _IN_FLIGHT},
    **{(state, InFlightEnded): (TransferClient._on_still_in_flight, state) for state in _IN_FLIGHT},
    (TransferRequestState.ACTIVE, RequestIdle): (TransferClient._on_request_idle, TransferRequestState.ABSENT),
    (TransferRequestState.ACTIVE, ReportedRequestIdle): (TransferClient._on_request_idle,
                                                         TransferRequestState.REPORTED),
    (TransferRequestState.FINISHING, RequestDrained): (TransferClient._on_request_drained,
                                                       TransferRequestState.REPORTED),
}, assigns=True, guards={RequestEnded: TransferClient._classify_ended,
                         InFlightEnded: TransferClient._classify_in_flight_ended})

# One op. A reply addresses the op of its correlation (ABSENT: no op expects it).
OP_TABLE: Table[OpState] = Table("TransferClient (one op)", OpState, OpState.ABSENT, {
    (OpState.ABSENT, ReplyReceived): (TransferClient._on_stale_reply, OpState.ABSENT),
    (OpState.ABSENT, RequestFailed): (TransferClient._on_stale_reply, OpState.ABSENT),
    **{(state, ReplyReceived): (TransferClient._on_reply, OpState.ABSENT) for state in _WAITING},
    (OpState.SENT, CopyPlanned): (TransferClient._on_copy_planned, OpState.COPYING),
    (OpState.SENT, CopySkipped): (TransferClient._on_copy_skipped, OpState.COMMITTING),
    **{(state, RequestFailed): (TransferClient._on_failure, OpState.ABSENT) for state in _WAITING},
    **{(state, CopyFinished): (TransferClient._on_stale_copy, state) for state in (OpState.ABSENT, *_WAITING)},
    (OpState.COPYING, CopyFinished): (TransferClient._on_copy_finished, OpState.COMMITTING),
    (OpState.COPYING, CopyOfLostServer): (TransferClient._on_copy_of_lost_server, OpState.ABSENT),
    **{(state, OpTimeout): (TransferClient._on_op_timeout, OpState.ABSENT) for state in _WAITING},
    **{(state, OpServerLost): (TransferClient._on_server_lost, OpState.ABSENT) for state in _WAITING},
    (OpState.COPYING, OpServerLost): (TransferClient._on_copy_outlives_server, OpState.COPYING),
}, assigns=True, guards={ReplyReceived: TransferClient._classify_reply, CopyFinished: TransferClient._classify_copy})
TABLES: dict[str, Table[Any]] = {t.name: t for t in (LINK_TABLE, REQUEST_TABLE, OP_TABLE)}
