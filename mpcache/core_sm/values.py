"""A machine's changing state as immutable values, and back: what ``state_values()`` /
``restore(values)`` of a machine made of parts (the server: its context, index, quota, entity
machines, heaps) use.

Each part's class names its attributes as ``STATE_FIELDS`` (carried) or ``WIRING_FIELDS`` (left
out: configuration, bound methods, the other parts it is wired to, made once by the
constructor). ``encode`` writes a field's value: an immutable value (a number, string, bytes, an
enum, a frozen record, a tuple of such) as itself; a mutable object (a dict, list, set, deque,
array, or a record with mutable fields) as a ``New(index, type, payload)`` the first time and a
``Ref(index)`` after that, so objects the state holds in several places (an L1 object in the
index's maps and its owner's leases, an account's LRU set) are one object again when decoded;
a tuple holding a mutable object as a ``Tup`` of its encoded items. ``decode`` rebuilds the
mutable objects, new ones, in the same order. Values hold no mutable object: ``encode`` of a
part in two different states shares nothing that one could change under the other.
"""
from __future__ import annotations

import enum
import types
from array import array
from collections import OrderedDict, deque
from typing import Any

import attrs

from mpcache.core_sm.chunks import PackedHashes


class New(tuple):  # type: ignore[type-arg]
    """A mutable object, written the first time: (index, type, payload)."""

    __slots__ = ()


class Ref(int):
    """A mutable object written earlier: its index."""

    __slots__ = ()


class Tup(tuple):  # type: ignore[type-arg]
    """A tuple that held a mutable object: its items, encoded."""

    __slots__ = ()


# immutable types beside enums, frozen records and named tuples (a job's packed chunk hashes: one bytes buffer)
_IMMUTABLE: set[type] = {int, float, bool, type(None), str, bytes, complex, frozenset, range, PackedHashes}
_KINDS: dict[type, int] = {}
_ATOM, _TUPLE, _DICT, _LIST, _SET, _DEQUE, _ARRAY, _RECORD, _OBJECT = range(9)
_FIELDS: dict[type, tuple[str, ...]] = {}


def _kind(t: type) -> int:
    """How values of type ``t`` are written (decided once per type)."""
    kind = _KINDS.get(t)
    if kind is not None:
        return kind
    if t in _IMMUTABLE or issubclass(t, enum.Enum) or isinstance(t, type) and issubclass(t, type):
        kind = _ATOM
    elif t is tuple:
        kind = _TUPLE
    elif issubclass(t, tuple):  # a named tuple: immutable (its items are ids and keys)
        kind = _ATOM
    elif t is dict or t is OrderedDict:
        kind = _DICT
    elif t is list:
        kind = _LIST
    elif t is set:
        kind = _SET
    elif t is deque:
        kind = _DEQUE
    elif t is array:
        kind = _ARRAY
    elif attrs.has(t):
        frozen = getattr(t.__setattr__, "__name__", "") == "_frozen_setattrs"
        kind = _ATOM if frozen else _RECORD
        _FIELDS[t] = tuple(a.name for a in attrs.fields(t))
    elif hasattr(t, "STATE_FIELDS") or issubclass(t, (types.MethodType, types.FunctionType, types.BuiltinFunctionType)):
        raise TypeError(f"{t.__name__} is wiring, not a value")
    elif hasattr(t, "__dict__") and not hasattr(t, "__slots__"):
        kind = _OBJECT
    else:
        raise TypeError(f"cannot write a {t.__name__} as values")
    _KINDS[t] = kind
    return kind


# the types written as themselves (every type _kind found immutable joins): tested in C at each
# call site before a call to encode
_ATOMS: set[type] = set(_IMMUTABLE)


def encode(x: Any, memo: dict[int, int]) -> Any:
    """``x`` as immutable values (``memo``: id of each mutable object written -> its index,
    shared by every field of one machine)."""
    t = type(x)
    kind = _KINDS.get(t)
    if kind is None:
        kind = _kind(t)
        if kind == _ATOM:
            _ATOMS.add(t)
    if kind == _ATOM:
        return x
    atoms = _ATOMS
    if kind == _TUPLE:
        items = [v if type(v) in atoms else encode(v, memo) for v in x]
        for a, b in zip(items, x):
            if a is not b:
                return Tup(items)
        return x
    index = memo.get(id(x))
    if index is not None:
        return Ref(index)
    index = memo[id(x)] = len(memo)
    if not x and kind != _RECORD and kind != _OBJECT:
        payload: Any = (x.maxlen, ()) if kind == _DEQUE else (x.typecode, b"") if kind == _ARRAY else ()
    elif kind == _DICT:
        payload = tuple([(k if type(k) in atoms else encode(k, memo), v if type(v) in atoms else encode(v, memo))
                         for k, v in x.items()])
    elif kind == _LIST or kind == _SET:
        payload = tuple([v if type(v) in atoms else encode(v, memo) for v in x])
    elif kind == _RECORD:
        payload = tuple([v if type(v) in atoms else encode(v, memo) for v in map(x.__getattribute__, _FIELDS[t])])
    elif kind == _DEQUE:
        payload = (x.maxlen, tuple([v if type(v) in atoms else encode(v, memo) for v in x]))
    elif kind == _ARRAY:
        payload = (x.typecode, x.tobytes())
    else:
        payload = tuple([(n, encode(v, memo)) for n, v in vars(x).items()])
    return New((index, t, payload))


_CODED = frozenset({New, Ref, Tup})  # what decode has to build; anything else is itself


def decode(v: Any, made: list[Any]) -> Any:
    """The value ``encode`` wrote, its mutable objects new (``made``: those decoded so far, by
    index, shared by every field of one machine, decoded in the order they were written)."""
    t = type(v)
    if t is New:
        index, cls, payload = v
        kind = _KINDS[cls]
        assert index == len(made)
        if kind == _DICT:
            d = cls()
            made.append(d)
            coded = _CODED
            for k, item in payload:
                d[decode(k, made) if type(k) in coded else k] = decode(item, made) if type(item) in coded else item
            return d
        if kind == _LIST:
            out: list[Any] = []
            made.append(out)
            out.extend([decode(item, made) if type(item) in _CODED else item for item in payload])
            return out
        if kind == _SET:
            s: set[Any] = set()
            made.append(s)
            s.update([decode(item, made) if type(item) in _CODED else item for item in payload])
            return s
        if kind == _RECORD:
            obj = object.__new__(cls)
            made.append(obj)
            setter = object.__setattr__
            for name, item in zip(_FIELDS[cls], payload):
                setter(obj, name, decode(item, made) if type(item) in _CODED else item)
            return obj
        if kind == _DEQUE:
            q: deque[Any] = deque(maxlen=payload[0])
            made.append(q)
            q.extend([decode(item, made) for item in payload[1]])
            return q
        if kind == _ARRAY:
            a = array(payload[0])
            a.frombytes(payload[1])
            made.append(a)
            return a
        obj = object.__new__(cls)
        made.append(obj)
        for name, item in payload:
            vars(obj)[name] = decode(item, made)
        return obj
    if t is Ref:
        return made[v]
    if t is Tup:
        return tuple([decode(item, made) for item in v])
    return v


def parts_values(parts: tuple[Any, ...], memo: dict[int, int]) -> tuple[Any, ...]:
    """The ``STATE_FIELDS`` of each part, encoded with one memo, part by part."""
    atoms = _ATOMS
    return tuple([tuple([v if type(v) in atoms else encode(v, memo)
                         for v in map(p.__getattribute__, type(p).STATE_FIELDS)]) for p in parts])


def restore_parts(parts: tuple[Any, ...], values: tuple[Any, ...], made: list[Any]) -> None:
    """Set each part's ``STATE_FIELDS`` to what ``parts_values`` wrote (new objects)."""
    coded = _CODED
    for p, fields in zip(parts, values):
        ns = vars(p)
        for name, v in zip(type(p).STATE_FIELDS, fields):
            ns[name] = decode(v, made) if type(v) in coded else v
