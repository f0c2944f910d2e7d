"""The workers' transport in simulation -- core_sm's ServerLink, the machine the production
client runs: a store or retrieve refused ``not_registered`` (a server that restarted between two
heartbeats, or reaped the instance) waits for one re-registration that its ``HealthMonitor`` asks
for, and is resent once or fails with a reason -- never hangs (the oracle: no request still
parked after quiescence, none resent twice)."""
from __future__ import annotations

from typing import Any

import attrs
import pytest

from mpcache.core_sm.effects import Effect, Reply
from mpcache.core_sm.health import HealthMonitor, RequestRefused
from mpcache.core_sm.messages import InstanceAttached, RegisterInstance
from mpcache.core_sm.server import LookupServer
from mpcache.core_sm.server_transfers import TransferMachine
from mpcache.sim.net import NetConfig
from mpcache.sim.profiles import PROFILES, Profile
from mpcache.sim.runner import run_scenario
from mpcache.sim.scenario import FaultSpec, RequestSpec, Scenario, WorldConfig, draw_scenario


# A drawn world where a store is sent while the server is down, refused not_registered, and resent
# after the registration (seeds 10, 26, 29, 42, 48 of 0-60 refuse one; 29 is the first whose
# resend a server without registration ids refuses again). The draw moved when the worlds gained
# KV-cache groups and L2 stalls.
SEED = 29


def _restart_between_heartbeats(seed: int, at: float) -> Scenario:
    """A server that is down for 20 ms: no heartbeat misses it, the stores sent meanwhile (and
    before the next heartbeat shows the new epoch) are refused not_registered."""
    base = draw_scenario(seed)
    return attrs.evolve(base, faults=(FaultSpec(at, "crash_server", (0, 0.02)),))


def test_a_refused_store_is_resent_once_after_the_registration_or_fails_with_a_reason() -> None:
    result, world = run_scenario(_restart_between_heartbeats(SEED, 0.9), keep_lines=True)
    assert result.ok, result.violation
    assert world.stats.get("transport_refusals", 0) >= 1
    assert world.stats.get("transport_resends", 0) >= 1
    assert any("register instance" in line and "again" in line for line in result.lines)
    beats = [links for engine in world.engines for links in engine.transport.links]
    assert sum(m.stats()["resends"] for links in beats for m in links.monitors) == world.stats["transport_resends"]


class ResendForeverMonitor(HealthMonitor):
    """A transport that forgets a request was already resent: it waits on registration after
    registration."""

    def _on_refused(self, event: RequestRefused, now: float, out: list[object]) -> None:  # type: ignore[override]
        super()._on_refused(attrs.evolve(event, retried=False), now, out)  # type: ignore[arg-type]


class NoRegistrationIdServer(LookupServer):
    """A server older than registration ids (``register_instance`` answers nil): a resend goes
    unchanged, so it gets its original's remembered refusal again."""

    def handle(self, event: Any, now: float) -> list[Effect]:
        effects = super().handle(event, now)
        if type(event) in (RegisterInstance, InstanceAttached):  # a server-driven one is answered on attach
            return [attrs.evolve(e, result=None) if type(e) is Reply else e for e in effects]
        return effects


class ResendForever(Profile):
    name = "resend-forever"
    health_monitor_class = ResendForeverMonitor
    server_class = NoRegistrationIdServer


def test_a_request_resent_twice_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(PROFILES, ResendForever.name, ResendForever())
    result, _ = run_scenario(_restart_between_heartbeats(SEED, 0.9), ResendForever.name)
    assert result.violation is not None and result.violation.code == "SAFETY", result.violation
    assert "resent a second time" in result.violation.message


def test_a_resend_after_the_registration_is_not_refused_again() -> None:
    """Was a finding: the server's once-per-op record (core_sm/server_transfers.py
    ``_transfer_once``) kept the original STORE's not_registered refusal and answered the
    byte-identical resend with it. The resend now names the registration it follows, so it is
    another op to that record, and goes through."""
    result, world = run_scenario(_restart_between_heartbeats(SEED, 0.9), keep_lines=True)
    assert result.ok, result.violation
    resent = {line.split("#")[1].split()[0] for line in result.lines if "resent after the registration" in line}
    assert resent
    refused_again = world.stats.get("transport_refusals", 0) - world.stats.get("transport_resends", 0)
    # every refusal was answered by one resend that then went through
    assert refused_again == 0 and world.stats.get("transport_give_ups", 0) == 0


class ResendAsOriginalServer(LookupServer):
    """The once-per-op record keyed as before the fix (a resend's registration left out): the
    resend gets its original's remembered refusal."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.transfers._named_registration = lambda ev: None  # type: ignore[method-assign]


class ResendAsOriginal(Profile):
    name = "resend-as-original"
    server_class = ResendAsOriginalServer


def test_a_resend_refused_by_its_originals_record_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    assert hasattr(TransferMachine, "_named_registration")
    monkeypatch.setitem(PROFILES, ResendAsOriginal.name, ResendAsOriginal())
    result, _ = run_scenario(_restart_between_heartbeats(SEED, 0.9), ResendAsOriginal.name)
    assert result.violation is not None and result.violation.code == "LIVENESS", result.violation
    assert "still the instance's, was refused not_registered again" in result.violation.message


def test_a_duplicated_refusal_of_a_parked_store_never_reaches_its_machine() -> None:
    """Found by tests/sim/test_properties.py once resends went through: the network duplicated a
    STORE refused not_registered, and the second refusal reached the worker's machine while the
    transport still held the store for its resend -- the machine took the refusal as the answer,
    vLLM freed the blocks, and the resend then copied them (F10). core_sm's ServerLink, every
    node's transport in both runtimes, drops another reply to a parked request (and its resend
    has a new uid)."""
    cfg = WorldConfig(num_servers=1, num_engines=2, tp=1, chunk_size=8, block_size=4, blocks_per_worker=96,
                      l1_slots=64, lease_ttl=10.0, l2_enabled=False, copy_fail_p=0.0, server_workers=1,
                      lookup_wait=0.0, sync_load_max_tokens=0, engine_driven=False, adversary=False,
                      store_threshold=0, net=NetConfig(min_delay=0.0005, mean_delay=0.002, drop_p=0.05, dup_p=0.2,
                                                       reorder_p=0.5, reorder_delay=0.05, capacity=256),
                      safety_duration=1.0, liveness_bound=10.0, chain_seed=0)
    request = RequestSpec(engine=0, request_id="r0", arrival=0.0, prompt=(1,) * 8, apc_blocks=0)
    result, world = run_scenario(Scenario(seed=-1, config=cfg, requests=(request,), faults=(), net_seed=0),
                                 keep_lines=True)
    assert result.ok, result.violation
    assert world.stats.get("transport_resends", 0) == 1
    assert any("reply after its refusal dropped" in line for line in result.lines)
