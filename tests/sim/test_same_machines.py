"""The simulator drives the connector's own machines: the class the simulated scheduler and
workers run is the class ``MPCacheConnector``'s adapters build (not a model of it)."""
from __future__ import annotations

import typing

import mpcache.runtime_zmq.adapters as adapters
from mpcache.core_sm.planner import StepPlanner
from mpcache.core_sm.transfer_client import TransferClient
from mpcache.sim.engine import LOOKUP, tc_name
from mpcache.sim.runner import run_scenario
from mpcache.sim.scenario import draw_scenario
from mpcache.sim.vllm_scheduler import SchedulerModel


def test_the_simulator_drives_the_class_the_connector_drives() -> None:
    # what the connector's scheduler shell holds, and what its worker shell builds
    assert typing.get_type_hints(adapters.SchedulerAdapter.__init__)["machine"] is StepPlanner
    assert adapters.StepPlanner is StepPlanner and adapters.TransferClient is TransferClient
    result, world = run_scenario(draw_scenario(3))
    assert result.ok, result.violation
    for engine in world.engines:
        assert engine.sched is not None and type(engine.sched.machines[LOOKUP]) is StepPlanner
        # vLLM's scheduler is the one model the adapter tests drive the production adapter with
        # (tests/runtime_zmq/adapter_driver.py; test_adapters.py checks that side).
        assert type(engine.model) is SchedulerModel
        for worker in engine.workers:
            assert worker.node is not None
            assert {type(worker.node.machines[tc_name(s)]) for s in range(engine.num_servers)} == {TransferClient}
    planned = sum(e.sched.machines[LOOKUP].stats()["stores_planned"] for e in world.engines if e.sched)
    assert planned > 0, "the world never asked the planner for a store"


def test_the_simulator_drives_the_health_monitor_the_zmq_client_drives() -> None:
    from mpcache.core_sm.health import HealthMonitor
    from mpcache.core_sm.server_link import ServerLink
    from mpcache.runtime_zmq.client import MPCacheClient

    # what the production client builds (a socket needs no server to exist)
    client = MPCacheClient("tcp://127.0.0.1:1", wait_connected=False, connect_timeout=0.2)
    try:
        assert type(client.link) is ServerLink and type(client.link.monitor) is HealthMonitor
    finally:
        client.close()
    result, world = run_scenario(draw_scenario(3))
    assert result.ok, result.violation
    beats = [links for engine in world.engines for links in engine.links]
    assert beats and {type(m) for links in beats for m in links.monitors} == {HealthMonitor}
    assert sum(m.stats()["heartbeats_sent"] for links in beats for m in links.monitors) > 0
