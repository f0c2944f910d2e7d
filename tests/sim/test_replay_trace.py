"""``mpcache-sim replay-trace``: a production server's trace runs through the simulator's own
server machine, and the simulator's server oracles judge every replayed event."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mpcache.core_sm.messages import RegisterInstance
from mpcache.core_sm.server import LookupServer
from mpcache.core_sm.server_core import ServerConfig
from mpcache.core_sm.trace import TraceCodec, header, replay
from mpcache.sim.cli import main


def _trace() -> tuple[dict[str, Any], list[Any]]:
    config = ServerConfig(num_slots=8, slot_bytes=4096)
    server = LookupServer(config)
    codec = TraceCodec()
    records = []
    for now, event in ((0.0, RegisterInstance(1, "m", 1, 4096, True, reply_to=("c", 1))),):
        effects = server.handle(event, now)
        records.append([now, codec.encode(event), codec.encode(effects)])
    return header(config, False), records


def test_the_server_machine_and_the_judge_are_the_callers() -> None:
    head, records = _trace()
    built: list[ServerConfig] = []

    def make(config: ServerConfig) -> LookupServer:
        built.append(config)
        return LookupServer(config)

    count, divergences = replay(head, records, make_server=make, judge=lambda server: None)
    assert count == 1 and not divergences and len(built) == 1
    count, divergences = replay(head, records, judge=lambda server: "SAFETY: planted")
    assert [(d.index, d.recorded, d.replayed) for d in divergences] == [(0, None, "SAFETY: planted")]


def test_replay_trace_judges_with_the_simulators_oracles(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    head, records = _trace()
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [head, *records]) + "\n")
    assert main(["replay-trace", str(path)]) == 0
    # a server machine whose invariants break is caught by the simulator's core_sm oracle
    monkeypatch.setattr(LookupServer, "check_invariants", lambda self: (_ for _ in ()).throw(AssertionError("planted")))
    assert main(["replay-trace", str(path)]) == 1
    assert "SAFETY: core_sm replayed invariant: planted" in capsys.readouterr().out
