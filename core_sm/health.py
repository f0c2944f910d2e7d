"""``HealthMonitor``: one client node's view of every server's health and epoch, as a pure machine.

A client node (a vLLM scheduler or worker) pings each server; the monitor decides when, and
what the answers mean for the node's protocol machines (``LookupClient``, ``TransferClient``,
``StepPlanner``), which it tells through the events they already take:

* every ``interval`` it asks for one heartbeat per server (``SendHeartbeat``); while a server is
  unhealthy the interval doubles per miss up to ``backoff_max`` (a dead server is not hammered)
  and resets once it answers;
* no reply for ``timeout`` -> ``ServerHealth(server, False)``: the machines fail what is pending
  on it and skip it until it is back;
* a reply (``HeartbeatReply(server, epoch)``) -> ``ServerHealth(server, True)`` if it was not
  healthy; its ``epoch`` (the server's start id) -> ``ServerEpoch(server, epoch)`` the first time
  and whenever it changes, *before* the health change: a restart between two heartbeats (F13),
  which no timeout ever showed, makes the machines resolve what was in flight and register again.

``handle(event, now) -> effects`` never raises; ``next_deadline()`` is the next ping or timeout.
Driven by the simulator's client nodes (``sim/engine.py``) with virtual time.
"""
from __future__ import annotations

from typing import Union

import attrs

from core_sm.messages import ServerEpoch, ServerHealth, TimerFired


@attrs.frozen
class HealthConfig:
    num_servers: int
    interval: float = 1.0
    timeout: float = 2.5
    backoff_max: float = 8.0
    initially_healthy: bool = False  # the runtime already told the machines "healthy"

    def __attrs_post_init__(self) -> None:
        if self.num_servers < 1 or not 0 < self.interval < self.timeout or self.backoff_max < self.interval:
            raise ValueError(f"bad health config {self!r}: need 0 < interval < timeout, backoff_max >= interval")


@attrs.frozen
class HeartbeatReply:
    """A heartbeat reply from ``server``, with the server's start id if the transport has it."""

    server: int
    epoch: int | str | None = None


@attrs.frozen
class SendHeartbeat:
    """Effect: send one heartbeat to ``server``; its reply comes back as ``HeartbeatReply``."""

    server: int


HealthEvent = Union[HeartbeatReply, TimerFired]
HealthEffect = Union[SendHeartbeat, ServerHealth, ServerEpoch]


@attrs.define
class _Server:
    healthy: bool
    last_reply: float
    next_ping: float
    period: float
    epoch: int | str | None = None


class HealthMonitor:
    def __init__(self, config: HealthConfig, now: float = 0.0) -> None:
        self.config = config
        self._servers = [_Server(config.initially_healthy, now, now, config.interval)
                         for _ in range(config.num_servers)]
        self._counters = {"internal_errors": 0, "heartbeats_sent": 0, "unhealthy": 0, "recovered": 0,
                          "epoch_changes": 0, "stale_replies": 0}

    def healthy(self, server: int) -> bool:
        return self._servers[server].healthy

    def epoch(self, server: int) -> int | str | None:
        return self._servers[server].epoch

    def stats(self) -> dict[str, int]:
        return dict(self._counters)

    def next_deadline(self) -> float | None:
        deadlines = [s.next_ping for s in self._servers]
        deadlines += [s.last_reply + self.config.timeout for s in self._servers if s.healthy]
        return min(deadlines)

    def handle(self, event: HealthEvent, now: float) -> list[HealthEffect]:
        out: list[HealthEffect] = []
        try:
            if isinstance(event, HeartbeatReply):
                self._on_reply(event, now, out)
            elif isinstance(event, TimerFired):
                self._on_timer(now, out)
            else:
                self._counters["stale_replies"] += 1
        except Exception:
            self._counters["internal_errors"] += 1
        return out

    def _on_timer(self, now: float, out: list[HealthEffect]) -> None:
        c = self.config
        for index, server in enumerate(self._servers):
            if server.healthy and now - server.last_reply >= c.timeout:
                server.healthy = False
                self._counters["unhealthy"] += 1
                out.append(ServerHealth(index, False))
            if server.next_ping <= now:
                out.append(SendHeartbeat(index))
                self._counters["heartbeats_sent"] += 1
                if not server.healthy and now - server.last_reply >= c.timeout:
                    server.period = min(server.period * 2, c.backoff_max)
                server.next_ping = now + server.period

    def _on_reply(self, event: HeartbeatReply, now: float, out: list[HealthEffect]) -> None:
        if not 0 <= event.server < len(self._servers):
            self._counters["stale_replies"] += 1
            return
        server = self._servers[event.server]
        server.last_reply = max(server.last_reply, now)
        if event.epoch is not None and event.epoch != server.epoch:
            if server.epoch is not None:
                self._counters["epoch_changes"] += 1
            server.epoch = event.epoch
            out.append(ServerEpoch(event.server, event.epoch))
        if not server.healthy:
            server.healthy = True
            server.period = self.config.interval
            server.next_ping = min(server.next_ping, now + server.period)
            self._counters["recovered"] += 1
            out.append(ServerHealth(event.server, True))
