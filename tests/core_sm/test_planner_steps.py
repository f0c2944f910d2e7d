"""mpcache.core_sm.planner: the settings that cut the steps a hit waits -- the lookup wait
(``MatchAnswer.wait_until``) and synchronous loads (``load_async=False``, ``StepPlan.sync_loads``)."""
from __future__ import annotations

import pytest

from mpcache.core_sm.planner import BlocksAllocated, MatchAnswer, MatchRequest, PlannerConfig, default_sync_load_max_tokens

from test_planner import BS, C, planner, step


def _match(p, tokens, now, computed=0):  # type: ignore[no-untyped-def]
    (answer,) = [e for e in p.handle(MatchRequest("r", tokens, len(tokens), computed), now) if isinstance(e, MatchAnswer)]
    return answer


def test_a_pending_lookup_may_be_waited_for_until_the_deadline_of_the_first_match() -> None:
    p, _ = planner(None, lookup_wait=0.004)
    tokens = list(range(4 * C))
    first = _match(p, tokens, 10.0)
    assert (first.tokens, first.wait_until) == (None, pytest.approx(10.004))
    again = _match(p, tokens, 10.003)  # asking again does not move the deadline
    assert again.wait_until == pytest.approx(10.004)


def test_without_a_lookup_wait_a_pending_lookup_is_answered_at_once() -> None:
    p, _ = planner(None)
    assert _match(p, list(range(4 * C)), 1.0).wait_until is None


def test_a_small_load_is_synchronous_and_named_in_the_plan() -> None:
    p, _ = planner(4 * C, sync_load_max_tokens=4 * C)
    tokens = list(range(4 * C + 3))
    answer = _match(p, tokens, 0.0)
    assert (answer.tokens, answer.load_async) == (4 * C, False)
    p.handle(BlocksAllocated("r", tuple(range(len(tokens) // BS + 1)), 4 * C), 0.0)
    plan = step(p)
    assert [r.request_id for r in plan.retrieves] == ["r"] and plan.sync_loads == ("r",) and plan.retrieves[0].synchronous


def test_a_load_over_the_limit_stays_asynchronous() -> None:
    p, _ = planner(4 * C, sync_load_max_tokens=4 * C - 1)
    tokens = list(range(4 * C + 3))
    answer = _match(p, tokens, 0.0)
    assert (answer.tokens, answer.load_async) == (4 * C, True)
    p.handle(BlocksAllocated("r", tuple(range(4 * C // BS)), 4 * C), 0.0)
    plan = step(p)
    assert len(plan.retrieves) == 1 and plan.sync_loads == () and not plan.retrieves[0].synchronous


@pytest.mark.parametrize(("cpu_engine", "load_async"), [(True, False), (False, True)])
def test_by_default_a_cpu_engine_loads_synchronously_and_a_gpu_engine_asynchronously(cpu_engine: bool, load_async: bool) -> None:
    p, _ = planner(4 * C, cpu_engine=cpu_engine)
    answer = _match(p, list(range(4 * C + 3)), 0.0)
    assert (answer.tokens, answer.load_async) == (4 * C, load_async)


@pytest.mark.parametrize("cpu_engine", [True, False])
def test_a_set_sync_load_limit_overrides_the_device_default(cpu_engine: bool) -> None:
    assert PlannerConfig(C, BS, cpu_engine=cpu_engine, sync_load_max_tokens=C).sync_load_max_tokens == C
    assert PlannerConfig(C, BS, cpu_engine=cpu_engine, sync_load_max_tokens=0).sync_load_max_tokens == 0
    assert default_sync_load_max_tokens(cpu_engine) == PlannerConfig(C, BS, cpu_engine=cpu_engine).sync_load_max_tokens


def test_the_settings_are_bounded() -> None:
    with pytest.raises(ValueError):
        PlannerConfig(C, BS, lookup_wait=2.0)
    with pytest.raises(ValueError):
        PlannerConfig(C, BS, sync_load_max_tokens=-1)


def test_one_scheduling_pass_waits_at_most_the_lookup_wait_in_all() -> None:
    p, _ = planner(None, lookup_wait=0.004)
    a, b = list(range(4 * C)), list(range(1, 4 * C + 1))
    (first,) = [e for e in p.handle(MatchRequest("a", a, len(a), 0), 10.0) if isinstance(e, MatchAnswer)]
    (second,) = [e for e in p.handle(MatchRequest("b", b, len(b), 0), 10.003) if isinstance(e, MatchAnswer)]
    assert first.wait_until == pytest.approx(10.004)
    assert second.wait_until == pytest.approx(10.004)  # the pass's budget, not b's own 5 ms
    step(p)  # the next pass has a budget of its own; b's own wait is over by then
    (again,) = [e for e in p.handle(MatchRequest("b", b, len(b), 0), 20.0) if isinstance(e, MatchAnswer)]
    assert again.wait_until is not None and again.wait_until < 20.0


# ---------------------------------------------------------------- the idle engine's longer wait


def test_an_idle_engine_waits_the_idle_budget_for_a_pending_lookup() -> None:
    p, _ = planner(None, lookup_wait=0.005, lookup_wait_idle=0.05)
    assert p.engine_idle()
    tokens = list(range(4 * C))
    assert _match(p, tokens, 10.0).wait_until == pytest.approx(10.05)
    assert _match(p, tokens, 10.04).wait_until == pytest.approx(10.05)  # one budget per pass
    step(p)  # nothing ran: still idle, and the next pass may wait again (no empty-step spin)
    assert _match(p, tokens, 10.06).wait_until == pytest.approx(10.11)


def test_a_busy_engine_keeps_the_short_wait() -> None:
    from mpcache.core_sm.planner import ScheduledRequest

    p, lookups = planner(4 * C, lookup_wait=0.005, lookup_wait_idle=0.05)
    running = list(range(4 * C + 3))
    p.handle(MatchRequest("run", running, len(running), 0), 0.0)
    p.handle(BlocksAllocated("run", tuple(range(len(running) // BS + 1)), 4 * C), 0.0)
    assert not p.engine_idle()  # a request holds blocks
    step(p, ScheduledRequest("run", 0, len(running), tuple(range(len(running) // BS + 1)), True))
    lookups.hit = None
    tokens = list(range(1, 4 * C + 1))
    (answer,) = [e for e in p.handle(MatchRequest("new", tokens, len(tokens), 0), 10.0) if isinstance(e, MatchAnswer)]
    assert answer.wait_until == pytest.approx(10.005)
    # the running request finishes, but the last step still ran it: busy until a step runs nothing
    step(p, ScheduledRequest("run", 4 * C, 3, None, False))
    from mpcache.core_sm.planner import RequestFinished

    p.handle(RequestFinished("run"), 11.0)
    assert not p.engine_idle()
    step(p)
    assert p.engine_idle()


def test_an_untracked_request_in_the_last_step_makes_the_engine_busy() -> None:
    from mpcache.core_sm.planner import ScheduledRequest

    p, _ = planner(None, lookup_wait=0.005, lookup_wait_idle=0.05)
    step(p, ScheduledRequest("unkeyed", 0, 16, (0,), True))  # vLLM ran a request mpcache skipped
    assert not p.engine_idle()
    assert _match(p, list(range(4 * C)), 10.0).wait_until == pytest.approx(10.005)


def test_the_idle_budget_never_shortens_the_wait_and_is_bounded() -> None:
    p, _ = planner(None, lookup_wait=0.005, lookup_wait_idle=0.001)
    assert _match(p, list(range(4 * C)), 10.0).wait_until == pytest.approx(10.005)
    with pytest.raises(ValueError):
        PlannerConfig(C, BS, lookup_wait_idle=1.5)
