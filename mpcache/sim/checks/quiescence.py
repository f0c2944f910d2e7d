"""The oracles of a world's end (``World.main``): after heal and quiescence, nothing owed and
nothing leaked.

* ``quiescent`` (F11, F8): every request a live server handled got its reply; a request that
  ended cleanly holds no lease where nothing was sent to release it or END_SESSION was last;
* ``released`` (F8, whatever the lease TTL): a request that finished cleanly while a server
  leased it objects sent that server a FREE or an END_SESSION (``World.held_after_done``, kept
  with ``holds_leases`` as requests finish and lookups land);
* ``registered`` (F13, F19): every live worker is registered with every server that is up;
* ``drained`` (F12, F8): after the TTLs, no server holds a job or a lease.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from mpcache.core_sm.messages import TimerFired
from mpcache.core_sm.server_core import RequestKey
from mpcache.core_sm.server_instances import InstanceState
from mpcache.sim.adversary import ADVERSARY
from mpcache.sim.checks.drained import drained as drained_judgement
from mpcache.sim.checks.instances import worker_unregistered
from mpcache.sim.checks.leases import leases_after_end
from mpcache.sim.ports import SERVER
from mpcache.sim.scenario import server_name

if TYPE_CHECKING:
    from mpcache.sim.checks.world_view import HostView, WorldView


def holds_leases(host: HostView, node: str, rid: str) -> bool:
    """Whether scheduler ``node``'s request ``rid`` holds read leases on ``host`` now."""
    assert host.node is not None
    index = host.node.machines[SERVER].index
    # a server that ignores peers (trust-all) files leases under no peer
    return bool(index.holds(RequestKey(node, rid)) or index.holds(RequestKey(None, rid)))


def quiescent(world: WorldView) -> None:
    """Everything landed: no reply owed, no lease held by a request that ended cleanly, every
    live worker registered with every server (checked later, ``registered``)."""
    for host in world.servers:
        if not host.up or host.node is None:
            continue
        for via, (name, t) in host.awaiting_reply.items():
            if name == "WaitPrefetchStatus":
                continue  # answered at its own deadline
            world.violation("F11", host.name, f"{name} from {via.node} handled at {t:.6f} never got a reply")
        server = host.node.machines[SERVER]
        for lease_owner, count in sorted(server.leases_by_owner().items(), key=lambda kv: repr(kv[0])):
            if not isinstance(lease_owner, RequestKey) or count <= 0 or lease_owner.peer == ADVERSARY:
                continue
            owner = lease_owner.request_id
            engine_req = world.find_request(owner)
            if engine_req is None:
                continue
            engine, req = engine_req
            last = host.last_session_event.get(owner)
            if not req.done or engine.crashed or owner in world.touched:
                continue
            # Leases of a request that ended cleanly may outlive it only when its LOOKUP landed
            # after its END_SESSION (a reordering the reaper covers), never when nothing was
            # ever sent to release them, nor when END_SESSION was the last word.
            world.judge(host.name, leases_after_end(
                owner, count, (owner, host.index) not in world.released_sent,
                last is not None and last[0] == "end", req.outcome, host.name,
                world.recent_lines(owner)))


def released(world: WorldView) -> None:
    """F8, whatever the lease TTL: a request that finished cleanly while a server still
    leased it objects sent that server a FREE or an END_SESSION -- leases that only the TTL
    gave back leaked for a whole TTL (pinned objects, a full L1 under long TTLs)."""
    for rid, server in sorted(world.held_after_done):
        found = world.find_request(rid)
        if found is None:
            continue
        engine, req = found
        if not req.done or engine.crashed or rid in world.touched or (rid, server) in world.released_sent:
            continue
        world.violation("F8", server_name(server), f"{rid} finished ({req.outcome}) without faults while "
                        f"{server_name(server)} leased it objects, and no FREE/END_SESSION was ever sent "
                        f"there: its leases stay until the TTL ({world.config.lease_ttl:g}s): "
                        f"{world.recent_lines(rid)}")


def registered(world: WorldView) -> None:
    """F13: after heal and quiescence a live worker is registered with every server that is up
    -- a restart must not leave it unknown there (every store refused not_registered)."""
    for host in world.servers:
        if not host.up or host.node is None:
            continue
        server = host.node.machines[SERVER]
        for engine in world.engines:
            if engine.crashed:
                continue
            for worker in engine.workers:
                if worker.alive and server.instance_state(worker.instance_id) is not InstanceState.REGISTERED:
                    world.judge(host.name, worker_unregistered(
                        worker.name, worker.instance_id, host.name, host.incarnation,
                        worker.instance_id in host.reaped))


def drained(world: WorldView) -> None:
    """After the TTLs: abandoned jobs reaped, every lease back."""
    for host in world.servers:
        if not host.up or host.node is None:
            continue
        server = host.node.machines[SERVER]
        server.handle(TimerFired(), world.now())
        world.judge(host.name, drained_judgement(server.stats()))
