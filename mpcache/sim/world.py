"""A simulated world: servers, vLLM engines (scheduler + workers), L2, SimNet, faults, oracles.

Every node is a `runtime_trio.Node` running the *production* core_sm machines (or a legacy
profile's subclasses of them). The world is only the shell: it carries messages through SimNet,
holds the L2 the servers share, injects faults, and checks oracles after every handled event. The
processes are modules of their own, each seeing the world through a port: a server with the
runtime that performs its effects (copies between engine blocks and L1 slots, L2 reads/writes) is
`sim/server_host.py`, an engine (vLLM's scheduler and workers) `sim/engine.py` with its
transport `sim/transport.py`; a node runs as a task of `sim/timeline.py`'s loop.

A run has three phases (TigerBeetle VOPR style):

1. safety: the workload arrives while faults fire (drops, duplicates, partitions, clogs, server
   crashes, engine crashes, clears, slow or failing L2 and copies);
2. liveness: heal the network, stop faults, restart crashed servers; every request of a live
   engine must then finish within `liveness_bound` virtual seconds and every lookup must resolve
   to an int, else each stuck request is reported with its last events;
3. quiescence: everything in flight lands; no request may be left without its reply, no lease
   may be held by a request that finished cleanly; after the lease TTL and reaping period every
   server must hold no lease and no job.

Scripted (``director``, a tape's or the explorer's guide's, ``World._play``): the safety phase's
choices -- which message of the net's bag arrives, is lost or duplicated, when the clock moves,
restarts, engine crashes, aborts, the adversary's requests -- are the director's; the random
streams decide nothing there. Without a director nothing of it runs (a seed's trace is unchanged).
"""
from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.health import HealthConfig
from mpcache.core_sm.messages import (
    EndSession,
    FreeLookupLocks,
    Lookup,
    TimerFired,
)
from mpcache.runtime_trio import Address, Node
from mpcache.sim import checks
from mpcache.sim.adversary import ADVERSARY, Adversary
from mpcache.sim.checks import quiescence, server_event, slots
from mpcache.sim.cluster_tier import make_tier
from mpcache.sim.engine import GROUP_SHIFT, SimEngine
from mpcache.sim.evolve import evolve
from mpcache.sim.net import Packet, SimNet
from mpcache.sim.oracles import Violation, ViolationFound
from mpcache.sim.ports import SERVER, ReplyMsg, RequestMsg, Via, request_id_of
from mpcache.sim.scenario import FaultSpec, Scenario, sched_name, server_name
from mpcache.sim.server_host import ServerHost
from mpcache.sim.timeline import Alarms, SimNode, Timeline
from mpcache.sim.trace import MessageRecord, Trace, event_text, short

HEARTBEAT = "hb"


class TapeError(Exception):
    """A tape's action cannot be taken in this world (not enabled, or another message)."""


class Director(Protocol):
    """Who makes a scripted world's choices (``World._play``): a tape, or a guide writing one."""

    def next_action(self, world: World) -> list[Any] | None:
        """The next action (None: the tape ended)."""

    def server_started(self, world: World, host: ServerHost, server: Any) -> None:
        """A server (re)starts: the tape's world may hold objects in its L1 from the start."""


def packet_text(packet: Packet) -> str:
    """A message in flight as a tape names it: from, to, what."""
    return f"{packet.src.node}->{packet.dst.node} {_label(packet.message)}" + (
        f" {request_id_of(packet.message)}" if request_id_of(packet.message) else "")


class World:
    def __init__(self, scenario: Scenario, profile: Any, *, keep_lines: bool = True, chart: bool = False,
                 director: Director | None = None) -> None:
        self.scenario = scenario
        # scripted (a tape): the director picks each of the safety phase's choices (below)
        self.director = director
        self.config = scenario.config
        self.profile = profile
        self.timeline = Timeline(random.Random(scenario.net_seed))  # the tasks' batch order
        self.trace = Trace(keep_lines=keep_lines)
        self.record_messages = chart
        base = scenario.net_seed
        self.net_rng = random.Random(f"{base}:net")
        self.exec_rng = random.Random(f"{base}:exec")
        self.fault_rng = random.Random(f"{base}:fault")
        self.stall_rng = random.Random(f"{base}:l2-stall")  # its own stream: the others stay as they were
        self.net = SimNet(self.timeline, self.net_rng, self.config.net, self._deliver_packet, self._net_fate)
        self.net.now = self.timeline.clock
        if director is not None:
            self.net.script()
        self.nodes: dict[str, Node] = {}
        self.servers = [ServerHost(self, i) for i in range(self.config.num_servers)]
        self.l2: dict[ObjectKey, tuple[int, ...]] = {}
        self.tier = make_tier(self.config)  # a fleet's cluster tier replaces self.l2 (sim/fleet.py)
        self.written: set[ObjectKey] = set()  # every object ever written into L1 or L2 (history)
        self.violations: list[Violation] = []
        self.phase = "safety"
        self.liveness_started = math.inf
        self.t0 = 0.0
        self.events = 0
        # request id -> its last events (time, node, machine, event, effects), for reports
        self.recent: dict[str, deque[tuple[float, str, str, Any, list[Any]]]] = {}
        self.alarms = Alarms(self.timeline.at, self.timeline.clock)  # each node's timer, once per deadline
        self._ticks_at_now: tuple[float, int] = (-1.0, 0)
        self._deliveries = 0
        self.engines = [SimEngine(self, e) for e in range(self.config.num_engines)]
        self.adversary = Adversary(self) if self.config.adversary else None  # sim/adversary.py
        self.touched: set[str] = set()  # request ids some fault may have hit
        # (request id, server) -> {pid: sent at} of LOOKUPs sent and not yet handed to the server
        self.lookups_in_flight: dict[tuple[str, int], dict[int, float]] = {}
        # (request id, server) to which an END_SESSION or FREE_LOOKUP_LOCKS was ever sent
        self.released_sent: set[tuple[str | None, int]] = set()
        # (request id, server) where the request held read leases once it had finished
        self.held_after_done: set[tuple[str, int]] = set()
        self.stats: dict[str, int] = {"crashes": 0, "restarts": 0, "partitions": 0, "l2_fail": 0, "copy_fail": 0,
                                      "evict_after_prefetch": 0, "engine_crashes": 0, "clears": 0,
                                      "l2_probes": 0}

    # =========================================================================== running
    def now(self) -> float:
        return self.timeline.now

    def run(self) -> None:
        """Run the world to its end on the timeline's loop (the first violation raises)."""
        self.timeline.run_main(self.main())

    async def main(self) -> None:
        cfg = self.config
        t0 = self.t0 = self.now()  # scenario times are relative to the start of the run
        for host in self.servers:
            await self._start_server(host)
        for engine in self.engines:
            await engine.start()
        for fault in self.scenario.faults:
            self.timeline.at(t0 + fault.at, self._inject, fault)
        for engine in self.engines:
            engine.schedule_workload()
        if self.adversary is not None and self.director is None:  # a tape names each of its requests
            self.adversary.start(t0)
        # Phase 1: safety.
        if self.director is None:
            await self.timeline.run(t0 + cfg.safety_duration)
        else:
            await self._play(self.director)
        # Phase 2: liveness.
        self._begin_liveness()
        deadline = self.now() + cfg.liveness_bound
        while self.now() < deadline and not all(e.all_done() for e in self.engines):
            await self.timeline.run(min(deadline, self.now() + 0.25))
        if not all(e.all_done() for e in self.engines):
            self._report_stuck()
        # Phase 3: quiescence.
        await self.timeline.run(self.now() + 1.0)
        quiescence.quiescent(self)
        quiescence.released(self)
        # A lost registration is retried after it timed out, with backoff: give it that long.
        health = HealthConfig(1)
        await self.timeline.run(self.now() + self.config.request_timeout + health.registration_retry_max + 1.0)
        quiescence.registered(self)
        for engine in self.engines:
            if not engine.crashed:
                engine.transport.check_drained()
        horizon = max(cfg.lease_ttl, self.profile.server_config(cfg).abandoned_job_ttl) * 2 + 1.0
        for engine in self.engines:
            engine.stop_heartbeats()
        await self.timeline.run(self.now() + horizon)
        quiescence.drained(self)

    # =========================================================================== scripted
    async def _play(self, director: Director) -> None:
        """The safety phase of a scripted world: each choice is the director's (a tape's action),
        the rest of the world as in a random one. Actions:

        * ``["tick"]``: the clock moves to the queue's next instant and runs everything due then
          (timers, copies, the engines' scheduler steps, arrivals);
        * ``["deliver" | "drop" | "dup", pid, text]``: that message of the net's bag (``text``,
          what the message was, is checked: a tape that drifted from its world stops);
        * ``["restart", s]``: server ``s`` crashes and restarts (what is in flight to or from it
          is lost); ``["crash", e]``: engine ``e`` crashes; ``["abort", request id]``: vLLM aborts
          the request;
        * ``["hold" | "unhold", request id]``: from the next step on, vLLM's scheduler keeps the
          request waiting as when its block pool is short (other requests hold it: each step asks
          the connector again and allocates nothing), or gives it blocks again.

        Then the net is released (`SimNet.release`) and the liveness and quiescence phases run
        as in every world. The nodes an action wakes run before the next action."""
        while True:
            action = director.next_action(self)
            if action is None:
                break
            kind = action[0]
            self.trace.mark(self.now(), "-", "tape", self.describe_action(action))
            if kind == "tick":
                t = self.timeline.next_time()
                if t == math.inf:
                    raise TapeError(f"tape action {action}: nothing is due")
                await self.timeline.run(t)
            elif kind in ("deliver", "drop", "dup"):
                packet = self.bag_packet(int(action[1]))
                if len(action) > 2 and action[2] != packet_text(packet):
                    raise TapeError(f"tape action {action}: message #{action[1]} is {packet_text(packet)}")
                if kind == "deliver":
                    self.net.deliver(packet)
                elif kind == "drop":
                    self.touch_packet(packet)
                    self.net.drop(packet)
                else:
                    self.touch_packet(packet)
                    self.net.duplicate(packet)
            elif kind == "restart":
                host = self.servers[int(action[1])]
                if host.up:
                    self.crash_server(host)
                self._lose_in_flight(lambda p: host.name in (p.src.node, p.dst.node))
                self._restart_server(host)
            elif kind == "crash":
                engine = self.engines[int(action[1])]
                self.stats["engine_crashes"] += not engine.crashed
                engine.crash()
                mine = {sched_name(engine.index), *(w.name for w in engine.workers)}
                self._lose_in_flight(lambda p: p.src.node in mine or p.dst.node in mine)
            elif kind == "attack":
                self._scripted_attack(str(action[1]), action[2], int(action[3]))
            elif kind == "abort":
                found = self.find_request(str(action[1]))
                if found is None:
                    raise TapeError(f"tape action {action}: no such request")
                found[0].abort(found[1])
            elif kind in ("hold", "unhold"):
                found = self.find_request(str(action[1]))
                if found is None:
                    raise TapeError(f"tape action {action}: no such request")
                if kind == "hold":
                    found[0].hold(found[1])
                else:
                    found[0].unhold(found[1])
            else:
                raise TapeError(f"unknown tape action {action}")
            await self.timeline.settle()
        self.net.release()

    def _scripted_attack(self, what: str, name: Any, s: int) -> None:
        """The adversary's request a tape names, delivered to server ``s`` at once: ``free`` or
        ``end`` naming request ``name`` (its LOOKUP key as the adversary saw it there), or
        ``register`` naming engine ``name``'s first worker's instance."""
        from mpcache.core_sm.messages import RegisterInstance
        from mpcache.sim.adversary import MACHINE

        adversary = self.adversary
        if adversary is None:
            raise TapeError("an attack in a world without the adversary")
        request: Any
        if what == "register":
            worker = self.engines[int(name)].workers[0]
            request = RegisterInstance(worker.instance_id, "x", self.config.tp, 1024)
        else:
            key = next((k for srv, k in adversary.lookup_keys if srv == s and k.request_id == name), None)
            if key is None:
                raise TapeError(f"the adversary saw no LOOKUP of {name} at server{s}")
            request = FreeLookupLocks(key) if what == "free" else EndSession(str(name))
        adversary.correlation += 1
        self.trace.line(self.now(), ADVERSARY, f"adversary {what}")
        self.net.send(Address(ADVERSARY, MACHINE), Address(server_name(s), SERVER),
                      RequestMsg(s, adversary.correlation, request))
        assert self.net.bag
        self.net.deliver(self.net.bag[-1])

    def bag_packet(self, pid: int) -> Packet:
        for packet in self.net.bag or ():
            if packet.pid == pid:
                return packet
        raise TapeError(f"tape: message #{pid} is not in flight")

    def _lose_in_flight(self, which: Callable[[Packet], bool]) -> None:
        """A crash: the messages of the bag to or from what crashed are lost."""
        for packet in [p for p in self.net.bag or () if which(p)]:
            self.net.bag.remove(packet)  # type: ignore[union-attr]
            self._net_fate("lost", packet)

    def describe_action(self, action: list[Any]) -> str:
        kind = action[0]
        if kind in ("deliver", "drop", "dup"):
            return f"{kind} #{action[1]} " + (str(action[2]) if len(action) > 2 else "")
        if kind == "tick":
            return f"clock -> {self.timeline.next_time():.6f}"
        return " ".join(str(a) for a in action)

    # =========================================================================== nodes
    def make_node(self, name: str, machines: dict[str, Any], interpret: Callable[[Node, str, Any], None]) -> Node:
        node = SimNode(self.timeline, name, machines, interpret, timer_event=TimerFired, arm_timer=self.arm_timer,
                       observer=self._observe)
        self.nodes[name] = node
        self.alarms.forget(name)
        return node

    async def start_node(self, node: Node) -> None:
        await self.timeline.start(node)

    def arm_timer(self, node: Node, deadline: float | None) -> None:
        self.alarms.arm(node.name, deadline, self._tick, node)

    def _tick(self, node: Node) -> None:
        now = self.now()
        self.alarms.fired(node.name)
        t, n = self._ticks_at_now
        n = n + 1 if t == now else 1
        self._ticks_at_now = (now, n)
        if n > 10_000:
            self.violation("SAFETY", node.name, "timer livelock: next_deadline() stays in the past")
        node.tick()

    def _observe(self, node: Node, machine: str, event: Any, effects: list[Any], now: float) -> None:
        self.events += 1
        self.trace.event(now, node.name, machine, event, effects)
        rid = request_id_of(event)
        if rid is not None:
            q = self.recent.get(rid)
            if q is None:
                q = self.recent[rid] = deque(maxlen=8)
            q.append((now, node.name, machine, event, effects))
        if machine == SERVER:
            server_event.after_event(self, node, event, effects, now)
        else:
            self.engine_of_node(node.name).observe(node, machine, event, effects)

    def recent_lines(self, rid: str, n: int = 3) -> str:
        """The last `n` events about request `rid`, one ``time node event -> effects`` each."""
        return " | ".join(f"{t:.6f} {node} {event_text(machine, event, effects)}"
                          for t, node, machine, event, effects in list(self.recent.get(rid, ()))[-n:])

    # =========================================================================== servers
    async def _start_server(self, host: ServerHost) -> None:
        await host.start()
        if host.incarnation > 1:  # a restart: each client's transport reconnects (Connected)
            for engine in self.engines:
                engine.transport.server_connected(host.index)

    def latency(self, mean: float) -> float:
        return self.exec_rng.expovariate(1.0 / mean) if mean > 0 else 0.0

    def check_slot_target(self, host: ServerHost, slot: int, key: ObjectKey, what: str) -> None:
        """F10 (``checks/slots.py``): an in-flight copy into/out of `slot` for `key` must find the
        slot still given to `key` (or free)."""
        slots.check_target(self, host, slot, key, what)

    # =========================================================================== chunks
    def expected_chunk(self, key: ObjectKey) -> tuple[int, ...]:
        """The one correct content of an object (what any correct store writes)."""
        base = int.from_bytes(key.chunk_hash[:6], "little") * 8 + key.kv_rank
        per_group = range(self.config.chunk_size // self.config.block_size)
        # several KV-cache groups: one object holds every group's blocks, group after group
        return tuple(base * 64 + j + (g << GROUP_SHIFT) for g in range(max(1, len(self.config.kv_groups)))
                     for j in per_group)

    def note_written(self, rid: str, chunk: int, rank: int) -> None:
        """History: the object for chunk `chunk` of `rid`'s prompt, rank `rank`, now exists."""
        found = self.find_request(rid)
        if found is not None and chunk < len(found[1].hashes):
            self.written.add(ObjectKey(found[1].hashes[chunk], rank))

    def worker_by_instance(self, instance_id: int) -> Any:
        for engine in self.engines:
            for w in engine.workers:
                if w.instance_id == instance_id:
                    return w
        return None

    # =========================================================================== network
    def send(self, src: Address, dst: Address, message: Any) -> None:
        pid = self.net.next_packet_id  # the id SimNet gives this packet (fates may fire inside send)
        if isinstance(message, RequestMsg):
            t = type(message.request)
            if t is Lookup:
                key = (message.request.key.request_id, message.server)
                self.lookups_in_flight.setdefault(key, {})[pid] = self.now()
            elif t is EndSession or t is FreeLookupLocks:
                self.released_sent.add((request_id_of(message), message.server))
        self.net.send(src, dst, message)
        if self.record_messages:
            self.trace.messages[pid] = MessageRecord(pid, src.node, dst.node, _label(message),
                                                     request_id_of(message), self.now())

    def _net_fate(self, fate: str, packet: Packet) -> None:
        rid = request_id_of(packet.message)
        if rid is None and isinstance(packet.message, ReplyMsg):
            rid = None
        self.trace.line(self.now(), packet.src.node, f"net {fate} #{packet.pid} ->{packet.dst.node} "
                        f"{short(packet.message, 100)}")
        self.touch_packet(packet)
        self._lookup_landed(packet)
        rec = self.trace.messages.get(packet.pid)
        if rec is not None:
            rec.fate = fate

    def _lookup_landed(self, packet: Packet) -> None:
        msg = packet.message
        if isinstance(msg, RequestMsg) and type(msg.request) is Lookup:
            pids = self.lookups_in_flight.get((msg.request.key.request_id, msg.server))
            if pids is not None:
                pids.pop(packet.pid, None)

    def _post_request(self, node: Node, packet: Packet, event: Any) -> None:
        self._lookup_landed(packet)
        node.post(SERVER, event)

    def touch_packet(self, packet: Packet) -> None:
        """A fault hit this packet: the requests it concerns are no longer 'clean'."""
        if ADVERSARY in (packet.src.node, packet.dst.node):
            return  # the adversary's own traffic
        rid = request_id_of(packet.message)
        if rid is not None:
            self.touched.add(rid)
        via = getattr(packet.message, "via_request", None)
        if via is not None:
            self.touched.add(via)
        if isinstance(packet.message, ReplyMsg):
            # A lost reply: the client engine knows which request it belonged to.
            for engine in self.engines:
                engine.transport.touch_reply(packet.dst.node, packet.message)

    def _deliver_packet(self, packet: Packet) -> None:
        if self.adversary is not None and packet.dst.node == ADVERSARY:
            self.adversary.on_reply(packet.message)
            return
        node = self.nodes.get(packet.dst.node)
        rec = self.trace.messages.get(packet.pid)
        if node is None or not node.alive:
            self.trace.line(self.now(), packet.dst.node, f"net dead #{packet.pid} {short(packet.message, 100)}")
            self.touch_packet(packet)
            self._lookup_landed(packet)
            if rec is not None:
                rec.fate = "dead"
            return
        if rec is not None and rec.fate == "in-flight":
            rec.fate = "delivered"
            rec.arrived = self.now()
        msg = packet.message
        if isinstance(msg, RequestMsg):
            self._deliveries += 1
            via = Via(packet.src.node, packet.src.machine, msg.server, msg.correlation, packet.pid,
                      request_id_of(msg.request), self._deliveries)
            # peer: who sent it, as a runtime names the connection (core_sm's ownership checks)
            event = evolve(msg.request, reply_to=via, peer=packet.src.node)
            if self.config.server_workers > 1 and self.exec_rng.random() < 0.5:
                # A worker pool: this handler starts a little later than its arrival.
                self.timeline.after(self.exec_rng.uniform(0, self.config.server_handler_jitter),
                                    self._post_request, node, packet, event)
            else:
                self._post_request(node, packet, event)
        elif isinstance(msg, ReplyMsg):
            engine = self.engine_of_node(packet.dst.node)
            engine.transport.deliver_reply(node, packet.dst.machine, msg)
        else:
            self.violation("SAFETY", packet.dst.node, f"unknown packet {short(msg)}")

    def engine_of_node(self, name: str) -> Any:
        digits = name[len("sched"):] if name.startswith("sched") else name[len("worker"):].split(".")[0]
        return self.engines[int(digits)]

    # =========================================================================== oracles
    def violation(self, code: str, node: str, message: str) -> None:
        v = Violation(code, self.now(), node, message)
        self.violations.append(v)
        self.trace.mark(self.now(), node, "VIOLATION", v.reason())
        raise ViolationFound(v)

    def judge(self, node: str, finding: checks.Finding | None) -> None:
        """Raise the violation a judgement (``sim/checks/``) found, if any."""
        if finding is not None:
            self.violation(finding[0], node, finding[1])

    # =========================================================================== faults
    def _inject(self, fault: FaultSpec) -> None:
        if self.phase != "safety":
            return
        now = self.now()
        kind, args = fault.kind, fault.args
        self.trace.mark(now, "-", "fault", f"{kind} {args}")
        if kind == "crash_server":
            host = self.servers[int(args[0])]
            if host.up:
                self.crash_server(host)
                host.down_until = now + float(args[1])
                self.timeline.at(host.down_until, self._restart_server, host)
        elif kind in ("partition", "clog"):
            a, b, one_way, dur = args
            self.stats["partitions"] += 1
            self.touch_all_live()
            if kind == "partition":
                self.net.partition(str(a), str(b), bool(one_way))
            else:
                self.net.clog(str(a), str(b), now + float(dur))
            self.timeline.at(now + float(dur), self._heal_link, str(a), str(b))
        elif kind == "crash_engine":
            engine = self.engines[int(args[0])]
            if not engine.crashed:
                self.stats["engine_crashes"] += 1
            engine.crash()
        elif kind == "clear":
            host = self.servers[int(args[0])]
            if host.up and host.node is not None:
                from mpcache.core_sm.messages import Clear

                self.touch_all_live()
                self.stats["clears"] += 1
                via = self.operator_via(host)
                host.node.post(SERVER, Clear(True, reply_to=via, admin=True))
        elif kind.startswith("tier_") and self.tier is not None:
            self.touch_all_live()
            self.tier.inject(self, fault)

    def touch_all_live(self) -> None:
        for engine in self.engines:
            engine.touch_all_live()

    def _heal_link(self, a: str, b: str) -> None:
        self.net.blocked.discard((a, b))
        self.net.blocked.discard((b, a))
        self.net.clogged_until.pop((a, b), None)

    def crash_server(self, host: ServerHost) -> None:
        assert host.node is not None
        self.stats["crashes"] += 1
        self.trace.mark(self.now(), host.name, "crash", f"incarnation {host.incarnation}")
        host.up = False
        host.node.crash()
        self.touch_all_live()

    def _restart_server(self, host: ServerHost) -> None:
        if host.up:
            return
        self.stats["restarts"] += 1
        self.trace.mark(self.now(), host.name, "restart", f"incarnation {host.incarnation + 1}")
        self.timeline.spawn(self._start_server(host))

    def _begin_liveness(self) -> None:
        self.phase = "liveness"
        now = self.now()
        self.liveness_started = now
        self.trace.mark(now, "-", "heal", "liveness phase: network healed, faults off, servers restarted")
        self.net.calm()
        if self.tier is not None:
            self.tier.heal()
        for host in self.servers:
            if not host.up:
                self._restart_server(host)
        for engine in self.engines:
            engine.begin_liveness()

    def _report_stuck(self) -> None:
        lines = []
        for engine in self.engines:
            lines.extend(engine.stuck_report())
        first = lines[0] if lines else "unknown"
        code = "F1" if any("lookup unresolved" in line for line in lines) else "LIVENESS"
        self.trace.line(self.now(), "-", "stuck requests:\n    " + "\n    ".join(lines))
        self.violation(code, "-", f"{len(lines)} request(s) stuck {self.config.liveness_bound:.0f}s after heal; "
                       f"first: {first}")

    def note_done(self, rid: str, node: str) -> None:
        """``rid`` (of scheduler ``node``) finished: remember the servers where it still holds
        read leases, which only a FREE/END_SESSION (or the TTL) gives back."""
        for host in self.servers:
            if host.up and host.node is not None and quiescence.holds_leases(host, node, rid):
                self.held_after_done.add((rid, host.index))

    def operator_via(self, host: ServerHost) -> Via:
        """reply_to for requests the simulator itself sends (an operator's CLEAR)."""
        self._deliveries += 1
        return Via("-", "-", host.index, 0, 0, None, self._deliveries)

    def coverage(self) -> dict[str, int]:
        """'Sometimes' counters: which rare paths this world went through (tests assert that
        across seeds every one of them happens, so the oracles are not passing vacuously)."""
        out: dict[str, int] = dict(self.stats)
        for k, v in self.net.counts.items():
            out[f"net_{k}"] = v
        for host in self.servers:
            if host.node is None:
                continue
            st = host.node.machines[SERVER].stats()
            for k in ("hit_chunks", "duplicate_lookups", "unknown_status", "reaped_jobs", "l2_reads", "l2_writes",
                      "l2_timeouts", "transfers_failed", "retrieve_misses", "evictions", "leases_released_ttl",
                      "leases_released_retrieve", "leases_released_free", "leases_released_end_session",
                      "leases_released_reap", "leases_released_clear", "expired_plans", "errors",
                      "lookups_answered_in_ack"):
                out[k] = out.get(k, 0) + st.get(k, 0)
        for engine in self.engines:
            for req in engine.order:
                key = f"requests_{req.outcome or 'unfinished'}"
                out[key] = out.get(key, 0) + 1
                if req.lm_hit:
                    out["requests_with_hit"] = out.get("requests_with_hit", 0) + 1
                if req.load_errors:
                    out["requests_with_load_errors"] = out.get("requests_with_load_errors", 0) + 1
                if req.preempted:
                    out["requests_preempted"] = out.get("requests_preempted", 0) + 1
        return out

    def find_request(self, rid: str) -> tuple[Any, Any] | None:
        for engine in self.engines:
            req = engine.requests.get(rid)
            if req is not None:
                return engine, req
        return None


def _label(message: Any) -> str:
    if isinstance(message, RequestMsg):
        return type(message.request).__name__
    if isinstance(message, ReplyMsg):
        if message.error is not None:
            return f"error:{message.error.kind.value}"
        return f"reply:{short(message.result, 40)}"
    return type(message).__name__
