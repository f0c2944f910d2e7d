"""SimNet: the simulated network between nodes (a `runtime_trio.Transport`).

Per directed link (src node -> dst node):

* delay: `min_delay + expovariate(mean)`; reordering follows from independent delays, plus an
  optional extra "reorder" delay with probability `reorder_p`;
* `drop_p`: the message is lost; `dup_p`: it is delivered twice (independent delays);
* partitions: a set of blocked directed links (symmetric = both directions; one-way = one);
  a message sent on a blocked link is lost;
* clog: a link clogged until time T holds its messages and releases them after T (order kept
  by their own delays);
* capacity: at most `capacity` messages in flight on a link; one more drops a random in-flight
  message on that link (as a full queue would).

`heal()` removes partitions and clogs; `calm()` also turns faults off and shortens delays (the
liveness phase). Every decision draws from one `random.Random` seeded by the world.

Scripted (`script()`, a world driven by a tape, `sim/world.py`): a message sent is put in a bag
and nothing is drawn; the tape delivers, drops or duplicates each one (`deliver`, `drop`,
`duplicate`) -- partitions and clogs still apply. `release()` ends it: what is still in the bag
is delivered, in the order it was sent, after the minimum delay, and later messages go the
random way again.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import attrs

from mpcache.runtime_trio import Address
from mpcache.sim.timeline import Timeline


@attrs.define
class NetConfig:
    min_delay: float = 0.0005
    mean_delay: float = 0.002
    drop_p: float = 0.0
    dup_p: float = 0.0
    reorder_p: float = 0.0
    reorder_delay: float = 0.02
    capacity: int = 64


@attrs.define(eq=False)
class Packet:
    pid: int
    src: Address
    dst: Address
    message: Any
    sent_at: float
    deliver_at: float = 0.0
    cancelled: bool = False


Deliver = Callable[[Packet], None]
Observe = Callable[[str, Packet], None]


class SimNet:
    def __init__(
        self, timeline: Timeline, rng: random.Random, config: NetConfig, deliver: Deliver, observe: Observe
    ) -> None:
        self.timeline = timeline
        self.rng = rng
        self.config = config
        self._deliver = deliver
        self._observe = observe
        self.blocked: set[tuple[str, str]] = set()
        self.clogged_until: dict[tuple[str, str], float] = {}
        self.in_flight: dict[tuple[str, str], list[Packet]] = {}
        self._pid = 0
        self.now: Callable[[], float] = lambda: 0.0
        self.counts = {"sent": 0, "delivered": 0, "dropped": 0, "duplicated": 0, "blocked": 0, "overflow": 0}
        self.bag: list[Packet] | None = None  # scripted: the messages in flight, in the order sent

    # ---- scripted -------------------------------------------------------------------
    def script(self) -> None:
        """From now on a message waits in the bag until the tape moves it."""
        self.bag = []

    def deliver(self, packet: Packet) -> None:
        """The tape delivers ``packet`` now (it leaves the bag)."""
        assert self.bag is not None
        self.bag.remove(packet)
        packet.deliver_at = self.now()
        self._arrive(packet)

    def drop(self, packet: Packet) -> None:
        """The tape loses ``packet``."""
        assert self.bag is not None
        self.bag.remove(packet)
        self.counts["dropped"] += 1
        self._observe("drop", packet)

    def duplicate(self, packet: Packet) -> None:
        """The tape duplicates ``packet``: a second copy (the same pid) waits in the bag."""
        assert self.bag is not None
        self.counts["duplicated"] += 1
        self.bag.append(attrs.evolve(packet))

    def release(self) -> None:
        """The tape ended: deliver what is left after the minimum delay; the random way again."""
        bag, self.bag = self.bag or [], None
        now = self.now()
        for packet in bag:
            packet.deliver_at = now + self.config.min_delay
            self.timeline.at(packet.deliver_at, self._arrive, packet)

    # ---- faults ---------------------------------------------------------------------
    def partition(self, a: str, b: str, one_way: bool = False) -> None:
        self.blocked.add((a, b))
        if not one_way:
            self.blocked.add((b, a))

    def clog(self, a: str, b: str, until: float) -> None:
        self.clogged_until[(a, b)] = until

    def heal(self) -> None:
        self.blocked.clear()
        self.clogged_until.clear()

    def calm(self) -> None:
        self.heal()
        self.config = NetConfig(min_delay=self.config.min_delay, mean_delay=min(self.config.mean_delay, 0.002),
                                capacity=max(self.config.capacity, 1024))

    # ---- transport ------------------------------------------------------------------
    @property
    def next_packet_id(self) -> int:
        """The id the next ``send`` gives its packet."""
        return self._pid + 1

    def send(self, src: Address, dst: Address, message: Any) -> None:
        self._pid += 1
        now = self.now()
        packet = Packet(self._pid, src, dst, message, now)
        self.counts["sent"] += 1
        cfg = self.config
        link = (src.node, dst.node)
        rng = self.rng
        if link in self.blocked:
            self.counts["blocked"] += 1
            self._observe("blocked", packet)
            return
        if self.bag is not None:
            self.bag.append(packet)
            return
        if cfg.drop_p and rng.random() < cfg.drop_p:
            self.counts["dropped"] += 1
            self._observe("drop", packet)
            return
        copies = 2 if cfg.dup_p and rng.random() < cfg.dup_p else 1
        if copies == 2:
            self.counts["duplicated"] += 1
        for i in range(copies):
            p = packet if i == 0 else attrs.evolve(packet, pid=packet.pid)
            delay = cfg.min_delay + (rng.expovariate(1.0 / cfg.mean_delay) if cfg.mean_delay > 0 else 0.0)
            if cfg.reorder_p and rng.random() < cfg.reorder_p:
                delay += rng.uniform(0, cfg.reorder_delay)
            p.deliver_at = now + delay
            queue = self.in_flight.setdefault(link, [])
            if len(queue) >= cfg.capacity:
                victim = queue.pop(rng.randrange(len(queue)))
                victim.cancelled = True
                self.counts["overflow"] += 1
                self._observe("overflow", victim)
            queue.append(p)
            self.timeline.at(p.deliver_at, self._arrive, p)

    def _arrive(self, packet: Packet) -> None:
        if packet.cancelled:
            return
        link = (packet.src.node, packet.dst.node)
        queue = self.in_flight.get(link)
        if queue is not None:
            try:
                queue.remove(packet)
            except ValueError:
                pass
        if link in self.blocked:
            # Partitioned while in flight: lost.
            self.counts["blocked"] += 1
            self._observe("blocked", packet)
            return
        until = self.clogged_until.get(link, -math.inf)
        now = self.now()
        if until > now:
            queue = self.in_flight.setdefault(link, [])
            queue.append(packet)
            packet.deliver_at = until + (packet.deliver_at - packet.sent_at)
            self.timeline.at(packet.deliver_at, self._arrive, packet)
            return
        self.counts["delivered"] += 1
        self._deliver(packet)
