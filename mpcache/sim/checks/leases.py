"""Read leases: F4 duplicate lookups, F9 over-release, F8 leases past their request, F20 loads on
expired leases, F21 loads on spent leases; and the lease reading both lease oracles share.

A pure judgement (see ``mpcache.sim.checks``): shared by the random simulator and the explorer."""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.server_core import RequestKey
from mpcache.sim.checks.finding import Finding


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


def leases_after_end(owner: str, count: int, never_released: bool, last_was_end: bool, outcome: Any,
                     server: str, recent: str) -> Finding | None:
    """F8: a request that ended cleanly holds no lease where nothing was ever sent to release it,
    nor where END_SESSION was its last word (a LOOKUP landing after it is the reaper's)."""
    if never_released or last_was_end:
        why = "no FREE/END_SESSION was ever sent for it" if never_released else "after its END_SESSION"
        return "F8", (f"{owner} finished ({outcome}) without faults but still holds "
                      f"{count} read lease(s) on {server}, {why}: {recent}")
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
