"""The fleet's L2 as the world holds it: a Redis-Cluster-like tier of ``tier_nodes`` nodes (see
``mpcache.sim.fleet`` for the faults it takes and the fleet it belongs to). It sits under the
world and the fleet both: the world holds one, the fleet draws and runs worlds."""
from __future__ import annotations

import hashlib
from typing import Any

from mpcache.sim.scenario import FaultSpec


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
