"""A corpus of shrunk failing scenarios (tests/sim/corpus/*.json), re-run in CI.

Each file holds one `Scenario` (as plain JSON), the legacy profile it failed under and the
violation code it produced. CI replays it twice: under that profile it must still fail with the
same code (the simulator still catches the bug), and under `default` it must pass (production
core_sm is immune to it).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from sim.net import NetConfig
from sim.scenario import FaultSpec, RequestSpec, Scenario, WorldConfig

CORPUS_DIR = Path(__file__).resolve().parent.parent / "tests" / "sim" / "corpus"


def to_json(scenario: Scenario, profile: str, code: str, note: str = "") -> str:
    data = {"profile": profile, "code": code, "note": note, "scenario": attrs.asdict(scenario)}
    return json.dumps(data, indent=1, sort_keys=True)


def from_json(text: str) -> tuple[Scenario, str, str]:
    data = json.loads(text)
    sc: dict[str, Any] = data["scenario"]
    cfg = dict(sc["config"])
    cfg["net"] = NetConfig(**cfg["net"])
    scenario = Scenario(
        seed=sc["seed"],
        config=WorldConfig(**cfg),
        requests=tuple(RequestSpec(**{**r, "prompt": tuple(r["prompt"])}) for r in sc["requests"]),
        faults=tuple(FaultSpec(f["at"], f["kind"], tuple(f["args"])) for f in sc["faults"]),
        net_seed=sc["net_seed"],
    )
    return scenario, data["profile"], data["code"]


def entries(directory: Path = CORPUS_DIR) -> list[Path]:
    return sorted(directory.glob("*.json"))
