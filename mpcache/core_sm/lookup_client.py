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
"""
from __future__ import annotations

from collections import OrderedDict
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
    LegLost,
    LookupClientConfig,
    LookupDeadline,
    LookupState,
    PendingLookup,
    Requery,
    ResultExpiry,
    ServerLeg,
    ServerView,
    StatusResend,
)
from mpcache.core_sm.table import Dispatcher, Table, run_due_timers
from mpcache.core_sm.timers import Timer, TimerHeap

__all__ = ["EVENTS", "LOOKUP_TABLE", "SERVER_VIEW_TABLE", "TABLES", "LegLost", "LookupClient", "LookupClientConfig",
           "LookupDeadline", "LookupState", "PendingLookup", "Requery", "ResultExpiry", "ServerLeg", "ServerView",
           "StatusResend"]



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
        self._lookups: Dispatcher[LookupState] = LOOKUP_TABLE.bind(
            self, self._address, self.state, self._counters, self._refuse)
        self._servers: Dispatcher[ServerView] = SERVER_VIEW_TABLE.bind(
            self, _server_of, self._view, self._counters, self._refuse)
        # What the runtime feeds goes to the table that names it (timers and LegLost are internal).
        self._routes: dict[type, Dispatcher[Any]] = {**{t: self._lookups for t in LOOKUP_TABLE.events() if t in EVENTS},
                        **{t: self._servers for t in SERVER_VIEW_TABLE.events() if t in EVENTS}}

    # ============================================================================= public API

    def _dispatch(self, event: ClientEvent, now: float, out: list[Effect]) -> None:
        route = self._routes.get(type(event))
        if route is not None:
            route.run(event, now, out)
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
        if rid in self._done:
            return LookupState.DONE
        pending = self._active.get(rid)
        return LookupState.ABSENT if pending is None else pending.state

    def pending(self, request_id: str) -> PendingLookup | None:
        return self._active.get(request_id) or self._done.get(request_id)

    def is_healthy(self, server: int) -> bool:
        return self._healthy[server]

    def next_deadline(self) -> float | None:
        return self._timers.next_deadline()

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
            assert LookupDeadline(rid, p.serial) in live, "a pending lookup without its deadline"
            for leg in p.legs.values():
                if leg.chunks is not None:
                    assert leg.query_correlation is None and leg.next_query_at is None
                if leg.query_correlation is not None:
                    assert leg.next_query_at is None, "two queries for one leg"
                if leg.next_query_at is not None:
                    assert Requery(rid, p.serial, leg.server) in live, "a re-query without its timer"
        for rid, p in self._done.items():
            assert p.result_tokens is not None and p.result_tokens >= 0
            assert p.result_tokens % self.config.chunk_size == 0
            assert ResultExpiry(rid, p.serial) in live, "a cached result without its expiry"
        assert len(self._fire_and_forget) <= self.config.fire_and_forget_cap
        assert self._counters.get("table_violations", 0) == 0, "a handler left a state its row does not list"

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

    def _refuse(self, out: list[Effect], reply_to: object, error: ProtocolError) -> None:
        raise AssertionError("client events carry no reply_to")  # pragma: no cover

    def _timer_live(self, timer: Timer) -> bool:
        if isinstance(timer, ResultExpiry):
            done = self._done.get(timer.request_id)
            return done is not None and done.serial == timer.serial
        pending = self._active.get(getattr(timer, "request_id"))
        if pending is None or pending.serial != getattr(timer, "serial"):
            return False
        if isinstance(timer, Requery):
            return pending.legs[timer.server].next_query_at is not None
        if isinstance(timer, StatusResend):
            return pending.legs[timer.server].query_correlation == timer.correlation
        return True

    def _advance(self, now: float, out: list[Effect]) -> None:
        run_due_timers(self._timers, lambda _timer: self._lookups, now, out)

    # ============================================================================= lookup rows

    def _on_submit(self, ev: SubmitLookup, now: float, out: list[Effect]) -> None:
        self._counters["submits"] += 1
        rid = ev.request_id
        C = self.config.chunk_size
        end = len(ev.token_ids) // C * C
        key = CacheKey(self.config.model_name, self.config.world_size, None, ev.token_ids, 0, end,
                       rid, ev.cache_salt, ev.extras.prefix(end // C))
        pending = PendingLookup(rid, key, {}, now + self.config.lookup_timeout)
        if validate_cache_salt(ev.cache_salt) is not None or not _uint32_tokens(ev.token_ids, end):
            self._counters["invalid_submits"] += 1
            self._resolve(pending, 0, now, out)
            return
        asked = self._servers_holding_ranks()
        if end == 0 or not all(self._healthy[s] for s in asked):
            self._resolve(pending, 0, now, out)
            return
        self._activate(pending)
        for s in asked:
            leg = ServerLeg(s)
            pending.legs[s] = leg
            self._counters["lookups_sent"] += 1
            leg.lookup_correlation = self._send(
                s, Lookup(key, self.config.num_readers, self._ranks_of(s), answer_in_ack=self.config.answer_in_ack),
                out, owner=(rid, s)
            )
            if not self._wait_for_ack(pending, s):
                self._send_query(pending, leg, now, out)

    def _on_duplicate_submit(self, ev: SubmitLookup, now: float, out: list[Effect]) -> None:
        self._counters["submits"] += 1
        self._counters["duplicate_submits"] += 1

    def _on_stray_reply(self, ev: ReplyReceived | RequestFailed, now: float, out: list[Effect]) -> None:
        """A reply to no pending lookup: a fire-and-forget FREE/END's, or stale."""
        if ev.correlation in self._fire_and_forget:
            del self._fire_and_forget[ev.correlation]
            self._counters["fire_and_forget_replies"] += 1
        else:
            self._counters["stale_replies"] += 1

    def _on_reply(self, ev: ReplyReceived, now: float, out: list[Effect]) -> None:
        self._answer(ev.server, ev.correlation, ev.result, False, now, out)

    def _on_failure(self, ev: RequestFailed, now: float, out: list[Effect]) -> None:
        self._answer(ev.server, ev.correlation, None, True, now, out)

    def _answer(self, server: int, corr: int, result: object, failed: bool, now: float,
                out: list[Effect]) -> None:
        rid, s = self._correlations.pop(corr)
        pending = self._active[rid]
        leg = pending.legs[s]
        if s != server:
            self._counters["bad_replies"] += 1
        if corr == leg.lookup_correlation:
            leg.lookup_correlation = None
            if failed:
                self._counters["failures"] += 1
                self._leg_answer(pending, leg, 0, now, out)
                return
            leg.acked = True
            if result is not None and self.config.answer_in_ack:
                # the server answered in its ack: its count, as a status reply would carry it
                self._counters["answered_in_ack"] += 1
                self._status_answer(pending, leg, result, now, out)
                return
            if leg.query_correlation is None and leg.next_query_at is None and leg.chunks is None:
                self._send_query(pending, leg, now, out)
            return
        leg.query_correlation = None
        if failed:
            self._counters["failures"] += 1
            self._leg_answer(pending, leg, 0, now, out)
        elif result is None:
            leg.next_query_at = now + self.config.poll_interval
            self._timers.push(leg.next_query_at, Requery(rid, pending.serial, s))
        else:
            self._status_answer(pending, leg, result, now, out)

    def _status_answer(self, pending: PendingLookup, leg: ServerLeg, result: object, now: float,
                       out: list[Effect]) -> None:
        """A server's hit count (a status reply's, or an ack's that carries one): a count that
        is not a non-negative int is a bad reply, taken as 0."""
        if isinstance(result, int) and not isinstance(result, bool) and result >= 0:
            self._leg_answer(pending, leg, result, now, out)
        else:
            self._counters["bad_replies"] += 1
            self._leg_answer(pending, leg, 0, now, out)

    def _on_end_request(self, ev: EndRequest, now: float, out: list[Effect]) -> None:
        rid = ev.request_id
        pending = self._active.get(rid)
        self._forget(rid, now, out, free_pending=False)
        if pending is not None:
            self._end_pending_lookup(pending, now, out)
        else:
            self._send_end_session(rid, out)

    def _on_cleanup(self, ev: Cleanup, now: float, out: list[Effect]) -> None:
        self._forget(ev.request_id, now, out, free_pending=True)

    def _on_free_unused(self, ev: FreeUnusedLeases, now: float, out: list[Effect]) -> None:
        if ev.start >= ev.end:
            return
        key = CacheKey(self.config.model_name, self.config.world_size, None, ev.token_ids,
                       ev.start, ev.end, ev.request_id, ev.cache_salt,
                       ev.extras.prefix(ev.end // self.config.chunk_size))
        for s in self._healthy_servers():
            self._counters["frees_sent"] += 1
            self._send(s, FreeLookupLocks(key), out, fire_and_forget=True)

    def _on_deadline(self, ev: LookupDeadline, now: float, out: list[Effect]) -> None:
        self._counters["timeouts"] += 1
        self._resolve(self._active[ev.request_id], 0, now, out)

    def _on_requery(self, ev: Requery, now: float, out: list[Effect]) -> None:
        pending = self._active[ev.request_id]
        if pending.deadline <= now:  # both due: the lookup's time is up, ask nothing more
            self._on_deadline(LookupDeadline(ev.request_id, ev.serial), now, out)
            return
        leg = pending.legs[ev.server]
        leg.next_query_at = None
        self._send_query(pending, leg, now, out)

    def _on_status_resend(self, ev: StatusResend, now: float, out: list[Effect]) -> None:
        pending = self._active[ev.request_id]
        leg = pending.legs[ev.server]
        if not self._should_resend_status(pending, leg, now):
            self._timers.push(now + self.config.poll_interval, ev)  # asked again later
            return
        self._counters["status_resends"] += 1
        self._correlations.pop(ev.correlation, None)
        leg.query_correlation = None
        self._send_query(pending, leg, now, out)

    def _on_result_expiry(self, ev: ResultExpiry, now: float, out: list[Effect]) -> None:
        del self._done[ev.request_id]
        self._counters["expired_results"] += 1

    def _on_leg_lost(self, ev: LegLost, now: float, out: list[Effect]) -> None:
        pending = self._active[ev.request_id]
        self._counters["failures"] += 1
        self._leg_answer(pending, pending.legs[ev.server], 0, now, out)

    # ============================================================================= server rows

    def _on_unknown_server(self, ev: ServerHealth | ServerEpoch, now: float, out: list[Effect]) -> None:
        self._counters["bad_replies"] += 1

    def _on_health(self, ev: ServerHealth, now: float, out: list[Effect]) -> None:
        self._healthy[ev.server] = bool(ev.healthy)
        if not ev.healthy:
            self._fail_legs_on(ev.server, now, out)

    def _on_epoch(self, ev: ServerEpoch, now: float, out: list[Effect]) -> None:
        old, self._epochs[ev.server] = self._epochs[ev.server], ev.epoch
        if old is None or old == ev.epoch:
            return
        # The server restarted: the jobs and leases of lookups in flight on it are gone, and a
        # status query would answer 0 anyway (or never come back).
        self._counters["server_restarts"] += 1
        self._fail_legs_on(ev.server, now, out)

    def _fail_legs_on(self, server: int, now: float, out: list[Effect]) -> None:
        for pending in list(self._active.values()):
            leg = pending.legs.get(server)
            if leg is not None and leg.chunks is None and self._active.get(pending.request_id) is pending:
                self._lookups.run(LegLost(pending.request_id, server), now, out)

    # ============================================================================= internals

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
        """Back to querying: the next ``handle`` sends a fresh status query to every server."""
        del self._done[pending.request_id]
        pending.result_tokens = None
        self._activate(pending)
        for leg in pending.legs.values():
            leg.chunks = None
            leg.acked = True
            leg.next_query_at = 0.0
            self._timers.push(0.0, Requery(pending.request_id, pending.serial, leg.server))

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
        """Finish the lookup with ``chunks``; free what each server holds beyond it."""
        C = self.config.chunk_size
        for leg in pending.legs.values():
            for corr in (leg.lookup_correlation, leg.query_correlation):
                if corr is not None:
                    self._correlations.pop(corr, None)
            # A server that may hold more than the result: its tail is never retrieved.
            held = leg.chunks if leg.chunks is not None else (
                pending.key.end // C if (leg.acked or leg.lookup_correlation is not None) else 0)
            leg.lookup_correlation = leg.query_correlation = leg.next_query_at = None
            if held > chunks and self._healthy[leg.server]:
                self._counters["frees_sent"] += 1
                key = attrs.evolve(pending.key, start=chunks * C, end=held * C)
                self._send(leg.server, FreeLookupLocks(key), out, fire_and_forget=True)
        self._active.pop(pending.request_id, None)
        pending.result_tokens = chunks * C
        pending.expires_at = now + self.config.result_ttl
        self._done[pending.request_id] = pending
        self._timers.push(pending.expires_at, ResultExpiry(pending.request_id, pending.serial))
        self._counters["resolved"] += 1
        if chunks == 0:
            self._counters["resolved_zero"] += 1

    def _forget(self, rid: str, now: float, out: list[Effect], free_pending: bool) -> None:
        self._done.pop(rid, None)
        pending = self._active.pop(rid, None)
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


def _server_of(event: object) -> object:
    return getattr(event, "server")


_L, _V, _C = LookupState, ServerView, LookupClient
_PENDING = (_L.AWAITING_ACK, _L.QUERYING)

# One request id's lookup: (its state, event) -> (handler, next states). handle runs it.
LOOKUP_TABLE: Table[LookupState] = Table("LookupClient (lookup of a request id)", LookupState, _L.ABSENT, {
    (_L.ABSENT, SubmitLookup): (_C._on_submit, (_L.AWAITING_ACK, _L.DONE)),
    **{(s, SubmitLookup): (_C._on_duplicate_submit, (s,)) for s in (*_PENDING, _L.DONE)},
    (_L.ABSENT, ReplyReceived): (_C._on_stray_reply, (_L.ABSENT,)),
    (_L.AWAITING_ACK, ReplyReceived): (_C._on_reply, (_L.AWAITING_ACK, _L.QUERYING, _L.DONE)),
    (_L.QUERYING, ReplyReceived): (_C._on_reply, (_L.QUERYING, _L.DONE)),
    (_L.ABSENT, RequestFailed): (_C._on_stray_reply, (_L.ABSENT,)),
    **{(s, RequestFailed): (_C._on_failure, (_L.DONE,)) for s in _PENDING},
    **{(s, LookupDeadline): (_C._on_deadline, (_L.DONE,)) for s in _PENDING},
    # AWAITING_ACK: only a client that queries before the ack (legacy) has a re-query then.
    (_L.AWAITING_ACK, Requery): (_C._on_requery, (_L.AWAITING_ACK, _L.DONE)),
    (_L.QUERYING, Requery): (_C._on_requery, (_L.QUERYING, _L.DONE)),
    **{(s, StatusResend): (_C._on_status_resend, (s,)) for s in _PENDING},
    **{(s, LegLost): (_C._on_leg_lost, (_L.DONE,)) for s in _PENDING},
    (_L.DONE, ResultExpiry): (_C._on_result_expiry, (_L.ABSENT,)),
    **{(s, Cleanup): (_C._on_cleanup, (_L.ABSENT,)) for s in LookupState},
    **{(s, EndRequest): (_C._on_end_request, (_L.ABSENT,)) for s in LookupState},
    **{(s, FreeUnusedLeases): (_C._on_free_unused, (s,)) for s in LookupState},
})
"""A reply addresses the lookup its correlation belongs to (ABSENT: no pending lookup expects it).
Pairs not listed (a timer of a lookup that ended) never run: the timer heap skips a timer whose
lookup is gone, and the dispatcher counts any other in ``stale_events``."""

# One server as the client sees it: ServerHealth / ServerEpoch (the lookups it fails: LegLost).
SERVER_VIEW_TABLE: Table[ServerView] = Table("LookupClient (one server's health and epoch)", ServerView,
                                            _V.UNKNOWN, {
    (_V.UNKNOWN, ServerHealth): (_C._on_unknown_server, (_V.UNKNOWN,)),
    (_V.UNKNOWN, ServerEpoch): (_C._on_unknown_server, (_V.UNKNOWN,)),
    **{(s, ServerHealth): (_C._on_health, (_V.HEALTHY, _V.UNHEALTHY)) for s in (_V.HEALTHY, _V.UNHEALTHY)},
    **{(s, ServerEpoch): (_C._on_epoch, (s,)) for s in (_V.HEALTHY, _V.UNHEALTHY)},
})
TABLES: dict[str, Table[Any]] = {t.name: t for t in (LOOKUP_TABLE, SERVER_VIEW_TABLE)}


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
