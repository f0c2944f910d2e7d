"""Which inputs of the client link and which server waiter rows a world exercised.

The simulator counts, per world, every event kind it feeds a ``ServerLink`` (``link_in_<Kind>``),
every event kind that link's ``HealthMonitor`` handles (``health_in_<Kind>``; its typed timers
are what a ``TimerFired`` runs) and every row of the server's job table that answers a
``WAIT_PREFETCH_STATUS`` (``waiter_row_<STATE>_<Event>``, only an honest client's waits). The
counts land in the world's coverage counters (``World.coverage``); tests/sim/test_link_coverage.py
asserts that across the default seeds every kind core_sm declares is reached, so a kind added to
core_sm that no seed reaches fails there.

The kinds are read from core_sm itself (``LINK_INPUTS``, ``HEALTH_INPUTS``, ``WAITER_ROWS``), never
listed here. Counting uses the tables' own ``Dispatcher.trace`` (a list the simulator sets and
drains after each event): core_sm is not patched.
"""
from __future__ import annotations

import typing
from typing import Any

from mpcache.core_sm.health import HealthEvent
from mpcache.core_sm.messages import TimerFired, WaitPrefetchStatus
from mpcache.core_sm.server_jobs import JOB_TABLE, WaiterDeadline
from mpcache.core_sm.server_link import LinkEvent
from mpcache.core_sm.timers import Timer

LINK_INPUTS: tuple[type, ...] = typing.get_args(LinkEvent)
HEALTH_INPUTS: tuple[type, ...] = typing.get_args(HealthEvent)
# The waiter's events: the request that makes one, and the timer that answers it None.
WAITER_EVENTS: tuple[type, ...] = (WaitPrefetchStatus, WaiterDeadline)
WAITER_ROWS: tuple[tuple[Any, type], ...] = tuple(k for k in JOB_TABLE.rows if k[1] in WAITER_EVENTS)


_LINK_KEYS: dict[type, str] = {}
_HEALTH_KEYS: dict[type, str] = {}


def link_key(kind: type) -> str:
    key = _LINK_KEYS.get(kind)
    if key is None:
        key = _LINK_KEYS[kind] = f"link_in_{kind.__name__}"
    return key


def health_key(kind: type) -> str:
    key = _HEALTH_KEYS.get(kind)
    if key is None:
        key = _HEALTH_KEYS[kind] = f"health_in_{kind.__name__}"
    return key


def waiter_key(row: tuple[Any, type]) -> str:
    return f"waiter_row_{row[0].name}_{row[1].__name__}"


def _bump(stats: dict[str, int], key: str) -> None:
    stats[key] = stats.get(key, 0) + 1


def count_link_input(stats: dict[str, int], event: object) -> None:
    _bump(stats, link_key(type(event)))


def drain_health(stats: dict[str, int], trace: list[tuple[Any, type, Any]] | None) -> None:
    """Count the rows a monitor ran since the last drain (a timer row is its ``TimerFired``)."""
    if not trace:
        return
    for _state, kind, _after in trace:
        _bump(stats, health_key(TimerFired if issubclass(kind, Timer) else kind))
    trace.clear()


def drain_waiters(stats: dict[str, int], trace: list[tuple[Any, type, Any]] | None, honest: bool) -> None:
    """Count the waiter rows a server's job table ran since the last drain; an adversary's wait
    (``honest`` False) counts only the timers it ran meanwhile."""
    if not trace:
        return
    for state, kind, _after in trace:
        if kind is WaiterDeadline or (honest and kind is WaitPrefetchStatus):
            _bump(stats, waiter_key((state, kind)))
    trace.clear()
