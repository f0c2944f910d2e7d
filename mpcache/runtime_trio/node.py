"""A node: core_sm machines + a mailbox + an effect interpreter + one timer.

The node knows nothing about the protocol. Its loop is the whole runtime:

    event = await mailbox.receive()
    effects = machine.handle(event, now)
    for effect in effects: interpret(node, machine_name, effect)
    if machine.deferred_work:          # a machine that acknowledged before working
        interpret the effects so far    # (the ack leaves first), then
        effects += machine.run_deferred()  # its work, before the next event
    re-arm the timer at min(machine.next_deadline() for machine in machines)

When the timer expires the node hands `timer_event()` (core_sm's `TimerFired()`) to every
machine whose deadline has passed.

Timers come in two flavours:

* internal (default): the mailbox wait is bounded by `trio.move_on_at(deadline)`; works on
  the real clock and on any virtual clock;
* external: the node calls `arm_timer(node, deadline)` after every step and the owner posts a
  `TimerTick` into the mailbox at that time. The simulator uses this so that every wake-up in
  the world comes from one ordered queue (trio breaks ties between equal deadlines by object
  id, which would make runs differ between processes).

Executors (L2 reads, transfers, copies) run as tasks in the node's nursery via `spawn`; their
result is posted back into the mailbox as an ordinary event.
"""
from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import attrs
import trio


class Machine(Protocol):
    def handle(self, event: Any, now: float) -> list[Any]: ...

    def next_deadline(self) -> float | None: ...


@attrs.frozen
class Delivery:
    """One mailbox item: `event` for the machine called `machine`."""

    machine: str
    event: Any


@attrs.frozen
class TimerTick:
    """Posted by an external timer owner: fire the machines whose deadline has passed."""


Interpreter = Callable[["Node", str, Any], None]
"""interpret(node, machine_name, effect): perform one effect (send, start a transfer...)."""

Observer = Callable[["Node", str, Any, list[Any], float], None]
"""observer(node, machine_name, event, effects, now): called after every handled event."""


class Node:
    """Hosts machines; see the module docstring for the contract."""

    def __init__(
        self,
        name: str,
        machines: Mapping[str, Machine],
        interpret: Interpreter,
        *,
        timer_event: Callable[[], Any],
        arm_timer: Callable[[Node, float | None], None] | None = None,
        observer: Observer | None = None,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.name = name
        self.machines: dict[str, Any] = dict(machines)
        self._interpret = interpret
        self._timer_event = timer_event
        self._arm_timer = arm_timer
        self._observer = observer
        self._clock = clock
        self._send, self._receive = trio.open_memory_channel[Any](math.inf)
        self._nursery: trio.Nursery | None = None
        self._cancel_scope: trio.CancelScope | None = None
        self.alive = False
        self.handled = 0

    # ---- outside world -> node -------------------------------------------------------
    def post(self, machine: str, event: Any) -> None:
        """Queue `event` for `machine` (non-blocking; dropped if the node is dead)."""
        if self.alive:
            self._send.send_nowait(Delivery(machine, event))

    def tick(self) -> None:
        if self.alive:
            self._send.send_nowait(TimerTick())

    def spawn(self, async_fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run an executor task inside this node (it dies with the node)."""
        assert self._nursery is not None, "node is not running"
        self._nursery.start_soon(async_fn, *args)

    def crash(self) -> None:
        """Cancel the node: its tasks stop, its mailbox is discarded."""
        self.alive = False
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()

    # ---- the loop ------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        best: float | None = None
        for machine in self.machines.values():
            d = machine.next_deadline()
            if d is not None and (best is None or d < best):
                best = d
        return best

    def step(self, machine_name: str, event: Any) -> list[Any]:
        """Hand one event to one machine and interpret its effects (synchronous)."""
        machine = self.machines[machine_name]
        now = self._clock()
        effects: list[Any] = machine.handle(event, now)
        self.handled += 1
        later = effects
        if getattr(machine, "deferred_work", False):
            # The machine acknowledged first (core_sm ServerConfig.ack_first): its replies go
            # out, then it does the work it left, before the node takes the next event.
            for effect in effects:
                self._interpret(self, machine_name, effect)
            later = machine.run_deferred()
            effects = effects + later
        if self._observer is not None:
            self._observer(self, machine_name, event, effects, now)
        for effect in later:
            self._interpret(self, machine_name, effect)
        return effects

    def fire_timers(self) -> None:
        now = self._clock()
        for name in list(self.machines):
            d = self.machines[name].next_deadline()
            if d is not None and d <= now:
                self.step(name, self._timer_event())

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            self._cancel_scope = scope
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.alive = True
                task_status.started()
                try:
                    await self._loop()
                finally:
                    self.alive = False
                    nursery.cancel_scope.cancel()

    async def _loop(self) -> None:
        receive = self._receive
        while True:
            deadline = self.next_deadline()
            if self._arm_timer is not None:
                self._arm_timer(self, deadline)
                item = await receive.receive()
            else:
                item = None
                with trio.move_on_at(math.inf if deadline is None else deadline):
                    item = await receive.receive()
                if item is None:
                    self.fire_timers()
                    continue
            if type(item) is TimerTick:
                self.fire_timers()
            else:
                self.step(item.machine, item.event)
