"""F5: a status query overtook its lookup.

A pure judgement (see ``mpcache.sim.checks``): shared by the random simulator and the explorer."""
from __future__ import annotations

from collections.abc import Iterable

from mpcache.sim.checks.finding import Finding


def status_before_lookup(rid: str, lookups_handled: Iterable[str], lookup_in_flight: bool,
                         server: str) -> Finding | None:
    """F5: a status query is handled before its request's LOOKUP, which was still on its way."""
    if rid not in lookups_handled and lookup_in_flight:
        return "F5", (f"status query for {rid} handled before its LOOKUP, which "
                      f"was still on its way to {server}; the answer cannot be the lookup's")
    return None
