"""The oracles' judgements, shared by the random simulator (``sim/world.py``, ``sim/engine.py``)
and the exhaustive explorer (``sim/explore.py``).

Each check is a pure function of what the shell observed: it returns ``(code, message)`` for a
violation (the code a failure of ``reference/lmcache_mp.md`` §F, see ``sim/oracles.py``) or
None. The shells keep their own bookkeeping (what was sent, handled, delivered) and raise the
violation their own way; the judgement -- what counts as the failure, and its words -- is here
once, so a counterexample the explorer finds is the violation the simulator reports.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.effects import ErrorReply, Reply
from mpcache.core_sm.server_core import RequestKey
# F24, the KV-cache groups' judgements, live with the groups' model (sim/groups.py); named here so
# that the explorer and the random simulator take every judgement from one module.
from mpcache.sim.groups import partial_restore as partial_restore
from mpcache.sim.groups import unrestorable_hit as unrestorable_hit
from mpcache.sim.trace import short

Finding = tuple[str, str]  # (violation code, message)

# Replies to requests whose answer may legitimately come later than the handling event.
DEFERRED_REPLIES = ("Store", "Retrieve", "WaitPrefetchStatus", "CommitTransfer", "RegisterInstance")


def reply_accounting(awaiting: MutableMapping[Any, Any], event: Any, via: Any, effects: Iterable[Any],
                     deferred: Iterable[str] = DEFERRED_REPLIES) -> Finding | None:
    """F11: every request handled gets exactly one reply. ``awaiting`` maps the reply_to of each
    request handled and not yet answered (this incarnation) to anything; ``via`` is the event's
    reply_to when it is a request the oracle counts (already entered in ``awaiting``), else None.
    Entries answered are removed."""
    for effect in effects:
        t = type(effect)
        if t is Reply or t is ErrorReply:
            if effect.reply_to not in awaiting:
                return "F11", f"second reply to one request: {short(effect)}"
            del awaiting[effect.reply_to]
    if via is not None and via in awaiting and type(event).__name__ not in deferred:
        return "F11", f"{short(event, 120)} handled without a reply"
    return None


def core_invariants(server: Any, what: str = "") -> Finding | None:
    """SAFETY: core_sm's own ``check_invariants`` after one event of ``server`` (any machine; a
    server skips a quiet event's where it cannot fail: ``LookupServer.check_invariants_after_event``)."""
    after_event = getattr(server, "check_invariants_after_event", None)
    try:
        if after_event is not None:
            after_event()
        else:
            server.check_invariants()
    except AssertionError as exc:
        return "SAFETY", f"core_sm {what + ' ' if what else ''}invariant: {exc}"
    return None


def bytes_accounting(server: Any) -> Finding | None:
    """SAFETY: L1 never holds more bytes or slots than it has."""
    index = server.index
    used = index.bytes_used
    if used > index.num_slots * index.slot_bytes or index.used_slots > index.num_slots:
        return "SAFETY", (f"bytes accounting: {used} B in {index.used_slots} of "
                          f"{index.num_slots} slots of {index.slot_bytes} B")
    return None


def duplicate_lookup_leases(server: Any, rid: RequestKey, num_readers: int) -> Finding | None:
    """F4: after a LOOKUP, its request holds at most ``num_readers`` counts on each object."""
    index = server.index
    for key in index.keys_leased_by(rid):
        n = index.read_count(key, rid)
        if n > max(num_readers, 1):
            return "F4", (f"{rid} holds {n} read counts on {key.wire_name()[:12]} after a "
                          f"duplicate LOOKUP (num_readers={num_readers}): the first set leaked")
    return None


def free_released_others(before: Mapping[Any, int], after: Mapping[Any, int], rid: str) -> Finding | None:
    """F9: a FREE_LOOKUP_LOCKS from ``rid`` released only ``rid``'s own leases (``before`` /
    ``after``: the server's leases by owner around it, time-driven expiries run first)."""
    for owner, count in before.items():
        if isinstance(owner, RequestKey) and owner.request_id != rid and after.get(owner, 0) < count:
            return "F9", (f"FREE_LOOKUP_LOCKS from {rid} released {owner}'s read "
                          f"lease(s) ({count} -> {after.get(owner, 0)}): {owner}'s objects may now be "
                          f"evicted before its RETRIEVE")
    return None


def status_before_lookup(rid: str, lookups_handled: Iterable[str], lookup_in_flight: bool,
                         server: str) -> Finding | None:
    """F5: a status query is handled before its request's LOOKUP, which was still on its way."""
    if rid not in lookups_handled and lookup_in_flight:
        return "F5", (f"status query for {rid} handled before its LOOKUP, which "
                      f"was still on its way to {server}; the answer cannot be the lookup's")
    return None


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


def leases_after_end(owner: str, count: int, never_released: bool, last_was_end: bool, outcome: Any,
                     server: str, recent: str) -> Finding | None:
    """F8: a request that ended cleanly holds no lease where nothing was ever sent to release it,
    nor where END_SESSION was its last word (a LOOKUP landing after it is the reaper's)."""
    if never_released or last_was_end:
        why = "no FREE/END_SESSION was ever sent for it" if never_released else "after its END_SESSION"
        return "F8", (f"{owner} finished ({outcome}) without faults but still holds "
                      f"{count} read lease(s) on {server}, {why}: {recent}")
    return None


def drained(stats: Mapping[str, int]) -> Finding | None:
    """F12 / F8: long after every request ended and every TTL passed, a server holds no job and
    no lease."""
    if stats["jobs"]:
        return "F12", (f"{stats['jobs']} prefetch job(s) still held long after every "
                       f"request ended (abandoned jobs never reaped)")
    if stats["leases_held"]:
        return "F8", f"{stats['leases_held']} read lease(s) still held after every TTL"
    return None


def worker_unregistered(worker: str, instance_id: int, server: str, incarnation: int, reaped: bool) -> Finding:
    """F13 / F19: after quiescence a live worker is not registered with a server that is up -- a
    restart left it unknown there (F13), or the server reaped it and it never registered again
    (F19): its stores and retrieves are refused not_registered."""
    if reaped:
        return "F19", (f"{worker} (instance {instance_id}) was reaped by {server} and never registered again: "
                       f"its retrieves are refused not_registered forever")
    return "F13", (f"{worker} (instance {instance_id}) is not registered with {server} (incarnation "
                   f"{incarnation}) after heal: its stores and retrieves are refused not_registered")


def reaped_while_live(worker: str, instance_id: int, server: str, seen: float | None, ttl: float | None,
                      now: float) -> Finding | None:
    """F19 (LMCache #4715): a server may reap a live instance only after ``instance_ttl`` without
    a heartbeat from it -- one whose heartbeat it handled (at ``seen``) less than that ago was live
    (compared as the server does, ``seen + ttl > now``: ``now - seen`` may round below it)."""
    if seen is not None and ttl is not None and seen + ttl > now:
        return "F19", (f"{worker} (instance {instance_id}) reaped although its heartbeat reached {server} "
                       f"{now - seen:.3f}s ago (instance_ttl {ttl:g}s): a live idle instance; its retrieves "
                       f"are refused not_registered from now on")
    return None


def leases_unaccounted(rid: str, hit_tokens: int | None, leases_freed: Iterable[tuple[int, int]],
                       retrieve: tuple[int, int] | None) -> Finding | None:
    """F8 at allocation: every token range of the hit ``[0, hit_tokens)`` is either read by the
    planned retrieve (``retrieve``: its ``(start, end)``) or has its read leases freed at once
    (``leases_freed``) -- a lease nobody will read must not wait for the request's END_SESSION (a
    long decode, a deep queue)."""
    if not hit_tokens:
        return None
    freed = tuple(leases_freed)
    covered = 0
    for start, end in sorted(freed + ((retrieve,) if retrieve is not None else ())):
        if start > covered:
            break
        covered = max(covered, end)
    if covered < hit_tokens:
        return "F8", (f"{rid}: hit of {hit_tokens} tokens, but after allocation only [0, {covered}) is retrieved "
                      f"or freed (freed {list(freed)}, retrieve {retrieve}): the rest stays leased until the "
                      f"request ends")
    return None


def load_planned_again(rid: str, start: int, end: int, preempted: bool) -> Finding:
    """F21: one lookup leases the hit once: the first load used those leases (or the first
    allocation freed them); a second load of the request reads chunks nothing holds for it."""
    return "F21", (f"{rid}: load [{start}, {end}) planned again{' after preemption' if preempted else ''}, on "
                   f"the leases of a lookup its first allocation already spent")


def retrieve_on_expired_leases(rid: str, start: int, end: int, now: float, waited: float, lease_ttl: Any,
                               earliest: float | None, held: bool, last_seen: float | None) -> Finding | None:
    """F20: a planned load reads through read leases its request still holds at the server. A
    request that waited in the queue longer than its leases live must renew them first or
    recompute: once they expired, the objects may be evicted and the hit is a load error.
    ``earliest``: the earliest expiry of the leases the load reads (at the servers it loads from),
    ``held``: whether the request holds all of them; ``last_seen``: when they were due to expire
    when last seen held, if no restart or clear took them since (None: unknown or taken)."""
    expired_at = earliest if earliest is not None and earliest <= now else None
    if expired_at is None and not held and last_seen is not None and last_seen <= now:
        # gone, and due to expire by now anyway: expired
        expired_at = last_seen
    if expired_at is None:
        return None
    return "F20", (f"{rid}: load [{start}, {end}) planned at {now:.3f} after waiting {waited:.3f} s in the "
                   f"queue, on read leases that expired at {expired_at:.3f} (lease TTL {lease_ttl}): the hit "
                   f"becomes a load error once the objects are evicted")


def misplaced_load(rid: str, rank: int, server: int, ranks_per_server: Any) -> Finding | None:
    """F2: each rank loads its hit from the server that answered it for that rank (the lookup's
    ranks per server, where the hit is leased); loaded from another server, the hit is lost (a
    load error at best, the leases at the right server left to the TTL)."""
    if ranks_per_server is None or rank in ranks_per_server[server]:
        return None
    held = [s for s, ranks in enumerate(ranks_per_server) if rank in ranks]
    return "F2", (f"{rid}: rank {rank} loads its hit from server{server}, but server{held[0] if held else '?'} "
                  f"answered (and leased) that rank's part of it: the hit is lost")


def parked_request(request: str, correlation: int, server: int) -> Finding:
    """LIVENESS: after quiescence, a request refused not_registered still waits on a registration
    (it must have been resent once, or failed with a reason)."""
    return "LIVENESS", (f"{request} #{correlation} to server{server}, refused not_registered, still waits "
                        f"for a registration")


def resend_refused(request: str, correlation: int, server: int, named: Any, current: Any,
                   reaped: bool) -> Finding | None:
    """LIVENESS: a resend naming registration ``named`` was refused not_registered by the same
    server incarnation, where ``current`` is the instance's registration now (None: none) and
    ``reaped`` whether the server reaped the instance meanwhile. Refused while ``named`` is still
    the instance's (registration ids are never reused within one incarnation): refused by a record
    of its original, not for a lost registration. Refused while another registration of the same
    instance replaced it and nothing dropped the instance: a second registration of the same
    fields (the worker's and the link's crossing) orphaned the resend."""
    if current == named:
        return "LIVENESS", (f"{request} #{correlation} resent to server{server} naming registration {named}, "
                            f"still the instance's, was refused not_registered again")
    if current is not None and not reaped:
        return "LIVENESS", (f"{request} #{correlation} resent to server{server} naming registration {named} "
                            f"was refused not_registered: registration {current} of the same instance "
                            f"replaced it meanwhile, orphaning the resend")
    return None


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


def lease_span(indexes: Sequence[Any], hashes: Sequence[bytes], first_chunk: int, end_chunk: int,
               scheduler: str | None, request_id: str) -> tuple[float | None, bool]:
    """The earliest expiry of the read leases a scheduler's request holds on chunks
    ``[first_chunk, end_chunk)`` of every rank (``indexes[rank]``: the L1 index of the server that
    rank loads from), and whether it holds all of them. The lookup's leases are its scheduler's
    request (peer, id); a server that ignores peers (trust-all) files them under no peer. The
    random simulator's and the explorer's lease oracles both read leases through this."""
    owners = (RequestKey(scheduler, request_id), RequestKey(None, request_id))
    earliest: float | None = None
    held = True
    for chunk in range(first_chunk, min(end_chunk, len(hashes))):
        for rank, index in enumerate(indexes):
            okey = ObjectKey(hashes[chunk], rank)
            expiry = index.lease_expiry(okey, owners[0])
            if expiry is None:
                expiry = index.lease_expiry(okey, owners[1])
            if expiry is None:
                held = False
            elif earliest is None or expiry < earliest:
                earliest = expiry
    return earliest, held
