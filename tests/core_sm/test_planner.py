"""mpcache.core_sm.planner.StepPlanner: the connector's scheduler side, with no runtime and no server.

A stub lookup client answers ``check`` with a fixed hit and records what the planner asks of it,
so each test states vLLM's calls and the planner's decisions directly."""
from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpcache.core_sm.effects import SendRequest
from mpcache.core_sm.lookup_client import LookupClient, LookupClientConfig
from mpcache.core_sm.messages import (
    Cleanup,
    EndRequest,
    FreeUnusedLeases,
    ReplyReceived,
    SubmitLookup,
    SubmitRetrieve,
    SubmitStore,
    TimerFired,
)
from mpcache.core_sm.planner import (
    TABLE,
    BlocksAllocated,
    LeaseRenewalDue,
    MatchAnswer,
    MatchRequest,
    PlannerConfig,
    RequestFinished,
    RequestPreempted,
    RequestScheduled,
    RequestState,
    ScheduledRequest,
    StepPlan,
    StepPlanner,
    StepScheduled,
)

C, BS = 8, 2  # 4 blocks per chunk


class StubLookups(LookupClient):
    def __init__(self, hit: int | None) -> None:
        super().__init__(LookupClientConfig(num_servers=1, model_name="m", chunk_size=C))
        self.hit = hit
        self.calls: list[Any] = []

    def handle(self, event: Any, now: float) -> list[Any]:
        self.calls.append(event)
        return []

    def check(self, request_id: str) -> int | None:
        return self.hit


def planner(hit: int | None, **kw: Any) -> tuple[StepPlanner, StubLookups]:
    lookups = StubLookups(hit)
    return StepPlanner(PlannerConfig(C, BS, **kw), lookups), lookups


def match(p: StepPlanner, tokens: list[int], computed: int = 0, rid: str = "r", now: float = 0.0) -> MatchAnswer:
    (answer,) = [e for e in p.handle(MatchRequest(rid, tokens, len(tokens), computed), now) if isinstance(e, MatchAnswer)]
    return answer


def step(p: StepPlanner, *scheduled: ScheduledRequest, preempted: tuple[str, ...] = ()) -> StepPlan:
    (plan,) = [e for e in p.handle(StepScheduled(scheduled, preempted), 0.0) if isinstance(e, StepPlan)]
    return plan


def frees(lookups: StubLookups) -> list[tuple[int, int]]:
    return [(e.start, e.end) for e in lookups.calls if isinstance(e, FreeUnusedLeases)]


def test_pending_lookup_answers_none_and_asks_once() -> None:
    p, lookups = planner(None)
    assert match(p, list(range(3 * C))) == MatchAnswer("r", None, True)
    assert match(p, list(range(3 * C))) == MatchAnswer("r", None, True)
    assert [type(e) for e in lookups.calls] == [SubmitLookup]
    assert p.state("r") is RequestState.LOOKING_UP


def test_a_whole_prompt_hit_leaves_the_last_token_to_compute() -> None:
    p, _ = planner(3 * C)
    assert match(p, list(range(3 * C))) == MatchAnswer("r", 3 * C - 1, True)
    assert match(p, list(range(3 * C)), computed=C) == MatchAnswer("r", 2 * C - 1, True)


def test_hit_within_the_engine_prefix_cache_loads_nothing_and_frees_the_hit() -> None:
    p, lookups = planner(C)
    assert match(p, list(range(3 * C)), computed=2 * C) == MatchAnswer("r", 0, False)
    p.handle(BlocksAllocated("r", range(12), 0), 0.0)
    assert frees(lookups) == [(0, C)]
    assert isinstance(lookups.calls[-1], Cleanup)
    assert step(p).retrieves == ()


def test_retrieve_and_the_lease_ranges_around_it() -> None:
    # hit 3 chunks, the engine holds 1 chunk + 1 block, blocks cover only 2 chunks
    p, lookups = planner(3 * C)
    tokens = list(range(4 * C))
    assert match(p, tokens, computed=C + BS) == MatchAnswer("r", 2 * C - BS, True)
    p.handle(BlocksAllocated("r", range(100, 108), 2 * C - BS), 0.0)
    assert frees(lookups) == [(0, C), (2 * C, 3 * C)]
    plan = step(p)
    assert plan.retrieves == (SubmitRetrieve("r", tokens[: 2 * C], C, 2 * C, (104, 105, 106, 107), BS),)
    assert step(p).retrieves == ()  # planned once


def test_stores_follow_completed_prompt_chunks_after_the_hit() -> None:
    p, _ = planner(C)
    tokens = list(range(3 * C + 3))
    match(p, tokens)
    blocks = tuple(range(14))
    p.handle(BlocksAllocated("r", blocks, C - 0), 0.0)
    step(p)  # the retrieve
    plan = step(p, ScheduledRequest("r", C, 2 * C, blocks, True))
    assert plan.stores == (SubmitStore("r", tokens[: 3 * C], C, 3 * C, blocks[4:12]),)
    tokens.extend(range(5 * C))  # decode tokens: not stored by default
    assert step(p, ScheduledRequest("r", 3 * C + 3, 3 * C, None)).stores == ()


def test_preempted_request_recomputes_and_keeps_storing() -> None:
    p, lookups = planner(C)
    tokens = list(range(3 * C))
    match(p, tokens)
    p.handle(BlocksAllocated("r", range(12), C), 0.0)
    step(p)
    plan = step(p, preempted=("r",))
    assert plan.preempted == ("r",) and p.state("r") is RequestState.PREEMPTED
    assert match(p, tokens) == MatchAnswer("r", 0, False)
    assert [type(e) for e in lookups.calls].count(SubmitLookup) == 1
    p.handle(BlocksAllocated("r", range(20, 32), 0), 0.0)
    plan = step(p, ScheduledRequest("r", 0, 3 * C, tuple(range(20, 32)), True))
    assert plan.stores == (SubmitStore("r", tokens, C, 3 * C, range(24, 32)),)
    assert p.stats()["recomputed_after_preemption"] == 1


def test_finish_ends_the_session_and_forgets() -> None:
    p, lookups = planner(None)
    match(p, list(range(C + 1)))
    p.handle(RequestFinished("r"), 0.0)
    assert isinstance(lookups.calls[-1], EndRequest) and p.tracker("r") is None
    p.handle(RequestFinished("never-seen"), 0.0)  # vLLM may finish one it never matched
    assert p.stats()["internal_errors"] == 0


def test_producer_only_never_looks_up_consumer_only_never_stores() -> None:
    p, lookups = planner(2 * C, load=False)
    assert match(p, list(range(3 * C))) == MatchAnswer("r", 0, False)
    assert not [e for e in lookups.calls if isinstance(e, SubmitLookup)]
    p, _ = planner(0, store=False)
    match(p, list(range(3 * C)))
    p.handle(BlocksAllocated("r", range(12), 0), 0.0)
    assert step(p, ScheduledRequest("r", 0, 3 * C, tuple(range(12)), True)).stores == ()


def test_block_size_must_divide_the_chunk() -> None:
    with pytest.raises(ValueError, match="multiple of the engine block size 3"):
        PlannerConfig(C, 3)


def _drive_to(p: StepPlanner, state: RequestState, tokens: list[int]) -> None:
    if state is RequestState.ABSENT:
        return
    match(p, tokens)
    if state in (RequestState.LOOKING_UP, RequestState.MATCHED):
        return
    p.handle(BlocksAllocated("r", range(12), 0), 0.0)
    if state is RequestState.PREEMPTED:
        step(p, preempted=("r",))


EVENTS = [
    MatchRequest("r", list(range(3 * C)), 3 * C, 0),
    BlocksAllocated("r", range(12), 2 * C),
    RequestPreempted("r"),
    LeaseRenewalDue("r", 0.0),
    RequestScheduled(ScheduledRequest("r", 0, 3 * C, tuple(range(12)), True)),
    RequestFinished("r"),
]


@pytest.mark.parametrize("state", list(RequestState))
@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_state_and_event_gives_its_rows_next_state_or_a_counted_stale_event(state: RequestState, event: Any) -> None:
    p, _ = planner(None if state is RequestState.LOOKING_UP else 2 * C)
    _drive_to(p, state, list(range(3 * C)))
    assert p.state("r") is state
    p._dispatch.trace = []
    p.handle(event, 1.0)
    stats = p.stats()
    assert stats["internal_errors"] == 0
    trace, p._dispatch.trace = p._dispatch.trace, None
    if not trace:  # not listed, even once a guard told the event apart
        assert stats["stale_events"] == 1 and p.state("r") is state
    else:
        # every row run (a first match, or a lookup's answer taken, runs the event again) left
        # the request in the one next state its row names, and the next row started there
        assert trace[0][0] is state and p.state("r") is trace[-1][2]
        for (before, ran, after), following in zip(trace, [*trace[1:], None]):
            assert TABLE.rows[(before, ran)].next_state is after
            assert following is None or following[0] is after
    p.check_invariants()


# ------------------------------------------------------------------ leases under a deep queue (F20)


def asks(lookups: StubLookups) -> list[type]:
    """What the planner asked of the lookup client (its timer ticks aside)."""
    return [type(e) for e in lookups.calls if not isinstance(e, TimerFired)]



def test_a_waiting_hit_is_looked_up_again_half_a_ttl_after_its_lookup() -> None:
    p, lookups = planner(2 * C, lease_ttl=10.0)
    tokens = list(range(3 * C))
    assert match(p, tokens) == MatchAnswer("r", 2 * C, True)
    assert p.next_deadline() == 5.0
    p.handle(TimerFired(), 4.9)
    assert asks(lookups) == [SubmitLookup]
    lookups.hit = None  # the renewal is in flight: vLLM is asked to wait
    p.handle(TimerFired(), 5.0)
    assert asks(lookups) == [SubmitLookup, Cleanup, SubmitLookup]
    assert p.state("r") is RequestState.LOOKING_UP and p.stats()["lease_renewals"] == 1
    assert match(p, tokens, now=5.1) == MatchAnswer("r", None, True)
    lookups.hit = C  # the renewal found less resident: that is the hit now
    assert match(p, tokens, now=5.2) == MatchAnswer("r", C, True)
    assert p.next_deadline() == 10.0  # half a TTL after the renewal was sent


def test_a_renewal_due_before_vllm_saw_the_answer_reads_it_then_renews() -> None:
    p, lookups = planner(None, lease_ttl=8.0)
    tokens = list(range(3 * C))
    assert match(p, tokens) == MatchAnswer("r", None, True)
    p.handle(TimerFired(), 4.0)  # still in flight: looked at again an eighth of a TTL later
    assert p.next_deadline() == 5.0 and asks(lookups) == [SubmitLookup]
    lookups.hit = 2 * C  # answered, but a full scheduler has not asked about the request since
    p.handle(TimerFired(), 5.0)
    assert asks(lookups) == [SubmitLookup, Cleanup, SubmitLookup]


def test_old_leases_are_renewed_before_loading_never_loaded() -> None:
    p, lookups = planner(2 * C, lease_ttl=10.0)
    tokens = list(range(3 * C))
    assert match(p, tokens) == MatchAnswer("r", 2 * C, True)  # looked up at 0
    assert match(p, tokens, now=7.5) == MatchAnswer("r", 2 * C, True)  # a quarter TTL left: fine
    # vLLM did not allocate; its next call comes later than the timer would (no TimerFired).
    assert match(p, tokens, now=7.6) == MatchAnswer("r", None, True)
    assert asks(lookups) == [SubmitLookup, Cleanup, SubmitLookup]
    assert match(p, tokens, now=7.7) == MatchAnswer("r", 2 * C, True)  # renewed at 7.6


def test_with_no_renewal_left_the_hit_is_given_up_and_its_leases_freed() -> None:
    p, lookups = planner(2 * C, lease_ttl=10.0, max_lease_renewals=1)
    tokens = list(range(3 * C))
    match(p, tokens)
    p.handle(TimerFired(), 5.0)  # renewal 1 of 1
    assert match(p, tokens, now=5.0) == MatchAnswer("r", 2 * C, True)
    p.handle(TimerFired(), 10.0)  # no renewal left
    assert frees(lookups) == [(0, 2 * C)] and p.stats()["hits_given_up"] == 1
    assert match(p, tokens, now=10.0) == MatchAnswer("r", 0, False)
    p.handle(BlocksAllocated("r", range(12), 0), 10.0)
    assert step(p).retrieves == ()
    p.check_invariants()


def test_allocated_requests_are_not_renewed() -> None:
    p, lookups = planner(2 * C, lease_ttl=10.0)
    tokens = list(range(3 * C))
    match(p, tokens)
    p.handle(BlocksAllocated("r", range(12), 2 * C), 0.0)
    n = len(asks(lookups))
    p.handle(TimerFired(), 5.0)
    assert len(asks(lookups)) == n and p.stats()["lease_renewals"] == 0
    assert p.next_deadline() is None  # the stale entry was popped


def test_lease_ttl_none_never_renews() -> None:
    p, lookups = planner(2 * C, lease_ttl=None)
    assert match(p, list(range(3 * C)), now=1e6) == MatchAnswer("r", 2 * C, True)
    assert p.next_deadline() is None
    with pytest.raises(ValueError):
        PlannerConfig(C, BS, lease_ttl=0.0)


# ------------------------------------------------------------------ random sequences


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_sequences_keep_every_assigned_state_true_to_its_tracker(seed: int) -> None:
    """vLLM's calls in a random order, with a real lookup client answered (or not) at random,
    leases that expire and renewals that run out (and calls vLLM would not make, which the
    table counts as stale): no handler or guard raises, and after every event each tracker's
    assigned state agrees with its data
    (``check_invariants``: a waiting request's hit is known exactly when MATCHED, a preempted
    one holds no blocks) -- what a guard and its row must agree on."""
    rng = random.Random(seed)
    lookups = LookupClient(LookupClientConfig(num_servers=1, model_name="m", chunk_size=C, lookup_timeout=2.0))
    p = StepPlanner(PlannerConfig(C, BS, lease_ttl=rng.choice([2.0, 300.0]), max_lease_renewals=rng.choice([0, 1]),
                                  load=rng.random() < 0.9, lookup_wait=rng.choice([0.0, 0.01])), lookups)
    tokens = {rid: list(range(n)) for rid, n in (("a", 3 * C), ("b", 5 * C + 1), ("c", C + 3))}
    outstanding: list[int] = []
    now = 0.0
    for step_no in range(60):
        now += rng.choice([0.0, 0.01, 0.5, 1.5])
        rid, kind = rng.choice(list(tokens)), rng.random()
        ev: Any
        if kind < 0.25:
            ev = MatchRequest(rid, tokens[rid], len(tokens[rid]), rng.choice([0, 0, BS, C]))
        elif kind < 0.35:
            ev = BlocksAllocated(rid, range(len(tokens[rid]) // BS + 1), rng.choice([0, C]))
        elif kind < 0.5:
            blocks = rng.choice([None, (90 + step_no,)])
            ev = StepScheduled(tuple(ScheduledRequest(r, 0, rng.choice([1, C]), blocks, rng.random() < 0.5)
                                     for r in rng.sample(list(tokens), rng.randint(0, 2))),
                               tuple(rng.sample(list(tokens), rng.choice([0, 0, 1]))))
        elif kind < 0.55:
            ev = RequestFinished(rid)
        elif kind < 0.85 and outstanding:
            corr = outstanding.pop(rng.randrange(len(outstanding)))
            ev = ReplyReceived(0, corr, rng.choice([None, 0, C, 2 * C, 5 * C]))
        else:
            deadline = p.next_deadline()
            now = max(now, deadline) if deadline is not None else now
            ev = TimerFired()
        outstanding += [e.correlation for e in p.handle(ev, now) if isinstance(e, SendRequest)]
        stats = p.stats()
        assert stats["internal_errors"] == 0 and stats["lookup_internal_errors"] == 0
        p.check_invariants()
