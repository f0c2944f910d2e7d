"""F12 / F8: long after the last request, a server holds no job and no lease.

A pure judgement (see ``mpcache.sim.checks``): shared by the random simulator and the explorer."""
from __future__ import annotations

from collections.abc import Mapping

from mpcache.sim.checks.finding import Finding


def drained(stats: Mapping[str, int]) -> Finding | None:
    """F12 / F8: long after every request ended and every TTL passed, a server holds no job and
    no lease."""
    if stats["jobs"]:
        return "F12", (f"{stats['jobs']} prefetch job(s) still held long after every "
                       f"request ended (abandoned jobs never reaped)")
    if stats["leases_held"]:
        return "F8", f"{stats['leases_held']} read lease(s) still held after every TTL"
    return None
