"""The world's single ordered queue of future happenings, and the loop that runs a world's tasks.

Every wake-up in a simulated world -- a message arriving, a node's timer, an L2 read or a copy
finishing, a workload step, a fault -- is an entry `(time, seq, action)` in one heap. `seq` is a
counter, so two entries at the same virtual instant run in the order they were scheduled, in
every process. The world's main task (`run`) sleeps until the head's time (the virtual clock
jumps there) and runs the action; the nodes it posts to then run before the next entry.

The tasks run on `Timeline`'s own loop, which schedules exactly as trio's run loop does for the
few kinds of task a world has (this is what the simulator ran on before; a seed's event order is
the one it had there): the tasks runnable now form a batch; the batch is ordered by task
creation, shuffled with the seeded `random.Random` trio's deterministic mode uses (`trio._core.
_run._r`, seeded by the runner) and run from its end; what a task makes runnable waits for the
next batch; the clock jumps only when nothing is runnable, to the main task's wake-up. What it
does not pay is trio's machinery around that order -- an I/O poll, cancel scopes and an outcome
per task switch -- which cost most of a seed's CPU time.

The tasks:

* the main task (`World.main`, a coroutine): awaits `sleep_until` (inside `run`), `checkpoint`
  (after each entry: the nodes it woke run first) and `start` (a node's first step);
* a node (`SimNode`, a `runtime_trio.Node` as a task of this loop): trio's memory channel and
  `Node._loop`, unrolled -- a posted item is handed to a waiting node (it becomes runnable) or
  queued; a node that takes a queued item yields once before it handles it; a crash cancels it (its task then runs the
  times trio's cancellation and nursery exit take before it ends -- one with an item in hand
  handles that item first);
* a restart (`spawn`): a coroutine like the main task, started by an action.

The first exception out of any task ends the run (the first violation stops the run); a loop
with nothing runnable and nothing asleep raises `DeadlockError`.
"""
from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Protocol

from mpcache.runtime_trio import DeadlockError, Node
from mpcache.runtime_trio.node import Delivery, TimerTick


class Task(Protocol):
    counter: int

    def resume(self) -> None: ...


class _Trap:
    """What a coroutine task awaits; the loop reads it off `coroutine.send`."""

    __slots__ = ("kind", "arg")

    def __init__(self, kind: str, arg: Any = None) -> None:
        self.kind = kind
        self.arg = arg

    def __await__(self) -> Generator[_Trap, None, None]:
        yield self


_CHECKPOINT = _Trap("checkpoint")


class CoroutineTask:
    """A coroutine on the loop (the world's main task, a server restart)."""

    def __init__(self, loop: Timeline, coroutine: Coroutine[Any, Any, Any], counter: int) -> None:
        self.loop = loop
        self.coroutine = coroutine
        self.counter = counter
        self.done = False

    def resume(self) -> None:
        try:
            trap = self.coroutine.send(None)
        except StopIteration:
            self.done = True
            return
        kind = trap.kind
        loop = self.loop
        if kind == "checkpoint":
            loop.runq.append(self)
        elif kind == "sleep":
            loop._sleeper = self
            loop._wake_at = trap.arg
        elif kind == "start":
            task = trap.arg
            loop._counter += 1
            task.counter = loop._counter
            task.starter = self
            loop.runq.append(task)
        else:  # pragma: no cover - only this module makes traps
            raise AssertionError(f"unknown trap {kind}")


_TICK = TimerTick()
# How many more times a cancelled node task runs (the last run ends it). Blocked in its mailbox:
# Cancelled is delivered at once (the wait raises), then leaving its nursery (no children left)
# is a schedule point of its own. Running (or holding an item, which it handles first): its next
# receive() finds the cancel -- a checkpoint, then the wait that raises -- before the same two.
_UNWIND_BLOCKED = 2
_UNWIND_RUNNING = 3


class SimNode(Node):
    """A `runtime_trio.Node` as a task of the timeline's loop (`sim/timeline.py`): the same
    `step` / `fire_timers` / external timer, its mailbox and `_loop` unrolled into `resume` --
    one call per time the node's trio task would have run."""

    def __init__(self, timeline: Timeline, name: str, machines: dict[str, Any],
                 interpret: Callable[[Node, str, Any], None], **kwargs: Any) -> None:
        super().__init__(name, machines, interpret, clock=timeline.clock, **kwargs)
        self._timeline = timeline
        self._mail: deque[Any] = deque()
        self._item: Any = None  # the item this node holds and handles when it next runs
        self._waiting = False  # blocked on an empty mailbox
        self._started = False
        self._cancelled = False
        self._unwinding = 0  # runs left before the cancelled task ends
        self.counter = 0  # creation order, set when started (trio's task counter)
        self.starter: Any = None  # the task waiting for this node's first step

    def post(self, machine: str, event: Any) -> None:
        if self.alive:
            self._put(Delivery(machine, event))

    def tick(self) -> None:
        if self.alive:
            self._put(_TICK)

    def _put(self, item: Any) -> None:
        if self._waiting:  # handed to the node blocked in its mailbox: it runs in the next batch
            self._waiting = False
            self._item = item
            self._timeline.runq.append(self)
        else:
            self._mail.append(item)

    def spawn(self, async_fn: Any, *args: Any) -> None:
        raise RuntimeError("simulated nodes run no executor tasks: the world performs their effects")

    def crash(self) -> None:
        self.alive = False
        if not self._started or self._cancelled:
            return  # not running yet (trio: no cancel scope to cancel), or already cancelled
        self._cancelled = True
        self._mail.clear()
        if self._waiting:  # blocked in its mailbox: the cancel is delivered at once
            self._waiting = False
            self._unwinding = _UNWIND_BLOCKED
            self._timeline.runq.append(self)

    def resume(self) -> None:
        if self._unwinding:
            self._unwinding -= 1
            if self._unwinding:
                self._timeline.runq.append(self)
            return
        item = self._item
        self._item = None
        if not self._started:  # Node.run: alive, started() wakes the starter, then _loop
            self._started = True
            self.alive = True
            self._timeline.runq.append(self.starter)
        elif item is _TICK:
            self.fire_timers()
        else:
            self.step(item.machine, item.event)
        assert self._arm_timer is not None
        self._arm_timer(self, self.next_deadline())
        if self._cancelled:  # receive() sees the cancel: the task unwinds
            self._unwinding = _UNWIND_RUNNING
            self._timeline.runq.append(self)
        elif self._mail:  # receive() took a queued item: a checkpoint before it returns
            self._item = self._mail.popleft()
            self._timeline.runq.append(self)
        else:
            self._waiting = True


class Timeline:
    def __init__(self, rng: random.Random | None = None) -> None:
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = 0
        self.executed = 0
        self.stop_at = math.inf
        self.now = 0.0
        self.rng = rng if rng is not None else random.Random(0)
        self.runq: list[Any] = []
        self.batches = 0
        self._counter = 2  # trio's init task is 0, the main task 1, its run_sync_soon task 2
        self._sleeper: CoroutineTask | None = None
        self._wake_at = math.inf
        self._main: CoroutineTask | None = None
        self._batch: list[Any] = []  # the tasks of the batch running now that have not run yet
        self._spawned: list[CoroutineTask] = []

    def clock(self) -> float:
        return self.now

    # ---- the queue ------------------------------------------------------------------
    def at(self, when: float, action: Callable[..., Any], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, action, args))
        if when < self._wake_at and self._sleeper is not None:
            # The main task is asleep until a later instant: wake it in time for this entry.
            self._wake_at = when

    def after(self, delay: float, action: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + delay, action, *args)

    def __len__(self) -> int:
        return len(self._heap)

    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    async def run(self, until: float) -> None:
        """Run entries up to virtual time `until` (inclusive), then return at `until`.

        The head is only peeked before sleeping: while the main task sleeps, the nodes woken by
        the previous entry run and may schedule something earlier, which moves the wake-up (`at`)."""
        heap = self._heap
        runq = self.runq
        batch = self._batch
        while True:
            target = heap[0][0] if heap and heap[0][0] <= until else until
            if target > self.now:
                if runq or batch:
                    await _Trap("sleep", target)
                else:
                    # Nothing else runnable: the loop would jump the clock to `target` and run
                    # this task alone (a batch of one draws nothing) -- do just that, here.
                    self.batches += 1
                    self.now = target
                continue
            if not heap or heap[0][0] > until:
                return
            _, _, action, args = heapq.heappop(heap)
            self.executed += 1
            action(*args)
            # Let the nodes woken by this entry run before the next one at the same instant
            # (none woken and none left in this batch: the checkpoint would be a batch of this
            # task alone -- go on).
            if runq or batch:
                await _CHECKPOINT
            else:
                self.batches += 1

    async def settle(self) -> None:
        """Let every task runnable now, and what they make runnable, run before going on (a
        scripted world's main task between two actions)."""
        while self.runq or self._batch:
            await _CHECKPOINT

    # ---- tasks ----------------------------------------------------------------------
    async def start(self, task: Any) -> None:
        """Start `task` (a node: `counter`, `starter`, `resume`); return after its first step,
        as trio's ``nursery.start`` returns once the task called ``task_status.started()``."""
        await _Trap("start", task)

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        """Run `coroutine` as a new task (trio's ``nursery.start_soon``)."""
        self._counter += 1
        task = CoroutineTask(self, coroutine, self._counter)
        self._spawned.append(task)
        self.runq.append(task)

    def run_main(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        """Run the world's main task to its end (the loop described in the module docstring)."""
        main = self._main = CoroutineTask(self, coroutine, 1)
        # trio's first batches: its init task alone, then the main task beside the
        # run_sync_soon task -- one shuffle of two, which draws from the seeded random.
        self.rng.shuffle([0, 1])
        runq = self.runq
        runq.append(main)
        batch = self._batch
        shuffle = self.rng.shuffle
        try:
            while not main.done:
                if not runq:
                    if self._sleeper is None:
                        raise DeadlockError(self.now, ["main task waiting with nothing runnable"])
                    if self._wake_at > self.now:
                        self.now = self._wake_at
                sleeper = self._sleeper
                if sleeper is not None and self._wake_at <= self.now:
                    self._sleeper = None
                    self._wake_at = math.inf
                    runq.append(sleeper)
                self.batches += 1
                if len(runq) == 1:
                    task = runq[0]
                    runq.clear()
                    task.resume()
                    continue
                batch[:] = sorted(runq, key=_by_counter)
                runq.clear()
                shuffle(batch)
                while batch:
                    batch.pop().resume()
        finally:
            # A run ended by an exception leaves tasks suspended (or never started): close them.
            for task in (main, *self._spawned):
                if not task.done:
                    task.coroutine.close()


def _by_counter(task: Task) -> int:
    return task.counter


class Alarms:
    """Each node's timer armed once per deadline: one queue entry for a node's next deadline,
    replaced only by an earlier one (a later or equal deadline keeps the entry already queued);
    an entry in the past no longer counts. ``fired`` says the node's entry ran, so a deadline at
    that same instant arms it again. `at` and `now` are the queue's (``Timeline.at``, its clock)."""

    __slots__ = ("_at", "_now", "_armed")

    def __init__(self, at: Callable[..., None], now: Callable[[], float]) -> None:
        self._at = at
        self._now = now
        self._armed: dict[str, float] = {}

    def arm(self, name: str, deadline: float | None, action: Callable[..., Any], *args: Any) -> None:
        """Queue ``action(*args)`` at ``deadline`` (or now, if it is past) for node ``name``."""
        if deadline is None:
            return
        now = self._now()
        armed = self._armed.get(name, math.inf)
        if armed < now:
            armed = math.inf
        if deadline < armed:
            when = max(deadline, now)
            self._armed[name] = when
            self._at(when, action, *args)

    def fired(self, name: str) -> None:
        """Node ``name``'s entry runs now."""
        if self._armed.get(name) == self._now():
            self._armed[name] = math.inf

    def forget(self, name: str) -> None:
        """A new node of that name (a restarted server): nothing of the old one is armed."""
        self._armed.pop(name, None)
