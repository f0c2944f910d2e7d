"""Machines as the explorer's states (``sim/explore.py``): a copy that shares what never changes,
a canonical snapshot to fingerprint, the deadline a machine is really waiting for, and the bytes a
state holds.

* ``copy.deepcopy`` of a ``Dispatcher`` rebinds its handlers to the copied machine and shares its
  table and frozen rows (registered here, on import).
* ``dispatchers(machine)``: every dispatcher of a machine and of the sub-machines it holds.
* ``snapshot(obj, ren)``: a canonical nested-tuple picture of a machine's state, strings renamed
  by ``ren`` (symmetry), lazily deleting heaps reduced to their live entries in firing order.
* ``next_deadline(machine, horizon)``: when a machine next has something to do (a link's answered
  requests and, past the horizon, its monitor's timers left out).
* ``deep_size(obj)``: bytes of an object graph, tables and types excepted.
"""
from __future__ import annotations

import copy
import enum
import gc
import math
import sys
import types
from collections import deque
from typing import Any

import attrs

from mpcache.core_sm.chunks import ChunkChain
from mpcache.core_sm.server_link import ServerLink
from mpcache.core_sm.table import Dispatcher, Table

def _copy_dispatcher(d: Dispatcher[Any], memo: dict[int, Any]) -> Dispatcher[Any]:
    """deepcopy of a Dispatcher: the table and the rows' next-state sets shared, every handler
    (and guard, and the machine's set_state) bound again to the copied machine. Three times cheaper than copy's generic path, which
    rebuilds every row tuple and bound method through __reduce_ex__."""
    new: Dispatcher[Any] = Dispatcher.__new__(Dispatcher)
    memo[id(d)] = new
    dc = copy.deepcopy

    def rebind(h: Any) -> Any:
        return types.MethodType(h.__func__, dc(h.__self__, memo))

    ns = dict(vars(d))
    ns["_bound"] = {k: (rebind(h), n) for k, (h, n) in d._bound.items()}
    ns["_fast"] = {k: (rebind(h), n, a) for k, (h, n, a) in d._fast.items()}
    for name in ("_address", "_state_of", "_refuse", "_counters", "trace", "_guards", "_set_state"):
        ns[name] = dc(ns[name], memo)
    vars(new).update(ns)
    return new


copy._deepcopy_dispatch[Dispatcher] = _copy_dispatcher  # type: ignore[attr-defined]


def dispatchers(machine: Any) -> list[Dispatcher[Any]]:
    """Every dispatcher of a machine and of the sub-machines it holds (one level of attributes)."""
    out: list[Dispatcher[Any]] = []
    for value in vars(machine).values():
        if isinstance(value, Dispatcher):
            out.append(value)
        elif hasattr(value, "__dict__") and not isinstance(value, (type, enum.Enum)) and type(value).__module__.startswith(
                "mpcache.core_sm"):
            out.extend(v for v in vars(value).values() if isinstance(v, Dispatcher))
    return out


def next_deadline(machine: Any, horizon: float = math.inf) -> float | None:
    """When ``machine`` next has something to do. A link's deadline heap keeps answered requests'
    entries until they are due (``ServerLink.next_deadline`` names them; firing one does nothing):
    the clock moves only to a pending request's deadline or the monitor's, or two equal states
    would differ by a clock moved for nothing. The monitor's (heartbeats, probes, the heartbeat
    timeout) count only up to ``horizon``."""
    if not isinstance(machine, ServerLink):
        d: float | None = machine.next_deadline()
        return d
    pending = [d for d, _ in machine.request_deadlines()[:1]]
    health = machine.monitor.next_deadline()
    if health is not None and health <= horizon:
        pending.append(health)
    return min(pending) if pending else None


def deep_size(obj: Any) -> int:
    """Bytes of ``obj`` and everything it refers to, tables and types excepted."""
    seen: set[int] = set()
    todo = [obj]
    total = 0
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, (type, Table, enum.Enum, types.ModuleType)) or callable(o):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        todo.extend(gc.get_referents(o))
    return total


def _by_time(entry: tuple[float, int, Any]) -> tuple[float, int]:
    return entry[0], entry[1]


# Left out of snapshots: counters and configuration (they decide nothing), dispatchers, and the
# tie-break sequence numbers and compaction marks of lazily deleting heaps (their live entries,
# in firing order, are kept instead).
_SKIP = frozenset({"_seq", "_compact_at", "compactions", "_counters", "counters", "trace", "config", "ctx_config", "dispatch", "_rows", "_routes",
                   "_timer_machine", "_lookups", "_events", "_monitor_effects"})
_ATOMS = (int, float, bool, type(None), bytes)


def snapshot(obj: Any, ren: dict[str, str], _memo: dict[int, int] | None = None) -> Any:
    """A canonical nested-tuple picture of ``obj``'s state: strings renamed by ``ren`` (symmetry),
    enums by value, callables, counters and configuration left out; a shared object is written
    once and referred to by its order of appearance after that (the machines share some)."""
    memo: dict[int, int] = {} if _memo is None else _memo
    t = type(obj)
    if t in _ATOMS:
        return obj
    if t is str:
        return ren.get(obj, obj)
    if isinstance(obj, enum.Enum):
        return obj._value_
    if t is ChunkChain:
        return obj.fingerprint
    if callable(obj) and not hasattr(obj, "__dict__") or isinstance(obj, (Dispatcher, type)) or t.__name__ in (
            "function", "method", "builtin_function_or_method"):
        return None
    if t is tuple or t is list:
        return tuple(snapshot(x, ren, memo) for x in obj)
    key = id(obj)
    if key in memo:
        return ("@", memo[key])
    memo[key] = len(memo)
    live = getattr(obj, "_live", None)
    if live is not None and callable(live):
        # A timer heap or reap queue deletes lazily (next_deadline() drops dead entries even
        # from a stored state): only its live entries, in firing order, are its state.
        if isinstance(getattr(obj, "_heap", None), list):
            return ("timers", tuple((d, snapshot(t, ren, memo)) for d, _seq, t in sorted(obj._heap, key=_by_time)
                                    if live(t)))
        items = getattr(obj, "_items", None)
        if isinstance(items, list):
            head = obj._head
            return ("queue", tuple((t, snapshot(i, ren, memo)) for t, i in zip(obj._times[head:], items[head:])
                                   if i is not None and live(i)))
    if isinstance(obj, dict):
        return ("d", tuple((snapshot(k, ren, memo), snapshot(v, ren, memo)) for k, v in obj.items()))
    if isinstance(obj, (set, frozenset)):
        return ("s", tuple(sorted((snapshot(x, ren, memo) for x in obj), key=repr)))
    if isinstance(obj, deque):
        return ("q", tuple(snapshot(x, ren, memo) for x in obj))
    if attrs.has(t):
        return (t.__name__, tuple(snapshot(getattr(obj, a.name), ren, memo) for a in attrs.fields(t)
                                  if a.name not in _SKIP))
    fields = getattr(obj, "__dict__", None)
    if fields is None:
        names = [n for c in t.__mro__ for n in getattr(c, "__slots__", ())]
        fields = {n: getattr(obj, n) for n in names if hasattr(obj, n)}
    if isinstance(obj, ServerLink):
        # the deadline heap keeps answered entries until due: only pending ones, in firing order
        fields = dict(fields)
        fields["_deadlines"] = obj.request_deadlines()
    expiry_live = getattr(obj, "_expiry_live", None)
    if expiry_live is not None and "_expiries" in fields:
        # L1's lease-expiry heap deletes lazily too: only live entries, in expiry order
        fields = dict(fields)
        fields["_expiries"] = [(e[0], *e[2:]) for e in sorted(fields["_expiries"], key=_by_time) if expiry_live(e)]
    return (t.__name__, tuple((k, snapshot(v, ren, memo)) for k, v in fields.items() if k not in _SKIP))
