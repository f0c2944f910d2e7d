"""The workers' transport in simulation: a store or retrieve refused ``not_registered`` (a
server that restarted between two heartbeats, or reaped the instance) waits for one
re-registration that core_sm's ``HealthMonitor`` asks for, and is resent once or fails with a
reason -- never hangs (the oracle: no request still parked after quiescence, none resent twice)."""
from __future__ import annotations

import attrs
import pytest

from mpcache.core_sm.health import HealthMonitor, RequestRefused
from mpcache.sim.profiles import PROFILES, Profile
from mpcache.sim.runner import run_scenario
from mpcache.sim.scenario import FaultSpec, Scenario, draw_scenario


def _restart_between_heartbeats(seed: int, at: float) -> Scenario:
    """A server that is down for 20 ms: no heartbeat misses it, the stores sent meanwhile (and
    before the next heartbeat shows the new epoch) are refused not_registered."""
    base = draw_scenario(seed)
    return attrs.evolve(base, faults=(FaultSpec(at, "crash_server", (0, 0.02)),))


def test_a_refused_store_is_resent_once_after_the_registration_or_fails_with_a_reason() -> None:
    result, world = run_scenario(_restart_between_heartbeats(9, 0.6), keep_lines=True)
    assert result.ok, result.violation
    assert world.stats.get("transport_refusals", 0) >= 1
    assert world.stats.get("transport_resends", 0) >= 1
    assert any("register instance" in line and "again" in line for line in result.lines)
    beats = [hb for engine in world.engines for hb in engine.heartbeats]
    assert sum(hb.monitor.stats()["resends"] for hb in beats) == world.stats["transport_resends"]


class ResendForeverMonitor(HealthMonitor):
    """A transport that forgets a request was already resent: it waits on registration after
    registration."""

    def _on_refused(self, event: RequestRefused, now: float, out: list[object]) -> None:  # type: ignore[override]
        super()._on_refused(attrs.evolve(event, retried=False), now, out)  # type: ignore[arg-type]


class ResendForever(Profile):
    name = "resend-forever"
    health_monitor_class = ResendForeverMonitor


def test_a_request_resent_twice_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(PROFILES, ResendForever.name, ResendForever())
    result, _ = run_scenario(_restart_between_heartbeats(9, 0.6), ResendForever.name)
    assert result.violation is not None and result.violation.code == "SAFETY", result.violation
    assert "resent a second time" in result.violation.message


def test_a_resend_after_the_registration_is_not_refused_again() -> None:
    """Was a finding: the server's once-per-op record (core_sm/server_transfers.py
    ``_transfer_once``) kept the original STORE's not_registered refusal and answered the
    byte-identical resend with it. The resend now names the registration it follows, so it is
    another op to that record, and goes through."""
    result, world = run_scenario(_restart_between_heartbeats(9, 0.6), keep_lines=True)
    assert result.ok, result.violation
    resent = {line.split("#")[1].split()[0] for line in result.lines if "resent after the registration" in line}
    assert resent
    refused_again = world.stats.get("transport_refusals", 0) - world.stats.get("transport_resends", 0)
    # every refusal was answered by one resend that then went through
    assert refused_again == 0 and world.stats.get("transport_give_ups", 0) == 0
