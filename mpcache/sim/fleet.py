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

import hashlib
import random
from collections.abc import Iterable
from typing import Any

import attrs

from mpcache.sim.scenario import FaultSpec, Scenario, draw_scenario


class ClusterTier:
    def __init__(self, num_nodes: int) -> None:
        self.num_nodes = num_nodes
        self.data: list[dict[Any, tuple[int, ...]]] = [{} for _ in range(num_nodes)]
        self.up = [True] * num_nodes
        self.cut: set[tuple[int, int]] = set()  # (server, node) pairs that cannot talk
        self.stats = {"tier_reads": 0, "tier_read_faults": 0, "tier_writes": 0, "tier_write_faults": 0,
                      "tier_probes": 0, "tier_probe_faults": 0, "tier_crashes": 0, "tier_partitions": 0,
                      "tier_objects_lost": 0}

    def node_of(self, key: Any) -> int:
        name = key.wire_name() if hasattr(key, "wire_name") else repr(key)
        digest = hashlib.blake2b(str(name).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") % self.num_nodes

    def reachable(self, server: int, node: int) -> bool:
        return self.up[node] and (server, node) not in self.cut

    def get(self, server: int, key: Any) -> tuple[int, ...] | None:
        node = self.node_of(key)
        self.stats["tier_reads"] += 1
        if not self.reachable(server, node):
            self.stats["tier_read_faults"] += 1
            return None
        return self.data[node].get(key)

    def has(self, server: int, key: Any) -> bool:
        node = self.node_of(key)
        self.stats["tier_probes"] += 1
        if not self.reachable(server, node):
            self.stats["tier_probe_faults"] += 1
            return False
        return key in self.data[node]

    def put(self, server: int, key: Any, value: tuple[int, ...]) -> bool:
        node = self.node_of(key)
        self.stats["tier_writes"] += 1
        if not self.reachable(server, node):
            self.stats["tier_write_faults"] += 1
            return False
        self.data[node][key] = value
        return True

    # ------------------------------------------------------------------------------ faults
    def inject(self, world: Any, fault: FaultSpec) -> None:
        now = world.now()
        if fault.kind == "tier_crash":
            node, down_for, lose = int(fault.args[0]), float(fault.args[1]), bool(fault.args[2])
            if not self.up[node]:
                return
            self.stats["tier_crashes"] += 1
            self.up[node] = False
            if lose:
                self.stats["tier_objects_lost"] += len(self.data[node])
                self.data[node].clear()
            world.trace.mark(now, f"tier{node}", "crash", "lost its objects" if lose else "kept its objects")
            world.timeline.at(now + down_for, self._restart, world, node)
        elif fault.kind == "tier_partition":
            server, node, dur = int(fault.args[0]), int(fault.args[1]), float(fault.args[2])
            self.stats["tier_partitions"] += 1
            self.cut.add((server, node))
            world.timeline.at(now + dur, self.cut.discard, (server, node))
        else:
            raise ValueError(f"unknown tier fault {fault.kind!r}")

    def _restart(self, world: Any, node: int) -> None:
        if not self.up[node]:
            self.up[node] = True
            world.trace.mark(world.now(), f"tier{node}", "restart", "")

    def heal(self) -> None:
        """The liveness phase: every node up, every partition healed."""
        self.up = [True] * self.num_nodes
        self.cut.clear()


def make_tier(config: Any) -> ClusterTier | None:
    """The world's L2 as a cluster tier (None: the single shared L2 of a plain world)."""
    nodes = int(getattr(config, "tier_nodes", 0))
    return ClusterTier(nodes) if nodes > 0 else None


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
