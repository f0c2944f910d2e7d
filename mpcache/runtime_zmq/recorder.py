"""``MPCACHE_RECORD=FILE``: record what the connector's shells hand their core_sm machines.

Off by default. With the environment variable set (to a file path), every client machine a
process builds -- the scheduler's ``StepPlanner`` (which owns the ``LookupClient``: its events
are the planner's), each worker rank's ``TransferClient``, each connection's ``ServerLink``
(which owns the ``HealthMonitor``) -- writes to that file, one JSON line per ``handle`` call:
the event it was given, the time it was given at and the effects it returned. The first line
of a machine is its build: its kind, its configs and the time it was built at. Values are
``mpcache.core_sm.trace.TraceCodec``'s (token ids kept; a future or frame the link carries but
never looks into as its number). ``mpcache.sim.prod_replay`` replays such a file through the
machines the simulator builds and reports the first step whose effects differ.

Lines::

    {"build": NAME, "kind": "planner"|"transfer_client"|"link", "t": NOW, "configs": {...}, "about": {...}}
    {"i": NAME, "t": NOW, "event": EVENT, "effects": [EFFECT, ...]}

``NAME`` is unique in its process (the pid is part of it), so processes may share one file:
the file is opened for appending and each line is one write. Recording is for short runs
(a test, a reproduction): every line is written as it happens, prompts included.

When the variable is not set ``recording(...)`` returns None and the shells' only cost is one
``is None`` test per event.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from mpcache.core_sm.trace import OpaqueNumbers, TraceCodec

ENV = "MPCACHE_RECORD"
log = logging.getLogger("mpcache.recorder")
FORMAT = 1


class Recorder:
    """One recording file per process and path; shared by every machine the process builds."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._codec = TraceCodec(keep_tokens=True, opaque=OpaqueNumbers())
        self._names = itertools.count(1)
        self._failed = False
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the process

    def _write(self, line: Mapping[str, Any]) -> None:
        text = json.dumps(line, separators=(",", ":")) + "\n"
        with self._lock:
            if self._failed:
                return
            try:
                self._file.write(text)
                self._file.flush()
            except OSError as exc:  # a full disk stops the recording, never the engine
                self._failed = True
                log.warning("mpcache: recording to %s stopped: %s", self.path, exc)

    def machine(self, kind: str, now: float, configs: Mapping[str, Any], about: Mapping[str, Any]) -> MachineRecord:
        """Register a machine just built; its handle calls go to the returned record."""
        name = f"{kind}-{os.getpid()}-{next(self._names)}"
        with self._lock:
            encoded = {key: self._codec.encode(value) for key, value in configs.items()}
        self._write({"mpcache_record": FORMAT, "build": name, "kind": kind, "t": now, "configs": encoded,
                     "about": dict(about)})
        return MachineRecord(self, name)

    def step(self, name: str, now: float, event: object, effects: Sequence[object]) -> None:
        with self._lock:  # the numbering of opaque objects is shared by every machine
            line = {"i": name, "t": now, "event": self._codec.encode(event),
                    "effects": [self._codec.encode(e) for e in effects]}
        self._write(line)


class MachineRecord:
    """One machine's stream in a recording: ``step(now, event, effects)`` after each handle."""

    def __init__(self, recorder: Recorder, name: str) -> None:
        self.recorder = recorder
        self.name = name

    def step(self, now: float, event: object, effects: Sequence[object]) -> None:
        self.recorder.step(self.name, now, event, effects)


_recorders: dict[str, Recorder] = {}
_recorders_lock = threading.Lock()


def recording(kind: str, now: float, configs: Mapping[str, Any], about: Mapping[str, Any] | None = None,
              ) -> MachineRecord | None:
    """The record a new machine writes its steps to, or None when ``MPCACHE_RECORD`` is unset
    (the default: nothing is recorded)."""
    path = os.environ.get(ENV)
    if not path:
        return None
    with _recorders_lock:
        recorder = _recorders.get(path)
        if recorder is None:
            recorder = _recorders[path] = Recorder(path)
    return recorder.machine(kind, now, configs, about or {})
