"""mpcache.core_sm.health.HealthMonitor: pings, timeouts, backoff and epochs, with no runtime."""
from __future__ import annotations

from typing import Any

import pytest

from mpcache.core_sm.health import (_INPUTS, NOT_REGISTERED, TABLE, Connected, HealthConfig, HealthMonitor, HealthState, HeartbeatDue,
                            HeartbeatReply, HeartbeatTimeout, HeartbeatUnsent, InstancePingRefused,
                            InstanceRegistered, ProbeDue, RequestRefused, SendHeartbeat, SendInstancePing)
from mpcache.core_sm.messages import ServerEpoch, ServerHealth, TimerFired


def monitor(**kw: object) -> HealthMonitor:
    return HealthMonitor(HealthConfig(2, interval=1.0, timeout=2.5, backoff_max=4.0, **kw))  # type: ignore[arg-type]


def test_pings_every_interval_and_a_reply_makes_healthy_once() -> None:
    m = monitor()
    assert m.handle(TimerFired(), 0.0) == [SendHeartbeat(0), SendHeartbeat(1)]
    assert m.next_deadline() == 1.0
    assert m.handle(HeartbeatReply(0, "e1"), 0.1) == [ServerEpoch(0, "e1"), ServerHealth(0, True)]
    assert m.handle(HeartbeatReply(0, "e1"), 0.2) == []
    assert m.healthy(0) and not m.healthy(1)


def test_silence_for_the_timeout_is_unhealthy_then_backoff_doubles_to_the_cap() -> None:
    m = monitor(initially_healthy=True)
    pings: list[float] = []
    now = 0.0
    unhealthy_at = None
    while now < 20.0:
        for effect in m.handle(TimerFired(), now):
            if effect == SendHeartbeat(0):
                pings.append(now)
            if effect == ServerHealth(0, False):
                unhealthy_at = now
        deadline = m.next_deadline()
        assert deadline is not None and deadline > now
        now = deadline
    assert unhealthy_at == 2.5
    gaps = [b - a for a, b in zip(pings, pings[1:])]
    assert gaps[:2] == [1.0, 1.0] and max(gaps) == 4.0 and gaps == sorted(gaps)
    # back: health returns, the interval resets
    assert m.handle(HeartbeatReply(0, 7), now) == [ServerEpoch(0, 7), ServerHealth(0, True)]
    assert m.next_deadline() is not None and m.next_deadline() <= now + 1.0  # type: ignore[operator]


def test_a_restart_between_two_heartbeats_is_a_new_epoch_without_a_health_change() -> None:
    m = monitor(initially_healthy=True)
    m.handle(HeartbeatReply(1, 1), 0.5)
    assert m.handle(HeartbeatReply(1, 2), 1.5) == [ServerEpoch(1, 2)]
    assert m.healthy(1) and m.stats()["epoch_changes"] == 1


def test_a_reply_from_an_unknown_server_is_counted_not_raised() -> None:
    m = monitor()
    assert m.handle(HeartbeatReply(9), 0.0) == [] and m.stats()["stale_replies"] == 1
    assert m.stats()["internal_errors"] == 0


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError):
        HealthConfig(1, interval=3.0, timeout=2.0)


# ---------------------------------------------------------------------------- production's needs

from mpcache.core_sm.health import (  # noqa: E402
    FailPending,
    GiveUp,
    HeartbeatUnsent,
    InstancePingRefused,
    InstanceRegistered,
    InstanceUnregistered,
    Register,
    RegistrationFailed,
    RegistrationRetryDue,
    RegistrationSent,
    RequestRefused,
    Resend,
    SendInstancePing,
)


def one(**kw: object) -> HealthMonitor:
    return HealthMonitor(HealthConfig(1, interval=1.0, timeout=3.0, backoff_max=1.0, probe_interval=0.1,  # type: ignore[arg-type]
                                      fail_pending=True, **kw))


def test_unhealthy_fails_pending_and_probes_fast_then_backs_off() -> None:
    m = one(initially_healthy=True)
    m.handle(HeartbeatReply(0, 1), 0.0)
    # a heartbeat the transport could not send is no verdict (it reconnects by itself)
    assert m.handle(HeartbeatUnsent(0), 0.5) == [] and m.healthy(0) and m.stats()["heartbeats_unsent"] == 1
    assert m.handle(TimerFired(), 3.0) == [ServerHealth(0, False), FailPending(0, "no heartbeat reply for 3 s"),
                                           SendHeartbeat(0)]
    pings, now = [3.0], 3.0
    while now < 12.0:
        now = m.next_deadline()  # type: ignore[assignment]
        if SendHeartbeat(0) in m.handle(TimerFired(), now):
            pings.append(round(now, 3))
    gaps = [round(b - a, 3) for a, b in zip(pings, pings[1:])]
    # silent for the timeout already: the 100 ms probe period doubles from the first probe on, to 1 s
    assert gaps[:4] == [0.2, 0.4, 0.8, 1.0] and set(gaps[4:]) == {1.0}
    assert m.handle(HeartbeatReply(0, 1), now) == [ServerHealth(0, True)]
    # never answered yet (a client starting): 100 ms probes until the timeout has passed
    fresh, now, starts = one(), 0.0, []
    while now < 4.0:
        if SendHeartbeat(0) in fresh.handle(TimerFired(), now):
            starts.append(round(now, 3))
        now = fresh.next_deadline()  # type: ignore[assignment]
    gaps = [round(b - a, 3) for a, b in zip(starts, starts[1:])]
    assert set(gaps[:29]) == {0.1} and max(gaps) > 0.1


def test_registered_instances_are_pinged_with_every_heartbeat_while_healthy() -> None:
    m = one()
    m.handle(HeartbeatReply(0, 1), 0.0)
    m.handle(InstanceRegistered(0, 7), 0.1)
    m.handle(InstanceRegistered(0, 8), 0.1)
    assert m.handle(TimerFired(), 1.0) == [SendHeartbeat(0), SendInstancePing(0, 7), SendInstancePing(0, 8)]
    m.handle(InstanceUnregistered(0, 7), 1.1)
    assert m.handle(TimerFired(), 2.0) == [SendHeartbeat(0), SendInstancePing(0, 8)]
    assert m.instances(0) == (8,)
    # down: only the plain heartbeat probes
    assert ServerHealth(0, False) in m.handle(TimerFired(), 5.0)
    assert [e for e in m.handle(TimerFired(), 6.0) if not isinstance(e, SendHeartbeat)] == []


def test_a_refused_ping_registers_again_once() -> None:
    m = one()
    m.handle(HeartbeatReply(0, 1), 0.0)
    m.handle(InstanceRegistered(0, 7), 0.0)
    assert m.handle(InstancePingRefused(0, 7, "not_registered"), 1.0) == [Register(0, 7)]
    assert m.handle(InstancePingRefused(0, 7, "not_registered"), 1.0) == []  # no longer pinged
    assert m.handle(InstancePingRefused(0, 9, "not_registered"), 1.0) == []  # never registered here
    assert m.handle(InstanceRegistered(0, 7), 1.2) == [] and m.instances(0) == (7,)
    assert m.handle(InstancePingRefused(0, 7, "internal"), 2.0) == [] and m.instances(0) == (7,)
    # a restart: the machines register again (ServerEpoch); no ping meanwhile, so no second Register
    assert m.handle(HeartbeatReply(0, 2), 2.1) == [ServerEpoch(0, 2)] and m.instances(0) == ()
    assert m.handle(TimerFired(), 3.0) == [SendHeartbeat(0)]


def test_not_registered_registers_once_for_all_waiting_requests_then_resends_each_once() -> None:
    m = one()
    m.handle(HeartbeatReply(0, 1), 0.0)
    m.handle(InstanceRegistered(0, 7), 0.0)
    assert m.handle(RequestRefused(0, 7, "a", "not_registered"), 1.0) == [Register(0, 7)]
    assert m.handle(RequestRefused(0, 7, "b", "not_registered"), 1.0) == []  # joins the registration
    assert m.handle(InstanceRegistered(0, 7), 1.1) == [Resend(0, "a"), Resend(0, "b")]
    # refused again after its resend: given up, no second registration for it
    assert m.handle(RequestRefused(0, 7, "a", "not_registered", retried=True), 1.2) == [GiveUp(0, "a")]
    # other errors are the request's own
    assert m.handle(RequestRefused(0, 7, "c", "validation"), 1.3) == [GiveUp(0, "c")]
    assert m.stats()["reregistrations"] == 1 and m.stats()["resends"] == 2


def test_a_failed_registration_or_a_lost_server_gives_up_what_waited() -> None:
    m = one()
    m.handle(HeartbeatReply(0, 1), 0.0)
    assert m.handle(RequestRefused(0, 7, "a", "not_registered"), 0.5) == [Register(0, 7)]
    assert m.handle(RegistrationFailed(0, 7), 0.6) == [GiveUp(0, "a")]
    assert m.handle(RequestRefused(0, 7, "b", "not_registered"), 0.7) == [Register(0, 7)]
    assert m.handle(TimerFired(), 3.5) == [ServerHealth(0, False), FailPending(0, "no heartbeat reply for 3 s"),
                                           GiveUp(0, "b"), SendHeartbeat(0)]
    assert m.handle(RequestRefused(0, 7, "c", "not_registered"), 3.6) == [GiveUp(0, "c")]  # unhealthy
    m.handle(HeartbeatReply(0, 1), 3.7)
    assert m.handle(RequestRefused(0, 7, "d", "not_registered"), 3.8) == [Register(0, 7)]  # not stuck


def test_waiting_requests_are_bounded() -> None:
    m = one(max_waiting=2)
    m.handle(HeartbeatReply(0, 1), 0.0)
    effects = [m.handle(RequestRefused(0, 7, i, "not_registered"), 0.5) for i in range(3)]
    assert effects == [[Register(0, 7)], [], [GiveUp(0, 2)]]


# ---------------------------------------------------------------------------------------------- who registers again


def test_the_monitor_alone_registers_again_on_epoch_recovery_and_refusal() -> None:
    """The one machine that registers again: a refusal (even while the node's own registration
    is under way), the first epoch learned after a registration went out (even one under way), a
    new epoch, a recovery."""
    m = one()
    m.handle(HeartbeatReply(0), 0.0)  # healthy, epoch not known yet
    assert m.handle(RegistrationSent(0, 7), 0.0) == []
    # refused while the node's registration is under way: it may be lost, register again now
    assert m.handle(RequestRefused(0, 7, "a", "not_registered"), 0.1) == [Register(0, 7)]
    assert m.handle(HeartbeatReply(0, "e1"), 0.2) == [ServerEpoch(0, "e1"), Register(0, 7)]
    assert m.handle(InstanceRegistered(0, 7, 4), 0.3) == [Resend(0, "a", 4)]
    assert m.handle(HeartbeatReply(0, "e1"), 0.4) == []
    assert m.handle(HeartbeatReply(0, "e2"), 0.5) == [ServerEpoch(0, "e2"), Register(0, 7)]
    assert m.instances(0) == ()  # pinged again once acknowledged
    m.handle(InstanceRegistered(0, 7, 5), 0.6)
    m.handle(TimerFired(), 3.6)  # silent: unhealthy
    assert m.handle(HeartbeatReply(0, "e2"), 4.0) == [ServerHealth(0, True), Register(0, 7)]
    st = m.stats()
    assert (st["registrations_on_epoch"], st["registrations_on_recovery"], st["reregistrations"]) == (2, 1, 4)
    m.handle(InstanceUnregistered(0, 7), 4.1)
    assert m.handle(HeartbeatReply(0, "e3"), 4.2) == [ServerEpoch(0, "e3")]  # forgotten: never again


def test_a_failed_registration_goes_again_with_bounded_backoff_while_healthy() -> None:
    m = HealthMonitor(HealthConfig(1, interval=1.0, timeout=100.0, backoff_max=1.0, initially_healthy=True,
                                   registration_retry=0.5, registration_retry_max=2.0))
    m.handle(RegistrationSent(0, 7), 0.0)
    now, delays = 0.0, []
    for _ in range(4):
        m.handle(RegistrationFailed(0, 7), now)
        due = min(at for at in m._servers[0].retry_at.values())
        delays.append(due - now)
        assert (m.next_deadline() or 0.0) <= due
        now = due
        assert Register(0, 7) in m.handle(TimerFired(), now)
    assert delays == [0.5, 1.0, 2.0, 2.0] and m.stats()["registration_retries"] == 4
    m.handle(InstanceRegistered(0, 7, 1), now)
    m.handle(RequestRefused(0, 7, "a", "not_registered"), now)
    m.handle(RegistrationFailed(0, 7), now)  # a success resets the backoff
    assert m._servers[0].retry_at == {7: now + 0.5}
    m2 = one()
    m2.handle(HeartbeatReply(0, 1), 0.0)
    m2.handle(RegistrationSent(0, 7), 0.0)
    m2.handle(TimerFired(), 3.0)  # unhealthy
    m2.handle(RegistrationFailed(0, 7), 3.1)
    assert m2._servers[0].retry_at == {}  # no retry while unhealthy: the recovery registers


# ---------------------------------------------------------------------------------------------- the table

WALK_INPUTS = [*_INPUTS, TimerFired]
TIMERS = (HeartbeatDue, HeartbeatTimeout, ProbeDue, RegistrationRetryDue)


def _event(event_type: type, server: int, now: float) -> Any:
    if event_type is HeartbeatReply:
        return HeartbeatReply(server, 2)
    if event_type is HeartbeatUnsent or event_type is Connected:
        return event_type(server)
    if event_type is InstancePingRefused:
        return InstancePingRefused(server, 7, NOT_REGISTERED)
    if event_type is RequestRefused:
        return RequestRefused(server, 7, "r2", NOT_REGISTERED)
    if event_type is TimerFired:
        return TimerFired()
    return event_type(server, 7)


def _in_state(state: HealthState) -> tuple[HealthMonitor, int]:
    """A two-server monitor, server 0 in ``state`` (ABSENT: the events name server 5), with an
    acknowledged instance, a request waiting on another's re-registration and a third's failed
    registration waiting on its backoff."""
    m = HealthMonitor(HealthConfig(2, interval=1.0, timeout=2.5, backoff_max=4.0, initially_healthy=True,
                                   fail_pending=True))
    m.handle(HeartbeatReply(0, 1), 0.0)
    m.handle(InstanceRegistered(0, 7), 0.0)
    m.handle(RequestRefused(0, 8, "r1", NOT_REGISTERED), 0.0)
    m.handle(RegistrationSent(0, 9), 0.0)
    m.handle(RegistrationFailed(0, 9), 0.0)  # instance 9 registers again at 0.5
    if state is HealthState.PROBING:
        m.handle(TimerFired(), 2.5)
    assert m.state(0) is (HealthState.PROBING if state is HealthState.PROBING else HealthState.HEALTHY)
    return m, 5 if state is HealthState.ABSENT else 0


def _times(state: HealthState) -> tuple[float, ...]:
    """When the input comes: before the timeout (a ping due), at and well past it."""
    return (3.0, 6.0, 30.0) if state is HealthState.PROBING else (1.0, 2.6, 6.0, 30.0)


@pytest.mark.parametrize("state", list(HealthState))
@pytest.mark.parametrize("event_type", WALK_INPUTS)
def test_every_state_times_every_input(state: HealthState, event_type: type) -> None:
    """Each pair runs its row (or, for a pair the table does not list, nothing runs and nothing
    changes), leaves the server in one of the row's next states, and never counts a violation."""
    for now in _times(state):
        m, server = _in_state(state)
        m._table.trace = []
        effects = m.handle(_event(event_type, server, now), now)
        stats = m.stats()
        assert stats["table_violations"] == 0 and stats["internal_errors"] == 0 and stats["stale_events"] == 0
        for before, ran, after in m._table.trace:
            assert after in TABLE.rows[(before, ran)].next_states
        if event_type is TimerFired:
            assert all(ran in TIMERS for _b, ran, _a in m._table.trace)
            if state is HealthState.HEALTHY and now >= 2.5:
                assert effects[0] == ServerHealth(0, False) and m.state(0) is HealthState.PROBING
        elif (state, event_type) in TABLE.rows:
            assert m._table.trace == [(state, event_type, m.state(server))]
        else:
            assert m._table.trace == [] and effects == []
        if state is HealthState.ABSENT and event_type is not TimerFired:
            assert effects == [] and stats["stale_replies"] == 1


def test_every_row_runs_and_an_unlisted_timer_pair_changes_nothing() -> None:
    ran: set[tuple[HealthState, type]] = set()
    for state in HealthState:
        for event_type in WALK_INPUTS:
            for now in _times(state):
                m, server = _in_state(state)
                m._table.trace = []
                m.handle(_event(event_type, server, now), now)
                ran |= {(b, e) for b, e, _a in m._table.trace}
    assert ran == set(TABLE.rows), set(TABLE.rows) - ran
    for state in (HealthState.HEALTHY, HealthState.PROBING):
        for timer in TIMERS:
            if (state, timer) in TABLE.rows:
                continue
            m, server = _in_state(state)
            before = (m.state(server), m.next_deadline(), m.instances(server))
            out: list[Any] = []
            due = timer(server, 9) if timer is RegistrationRetryDue else timer(server)
            assert not m._table.run(due, 9.0, out) and out == []
            assert (m.state(server), m.next_deadline(), m.instances(server)) == before
            assert m.stats()["stale_events"] == 1


def test_a_ping_due_with_the_timeout_is_a_probe() -> None:
    """The timeout runs before the ping of the same server, so the ping is a probe (no instance
    pings) and, the server being silent for the timeout already, its period doubles."""
    m = HealthMonitor(HealthConfig(1, interval=1.0, timeout=2.0, backoff_max=4.0, initially_healthy=True))
    m.handle(InstanceRegistered(0, 3), 0.0)
    assert m.handle(TimerFired(), 0.0) == [SendHeartbeat(0), SendInstancePing(0, 3)]
    m.handle(TimerFired(), 1.0)
    assert m.handle(TimerFired(), 2.0) == [ServerHealth(0, False), SendHeartbeat(0)]
    assert m.next_deadline() == 4.0


# ---------------------------------------------------------------------------------------------- Connected

def _backed_off() -> tuple[HealthMonitor, float]:
    """A one-server monitor whose server went silent and whose probes backed off to the cap."""
    m = one(initially_healthy=True)
    m.handle(HeartbeatReply(0, 1), 0.0)
    now = 0.0
    while m.healthy(0) or m.period(0) < 1.0:
        now = m.next_deadline()  # type: ignore[assignment]
        m.handle(TimerFired(), now)
    return m, now


def test_a_connection_back_to_an_unhealthy_server_probes_it_now_and_resets_the_backoff() -> None:
    m, now = _backed_off()
    assert m.state(0) is HealthState.PROBING and m.period(0) == 1.0 and m.next_deadline() == now + 1.0
    at = now + 0.3
    assert m.handle(Connected(0), at) == [SendHeartbeat(0)]
    assert m.period(0) == 0.1 and m.next_deadline() == at + 0.1
    assert m.stats()["connects"] == 1
    # the probe's reply is the verdict, as for any probe
    assert m.handle(HeartbeatReply(0, 2), at + 0.01) == [ServerEpoch(0, 2), ServerHealth(0, True)]
    assert m.period(0) == 1.0


def test_a_connection_that_brings_no_reply_backs_off_again_from_the_probe_period() -> None:
    m, now = _backed_off()
    m.handle(Connected(0), now + 0.3)
    pings, t = [], now + 0.3
    while len(pings) < 5:
        t = m.next_deadline()  # type: ignore[assignment]
        if SendHeartbeat(0) in m.handle(TimerFired(), t):
            pings.append(round(t - now - 0.3, 3))
    assert pings == [0.1, 0.3, 0.7, 1.5, 2.5] and not m.healthy(0)


def test_a_connection_to_a_healthy_server_sends_one_heartbeat_and_keeps_the_schedule() -> None:
    m = one(initially_healthy=True)
    m.handle(HeartbeatReply(0, 1), 0.0)
    m.handle(InstanceRegistered(0, 7), 0.0)
    m.handle(TimerFired(), 0.0)
    before = m.next_deadline()
    # no instance pings: this heartbeat only asks for the (maybe new) epoch
    assert m.handle(Connected(0), 0.4) == [SendHeartbeat(0)]
    assert m.next_deadline() == before and m.healthy(0) and m.period(0) == 1.0
    assert m.handle(HeartbeatReply(0, 2), 0.41) == [ServerEpoch(0, 2)]


def test_a_connection_to_an_unknown_server_is_counted_not_raised() -> None:
    m = one()
    assert m.handle(Connected(3), 0.0) == [] and m.stats()["stale_replies"] == 1
    assert m.stats()["internal_errors"] == 0
