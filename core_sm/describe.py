"""Render the machines' transition tables as Markdown (docs/core_sm.md embeds the output; a test
keeps the two identical). ``python -m core_sm.describe`` prints every table."""
from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from core_sm import l1_index, lookup_client, server, transfer_client

TABLES: dict[str, Mapping[Any, frozenset[Any]]] = {
    "LookupServer (job of a request id, transfer)": server.TRANSITIONS,
    "LookupClient (lookup of a request id)": lookup_client.TRANSITIONS,
    "TransferClient (one op)": transfer_client.TRANSITIONS,
    "L1Index (one object)": l1_index.TRANSITIONS,
}


def _name(x: object) -> str:
    if isinstance(x, enum.Enum):
        return f"{type(x).__name__}.{x.name}"
    if isinstance(x, type):
        return x.__name__
    return str(x)


def render(table: Mapping[Any, frozenset[Any]]) -> str:
    """One row per (state, input): the next states, sorted by name."""
    lines = ["| state | input | next states |", "|---|---|---|"]
    for (state, event), nexts in table.items():
        names = ", ".join(sorted(_name(n).split(".")[-1] for n in nexts))
        lines.append(f"| {_name(state)} | {_name(event)} | {names} |")
    return "\n".join(lines)


def render_all() -> str:
    return "\n\n".join(f"### {title}\n\n{render(table)}" for title, table in TABLES.items())


if __name__ == "__main__":
    print(render_all())
