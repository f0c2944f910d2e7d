"""What the simulator's engine model needs from the world it lives in, and the messages they
exchange.

``mpcache.sim.world.World`` implements ``WorldPort``; ``mpcache.sim.engine`` and its transport
(``mpcache.sim.transport``) are written against this protocol only, so neither imports World nor
reaches a private member of it (the world creates the engines; the dependency runs one way).
"""
from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import attrs

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.errors import ProtocolError
from mpcache.runtime_trio import Address, Node
from mpcache.sim.timeline import Timeline
from mpcache.sim.trace import Trace

__all__ = ["SERVER", "ReplyMsg", "RequestMsg", "Via", "WorldPort", "request_id_of"]

SERVER = "server"  # the machine name of a server node's core_sm server (its address's port)


@attrs.frozen
class Via:
    """The simulator's `reply_to`: who asked, under which correlation, through which packet."""

    node: str
    machine: str
    server: int
    correlation: int
    pid: int
    request_id: str | None
    delivery: int = 0  # a duplicated packet is two requests, each owed its own reply


@attrs.frozen
class RequestMsg:
    server: int
    correlation: int
    request: Any


@attrs.frozen
class ReplyMsg:
    server: int
    correlation: int
    result: Any = None
    error: ProtocolError | None = None
    request_id: str | None = None  # what the answered request was about (traces, fault tracking)


def request_id_of(message: Any) -> str | None:
    """The request id a message is about (for per-request fault tracking and charts)."""
    if isinstance(message, RequestMsg):
        message = message.request
    rid = getattr(message, "request_id", None)
    if rid is None:
        key = getattr(message, "key", None)
        rid = getattr(key, "request_id", None)
    return rid if isinstance(rid, str) else None


class WorldPort(Protocol):
    """The world as the engine model sees it."""

    config: Any
    scenario: Any
    profile: Any
    t0: float
    timeline: Timeline
    trace: Trace
    exec_rng: random.Random
    servers: list[Any]
    nodes: dict[str, Node]
    touched: set[str]
    stats: dict[str, int]

    def now(self) -> float: ...

    def recent_lines(self, rid: str, n: int = 3) -> str: ...

    def make_node(self, name: str, machines: dict[str, Any],
                  interpret: Callable[[Node, str, Any], None]) -> Node: ...

    def start_node(self, node: Node) -> Coroutine[Any, Any, None]: ...

    def arm_timer(self, node: Node, deadline: float | None) -> None: ...

    def latency(self, mean: float) -> float: ...

    def send(self, src: Address, dst: Address, message: Any) -> None: ...

    def violation(self, code: str, node: str, message: str) -> None: ...

    def note_written(self, rid: str, chunk: int, rank: int) -> None: ...

    def note_done(self, rid: str, node: str) -> None: ...

    def check_slot_target(self, host: Any, slot: int, key: ObjectKey, what: str) -> None: ...
