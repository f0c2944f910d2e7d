"""F10: a copy or an L2 transfer in flight into or out of an L1 slot for an object must find the
slot still given to that object (or free) when it lands -- otherwise it writes into, or reads,
another object's memory (the slot was freed while the operation was in flight)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from mpcache.core_sm.chunks import ObjectKey
from mpcache.sim.ports import SERVER

if TYPE_CHECKING:
    from mpcache.sim.checks.world_view import HostView, WorldView


def holder(host: HostView, slot: int) -> ObjectKey | None:
    """Which object the server's index gives ``slot`` to right now (None: free)."""
    assert host.node is not None
    index = host.node.machines[SERVER].index
    for key in index.objects():
        if index.slot_of(key) == slot:
            return key  # type: ignore[no-any-return]
    return None


def check_target(world: WorldView, host: HostView, slot: int, key: ObjectKey, what: str) -> None:
    found = holder(host, slot)
    if found is not None and found != key:
        world.violation("F10", host.name, f"{what} for {key.wire_name()[:12]} landed in slot {slot}, which the "
                        f"server has meanwhile given to {found.wire_name()[:12]}: the slot was freed while the "
                        f"operation was still in flight")
