"""Logging for mpcache-server: text or JSON lines, and repeats folded into one line.

* ``setup(level, fmt)`` configures the root logger once (stderr), ``fmt`` ``text`` or ``json``
  (one object per line: ``ts``, ``level``, ``logger``, ``msg``, plus ``extra`` fields).
* ``RepeatFilter``: a message template (``record.msg`` before ``%`` formatting, per logger and
  level) is let through once per ``window`` seconds; the others are counted, and the next time
  the window rolls over one line says ``... and N more in the last 30 s: <last message>``. A
  Redis outage that fails every object therefore logs a line per window, not per object.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_STD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "no_fold"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in _STD_ATTRS and not k.startswith("_"):
                out[k] = v if isinstance(v, (str, int, float, bool, type(None), list, dict)) else repr(v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=repr)


class RepeatFilter(logging.Filter):
    """Let a message template through once per ``window`` seconds; count and summarize the rest.

    Installed on a handler. Records below INFO, and records with ``extra={"no_fold": True}``,
    always pass. Memory is bounded by ``max_keys`` templates."""

    def __init__(self, window: float = 30.0, clock: Callable[[], float] = time.monotonic, max_keys: int = 1024) -> None:
        super().__init__()
        self.window = window
        self.clock = clock
        self.max_keys = max_keys
        self._lock = threading.Lock()
        # (logger, level, template) -> _Fold
        self._seen: dict[tuple[str, int, str], _Fold] = {}
        self._emitting = False

    def filter(self, record: logging.LogRecord) -> bool:
        if self._emitting or record.levelno < logging.INFO or getattr(record, "no_fold", False):
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        ended: _Fold | None = None
        with self._lock:
            fold = self._seen.get(key)
            if fold is not None and now - fold.since < self.window:
                fold.count += 1
                fold.last = record.getMessage()
                return False
            if fold is not None and fold.count:
                ended = fold
            elif fold is None and len(self._seen) >= self.max_keys:
                self._expire_locked(now)
            self._seen[key] = _Fold(now)
        if ended is not None:
            self._emit(key, ended)
        return True

    def flush(self) -> None:
        """Emit the summary of every window that has ended (the server calls it periodically)."""
        now = self.clock()
        with self._lock:
            ended = [(k, f) for k, f in self._seen.items() if f.count and now - f.since >= self.window]
            for k, _f in ended:
                self._seen[k] = _Fold(now - self.window)  # the next record passes at once
        for k, f in ended:
            self._emit(k, f)

    def _expire_locked(self, now: float) -> None:
        for k in [k for k, f in self._seen.items() if now - f.since >= self.window and not f.count]:
            del self._seen[k]
        if len(self._seen) >= self.max_keys:  # still full: forget the oldest half
            for k in sorted(self._seen, key=lambda k: self._seen[k].since)[: self.max_keys // 2]:
                del self._seen[k]

    def _emit(self, key: tuple[str, int, str], fold: _Fold) -> None:
        name, level, _template = key
        record = logging.LogRecord(
            name, level, __file__, 0, "... and %d more in the last %g s: %s", (fold.count, self.window, fold.last), None,
        )
        record.repeats = fold.count
        self._emitting = True
        try:
            for handler in logging.getLogger().handlers:
                if self in handler.filters:
                    handler.handle(record)
        finally:
            self._emitting = False


class _Fold:
    __slots__ = ("since", "count", "last")

    def __init__(self, since: float) -> None:
        self.since = since
        self.count = 0
        self.last = ""


def setup(level: str = "INFO", fmt: str = "text", window: float = 30.0, stream: Any = None) -> RepeatFilter:
    """Configure the root logger: one handler on stderr, ``fmt`` text or json, repeats folded."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    repeats = RepeatFilter(window)
    handler.addFilter(repeats)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level))
    return repeats


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f}"


def summary_line(elapsed: float, delta: dict[str, int], l1: dict[str, int], l2: list[dict[str, Any]],
                 errors: dict[str, int]) -> str:
    """The periodic summary: what happened in the last ``elapsed`` seconds, and the state now."""
    asked, hits = delta.get("requested", 0), delta.get("hits", 0)
    rate = f"{100.0 * hits / asked:.1f}%" if asked else "-"
    tiers = ", ".join(f"{t['tier']} {'up' if t['up'] else 'DOWN'}" for t in l2) or "none"
    errs = delta.get("errors", 0)
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(errors.items())) if errs else ""
    return (
        f"last {elapsed:.0f} s: {delta.get('requests', 0)} requests, {delta.get('lookups', 0)} lookups, "
        f"hit tokens {rate} ({hits} of {asked}), {delta.get('stores', 0)} stores, "
        f"L1 {_gib(l1['used_bytes'])}/{_gib(l1['capacity_bytes'])} GiB ({l1['objects']} objects), "
        f"L2 {tiers}, {errs} errors" + (f" (since start: {kinds})" if kinds else "")
    )
