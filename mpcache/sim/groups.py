"""KV-cache groups in the simulated world (vLLM's hybrid KV-cache manager) and the F24 oracle.

Some worlds draw an engine with several KV-cache groups (``WorldConfig.kv_groups``; none: one
full-attention group, the plain path): a full-attention group, a sliding window (its window in
tokens drawn from the seed), maybe a recurrent state. Group 0 is the full-attention group whose
objects the protocol moves: its lookups, leases, stores and loads are the ones every world runs.
The other groups' chunks are objects of their own, keyed apart (the group in the key's
identity), stored and looked up per group; here a ``GroupStore`` holds, per server, which of
them exist:

* a STORE copy of a request's chunks (rank 0's) stores the other groups' same chunks, each group
  its own copy landing a copy latency later: a sliding window only the chunks still live when the
  step started (``kv_groups.first_live_token``), the recurrent state every chunk's end;
* they go missing per group: a failed or partial store of one group (``group_fault_p``: the
  group stores a prefix of the range, or nothing), an eviction of one group's object, a server
  restart (L1 lost) or one landing after it (the restart came between the groups' stores), a
  forced clear; with L2 on they are written behind to L2 as the group-0 objects are.

The honest client (the connector's group layer, ``engine._PlannerCalls``) reads every group's
presence when the planner answers a hit and lowers the request's load to
``kv_groups.resume_point`` over all groups -- the core_sm rule production uses, no copy here.

F24 (``partial_restore``): vLLM is told a request has N external tokens (its resume point is
N) while a group lacks a chunk ``needed_chunks(group, N)`` requires: the engine would skip the
prefix for that group's layers with KV it never got -- wrong output (LMCache #2863).
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from mpcache.core_sm.kv_groups import GroupKind, KVGroup, first_live_token, needed_chunks, resume_point

Finding = tuple[str, str]

__all__ = ["GroupStore", "group_resume_point", "partial_restore"]


class GroupStore:
    """Which chunks of the groups after the first exist, per server (L1, this incarnation) and in
    L2. Keys are (group index, chunk hash): the same prefix hashes alike for every engine."""

    def __init__(self, world: Any) -> None:
        self.world = world
        cfg = world.config
        self.groups: tuple[KVGroup, ...] = cfg.kv_groups
        self.chunk = cfg.chunk_size
        self.fault_p: float = cfg.group_fault_p
        self.l2_enabled: bool = cfg.l2_enabled
        # its own stream: the world's other draws stay as they were
        self.rng = random.Random(f"{world.scenario.net_seed}:groups")
        self.l1: dict[int, tuple[int, set[tuple[int, bytes]]]] = {}  # server -> (incarnation, objects)
        self.l2: set[tuple[int, bytes]] = set()
        self.stats = {"group_stores": 0, "group_partial_stores": 0, "group_evictions": 0, "group_lost_stores": 0}

    def _objects(self, host: Any) -> set[tuple[int, bytes]]:
        held = self.l1.get(host.index)
        if held is None or held[0] != host.incarnation:
            held = self.l1[host.index] = (host.incarnation, set())
        return held[1]

    def stored(self, host: Any, hashes: Sequence[bytes], chunks: Sequence[int], computed: int) -> None:
        """Group 0's STORE copy of ``chunks`` landed at ``host``: each other group's copy of them
        starts (``computed``: the tokens the request had computed when its step started)."""
        for g in range(1, len(self.groups)):
            group = self.groups[g]
            live = first_live_token(group, computed) // self.chunk  # a window's older blocks are freed
            mine = [c for c in chunks if c >= live and c < len(hashes)]
            if self.rng.random() < self.fault_p:
                self.stats["group_partial_stores"] += 1
                mine = mine[: self.rng.randrange(len(mine))] if mine else mine  # a prefix: maybe nothing
            delay = self.world.latency(self.world.config.copy_latency_mean)
            self.world.timeline.after(delay, self._land, host, host.incarnation, g,
                                      tuple(hashes[c] for c in mine))

    def _land(self, host: Any, incarnation: int, g: int, hashes: tuple[bytes, ...]) -> None:
        if host.incarnation != incarnation or not host.up:
            self.stats["group_lost_stores"] += 1  # the server restarted between the groups' stores
            return
        objects = self._objects(host)
        for h in hashes:
            objects.add((g, h))
            if self.l2_enabled:
                self.l2.add((g, h))
        self.stats["group_stores"] += 1
        if objects and self.rng.random() < self.fault_p / 2:
            victim = sorted(objects)[self.rng.randrange(len(objects))]
            objects.discard(victim)  # memory pressure: LRU evicts one group's object alone
            self.stats["group_evictions"] += 1

    def cleared(self, host: Any) -> None:
        """A forced clear of ``host``'s L1."""
        self._objects(host).clear()

    def present(self, host: Any, hashes: Sequence[bytes]) -> list[frozenset[int]]:
        """Per group after the first: the chunk indices of the prompt ``host`` can restore."""
        objects = self._objects(host) if host.up else set()
        return [frozenset(c for c, h in enumerate(hashes) if (g, h) in objects or (g, h) in self.l2)
                for g in range(1, len(self.groups))]


def group_resume_point(groups: Sequence[KVGroup], first_hit: int, others: Sequence[frozenset[int]], limit: int,
                       chunk: int) -> int:
    """The resume point of a request whose first (full-attention) group hits ``first_hit`` tokens
    and whose other groups hold ``others``: ``kv_groups.resume_point`` over every group."""
    return resume_point(groups, [range(0, first_hit // chunk), *others], min(limit, first_hit), chunk)


def partial_restore(rid: str, groups: Sequence[KVGroup], others: Sequence[frozenset[int]], computed: int,
                    resume: int, chunk: int) -> Finding | None:
    """F24: vLLM was told ``rid`` resumes at token ``resume`` (``computed`` from its own prefix
    cache, the rest external): every group after the first must hold every chunk
    ``needed_chunks(group, resume)`` requires that vLLM's own cache does not (the first group's
    are the lookup's hit, judged by the HIT and F10 oracles). A recurrent state exists only at a
    chunk's end: a resume point inside a chunk cannot be restored for it."""
    if resume <= computed:
        return None
    aligned = -(-resume // chunk) * chunk
    for g in range(1, len(groups)):
        group = groups[g]
        if group.kind is GroupKind.RECURRENT and resume % chunk:
            return "F24", (f"{rid}: vLLM told it resumes at token {resume} (computed {computed}), inside a chunk: "
                           f"group {g} ({group.kind.value}) has no state there -- a partial restore")
        need = needed_chunks(group, aligned if group.kind is not GroupKind.RECURRENT else resume, chunk)
        missing = [c for c in need if (c + 1) * chunk > computed and c not in others[g - 1]]
        if missing:
            return "F24", (f"{rid}: vLLM told it resumes at token {resume} (computed {computed}), but group {g} "
                           f"({group.kind.value}{' ' + str(group.window) if group.window else ''}) lacks chunk(s) "
                           f"{missing} of {list(need)}: a partial restore, wrong output")
    return None
