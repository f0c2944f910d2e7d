"""A fleet in the simulator: N servers x M engines sharing a cluster L2 tier of several nodes.

``ClusterTier`` models a Redis-Cluster-like tier: ``tier_nodes`` nodes, each object key hashed
(blake2b of its wire name, so runs are deterministic) to one node that holds it. Tier faults,
scheduled as ``FaultSpec`` s like the world's other faults:

* ``tier_crash(node, down_for, lose)``: the node is down for ``down_for`` s; ``lose``: it comes
  back empty (a master without a replica);
* ``tier_partition(server, node, for_)``: that server cannot reach that node for ``for_`` s.

An operation on a node that is down or cut off from the asking server fails: a read of that
object loads nothing (a miss), a probe says absent, a write is reported failed. The tier never
answers an error the server would pass on, and never returns data it does not hold. The world's
oracles then check the fleet as any world: no hang (F1, LIVENESS, DEADLOCK), no wrong data
(F10 on every copy out of a slot an L2 read filled, HIT), SAFETY after every event; the tier's
counts (``stats``) show the faults were met (reads that missed because of them).

``draw_fleet_scenario(seed, servers, engines, tier_nodes)`` draws a world as ``draw_scenario``
does, then makes it a fleet: L2 on, the given topology, requests spread over the engines, and
tier faults drawn from their own stream. ``mpcache-sim fleet`` runs many seeds of it.
"""
from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import attrs

from mpcache.sim.cluster_tier import ClusterTier
from mpcache.sim.scenario import FaultSpec, Scenario, draw_scenario

__all__ = ["ClusterTier", "FleetResult", "draw_fleet_scenario", "run_fleet", "run_fleet_seed"]


def draw_fleet_scenario(seed: int, servers: int = 3, engines: int = 4, tier_nodes: int = 3) -> Scenario:
    base = draw_scenario(seed)
    rng = random.Random(f"fleet:{seed}:{servers}:{engines}:{tier_nodes}")
    config = attrs.evolve(base.config, num_servers=servers, num_engines=engines, tp=1, l2_enabled=True,
                          tier_nodes=tier_nodes, l2_fail_p=0.0, max_running=None)
    requests = tuple(attrs.evolve(r, engine=rng.randrange(engines)) for r in base.requests)
    faults: list[FaultSpec] = []
    for f in base.faults:  # the base world's faults, re-aimed at the fleet's nodes
        if f.kind in ("crash_server", "clear"):
            faults.append(attrs.evolve(f, args=(rng.randrange(servers), *f.args[1:])))
        elif f.kind == "crash_engine":
            faults.append(attrs.evolve(f, args=(rng.randrange(engines),)))
        elif f.kind in ("partition", "clog") and all(_in_fleet(n, servers, engines) for n in f.args[:2]):
            faults.append(f)
    for _ in range(rng.randint(1, 4)):
        at = round(rng.uniform(0.0, config.safety_duration), 6)
        if rng.random() < 0.5:
            faults.append(FaultSpec(at, "tier_crash", (rng.randrange(tier_nodes), rng.choice((0.05, 0.5, 2.0)),
                                                       rng.random() < 0.5)))
        else:
            faults.append(FaultSpec(at, "tier_partition", (rng.randrange(servers), rng.randrange(tier_nodes),
                                                           rng.choice((0.05, 0.5, 3.0)))))
    faults.sort(key=lambda f: f.at)
    return attrs.evolve(base, config=config, requests=requests, faults=tuple(faults))


def _in_fleet(name: Any, servers: int, engines: int) -> bool:
    text = str(name)
    for prefix, count in (("server", servers), ("sched", engines)):
        if text.startswith(prefix) and text[len(prefix):].isdigit():
            return int(text[len(prefix):]) < count
    if text.startswith("worker"):
        e, _, r = text[len("worker"):].partition(".")
        return e.isdigit() and int(e) < engines and r == "0"
    return False


@attrs.frozen
class FleetResult:
    seed: int
    violation: Any
    tier: dict[str, int]
    events: int

    @property
    def ok(self) -> bool:
        return self.violation is None


def run_fleet_seed(seed: int, servers: int = 3, engines: int = 4, tier_nodes: int = 3,
                   keep_lines: bool = False) -> FleetResult:
    from mpcache.sim.runner import run_scenario

    result, world = run_scenario(draw_fleet_scenario(seed, servers, engines, tier_nodes), keep_lines=keep_lines)
    tier = dict(world.tier.stats) if world.tier is not None else {}
    return FleetResult(seed, result.violation, tier, result.events)


def run_fleet(seeds: Iterable[int], servers: int = 3, engines: int = 4, tier_nodes: int = 3) -> list[FleetResult]:
    return [run_fleet_seed(s, servers, engines, tier_nodes) for s in seeds]
