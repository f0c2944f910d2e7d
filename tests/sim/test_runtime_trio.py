"""runtime_trio: node loop, timers, transports, virtual clock and deadlock detection."""
from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio

from mpcache.runtime_trio import Address, DeadlockError, LocalTransport, Node, TaskExecutor, run_virtual


@attrs.frozen
class Ping:
    n: int


@attrs.frozen
class Tick:
    pass


@attrs.frozen
class Send:
    dst: str
    msg: Any


class PingPong:
    """A toy machine: answers Ping(n) with Ping(n+1) until n reaches `stop`; a timer at 5s."""

    def __init__(self, peer: str, stop: int) -> None:
        self.peer, self.stop = peer, stop
        self.seen: list[tuple[int, float]] = []
        self.deadline: float | None = 5.0
        self.fired: list[float] = []

    def handle(self, event: Any, now: float) -> list[Any]:
        if isinstance(event, Tick):
            self.fired.append(now)
            self.deadline = None
            return []
        self.seen.append((event.n, now))
        return [Send(self.peer, Ping(event.n + 1))] if event.n < self.stop else []

    def next_deadline(self) -> float | None:
        return self.deadline


def make_cluster(delay: float) -> tuple[LocalTransport, list[Node]]:
    net = LocalTransport()
    nodes = []

    def interpret(node: Node, machine: str, effect: Any) -> None:
        async def later() -> None:
            await trio.sleep(delay)
            net.send(Address(node.name, machine), Address(effect.dst, "m"), effect.msg)

        node.spawn(later)

    for name, peer in (("a", "b"), ("b", "a")):
        node = Node(name, {"m": PingPong(peer, 6)}, interpret, timer_event=Tick)
        net.add(node)
        nodes.append(node)
    return net, nodes


async def play(delay: float) -> list[Node]:
    net, nodes = make_cluster(delay)
    async with trio.open_nursery() as nursery:
        for node in nodes:
            await nursery.start(node.run)
        nodes[0].post("m", Ping(0))
        await trio.sleep(6.0)
        nursery.cancel_scope.cancel()
    return nodes


def test_virtual_time_is_exact() -> None:
    nodes = run_virtual(play, 0.25)
    a, b = (n.machines["m"] for n in nodes)
    assert a.seen == [(0, 0.0), (2, 0.5), (4, 1.0), (6, 1.5)]  # type: ignore[attr-defined]
    assert b.seen == [(1, 0.25), (3, 0.75), (5, 1.25)]  # type: ignore[attr-defined]
    assert a.fired == [5.0] and b.fired == [5.0]  # type: ignore[attr-defined]


def test_real_clock_cluster_runs() -> None:
    # The same nodes on trio's real clock (short delays, timer at 5 s relative to start).
    async def main() -> list[Node]:
        net, nodes = make_cluster(0.001)
        for n in nodes:
            n.machines["m"].deadline = trio.current_time() + 0.05  # type: ignore[attr-defined]
        async with trio.open_nursery() as nursery:
            for node in nodes:
                await nursery.start(node.run)
            nodes[0].post("m", Ping(0))
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()
        return nodes

    nodes = trio.run(main)
    assert [n for n, _ in nodes[0].machines["m"].seen] == [0, 2, 4, 6]  # type: ignore[attr-defined]
    assert len(nodes[0].machines["m"].fired) == 1  # type: ignore[attr-defined]


def test_deadlock_is_reported_with_blocked_tasks() -> None:
    async def stuck() -> None:
        send, receive = trio.open_memory_channel[int](0)

        async def waiter_on_reply() -> None:
            await receive.receive()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter_on_reply, name="waiter_on_reply")
            await trio.sleep(3.0)

    with pytest.raises(DeadlockError) as info:
        run_virtual(stuck)
    assert info.value.now == 3.0
    assert any("waiter_on_reply" in line for line in info.value.blocked)


def test_task_executor_posts_completion() -> None:
    results: list[tuple[Any, float]] = []

    class Caller:
        def handle(self, event: Any, now: float) -> list[Any]:
            results.append((event, now))
            return []

        def next_deadline(self) -> float | None:
            return None

    async def work(effect: Any) -> Any:
        await trio.sleep(2.0)
        return ("done", effect)

    async def main() -> None:
        executor = TaskExecutor(work)
        node = Node("n", {"c": Caller()}, lambda *a: None, timer_event=Tick)
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            executor.start(node, "c", "copy#1")
            await trio.sleep(10)
            nursery.cancel_scope.cancel()

    run_virtual(main)
    assert results == [(("done", "copy#1"), 2.0)]


def test_core_sm_machines_on_the_real_clock() -> None:
    """runtime_trio drives production core_sm machines on trio's real clock: an in-process
    LookupServer and LookupClient, a lookup that resolves, a duplicate-free status exchange."""
    import attrs as _attrs

    from mpcache.core_sm.effects import ErrorReply, Reply, SendRequest
    from mpcache.core_sm.lookup_client import LookupClient, LookupClientConfig, LookupState
    from mpcache.core_sm.messages import ReplyReceived, RequestFailed, SubmitLookup, TimerFired
    from mpcache.core_sm.server import LookupServer, ServerConfig

    net = LocalTransport()

    def interpret(node: Node, machine: str, effect: Any) -> None:
        if isinstance(effect, SendRequest):
            request = _attrs.evolve(effect.request, reply_to=(node.name, machine, effect.server, effect.correlation))
            net.send(Address(node.name, machine), Address("server", "server"), request)
        elif isinstance(effect, (Reply, ErrorReply)):
            client, client_machine, server, corr = effect.reply_to
            event = (ReplyReceived(server, corr, effect.result) if isinstance(effect, Reply)
                     else RequestFailed(server, corr, effect.error))
            net.send(Address(node.name, machine), Address(client, client_machine), event)

    server = Node("server", {"server": LookupServer(ServerConfig(chunk_size=4))}, interpret, timer_event=TimerFired)
    client = LookupClient(LookupClientConfig(model_name="m", chunk_size=4, poll_interval=0.001))
    sched = Node("sched", {"lookup": client}, interpret, timer_event=TimerFired)
    net.add(server)
    net.add(sched)

    async def main() -> int | None:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            await nursery.start(sched.run)
            sched.post("lookup", SubmitLookup("req-1", tuple(range(10))))
            with trio.move_on_after(2.0):
                while client.state("req-1") is not LookupState.DONE:
                    await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
        return client.check("req-1")

    assert trio.run(main) == 0  # nothing stored: a miss, resolved on the real clock
    assert server.handled >= 2 and net.sent >= 4
