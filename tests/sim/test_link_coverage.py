"""The default seeds drive every input of the client's link machines and every waiter row of the
server: each event kind a ``ServerLink`` and its ``HealthMonitor`` take, and each row of the
server's job table that a ``WAIT_PREFETCH_STATUS`` or its deadline runs (an honest client's
waits, not the adversary's). The kinds come from core_sm (``sim/link_coverage.py`` reads the
union types and the table), so a kind added there that no seed reaches fails here."""
from __future__ import annotations

import typing

from mpcache.core_sm import health, server_link
from mpcache.core_sm.messages import WaitPrefetchStatus
from mpcache.core_sm.server_jobs import JOB_TABLE, WaiterDeadline
from mpcache.sim import link_coverage as lc
from mpcache.sim.runner import run_many

SEEDS = 200
# Kinds no default seed can reach, with the reason. Empty: every kind is reached.
UNREACHABLE: dict[str, str] = {}


def test_kinds_are_read_from_core_sm() -> None:
    assert set(lc.LINK_INPUTS) == set(server_link.INPUT_KINDS) == set(typing.get_args(server_link.LinkEvent))
    assert set(lc.HEALTH_INPUTS) == set(typing.get_args(health.HealthEvent)) and len(lc.HEALTH_INPUTS) >= 9
    # every state in which the job table lets a wait in, and the waiter's own deadline
    waits = {state for state, kind in JOB_TABLE.rows if kind is WaitPrefetchStatus}
    assert waits == set(JOB_TABLE.states)
    assert set(lc.WAITER_ROWS) == {(s, WaitPrefetchStatus) for s in waits} | {
        (s, k) for s, k in JOB_TABLE.rows if k is WaiterDeadline}


def test_default_seeds_reach_every_link_input_and_waiter_row() -> None:
    total: dict[str, int] = {}
    results = run_many(range(SEEDS), "default", jobs=2)
    assert all(r.ok for r in results), [(r.seed, r.violation) for r in results if not r.ok]
    for r in results:
        for k, v in r.coverage:
            total[k] = total.get(k, 0) + v
    wanted = ([lc.link_key(k) for k in lc.LINK_INPUTS] + [lc.health_key(k) for k in lc.HEALTH_INPUTS]
              + [lc.waiter_key(row) for row in lc.WAITER_ROWS])
    missing = [k for k in wanted if total.get(k, 0) == 0 and k not in UNREACHABLE]
    assert not missing, f"{SEEDS} default seeds never reached {missing}"
    assert set(UNREACHABLE) <= set(wanted), "an exemption names no kind core_sm has"
