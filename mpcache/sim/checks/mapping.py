"""F23: a server-driven copy runs through the registration its instance's owner made.

A pure judgement (see ``mpcache.sim.checks``): shared by the random simulator and the explorer."""
from __future__ import annotations

from mpcache.sim.checks.finding import Finding


def copy_through_other_registration(kind: str, transfer_id: int, instance_id: int, owner: str,
                                    attached: str | None) -> Finding | None:
    """F23: a server-driven copy of ``instance_id`` (owned by the honest worker ``owner``) runs
    through the registration its owner made -- the transfer engine attached it for the peer
    core_sm says owns the instance. ``attached``: the peer whose registration the transfer engine
    holds for it now (None: none). A runtime that registers with its engine before core_sm decides
    lets another peer's register replace the mapping (the owner's KV copied to or from the other's
    memory) or its unregister drop it."""
    if attached == owner:
        return None
    how = "no registration open" if attached is None else f"the registration {attached} made"
    return "F23", (f"{kind} copy {transfer_id} of instance {instance_id} (owned by {owner}) runs through {how}: "
                   f"the transfer engine acted before core_sm decided")
