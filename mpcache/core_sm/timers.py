"""Typed timers and the one bounded heap that holds them.

A timer kind is a small frozen class (subclass ``Timer``) naming what it is about -- e.g. a
job's L2 deadline ``L2Timeout(key, serial)`` -- and, once due, it is an event of its
machine's ``mpcache.core_sm.table.Table`` like any other: its rows say what the deadline does in each
state of the entity it addresses. No string kinds.

``TimerHeap`` orders entries by ``(deadline, seq)`` with a unique ``seq``, so firing order is
deterministic and independent of the timer objects. An entry whose subject ended first (a job
ended, a waiter answered, a transfer finished) is not removed then: it goes stale (``live``
says so) and is skipped when it comes due. So that stale entries cannot pile up for a whole TTL
(memory following the request rate times the TTL), the heap is rebuilt from its live entries
whenever it holds more than twice the live entries of the last rebuild plus ``slack``, and
more than ``floor`` (default ``slack``): amortised O(1) per timer, and the heap stays under
``max(floor, 2 * live + slack)``. A rebuild changes no firing order. A machine that knows its
live count at no cost (one entry per subject it holds) passes ``live_count``: the heap is then
rebuilt whenever it holds more than twice that count now plus ``slack`` (and more than
``floor``), a bound that follows the live entries down as well as up.

Each entry's ``seq`` is the heap's count of pushes when it was pushed (``seq`` names the last
one): a machine may use it as the id of what the entry is about (the L1 index's write batches).
A machine whose expiry step decides staleness itself -- an entry stale by ``live`` may still
have work to do or count against a budget -- pops with ``pop_due_entry``, live or stale.

Deadlines that all follow one TTL (a job's reap deadline: ``abandoned_job_ttl`` after its
lookup) come due in the order they were armed, and there is one per live job: they sit in a
``ReapQueue`` (a FIFO of 16 B entries) instead of the heap.
"""
from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import attrs

T = TypeVar("T")

# Stale entries the heap may hold beyond twice its live ones before it is rebuilt.
DEFAULT_COMPACT_SLACK = 256


@attrs.frozen
class Timer:
    """Base of every timer kind (a frozen attrs class; its fields name its subject)."""


class TimerHeap:
    """Deadlines of typed timers. ``live(timer)`` says whether a timer's subject still exists
    with the state that armed it (the machine decides); dead entries are skipped and compacted."""

    # What a machine's ``state_values`` carries of this part, and the wiring it leaves out
    # (core_sm/values.py; tests/core_sm/test_state_values.py holds every attribute to one).
    STATE_FIELDS: tuple[str, ...] = ("_heap", "_seq", "_compact_at", "compactions")
    WIRING_FIELDS: tuple[str, ...] = ("_live", "_slack", "_floor", "_live_count")

    def __init__(self, live: Callable[[Timer], bool], slack: int | None = None,
                 live_count: Callable[[], int] | None = None, floor: int | None = None) -> None:
        """``live_count``: how many entries are live now, when the machine knows it (else the
        bound follows the live entries of the last rebuild). ``floor``: the heap is never
        rebuilt while it holds at most that many entries (default ``slack``)."""
        self._live = live
        self._slack = DEFAULT_COMPACT_SLACK if slack is None else slack
        self._floor = self._slack if floor is None else floor
        self._live_count = live_count
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = 0
        self._compact_at = self._floor
        self.compactions = 0

    def __len__(self) -> int:
        return len(self._heap)

    @property
    def seq(self) -> int:
        """The ``seq`` of the last entry pushed (0 before any): the next push gets ``seq + 1``."""
        return self._seq

    def push(self, deadline: float, timer: Timer) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, timer))
        if self._live_count is not None:
            if len(self._heap) > max(self._floor, 2 * self._live_count() + self._slack):
                self._compact()
        elif len(self._heap) > self._compact_at:
            self._compact()

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._live(e[2])]
        heapq.heapify(self._heap)
        self._compact_at = max(self._floor, 2 * len(self._heap) + self._slack)
        self.compactions += 1

    def clear(self) -> None:
        """Drop every entry (a machine that ended every subject at once)."""
        self._heap.clear()
        self._compact_at = self._floor

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

    def pop_due_entry(self, now: float) -> tuple[float, Timer] | None:
        """The next entry due at ``now``, live or stale, as ``(deadline, timer)``, removed (firing
        order); None when none is due. For a machine whose expiry step judges each entry itself:
        an entry stale by ``live`` is handed over too, not skipped."""
        if self._heap and self._heap[0][0] <= now:
            deadline, _seq, timer = heapq.heappop(self._heap)
            return deadline, timer
        return None

    def first_deadline(self) -> float | None:
        """The earliest entry's deadline, live or stale, nothing dropped: for a machine whose
        ``next_deadline`` has always named every entry (a stale one fires and does nothing)."""
        return self._heap[0][0] if self._heap else None

    def next_deadline(self) -> float | None:
        heap = self._heap
        while heap and not self._live(heap[0][2]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def timers(self) -> list[Timer]:
        """Every entry, live or stale (tests and invariants)."""
        return [e[2] for e in self._heap]

    def live_entries(self) -> list[tuple[float, Timer]]:
        """``(deadline, timer)`` of every live entry, in firing order (checkers comparing states)."""
        return [(d, t) for d, _seq, t in sorted(self._heap) if self._live(t)]

    def state_values(self) -> tuple[Any, ...]:
        """What changes in the heap, as immutable values: its entries (in heap order, stale ones
        too), the last seq, the compaction bound and count. ``restore`` takes them back."""
        return (tuple(self._heap), self._seq, self._compact_at, self.compactions)

    def restore(self, values: tuple[Any, ...]) -> None:
        """Become the heap ``state_values`` described (the live predicate and bounds are kept)."""
        heap, self._seq, self._compact_at, self.compactions = values
        self._heap = list(heap)


class ReapQueue(Generic[T]):
    """Deadlines of one TTL, in the order they were armed: a FIFO, not a heap entry per item.

    Every item armed with one TTL comes due in the order it was armed, so a queue does what the
    heap does for a fraction of the memory: an entry is a float in an array and a reference in a
    list (16 B, no object). A deadline earlier than the last one armed (a clock that stepped
    back) is held to the last one: an item is never due before its deadline, at worst later.
    ``live(item)`` says whether the item still waits for its deadline; an item that ended first
    goes stale, is skipped when it reaches the front, and is compacted away (as in
    ``TimerHeap``) once the queue holds more than twice the live entries of the last rebuild
    plus ``slack``."""

    # What a machine's ``state_values`` carries of this part, and the wiring it leaves out
    # (core_sm/values.py; tests/core_sm/test_state_values.py holds every attribute to one).
    STATE_FIELDS: tuple[str, ...] = ("_times", "_items", "_head", "_compact_at", "compactions")
    WIRING_FIELDS: tuple[str, ...] = ("_live", "_slack")

    def __init__(self, live: Callable[[T], bool], slack: int | None = None) -> None:
        self._live = live
        self._slack = DEFAULT_COMPACT_SLACK if slack is None else slack
        self._times = array("d")
        self._items: list[T | None] = []
        self._head = 0
        self._compact_at = self._slack
        self.compactions = 0

    def __len__(self) -> int:
        return len(self._items) - self._head

    def push(self, deadline: float, item: T) -> None:
        times = self._times
        if len(times) > self._head and deadline < times[-1]:
            deadline = times[-1]
        times.append(deadline)
        self._items.append(item)
        if len(self._items) - self._head > self._compact_at:
            self._compact()

    def _compact(self) -> None:
        live = self.live_entries()
        self._times = array("d", (t for t, _i in live))
        self._items = [i for _t, i in live]
        self._head = 0
        self._compact_at = 2 * len(live) + self._slack
        self.compactions += 1

    def _drop_front(self) -> None:
        self._items[self._head] = None
        self._head += 1
        if self._head > 64 and 2 * self._head > len(self._items):
            del self._items[: self._head]
            del self._times[: self._head]
            self._head = 0

    def pop_due(self, now: float) -> T | None:
        """The next live item whose deadline is ``<= now``, removed; None when none is due."""
        while self._head < len(self._items) and self._times[self._head] <= now:
            item = self._items[self._head]
            self._drop_front()
            if item is not None and self._live(item):
                return item
        return None

    def next_deadline(self) -> float | None:
        """The deadline of the first live entry (stale ones in front are dropped)."""
        while self._head < len(self._items):
            item = self._items[self._head]
            if item is not None and self._live(item):
                return self._times[self._head]
            self._drop_front()
        return None

    def items(self) -> list[T]:
        """Every entry still queued, live or stale (tests and invariants)."""
        return [i for i in self._items[self._head:] if i is not None]

    def live_entries(self) -> list[tuple[float, T]]:
        """``(time, item)`` of every live entry, in the order they come due (checkers comparing
        states)."""
        return [(t, i) for t, i in zip(self._times[self._head:], self._items[self._head:])
                if i is not None and self._live(i)]
