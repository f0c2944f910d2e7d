"""docs/core_sm.md is the contract others build against: every class, hook and field it names
must exist with that name."""
from __future__ import annotations

import keyword
import pathlib
import re

import attrs

from mpcache import core_sm

import mpcache.core_sm.chunks
import mpcache.core_sm.effects
import mpcache.core_sm.errors
import mpcache.core_sm.health
import mpcache.core_sm.l1_index
import mpcache.core_sm.lookup_client
import mpcache.core_sm.lookup_ops
import mpcache.core_sm.messages
import mpcache.core_sm.server
import mpcache.core_sm.server_core
import mpcache.core_sm.server_instances
import mpcache.core_sm.server_jobs
import mpcache.core_sm.job_table
import mpcache.core_sm.planner
import mpcache.core_sm.planner_ops
import mpcache.core_sm.server_l2
import mpcache.core_sm.server_link
import mpcache.core_sm.server_transfers
import mpcache.core_sm.table
import mpcache.core_sm.timers
import mpcache.core_sm.transfer_client
import mpcache.core_sm.transfer_ops
import mpcache.core_sm.admission
import mpcache.core_sm.holdings
import mpcache.core_sm.keys
import mpcache.core_sm.trace
DOC = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "core_sm.md").read_text()
MODULES = [core_sm.server_link,  # first: a name it shares with a later module (Reply) is the later one's
           core_sm.chunks, core_sm.effects, core_sm.errors, core_sm.health, core_sm.l1_index, core_sm.lookup_client, core_sm.lookup_ops,
           core_sm.messages, core_sm.server, core_sm.server_core, core_sm.server_instances,
           core_sm.server_jobs, core_sm.job_table, core_sm.server_l2, core_sm.server_transfers, core_sm.table, core_sm.timers, core_sm.transfer_client, core_sm.transfer_ops,
           core_sm.keys, core_sm.admission, core_sm.holdings, core_sm.trace, core_sm.planner, core_sm.planner_ops]
NAMESPACE = {name: getattr(m, name) for m in MODULES for name in dir(m) if not name.startswith("__")}


def test_every_class_the_doc_calls_exists_with_those_fields() -> None:
    checked = 0
    for name, args in re.findall(r"`([A-Z][A-Za-z0-9]+)\(([^`]*)\)`", DOC):
        assert name in NAMESPACE, f"docs name {name} but core_sm has no such class"
        cls = NAMESPACE[name]
        if not attrs.has(cls) or not args.strip() or "..." in args:
            continue
        fields = [f.name for f in attrs.fields(cls)]
        parts = [a.strip() for a in re.split(r",\s*(?![^()]*\))", args)]
        if any(keyword.iskeyword(p) or p[:1] in "-0123456789\"'" for p in parts):
            continue  # an example value, not a signature
        for arg in parts:
            field = arg.split("=")[0].split(":")[0].strip()
            if field.isidentifier():
                assert field in fields, f"{name}: the doc's field {field!r} is not one of {fields}"
                checked += 1
    assert checked > 50


def test_every_hook_the_doc_names_exists() -> None:
    classes = {"LookupServer": core_sm.server.LookupServer,
               "LookupClient": core_sm.lookup_client.LookupClient,
               "TransferClient": core_sm.transfer_client.TransferClient}
    rows = re.findall(r"\| `(LookupServer|LookupClient|TransferClient)` \| `(_[a-z_]+)\(", DOC)
    assert len(rows) >= 12
    for cls, hook in rows:
        assert callable(getattr(classes[cls], hook, None)), f"{cls}.{hook} is documented but missing"


def test_error_kinds_match() -> None:
    documented = set(re.search(r"`ErrorKind` \(enum, value = wire name\): `([^`]*)`", DOC).group(1)  # type: ignore[union-attr]
                     .replace(" ", "").split(","))
    assert documented == {k.name for k in core_sm.errors.ErrorKind}


def test_doc_tables_are_the_code_tables() -> None:
    from mpcache.core_sm.describe import render_all

    begin, end = "<!-- BEGIN GENERATED TABLES -->\n", "\n<!-- END GENERATED TABLES -->"
    assert begin in DOC and end in DOC
    embedded = DOC[DOC.index(begin) + len(begin):DOC.index(end)]
    assert embedded == render_all(), "docs/core_sm.md tables are stale: paste `python -m mpcache.core_sm.describe`"


def test_client_stats_keys_are_the_documented_ones() -> None:
    machines = {"LookupClient": core_sm.lookup_client.LookupClient(),
                "TransferClient": core_sm.transfer_client.TransferClient()}
    for name, machine in machines.items():
        m = re.search(rf"`{name}\.stats\(\)`: `([^`]*)`", DOC)
        assert m is not None, f"docs list no stats keys for {name}"
        documented = {k.strip() for k in m.group(1).split(",")}
        assert documented == set(machine.stats()), f"{name}.stats() keys differ from the doc"


def test_every_executing_table_is_in_the_doc() -> None:
    """The docs show the tables each machine's ``handle`` runs -- the client machines' too."""
    from mpcache.core_sm import describe, health, lookup_client, planner, transfer_client

    tables = [*core_sm.server.TABLES.values(), planner.TABLE, *lookup_client.TABLES.values(),
              *transfer_client.TABLES.values(), health.TABLE]
    assert len(lookup_client.TABLES) == 2 and len(transfer_client.TABLES) == 3
    for table in tables:
        assert isinstance(table, core_sm.table.Table)
        (title,) = [title for title, t in describe.TABLES.items() if t is table]
        assert f"### {title}\n\n| state | input | handler | next states |" in DOC, title


def test_readme_layout_row_names_every_machine() -> None:
    """README's core_sm row names each machine with a transition table (the docs' tables), the
    connection machine and the block arithmetic: it once stopped at the lookup and transfer
    clients, with no planner, health monitor or blocks."""
    from mpcache.core_sm import describe

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `mpcache/core_sm/` |"))
    machines = {title.split()[0] for title in describe.TABLES}
    assert {"StepPlanner", "HealthMonitor", "LookupServer"} <= machines
    for name in sorted(machines | {"ServerLink", "blocks"}):
        assert f"`{name}`" in row, f"README's core_sm row does not name {name}"
