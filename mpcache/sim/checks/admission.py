"""Store admission: an object a STORE made ready belongs to a chunk that LOOKUPs asked for at
least ``store_threshold`` times in this server incarnation (every LOOKUP counts, the
adversary's too). Run after each server event of a world with ``store_threshold > 1``."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mpcache.core_sm.messages import Lookup

if TYPE_CHECKING:
    from mpcache.sim.checks.world_view import HostView, WorldView


def check(world: WorldView, host: HostView, server: Any, event: Any) -> None:
    """Count ``event``'s chunks if it is a LOOKUP; judge the objects it made readable."""
    if type(event) is Lookup:
        hashes, err = server.ctx.hashes(event.key, event.key.end // world.config.chunk_size)
        for h in hashes if err is None else ():
            host.chunk_lookups[h] = host.chunk_lookups.get(h, 0) + 1
    index = server.index
    held = frozenset(k for k in index.objects() if index.is_readable(k))
    if type(event).__name__ in ("TransferFinished", "CommitTransfer"):
        for key in held - host.objects_held:
            seen = host.chunk_lookups.get(key.chunk_hash, 0)
            if seen < world.config.store_threshold:
                world.violation("ADMISSION", host.name, f"{key.wire_name()[:12]} stored after {seen} "
                                f"lookups (store_threshold {world.config.store_threshold})")
    host.objects_held = held
