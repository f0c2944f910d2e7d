"""A simulated mpcache server process: core_sm's server machine on a node, and the runtime around
it that ``runtime_zmq``'s server loop, transfer engine and L2 tiers are in production.

A ``ServerHost`` holds one server's incarnation, its L1 slot memory (checksummed contents) and the
bookkeeping its oracles read; ``start`` builds a fresh machine (a restart loses every state) on a
new node. ``interpret`` performs the machine's effects in virtual time: a reply leaves through the
world's network; a server-driven copy runs between the worker's blocks and the slots after a
latency and may fail; L2 reads, writes and probes go to the world's L2 (or a fleet's cluster tier)
after theirs, a read sometimes stalls or fails, a write is checked against what was stored; the
transfer engine attaches and detaches instances' registrations. What the host needs of the world
is ``ServerWorld``: the host imports no world (the world makes the hosts).

``ProbedServer`` is the machine as the node holds it: the F9 check around a FREE_LOOKUP_LOCKS,
the adversary's requests judged apart (F22), and the legacy runtime that acts before it decides.
"""
from __future__ import annotations

import random
from typing import Any, Protocol

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.effects import (
    AttachInstance,
    DetachInstance,
    ErrorReply,
    InstanceReaped,
    ProbeL2,
    ReadL2,
    Reply,
    ScrubSlots,
    StartTransfer,
    WriteL2,
)
from mpcache.core_sm.messages import (
    FreeLookupLocks,
    InstanceAttached,
    L2ReadFinished,
    L2WriteFinished,
    TimerFired,
    TransferFinished,
)
from mpcache.runtime_trio import Address, Node
from mpcache.sim import checks
from mpcache.sim.link_coverage import drain_waiters
from mpcache.sim.ports import SERVER, ReplyMsg, Via
from mpcache.sim.profiles import acted_first
from mpcache.sim.scenario import server_name
from mpcache.sim.timeline import Timeline
from mpcache.sim.trace import Trace, short

# An L2 read's stall (WorldConfig.l2_stall_p): past a status wait (at most 1 s), within the
# server's l2_read_timeout (2 s), so the waiter's deadline answers None and the read still lands.
L2_STALL = 1.5


class ServerWorld(Protocol):
    """The world as a server host sees it (``mpcache.sim.world.World`` is one)."""

    config: Any
    profile: Any
    director: Any
    adversary: Any
    timeline: Timeline
    trace: Trace
    stats: dict[str, int]
    exec_rng: random.Random
    fault_rng: random.Random
    stall_rng: random.Random
    l2: dict[ObjectKey, tuple[int, ...]]
    tier: Any
    phase: str

    def now(self) -> float: ...

    def make_node(self, name: str, machines: dict[str, Any], interpret: Any) -> Node: ...

    async def start_node(self, node: Node) -> None: ...

    def latency(self, mean: float) -> float: ...

    def send(self, src: Address, dst: Address, message: Any) -> None: ...

    def violation(self, code: str, node: str, message: str) -> None: ...

    def judge(self, node: str, finding: checks.Finding | None) -> None: ...

    def worker_by_instance(self, instance_id: int) -> Any: ...

    def check_slot_target(self, host: Any, slot: int, key: ObjectKey, what: str) -> None: ...

    def expected_chunk(self, key: ObjectKey) -> tuple[int, ...]: ...

    def operator_via(self, host: Any) -> Via: ...


class ServerHost:
    """One server: its node, incarnation, L1 slot memory (checksummed contents)."""

    def __init__(self, world: ServerWorld, index: int) -> None:
        self.world = world
        self.index = index
        self.name = server_name(index)
        self.incarnation = 0
        self.node: Node | None = None
        self.slots: dict[int, tuple[int, ...]] = {}
        self.up = False
        self.down_until = 0.0
        self.started_at = 0.0
        # reply accounting for this incarnation: reply_to -> (request type, handled at)
        self.awaiting_reply: dict[Via, tuple[str, float]] = {}
        # request id -> last of ("lookup", t) / ("end", t) handled in this incarnation
        self.last_session_event: dict[str, tuple[str, float]] = {}
        self.lookups_handled: set[str] = set()
        # store admission oracle: LOOKUPs seen per chunk hash, and the objects readable after
        # the last event (this incarnation)
        self.chunk_lookups: dict[bytes, int] = {}
        self.objects_held: frozenset[Any] = frozenset()
        # instance liveness (F19), this incarnation: instance id -> when its last heartbeat was
        # handled while it was registered; the instances this incarnation reaped
        self.heartbeat_seen: dict[int, float] = {}
        self.reaped: set[int] = set()
        # the transfer engine's open registrations, this incarnation: instance id -> the node whose
        # registration it attached (a GPU executor's IPC mappings; F23)
        self.mappings: dict[int, str] = {}

    async def start(self) -> None:
        """A new incarnation: this incarnation's bookkeeping fresh, a fresh server machine (the
        profile's) on a new node, running once this returns."""
        world = self.world
        self.incarnation += 1
        self.started_at = world.now()
        self.slots = {}
        self.awaiting_reply = {}
        self.last_session_event = {}
        self.lookups_handled = set()
        self.heartbeat_seen, self.reaped = {}, set()
        self.mappings = {}
        self.chunk_lookups = {}
        self.objects_held = frozenset()
        machine = ProbedServer(world.profile.make_server(world.config), world, self)
        if world.director is not None:
            world.director.server_started(world, self, machine.inner)
        machine.inner.jobs.dispatch.trace = []  # its waiter rows, for the coverage counters
        node = world.make_node(self.name, {SERVER: machine}, self.interpret)
        self.node = node
        self.up = True
        await world.start_node(node)

    def interpret(self, node: Node, machine: str, effect: Any) -> None:
        """One effect of the server machine, performed as the production runtime does."""
        world = self.world
        t = type(effect)
        if t is Reply or t is ErrorReply:
            via = effect.reply_to
            if not isinstance(via, Via):
                return
            if t is Reply:
                msg = ReplyMsg(via.server, via.correlation, effect.result, None, via.request_id)
            else:
                msg = ReplyMsg(via.server, via.correlation, None, effect.error, via.request_id)
            world.send(Address(node.name, SERVER), Address(via.node, via.machine), msg)
        elif t is StartTransfer:
            self._check_mapping(effect)
            delay = world.latency(world.config.copy_latency_mean)
            world.timeline.after(delay, self._finish_transfer, self.incarnation, effect)
        elif t is ReadL2:
            delay = world.config.l2_latency_min + world.latency(world.config.l2_latency_mean)
            if world.config.l2_stall_p and world.stall_rng.random() < world.config.l2_stall_p:
                delay += L2_STALL
            world.timeline.after(delay, self._finish_l2_read, self.incarnation, effect)
        elif t is WriteL2:
            delay = world.config.l2_latency_min + world.latency(world.config.l2_latency_mean)
            world.timeline.after(delay, self._finish_l2_write, self.incarnation, effect)
        elif t is ProbeL2:
            delay = world.config.l2_latency_min + world.latency(world.config.l2_latency_mean / 4)
            world.timeline.after(delay, self._finish_l2_probe, self.incarnation, effect)
        elif t is InstanceReaped:
            self.mappings.pop(effect.instance_id, None)
            self._on_instance_reaped(effect)
        elif t is AttachInstance:  # the transfer engine opens the registration core_sm accepted
            if isinstance(effect.reply_to, Via):
                self.mappings[effect.instance_id] = effect.reply_to.node
            assert self.node is not None
            self.node.post(SERVER, InstanceAttached(effect.instance_id, effect.registration_id, None,
                                                    reply_to=effect.reply_to))
        elif t is DetachInstance:
            self.mappings.pop(effect.instance_id, None)
        elif t is ScrubSlots:
            pass  # the simulator models no slot bytes: zeroing them changes nothing it checks
        else:
            world.violation("SAFETY", node.name, f"server emitted an unknown effect {short(effect)}")

    def _check_mapping(self, effect: StartTransfer) -> None:
        """F23 (``checks.copy_through_other_registration``): a server-driven copy runs through
        the registration the transfer engine attached for its instance's owner."""
        owner = self.world.worker_by_instance(effect.instance_id)  # the honest worker whose instance it is
        if owner is None:
            return
        self.world.judge(self.name, checks.copy_through_other_registration(
            effect.kind.value, effect.transfer_id, effect.instance_id, owner.name, self.mappings.get(effect.instance_id)))

    def _on_instance_reaped(self, effect: InstanceReaped) -> None:
        """F19 (LMCache #4715): the server may reap an instance only after ``instance_ttl`` without
        a heartbeat from it -- one whose heartbeat it handled less than that ago was live
        (compared as the server does, ``seen + ttl > now``: ``now - seen`` may round below it)."""
        world = self.world
        now = world.now()
        iid = effect.instance_id
        self.reaped.add(iid)
        world.stats["instances_reaped"] = world.stats.get("instances_reaped", 0) + 1
        world.trace.line(now, self.name, f"instance {iid} reaped")
        seen = self.heartbeat_seen.get(iid)
        ttl = world.profile.server_config(world.config).instance_ttl
        worker = world.worker_by_instance(iid)
        if worker is not None and worker.alive:
            world.judge(self.name, checks.reaped_while_live(worker.name, iid, self.name, seen, ttl, now))

    def _finish_transfer(self, incarnation: int, effect: StartTransfer) -> None:
        if self.incarnation != incarnation or not self.up:
            return  # the server crashed: its copies died with it
        world = self.world
        ok = world.exec_rng.random() >= world.config.copy_fail_p
        worker = world.worker_by_instance(effect.instance_id)
        if worker is None or not worker.alive:
            ok = False
        if ok and worker is not None:
            ok = worker.copy(self, effect.request_id, effect.kind, effect.start, effect.end, effect.placements,
                             effect.block_ids, effect.skip_first_n_tokens, f"{effect.kind.value} copy {effect.transfer_id}")
        if not ok:
            world.stats["copy_fail"] += 1
        assert self.node is not None
        self.node.post(SERVER, TransferFinished(effect.transfer_id, ok))

    def _finish_l2_read(self, incarnation: int, effect: ReadL2) -> None:
        if self.incarnation != incarnation or not self.up:
            return
        world = self.world
        loaded = []
        for key, slot in effect.items:
            data = world.l2.get(key) if world.tier is None else world.tier.get(self.index, key)
            if data is None or world.exec_rng.random() < world.config.l2_fail_p:
                if data is not None:
                    world.stats["l2_fail"] += 1
                loaded.append(False)
                continue
            world.check_slot_target(self, slot, key, f"L2 read {effect.read_id}")
            self.slots[slot] = data
            loaded.append(True)
        assert self.node is not None
        self.node.post(SERVER, L2ReadFinished(effect.read_id, tuple(loaded)))
        if world.phase == "safety" and world.fault_rng.random() < world.config.evict_after_prefetch_p:
            # Cache chaos: memory pressure right after a prefetch lands (unleased objects go).
            from mpcache.core_sm.messages import Clear

            world.stats["evict_after_prefetch"] += 1
            self.node.post(SERVER, Clear(False, reply_to=world.operator_via(self), admin=True))

    def _finish_l2_probe(self, incarnation: int, effect: Any) -> None:
        if self.incarnation != incarnation or not self.up:
            return
        from mpcache.core_sm.messages import L2ProbeFinished

        world = self.world
        world.stats["l2_probes"] += 1
        if world.tier is None:
            present = tuple(key in world.l2 for key in effect.keys)
        else:
            present = tuple(world.tier.has(self.index, key) for key in effect.keys)
        assert self.node is not None
        self.node.post(SERVER, L2ProbeFinished(effect.probe_id, present))

    def _finish_l2_write(self, incarnation: int, effect: WriteL2) -> None:
        if self.incarnation != incarnation or not self.up:
            return
        world = self.world
        ok = world.exec_rng.random() >= world.config.l2_fail_p
        if ok:
            for key, slot in effect.items:
                world.check_slot_target(self, slot, key, f"L2 write {effect.write_id}")
                data = self.slots.get(slot)
                if data is None or data != world.expected_chunk(key):
                    world.violation("F10", self.name, f"L2 write of {key.wire_name()[:12]} from slot {slot} "
                                    f"carries data that was never stored for it")
                if world.tier is None:
                    world.l2[key] = data  # type: ignore[assignment]
                elif data is not None and not world.tier.put(self.index, key, data):
                    ok = False  # a tier node down or cut off: the write failed (a later miss)
        assert self.node is not None
        self.node.post(SERVER, L2WriteFinished(effect.write_id, ok))


class ProbedServer:
    """The server machine as the node sees it, plus one before/after check that needs the state
    *before* an event: a FREE_LOOKUP_LOCKS may only release the freeing request's own leases (F9).
    Time-driven work is run first (an extra TimerFired, which the contract allows) so that expiries
    due at this instant are not mistaken for the FREE's doing."""

    def __init__(self, inner: Any, world: ServerWorld, host: ServerHost) -> None:
        self.inner = inner
        self.world = world
        self.host = host

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def next_deadline(self) -> float | None:
        return self.inner.next_deadline()  # type: ignore[no-any-return]

    @property
    def deferred_work(self) -> bool:
        """The inner machine's (``Node.step`` asks after every event: spelled out, not through
        ``__getattr__``)."""
        return bool(getattr(self.inner, "deferred_work", False))

    def handle(self, event: Any, now: float) -> list[Any]:
        if self.world.profile.act_before_decide:
            self._act_first(event)
        adversary = self.world.adversary
        if adversary is None:
            effects: list[Any] = self._handle(event, now)
        elif adversary.sent(event):  # judged by its own oracle (F22)
            effects = adversary.judge(self.inner, self.host, event, now)
            drain_waiters(self.world.stats, self.inner.jobs.dispatch.trace, honest=False)
            return effects
        else:
            effects = self._handle(event, now)
            adversary.observe(self.host.index, event, effects)
        drain_waiters(self.world.stats, self.inner.jobs.dispatch.trace, honest=True)
        return effects

    def _act_first(self, event: Any) -> None:
        """The legacy runtime (profile ``act-first``): it registers with its transfer engine (and
        unregisters) on receipt, for whichever peer asked, before core_sm decides."""
        acted = acted_first(event)
        if acted is None:
            return
        iid, peer = acted
        if peer is None:
            self.host.mappings.pop(iid, None)
        else:
            self.host.mappings[iid] = peer

    def _handle(self, event: Any, now: float) -> list[Any]:
        if type(event) is not FreeLookupLocks:
            return self.inner.handle(event, now)  # type: ignore[no-any-return]
        effects: list[Any] = self.inner.handle(TimerFired(), now)
        before = dict(self.inner.leases_by_owner())
        effects += self.inner.handle(event, now)
        self.world.judge(self.host.name, checks.free_released_others(
            before, self.inner.leases_by_owner(), event.key.request_id))
        return effects
