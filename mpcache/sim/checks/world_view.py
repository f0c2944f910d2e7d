"""What the world's oracles read of the world: the narrow view a checker is given (the checkers
live apart from the world they judge, as TigerBeetle's do, and import nothing of it).
``sim.world.World`` and ``sim.server_host.ServerHost`` are what satisfy these in the simulator."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from mpcache.core_sm.chunks import ObjectKey
from mpcache.runtime_trio import Node
from mpcache.sim.checks.finding import Finding
from mpcache.sim.ports import Via
from mpcache.sim.scenario import WorldConfig


class HostView(Protocol):
    """One simulated server as the oracles read it: this incarnation's bookkeeping, which the
    admission oracle also updates (what each chunk was looked up, the objects held)."""

    index: int
    name: str
    incarnation: int
    node: Node | None
    slots: dict[int, tuple[int, ...]]
    up: bool
    started_at: float
    awaiting_reply: dict[Via, tuple[str, float]]
    last_session_event: dict[str, tuple[str, float]]
    lookups_handled: set[str]
    chunk_lookups: dict[bytes, int]
    objects_held: frozenset[Any]
    heartbeat_seen: dict[int, float]
    reaped: set[int]


class WorldView(Protocol):
    """The world as the oracles read it, and the two ways they report (``violation``, ``judge``)."""

    config: WorldConfig
    written: set[ObjectKey]
    touched: set[str]
    released_sent: set[tuple[str | None, int]]
    held_after_done: set[tuple[str, int]]
    lookups_in_flight: dict[tuple[str, int], dict[int, float]]

    @property
    def servers(self) -> Sequence[HostView]: ...

    @property
    def engines(self) -> Sequence[Any]: ...

    def now(self) -> float: ...

    def violation(self, code: str, node: str, message: str) -> None: ...

    def judge(self, node: str, finding: Finding | None) -> None: ...

    def engine_of_node(self, name: str) -> Any: ...

    def recent_lines(self, rid: str, n: int = 3) -> str: ...

    def find_request(self, rid: str) -> tuple[Any, Any] | None: ...
