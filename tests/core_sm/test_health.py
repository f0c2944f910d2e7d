"""core_sm.health.HealthMonitor: pings, timeouts, backoff and epochs, with no runtime."""
from __future__ import annotations

import pytest

from core_sm.health import HealthConfig, HealthMonitor, HeartbeatReply, SendHeartbeat
from core_sm.messages import ServerEpoch, ServerHealth, TimerFired


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
