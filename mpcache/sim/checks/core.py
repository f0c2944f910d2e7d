"""SAFETY: core_sm's own invariants after an event, and L1's byte and slot accounting.

A pure judgement (see ``mpcache.sim.checks``): shared by the random simulator and the explorer."""
from __future__ import annotations

from typing import Any

from mpcache.sim.checks.finding import Finding


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
