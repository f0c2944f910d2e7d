"""``LookupClient``: the scheduler side of lookups, over N servers, as one pure machine.

Per request id (vLLM calls in brackets)::

    SubmitLookup [maybe_submit_lookup_request]
        -> LOOKUP to every server; the request is AWAITING_ACK
    ack from server s -> one QUERY_PREFETCH_STATUS (or WAIT_PREFETCH_STATUS) to s, kept until
        answered, never resent; None -> another query after poll_interval
    (config.answer_in_ack) an ack carrying s's hit count n_s -> s has answered, no status query
        (one round trip); a nil ack -> the status query as above (an L2 step left, or an older
        server that ignores the request)
    every server answered n_s -> result = min(n_s) chunks; servers that reported more get a
        FREE_LOOKUP_LOCKS for their tail [min, n_s); the request is DONE and its result cached
    check(request_id) [check_lookup_result] -> None while pending, tokens when DONE, 0 unknown
    Cleanup [cleanup_lookup_result] -> forget it (a pending lookup also frees its leases)
    FreeUnusedLeases / EndRequest -> fire-and-forget FREE_LOOKUP_LOCKS / END_SESSION

A failed request, an unhealthy server, a restarted server (``ServerEpoch`` with a new epoch: its
jobs and leases are gone), or ``lookup_timeout`` resolves the lookup to 0 at once (no caller
ever polls forever). A reply whose correlation the client no longer expects (a
duplicate, a reply after a timeout) is ignored and counted in ``stats()["stale_replies"]``.
``check()`` is a pure read and never blocks; all sends happen in ``handle``.

Dispatch (``mpcache.core_sm.table``): ``handle`` runs the typed timers now due, then the event, each
through one of two tables it executes -- ``LOOKUP_TABLE`` (one request id's lookup: the vLLM
calls, the replies by their correlation, its timers ``LookupDeadline`` / ``Requery`` /
``StatusResend`` / ``ResultExpiry``, and ``LegLost`` when a server fails under it) and
``SERVER_VIEW_TABLE`` (one server: ``ServerHealth`` / ``ServerEpoch``). ``TimerFired`` only
makes the due timers run. Any other event type is counted in ``stale_replies``.

Both tables *assign*: each row names one next state, which the dispatcher gives the lookup
(``_set_state``: a pending lookup waits in ``_active``, a finished one is cached in ``_done``, an
absent one is forgotten) or the server (``_set_view``: its health) after the handler, and the
handlers only change the records' data and append effects. Where the next state depends on more
than the event's type, a guard tells the raw event apart first: ``_classify_submit`` (a submit
resolved at once: ``InvalidSubmit``, ``UnservedSubmit``), ``_classify_reply`` (``LookupAck`` /
``LastLookupAck``, ``StatusPending``, ``HitCount`` / ``HitCountLastAck`` / ``FinalHitCount``),
``_classify_requery`` (a re-query due once the lookup's deadline has passed is that deadline:
``LookupDeadline``) and ``_classify_health`` (``ServerHealthy`` / ``ServerUnhealthy``). A
server's failure (unhealthy, or a new epoch) names the lookups waiting on it, and their
``LegLost`` rows run once the server's own row is done (so its health is assigned first).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import attrs

from mpcache.core_sm.chunks import TokenIds, pack_tokens, validate_cache_salt
from mpcache.core_sm.effects import Effect, SendRequest
from mpcache.core_sm.errors import ProtocolError
from mpcache.core_sm.guarded import GuardedMachine
from mpcache.core_sm.messages import (
    CacheKey,
    Cleanup,
    ClientEvent,
    EndRequest,
    EndSession,
    FreeLookupLocks,
    FreeUnusedLeases,
    Lookup,
    QueryPrefetchStatus,
    ReplyReceived,
    RequestFailed,
    ServerEpoch,
    ServerHealth,
    ServerRequest,
    SubmitLookup,
    TimerFired,
    WaitPrefetchStatus,
)
from mpcache.core_sm.lookup_ops import (
    EVENTS,
    FinalHitCount,
    HitCount,
    HitCountLastAck,
    InvalidSubmit,
    LastLookupAck,
    LegLost,
    LookupAck,
    LookupClientConfig,
    LookupDeadline,
    LookupState,
    PendingLookup,
    Requery,
    ResultExpiry,
    ServerHealthy,
    ServerLeg,
    ServerUnhealthy,
    ServerView,
    StatusPending,
    StatusResend,
    UnservedSubmit,
)
from mpcache.core_sm.table import Dispatcher, Table, run_due_timers
from mpcache.core_sm.timers import Timer, TimerHeap

__all__ = ["EVENTS", "LOOKUP_TABLE", "SERVER_VIEW_TABLE", "TABLES", "FinalHitCount", "HitCount", "HitCountLastAck",
           "InvalidSubmit", "LastLookupAck", "LegLost", "LookupAck", "LookupClient", "LookupClientConfig",
           "LookupDeadline", "LookupState", "PendingLookup", "Requery", "ResultExpiry", "ServerHealthy", "ServerLeg",
           "ServerUnhealthy", "ServerView", "StatusPending", "StatusResend", "UnservedSubmit"]


class LookupClient(GuardedMachine[ClientEvent]):
    """Scheduler-side lookup bookkeeping. ``handle(event, now)``, ``next_deadline()``,
    ``check(request_id)``."""

    def __init__(self, config: LookupClientConfig | None = None) -> None:
        self.config = config if config is not None else LookupClientConfig()
        self._active: dict[str, PendingLookup] = {}  # AWAITING_ACK / QUERYING
        self._done: OrderedDict[str, PendingLookup] = OrderedDict()  # DONE, expiry order
        self._correlations: dict[int, tuple[str, int]] = {}  # correlation -> (request, server)
        self._fire_and_forget: OrderedDict[int, None] = OrderedDict()
        self._healthy = [True] * self.config.num_servers
        self._epochs: list[int | str | None] = [None] * self.config.num_servers
        self._next_correlation = 0
        self._next_serial = 0
        self._counters = {
            name: 0
            for name in ("submits", "duplicate_submits", "invalid_submits", "lookups_sent",
                         "status_queries_sent", "status_resends", "stale_replies", "timeouts",
                         "failures", "resolved", "resolved_zero", "frees_sent", "end_sessions_sent",
                         "fire_and_forget_replies", "expired_results", "bad_replies",
                         "internal_errors", "server_restarts", "answered_in_ack")
        }
        self._timers = TimerHeap(self._timer_live)
        # The lookups a server's failure ends: its row names them, they run after it (_dispatch).
        self._legs_lost: list[LegLost] = []
        self._lookups: Dispatcher[LookupState] = LOOKUP_TABLE.bind(
            self, self._address, self.state, self._counters, self._refuse, self._set_state)
        self._servers: Dispatcher[ServerView] = SERVER_VIEW_TABLE.bind(
            self, _server_of, self._view, self._counters, self._refuse, self._set_view)
        # What the runtime feeds goes to the table that names it or guards it (timers and
        # LegLost are internal).
        self._routes: dict[type, Dispatcher[Any]] = {
            **{t: self._lookups for t in (*LOOKUP_TABLE.events(), *LOOKUP_TABLE.guards) if t in EVENTS},
            **{t: self._servers for t in (*SERVER_VIEW_TABLE.events(), *SERVER_VIEW_TABLE.guards) if t in EVENTS}}

    # ============================================================================= public API

    def _dispatch(self, event: ClientEvent, now: float, out: list[Effect]) -> None:
        route = self._routes.get(type(event))
        if route is not None:
            route.run(event, now, out)
            if self._legs_lost:
                self._run_legs_lost(now, out)
        elif type(event) is not TimerFired:  # TimerFired: the due timers ran in _advance
            self._counters["stale_replies"] += 1

    def check(self, request_id: str) -> int | None:
        """Tokens hit (a multiple of chunk_size) when DONE, None while pending, 0 if unknown.
        A pure read unless ``_keep_result_after_check`` says no (legacy profiles only)."""
        done = self._done.get(request_id)
        if done is not None:
            result = done.result_tokens
            assert result is not None
            if not self._keep_result_after_check(done):
                self._query_again(done)
            return result
        if request_id in self._active:
            return None
        return 0

    def state(self, request_id: object) -> LookupState:
        rid = str(request_id)
        pending = self._active.get(rid) or self._done.get(rid)
        return LookupState.ABSENT if pending is None else pending.state

    def pending(self, request_id: str) -> PendingLookup | None:
        return self._active.get(request_id) or self._done.get(request_id)

    def is_healthy(self, server: int) -> bool:
        return self._healthy[server]

    def next_deadline(self) -> float | None:
        return self._timers.next_deadline()

    # What ``state_values`` carries, and what it leaves out: the wiring ``__init__`` makes once
    # (configuration, the bound tables and routes). Every attribute is one or the other
    # (tests/core_sm/test_state_values.py holds them to it).
    STATE_FIELDS = ("_active", "_done", "_correlations", "_fire_and_forget", "_healthy", "_epochs",
                    "_next_correlation", "_next_serial", "_counters", "_timers", "_legs_lost")
    WIRING_FIELDS = ("config", "_lookups", "_servers", "_routes")

    def state_values(self) -> tuple[Any, ...]:
        """The machine's changing state as immutable values (tuples, ints, strings, enums and
        the frozen keys and timers it holds), its wiring left out: ``restore`` on any client of
        the same configuration makes it this one. A model checker keeps a state this way and
        restores one machine in place instead of copying it."""
        return (tuple([(rid, _lookup_values(p)) for rid, p in self._active.items()]),
                tuple([(rid, _lookup_values(p)) for rid, p in self._done.items()]),
                tuple(self._correlations.items()), tuple(self._fire_and_forget), tuple(self._healthy),
                tuple(self._epochs), self._next_correlation, self._next_serial, tuple(self._counters.values()),
                self._timers.state_values(), tuple(self._legs_lost))

    def restore(self, values: tuple[Any, ...]) -> None:
        """Become, in place, the client whose ``state_values()`` gave ``values`` (the wiring
        stays: the tables stay bound to this machine, the counters dict they share is updated)."""
        (active, done, correlations, fire_and_forget, healthy, epochs, self._next_correlation, self._next_serial,
         counters, timers, legs_lost) = values
        self._active = {rid: _lookup_of(v) for rid, v in active}
        self._done = OrderedDict([(rid, _lookup_of(v)) for rid, v in done])
        self._correlations = dict(correlations)
        self._fire_and_forget = OrderedDict.fromkeys(fire_and_forget)
        self._healthy = list(healthy)
        self._epochs = list(epochs)
        own = self._counters
        own.update(zip(tuple(own), counters))
        self._timers.restore(timers)
        self._legs_lost = list(legs_lost)

    def stats(self) -> dict[str, int]:
        out = dict(self._counters)
        out["active"] = len(self._active)
        out["results_cached"] = len(self._done)
        out["correlations"] = len(self._correlations)
        out["fire_and_forget_pending"] = len(self._fire_and_forget)
        out["healthy_servers"] = sum(self._healthy)
        out["timers"] = len(self._timers)
        return out

    def check_invariants(self) -> None:
        for corr, (rid, server) in self._correlations.items():
            p = self._active.get(rid)
            assert p is not None, "a correlation for a request that is not active"
            leg = p.legs[server]
            assert corr in (leg.lookup_correlation, leg.query_correlation), "orphan correlation"
        live = {t for t in self._timers.timers() if self._timer_live(t)}
        for rid, p in self._active.items():
            assert p.result_tokens is None and rid not in self._done
            assert p.state is p.state_by_legs(), "a pending lookup's legs disagree with the state its row assigned"
            assert LookupDeadline(rid, p.serial) in live, "a pending lookup without its deadline"
            for leg in p.legs.values():
                if leg.chunks is not None:
                    assert leg.query_correlation is None and leg.next_query_at is None
                if leg.query_correlation is not None:
                    assert leg.next_query_at is None, "two queries for one leg"
                if leg.next_query_at is not None:
                    assert Requery(rid, p.serial, leg.server) in live, "a re-query without its timer"
        for rid, p in self._done.items():
            assert p.result_tokens is not None and p.result_tokens >= 0 and p.state is LookupState.DONE
            assert p.result_tokens % self.config.chunk_size == 0
            assert ResultExpiry(rid, p.serial) in live, "a cached result without its expiry"
        assert len(self._fire_and_forget) <= self.config.fire_and_forget_cap
        assert not self._legs_lost, "a server's failure left lookups it did not end"

    # ============================================================================= hooks

    def _wait_for_ack(self, pending: PendingLookup, server: int) -> bool:
        """Send the status query only after the LOOKUP ack (legacy: False, so the query can
        overtake the lookup on a multi-worker server: F5)."""
        return True

    def _should_resend_status(self, pending: PendingLookup, leg: ServerLeg, now: float) -> bool:
        """Abandon an unanswered status query and send a new one (legacy: True after
        poll_interval, so the abandoned answer consumes the job: F2)."""
        return False

    def _end_pending_lookup(self, pending: PendingLookup, now: float, out: list[Effect]) -> None:
        """``EndRequest`` for a request whose lookup is still pending (an abort): its state is
        already dropped; release what the servers may hold for it -- END_SESSION to every healthy
        server (legacy: nothing, so its leases and jobs leak: F8)."""
        self._send_end_session(pending.request_id, out)

    def _keep_result_after_check(self, pending: PendingLookup) -> bool:
        """Whether a result ``check()`` delivered stays cached until Cleanup / ``result_ttl``
        (legacy: False, so the next ``handle`` asks every server again, as an adapter without a
        result cache did: with a server that pops the job on its answer and answers None for an
        unknown id, that polls forever: F1)."""
        return True

    def _may_resend(self) -> bool:
        """Whether ``_should_resend_status`` can ever say yes (only then is a StatusResend armed)."""
        return type(self)._should_resend_status is not LookupClient._should_resend_status

    # ============================================================================= table plumbing

    def _address(self, event: object) -> str | None:
        """The request id an event of LOOKUP_TABLE addresses: a reply's is its correlation's
        (None, so ABSENT, for one the client no longer expects)."""
        corr = getattr(event, "correlation", None)
        if corr is not None and not isinstance(event, Timer):
            owner = self._correlations.get(corr)
            return None if owner is None else owner[0]
        return str(getattr(event, "request_id"))

    def _view(self, server: object) -> ServerView:
        if not isinstance(server, int) or not 0 <= server < self.config.num_servers:
            return ServerView.UNKNOWN
        return ServerView.HEALTHY if self._healthy[server] else ServerView.UNHEALTHY

    def _set_state(self, request_id: Hashable, state: LookupState) -> None:
        """LOOKUP_TABLE's assignment: the lookup of ``request_id`` is now in ``state`` -- a
        pending one waits in ``_active``, a finished one is cached in ``_done`` (in the order
        it finished), an absent one is forgotten."""
        if state is LookupState.ABSENT:
            if isinstance(request_id, str):  # a stray reply addresses None
                self._active.pop(request_id, None)
                self._done.pop(request_id, None)
            return
        rid = str(request_id)
        home, other = (self._done, self._active) if state is LookupState.DONE else (self._active, self._done)
        pending = home.get(rid)
        if pending is None:
            pending = home[rid] = other.pop(rid)
        pending.state = state

    def _set_view(self, server: Hashable, view: ServerView) -> None:
        """SERVER_VIEW_TABLE's assignment: one of the client's servers is now healthy or not."""
        if view is not ServerView.UNKNOWN and isinstance(server, int):
            self._healthy[server] = view is ServerView.HEALTHY

    def _refuse(self, out: list[Effect], reply_to: object, error: ProtocolError) -> None:
        raise AssertionError("client events carry no reply_to")  # pragma: no cover

    def _timer_live(self, timer: Timer) -> bool:
        rid = getattr(timer, "request_id")
        pending = self._active.get(rid) or self._done.get(rid)
        if pending is None or pending.serial != getattr(timer, "serial"):
            return False
        # By the record's data, not where it is filed: a handler arms timers before its row's
        # next state is assigned (a heap compaction then must not drop the one just armed).
        if isinstance(timer, ResultExpiry):
            return pending.result_tokens is not None
        if pending.result_tokens is not None:
            return False
        if isinstance(timer, Requery):
            return pending.legs[timer.server].next_query_at is not None
        if isinstance(timer, StatusResend):
            return pending.legs[timer.server].query_correlation == timer.correlation
        return True

    def _advance(self, now: float, out: list[Effect]) -> None:
        run_due_timers(self._timers, lambda _timer: self._lookups, now, out)

    def _run_legs_lost(self, now: float, out: list[Effect]) -> None:
        """The lookups a server's row named run their ``LegLost`` rows, in order (one still
        waiting on that server: a lookup that ended meanwhile is skipped)."""
        lost, self._legs_lost = self._legs_lost, []
        for event in lost:
            pending = self._active.get(event.request_id)
            if pending is not None and pending.legs[event.server].chunks is None:
                self._lookups.run(event, now, out)

    # ============================================================================= guards
    # Pure: they read the machine and the raw event, and name the specific event whose row runs.

    def _classify_submit(self, event: SubmitLookup, state: LookupState, now: float) -> SubmitLookup:
        """A first submit that resolves to 0 at once (``InvalidSubmit``: a bad cache salt or
        token ids; ``UnservedSubmit``: under one chunk, or a server it must ask unhealthy); a
        duplicate or a submit that asks the servers stays a ``SubmitLookup``."""
        if state is not LookupState.ABSENT:
            return event
        end = self._lookup_end(event)
        fields = (event.request_id, event.token_ids, event.cache_salt, event.extras)
        if validate_cache_salt(event.cache_salt) is not None or not _uint32_tokens(event.token_ids, end):
            return InvalidSubmit(*fields)
        if end == 0 or not all(self._healthy[server] for server in self._servers_holding_ranks()):
            return UnservedSubmit(*fields)
        return event

    def _classify_reply(self, event: ReplyReceived, state: LookupState, now: float) -> ReplyReceived:
        """A reply to a pending lookup, by what it is (the LOOKUP's ack, a status reply, a hit
        count) and what it leaves the lookup waiting for (see ``lookup_ops``); a stray reply
        (ABSENT) stays a ``ReplyReceived``."""
        if state is LookupState.ABSENT:
            return event
        request_id, server = self._correlations[event.correlation]
        pending = self._active[request_id]
        leg = pending.legs[server]
        fields = (event.server, event.correlation, event.result)
        is_ack = event.correlation == leg.lookup_correlation
        others = [other for other in pending.legs.values() if other is not leg]
        others_acked = all(other.acked or other.chunks is not None for other in others)
        if is_ack and not (event.result is not None and self.config.answer_in_ack):
            return (LastLookupAck if others_acked else LookupAck)(*fields)
        if not is_ack and event.result is None:
            return StatusPending(*fields)
        if not _hit_count(event.result) or all(other.chunks is not None for other in others):
            return FinalHitCount(*fields)
        if state is LookupState.AWAITING_ACK and others_acked:
            return HitCountLastAck(*fields)
        return HitCount(*fields)

    def _classify_requery(self, event: Requery, state: LookupState, now: float) -> Requery | LookupDeadline:
        """A re-query due when the lookup's deadline has passed too is that deadline (both due:
        the lookup's time is up, ask nothing more)."""
        pending = self._active.get(event.request_id)
        if pending is not None and pending.deadline <= now:
            return LookupDeadline(event.request_id, event.serial)
        return event

    def _classify_health(self, event: ServerHealth, state: ServerView, now: float) -> ServerHealth:
        """``ServerHealthy`` / ``ServerUnhealthy`` for one of the client's servers."""
        if state is ServerView.UNKNOWN:
            return event
        return (ServerHealthy if event.healthy else ServerUnhealthy)(event.server, event.healthy)

    # ============================================================================= lookup rows

    def _on_submit(self, event: SubmitLookup, now: float, out: list[Effect]) -> None:
        """A first submit: a LOOKUP to every server holding a rank."""
        self._counters["submits"] += 1
        pending = self._new_lookup(event, now)
        self._activate(pending)
        for server in self._servers_holding_ranks():
            leg = ServerLeg(server)
            pending.legs[server] = leg
            self._counters["lookups_sent"] += 1
            leg.lookup_correlation = self._send(
                server, Lookup(pending.key, self.config.num_readers, self._ranks_of(server),
                               answer_in_ack=self.config.answer_in_ack),
                out, owner=(pending.request_id, server)
            )
            if not self._wait_for_ack(pending, server):
                self._send_query(pending, leg, now, out)

    def _on_invalid_submit(self, event: InvalidSubmit, now: float, out: list[Effect]) -> None:
        self._counters["invalid_submits"] += 1
        self._on_unserved_submit(event, now, out)

    def _on_unserved_submit(self, event: SubmitLookup, now: float, out: list[Effect]) -> None:
        """A first submit resolved to 0 at once (nothing sent)."""
        self._counters["submits"] += 1
        pending = self._done[event.request_id] = self._new_lookup(event, now)
        self._resolve(pending, 0, now, out)

    def _on_duplicate_submit(self, event: SubmitLookup, now: float, out: list[Effect]) -> None:
        self._counters["submits"] += 1
        self._counters["duplicate_submits"] += 1

    def _on_stray_reply(self, event: ReplyReceived | RequestFailed, now: float, out: list[Effect]) -> None:
        """A reply to no pending lookup: a fire-and-forget FREE/END's, or stale."""
        if event.correlation in self._fire_and_forget:
            del self._fire_and_forget[event.correlation]
            self._counters["fire_and_forget_replies"] += 1
        else:
            self._counters["stale_replies"] += 1

    def _on_lookup_ack(self, event: LookupAck | LastLookupAck, now: float, out: list[Effect]) -> None:
        """The LOOKUP's ack: now the status query (unless one is out, or armed, already)."""
        pending, leg = self._leg_of_reply(event)
        leg.lookup_correlation = None
        leg.acked = True
        if leg.query_correlation is None and leg.next_query_at is None and leg.chunks is None:
            self._send_query(pending, leg, now, out)

    def _on_status_pending(self, event: StatusPending, now: float, out: list[Effect]) -> None:
        """The server's job is still pending: ask again after poll_interval."""
        pending, leg = self._leg_of_reply(event)
        leg.query_correlation = None
        leg.next_query_at = now + self.config.poll_interval
        self._timers.push(leg.next_query_at, Requery(pending.request_id, pending.serial, leg.server))

    def _on_hit_count(self, event: HitCount | HitCountLastAck | FinalHitCount, now: float, out: list[Effect]) -> None:
        """A server's hit count, in a status reply or (``answer_in_ack``) in the LOOKUP's ack; a
        count that is not a non-negative int is a bad reply, taken as 0."""
        pending, leg = self._leg_of_reply(event)
        if event.correlation == leg.lookup_correlation:
            leg.lookup_correlation = None
            leg.acked = True
            self._counters["answered_in_ack"] += 1
        else:
            leg.query_correlation = None
        count = _hit_count(event.result)
        if count is None:
            self._counters["bad_replies"] += 1
        self._leg_answer(pending, leg, count or 0, now, out)

    def _on_failure(self, event: RequestFailed, now: float, out: list[Effect]) -> None:
        """The LOOKUP or the status query failed: this server answers 0, so the lookup does."""
        pending, leg = self._leg_of_reply(event)
        if event.correlation == leg.lookup_correlation:
            leg.lookup_correlation = None
        else:
            leg.query_correlation = None
        self._counters["failures"] += 1
        self._leg_answer(pending, leg, 0, now, out)

    def _leg_of_reply(self, event: ReplyReceived | RequestFailed) -> tuple[PendingLookup, ServerLeg]:
        """The lookup and leg a reply answers (its correlation is no longer expected); a reply
        from another server than the one asked is counted as a bad reply."""
        request_id, server = self._correlations.pop(event.correlation)
        pending = self._active[request_id]
        if server != event.server:
            self._counters["bad_replies"] += 1
        return pending, pending.legs[server]

    def _on_end_request(self, event: EndRequest, now: float, out: list[Effect]) -> None:
        request_id = event.request_id
        pending = self._active.get(request_id)
        self._forget(request_id, now, out, free_pending=False)
        if pending is not None:
            self._end_pending_lookup(pending, now, out)
        else:
            self._send_end_session(request_id, out)

    def _on_cleanup(self, event: Cleanup, now: float, out: list[Effect]) -> None:
        self._forget(event.request_id, now, out, free_pending=True)

    def _on_free_unused(self, event: FreeUnusedLeases, now: float, out: list[Effect]) -> None:
        if event.start >= event.end:
            return
        key = CacheKey(self.config.model_name, self.config.world_size, None, event.token_ids,
                       event.start, event.end, event.request_id, event.cache_salt,
                       event.extras.prefix(event.end // self.config.chunk_size))
        for server in self._healthy_servers():
            self._counters["frees_sent"] += 1
            self._send(server, FreeLookupLocks(key), out, fire_and_forget=True)

    def _on_deadline(self, event: LookupDeadline, now: float, out: list[Effect]) -> None:
        self._counters["timeouts"] += 1
        self._resolve(self._active[event.request_id], 0, now, out)

    def _on_requery(self, event: Requery, now: float, out: list[Effect]) -> None:
        pending = self._active[event.request_id]
        leg = pending.legs[event.server]
        leg.next_query_at = None
        self._send_query(pending, leg, now, out)

    def _on_status_resend(self, event: StatusResend, now: float, out: list[Effect]) -> None:
        pending = self._active[event.request_id]
        leg = pending.legs[event.server]
        if not self._should_resend_status(pending, leg, now):
            self._timers.push(now + self.config.poll_interval, event)  # asked again later
            return
        self._counters["status_resends"] += 1
        self._correlations.pop(event.correlation, None)
        leg.query_correlation = None
        self._send_query(pending, leg, now, out)

    def _on_result_expiry(self, event: ResultExpiry, now: float, out: list[Effect]) -> None:
        self._counters["expired_results"] += 1

    def _on_leg_lost(self, event: LegLost, now: float, out: list[Effect]) -> None:
        pending = self._active[event.request_id]
        self._counters["failures"] += 1
        self._leg_answer(pending, pending.legs[event.server], 0, now, out)

    # ============================================================================= server rows

    def _on_unknown_server(self, event: ServerHealth | ServerEpoch, now: float, out: list[Effect]) -> None:
        self._counters["bad_replies"] += 1

    def _on_healthy(self, event: ServerHealthy, now: float, out: list[Effect]) -> None:
        """Nothing to do beyond the view its row assigns: new lookups ask it again."""

    def _on_unhealthy(self, event: ServerUnhealthy, now: float, out: list[Effect]) -> None:
        self._name_legs_lost(event.server)

    def _on_epoch(self, event: ServerEpoch, now: float, out: list[Effect]) -> None:
        old, self._epochs[event.server] = self._epochs[event.server], event.epoch
        if old is None or old == event.epoch:
            return
        # The server restarted: the jobs and leases of lookups in flight on it are gone, and a
        # status query would answer 0 anyway (or never come back).
        self._counters["server_restarts"] += 1
        self._name_legs_lost(event.server)

    def _name_legs_lost(self, server: int) -> None:
        """Every lookup still waiting on ``server``: its ``LegLost`` runs after this row."""
        for pending in self._active.values():
            leg = pending.legs.get(server)
            if leg is not None and leg.chunks is None:
                self._legs_lost.append(LegLost(pending.request_id, server))

    # ============================================================================= internals

    def _new_lookup(self, event: SubmitLookup, now: float) -> PendingLookup:
        """The record of a first submit (ABSENT until its row's next state is assigned)."""
        end = self._lookup_end(event)
        key = CacheKey(self.config.model_name, self.config.world_size, None, event.token_ids, 0, end,
                       event.request_id, event.cache_salt, event.extras.prefix(end // self.config.chunk_size))
        return PendingLookup(event.request_id, key, {}, now + self.config.lookup_timeout)

    def _lookup_end(self, event: SubmitLookup) -> int:
        """The tokens a lookup asks about: the submit's full chunks."""
        return len(event.token_ids) // self.config.chunk_size * self.config.chunk_size

    def _activate(self, pending: PendingLookup) -> None:
        """``pending`` is (again) waiting on its servers: a new serial, its deadline armed."""
        self._next_serial += 1
        pending.serial = self._next_serial
        self._active[pending.request_id] = pending
        self._timers.push(pending.deadline, LookupDeadline(pending.request_id, pending.serial))

    def _send_end_session(self, rid: str, out: list[Effect]) -> None:
        for s in self._healthy_servers():
            self._counters["end_sessions_sent"] += 1
            self._send(s, EndSession(rid), out, fire_and_forget=True)

    def _query_again(self, pending: PendingLookup) -> None:
        """Back to querying: the next ``handle`` sends a fresh status query to every server.
        Legacy only (``_keep_result_after_check``): the one state change outside the table, as
        ``check()`` is a read the old adapter turned into a poll."""
        del self._done[pending.request_id]
        pending.result_tokens = None
        self._activate(pending)
        for leg in pending.legs.values():
            leg.chunks = None
            leg.acked = True
            leg.next_query_at = 0.0
            self._timers.push(0.0, Requery(pending.request_id, pending.serial, leg.server))
        self._set_state(pending.request_id, pending.state_by_legs())

    def _send_query(self, pending: PendingLookup, leg: ServerLeg, now: float, out: list[Effect]) -> None:
        assert leg.query_correlation is None
        request: ServerRequest
        if self.config.use_wait:
            request = WaitPrefetchStatus(pending.request_id, self.config.wait_timeout)
        else:
            request = QueryPrefetchStatus(pending.request_id)
        self._counters["status_queries_sent"] += 1
        leg.query_sent_at = now
        corr = leg.query_correlation = self._send(leg.server, request, out, owner=(pending.request_id, leg.server))
        if self._may_resend():
            self._timers.push(now + self.config.poll_interval,
                              StatusResend(pending.request_id, pending.serial, leg.server, corr))

    def _leg_answer(
        self, pending: PendingLookup, leg: ServerLeg, chunks: int, now: float, out: list[Effect]
    ) -> None:
        for corr in (leg.lookup_correlation, leg.query_correlation):
            if corr is not None:
                self._correlations.pop(corr, None)
        leg.lookup_correlation = leg.query_correlation = leg.next_query_at = None
        leg.chunks = chunks
        if chunks == 0 or all(lg.chunks is not None for lg in pending.legs.values()):
            self._resolve(pending, min(lg.chunks for lg in pending.legs.values() if lg.chunks is not None),
                          now, out)

    def _resolve(self, pending: PendingLookup, chunks: int, now: float, out: list[Effect]) -> None:
        """Finish the lookup with ``chunks``; free what each server holds beyond it (the row
        assigns DONE, which files the result among the cached ones)."""
        chunk_size = self.config.chunk_size
        for leg in pending.legs.values():
            for corr in (leg.lookup_correlation, leg.query_correlation):
                if corr is not None:
                    self._correlations.pop(corr, None)
            # A server that may hold more than the result: its tail is never retrieved.
            held = leg.chunks if leg.chunks is not None else (
                pending.key.end // chunk_size if (leg.acked or leg.lookup_correlation is not None) else 0)
            leg.lookup_correlation = leg.query_correlation = leg.next_query_at = None
            if held > chunks and self._healthy[leg.server]:
                self._counters["frees_sent"] += 1
                key = attrs.evolve(pending.key, start=chunks * chunk_size, end=held * chunk_size)
                self._send(leg.server, FreeLookupLocks(key), out, fire_and_forget=True)
        pending.result_tokens = chunks * chunk_size
        pending.expires_at = now + self.config.result_ttl
        self._timers.push(pending.expires_at, ResultExpiry(pending.request_id, pending.serial))
        self._counters["resolved"] += 1
        if chunks == 0:
            self._counters["resolved_zero"] += 1

    def _forget(self, rid: str, now: float, out: list[Effect], free_pending: bool) -> None:
        """Cleanup / EndRequest (the row assigns ABSENT, which drops the record)."""
        pending = self._active.get(rid)
        if pending is None:
            return
        # Aborted before its result: release what the servers may have leased for it (F8).
        for leg in pending.legs.values():
            for corr in (leg.lookup_correlation, leg.query_correlation):
                if corr is not None:
                    self._correlations.pop(corr, None)
            if free_pending and self._healthy[leg.server] and pending.key.end > 0:
                self._counters["frees_sent"] += 1
                self._send(leg.server, FreeLookupLocks(pending.key), out, fire_and_forget=True)

    def _ranks_of(self, server: int) -> tuple[int, ...] | None:
        rps = self.config.ranks_per_server
        return None if rps is None else rps[server]

    def _servers_holding_ranks(self) -> list[int]:
        """The servers a lookup asks: those holding some rank (a server no rank uses holds nothing)."""
        rps = self.config.ranks_per_server
        return [s for s in range(self.config.num_servers) if rps is None or rps[s]]

    def _healthy_servers(self) -> list[int]:
        return [s for s, ok in enumerate(self._healthy) if ok]

    def _send(
        self, server: int, request: ServerRequest, out: list[Effect], *,
        owner: tuple[str, int] | None = None, fire_and_forget: bool = False,
    ) -> int:
        self._next_correlation += 1
        corr = self._next_correlation
        if owner is not None:
            self._correlations[corr] = owner
        if fire_and_forget:
            self._fire_and_forget[corr] = None
            while len(self._fire_and_forget) > self.config.fire_and_forget_cap:
                self._fire_and_forget.popitem(last=False)
        out.append(SendRequest(server, corr, request))
        return corr


def _lookup_values(p: PendingLookup) -> tuple[Any, ...]:
    """A lookup record as values (``LookupClient.state_values``); its legs as field tuples."""
    return (p.request_id, p.key,
            tuple([(s, (leg.server, leg.lookup_correlation, leg.acked, leg.query_correlation, leg.query_sent_at,
                        leg.next_query_at, leg.chunks)) for s, leg in p.legs.items()]),
            p.deadline, p.result_tokens, p.expires_at, p.serial, p.state)


def _lookup_of(v: tuple[Any, ...]) -> PendingLookup:
    """The lookup record ``_lookup_values`` described (a new one: a restored machine owns it)."""
    request_id, key, legs, deadline, result_tokens, expires_at, serial, state = v
    return PendingLookup(request_id, key, {s: ServerLeg(*leg) for s, leg in legs}, deadline, result_tokens,
                         expires_at, serial, state)


def _server_of(event: object) -> object:
    return getattr(event, "server")


_PENDING = (LookupState.AWAITING_ACK, LookupState.QUERYING)

# One request id's lookup: (its state, event) -> (handler, the one next state). handle runs it,
# the dispatcher assigns the next state (LookupClient._set_state).
LOOKUP_TABLE: Table[LookupState] = Table("LookupClient (lookup of a request id)", LookupState, LookupState.ABSENT, {
    (LookupState.ABSENT, SubmitLookup): (LookupClient._on_submit, LookupState.AWAITING_ACK),
    (LookupState.ABSENT, InvalidSubmit): (LookupClient._on_invalid_submit, LookupState.DONE),
    (LookupState.ABSENT, UnservedSubmit): (LookupClient._on_unserved_submit, LookupState.DONE),
    **{(state, SubmitLookup): (LookupClient._on_duplicate_submit, state) for state in (*_PENDING, LookupState.DONE)},
    (LookupState.ABSENT, ReplyReceived): (LookupClient._on_stray_reply, LookupState.ABSENT),
    (LookupState.AWAITING_ACK, LookupAck): (LookupClient._on_lookup_ack, LookupState.AWAITING_ACK),
    (LookupState.AWAITING_ACK, LastLookupAck): (LookupClient._on_lookup_ack, LookupState.QUERYING),
    **{(state, StatusPending): (LookupClient._on_status_pending, state) for state in _PENDING},
    (LookupState.AWAITING_ACK, HitCount): (LookupClient._on_hit_count, LookupState.AWAITING_ACK),
    (LookupState.AWAITING_ACK, HitCountLastAck): (LookupClient._on_hit_count, LookupState.QUERYING),
    (LookupState.QUERYING, HitCount): (LookupClient._on_hit_count, LookupState.QUERYING),
    **{(state, FinalHitCount): (LookupClient._on_hit_count, LookupState.DONE) for state in _PENDING},
    (LookupState.ABSENT, RequestFailed): (LookupClient._on_stray_reply, LookupState.ABSENT),
    **{(state, RequestFailed): (LookupClient._on_failure, LookupState.DONE) for state in _PENDING},
    **{(state, LookupDeadline): (LookupClient._on_deadline, LookupState.DONE) for state in _PENDING},
    # In AWAITING_ACK: a server that acked (or, legacy, was asked before its ack) while another
    # has not yet acked.
    **{(state, Requery): (LookupClient._on_requery, state) for state in _PENDING},
    **{(state, StatusResend): (LookupClient._on_status_resend, state) for state in _PENDING},
    **{(state, LegLost): (LookupClient._on_leg_lost, LookupState.DONE) for state in _PENDING},
    (LookupState.DONE, ResultExpiry): (LookupClient._on_result_expiry, LookupState.ABSENT),
    **{(state, Cleanup): (LookupClient._on_cleanup, LookupState.ABSENT) for state in LookupState},
    **{(state, EndRequest): (LookupClient._on_end_request, LookupState.ABSENT) for state in LookupState},
    **{(state, FreeUnusedLeases): (LookupClient._on_free_unused, state) for state in LookupState},
}, assigns=True, guards={
    SubmitLookup: LookupClient._classify_submit,
    ReplyReceived: LookupClient._classify_reply,
    Requery: LookupClient._classify_requery,
})
"""A reply addresses the lookup its correlation belongs to (ABSENT: no pending lookup expects it).
Pairs not listed (a timer of a lookup that ended) never run: the timer heap skips a timer whose
lookup is gone, and the dispatcher counts any other in ``stale_events``."""

# One server as the client sees it: ServerHealth / ServerEpoch (the lookups it fails: LegLost).
SERVER_VIEW_TABLE: Table[ServerView] = Table("LookupClient (one server's health and epoch)", ServerView,
                                            ServerView.UNKNOWN, {
    (ServerView.UNKNOWN, ServerHealth): (LookupClient._on_unknown_server, ServerView.UNKNOWN),
    (ServerView.UNKNOWN, ServerEpoch): (LookupClient._on_unknown_server, ServerView.UNKNOWN),
    **{(view, ServerHealthy): (LookupClient._on_healthy, ServerView.HEALTHY)
       for view in (ServerView.HEALTHY, ServerView.UNHEALTHY)},
    **{(view, ServerUnhealthy): (LookupClient._on_unhealthy, ServerView.UNHEALTHY)
       for view in (ServerView.HEALTHY, ServerView.UNHEALTHY)},
    **{(view, ServerEpoch): (LookupClient._on_epoch, view) for view in (ServerView.HEALTHY, ServerView.UNHEALTHY)},
}, assigns=True, guards={ServerHealth: LookupClient._classify_health})
TABLES: dict[str, Table[Any]] = {t.name: t for t in (LOOKUP_TABLE, SERVER_VIEW_TABLE)}


def _hit_count(result: object) -> int | None:
    """A server's hit count as a reply carries it; None for one that is not a non-negative int."""
    if isinstance(result, int) and not isinstance(result, bool) and result >= 0:
        return result
    return None


def _uint32_tokens(token_ids: TokenIds, end: int) -> bool:
    """Whether the first ``end`` ids are all uint32 (ids that did not pack are checked again
    only up to ``end``)."""
    if token_ids.valid:
        return True
    try:
        pack_tokens(token_ids.tolist()[:end])
    except (TypeError, ValueError, OverflowError):
        return False
    return True
