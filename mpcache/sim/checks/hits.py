"""F2: a hit the server answered lost on its way into the engine.

A pure judgement (see ``mpcache.sim.checks``): shared by the random simulator and the explorer."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mpcache.sim.checks.finding import Finding


def lost_hit(rid: str, legs: Mapping[int, Any], delivered_hits: Mapping[tuple[str, int], int],
             result_tokens: Any) -> str | None:
    """F2 (its message; the node is the shell's): a hit a server answered, received while the
    client still waited for that server, must not turn into less when the lookup resolves."""
    for s, leg in legs.items():
        got = delivered_hits.get((rid, s), 0)
        # A leg cut short (None) by another server's 0 is the min rule, not a lost answer.
        if got > 0 and leg.chunks is not None and leg.chunks < got:
            return (f"{rid}: server{s} answered {got} hit chunks and the answer reached the client while it "
                    f"waited for that server, but the lookup resolved that server's leg to {leg.chunks} "
                    f"(result {result_tokens} tokens)")
    return None


def misplaced_load(rid: str, rank: int, server: int, ranks_per_server: Any) -> Finding | None:
    """F2: each rank loads its hit from the server that answered it for that rank (the lookup's
    ranks per server, where the hit is leased); loaded from another server, the hit is lost (a
    load error at best, the leases at the right server left to the TTL)."""
    if ranks_per_server is None or rank in ranks_per_server[server]:
        return None
    held = [s for s, ranks in enumerate(ranks_per_server) if rank in ranks]
    return "F2", (f"{rid}: rank {rank} loads its hit from server{server}, but server{held[0] if held else '?'} "
                  f"answered (and leased) that rank's part of it: the hit is lost")
