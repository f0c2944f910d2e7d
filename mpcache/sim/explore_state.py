"""Machines as the explorer's states (``sim/explore.py``): a copy that shares what never changes,
a canonical snapshot to fingerprint, the deadline a machine is really waiting for, and the bytes a
state holds.

* ``Held(machine, horizon)``: a machine of a stored state as its ``state_values()`` (a machine
  that has the pair and ``restorable``), restored in place by the explorer into the one machine
  it keeps per slot instead of copied.
* ``clone(machine, memo)``: the deep copy a state makes of a machine an action touches, the graph
  ``copy.deepcopy`` would build (what ``memo`` names shared: tables, configurations, frozen rows)
  by a copier chosen once per type; a ``Dispatcher``'s copy is a ``LazyDispatcher``, its handlers
  bound to the copy at its first use, once per distinct function, from a template per table and
  machine class (``Dispatcher.copied``, core_sm's; ``copy.deepcopy`` of a ``Dispatcher`` does the same).
* ``dispatchers(machine)``: every dispatcher of a machine and of the sub-machines it holds;
  ``dispatchers_of(machine)`` the same, by the attribute paths found once per machine class.
* ``snapshot(obj, ren)``: a canonical nested-tuple picture of a machine's state, strings renamed
  by ``ren`` (symmetry), lazily deleting heaps reduced to their live entries in firing order; how
  each type is written is decided once per type.
* ``next_deadline(machine, horizon)``: when a machine next has something to do (a link's answered
  requests and, past the horizon, its monitor's timers left out).
* ``deep_size(obj, shared)``: bytes of an object graph, tables and types excepted (with
  ``shared``, what every copy of a machine shares too).
"""
from __future__ import annotations

import copy
import enum
import gc
import math
import operator
import sys
import types
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import attrs

from mpcache.core_sm.chunks import ChunkChain
from mpcache.core_sm.server_link import ServerLink
from mpcache.core_sm.table import TEMPLATE_PARTS, Dispatcher, DispatcherTemplate, LazyDispatcher, Table
from mpcache.core_sm.timers import ReapQueue, TimerHeap



# ------------------------------------------------------------------ copies
# What a copy shares with its original: immutable atoms, classes and functions (as copy.deepcopy).
_SHARED_TYPES: set[type] = {int, float, bool, type(None), str, bytes, complex, type, types.FunctionType,
                            types.BuiltinFunctionType, types.BuiltinMethodType, range, type(Ellipsis),
                            type(NotImplemented), types.CodeType, property, weakref.ref}
_Copier = Callable[[Any, dict[int, Any]], Any]
_COPIERS: dict[type, _Copier] = {}


def clone(x: Any, memo: dict[int, Any]) -> Any:
    """A deep copy of ``x`` as ``copy.deepcopy(x, memo)`` makes it (the same graph: shared
    objects stay shared, what ``memo`` names is taken from it, immutable objects whose parts are
    all shared are shared), by a copier chosen once per type instead of through each object's
    ``__reduce_ex__``: what turns a machine into a new state, three times cheaper. A type it
    does not know goes to ``copy.deepcopy`` with the same memo."""
    t = type(x)
    if t in _SHARED_TYPES:
        return x
    y = memo.get(id(x), memo)
    if y is not memo:
        return y
    copier = _COPIERS.get(t)
    if copier is None:
        copier = _COPIERS[t] = _copier_for(t)
    return copier(x, memo)


def _copy_dict(x: dict[Any, Any], memo: dict[int, Any]) -> dict[Any, Any]:
    shared = _SHARED_TYPES
    if shared.issuperset(map(type, x.values())) and shared.issuperset(map(type, x)):
        # every key and value shared (counters, ids, enums): copied in C, types checked in C
        y = x.copy()
        memo[id(x)] = y
        return y
    y = {}
    memo[id(x)] = y
    for k, v in x.items():
        y[k if type(k) in shared else clone(k, memo)] = v if type(v) in shared else clone(v, memo)
    return y


def _copy_ordered(x: OrderedDict[Any, Any], memo: dict[int, Any]) -> OrderedDict[Any, Any]:
    shared = _SHARED_TYPES
    if shared.issuperset(map(type, x.values())) and shared.issuperset(map(type, x)):
        y = x.copy()
        memo[id(x)] = y
        return y
    y = OrderedDict()
    memo[id(x)] = y
    for k, v in x.items():
        y[clone(k, memo)] = clone(v, memo)
    return y


def _copy_list(x: list[Any], memo: dict[int, Any]) -> list[Any]:
    shared = _SHARED_TYPES
    if shared.issuperset(map(type, x)):
        y = x.copy()
        memo[id(x)] = y
        return y
    y = []
    memo[id(x)] = y
    y.extend([v if type(v) in shared else clone(v, memo) for v in x])
    return y


def _copy_tuple(x: tuple[Any, ...], memo: dict[int, Any]) -> tuple[Any, ...]:
    shared = _SHARED_TYPES
    parts = [v if type(v) in shared else clone(v, memo) for v in x]
    done = memo.get(id(x), memo)  # a cycle through the tuple made it already
    if done is not memo:
        return done  # type: ignore[no-any-return]
    y = x
    for a, b in zip(parts, x):
        if a is not b:
            y = tuple(parts)
            break
    memo[id(x)] = y
    return y


def _copy_set(x: set[Any], memo: dict[int, Any]) -> set[Any]:
    if _SHARED_TYPES.issuperset(map(type, x)):
        y = x.copy()
        memo[id(x)] = y
        return y
    y = set()
    memo[id(x)] = y
    for v in x:
        y.add(clone(v, memo))
    return y


def _copy_frozenset(x: frozenset[Any], memo: dict[int, Any]) -> frozenset[Any]:
    parts = [clone(v, memo) for v in x]
    y = x if all(a is b for a, b in zip(parts, x)) else frozenset(parts)
    memo[id(x)] = y
    return y


def _copy_deque(x: deque[Any], memo: dict[int, Any]) -> deque[Any]:
    y: deque[Any] = deque(maxlen=x.maxlen)
    memo[id(x)] = y
    y.extend([clone(v, memo) for v in x])
    return y


def _copy_method(x: types.MethodType, memo: dict[int, Any]) -> types.MethodType:
    return types.MethodType(x.__func__, clone(x.__self__, memo))


def _share(x: Any, memo: dict[int, Any]) -> Any:
    return x


def _deepcopy(x: Any, memo: dict[int, Any]) -> Any:
    return copy.deepcopy(x, memo)


def _own_deepcopy(x: Any, memo: dict[int, Any]) -> Any:
    return x.__deepcopy__(memo)


def _plain(t: type) -> bool:
    """Whether copying ``t`` field by field is what deepcopy does: nothing of its own for
    copying or pickling."""
    own: Any = object
    return (getattr(t, "__reduce_ex__") is own.__reduce_ex__ and getattr(t, "__reduce__") is own.__reduce__
            and getattr(t, "__getstate__") is own.__getstate__ and getattr(t, "__setstate__", None) is None
            and not hasattr(t, "__deepcopy__"))


def _clone_dispatcher(d: Dispatcher[Any], memo: dict[int, Any]) -> Dispatcher[Any]:
    return d.copied(memo, clone)


def _copier_for(t: type) -> _Copier:
    """The copier of type ``t`` (chosen once per type)."""
    exact: dict[type, _Copier] = {dict: _copy_dict, list: _copy_list, tuple: _copy_tuple, set: _copy_set,
                                  frozenset: _copy_frozenset, deque: _copy_deque, OrderedDict: _copy_ordered,
                                  types.MethodType: _copy_method, Dispatcher: _clone_dispatcher,
                                  LazyDispatcher: _clone_dispatcher}
    if t in exact:
        return exact[t]
    if issubclass(t, type):  # a class (an enum's too), as deepcopy: itself
        _SHARED_TYPES.add(t)
        return _share
    if issubclass(t, enum.Enum):
        _SHARED_TYPES.add(t)  # as deepcopy: an enum member is itself (its copy shares it)
        return _share
    if hasattr(t, "__deepcopy__"):
        return _own_deepcopy
    if issubclass(t, tuple) and hasattr(t, "_fields") and getattr(t, "__reduce__") is getattr(tuple, "__reduce__"):
        return _named_tuple_copier(t)
    if attrs.has(t) and "__slots__" in vars(t):
        names = tuple(a.name for a in attrs.fields(t))
        slots = {n for c in t.__mro__ for n in getattr(c, "__slots__", ())}
        if slots <= {*names, "__weakref__"}:
            frozen = getattr(t.__setattr__, "__name__", "") == "_frozen_setattrs"
            return _slotted_copier(t, names, frozen)
        return _deepcopy
    slots = {n for c in t.__mro__ for n in getattr(c, "__slots__", ())} - {"__dict__", "__weakref__"}
    if _plain(t) and not slots and t.__dictoffset__ != 0:
        return _object_copier(t)
    return _deepcopy


def _named_tuple_copier(t: type) -> _Copier:
    """A named tuple (immutable): shared when its parts are, else built from their copies."""
    make = t._make  # type: ignore[attr-defined]

    def copy_named_tuple(x: Any, memo: dict[int, Any]) -> Any:
        parts = [clone(v, memo) for v in x]
        y = x if all(a is b for a, b in zip(parts, x)) else make(parts)
        memo[id(x)] = y
        return y
    return copy_named_tuple


def _object_copier(t: type) -> _Copier:
    new = object.__new__

    def copy_object(x: Any, memo: dict[int, Any]) -> Any:
        y: Any = new(t)
        memo[id(x)] = y
        shared = _SHARED_TYPES
        y.__dict__.update({k: v if type(v) in shared else clone(v, memo) for k, v in x.__dict__.items()})
        return y
    return copy_object


def _slotted_copier(t: type, names: tuple[str, ...], frozen: bool) -> _Copier:
    """A slotted attrs class: its fields copied; a frozen one whose fields are all shared is
    shared itself (as deepcopy shares such a tuple)."""
    new = object.__new__
    setter = object.__setattr__

    def copy_slotted(x: Any, memo: dict[int, Any]) -> Any:
        values = [clone(getattr(x, n), memo) for n in names]
        done = memo.get(id(x), memo)
        if done is not memo:
            return done
        if frozen and all(a is getattr(x, n) for a, n in zip(values, names)):
            memo[id(x)] = x
            return x
        y: Any = new(t)
        memo[id(x)] = y
        for n, v in zip(names, values):
            setter(y, n, v)
        return y
    return copy_slotted


class Held:
    """A machine of a stored state kept as values (its ``state_values()``) instead of a copy: a
    state's slot holds it, and the explorer restores the one machine it works on per slot from
    it (``restore(values)``, in place) before a step or a read. Never changed once made; the
    explorer's caches (snapshots, steps) hang on it as on a machine, while it lives. ``deadline``:
    the machine's ``next_deadline()`` when it was made; ``soon``: ``next_deadline(machine,
    horizon)`` (a link's monitor's timers only up to the world's horizon); ``counters``: its
    counters then."""

    __slots__ = ("cls", "values", "deadline", "soon", "counters", "__weakref__")

    def __init__(self, machine: Any, horizon: float) -> None:
        self.cls = type(machine)
        self.counters: dict[str, int] = dict(machine.counters)  # read without a restore
        self.deadline = machine.next_deadline()  # first: it may drop stale timers (no state)
        self.soon = next_deadline(machine, horizon) if isinstance(machine, ServerLink) else self.deadline
        self.values = machine.state_values()


def restorable(machine: Any) -> bool:
    """Whether ``machine`` can be kept as values: it has the pair, and every attribute it holds is
    one its class names as state or wiring (a legacy profile's subclass adding state is copied)."""
    cls = type(machine)
    state = getattr(cls, "STATE_FIELDS", None)
    wiring = getattr(cls, "WIRING_FIELDS", None)
    if state is None or wiring is None or set(vars(machine)) != {*state, *wiring}:
        return False
    # what it restores beside its own fields: a sub-machine (a link's monitor), a server's parts
    parts = [getattr(machine, name) for name in state]
    if hasattr(machine, "state_parts"):
        parts += machine.state_parts()[1:]
    return all(restorable(p) for p in parts if hasattr(type(p), "STATE_FIELDS"))


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


_PATHS: dict[type, Callable[[Any], tuple[Any, ...]]] = {}


def dispatchers_of(machine: Any) -> tuple[Dispatcher[Any], ...]:
    """``dispatchers(machine)``, by the attribute paths found on the first machine of its class
    (a machine's wiring is made once, in its constructor, the same for every machine of a class)."""
    get = _PATHS.get(type(machine))
    if get is None:
        found = {id(d) for d in dispatchers(machine)}
        paths: list[str] = []
        for name, value in vars(machine).items():
            if id(value) in found:
                paths.append(name)
            elif hasattr(value, "__dict__") and not isinstance(value, (type, enum.Enum)) and type(
                    value).__module__.startswith("mpcache.core_sm"):
                paths.extend(f"{name}.{sub}" for sub, v in vars(value).items() if id(v) in found)
        get = _PATHS[type(machine)] = _getter(paths)
    return get(machine)


def _getter(paths: list[str]) -> Callable[[Any], tuple[Any, ...]]:
    """A function of a machine: the values at ``paths``, as a tuple."""
    if len(paths) > 1:
        many: Callable[[Any], tuple[Any, ...]] = operator.attrgetter(*paths)
        return many
    one = operator.attrgetter(*paths) if paths else None

    def get(machine: Any) -> tuple[Any, ...]:
        return () if one is None else (one(machine),)
    return get


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


def deep_size(obj: Any, shared: dict[int, Any] | None = None) -> int:
    """Bytes of ``obj`` and everything it refers to, tables and types excepted; with ``shared``,
    what every copy of a machine shares excepted too: what it names (the explorer's tables' rows
    and next-state sets, configurations) and the dispatcher templates and their parts."""
    seen: set[int] = set()
    skip: tuple[type, ...] = (type, Table, enum.Enum, types.ModuleType)
    if shared is not None:
        seen.update(shared, TEMPLATE_PARTS)
        skip += (DispatcherTemplate,)
    todo = [obj]
    total = 0
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, skip) or callable(o):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        todo.extend(gc.get_referents(o))
    return total


# Left out of snapshots: counters and configuration (they decide nothing), dispatchers, and the
# tie-break sequence numbers and compaction marks of lazily deleting heaps (their live entries,
# in firing order, are kept instead).
_SKIP = frozenset({"_seq", "_compact_at", "compactions", "_counters", "counters", "trace", "config", "ctx_config", "dispatch", "_rows", "_routes",
                   "_timer_machine", "_lookups", "_events", "_monitor_effects",
                   # the server's per-event check bookkeeping: the check is a function of the rest
                   "_clean", "_skipped", "_quiet_rows"})
_ATOMS = (int, float, bool, type(None), bytes)


# How snapshot() writes an object of each type (chosen once per type, by _kind_of).
_ATOM, _STR, _ENUM, _CHAIN, _NONE, _SEQ, _DICT, _SET, _DEQUE, _ATTRS, _OBJECT = range(11)
_KINDS: dict[type, tuple[int, tuple[str, ...]]] = {t: (_ATOM, ()) for t in _ATOMS}
_KINDS.update({str: (_STR, ()), ChunkChain: (_CHAIN, ()), tuple: (_SEQ, ()), list: (_SEQ, ())})


def _kind_of(obj: Any) -> tuple[int, tuple[str, ...]]:
    """How snapshot() writes objects of ``obj``'s type, and an attrs class's fields it keeps."""
    t = type(obj)
    if isinstance(obj, enum.Enum):
        kind = (_ENUM, ())
    elif callable(obj) and not hasattr(obj, "__dict__") or isinstance(obj, (Dispatcher, type)) or t.__name__ in (
            "function", "method", "builtin_function_or_method"):
        kind = (_NONE, ())
    elif isinstance(obj, tuple):
        # a named tuple (ObjectKey, RequestKey: which peer or request owns a job or lease) is its
        # values: written as its type's name alone, states differing only in an owner were one
        kind = (_SEQ, ())
    elif isinstance(obj, dict):
        kind = (_DICT, ())
    elif isinstance(obj, (set, frozenset)):
        kind = (_SET, ())
    elif isinstance(obj, deque):
        kind = (_DEQUE, ())
    elif attrs.has(t):
        kind = (_ATTRS, tuple(a.name for a in attrs.fields(t) if a.name not in _SKIP))
    else:
        kind = (_OBJECT, ())
    if kind[0] in (_ENUM, _NONE, _ATTRS, _OBJECT, _SEQ) or t in (dict, set, frozenset, deque, OrderedDict):
        _KINDS[t] = kind  # the same for every object of the type (the others are looked at each time)
    return kind


def snapshot(obj: Any, ren: dict[str, str], _memo: dict[int, int] | None = None) -> Any:
    """A canonical nested-tuple picture of ``obj``'s state: strings renamed by ``ren`` (symmetry),
    enums by value, callables, counters and configuration left out; a shared object is written
    once and referred to by its order of appearance after that (the machines share some). How
    each type is written is decided once per type."""
    memo: dict[int, int] = {} if _memo is None else _memo
    kinds = _KINDS
    atoms = _ATOMS

    def snap(obj: Any) -> Any:
        t = type(obj)
        if t in atoms:
            return obj
        kind = kinds.get(t)
        k, names = kind if kind is not None else _kind_of(obj)
        if k == _STR:
            return ren.get(obj, obj)
        if k == _SEQ:
            return tuple([x if type(x) in atoms else snap(x) for x in obj])
        if k == _ENUM:
            return obj._value_
        if k == _NONE:
            return None
        if k == _CHAIN:
            return obj.fingerprint
        key = id(obj)
        if key in memo:
            return ("@", memo[key])
        memo[key] = len(memo)
        if k == _DICT:
            return ("d", tuple([(snap(a), b if type(b) in atoms else snap(b)) for a, b in obj.items()]))
        if k == _ATTRS:
            return (t.__name__, tuple([snap(getattr(obj, n)) for n in names]))
        if k == _SET:
            return ("s", tuple(sorted([snap(x) for x in obj], key=repr)))
        if k == _DEQUE:
            return ("q", tuple([snap(x) for x in obj]))
        # A timer heap or reap queue deletes lazily (next_deadline() drops dead entries even
        # from a stored state): only its live entries, in firing order, are its state.
        if isinstance(obj, TimerHeap):
            return ("timers", tuple([(d, snap(x)) for d, x in obj.live_entries()]))
        if isinstance(obj, ReapQueue):
            return ("queue", tuple([(d, snap(x)) for d, x in obj.live_entries()]))
        fields = getattr(obj, "__dict__", None)
        if fields is None:
            slots = [n for c in t.__mro__ for n in getattr(c, "__slots__", ())]
            fields = {n: getattr(obj, n) for n in slots if hasattr(obj, n)}
        skip = _SKIP
        return (t.__name__, tuple([(n, snap(v)) for n, v in fields.items() if n not in skip]))

    return snap(obj)
