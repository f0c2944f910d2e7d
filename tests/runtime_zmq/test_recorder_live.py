"""``MPCACHE_RECORD``: the connector's shells record what they hand their machines, and only
when asked. The recording tools/record_production.py makes against a real server (the one
committed under tests/data is such a run) replays through the simulator's machines."""
from __future__ import annotations

import importlib.util
import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from live_server import REPO
from mpcache.runtime_zmq import recorder
from mpcache.runtime_zmq.client import MPCacheClient


def test_nothing_is_recorded_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(recorder.ENV, raising=False)
    assert recorder.recording("link", 0.0, {}) is None
    client = MPCacheClient("tcp://127.0.0.1:1", wait_connected=False, connect_timeout=0.2)
    try:
        assert client._record is None  # noqa: SLF001 - the shell's one test per event
    finally:
        client.close()


def test_a_recorded_production_run_replays_through_the_simulator(tmp_path: Path) -> None:
    """Regenerate the recording (a real server, the connector's adapters, ten requests, an outage, a pause,
    two restarts, a preemption, and through a fault proxy a dropped reply and a not_registered refusal) and
    replay it: every machine the run built is in it, and every step replays as recorded."""
    from mpcache.sim.prod_replay import load, replay

    spec = importlib.util.spec_from_file_location("record_production", os.path.join(REPO, "tools", "record_production.py"))
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "recording.jsonl"
    assert tool.main(str(out)) == 0
    assert recorder.ENV not in os.environ
    lines = load(str(out))
    builds = [line for line in lines if "build" in line]
    # two engines (the second through the fault proxy), each a planner, a transfer client, two links
    assert sorted(line["kind"] for line in builds) == ["link"] * 4 + ["planner"] * 2 + ["transfer_client"] * 2
    assert all(json.loads(json.dumps(line)) == line for line in lines)
    result = replay(lines)
    assert result.ok, result.mismatch.describe() if result.mismatch else ""
    assert sum(result.steps.values()) == len(lines) - len(builds)
    events = result.events
    assert {"MatchRequest", "BlocksAllocated", "StepScheduled", "ReplyReceived", "RequestFinished"} <= set(events["planner"])
    assert {"SubmitStore", "SubmitRetrieve", "CopyFinished", "EngineFinished"} <= set(events["transfer_client"])
    assert {"Submit", "Reply", "TimerFired"} <= set(events["link"])
    assert out.stat().st_size < 250_000


def test_two_ranks_on_two_servers_replay_as_recorded(start_server: Callable[..., Any], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The recording the committed one is not: tensor parallelism over two servers (each lookup
    names the ranks a server holds, the hit is the minimum; rank r stores to and loads from
    server r), through the adapter tests' model of vLLM's scheduler. Both workers' transfer
    clients and every link replay as recorded."""
    from adapter_driver import CHUNK, Engine

    from mpcache.sim.prod_replay import load, replay, world_of

    flags = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.0625", "--slot-mb", "1")
    a, b = start_server(*flags), start_server(*flags)
    out = tmp_path / "two.jsonl"
    monkeypatch.setenv(recorder.ENV, str(out))
    engine = Engine([a.url, b.url], world_size=2)
    try:
        prompt = [random.Random(5).randrange(1000) for _ in range(3 * CHUNK)]
        engine.add("a", prompt)
        engine.run_all()
        again = engine.add("b", prompt)
        engine.run_all()
        assert again.external == 3 * CHUNK - 1 and again.checked
    finally:
        engine.close()
        monkeypatch.delenv(recorder.ENV)
    lines = load(str(out))
    world = world_of(lines)
    assert (world.num_servers, world.tp) == (2, 2)
    ranks = sorted(line["about"]["rank"] for line in lines if line.get("kind") == "transfer_client")
    assert ranks == [0, 1]
    result = replay(lines)
    assert result.ok, result.mismatch.describe() if result.mismatch else ""
    transfers = [m for name, m in result.machines.items() if name.startswith("transfer_client")]
    assert all(m.stats()["stores"] >= 1 and m.stats()["retrieves"] >= 1 for m in transfers)
