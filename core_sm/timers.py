"""Typed timers and the one bounded heap that holds them.

A timer kind is a small frozen class (subclass ``Timer``) naming what it is about -- e.g. a
job's reap deadline ``ReapJob(request_id, serial)`` -- and, once due, it is an event of its
machine's ``core_sm.table.Table`` like any other: its rows say what the deadline does in each
state of the entity it addresses. No string kinds.

``TimerHeap`` orders entries by ``(deadline, seq)`` with a unique ``seq``, so firing order is
deterministic and independent of the timer objects. An entry whose subject ended first (a job
ended, a waiter answered, a transfer finished) is not removed then: it goes stale (``live``
says so) and is skipped when it comes due. So that stale entries cannot pile up for a whole TTL
(memory following the request rate times the TTL), the heap is rebuilt from its live entries
whenever it holds more than twice the live entries of the last rebuild plus ``slack``:
amortised O(1) per timer, and the heap stays under ``2 * live + slack``. A rebuild changes no
firing order.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable

import attrs

# Stale entries the heap may hold beyond twice its live ones before it is rebuilt.
DEFAULT_COMPACT_SLACK = 256


@attrs.frozen
class Timer:
    """Base of every timer kind (a frozen attrs class; its fields name its subject)."""


class TimerHeap:
    """Deadlines of typed timers. ``live(timer)`` says whether a timer's subject still exists
    with the state that armed it (the machine decides); dead entries are skipped and compacted."""

    def __init__(self, live: Callable[[Timer], bool], slack: int | None = None) -> None:
        self._live = live
        self._slack = DEFAULT_COMPACT_SLACK if slack is None else slack
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = 0
        self._compact_at = self._slack
        self.compactions = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, deadline: float, timer: Timer) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, timer))
        if len(self._heap) > self._compact_at:
            self._heap = [e for e in self._heap if self._live(e[2])]
            heapq.heapify(self._heap)
            self._compact_at = 2 * len(self._heap) + self._slack
            self.compactions += 1

    def due(self, now: float) -> bool:
        """Whether some entry (live or stale) is due at ``now`` (cheap: the heap's top)."""
        return bool(self._heap) and self._heap[0][0] <= now

    def pop_due(self, now: float) -> Timer | None:
        """The next live timer due at ``now`` (firing order), removed; None when none is due.
        Call it until None: a handler may push timers meanwhile (even due ones)."""
        while self._heap and self._heap[0][0] <= now:
            _deadline, _seq, timer = heapq.heappop(self._heap)
            if self._live(timer):
                return timer
        return None

    def next_deadline(self) -> float | None:
        heap = self._heap
        while heap and not self._live(heap[0][2]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def timers(self) -> list[Timer]:
        """Every entry, live or stale (tests and invariants)."""
        return [e[2] for e in self._heap]
