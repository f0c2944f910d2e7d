"""HIT: a status answer of ``chunks`` hit chunks names only objects some store ever wrote (the
world's history of writes into L1 or L2, ``World.written``), for the ranks that server was asked
about, and never more chunks than the prompt has."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mpcache.core_sm.chunks import ObjectKey
from mpcache.sim.ports import Via

if TYPE_CHECKING:
    from mpcache.sim.checks.world_view import WorldView


def check(world: WorldView, node: str, rid: str, chunks: int, via: Any) -> None:
    engine = world.engine_of_node(via.node) if isinstance(via, Via) else None
    if engine is None:
        return
    req = engine.requests.get(rid)
    if req is None:
        return
    # the ranks this server was asked about (core_sm's placement: a lookup names its server's)
    rps = engine.planner().lookups.config.ranks_per_server
    ranks = range(engine.tp) if rps is None else rps[via.server]
    for c in range(min(chunks, len(req.hashes))):
        for r in ranks:
            if ObjectKey(req.hashes[c], r) not in world.written:
                world.violation("HIT", node, f"{rid}: status answered {chunks} chunks but chunk {c} rank {r} "
                                f"was never stored anywhere")
    if chunks > len(req.hashes):
        world.violation("HIT", node, f"{rid}: {chunks} hit chunks for a {len(req.hashes)}-chunk prompt")
