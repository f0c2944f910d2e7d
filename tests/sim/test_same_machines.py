"""The simulator drives the connector's own machines: the class the simulated scheduler and
workers run is the class ``MPCacheConnector``'s adapters build (not a model of it)."""
from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

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
    scenario = draw_scenario(3)
    assert len(scenario.config.kv_groups) > 1  # a hybrid model's engine: production's groups path
    result, world = run_scenario(scenario)
    assert result.ok, result.violation
    for engine in world.engines:
        assert engine.sched is not None and type(engine.sched.machines[LOOKUP]) is StepPlanner
        # the planner plans the groups' joined ops itself, as it does in the connector
        config = engine.planner().config
        assert config.kv_groups == scenario.config.kv_groups and config.cpu_engine == scenario.config.cpu_engine
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
    beats = [links for engine in world.engines for links in engine.transport.links]
    assert beats and {type(m) for links in beats for m in links.monitors} == {HealthMonitor}
    assert sum(m.stats()["heartbeats_sent"] for links in beats for m in links.monitors) > 0


def test_the_simulator_builds_its_configs_as_the_connector_does() -> None:
    """Equal classes are not enough: the configs too. The connector and the simulator build the
    lookup client's config and every link's with core_sm's builders; the simulated world differs
    only where it names a variation."""
    import attrs

    from mpcache.core_sm.client_config import lookup_client_config
    from mpcache.runtime_zmq.adapters import ConnectorConfig
    from mpcache.runtime_zmq.client import MPCacheClient
    from mpcache.sim.engine import MODEL
    from mpcache.sim.profiles import PROFILES
    from mpcache.sim.transport import sim_link_config

    world = draw_scenario(3).config
    assert world.lookup_answer_in_ack  # a drawn variation: the connector's key names it
    connector = ConnectorConfig(lookup_answer_in_ack=world.lookup_answer_in_ack)
    production = lookup_client_config(connector.settings(), num_servers=world.num_servers, model_name=MODEL,
                                      world_size=world.tp, chunk_size=world.chunk_size)
    simulated = PROFILES["default"].make_lookup_client(world).config
    assert simulated.use_wait and production.use_wait  # honest clients wait, as production's do
    assert attrs.evolve(simulated, result_ttl=production.result_ttl) == production  # named: a minute's results
    client = MPCacheClient("tcp://127.0.0.1:1", request_timeout=connector.request_timeout_s, wait_connected=False,
                           connect_timeout=0.2)
    try:
        production_link = client.link.config
    finally:
        client.close()
    simulated_link = sim_link_config(world)
    # named: the world's heartbeat timeout and backoff, and an engine that starts with its
    # servers up (the connector waits for them before it serves)
    named = attrs.evolve(simulated_link.health, timeout=production_link.health.timeout,
                         backoff_max=production_link.health.backoff_max, initially_healthy=False)
    assert attrs.evolve(simulated_link, health=named) == production_link


def test_the_simulator_places_ranks_as_the_connector_does() -> None:
    """A worker rank stores to and loads from the server production's placement names
    (core_sm.client_config.server_for_rank, which ConnectorConfig.server_for_rank uses too);
    its links to the other servers carry no store or retrieve."""
    from mpcache.core_sm.client_config import server_for_rank
    from mpcache.runtime_zmq.adapters import ConnectorConfig

    urls = ("tcp://a:1", "tcp://b:1", "tcp://c:1")
    connector = ConnectorConfig(server_urls=urls)
    assert [connector.server_for_rank(r, 4) for r in range(4)] == [urls[server_for_rank(r, 4, 3)] for r in range(4)]
    scenario = draw_scenario(5)  # two servers, two ranks
    assert scenario.config.num_servers == 2 and scenario.config.tp == 2
    result, world = run_scenario(scenario)
    assert result.ok, result.violation
    moved = 0
    for engine in world.engines:
        for worker in engine.workers:
            assert worker.node is not None
            home = server_for_rank(worker.rank, engine.tp, engine.num_servers)
            for s in range(engine.num_servers):
                stats = worker.node.machines[tc_name(s)].stats()
                if s != home:
                    assert stats["stores"] == stats["retrieves"] == 0, (worker.name, s, stats)
                else:
                    moved += stats["stores"]
    assert moved > 0, "no worker stored anything"


# ----------------------------------------------------------------------------------------------
# Same inputs, same effects: a recorded production run replayed through the simulator's machines


RECORDING = Path(__file__).resolve().parents[1] / "data" / "prod_recording.jsonl"


def test_a_recorded_production_run_replays_step_for_step_through_the_simulators_machines() -> None:
    """tests/data/prod_recording.jsonl: the connector's adapters and clients against a real
    mpcache-server (tools/record_production.py made it, MPCACHE_RECORD on): every event they
    handed their machines, replayed through the machines the simulator's default world builds
    from the recorded settings, gives every recorded effect list back, step for step."""
    from mpcache.sim.prod_replay import DEPLOYMENT_FACTS, load, replay, world_of

    lines = load(str(RECORDING))
    result = replay(lines)
    assert result.ok, result.mismatch.describe() if result.mismatch else ""
    recorded_steps = [line for line in lines if "i" in line]
    assert sum(result.steps.values()) == len(recorded_steps)
    world = world_of(lines)
    assert (world.cpu_engine, world.engine_driven, world.lookup_answer_in_ack) == (True, True, True)
    # only the named deployment facts came from the recording; the builders made the rest
    assert set(result.taken) <= {f"{kind}.{name}" for kind, names in DEPLOYMENT_FACTS.items() for name in names}
    _assert_production_paths(lines, result, gpu=False)


def _assert_production_paths(lines: list[Any], result: Any, *, gpu: bool) -> None:
    """What tools/record_production.py's run covers, asserted of a recording and its replay (the
    CPU one and the GPU one run the same stretches a-n; a new recording that loses one fails)."""
    from mpcache.core_sm.lookup_client import LookupClient
    from mpcache.core_sm.server_link import ServerLink

    by_kind: dict[str, list[Any]] = {}
    for name, machine in result.machines.items():
        by_kind.setdefault(name.rsplit("-", 2)[0], []).append(machine)
    # two engines, one after the other: the first straight to the server (a-k), the second
    # through the recorder's fault proxy (l-n)
    planner, proxied_planner = by_kind["planner"]
    transfer, proxied_transfer = by_kind["transfer_client"]
    assert {type(p) for p in (planner, proxied_planner)} == {StepPlanner} and type(planner.lookups) is LookupClient
    assert {type(t) for t in (transfer, proxied_transfer)} == {TransferClient}
    assert len(by_kind["link"]) == 4 and {type(link) for link in by_kind["link"]} == {ServerLink}
    # what the run covers: a miss, a store, a hit, a load; both lookup paths (the count in the
    # LOOKUP's ack for an L1 hit, the status query for a lookup that read L2)
    lookups = planner.lookups.stats()
    assert lookups["answered_in_ack"] >= 1 and lookups["status_queries_sent"] >= 1 and lookups["resolved_zero"] >= 1
    assert planner.stats()["stores_planned"] >= 1 and planner.stats()["loads_planned"] >= 1
    assert transfer.stats()["stores"] >= 1 and transfer.stats()["retrieves"] >= 1
    assert all(link.monitor.stats()["heartbeats_sent"] >= 1 for link in by_kind["link"])
    # and a request finished before it was allocated (vLLM aborted it after its lookup)
    assert result.events["planner"]["RequestFinished"] > result.events["planner"]["BlocksAllocated"]
    # a server stopped and started again on the same address: the links' sends failed while it
    # was down, both machines saw it unhealthy and then a new epoch, and a load after the restart
    # (from L2) was copied (three retrieves: b, c and f; a retrieve decided on the stale "down"
    # view would have failed without a copy)
    assert result.events["link"]["SendFailed"] >= 1 and result.events["link"]["Connected"] >= 2
    for kind in ("planner", "transfer_client"):
        assert result.events[kind]["ServerEpoch"] >= 2 and result.events[kind]["ServerHealth"] >= 2
    assert any(not e.get("healthy", True) for line in lines if line.get("i", "").startswith("transfer_client")
               for e in [line["event"]] if e["$"] == "ServerHealth")
    assert transfer.stats()["retrieves"] >= 3
    if gpu:  # every store and load was the server's copy, answered by its reply (no engine copy)
        assert result.events["transfer_client"].get("CopyFinished", 0) == 0
        assert result.events["transfer_client"]["ReplyReceived"] >= 5
    else:
        assert result.events["transfer_client"]["CopyFinished"] >= 5
    # the server paused past the heartbeat timeout (g): the lookup waiting on it failed when the
    # link declared the server down; killed and restarted at once (h): sends failed at once
    failures = [line["event"]["error"]["message"] for line in lines
                if line.get("i", "").startswith("planner") and line["event"]["$"] == "RequestFailed"]
    assert any("stopped answering" in f for f in failures) and any("not connected" in f for f in failures)
    # k: a request preempted with its load planned, matched again: recomputed (no second load)
    assert any("k" in plan_event["event"].get("preempted", ()) for plan_event in lines
               if plan_event.get("i", "").startswith("planner") and plan_event["event"]["$"] == "StepScheduled")
    assert planner.stats()["recomputed_after_preemption"] >= 1
    # m: the server alive, one reply dropped: the link's request deadline failed it typed
    # (timeout), the lookup a miss, while the heartbeats kept answering
    link_effects = [(line["event"], effect) for line in lines if line.get("i", "").startswith("link")
                    for effect in line["effects"]]
    assert any(e["$"] == "Failed" and e["kind"] == "timeout" for _, e in link_effects)
    assert {"e": "ErrorKind.TIMEOUT"} in [line["event"]["error"]["kind"] for line in lines
                                         if line.get("i", "").startswith("planner")
                                         and line["event"]["$"] == "RequestFailed"]
    # n: a store refused not_registered (the server behind the address replaced, the links not
    # yet told): parked, the instance registered again, the store sent once more naming the
    # registration
    assert any(event["$"] == "server_link.Reply" and event.get("kind") == "not_registered"
               for event, _ in link_effects), "no request was refused not_registered"
    assert any(e["$"] == "Transmit" and e["resend"] and e["registration"] is not None for _, e in link_effects)
    links = by_kind["link"]
    assert sum(link.stats()["parked"] for link in links) >= 1
    assert sum(link.stats()["health_resends"] for link in links) >= 1
    assert sum(link.stats()["timeouts"] for link in links) >= 1


def test_a_replay_reports_the_first_step_whose_effects_differ() -> None:
    """The replay can fail: a legacy profile's machine (double-register: a worker that registers
    again itself on the server's start id, beside its link, which alone decides it in production)
    and a recording whose one effect was changed each stop at the step that differs, and nowhere
    earlier."""
    import copy
    import json

    from mpcache.sim.prod_replay import load, replay

    lines = load(str(RECORDING))
    # the transfer client's first ServerEpoch: production's sends nothing there, the legacy one
    # registers again
    first_epoch = next(n for n, line in enumerate(lines, 1)
                       if line.get("i", "").startswith("transfer_client") and line["event"]["$"] == "ServerEpoch")
    legacy = replay(lines, "double-register")
    assert legacy.mismatch is not None, "a legacy transfer client replayed as production's"
    assert (legacy.mismatch.line, legacy.mismatch.event) == (first_epoch, "ServerEpoch")
    assert not legacy.mismatch.recorded and legacy.mismatch.replayed  # it registered; production did not
    assert '"RegisterInstance"' in json.dumps(legacy.mismatch.replayed)

    # a store range changed in the recorded plan of the first step that planned one
    planned = next(n for n, line in enumerate(lines, 1)
                   if line.get("i", "").startswith("planner") and '"SubmitStore"' in json.dumps(line["effects"]))
    mutated = copy.deepcopy(lines)
    plan = next(e for e in mutated[planned - 1]["effects"] if e["$"] == "StepPlan")
    plan["stores"][0]["end"] -= planner_chunk(lines)
    result = replay(mutated)
    assert result.mismatch is not None
    assert result.mismatch.line == planned and result.mismatch.event == "StepScheduled"
    name = result.mismatch.machine
    assert result.mismatch.step == sum(1 for line in lines[: planned - 1] if line.get("i") == name)
    assert result.mismatch.describe().startswith(f"line {planned}: {name} step {result.mismatch.step} (StepScheduled)")


GPU_RECORDING = RECORDING.with_name("prod_recording_gpu.jsonl")


def test_a_recorded_gpu_run_replays_step_for_step_through_the_simulators_machines() -> None:
    """tests/data/prod_recording_gpu.jsonl (``tools/record_production.py --gpu`` on an H200): the
    same run with the engine's KV on CUDA, the server copying after the worker's interprocess
    event (server-driven), loads asynchronous, and the same stretches: the outage and restart, the
    pause, the quick restart, the preemption, the live server's timeout and the not_registered
    resend. The simulator's server-driven world builds the same machines and gets every effect
    back."""
    from mpcache.core_sm.transfer_client import TransferClient
    from mpcache.sim.prod_replay import load, replay, world_of

    lines = load(str(GPU_RECORDING))
    world = world_of(lines)
    assert (world.cpu_engine, world.engine_driven) == (False, False)
    result = replay(lines)
    assert result.ok, result.mismatch.describe() if result.mismatch else ""
    _assert_production_paths(lines, result, gpu=True)


def test_mpcache_sim_replays_a_recording(capsys: Any) -> None:
    from mpcache.sim.cli import main

    assert main(["replay-recording", str(RECORDING)]) == 0
    assert "every effect as recorded" in capsys.readouterr().out
    assert main(["replay-recording", str(RECORDING), "--profile", "no-ack-wait"]) == 1
    out = capsys.readouterr().out
    assert "(MatchRequest) differs at effect" in out  # it does not ask for the lookup's status


def planner_chunk(lines: list[dict[str, Any]]) -> int:
    from mpcache.sim.prod_replay import world_of

    return world_of(lines).chunk_size
