"""A fleet in the simulator (sim/fleet.py): servers x engines over a cluster L2 tier whose nodes
crash (some losing their objects) and are cut off from servers. A few seeds pass every oracle and
meet tier faults; a tier that returns wrong data, or fails loudly, is caught."""
from __future__ import annotations

from typing import Any

import pytest

from mpcache.sim.cli import main as sim_main
from mpcache.sim.fleet import ClusterTier, draw_fleet_scenario, run_fleet, run_fleet_seed
from mpcache.sim.runner import run_scenario

SEEDS = range(8)


def test_a_few_fleet_seeds_pass_and_meet_tier_faults() -> None:
    results = run_fleet(SEEDS)
    assert [r.seed for r in results if not r.ok] == [], [r.violation.reason() for r in results if not r.ok]
    total = {k: sum(r.tier[k] for r in results) for k in results[0].tier}
    assert total["tier_crashes"] > 0 and total["tier_partitions"] > 0 and total["tier_objects_lost"] > 0
    assert total["tier_read_faults"] + total["tier_probe_faults"] > 0  # faults became misses
    assert total["tier_writes"] > total["tier_write_faults"] > 0


def test_fleet_world_is_what_was_asked_and_deterministic() -> None:
    sc = draw_fleet_scenario(3, servers=2, engines=3, tier_nodes=4)
    assert (sc.config.num_servers, sc.config.num_engines, sc.config.tier_nodes, sc.config.l2_enabled) == (2, 3, 4, True)
    assert {r.engine for r in sc.requests} <= {0, 1, 2}
    assert any(f.kind.startswith("tier_") for f in sc.faults)
    a, _ = run_scenario(sc)
    b, _ = run_scenario(draw_fleet_scenario(3, servers=2, engines=3, tier_nodes=4))
    assert a.trace_hash == b.trace_hash


def test_keys_spread_over_the_tier_nodes() -> None:
    tier = ClusterTier(3)
    nodes = {tier.node_of(f"key{i}") for i in range(60)}
    assert nodes == {0, 1, 2}


@pytest.mark.parametrize("broken", ["wrong_data", "raises"])
def test_a_broken_tier_is_caught(broken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real_get = ClusterTier.get

    def get(self: ClusterTier, server: int, key: Any) -> Any:
        data = real_get(self, server, key)
        if data is None:
            return None
        if broken == "raises":
            raise ConnectionError("tier node reset the connection")
        return tuple(x + 1 for x in data)

    monkeypatch.setattr(ClusterTier, "get", get)
    monkeypatch.setattr(ClusterTier, "has", lambda self, server, key: key in self.data[self.node_of(key)])
    want = "F10" if broken == "wrong_data" else "CRASH"
    codes = set()
    for seed in range(40):  # the first seed whose loads read the tier shows it
        r = run_fleet_seed(seed, servers=2, engines=2, tier_nodes=2)
        if r.violation is not None:
            codes.add(r.violation.code)
            if r.violation.code == want:
                break
    assert want in codes, codes


def test_cli_fleet(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_main(["fleet", "--seeds", "2", "--servers", "2", "--engines", "2", "--tier-nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "passed / failed" in out and "2 / 0" in out and "tier reads" in out
    assert run_fleet_seed(0, 2, 2, 2).ok
