"""``StepPlanner``: the vLLM connector's scheduler side, as one pure machine.

It owns the scheduler's ``LookupClient`` and decides everything the connector's scheduler half
decides: how many tokens a request loads (the hit, less what the engine's own prefix cache
holds, always leaving the last prompt token to compute), which read leases to free once the
blocks are allocated, what each step retrieves and stores, and what preemption and aborts mean.
``mpcache.runtime_zmq.vllm_connector`` (production) and ``mpcache.sim.engine`` (the simulator's model of vLLM's
scheduler) both drive *this* class, through the same events in vLLM's call order.

Events (vLLM's scheduler calls), each addressing one request:

* ``MatchRequest`` (``get_num_new_matched_tokens``) -> one ``MatchAnswer``: ``tokens=None`` while
  the lookup is pending (the caller may wait for it until ``wait_until``, else vLLM asks again
  next step); ``tokens > 0`` when that many tokens beyond ``num_computed_tokens`` will be loaded,
  ``load_async=False`` for a load small enough to finish within the step
  (``PlannerConfig.sync_load_max_tokens``); ``0, False`` otherwise. A request
  seen again after its blocks were allocated (preempted, resumed) loads nothing: the lookup's
  leases were freed or used, so it recomputes.
* ``BlocksAllocated`` (``update_state_after_alloc``): records the blocks; the first one ends the
  lookup (``Cleanup``), frees every lease the engine will not read through the retrieve
  (``unused_lease_ranges``) and queues the retrieve for the next plan.
* ``StepScheduled`` (``build_connector_meta``) -> one ``StepPlan``: the queued retrieves, a store
  for every chunk newly completed by this step (prompt chunks; decode chunks with
  ``store_decode_tokens``), and the preempted request ids.
* ``RequestFinished`` (``request_finished``): ends the request (``EndRequest`` -> END_SESSION).
  vLLM must always delay freeing the blocks: the worker reports the id in ``sending``.

Read leases under a deep queue (F20, LMCache #4691): a hit's leases expire ``lease_ttl`` after
the lookup that took them, and a request may wait in vLLM's queue longer than that between its
match and its allocation. The planner counts the leases from the moment it sent that lookup (the
server took them later, so they live at least that long) and renews them while the request
waits: half a TTL after the lookup it looks the request up again (a server renews the leases a
lookup of the same id holds, and recovers those of objects still resident), at most
``max_lease_renewals`` times (the server caps lookups per id). A hit is loaded only while at
least a quarter of the TTL is left; otherwise the planner renews first (the match answers
``None`` meanwhile) or, with no renewal left, gives the hit up (frees its leases, answers 0: the
request recomputes). So a load never relies on leases that may have expired.

The table (``TABLE``, one request id) *assigns*: each row names one next state, which the
dispatcher gives the request's tracker after the handler (``_set_state``); handlers change the
tracker's data and append effects. Guards tell a raw event apart first where the next state
depends on more than its type: ``_classify_match`` (a first match that asks no lookup; a match
that finds the lookup answered: ``LookupAnswered``; a hit whose leases need renewing first, or
must be given up), ``_classify_renewal`` (stale, the lookup answered, a miss, no renewal left)
and ``_classify_scheduled`` (a preempted request resumed). A row that leaves its event unanswered
-- a first match files the request, ``LookupAnswered`` takes the hit -- has the same event run
again in the state just assigned (``_run``).

``ReplyReceived`` / ``RequestFailed`` / ``ServerHealth`` / ``ServerEpoch`` / ``TimerFired`` go to
the lookup client. Effects: the lookup client's ``SendRequest``s, ``MatchAnswer``, ``StepPlan``.
``handle`` never raises (a bug is counted in ``stats()["internal_errors"]``).

KV-cache groups (``PlannerConfig.kv_groups``, vLLM's hybrid KV-cache manager): a hit is a hit only
when every group the request needs is restorable (``core_sm.kv_groups``); groups this version
cannot restore (``kv_groups.unrestorable``: recurrent state, several groups on a GPU engine)
make every request a miss -- no lookup, no lease, no store -- never a partial restore. One
sliding-window group: a load writes only the chunks of the window before the resume point.
Several groups (full attention and windows mixed): one object per chunk holds them all, so the
hit is one lookup's; each op carries every group's blocks (``kv_groups.join_group_blocks``) and
loads are asynchronous (``kv_groups.sync_load_allowed``). The workers write a window's blocks
from its first live one at the retrieve's end; a whole-prompt hit, which vLLM resumes one token
short of it, ends a chunk earlier where a window would keep one block more there
(``kv_groups.load_end``). A store never reads a block that left a window before its step (vLLM
may have reused it): ``kv_groups.store_floor``.

Tensor parallelism: one planner serves every rank; the plan is the same for all of them, and
each rank's worker stores and loads its own objects (``ObjectKey(chunk, rank)``).
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TypeVar

from mpcache.core_sm.effects import Effect
from mpcache.core_sm.errors import ProtocolError
from mpcache.core_sm.kv_groups import (
    join_group_blocks,
    load_end,
    needed_chunks,
    several,
    store_floor,
    sync_load_allowed,
    unrestorable,
)
from mpcache.core_sm.lookup_client import LookupClient
from mpcache.core_sm.messages import (
    Cleanup,
    EndRequest,
    FreeUnusedLeases,
    ReplyReceived,
    RequestFailed,
    ServerEpoch,
    ServerHealth,
    SubmitLookup,
    SubmitRetrieve,
    SubmitStore,
    TimerFired,
)
from mpcache.core_sm.table import Dispatcher, Table
from mpcache.core_sm.timers import Timer, TimerHeap

# The records (configuration, events, answers, per-request state) live in planner_ops; they are
# importable from here too, where every caller has always found them.
from mpcache.core_sm.planner_ops import (
    SYNC_LOAD_ALL as SYNC_LOAD_ALL,
    default_sync_load_max_tokens as default_sync_load_max_tokens,
    PlannerConfig as PlannerConfig,
    MatchRequest as MatchRequest,
    BlocksAllocated as BlocksAllocated,
    ScheduledRequest as ScheduledRequest,
    StepScheduled as StepScheduled,
    RequestPreempted as RequestPreempted,
    RequestScheduled as RequestScheduled,
    LeaseRenewalDue as LeaseRenewalDue,
    FirstMatchWithoutLookup as FirstMatchWithoutLookup,
    LookupAnswered as LookupAnswered,
    MatchRenewing as MatchRenewing,
    MatchGivingUp as MatchGivingUp,
    RenewalStale as RenewalStale,
    RenewalOfMiss as RenewalOfMiss,
    RenewalGivingUp as RenewalGivingUp,
    RequestResumed as RequestResumed,
    RequestFinished as RequestFinished,
    MatchAnswer as MatchAnswer,
    StepPlan as StepPlan,
    PlannerEvent as PlannerEvent,
    PlannerEffect as PlannerEffect,
    Out as Out,
    LOOKUP_EVENTS as LOOKUP_EVENTS,
    RequestState as RequestState,
    RequestTracker as RequestTracker,
)

# The raw events a guard may hand back as they came, and the specific matches it names.
EventT = TypeVar("EventT", MatchRequest, LeaseRenewalDue)
MatchT = TypeVar("MatchT", bound=MatchRequest)


class StepPlanner:
    """See the module docstring. ``lookups``: the scheduler's ``LookupClient`` (a legacy
    profile may pass a subclass)."""

    def __init__(self, config: PlannerConfig, lookups: LookupClient) -> None:
        if lookups.config.chunk_size != config.chunk_size:
            raise ValueError(f"lookup chunk size {lookups.config.chunk_size} != planner's {config.chunk_size}")
        self.config = config
        self.lookups = lookups
        # why this engine's KV-cache groups cannot be restored (None: they can)
        self.unrestorable = unrestorable(config.kv_groups, config.cpu_engine)
        # the one group restored (None: a plain full-attention engine, or several groups)
        self.kv_group = config.kv_groups[0] if self.unrestorable is None and len(config.kv_groups) == 1 else None
        # several groups restored: the workers write a window's blocks from its first live one
        self._several_groups = self.unrestorable is None and several(config.kv_groups)
        self._sync_loads_allowed = sync_load_allowed(config.kv_groups)
        self._trackers: dict[str, RequestTracker] = {}
        self._step_stores: list[SubmitStore] = []  # the stores of the step being planned
        # Lease renewals (the typed timer LeaseRenewalDue) on the shared heap. Every one runs
        # through the table when due: a renewal whose request moved on (allocated, renewed,
        # finished) is told apart there, and its row does nothing.
        self._timers = TimerHeap(_every_renewal_runs)
        self._pass_started_at: float | None = None  # the first MatchRequest since the last step
        self._last_step_ran = False  # the last StepScheduled scheduled a request (or preempted one)
        self._counters: dict[str, int] = {"internal_errors": 0, "lookups_submitted": 0, "loads_planned": 0,
                                          "stores_planned": 0, "recomputed_after_preemption": 0,
                                          "lease_renewals": 0, "hits_given_up": 0}
        # Set by a row that leaves its event unanswered (a first match filed, a lookup's answer
        # taken): _run runs the event again in the state just assigned.
        self._run_again = False
        self._dispatch: Dispatcher[RequestState] = TABLE.bind(
            self, self._address, self._state_of, self._counters, self._refuse, self._set_state)

    # ------------------------------------------------------------------ the entry point

    def handle(self, event: PlannerEvent, now: float) -> list[PlannerEffect]:
        """Feed one event; returns the effects, in order. Never raises."""
        out: Out = []
        try:
            if isinstance(event, LOOKUP_EVENTS):
                out.extend(self.lookups.handle(event, now))
                if isinstance(event, TimerFired):
                    self._renew_due(now, out)
            elif isinstance(event, StepScheduled):
                self._on_step(event, now, out)
            else:
                if isinstance(event, MatchRequest) and self._pass_started_at is None:
                    self._pass_started_at = now
                self._run(event, now, out)
        except Exception:
            self._counters["internal_errors"] += 1
        return out

    def next_deadline(self) -> float | None:
        deadline = self.lookups.next_deadline()
        due = self._timers.next_deadline()  # may be a stale renewal: its TimerFired runs a row that does nothing
        if due is not None:
            deadline = due if deadline is None else min(deadline, due)
        return deadline

    def tracker(self, request_id: str) -> RequestTracker | None:
        return self._trackers.get(request_id)

    def state(self, request_id: str) -> RequestState:
        return self._state_of(request_id)

    @property
    def counters(self) -> Mapping[str, int]:
        """The machine's own counters, live (read them; ``stats()`` is a copy with more)."""
        return self._counters

    def stats(self) -> dict[str, int]:
        out = dict(self._counters)
        out["requests"] = len(self._trackers)
        out["lookup_internal_errors"] = self.lookups.stats().get("internal_errors", 0)
        return out

    def check_invariants(self) -> None:
        self.lookups.check_invariants()
        for rid, tracker in self._trackers.items():
            assert tracker.request_id == rid, "tracker filed under another id"
            if tracker.hit_tokens is not None:
                assert tracker.hit_tokens % self.config.chunk_size == 0, "hit not chunk aligned"
            assert tracker.stored_until % self.config.chunk_size == 0, "store boundary not chunk aligned"
            if tracker.pending_retrieve is not None:
                assert tracker.state is RequestState.RUNNING, "retrieve queued for a request without blocks"
            assert tracker.lease_renewals <= self.config.max_lease_renewals, "renewed past the cap"
            assert tracker.state is not RequestState.ABSENT, "a tracker filed without the state its row assigns"
            if tracker.state in (RequestState.LOOKING_UP, RequestState.MATCHED):
                # the hit is known exactly when the lookup's answer was taken (MATCHED)
                assert (tracker.hit_tokens is None) == (tracker.state is RequestState.LOOKING_UP), \
                    "a waiting request's hit disagrees with the state its row assigned"
            if tracker.state is RequestState.PREEMPTED:
                assert not tracker.block_ids, "a preempted request still holds blocks"

    # ------------------------------------------------------------------ table plumbing

    @staticmethod
    def _address(event: object) -> str:
        return str(getattr(event, "request_id"))

    def _state_of(self, request_id: object) -> RequestState:
        tracker = self._trackers.get(str(request_id))
        return RequestState.ABSENT if tracker is None else tracker.state

    def _set_state(self, request_id: Hashable, state: RequestState) -> None:
        """TABLE's assignment: the request is now in ``state`` (ABSENT: its tracker is forgotten;
        a first match's handler filed the tracker this makes LOOKING_UP or MATCHED)."""
        rid = str(request_id)
        if state is RequestState.ABSENT:
            self._trackers.pop(rid, None)
            return
        self._trackers[rid].state = state

    def _run(self, event: object, now: float, out: Out) -> None:
        """Run ``event``'s row. A row that leaves the event unanswered (a first match files the
        request, a lookup's answer becomes the hit) has it run again, in the state just assigned."""
        self._run_again = False
        self._dispatch.run(event, now, out)
        for _again in range(2):  # at most: a first match filed, its lookup's answer taken
            if not self._run_again:
                return
            self._run_again = False
            self._dispatch.run(event, now, out)
        if self._run_again:  # a row assigned a state whose row runs it again: a table bug
            self._run_again = False
            raise AssertionError(f"{type(event).__name__} of {self._address(event)} ran three rows and is not done")

    def _refuse(self, out: list[Effect], reply_to: object, error: ProtocolError) -> None:
        raise AssertionError("planner events carry no reply_to")  # pragma: no cover

    def _lookup(self, event: object, now: float, out: Out) -> None:
        out.extend(self.lookups.handle(event, now))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ extension points

    def loadable_tokens(self, tracker: RequestTracker) -> int:
        """Tokens of the prompt a hit can cover: the engine needs the last prompt token to sample
        from, so it is always computed."""
        return min(self.load_end(tracker), tracker.num_prompt_tokens - 1)

    def load_end(self, tracker: RequestTracker) -> int:
        """Where a load of the hit ends (a chunk boundary): the hit, capped by the request's
        load limit; with several groups where each window's first live block agrees with the
        one vLLM keeps at its resume point (``kv_groups.load_end``)."""
        end = tracker.hit_tokens or 0
        if tracker.load_limit is not None:
            end = min(end, tracker.load_limit)
        if self._several_groups:
            end = load_end(self.config.kv_groups, end, tracker.num_prompt_tokens, self.config.chunk_size)
        return end

    def unused_lease_ranges(self, hit: int, start: int, end: int) -> list[tuple[int, int]]:
        """Token ranges of the hit ``[0, hit)`` whose leases the engine will not read, when the
        retrieve reads ``[start, end)`` (``end <= start``: no retrieve): everything else."""
        if end <= start:
            return [(0, hit)] if hit > 0 else []
        ranges = []
        if start > 0:
            ranges.append((0, start))
        if end < hit:
            ranges.append((end, hit))
        return ranges

    def renew_at(self, tracker: RequestTracker) -> float | None:
        """When to renew the leases of a waiting request's hit: half a TTL after the lookup that
        took them (None: never)."""
        ttl = self.config.lease_ttl
        return None if ttl is None or tracker.leased_at is None else tracker.leased_at + ttl / 2

    def leases_loadable(self, tracker: RequestTracker, now: float) -> bool:
        """Whether the hit may be loaded now: its leases live at least a quarter of a TTL more
        (the retrieve must reach the server before they expire)."""
        ttl = self.config.lease_ttl
        return ttl is None or tracker.leased_at is None or now <= tracker.leased_at + ttl * 3 / 4

    def _match_after_allocation(self, tracker: RequestTracker, event: MatchRequest,
                                out: Out) -> None:
        """Seen again after its blocks were allocated (preempted, resumed): the lookup's leases
        were freed or used by the first load, so the request recomputes."""
        if tracker.hit_tokens:
            self._counters["recomputed_after_preemption"] += 1
        out.append(MatchAnswer(tracker.request_id, 0, False))

    # ------------------------------------------------------------------ guards
    # Pure (but for what a legacy lookup client's check() does): they read the tracker and the
    # lookup client and name the specific event whose row runs.

    def _classify_match(self, event: MatchRequest, state: RequestState, now: float) -> MatchRequest | LookupAnswered:
        """A first match that asks no lookup (``FirstMatchWithoutLookup``); a match of a request
        whose lookup has answered (``LookupAnswered``: the hit is taken, then the match runs
        again); a matched hit whose leases may expire before its load (``MatchRenewing``, or
        ``MatchGivingUp`` with no renewal left). Anything else stays a ``MatchRequest``."""
        if state is RequestState.ABSENT:
            return event if self._asks_lookup(event) else _specific(FirstMatchWithoutLookup, event)
        if state is RequestState.LOOKING_UP:
            return self._classify_looking_up(event)
        if state is RequestState.MATCHED:
            tracker = self._trackers[event.request_id]
            if self.loadable_tokens(tracker) > event.num_computed_tokens and not self.leases_loadable(tracker, now):
                # The leases may expire before the retrieve reaches the server: renew them first.
                return _specific(MatchRenewing if self._renewal_left(tracker) else MatchGivingUp, event)
        return event

    def _classify_renewal(self, event: LeaseRenewalDue, state: RequestState,
                          now: float) -> LeaseRenewalDue | LookupAnswered:
        """A renewal a later lookup made stale (``RenewalStale``); one due while the lookup has
        answered unseen (``LookupAnswered``: the hit is taken, then the renewal runs again); in
        MATCHED, a miss has nothing to renew (``RenewalOfMiss``) and a hit with no renewal left is
        given up (``RenewalGivingUp``). Anything else stays a ``LeaseRenewalDue``."""
        if state not in (RequestState.LOOKING_UP, RequestState.MATCHED):
            return event
        tracker = self._trackers[event.request_id]
        if tracker.leased_at != event.leased_at:
            return RenewalStale(event.request_id, event.leased_at)
        if state is RequestState.LOOKING_UP:
            return self._classify_looking_up(event)
        if not tracker.hit_tokens:
            return RenewalOfMiss(event.request_id, event.leased_at)
        if not self._renewal_left(tracker):
            return RenewalGivingUp(event.request_id, event.leased_at)
        return event

    def _classify_looking_up(self, event: EventT) -> EventT | LookupAnswered:
        """While LOOKING_UP: ``LookupAnswered`` once the lookup has an answer (``check``), the
        event as it came while it is pending."""
        hit = self.lookups.check(event.request_id)
        return event if hit is None else LookupAnswered(event.request_id, int(hit))

    def _classify_scheduled(self, event: RequestScheduled, state: RequestState, now: float) -> RequestScheduled:
        """A preempted request scheduled with new blocks is resumed (``RequestResumed``)."""
        if state is RequestState.PREEMPTED and event.request.block_ids is not None:
            return RequestResumed(event.request)
        return event

    def _asks_lookup(self, event: MatchRequest) -> bool:
        """Whether a first match looks the request up: loads on, groups restorable, and a load
        cap (if any) beyond the engine's own hit."""
        load_limit = self._load_limit(event)
        return self.config.load and self.unrestorable is None and (
            load_limit is None or load_limit > event.num_computed_tokens)

    def _renewal_left(self, tracker: RequestTracker) -> bool:
        return tracker.lease_renewals < self.config.max_lease_renewals

    # ------------------------------------------------------------------ handlers
    # They change the trackers' data and append effects; the row's next state is assigned after
    # them (_set_state).

    def _on_first_match(self, event: MatchRequest, now: float, out: Out) -> None:
        """A request's first match: its lookup is sent; the match is answered by the row of the
        state assigned (``_run`` runs it again)."""
        tracker = self._file_tracker(event, now)
        self._counters["lookups_submitted"] += 1
        tracker.leased_at = now
        self._lookup(SubmitLookup(event.request_id, tracker.prompt(), tracker.cache_salt, tracker.extras),
                     now, out)
        self._schedule_renewal(tracker, self.renew_at(tracker))
        self._run_again = True

    def _on_first_match_without_lookup(self, event: FirstMatchWithoutLookup, now: float, out: Out) -> None:
        """A first match with nothing to look up: its hit is 0 (answered by the MATCHED row)."""
        self._file_tracker(event, now).hit_tokens = 0
        self._run_again = True

    def _file_tracker(self, event: MatchRequest, now: float) -> RequestTracker:
        """The tracker of a request's first match (ABSENT until its row's next state is assigned)."""
        chunk = self.config.chunk_size
        tracker = RequestTracker(event.request_id, event.token_ids, event.num_prompt_tokens, event.cache_salt or "",
                                 event.extras)
        tracker.load_limit = self._load_limit(event)
        if event.max_offload_tokens is not None:
            tracker.store_limit = event.max_offload_tokens // chunk * chunk
        tracker.first_match_at = now
        self._trackers[event.request_id] = tracker
        return tracker

    def _load_limit(self, event: MatchRequest) -> int | None:
        """Tokens ``[0, load_limit)`` a first match may load (its ``max_load_tokens``, in chunks)."""
        if event.max_load_tokens is None:
            return None
        chunk = self.config.chunk_size
        return (event.num_computed_tokens + event.max_load_tokens) // chunk * chunk

    def _on_match_pending(self, event: MatchRequest, now: float, out: Out) -> None:
        """The lookup is still pending: not yet (the caller may wait until ``wait_until``)."""
        tracker = self._trackers[event.request_id]
        wait = self.config.lookup_wait
        started = self._pass_started_at if self._pass_started_at is not None else now
        until = None
        if self.config.lookup_wait_idle > wait and self.engine_idle():
            # every pass of an idle engine may wait: a slow lookup (L2) costs a step per
            # lookup_wait_idle instead of an empty step per few hundred microseconds
            until = started + self.config.lookup_wait_idle
        elif wait > 0:
            until = min(tracker.first_match_at, started) + wait
        out.append(MatchAnswer(event.request_id, None, True, until))

    def _on_lookup_answered(self, event: LookupAnswered, now: float, out: Out) -> None:
        """The lookup's answer is the hit; the event that found it (a match, a renewal) runs
        again in MATCHED."""
        self._trackers[event.request_id].hit_tokens = event.hit_tokens
        self._run_again = True

    def _on_match(self, event: MatchRequest, now: float, out: Out) -> None:
        """A matched request: the tokens it loads beyond the engine's own hit."""
        tracker = self._trackers[event.request_id]
        tracker.engine_hit_tokens = event.num_computed_tokens
        self._answer_match(tracker, event, self.loadable_tokens(tracker), out)

    def _on_match_renewing(self, event: MatchRenewing, now: float, out: Out) -> None:
        tracker = self._trackers[event.request_id]
        tracker.engine_hit_tokens = event.num_computed_tokens
        self._renew(tracker, now, out)
        out.append(MatchAnswer(event.request_id, None, True))

    def _on_match_giving_up(self, event: MatchGivingUp, now: float, out: Out) -> None:
        tracker = self._trackers[event.request_id]
        tracker.engine_hit_tokens = event.num_computed_tokens
        self._give_up(tracker, now, out)
        self._answer_match(tracker, event, 0, out)

    def _answer_match(self, tracker: RequestTracker, event: MatchRequest, loadable: int, out: Out) -> None:
        if loadable <= event.num_computed_tokens:
            tracker.sync_load = False
            out.append(MatchAnswer(event.request_id, 0, False))
        else:
            tokens = loadable - event.num_computed_tokens
            tracker.sync_load = tokens <= self.config.sync_load_max_tokens and self._sync_loads_allowed
            out.append(MatchAnswer(event.request_id, tokens, not tracker.sync_load))

    def _on_renewal_pending(self, event: LeaseRenewalDue, now: float, out: Out) -> None:
        """A renewal due while the request's lookup is still in flight: looked at again an
        eighth of a TTL later. (vLLM may not ask about a request for a long time -- a full
        scheduler does not reach it -- so a renewal reads a lookup vLLM has not seen answered.)"""
        ttl = self.config.lease_ttl
        self._schedule_renewal(self._trackers[event.request_id], None if ttl is None else now + ttl / 8)

    def _on_renewal_due(self, event: LeaseRenewalDue, now: float, out: Out) -> None:
        """Renew a waiting request's leases: it is looked up again."""
        self._renew(self._trackers[event.request_id], now, out)

    def _on_renewal_giving_up(self, event: RenewalGivingUp, now: float, out: Out) -> None:
        self._give_up(self._trackers[event.request_id], now, out)

    def _schedule_renewal(self, tracker: RequestTracker, due: float | None) -> None:
        if due is not None and tracker.leased_at is not None:
            self._timers.push(due, LeaseRenewalDue(tracker.request_id, tracker.leased_at))

    def _renew(self, tracker: RequestTracker, now: float, out: Out) -> None:
        """Look a waiting request up again, so the servers renew (or recover) its hit's leases
        (its row makes it LOOKING_UP again)."""
        tracker.lease_renewals += 1
        self._counters["lease_renewals"] += 1
        tracker.hit_tokens, tracker.leased_at = None, now
        self._lookup(Cleanup(tracker.request_id), now, out)  # forgets the answered lookup; frees nothing
        self._lookup(SubmitLookup(tracker.request_id, tracker.prompt(), tracker.cache_salt, tracker.extras),
                     now, out)
        self._schedule_renewal(tracker, self.renew_at(tracker))

    def _give_up(self, tracker: RequestTracker, now: float, out: Out) -> None:
        """No renewal left: the hit is given up (its leases freed); the request recomputes."""
        self._counters["hits_given_up"] += 1
        hit, tracker.hit_tokens, tracker.leased_at = tracker.hit_tokens or 0, 0, None
        self._lookup(FreeUnusedLeases(tracker.request_id, tracker.prompt(), 0, hit, tracker.cache_salt,
                                      tracker.extras), now, out)

    def _renew_due(self, now: float, out: Out) -> None:
        """The renewals due, in firing order, each through the table (and run again where its
        row says so: ``_run``)."""
        timer = self._timers.pop_due(now)
        while timer is not None:
            self._run(timer, now, out)
            timer = self._timers.pop_due(now)

    def _on_match_allocated(self, event: MatchRequest, now: float, out: Out) -> None:
        self._match_after_allocation(self._trackers[event.request_id], event, out)

    def _on_allocated(self, event: BlocksAllocated, now: float, out: Out) -> None:
        tracker = self._trackers[event.request_id]
        tracker.block_ids = list(event.block_ids)
        tracker.other_group_block_ids = [list(g) for g in event.other_group_block_ids]
        hit = tracker.hit_tokens or 0
        chunk, block = self.config.chunk_size, self.config.block_size
        start = end = 0
        if event.num_external_tokens > 0 and hit > 0:
            start = tracker.engine_hit_tokens // chunk * chunk
            covered = tracker.num_blocks() * block
            end = min(self.load_end(tracker), covered // chunk * chunk)
            if self.kv_group is not None and end > start:  # a window needs only its chunks before end
                start = max(start, needed_chunks(self.kv_group, end, chunk).start * chunk)
            if end > start:
                self._counters["loads_planned"] += 1
                tracker.pending_retrieve = SubmitRetrieve(
                    tracker.request_id, tracker.token_ids[:end], start, end,
                    self._op_blocks(tracker, start // block, end // block), max(0, tracker.engine_hit_tokens - start),
                    tracker.cache_salt, tracker.extras, synchronous=tracker.sync_load)
        prompt = tracker.prompt()
        tracker.leases_freed = tuple(self.unused_lease_ranges(hit, start, end))
        for free_start, free_end in tracker.leases_freed:
            self._lookup(FreeUnusedLeases(tracker.request_id, prompt, free_start, free_end, tracker.cache_salt,
                                          tracker.extras), now, out)
        self._lookup(Cleanup(tracker.request_id), now, out)
        # Chunks that hit are in mpcache already: never store them again.
        tracker.stored_until = max(tracker.stored_until, hit)

    def _on_blocks(self, event: BlocksAllocated, now: float, out: Out) -> None:
        tracker = self._trackers[event.request_id]
        tracker.block_ids = list(event.block_ids)
        tracker.other_group_block_ids = [list(g) for g in event.other_group_block_ids]

    def _on_preempted(self, event: RequestPreempted, now: float, out: Out) -> None:
        tracker = self._trackers[event.request_id]
        tracker.block_ids = []
        tracker.other_group_block_ids = []
        tracker.pending_retrieve = None

    def _on_scheduled(self, event: RequestScheduled, now: float, out: Out) -> None:
        """A request this step runs: its new blocks (all of them when it is new or resumed), and
        the store of the chunks the step completes."""
        tracker = self._trackers[event.request_id]
        request = event.request
        if request.block_ids is not None:
            if request.replaces_blocks or tracker.state is RequestState.PREEMPTED:  # the state before the row
                tracker.block_ids = list(request.block_ids)
                tracker.other_group_block_ids = [list(g) for g in request.other_group_block_ids]
            else:
                tracker.block_ids.extend(request.block_ids)
                for blocks, new in zip(tracker.other_group_block_ids, request.other_group_block_ids):
                    blocks.extend(new)
        store = self._plan_store(tracker, request.num_computed_tokens + request.num_scheduled_tokens,
                                 request.num_computed_tokens)
        if store is not None:
            self._step_stores.append(store)

    def _on_finished(self, event: RequestFinished, now: float, out: Out) -> None:
        """The request ends (its lookup too); its row forgets the tracker."""
        self._lookup(EndRequest(event.request_id), now, out)

    def _ignore(self, event: object, now: float, out: Out) -> None:
        """Nothing to do: a request the planner does not track (vLLM may call for one it never
        matched), one the event does not concern in its state, or a renewal with nothing to
        renew (stale, or a miss)."""

    # ------------------------------------------------------------------ the step

    def engine_idle(self) -> bool:
        """Whether the engine has nothing to run (``PlannerConfig.lookup_wait_idle``): its last
        step scheduled no request and no tracked request holds blocks."""
        if self._last_step_ran:
            return False
        busy = (RequestState.RUNNING, RequestState.PREEMPTED)
        return not any(t.state in busy for t in self._trackers.values())

    def _on_step(self, event: StepScheduled, now: float, out: Out) -> None:
        self._pass_started_at = None
        self._last_step_ran = bool(event.scheduled or event.preempted)
        retrieves: list[SubmitRetrieve] = []
        sync_loads: list[str] = []
        for tracker in self._trackers.values():
            if tracker.pending_retrieve is not None:
                retrieves.append(tracker.pending_retrieve)
                if tracker.pending_retrieve.synchronous:
                    sync_loads.append(tracker.request_id)
                tracker.pending_retrieve = None
        for request_id in event.preempted:
            self._run(RequestPreempted(request_id), now, out)
        self._step_stores = []
        for request in event.scheduled:
            self._run(RequestScheduled(request), now, out)
        out.append(StepPlan(tuple(retrieves), tuple(self._step_stores), event.preempted, tuple(sync_loads)))
        self._step_stores = []

    @staticmethod
    def _op_blocks(tracker: RequestTracker, start_block: int, end_block: int) -> tuple[int, ...] | list[int]:
        """An op's block ids: the range's blocks, of every group (group after group) when the
        engine has several."""
        if not tracker.other_group_block_ids:
            return tracker.block_ids[start_block:end_block]
        return join_group_blocks([tracker.block_ids, *tracker.other_group_block_ids], start_block, end_block)

    def _plan_store(self, tracker: RequestTracker, computed_tokens: int, computed_before: int = 0) -> SubmitStore | None:
        c = self.config
        if not c.store or self.unrestorable is not None:  # what cannot be restored is not stored
            return None
        if tracker.stored_until < store_floor(c.kv_groups, computed_before):
            # the next chunk's first blocks left a window before this step: vLLM may have
            # given them to another request, so neither it nor (a prefix chain) any later one
            # is stored
            tracker.store_limit = tracker.stored_until
            return None
        limit = min(computed_tokens, len(tracker.token_ids))
        if not c.store_decode_tokens:
            limit = min(limit, tracker.num_prompt_tokens)
        limit = min(limit, tracker.num_blocks() * c.block_size)
        if tracker.store_limit is not None:
            limit = min(limit, tracker.store_limit)
        end = limit // c.chunk_size * c.chunk_size
        start = tracker.stored_until
        if end <= start:
            return None
        tracker.stored_until = end
        self._counters["stores_planned"] += 1
        return SubmitStore(tracker.request_id, tracker.token_ids[:end], start, end,
                           self._op_blocks(tracker, start // c.block_size, end // c.block_size), tracker.cache_salt,
                           tracker.extras)


_ALL = tuple(RequestState)
_WAITING = (RequestState.LOOKING_UP, RequestState.MATCHED)

# The one transition table: (request's state, event) -> (handler, the one next state). handle runs
# it; the dispatcher assigns the next state (StepPlanner._set_state). The guards tell a match, a
# renewal and a scheduled request apart first (_classify_match, _classify_renewal,
# _classify_scheduled).
TABLE: Table[RequestState] = Table("StepPlanner", RequestState, RequestState.ABSENT, {
    (RequestState.ABSENT, MatchRequest): (StepPlanner._on_first_match, RequestState.LOOKING_UP),
    (RequestState.ABSENT, FirstMatchWithoutLookup): (StepPlanner._on_first_match_without_lookup,
                                                     RequestState.MATCHED),
    (RequestState.LOOKING_UP, MatchRequest): (StepPlanner._on_match_pending, RequestState.LOOKING_UP),
    (RequestState.LOOKING_UP, LookupAnswered): (StepPlanner._on_lookup_answered, RequestState.MATCHED),
    (RequestState.MATCHED, MatchRequest): (StepPlanner._on_match, RequestState.MATCHED),
    (RequestState.MATCHED, MatchRenewing): (StepPlanner._on_match_renewing, RequestState.LOOKING_UP),
    (RequestState.MATCHED, MatchGivingUp): (StepPlanner._on_match_giving_up, RequestState.MATCHED),
    (RequestState.RUNNING, MatchRequest): (StepPlanner._on_match_allocated, RequestState.RUNNING),
    (RequestState.PREEMPTED, MatchRequest): (StepPlanner._on_match_allocated, RequestState.PREEMPTED),
    # A renewal due while the request still waits looks it up again; once it holds blocks the
    # leases are spent or freed: nothing to renew.
    (RequestState.LOOKING_UP, LeaseRenewalDue): (StepPlanner._on_renewal_pending, RequestState.LOOKING_UP),
    (RequestState.MATCHED, LeaseRenewalDue): (StepPlanner._on_renewal_due, RequestState.LOOKING_UP),
    (RequestState.MATCHED, RenewalGivingUp): (StepPlanner._on_renewal_giving_up, RequestState.MATCHED),
    (RequestState.MATCHED, RenewalOfMiss): (StepPlanner._ignore, RequestState.MATCHED),
    **{(state, RenewalStale): (StepPlanner._ignore, state) for state in _WAITING},
    **{(state, LeaseRenewalDue): (StepPlanner._ignore, state)
       for state in (RequestState.ABSENT, RequestState.RUNNING, RequestState.PREEMPTED)},
    (RequestState.ABSENT, BlocksAllocated): (StepPlanner._ignore, RequestState.ABSENT),
    # Allocated before the lookup answered (vLLM got (None, True) and must not allocate; a
    # kv_producer-only engine has no lookup): the hit counts as 0.
    **{(state, BlocksAllocated): (StepPlanner._on_allocated, RequestState.RUNNING) for state in _WAITING},
    (RequestState.RUNNING, BlocksAllocated): (StepPlanner._on_blocks, RequestState.RUNNING),
    (RequestState.PREEMPTED, BlocksAllocated): (StepPlanner._on_blocks, RequestState.RUNNING),
    **{(state, RequestPreempted): (StepPlanner._ignore, state) for state in (RequestState.ABSENT, *_WAITING)},
    (RequestState.RUNNING, RequestPreempted): (StepPlanner._on_preempted, RequestState.PREEMPTED),
    (RequestState.PREEMPTED, RequestPreempted): (StepPlanner._on_preempted, RequestState.PREEMPTED),
    (RequestState.ABSENT, RequestScheduled): (StepPlanner._ignore, RequestState.ABSENT),
    (RequestState.RUNNING, RequestScheduled): (StepPlanner._on_scheduled, RequestState.RUNNING),
    (RequestState.PREEMPTED, RequestScheduled): (StepPlanner._on_scheduled, RequestState.PREEMPTED),
    (RequestState.PREEMPTED, RequestResumed): (StepPlanner._on_scheduled, RequestState.RUNNING),
    **{(state, RequestFinished): (StepPlanner._on_finished, RequestState.ABSENT) for state in _ALL},
}, assigns=True, guards={
    MatchRequest: StepPlanner._classify_match,
    LeaseRenewalDue: StepPlanner._classify_renewal,
    RequestScheduled: StepPlanner._classify_scheduled,
})
"""Pairs not listed (scheduling a request before its blocks were allocated) are counted as
stale events by the dispatcher and change nothing."""


def _every_renewal_runs(timer: Timer) -> bool:
    """The heap's liveness: every renewal is live until due. Whether it still renews anything is
    its row's to say (a stale one, or one of a request allocated or gone, does nothing), and the
    planner's deadline has always been the earliest renewal armed, stale or not."""
    return True


def _specific(kind: type[MatchT], event: MatchRequest) -> MatchT:
    """``event`` as the specific match a guard named (the same fields)."""
    return kind(event.request_id, event.token_ids, event.num_prompt_tokens, event.num_computed_tokens,
                event.cache_salt, event.extras, event.max_load_tokens, event.max_offload_tokens)
