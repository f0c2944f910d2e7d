"""The timeline's loop schedules a world's tasks exactly as trio's run loop does.

A small world of nodes whose machines post to each other, schedule entries, arm timers and crash
nodes -- each decision drawn from one random stream as the events are handled -- runs twice: on
trio (runtime_trio's `Node` tasks in a nursery, the main task sleeping in a cancel scope until
the next entry, as the simulator ran before) and on `Timeline`'s loop with its
`SimNode`. The order in which events are handled (and so every draw) must be the same.
"""
from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from typing import Any

import pytest
import trio

from mpcache.runtime_trio import DeadlockError, Node
from mpcache.runtime_trio.clock import VirtualClock, VirtualTimeDriver
from mpcache.sim.timeline import Alarms, SimNode, Timeline

NODES = 6
UNTIL = 2.0


class Fired:
    def __repr__(self) -> str:
        return "Fired"


class TrioTimeline:
    """The reference: the entry queue's main task on trio (the simulator's former runner)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = 0
        self._sleep: trio.CancelScope | None = None

    def at(self, when: float, action: Callable[..., Any], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, action, args))
        if self._sleep is not None and when < self._sleep.deadline:
            self._sleep.deadline = when

    async def run(self, until: float) -> None:
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
            action(*args)
            await trio.lowlevel.cancel_shielded_checkpoint()


class Chatter:
    """A machine that logs what it handles and draws what to do next from the shared stream."""

    def __init__(self, world: Harness, name: str) -> None:
        self.world = world
        self.name = name
        self.deadline: float | None = None

    def handle(self, event: Any, now: float) -> list[Any]:
        w = self.world
        w.log.append((round(now, 9), self.name, repr(event)))
        if isinstance(event, Fired):
            self.deadline = None
        rng = w.rng
        if len(w.log) > 3000:
            return []
        for _ in range(rng.choice((0, 1, 1, 2))):
            w.post(rng.randrange(NODES), f"{event}>{self.name}"[-40:])
        r = rng.random()
        if r < 0.25:
            w.timeline.at(now + rng.choice((0.0, 0.0, 0.001, 0.01)), w.post, rng.randrange(NODES), f"later:{self.name}")
        elif r < 0.4:
            self.deadline = now + rng.choice((0.0, 0.002, 0.02))
        elif r < 0.41:
            victim = w.nodes[rng.randrange(NODES)]
            w.crashes += victim.alive
            victim.crash()
        return []

    def next_deadline(self) -> float | None:
        return self.deadline


class Harness:
    def __init__(self, seed: int, timeline: Any, now: Callable[[], float]) -> None:
        self.rng = random.Random(f"{seed}:world")
        self.timeline = timeline
        self.now = now
        self.log: list[tuple[float, str, str]] = []
        self.crashes = 0
        self.nodes: list[Node] = []
        self.alarms = Alarms(timeline.at, now)  # the world's rule: a node's timer once per deadline

    def post(self, index: int, text: str) -> None:
        self.nodes[index].post("m", text)

    def arm_timer(self, node: Node, deadline: float | None) -> None:
        self.alarms.arm(node.name, deadline, self._tick, node)

    def _tick(self, node: Node) -> None:
        self.alarms.fired(node.name)
        node.tick()

    def seed_work(self) -> None:
        for i in range(NODES):
            self.timeline.at(self.rng.choice((0.0, 0.001)), self.post, i, "start")


def run_on_trio(seed: int) -> Harness:
    import trio._core._run as trio_run

    timeline = TrioTimeline()
    world = Harness(seed, timeline, trio.current_time)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(NODES):
                node = Node(f"n{i}", {}, lambda n, m, e: None, timer_event=Fired, arm_timer=world.arm_timer)
                node.machines["m"] = Chatter(world, node.name)
                world.nodes.append(node)
                await nursery.start(node.run)
            world.seed_work()
            await timeline.run(UNTIL)
            nursery.cancel_scope.cancel()

    allowed = trio_run._ALLOW_DETERMINISTIC_SCHEDULING
    trio_run._ALLOW_DETERMINISTIC_SCHEDULING = True  # type: ignore[misc]
    trio_run._r.seed(seed)
    try:
        VirtualTimeDriver(VirtualClock()).run(main)
    finally:
        trio_run._ALLOW_DETERMINISTIC_SCHEDULING = allowed  # type: ignore[misc]
    return world


def run_on_timeline(seed: int) -> Harness:
    timeline = Timeline(random.Random(seed))
    world = Harness(seed, timeline, timeline.clock)

    async def main() -> None:
        for i in range(NODES):
            node = SimNode(timeline, f"n{i}", {}, lambda n, m, e: None, timer_event=Fired, arm_timer=world.arm_timer)
            node.machines["m"] = Chatter(world, node.name)
            world.nodes.append(node)
            await timeline.start(node)
        world.seed_work()
        await timeline.run(UNTIL)

    timeline.run_main(main())
    return world


@pytest.mark.parametrize("seed", range(12))
def test_the_loop_handles_events_in_trios_order(seed: int) -> None:
    reference = run_on_trio(seed)
    assert len(reference.log) > 30  # the world did something
    ours = run_on_timeline(seed)
    assert ours.log == reference.log and ours.crashes == reference.crashes


def test_nodes_crash_in_these_worlds() -> None:
    """The comparison covers cancelled nodes (a live node crashed, with work left or not)."""
    assert sum(run_on_timeline(seed).crashes for seed in range(12)) >= 3


def test_a_main_task_waiting_on_nothing_is_a_deadlock() -> None:
    timeline = Timeline(random.Random(0))

    class NeverStarts:
        counter = 0
        starter: Any = None

        def resume(self) -> None:
            pass  # never wakes its starter

    async def main() -> None:
        await timeline.start(NeverStarts())

    with pytest.raises(DeadlockError):
        timeline.run_main(main())
