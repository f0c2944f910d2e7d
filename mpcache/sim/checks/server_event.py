"""The oracle run after every event a simulated server handles (``World._observe``).

It keeps the world's per-incarnation bookkeeping of what the server was asked (replies owed,
lookups handled, each request's last session event, heartbeats seen) and judges, in this order:
F5 (a status query overtook its lookup), F11 (one reply per request), SAFETY (core_sm's own
invariants, L1's accounting), F4 (a duplicate LOOKUP leased twice), HIT (a hit for data never
stored, ``hit_history``) and store admission (``admission``). The first violation stops the run.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mpcache.core_sm.messages import EndSession, Lookup, Ping, QueryPrefetchStatus, WaitPrefetchStatus
from mpcache.core_sm.effects import Reply
from mpcache.core_sm.server_core import RequestKey
from mpcache.core_sm.server_instances import InstanceState
from mpcache.runtime_trio import Node
from mpcache.sim.adversary import ADVERSARY
from mpcache.sim.checks import admission, hit_history
from mpcache.sim.checks.core import bytes_accounting, core_invariants
from mpcache.sim.checks.leases import duplicate_lookup_leases
from mpcache.sim.checks.quiescence import holds_leases
from mpcache.sim.checks.replies import reply_accounting
from mpcache.sim.checks.status import status_before_lookup
from mpcache.sim.ports import SERVER, Via

if TYPE_CHECKING:
    from mpcache.sim.checks.world_view import WorldView

_SERVER_PREFIX = len("server")


def after_event(world: WorldView, node: Node, event: Any, effects: list[Any], now: float) -> None:
    """Judge one event server ``node`` handled (``effects``: what it answered)."""
    host = world.servers[int(node.name[_SERVER_PREFIX:])]
    server = node.machines[SERVER]
    t = type(event)
    reply_to = getattr(event, "reply_to", None)
    via = reply_to if isinstance(reply_to, Via) else None  # a request some node sent (a reply is owed)
    name = t.__name__
    honest = not (via is not None and via.node == ADVERSARY)
    if honest and t is Ping and isinstance(event.instance_id, int):
        if server.instance_state(event.instance_id) is InstanceState.REGISTERED:
            host.heartbeat_seen[event.instance_id] = now
    if via is not None:
        host.awaiting_reply[via] = (name, now)
        if honest and (name == "QueryPrefetchStatus" or name == "WaitPrefetchStatus"):
            rid = event.request_id
            in_flight = world.lookups_in_flight.get((rid, host.index), {})
            world.judge(node.name, status_before_lookup(
                rid, host.lookups_handled, any(t0 >= host.started_at for t0 in in_flight.values()), host.name))
    if not honest:
        pass  # its ids are not the honest requests' sessions
    elif t is Lookup:
        rid = event.key.request_id
        host.lookups_handled.add(rid)
        host.last_session_event[rid] = ("lookup", now)
        found = world.find_request(rid)
        if found is not None and found[1].done and holds_leases(host, str(event.peer), rid):
            world.held_after_done.add((rid, host.index))  # its LOOKUP landed after it finished
    elif t is EndSession:
        host.last_session_event[event.request_id] = ("end", now)
    world.judge(node.name, reply_accounting(host.awaiting_reply, event, via, effects))
    # Per-event safety: core_sm's own invariants, plus exact per-owner lease accounting.
    world.judge(node.name, core_invariants(server))
    if t is Lookup and honest:
        world.judge(host.name, duplicate_lookup_leases(
            server, RequestKey(event.peer, event.key.request_id), event.num_readers))
    world.judge(node.name, bytes_accounting(server))
    if honest and (t is QueryPrefetchStatus or t is WaitPrefetchStatus):
        for effect in effects:
            if type(effect) is Reply and isinstance(effect.result, int) and effect.result > 0:
                hit_history.check(world, node.name, event.request_id, effect.result, reply_to)
    if world.config.store_threshold > 1:  # every LOOKUP counts, the adversary's too
        admission.check(world, host, server, event)
