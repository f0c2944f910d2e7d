"""A corpus of shrunk failing scenarios (tests/sim/corpus/*.json), re-run in CI.

Each file holds one `Scenario` (as plain JSON), the legacy profile it failed under and the
violation code it produced. CI replays it twice: under that profile it must still fail with the
same code (the simulator still catches the bug), and under `default` it must pass (production
core_sm is immune to it).
"""
from __future__ import annotations

import enum
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from mpcache.core_sm.kv_groups import GroupKind, KVGroup
from mpcache.sim.net import NetConfig
from mpcache.sim.scenario import FaultSpec, RequestSpec, Scenario, WorldConfig

CORPUS_DIR = Path(__file__).resolve().parents[2] / "tests" / "sim" / "corpus"


def to_json(scenario: Scenario, profile: str, code: str, note: str = "") -> str:
    data = {"profile": profile, "code": code, "note": note, "scenario": attrs.asdict(scenario, value_serializer=_plain)}
    return json.dumps(data, indent=1, sort_keys=True)


def from_json(text: str) -> tuple[Scenario, str, str]:
    data = json.loads(text)
    sc: dict[str, Any] = data["scenario"]
    cfg = dict(sc["config"])
    cfg["net"] = NetConfig(**cfg["net"])
    cfg["kv_groups"] = tuple(KVGroup(**{**g, "kind": GroupKind(g["kind"])}) for g in cfg.get("kv_groups", ()))
    scenario = Scenario(
        seed=sc["seed"],
        config=WorldConfig(**cfg),
        requests=tuple(RequestSpec(**{**r, "prompt": tuple(r["prompt"])}) for r in sc["requests"]),
        faults=tuple(FaultSpec(f["at"], f["kind"], tuple(f["args"])) for f in sc["faults"]),
        net_seed=sc["net_seed"],
    )
    return scenario, data["profile"], data["code"]


def _plain(instance: Any, field: Any, value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value  # a KV-cache group's kind


def entries(directory: Path = CORPUS_DIR) -> list[Path]:
    return sorted(directory.glob("*.json"))


def reduce_scenario(scenario: Scenario, still_fails: Callable[[Scenario], bool]) -> Scenario:
    """Greedy delta reduction of a failing seed's world: drop faults, then requests, then turn
    fault knobs off, keeping every step that still fails. Used when Hypothesis's generator does
    not reach a failure the seeded generator finds."""
    current = scenario
    changed = True
    while changed:
        changed = False
        for i in range(len(current.faults)):
            candidate = attrs.evolve(current, faults=current.faults[:i] + current.faults[i + 1:])
            if still_fails(candidate):
                current, changed = candidate, True
                break
        if changed:
            continue
        for i in range(len(current.requests)):
            candidate = attrs.evolve(current, requests=current.requests[:i] + current.requests[i + 1:])
            if still_fails(candidate):
                current, changed = candidate, True
                break
        if changed:
            continue
        cfg = current.config
        knob_sets: tuple[dict[str, Any], ...] = ({"drop_p": 0.0}, {"dup_p": 0.0}, {"reorder_p": 0.0})
        for knobs in knob_sets:
            net = attrs.evolve(cfg.net, **knobs)
            if net != cfg.net:
                candidate = attrs.evolve(current, config=attrs.evolve(cfg, net=net))
                if still_fails(candidate):
                    current, changed = candidate, True
                    break
        if changed:
            continue
        simpler: tuple[tuple[str, Any], ...] = (
            ("l2_fail_p", 0.0), ("copy_fail_p", 0.0), ("evict_after_prefetch_p", 0.0),
            ("num_engines", 1), ("num_servers", 1), ("tp", 1), ("l2_enabled", False))
        for field, value in simpler:
            if getattr(cfg, field) != value:
                candidate = attrs.evolve(current, config=attrs.evolve(cfg, **{field: value}))
                if field == "num_engines":
                    candidate = attrs.evolve(candidate, requests=tuple(
                        attrs.evolve(r, engine=0) for r in candidate.requests))
                if field in ("num_engines", "num_servers", "tp") and candidate.faults:
                    continue  # faults name nodes; keep topology while faults remain
                try:
                    ok = still_fails(candidate)
                except Exception:
                    ok = False
                if ok:
                    current, changed = candidate, True
                    break
    return current
