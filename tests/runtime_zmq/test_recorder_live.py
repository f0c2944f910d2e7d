"""``MPCACHE_RECORD``: the connector's shells record what they hand their machines, and only
when asked. The recording tools/record_production.py makes against a real server (the one
committed under tests/data is such a run) replays through the simulator's machines."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

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
    """Regenerate the recording (a real server, the connector's adapters, three requests) and
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
    assert sorted(line["kind"] for line in builds) == ["link", "link", "planner", "transfer_client"]
    assert all(json.loads(json.dumps(line)) == line for line in lines)
    result = replay(lines)
    assert result.ok, result.mismatch.describe() if result.mismatch else ""
    assert sum(result.steps.values()) == len(lines) - len(builds)
    events = result.events
    assert {"MatchRequest", "BlocksAllocated", "StepScheduled", "ReplyReceived", "RequestFinished"} <= set(events["planner"])
    assert {"SubmitStore", "SubmitRetrieve", "CopyFinished", "EngineFinished"} <= set(events["transfer_client"])
    assert {"Submit", "Reply", "TimerFired"} <= set(events["link"])
    assert out.stat().st_size < 100_000
