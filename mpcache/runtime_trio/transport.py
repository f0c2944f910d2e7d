"""Transports carry messages between nodes; executors run slow effects off the node loop.

Both are pluggable so the same node runs in an in-process cluster on the real clock
(`LocalTransport`, `TaskExecutor`) and inside the simulator (SimNet, simulated L2/transfers).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import attrs

from mpcache.runtime_trio.node import Node


@attrs.frozen
class Address:
    """A machine inside a node."""

    node: str
    machine: str


class Transport(Protocol):
    def send(self, src: Address, dst: Address, message: Any) -> None:
        """Non-blocking; the message may be delayed, reordered or lost by the transport."""


class LocalTransport:
    """In-process delivery: the message is posted at once into the destination's mailbox.

    `wrap(src, message)` turns the message into the event the destination machine handles
    (e.g. fills in `reply_to`), so the transport itself stays protocol-free.
    """

    def __init__(self, wrap: Callable[[Address, Address, Any], Any] | None = None) -> None:
        self.nodes: dict[str, Node] = {}
        self._wrap = wrap
        self.sent = 0

    def add(self, node: Node) -> None:
        self.nodes[node.name] = node

    def send(self, src: Address, dst: Address, message: Any) -> None:
        node = self.nodes.get(dst.node)
        if node is None:
            return
        self.sent += 1
        event = self._wrap(src, dst, message) if self._wrap is not None else message
        node.post(dst.machine, event)


class Executor(Protocol):
    def start(self, node: Node, machine: str, effect: Any) -> None:
        """Begin the work for `effect`; post the completion event to `machine` when done."""


class TaskExecutor:
    """Runs `work(effect) -> completion event` as a task in the node's nursery."""

    def __init__(self, work: Callable[[Any], Awaitable[Any]]) -> None:
        self._work = work

    def start(self, node: Node, machine: str, effect: Any) -> None:
        async def job() -> None:
            event = await self._work(effect)
            node.post(machine, event)

        node.spawn(job)
