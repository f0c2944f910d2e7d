"""LookupServer's reap queue (and timer heap) holds what is live, not one entry per request for a whole TTL."""
from __future__ import annotations

from typing import Any

import pytest

from mpcache import core_sm

import mpcache.core_sm.timers
from mpcache.core_sm.messages import EndSession, Lookup, TimerFired
from mpcache.core_sm.server import LookupServer, ServerConfig
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


def test_reap_queue_keeps_arming_order_never_fires_early_and_compacts_stale_entries() -> None:
    live: set[str] = set()
    q: core_sm.timers.ReapQueue[str] = core_sm.timers.ReapQueue(live.__contains__, slack=4)
    for name, deadline in (("a", 1.0), ("b", 2.0), ("c", 1.5), ("d", 3.0)):  # c: a clock that stepped back
        live.add(name)
        q.push(deadline, name)
    assert q.next_deadline() == 1.0 and q.pop_due(1.9) == "a" and q.pop_due(1.9) is None
    assert q.pop_due(2.0) == "b" and q.pop_due(2.0) == "c"  # held to b's deadline, not earlier
    live.discard("d")  # ended before its deadline: stale, skipped
    assert q.next_deadline() is None and len(q) == 0
    for i in range(1000):  # one live entry in front of many that end at once
        live.add(f"x{i}")
        q.push(10.0 + i, f"x{i}")
        if i:
            live.discard(f"x{i}")
    assert len(q) <= 2 * 1 + 4 + 1 and q.compactions > 0
    assert q.pop_due(1e9) == "x0" and q.pop_due(1e9) is None

