"""Traces: one readable line per event, a hash over them, and message records for charts.

Line format (fixed columns, so a trace diffs well)::

    <virtual time, 6 decimals> <node> <what>

`what` is ``machine: Event(...) -> [Effect(...), ...]`` for a handled event, ``net drop #pid
src->dst Message`` for a network fate, ``fault ...`` for an injected fault and ``VIOLATION ...``
for an oracle failure. The hash is blake2b over every line, so two runs agree exactly when
their traces do; `first_divergence` finds where two traces part.
"""
from __future__ import annotations

import hashlib
from typing import Any

import attrs


def short(obj: Any, limit: int = 160) -> str:
    """A compact repr: token tuples and hashes are abbreviated so lines stay readable."""
    text = _short(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_FIELDS: dict[type, tuple[str, ...] | None] = {}
_SKIP = ("model_name", "world_size")


def _fields_of(cls: type) -> tuple[str, ...] | None:
    names = _FIELDS.get(cls, ())
    if names == ():
        names = tuple(a.name for a in attrs.fields(cls) if a.name not in _SKIP) if attrs.has(cls) else None
        _FIELDS[cls] = names
    return names


def _short(obj: Any) -> str:
    cls = type(obj)
    if cls is int or cls is str or obj is None or cls is bool:
        return repr(obj)
    names = _fields_of(cls)
    if names is not None:
        fields = []
        for name in names:
            value = getattr(obj, name)
            if name == "token_ids":
                fields.append(f"tokens={len(value)}")
            elif name == "cache_salt" and not value:
                continue
            else:
                fields.append(f"{name}={_short(value)}")
        return f"{cls.__name__}({', '.join(fields)})"
    if isinstance(obj, bytes):
        return obj[:4].hex()
    if isinstance(obj, tuple):
        if len(obj) > 6 and all(type(x) is int for x in obj):
            return f"<{len(obj)} ints {obj[0]}..{obj[-1]}>"
        inner = ", ".join(_short(x) for x in obj)
        return f"({inner},)" if len(obj) == 1 else f"({inner})"
    if isinstance(obj, list):
        return "[" + ", ".join(_short(x) for x in obj) + "]"
    if hasattr(obj, "value") and type(obj).__module__ != "builtins" and hasattr(type(obj), "__members__"):
        return str(obj.value)
    if isinstance(obj, float):
        return f"{obj:.6f}"
    return repr(obj)


@attrs.define
class MessageRecord:
    pid: int
    src: str
    dst: str
    label: str
    request_id: str | None
    sent: float
    fate: str = "in-flight"  # delivered / drop / blocked / overflow / dead
    arrived: float | None = None


@attrs.define
class Mark:
    t: float
    node: str
    kind: str  # crash / restart / violation / partition / heal
    text: str


class Trace:
    """The run's lines, kept as records and formatted only when asked for (`lines`, `digest`):
    a seed that passes in a sweep never formats one. An event's record holds the event and its
    effects themselves (core_sm's frozen messages and effects), so its line reads the same
    whenever it is formatted."""

    def __init__(self, keep_lines: bool = True) -> None:
        self.keep_lines = keep_lines
        self._records: list[tuple[Any, ...]] = []
        self._lines: list[str] = []
        self._hash = hashlib.blake2b(digest_size=16)
        self.messages: dict[int, MessageRecord] = {}
        self.marks: list[Mark] = []

    @property
    def count(self) -> int:
        return len(self._records)

    def line(self, t: float, node: str, text: str) -> None:
        self._records.append((t, node, text))

    def event(self, t: float, node: str, machine: str, event: Any, effects: list[Any]) -> None:
        """A machine handled `event` with `effects` (formatted as ``machine: Event -> [...]``)."""
        self._records.append((t, node, machine, event, tuple(effects)))

    def mark(self, t: float, node: str, kind: str, text: str) -> None:
        self.marks.append(Mark(t, node, kind, text))
        self.line(t, node, f"{kind} {text}")

    def _format(self) -> list[str]:
        lines = self._lines
        for record in self._records[len(lines):]:
            s = format_record(record)
            self._hash.update(s.encode())
            self._hash.update(b"\n")
            lines.append(s)
        return lines

    @property
    def lines(self) -> list[str]:
        return self._format()

    def digest(self) -> str:
        self._format()
        return self._hash.hexdigest()


def format_record(record: tuple[Any, ...]) -> str:
    """One trace line: ``<virtual time> <node> <what>`` (see the module docstring)."""
    if len(record) == 3:
        t, node, text = record
    else:
        t, node, machine, event, effects = record
        text = event_text(machine, event, effects)
    return f"{t:12.6f} {node:<11} {text}"


def event_text(machine: str, event: Any, effects: Any) -> str:
    return f"{machine}: {short(event)} -> [{', '.join(short(e) for e in effects)}]"


def first_divergence(a: list[str], b: list[str]) -> tuple[int, str, str] | None:
    """Index and the two lines where traces `a` and `b` first differ (None if equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i, x, y
    if len(a) != len(b):
        i = min(len(a), len(b))
        return i, a[i] if i < len(a) else "<end>", b[i] if i < len(b) else "<end>"
    return None
