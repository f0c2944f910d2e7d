"""Instance liveness in simulation (F19, LMCache #4715): a worker's heartbeats name its
instance, so a live idle instance stays registered however long it is idle; one that falls
silent is reaped, and a live one reaped while cut off registers again."""
from __future__ import annotations

import attrs

from mpcache.sim.profiles import PROFILES
from mpcache.sim.runner import run_scenario
from mpcache.sim.scenario import FaultSpec, draw_scenario, server_name, worker_name


def _reaps(lines: tuple[str, ...]) -> list[str]:
    return [line for line in lines if line.rstrip().endswith("reaped") and " instance " in line]


def test_idle_live_instances_stay_registered_and_silent_ones_are_reaped() -> None:
    ttl = PROFILES["default"].instance_ttl
    base = draw_scenario(0)
    # Engine 0 crashes as the safety phase ends: its instances fall silent and are reaped. The
    # others idle, live, for longer than the TTL (until the world shuts down and they unregister,
    # as the connector's close does): idleness alone never reaped one.
    crash = FaultSpec(base.config.safety_duration - 0.1, "crash_engine", (0,))
    scenario = attrs.evolve(base, faults=(*base.faults, crash))
    assert base.config.num_engines >= 2
    result, world = run_scenario(scenario, "default", keep_lines=True)
    assert result.ok, result.violation
    assert world.stats["instances_reaped"] >= 1
    assert world.stats["instances_reaped"] == len(_reaps(result.lines))
    assert all(" instance 1 reaped" in line for line in _reaps(result.lines)), _reaps(result.lines)
    assert ttl is not None and ttl < 10.0
    bad, _ = run_scenario(scenario, "idle-reap")
    assert bad.violation is not None and bad.violation.code == "F19", bad.violation


def test_a_live_worker_reaped_while_cut_off_registers_again() -> None:
    ttl = PROFILES["default"].instance_ttl
    assert ttl is not None
    base = draw_scenario(3)
    # Cut after the worker's first heartbeat (liveness is watched from then on), for 2 TTLs.
    cut = FaultSpec(1.5, "partition", (worker_name(0, 0), server_name(0), False, 2 * ttl))
    heal = 2 * ttl + 3.0
    scenario = attrs.evolve(base, config=attrs.evolve(base.config, safety_duration=heal), faults=(cut,))
    result, world = run_scenario(scenario, "default", keep_lines=True)
    reaped_while_cut = [line for line in _reaps(result.lines)
                        if "server0" in line and "instance 1 reaped" in line and float(line.split()[0]) < heal]
    assert reaped_while_cut, "the partition outlasted instance_ttl: server0 must reap the worker"
    # The oracles passed, among them: registered with every server after heal (F13/F19).
    assert result.ok, result.violation
    # The profile whose worker never registers again is caught on the same world.
    bad, _ = run_scenario(scenario, "idle-reap")
    assert bad.violation is not None and bad.violation.code == "F19", bad.violation
