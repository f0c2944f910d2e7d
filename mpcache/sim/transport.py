"""A simulated engine's transport: on each of its nodes (the scheduler, every worker) a core_sm
``ServerLink`` per server -- request uids and deadlines, heartbeats and epoch, instance pings,
registration memory, parking after ``not_registered``, one resend naming the registration,
give-up -- the machine ``runtime_zmq.client.MPCacheClient`` runs.

The simulator moves the frames a link transmits through the simulated network and feeds it the
replies (a heartbeat's reply names the server incarnation that answered, the epoch the production
``health`` reply carries); it decides nothing. The seam between the simulated and the production
world is the socket: a machine's ``SendRequest`` goes in (``EngineTransport.submit``), a frame
comes back (``deliver_reply``) and reaches the machine as ``ReplyReceived`` / ``RequestFailed``,
and the links' ``ServerHealth`` / ``ServerEpoch`` reach the machines that follow that server.

The engine that owns the nodes (``sim/engine.py``) is seen through ``TransportOwner`` only; the
transport's own oracles (a request resent twice, a resend refused by a record of its original, a
request still parked after quiescence) are judged here, with ``sim/checks``.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any, Protocol

import attrs

from mpcache.core_sm.effects import SendRequest
from mpcache.core_sm.errors import ErrorKind, ProtocolError
from mpcache.core_sm.health import RESENDABLE_AFTER_NOT_REGISTERED, Connected, HealthMonitor, resend_of
from mpcache.core_sm.messages import (
    Ping,
    RegisterInstance,
    ReplyReceived,
    RequestFailed,
    ServerHealth,
    TimerFired,
    UnregisterInstance,
)
from mpcache.core_sm.server_link import (
    SERVER,
    Close,
    Completed,
    Failed,
    Heartbeat,
    InstancePing,
    Role,
    SendFailed,
    ServerLink,
    ServerLinkConfig,
    Submit,
    Transmit,
    client_link_config,
)
from mpcache.core_sm.server_link import Reply as LinkReply
from mpcache.runtime_trio import Address, Node
from mpcache.sim import checks, link_coverage
from mpcache.sim.ports import RequestMsg, WorldPort
from mpcache.sim.scenario import server_name


class TransportOwner(Protocol):
    """The engine whose nodes the transport serves, as the transport sees it."""

    def call(self, node: Node, machine: str, event: Any) -> list[Any]:
        """A synchronous call into a machine (a link's ``ServerHealth`` / ``ServerEpoch``)."""

    def touch_all_live(self) -> None:
        """A fault may have hit every live request of the engine (a health flip, a new epoch)."""

    def reply_arrived(self, node: Node, machine: str, server: int, about: tuple[str | None, str] | None,
                      result: Any) -> None:
        """A result is about to reach ``machine`` (``about``: the request id and type of the
        request it answers, when known)."""


@attrs.frozen
class Outbound:
    """A machine's request as its node's link carries it (the token its answer goes back by)."""

    machine: str
    correlation: int
    request: Any


class ClientLinks:
    """One client node's links, one per server, and what the simulator remembers about the frames
    they sent (for fault tracking and the transport's oracles)."""

    def __init__(self, world: WorldPort, node_name: str, targets: dict[int, list[str]]) -> None:
        self.node_name = node_name
        self.targets = targets  # server -> machines told of its health and epoch
        cfg = world.config
        profile = world.profile
        self.links: list[ServerLink] = []
        for _ in range(cfg.num_servers):
            # heartbeats out of phase across nodes, as independent processes are
            start = world.now() + world.exec_rng.uniform(0, cfg.heartbeat_interval)
            config = sim_link_config(cfg)
            link = profile.make_link(config, start)
            link.monitor.dispatch.trace = []  # drained into the coverage counters (sim/link_coverage.py)
            self.links.append(link)
        self.armed: dict[int, float] = {}
        self.running = True
        self.closed = False  # the node shut down (its links closed): its machines send nothing more
        # (server, uid) -> the machine request a frame carried (None: the link's own), for the
        # fault tracking of a reply lost or duplicated after its request was answered
        self.frames: OrderedDict[tuple[int, int], Outbound | None] = OrderedDict()
        self.resent: set[tuple[str, int]] = set()  # (machine, correlation) resent after not_registered
        # (server, uid) of a resend -> (the registration it names, the server incarnation it went to)
        self.resent_naming: dict[tuple[int, int], tuple[int, int]] = {}
        # the server incarnations this node started against, and the epochs its links reported
        self.start_epochs = {s: world.servers[s].incarnation for s in range(cfg.num_servers)}
        self.epochs: dict[int, Any] = {}

    @property
    def monitors(self) -> list[HealthMonitor]:
        return [link.monitor for link in self.links]


def sim_link_config(cfg: Any) -> ServerLinkConfig:
    """The simulated world's links: production's (``client_link_config``) with the world's
    heartbeat settings; the engine starts healthy, as the connector waits for its servers before
    it serves (``wait_connected``)."""
    return _link_config(cfg.request_timeout, cfg.heartbeat_interval, cfg.heartbeat_timeout)


@functools.lru_cache(maxsize=64)
def _link_config(request_timeout: float, heartbeat_interval: float, heartbeat_timeout: float) -> ServerLinkConfig:
    """One frozen config per setting, shared by every link that uses it (each link of a world
    built its own, validators and all: a few per cent of a seed)."""
    config = client_link_config(request_timeout=request_timeout, heartbeat_interval=heartbeat_interval,
                                heartbeat_timeout=heartbeat_timeout, heartbeat_backoff_max=4 * heartbeat_interval)
    return attrs.evolve(config, health=attrs.evolve(config.health, initially_healthy=True))


def _link_role(request: Any) -> tuple[Role, int | None]:
    """What a machine's request is to its link, and the engine instance it names."""
    t = type(request)
    if t is RegisterInstance:
        return Role.REGISTRATION, request.instance_id
    if t is UnregisterInstance:
        return Role.UNREGISTRATION, request.instance_id
    if t in RESENDABLE_AFTER_NOT_REGISTERED:
        return Role.REQUEST, request.instance_id
    return Role.REQUEST, None


def link_machine(server: int) -> str:
    """The address a node's link to ``server`` sends from (replies come back to it)."""
    return f"link{server}"


class EngineTransport:
    """The links of one engine's nodes, driven in virtual time: machines' requests in, frames
    out through the world's network, replies and the links' verdicts back to the machines."""

    def __init__(self, world: WorldPort, owner: TransportOwner) -> None:
        self.world = world
        self.owner = owner
        self.num_servers = world.config.num_servers
        self.links: list[ClientLinks] = []  # one per node
        self._links_of: dict[str, ClientLinks] = {}
        # (node, machine, correlation) -> (request id, request type), for reply fault tracking
        self.sent: OrderedDict[tuple[str, str, int], tuple[str | None, str]] = OrderedDict()
        self.crashed = False  # the engine crashed: its links are gone with its processes

    def add_node(self, node_name: str, targets: dict[int, list[str]]) -> None:
        """``node_name``'s links, one per server; ``targets``: server -> the machines told of its
        health and epoch."""
        links = ClientLinks(self.world, node_name, targets)
        self.links.append(links)
        self._links_of[node_name] = links
        for s in range(self.num_servers):
            self._arm(links, s)

    def submit(self, node: Node, machine: str, effect: SendRequest) -> None:
        """A machine's ``SendRequest``: its node's link to the effect's server carries it."""
        rid = _rid(effect.request)
        self.sent[(node.name, machine, effect.correlation)] = (rid, type(effect.request).__name__)
        if len(self.sent) > 4096:
            self.sent.popitem(last=False)
        links = self._links_of[node.name]
        if links.closed:
            return  # the node shut down: nothing leaves it any more
        role, instance = _link_role(effect.request)
        self._link_event(links, effect.server,
                         Submit((machine, effect.correlation), Outbound(machine, effect.correlation, effect.request),
                                None, role, instance))

    def deliver_reply(self, node: Node, machine: str, msg: Any) -> None:
        """A reply frame reached ``node``'s link to ``msg.server``: the link correlates it."""
        links = self._links_of.get(node.name)
        if links is None or machine != link_machine(msg.server):
            self.world.violation("SAFETY", node.name, f"a reply reached {machine}, no link: {msg!r}")
            return
        s, uid = msg.server, msg.correlation
        link = links.links[s]
        request = link.request_of(uid)
        if link.parked(uid):
            # another reply to the refused send (a network duplicate of it): the request's answer
            # is its resend's, or the link's verdict
            assert isinstance(request, Outbound)
            self.world.trace.line(self.world.now(), node.name, f"transport: #{request.correlation} reply "
                                  f"after its refusal dropped")
        if msg.error is None:
            # a heartbeat's reply carries the answering server's start id (its incarnation here)
            value = {"epoch": self.world.servers[s].incarnation} if type(request) is Heartbeat else msg.result
            event = LinkReply(uid, True, value)
        else:
            if msg.error.kind is ErrorKind.NOT_REGISTERED and isinstance(request, Outbound):
                self._check_resend_refusal(links, s, uid, request)
            event = LinkReply(uid, False, msg.error, msg.error.kind.value)
        parked = link.parked(uid)
        self._link_event(links, s, event)
        if not parked and link.parked(uid):
            assert isinstance(request, Outbound)
            self.world.stats["transport_refusals"] = self.world.stats.get("transport_refusals", 0) + 1
            self.world.trace.line(self.world.now(), node.name, f"transport: {type(request.request).__name__} "
                                  f"#{request.correlation} to server{s} refused not_registered: parked")

    def _answer(self, node: Node, machine: str, server: int, correlation: int, result: Any) -> None:
        self.owner.reply_arrived(node, machine, server, self.sent.get((node.name, machine, correlation)), result)
        node.post(machine, ReplyReceived(server, correlation, result))

    def touch_reply(self, node_name: str, msg: Any) -> None:
        """A fault hit a reply to ``node_name``: the request it answers is no longer clean."""
        links = self._links_of.get(node_name)
        request = links.frames.get((msg.server, msg.correlation)) if links is not None else None
        if request is not None:
            info = self.sent.get((node_name, request.machine, request.correlation))
            if info is not None and info[0] is not None:
                self.world.touched.add(info[0])

    def _link_event(self, links: ClientLinks, server: int, event: Any) -> None:
        """One event into ``links``' link to ``server``; its effects performed in its order."""
        link = links.links[server]
        node = self.world.nodes.get(links.node_name)
        stats = self.world.stats
        link_coverage.count_link_input(stats, event)
        effects = link.handle(event, self.world.now())
        link_coverage.drain_health(stats, link.monitor.dispatch.trace)
        for effect in effects:
            if isinstance(effect, Transmit):
                self._transmit(links, server, effect, event)
            elif isinstance(effect, Completed):
                if effect.token is None:
                    continue  # the shell's own request (an unregistration at shutdown)
                machine, correlation = _token(effect.token)
                if node is not None and node.alive:
                    self._answer(node, machine, server, correlation, effect.value)
            elif isinstance(effect, Failed):
                self._failed(links, node, server, effect)
            else:
                self._health(links, node, attrs.evolve(effect, server=server))
        self._arm(links, server)

    def _transmit(self, links: ClientLinks, server: int, t: Transmit, cause: Any) -> None:
        request = t.request
        body: Any
        if isinstance(request, Outbound):
            body = request.request
            if t.resend:
                body = resend_of(body, t.registration)
                self._note_resend(links, server, t, request, body)
            elif type(body) is RegisterInstance and type(cause) is not Submit:
                self.world.trace.line(self.world.now(), links.node_name, f"transport: register instance "
                                      f"{body.instance_id} at server{server} again")
        else:
            body = Ping(request.instance_id) if isinstance(request, InstancePing) else Ping()
        if not self.world.servers[server].up:
            # production's socket queues a frame only on a completed connection (ZMQ IMMEDIATE): a
            # crashed server's process closed it, so the send fails at once (the link's SendFailed)
            self._link_event(links, server, SendFailed(t.uid, "server not connected"))
            return
        links.frames[(server, t.uid)] = request if isinstance(request, Outbound) else None
        if len(links.frames) > 4096:
            links.frames.popitem(last=False)
        self.world.send(Address(links.node_name, link_machine(server)), Address(server_name(server), "server"),
                        RequestMsg(server, t.uid, body))

    def _note_resend(self, links: ClientLinks, server: int, t: Transmit, request: Outbound, body: Any) -> None:
        key = (request.machine, request.correlation)
        if key in links.resent:
            self.world.violation("SAFETY", links.node_name, f"{type(request.request).__name__} #{request.correlation} "
                                 f"to server{server} resent a second time after not_registered")
        links.resent.add(key)
        self.world.stats["transport_resends"] = self.world.stats.get("transport_resends", 0) + 1
        self.world.trace.line(self.world.now(), links.node_name, f"transport: #{request.correlation} resent after "
                              f"the registration {t.registration}")
        if t.registration is not None and getattr(body, "registration", None) is not None:
            links.resent_naming[(server, t.uid)] = (t.registration, self.world.servers[server].incarnation)

    def _failed(self, links: ClientLinks, node: Node | None, server: int, f: Failed) -> None:
        if f.token is None:
            return
        machine, correlation = _token(f.token)
        if not isinstance(f.error, ProtocolError) and not f.message:
            self.world.violation("SAFETY", links.node_name, f"#{correlation} failed with no reason: {f!r}")
        error = f.protocol_error()
        if error.kind is ErrorKind.NOT_REGISTERED and type(f.request.request) in RESENDABLE_AFTER_NOT_REGISTERED:
            # a parked request answered with its refusal: given up, or timed out waiting
            self.world.stats["transport_give_ups"] = self.world.stats.get("transport_give_ups", 0) + 1
            self.world.trace.line(self.world.now(), links.node_name, f"transport: #{correlation} given up")
        if node is not None and node.alive:
            node.post(machine, RequestFailed(server, correlation, error))

    def _check_resend_refusal(self, links: ClientLinks, server: int, uid: int, request: Outbound) -> None:
        """Oracle: a resend refused not_registered although the registration it names is still the
        instance's registration at that server incarnation (registration ids are never reused
        within one) was refused by a record of its original, not for a lost registration."""
        named = links.resent_naming.get((server, uid))
        if named is None:
            return
        host = self.world.servers[server]
        machine = host.node.machines["server"] if host.node is not None and host.up else None
        iid = getattr(request.request, "instance_id", None)
        if machine is None or host.incarnation != named[1] or not isinstance(iid, int):
            return
        current = machine.instances.registration_id(iid)
        finding = checks.resend_refused(type(request.request).__name__, request.correlation, server, named[0], current,
                                        iid in host.reaped)
        if finding is not None:
            self.world.violation(finding[0], links.node_name, finding[1])

    def check_drained(self) -> None:
        """After quiescence: no refused request still waits on a registration (it was resent
        once, or failed with a reason)."""
        for links in self.links:
            for s, link in enumerate(links.links):
                for uid in link.parked_uids():
                    request = link.request_of(uid)
                    finding = checks.parked_request(type(request.request).__name__, request.correlation, s)
                    self.world.violation(finding[0], links.node_name, finding[1])

    def _arm(self, links: ClientLinks, server: int) -> None:
        """One timeline entry for the link's next deadline (an earlier one replaces it)."""
        deadline = links.links[server].next_deadline()
        if deadline is None or not links.running:
            return
        armed = links.armed.get(server)
        if armed is not None and armed <= deadline:
            return
        links.armed[server] = deadline
        self.world.timeline.at(max(deadline, self.world.now()), self._tick, links, server, deadline)

    def _tick(self, links: ClientLinks, server: int, deadline: float) -> None:
        if links.armed.get(server) != deadline:
            return  # replaced by an earlier one
        del links.armed[server]
        if not links.running or self.crashed:
            return
        due = links.links[server].next_deadline()
        if due is not None and due <= self.world.now():
            self._link_event(links, server, TimerFired())
        else:
            self._arm(links, server)

    def _health(self, links: ClientLinks, node: Node | None, effect: Any) -> None:
        now = self.world.now()
        if type(effect) is ServerHealth:
            self.world.trace.line(now, links.node_name, f"health server{effect.server} -> "
                                  f"{'up' if effect.healthy else 'DOWN'}")
            self.owner.touch_all_live()
        else:  # ServerEpoch
            self.world.trace.line(now, links.node_name, f"epoch server{effect.server} -> {effect.epoch}")
            first = effect.server not in links.epochs
            links.epochs[effect.server] = effect.epoch
            if not (first and effect.epoch == links.start_epochs[effect.server]):
                self.owner.touch_all_live()  # a restart (the first epoch of the server it started with is none)
        if node is not None and node.alive:
            for machine in links.targets[effect.server]:
                self.owner.call(node, machine, effect)

    def server_connected(self, server: int) -> None:
        """``server`` listens again: every node's transport reconnects to it (``Connected``)."""
        for links in self.links:
            if links.running and not self.crashed:
                self._link_event(links, server, Connected(SERVER))

    def shut_down(self, instances: list[tuple[str, int]]) -> None:
        """The engine shuts down, as the connector's ``close`` does: each live worker of
        ``instances`` (node name, instance id) unregisters its instance at its servers (the
        request goes; its answer is nobody's), then every link closes (``Close``: what is pending
        fails ``closed``) and its node sends nothing more."""
        if not self.crashed:
            for node_name, instance_id in instances:
                links = self._links_of.get(node_name)
                if links is None:
                    continue
                for s in range(self.num_servers):
                    request = UnregisterInstance(instance_id)
                    self._link_event(links, s, Submit(None, Outbound("-", 0, request), None, Role.UNREGISTRATION,
                                                      instance_id))
            for links in self.links:
                for s in range(self.num_servers):
                    self._link_event(links, s, Close())
        for links in self.links:
            links.running = False
            links.closed = True

    def crash(self) -> None:
        """The engine's processes died: their links send and time nothing more."""
        self.crashed = True
        for links in self.links:
            links.running = False


def _token(token: Any) -> tuple[str, int]:
    """The (machine, correlation) a link's answer goes back to."""
    machine, correlation = token
    return str(machine), int(correlation)


def _rid(request: Any) -> str | None:
    rid = getattr(request, "request_id", None)
    if rid is None:
        rid = getattr(getattr(request, "key", None), "request_id", None)
    return rid
