"""The world's single ordered queue of future happenings.

Every wake-up in a simulated world -- a message arriving, a node's timer, an L2 read or a copy
finishing, a workload step, a fault -- is an entry `(time, seq, action)` in one heap. `seq` is a
counter, so two entries at the same virtual instant run in the order they were scheduled, in
every process. One trio task (`run`) sleeps until the head's time (the virtual clock jumps
there) and runs the action; the nodes it posts to then run before the next entry.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any

import trio


class Timeline:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = 0
        self.executed = 0
        self.stop_at = math.inf
        self._sleep: trio.CancelScope | None = None

    def at(self, when: float, action: Callable[..., Any], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, action, args))
        scope = self._sleep
        if scope is not None and when < scope.deadline:
            # The runner is asleep until a later instant: wake it in time for this entry.
            scope.deadline = when

    def after(self, delay: float, action: Callable[..., Any], *args: Any) -> None:
        self.at(trio.current_time() + delay, action, *args)

    def __len__(self) -> int:
        return len(self._heap)

    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    async def run(self, until: float) -> None:
        """Run entries up to virtual time `until` (inclusive), then return at `until`.

        The head is only peeked before sleeping: while the runner sleeps, the nodes woken by the
        previous entry run and may schedule something earlier, which moves the wake-up (`at`)."""
        heap = self._heap
        while True:
            target = heap[0][0] if heap and heap[0][0] <= until else until
            if target > trio.current_time():
                with trio.CancelScope(deadline=target) as scope:
                    self._sleep = scope
                    try:
                        await trio.sleep_forever()
                    finally:
                        self._sleep = None
                continue
            if not heap or heap[0][0] > until:
                return
            _, _, action, args = heapq.heappop(heap)
            self.executed += 1
            action(*args)
            # Let the nodes woken by this entry run before the next one at the same instant.
            await trio.lowlevel.cancel_shielded_checkpoint()
