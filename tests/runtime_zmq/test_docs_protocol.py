"""docs/protocol.md's error-kind and limit tables are generated from the code
(``python -m mpcache.runtime_zmq.protocol_doc docs/protocol.md``, part of ``make docs``): what the
page says is what the server does. Before, it gave three wrong defaults (--max-frame-mb 64 for 16,
--max-tokens 1,048,576 for 524,288, MAXMSGSIZE 4x the frame limit for 2x) and left out a kind."""
from __future__ import annotations

import pathlib

import pytest

from mpcache.core_sm.errors import ErrorKind
from mpcache.runtime_zmq import cli, protocol_doc, wire

DOC = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()


@pytest.mark.parametrize("name", sorted(protocol_doc.TABLES))
def test_protocol_doc_tables_are_the_code(name: str) -> None:
    assert protocol_doc.embedded(DOC, name) == protocol_doc.TABLES[name](), (
        f"docs/protocol.md's {name} table is stale: run `python -m mpcache.runtime_zmq.protocol_doc docs/protocol.md`")


def test_the_tables_carry_the_values_the_server_runs_with() -> None:
    limits = protocol_doc.embedded(DOC, "limits")
    args = cli.build_parser().parse_args([])
    assert f"| `--max-frame-mb` | {args.max_frame_mb:g} MiB |" in limits
    assert f"| `--max-tokens` | {args.max_tokens:,} tokens |" in limits
    assert f"= {2 * int(args.max_frame_mb * (1 << 20)):,} B" in limits  # server.py: MAXMSGSIZE = 2 x the frame limit
    assert f"| `wire.Limits.max_frames` (fixed) | {wire.Limits().max_frames} |" in limits
    kinds = protocol_doc.embedded(DOC, "error kinds")
    assert all(f"| `{k.value}` |" in kinds for k in ErrorKind)


def test_rewrite_replaces_only_the_tables() -> None:
    row = next(line for line in DOC.splitlines() if line.startswith("| `--max-tokens` |"))
    stale = DOC.replace(row, "| `--max-tokens` | 1,048,576 tokens | token ids in one key |")
    assert stale != DOC and protocol_doc.rewrite(stale) == DOC
