"""The entry point the client machines share: ``handle`` never lets an exception escape.

A bug in a machine must not kill the node that hosts it (a vLLM scheduler or worker): the
exception is counted in ``stats()["internal_errors"]`` (oracles and metrics assert it stays 0)
and the effects produced before it are still returned, so nothing already decided is lost.
The server has its own entry point, since it must also answer the request that failed.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, TypeVar

from mpcache.core_sm.effects import Effect

EventT = TypeVar("EventT")


class GuardedMachine(Generic[EventT]):
    """Base of ``LookupClient`` and ``TransferClient``: subclasses implement ``_advance`` (the
    time-driven work due at ``now``) and ``_dispatch`` (one event)."""

    _counters: dict[str, int]

    @property
    def counters(self) -> Mapping[str, int]:
        """The machine's own counters, live (read them; ``stats()`` is a copy with more)."""
        return self._counters

    def handle(self, event: EventT, now: float) -> list[Effect]:
        """Feed one event; returns the effects, in order. Never raises: events meant for other
        machines are ignored and counted as stale; an exception (a bug) is counted in
        ``stats()["internal_errors"]`` and the effects produced so far are returned."""
        out: list[Effect] = []
        try:
            self._advance(now, out)
            self._dispatch(event, now, out)
        except Exception:
            self._counters["internal_errors"] += 1
        return out

    def _advance(self, now: float, out: list[Effect]) -> None:
        raise NotImplementedError

    def _dispatch(self, event: EventT, now: float, out: list[Effect]) -> None:
        raise NotImplementedError
