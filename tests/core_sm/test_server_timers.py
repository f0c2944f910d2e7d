"""LookupServer's reap queue (and timer heap) holds what is live, not one entry per request for a whole TTL."""
from __future__ import annotations

from typing import Any

import pytest

import core_sm.timers
from core_sm.messages import EndSession, Lookup, TimerFired
from core_sm.server import LookupServer, ServerConfig
from sm_helpers import C, key, tokens


def _server() -> LookupServer:
    # production TTLs
    return LookupServer(ServerConfig(chunk_size=C, abandoned_job_ttl=60.0, tombstone_ttl=60.0, lease_ttl=300.0))


def test_ended_lookups_leave_a_bounded_reap_queue() -> None:
    # one instant: each lookup's reap entry would otherwise stay 60 s after its job ended
    server = _server()
    toks = tokens(1)
    longest = 0
    for i in range(100_000):
        rid = f"r{i}"
        server.handle(Lookup(key(rid, toks), 1, reply_to=("l", i)), 5.0)
        server.handle(EndSession(rid, reply_to=("e", i)), 5.0)
        stats = server.stats()
        longest = max(longest, stats["reap_queue"], stats["timers"])
    # an ended job's entry goes as soon as it reaches the front (here at once)
    assert longest <= 300, longest
    assert server.stats()["jobs"] == 0


def _run(server: LookupServer) -> list[Any]:
    """Open jobs at distinct times among many that end at once, then let time pass."""
    toks = tokens(1)
    out: list[Any] = []
    for i in range(300):
        now = i / 1000
        out += server.handle(Lookup(key(f"keep{i}", toks), 1, reply_to=("k", i)), now)
        for j in range(20):
            rid = f"end{i}.{j}"
            out += server.handle(Lookup(key(rid, toks), 1, reply_to=("l", i, j)), now)
            out += server.handle(EndSession(rid, reply_to=("e", i, j)), now)
    out.append(server.next_deadline())
    for t in (60.0, 60.1495, 60.2, 61.0):
        out += server.handle(TimerFired(), t)
        out.append((server.stats()["jobs"], server.next_deadline()))
    return out


def test_compaction_changes_no_effect_and_no_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    compacted = _server()
    effects = _run(compacted)
    assert compacted.stats()["reap_queue_compactions"] > 0
    # the open jobs are reaped oldest first, each at its own TTL
    assert effects[-3][0] == 150 and effects[-3][1] == pytest.approx(60.150)
    assert effects[-1] == (0, None)
    monkeypatch.setattr(core_sm.timers, "DEFAULT_COMPACT_SLACK", 10**9)
    never = _server()
    assert _run(never) == effects
    assert never.stats()["reap_queue_compactions"] == 0
