"""Render the machines' transition tables as Markdown (docs/core_sm.md embeds the output; a test
keeps the two identical). ``python -m mpcache.core_sm.describe`` prints every table.

The server's, the StepPlanner's, the LookupClient's, the TransferClient's and the HealthMonitor's
tables are the
``mpcache.core_sm.table.Table`` objects their ``handle`` executes (the handler of each row is shown); the
L1 index's is the allowed-next-state map of its operations.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from mpcache.core_sm import health, l1_index, lookup_client, planner, server, transfer_client
from mpcache.core_sm.table import Table

TABLES: dict[str, Table[Any] | Mapping[Any, frozenset[Any]]] = {
    **server.TABLES,
    "StepPlanner (one request id, the connector's scheduler side)": planner.TABLE,
    **lookup_client.TABLES,
    **transfer_client.TABLES,
    **health.TABLES,
    "L1Index (one object)": l1_index.TRANSITIONS,
}


def _name(x: object) -> str:
    if isinstance(x, enum.Enum):
        return f"{type(x).__name__}.{x.name}"
    if isinstance(x, type):
        return x.__name__
    return str(x)


def _has_reply_to(event_type: type) -> bool:
    """Whether an event type is a request (answered, so an illegal pair is refused to it)."""
    return any("reply_to" in getattr(k, "__annotations__", {}) for k in event_type.__mro__)


def _nexts(nexts: frozenset[Any]) -> str:
    return ", ".join(sorted(_name(n).split(".")[-1] for n in nexts))


def render(table: Table[Any] | Mapping[Any, frozenset[Any]]) -> str:
    """One row per (state, input): the handler that runs (executing tables) and the next
    states, sorted by name; an assigning table says so, and names its guards."""
    if isinstance(table, Table):
        lines = ["| state | input | handler | next states |", "|---|---|---|---|"]
        for (state, event), row in table.rows.items():
            lines.append(f"| {_name(state)} | {_name(event)} | `{row.handler.__name__}` | {_nexts(row.next_states)} |")
        lines.append("")
        if table.assigns:
            lines.append("Each row names one next state; the dispatcher assigns it after the handler.")
        if table.guards:
            guards = ", ".join(f"{_name(raw)} by `{guard.__name__}`" for raw, guard in table.guards.items())
            lines.append(f"Classified first into the specific input whose row runs: {guards}.")
        if any(_has_reply_to(event) for _state, event in table.rows):
            lines.append(f"Any other pair: a request is refused `{table.illegal_kind.value}`, "
                         "an internal event is counted in `stale_events`.")
        else:
            lines.append("Any other pair is counted in `stale_events` and changes nothing.")
        return "\n".join(lines)
    lines = ["| state | input | next states |", "|---|---|---|"]
    for (state, event), nexts in table.items():
        lines.append(f"| {_name(state)} | {_name(event)} | {_nexts(nexts)} |")
    return "\n".join(lines)


def render_all() -> str:
    return "\n\n".join(f"### {title}\n\n{render(table)}" for title, table in TABLES.items())


if __name__ == "__main__":
    print(render_all())
