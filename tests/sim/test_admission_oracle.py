"""The simulator's store-admission oracle: with ``store_threshold`` set, no STORE makes an object
ready for a chunk fewer LOOKUPs asked for; production admission passes it, an admission that
admits everything is caught."""
from __future__ import annotations

import attrs
import pytest

from mpcache.core_sm.admission import StoreAdmission
from mpcache.sim.runner import run_scenario
from mpcache.sim.scenario import draw_scenario
from mpcache.sim.world import SERVER

SEEDS = range(12)


def run(seed: int, threshold: int) -> tuple[object, dict[str, int]]:
    scenario = draw_scenario(seed)
    scenario = attrs.evolve(scenario, config=attrs.evolve(scenario.config, store_threshold=threshold))
    result, world = run_scenario(scenario)
    totals: dict[str, int] = {"stores_not_admitted": 0, "objects": 0}
    for host in world.servers:
        if host.node is not None:
            stats = host.node.machines[SERVER].stats()
            for name in totals:
                totals[name] += int(stats.get(name, 0))
    return result.violation, totals


def test_production_admission_passes_and_the_oracle_is_not_vacuous() -> None:
    refused = stored = 0
    for seed in SEEDS:
        violation, totals = run(seed, 2)
        assert violation is None, (seed, violation)
        refused += totals["stores_not_admitted"]
        stored += totals["objects"]
    assert refused > 0 and stored > 0


def test_an_admission_that_admits_everything_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StoreAdmission, "admits", lambda self, chunk_hash: True)
    caught = [seed for seed in SEEDS if (v := run(seed, 3)[0]) is not None and v.code == "ADMISSION"]
    assert caught, "no seed caught a store made without enough lookups"
