"""``HealthMonitor``: one client node's view of every server's health and epoch, and of the
liveness of the engine instances it registered there, as a pure machine.

A client node (a vLLM scheduler or worker) pings each server; the monitor decides when, and
what the answers mean for the node's protocol machines (``LookupClient``, ``TransferClient``,
``StepPlanner``), which it tells through the events they already take:

* every ``interval`` it asks for one heartbeat per server (``SendHeartbeat``);
* no reply for ``timeout`` -> ``ServerHealth(server, False)``: the machines fail what is pending
  on it and skip it until it is back; with ``fail_pending`` (a transport that holds requests of
  its own, such as the ZMQ client) also ``FailPending(server)``: every request still waiting
  on that server fails now, nothing waits on a dead server. A heartbeat the transport could not
  even send (``HeartbeatUnsent``: no connection at that moment) is counted, not a verdict: a
  transport that reconnects by itself (ZMQ) may still deliver the replies of that server, and
  only the ``timeout`` without a reply says it is gone;
* while a server is unhealthy it is probed every ``probe_interval`` (default: ``interval``);
  once it has been silent for ``timeout`` the period doubles per probe up to ``backoff_max`` (a
  dead server is not hammered), and resets once it answers;
* ``Connected(server)``: the transport's connection to ``server`` was (re)established (its
  handshake completed). While unhealthy, the probe is sent now and the backoff resets to
  ``probe_interval``: a restarted server is found as soon as the transport reached it, not a
  backed-off period later. While healthy, one heartbeat goes now (the connection dropped and
  came back, maybe to a restarted server: its epoch is learned at once); the schedule stays;
* a reply (``HeartbeatReply(server, epoch)``) -> ``ServerHealth(server, True)`` if it was not
  healthy; its ``epoch`` (the server's start id) -> ``ServerEpoch(server, epoch)`` the first time
  and whenever it changes, *before* the health change: a restart between two heartbeats (F13),
  which no timeout ever showed, makes the machines resolve what was in flight, and the monitor
  registers every instance again (``Register``; the first epoch too: a registration sent before
  it may have reached an incarnation that is gone).

Instances (F13/F19, LMCache #4715: a server reaps an instance that stops heartbeating, so the
heartbeat must name it, whatever its traffic). The monitor is the one machine of its connection
that decides to register an instance again. The transport tells it what it saw:

* ``RegistrationSent(server, iid)``: the node's own machine registered ``iid`` (the link
  remembered that registration): ``iid`` is kept registered there from now on -- registered
  again on a first or new epoch and on recovery (the server may have reaped it), until
  ``InstanceUnregistered``;

* ``InstanceRegistered(server, iid, registration)`` (a registration of ``iid`` was acknowledged;
  ``registration``: the id its reply gave, None from a server that gives none) /
  ``InstanceUnregistered``: from then on every heartbeat of a healthy server also asks for
  ``SendInstancePing(server, iid)`` -- an idle live instance is never reaped. A new epoch (the
  server restarted and knows none) stops them until the next acknowledged registration.
* ``InstancePingRefused(server, iid, kind)``: ``not_registered`` means the server dropped it
  (reaped while this node could not reach it, say): ``Register(server, iid)`` -- register again
  with the registration last sent -- so the next request finds it.
* ``RequestRefused(server, iid, request, kind, retried)``: a request naming ``iid`` (a store, a
  retrieve, a prepare) got an error. ``not_registered`` on a first attempt: the request waits,
  ``Register(server, iid)`` goes out (once for all that wait), and on ``InstanceRegistered`` each
  gets ``Resend(server, request, registration)``, naming the registration just acknowledged:
  the transport sends ``resend_of(request, registration)``, which a server-driven STORE/RETRIEVE
  carries as ``registration`` -- the server tells that resend apart from a network duplicate of
  the request it repeats (``mpcache.core_sm.server_transfers``); a registration that fails (``RegistrationFailed``) or a
  server that goes unhealthy gives each ``GiveUp(server, request)``. Any other error, or a
  second ``not_registered`` after the resend: ``GiveUp`` at once -- a request is resent at most
  once and never waits for more than one registration (its own timeout still runs in the
  transport), so a RETRIEVE never hangs on a reaped instance.
* A failed registration of a kept instance (``RegistrationFailed``: refused, unanswered within the
  transport's request timeout, unsendable) goes again after ``registration_retry``, doubling up to
  ``registration_retry_max``, while the server is healthy (``RegistrationRetryDue``); a recovery
  registers it anyway.

``handle(event, now) -> effects`` never raises; ``next_deadline()`` is the next ping or timeout.
The same class is driven by the simulator's client nodes (``sim/transport.py``, virtual time) and
by ``mpcache.runtime_zmq.client.MPCacheClient`` (one monitor per server connection).
"""
from __future__ import annotations

import enum
from collections.abc import Hashable
from typing import Any, Union

import attrs

from mpcache.core_sm.effects import Effect
from mpcache.core_sm.errors import ProtocolError
from mpcache.core_sm.messages import (
    PrepareRetrieve,
    PrepareStore,
    Retrieve,
    ServerEpoch,
    ServerHealth,
    Store,
    TimerFired,
)
from mpcache.core_sm.table import Dispatcher, Table
from mpcache.core_sm.timers import Timer

NOT_REGISTERED = "not_registered"  # ErrorKind.NOT_REGISTERED's wire value


@attrs.frozen
class HealthConfig:
    num_servers: int
    interval: float = 1.0
    timeout: float = 2.5
    backoff_max: float = 8.0
    initially_healthy: bool = False  # the runtime already told the machines "healthy"
    probe_interval: float | None = None  # ping period while unhealthy, before backoff (None: interval)
    fail_pending: bool = False  # emit FailPending with every ServerHealth(False)
    max_waiting: int = 4096  # requests one instance's re-registration may hold; more give up
    registration_retry: float = 0.5  # a failed registration goes again after this; doubles...
    registration_retry_max: float = 5.0  # ...up to this

    def __attrs_post_init__(self) -> None:
        probe = self.interval if self.probe_interval is None else self.probe_interval
        if (self.num_servers < 1 or not 0 < self.interval < self.timeout or self.backoff_max < self.interval
                or not 0 < probe <= self.interval or self.max_waiting < 0
                or not 0 < self.registration_retry <= self.registration_retry_max):
            raise ValueError(f"bad health config {self!r}: need 0 < interval < timeout, backoff_max >= interval, "
                             f"0 < probe_interval <= interval")


# ---------------------------------------------------------------------------------------------- events


@attrs.frozen
class HeartbeatReply:
    """A heartbeat reply from ``server``, with the server's start id if the transport has it."""

    server: int
    epoch: int | str | None = None


@attrs.frozen
class HeartbeatUnsent:
    """The transport could not send ``server``'s heartbeat: no connection to it."""

    server: int


@attrs.frozen
class Connected:
    """The transport's connection to ``server`` was (re)established: a probe is worth sending now."""

    server: int


@attrs.frozen
class InstanceRegistered:
    """A registration of ``instance_id`` at ``server`` was acknowledged; ``registration`` is the
    id its reply gave (None: the server gave none)."""

    server: int
    instance_id: int
    registration: int | None = None


@attrs.frozen
class RegistrationSent:
    """The node's own machine sent a registration of ``instance_id`` to ``server`` (remembered by
    the link): the instance is one to keep registered there."""

    server: int
    instance_id: int


@attrs.frozen
class InstanceUnregistered:
    """The node unregistered ``instance_id`` at ``server`` (or is about to)."""

    server: int
    instance_id: int


@attrs.frozen
class RegistrationFailed:
    """A registration of ``instance_id`` at ``server`` failed or went unanswered."""

    server: int
    instance_id: int


@attrs.frozen
class InstancePingRefused:
    """``server`` answered ``instance_id``'s heartbeat with the error ``kind``."""

    server: int
    instance_id: int
    kind: str


# The requests a transport may hold and resend once after a ``not_registered`` refusal: the
# server refuses them before any work, so resending the same request after the instance
# registered again cannot copy twice. Only these are reported as ``RequestRefused``.
RESENDABLE_AFTER_NOT_REGISTERED: tuple[type, ...] = (Store, Retrieve, PrepareStore, PrepareRetrieve)


# The resends that name the registration they follow (``registration``): the requests the server
# answers at most once per op (``server_transfers``), whose original's answer a resend must not get.
RESENDS_NAMING_REGISTRATION: tuple[type, ...] = (Store, Retrieve)


def resend_of(request: object, registration: int | None) -> object:
    """What a transport sends for ``Resend(server, request, registration)``: a server-driven
    ``Store`` / ``Retrieve`` names the registration it follows, so the server runs it as a new op
    (only under that registration) while a late network duplicate of the original still gets the
    original's remembered refusal and never copies; a prepare (which the server does not
    deduplicate) goes again unchanged, and so does everything when ``registration`` is None (a
    server that names none: it also keeps no per-op record a resend would hit)."""
    if registration is not None and isinstance(request, RESENDS_NAMING_REGISTRATION):
        named: Any = request
        return attrs.evolve(named, registration=registration)
    return request


@attrs.frozen
class RequestRefused:
    """``server`` answered ``request`` (the transport's opaque id for it), which names
    ``instance_id``, with the error ``kind``; ``retried``: it was already resent once."""

    server: int
    instance_id: int
    request: Hashable
    kind: str
    retried: bool = False


# ---------------------------------------------------------------------------------------------- effects


@attrs.frozen
class SendHeartbeat:
    """Effect: send one heartbeat to ``server``; its reply comes back as ``HeartbeatReply``."""

    server: int


@attrs.frozen
class SendInstancePing:
    """Effect: send ``Ping(instance_id)`` to ``server`` (the instance's liveness there)."""

    server: int
    instance_id: int


@attrs.frozen
class FailPending:
    """Effect: fail every request still waiting on ``server`` (it stopped answering; ``reason``
    says how the monitor knows, for the log)."""

    server: int
    reason: str = ""


@attrs.frozen
class Register:
    """Effect: send ``instance_id``'s last registration to ``server`` again."""

    server: int
    instance_id: int


@attrs.frozen
class Resend:
    """Effect: send ``request`` again (the instance it names is registered again), as
    ``resend_of(request, registration)``: ``registration`` is the id of that registration."""

    server: int
    request: Hashable
    registration: int | None = None


@attrs.frozen
class GiveUp:
    """Effect: fail ``request`` with the error the server gave it."""

    server: int
    request: Hashable


HealthEvent = Union[HeartbeatReply, HeartbeatUnsent, Connected, RegistrationSent, InstanceRegistered,
                    InstanceUnregistered, RegistrationFailed, InstancePingRefused, RequestRefused, TimerFired]
HealthEffect = Union[SendHeartbeat, SendInstancePing, ServerHealth, ServerEpoch, FailPending, Register, Resend,
                     GiveUp]


class HealthState(enum.Enum):
    """One server as the monitor sees it (``ABSENT``: an index this monitor does not watch)."""

    ABSENT = "absent"
    HEALTHY = "healthy"  # answered within ``timeout``: pinged every ``interval``, instances too
    PROBING = "probing"  # unhealthy: probed every ``probe_interval``, with backoff once silent


# ---------------------------------------------------------------------------------------------- timers
# The monitor's typed timers, one per kind, events of its table. Their deadlines are the
# server's ``next_ping`` and ``last_reply + timeout``; ``TimerFired`` runs the due ones server by
# server in index order, a server's timeout before its ping (see ``HealthMonitor._run_due``).


@attrs.frozen
class HeartbeatDue(Timer):
    """A healthy server's ping is due: one heartbeat, and one ping per registered instance."""

    server: int


@attrs.frozen
class HeartbeatTimeout(Timer):
    """A healthy server has not answered for ``timeout``."""

    server: int


@attrs.frozen
class ProbeDue(Timer):
    """An unhealthy server's probe is due (its period doubles once it has been silent for
    ``timeout``, up to ``backoff_max``)."""

    server: int


@attrs.frozen
class RegistrationRetryDue(Timer):
    """A failed registration's backoff is over while the server is healthy: register again."""

    server: int
    instance_id: int


@attrs.define
class _Server:
    healthy: bool
    last_reply: float
    next_ping: float
    period: float
    epoch: int | str | None = None
    instances: dict[int, None] = attrs.Factory(dict)  # registered and acknowledged: pinged
    registering: set[int] = attrs.Factory(set)  # re-registrations this monitor asked for
    known: dict[int, None] = attrs.Factory(dict)  # instances the node registered here, until unregistered
    retry_at: dict[int, float] = attrs.Factory(dict)  # instance -> when its failed registration goes again
    retry_delay: dict[int, float] = attrs.Factory(dict)  # instance -> its next backoff
    waiting: dict[int, list[Hashable]] = attrs.Factory(dict)  # instance -> requests to resend


def _server_values(s: _Server) -> tuple[Any, ...]:
    """One server's view as values (``HealthMonitor.state_values``)."""
    return (s.healthy, s.last_reply, s.next_ping, s.period, s.epoch, tuple(s.instances), tuple(s.registering),
            tuple(s.known), tuple(s.retry_at.items()), tuple(s.retry_delay.items()),
            tuple([(i, tuple(w)) for i, w in s.waiting.items()]))


def _server_of_values(v: tuple[Any, ...]) -> _Server:
    """The view ``_server_values`` described (a new one: the restored monitor owns it)."""
    healthy, last_reply, next_ping, period, epoch, instances, registering, known, retry_at, retry_delay, waiting = v
    return _Server(healthy, last_reply, next_ping, period, epoch, dict.fromkeys(instances), set(registering),
                   dict.fromkeys(known), dict(retry_at), dict(retry_delay), {i: list(w) for i, w in waiting})


class HealthMonitor:
    def __init__(self, config: HealthConfig, now: float = 0.0) -> None:
        self.config = config
        period = config.interval if config.initially_healthy else self._probe
        self._servers = [_Server(config.initially_healthy, now, now, period) for _ in range(config.num_servers)]
        self._counters = {"internal_errors": 0, "heartbeats_sent": 0, "heartbeats_unsent": 0, "unhealthy": 0,
                          "recovered": 0, "connects": 0, "epoch_changes": 0, "stale_replies": 0, "instance_pings": 0,
                          "instances_lost": 0, "reregistrations": 0, "resends": 0, "give_ups": 0,
                          "registrations_on_epoch": 0, "registrations_on_recovery": 0, "registration_failures": 0,
                          "registration_retries": 0}
        self._table: Dispatcher[HealthState] = TABLE.bind(self, _server_of, self.state, self._counters,
                                                          self._refuse, self._set_state)

    @property
    def dispatch(self) -> Dispatcher[HealthState]:
        """The monitor's bound table: a simulator sets ``dispatch.trace`` to a list to see every
        row it runs (its coverage counters); nothing else reads it."""
        return self._table

    @property
    def _probe(self) -> float:
        c = self.config
        return c.interval if c.probe_interval is None else c.probe_interval

    def state(self, index: Hashable) -> HealthState:
        if isinstance(index, int) and 0 <= index < len(self._servers):
            return HealthState.HEALTHY if self._servers[index].healthy else HealthState.PROBING
        return HealthState.ABSENT

    def _set_state(self, index: Hashable, state: HealthState) -> None:
        """TABLE's assignment: a watched server is now healthy or probing (an index this monitor
        does not watch stays ``ABSENT``: nothing to record)."""
        if state is not HealthState.ABSENT and isinstance(index, int) and 0 <= index < len(self._servers):
            self._servers[index].healthy = state is HealthState.HEALTHY

    def healthy(self, server: int) -> bool:
        return self._servers[server].healthy

    def epoch(self, server: int) -> int | str | None:
        return self._servers[server].epoch

    def period(self, server: int) -> float:
        """``server``'s current ping period (``interval`` while healthy, the backed-off probe
        period while not)."""
        return self._servers[server].period

    def instances(self, server: int) -> tuple[int, ...]:
        """The instances whose heartbeats go to ``server``."""
        return tuple(self._servers[server].instances)

    # What ``state_values`` carries, and the wiring it leaves out (tests/core_sm/test_state_values.py).
    STATE_FIELDS = ("_servers", "_counters")
    WIRING_FIELDS = ("config", "_table")

    def state_values(self) -> tuple[Any, ...]:
        """The monitor's changing state as immutable values (each server's view, in order, its
        sets and maps as tuples in their iteration order), the wiring left out: ``restore`` on a
        monitor of the same configuration makes it this one."""
        return tuple([_server_values(s) for s in self._servers]), tuple(self._counters.values())

    def restore(self, values: tuple[Any, ...]) -> None:
        """Become, in place, the monitor whose ``state_values()`` gave ``values`` (its table stays
        bound to it; the counters dict it shares is updated)."""
        servers, counters = values
        self._servers = [_server_of_values(v) for v in servers]
        own = self._counters
        own.update(zip(tuple(own), counters))

    def stats(self) -> dict[str, int]:
        return dict(self._counters)

    def next_deadline(self) -> float | None:
        """The earliest of every server's next ping, every healthy server's reply timeout and
        every registration retry. Asked after every event the node handles, so no list is
        built: the candidates are compared in that order as ``min`` of their list would (a
        later one wins only if strictly earlier), so the same value (and type) comes back."""
        servers = self._servers
        if not servers:
            return min(())  # as min of no candidates: ValueError
        best = servers[0].next_ping
        for s in servers:
            if s.next_ping < best:
                best = s.next_ping
        timeout = self.config.timeout
        for s in servers:
            if s.healthy and s.last_reply + timeout < best:
                best = s.last_reply + timeout
        for s in servers:
            if s.retry_at:
                for at in s.retry_at.values():
                    if at < best:
                        best = at
        return best

    def handle(self, event: HealthEvent, now: float) -> list[HealthEffect]:
        out: list[Any] = []
        try:
            if type(event) is TimerFired:
                self._run_due(now, out)
            elif type(event) in _INPUTS:
                self._table.run(event, now, out)
            else:
                self._counters["stale_replies"] += 1
        except Exception:
            self._counters["internal_errors"] += 1
        return out

    def _run_due(self, now: float, out: list[Effect]) -> None:
        """Every timer due at ``now``, through the table: server by server in index order, a
        healthy server's timeout before its ping (so a ping due with the timeout is a probe)."""
        c = self.config
        for index, server in enumerate(self._servers):
            if server.healthy and now - server.last_reply >= c.timeout:
                self._table.run(HeartbeatTimeout(index), now, out)
            if server.next_ping <= now:
                self._table.run(HeartbeatDue(index) if server.healthy else ProbeDue(index), now, out)
            for iid, at in sorted(server.retry_at.items(), key=lambda item: (item[1], item[0])):
                if at <= now:
                    self._table.run(RegistrationRetryDue(index, iid), now, out)

    @staticmethod
    def _refuse(out: list[Effect], reply_to: Hashable, error: ProtocolError) -> None:
        """No event of the monitor is a request (none has a ``reply_to``): never called."""

    def _on_unknown_server(self, _ev: Any, now: float, out: list[Any]) -> None:
        self._counters["stale_replies"] += 1

    # ------------------------------------------------------------------------------ health

    def _on_timeout(self, event: HeartbeatTimeout, now: float, out: list[Any]) -> None:
        index = event.server
        server = self._servers[index]
        server.period = self._probe
        server.next_ping = min(server.next_ping, now + server.period)
        self._counters["unhealthy"] += 1
        out.append(ServerHealth(index, False))
        if self.config.fail_pending:
            out.append(FailPending(index, f"no heartbeat reply for {self.config.timeout:g} s"))
        # what waited on a re-registration fails with the rest; a registration in flight is
        # forgotten (the transport fails it with the rest; the machines register on recovery)
        for requests in server.waiting.values():
            out.extend(GiveUp(index, r) for r in requests)
            self._counters["give_ups"] += len(requests)
        server.waiting.clear()
        server.registering.clear()
        server.retry_at.clear()  # the recovery registers again, backoff reset
        server.retry_delay.clear()

    def _on_heartbeat_due(self, event: HeartbeatDue, now: float, out: list[Any]) -> None:
        index = event.server
        server = self._servers[index]
        out.append(SendHeartbeat(index))
        self._counters["heartbeats_sent"] += 1
        out.extend(SendInstancePing(index, iid) for iid in server.instances)
        self._counters["instance_pings"] += len(server.instances)
        server.next_ping = now + server.period

    def _on_probe_due(self, event: ProbeDue, now: float, out: list[Any]) -> None:
        index = event.server
        server = self._servers[index]
        out.append(SendHeartbeat(index))
        self._counters["heartbeats_sent"] += 1
        if now - server.last_reply >= self.config.timeout:
            server.period = min(server.period * 2, self.config.backoff_max)
        server.next_ping = now + server.period

    def _on_unsent(self, event: HeartbeatUnsent, now: float, out: list[Any]) -> None:
        self._counters["heartbeats_unsent"] += 1

    def _on_connected_probing(self, event: Connected, now: float, out: list[Any]) -> None:
        """The transport reached the unhealthy server again: probe it now, backoff reset (a
        reply makes it healthy; silence backs off again from ``probe_interval``)."""
        server = self._servers[event.server]
        self._counters["connects"] += 1
        self._counters["heartbeats_sent"] += 1
        out.append(SendHeartbeat(event.server))
        server.period = self._probe
        server.next_ping = now + server.period

    def _on_connected_healthy(self, event: Connected, now: float, out: list[Any]) -> None:
        """A healthy server's connection came back (it dropped, maybe for a restart): one
        heartbeat now learns a new epoch at once; the ping schedule and timeout stay."""
        self._counters["connects"] += 1
        self._counters["heartbeats_sent"] += 1
        out.append(SendHeartbeat(event.server))

    def _on_reply(self, event: HeartbeatReply, now: float, out: list[Any]) -> None:
        server = self._servers[event.server]
        server.last_reply = max(server.last_reply, now)
        new_epoch = False
        if event.epoch is not None and event.epoch != server.epoch:
            new_epoch = True
            if server.epoch is not None:
                self._counters["epoch_changes"] += 1
                # a restarted server knows no instance: each is pinged again once its
                # registration below is acknowledged
                server.instances.clear()
            server.epoch = event.epoch
            out.append(ServerEpoch(event.server, event.epoch))
        recovered = not server.healthy  # PROBING: the dispatcher makes it HEALTHY after this
        if recovered:
            server.period = self.config.interval
            server.next_ping = min(server.next_ping, now + server.period)
            self._counters["recovered"] += 1
            out.append(ServerHealth(event.server, True))
        for iid in list(server.known):
            if new_epoch:
                # the first epoch learned, or a new one (a restart): a registration sent earlier,
                # even one under way, may have reached an incarnation that is gone -- again
                # (idempotent; the answer of either lands)
                server.registering.discard(iid)
                self._counters["registrations_on_epoch"] += 1
            elif recovered and iid not in server.registering:
                # unreachable for a while: the server may have reaped it
                self._counters["registrations_on_recovery"] += 1
            else:
                continue
            self._register(event.server, server, iid, out)

    # ------------------------------------------------------------------------------ instances

    def _on_registration_sent(self, event: RegistrationSent, now: float, out: list[Any]) -> None:
        """The node's own registration: the instance is kept registered from now on. It is not
        one the monitor waits on: a request refused while it is under way (it overtook it, or
        the registration was lost) registers again at once -- the server takes both."""
        server = self._servers[event.server]
        server.known[event.instance_id] = None
        server.retry_at.pop(event.instance_id, None)

    def _on_registered(self, event: InstanceRegistered, now: float, out: list[Any]) -> None:
        """Each request that waited on ``iid``'s registration is resent, naming it."""
        server, requests = self._release(event.server, event.instance_id)
        out.extend(Resend(event.server, r, event.registration) for r in requests)
        self._counters["resends"] += len(requests)
        server.instances[event.instance_id] = None
        server.retry_at.pop(event.instance_id, None)
        server.retry_delay.pop(event.instance_id, None)

    def _on_unregistered(self, event: InstanceUnregistered, now: float, out: list[Any]) -> None:
        server = self._give_up_waiting(event.server, event.instance_id, out)
        server.instances.pop(event.instance_id, None)
        server.known.pop(event.instance_id, None)
        server.retry_at.pop(event.instance_id, None)
        server.retry_delay.pop(event.instance_id, None)

    def _on_registration_failed(self, event: RegistrationFailed, now: float, out: list[Any]) -> None:
        """What waited on it gives up; while the server is healthy the registration goes again
        after a backoff (``registration_retry`` doubling up to ``registration_retry_max``)."""
        iid = event.instance_id
        server = self._give_up_waiting(event.server, iid, out)
        self._counters["registration_failures"] += 1
        if server.healthy and iid in server.known and iid not in server.retry_at:
            c = self.config
            delay = server.retry_delay.get(iid, c.registration_retry)
            server.retry_at[iid] = now + delay
            server.retry_delay[iid] = min(delay * 2, c.registration_retry_max)

    def _on_registration_retry_due(self, event: RegistrationRetryDue, now: float, out: list[Any]) -> None:
        server = self._servers[event.server]
        del server.retry_at[event.instance_id]
        self._counters["registration_retries"] += 1
        self._register(event.server, server, event.instance_id, out)

    def _give_up_waiting(self, index: int, iid: int, out: list[Any]) -> _Server:
        server, requests = self._release(index, iid)
        out.extend(GiveUp(index, r) for r in requests)
        self._counters["give_ups"] += len(requests)
        return server

    def _release(self, index: int, iid: int) -> tuple[_Server, list[Hashable]]:
        """``iid``'s re-registration is over: the requests that waited on it, for their verdict."""
        server = self._servers[index]
        server.registering.discard(iid)
        return server, server.waiting.pop(iid, [])

    def _register(self, index: int, server: _Server, iid: int, out: list[Any]) -> None:
        if iid not in server.registering:
            server.registering.add(iid)
            self._counters["reregistrations"] += 1
            out.append(Register(index, iid))

    def _on_ping_refused(self, event: InstancePingRefused, now: float, out: list[Any]) -> None:
        server = self._servers[event.server]
        if event.instance_id not in server.instances or event.kind != NOT_REGISTERED:
            return  # unregistered meanwhile, or an error that says nothing about the registration
        del server.instances[event.instance_id]
        self._counters["instances_lost"] += 1
        if server.healthy:
            self._register(event.server, server, event.instance_id, out)

    def _on_refused(self, event: RequestRefused, now: float, out: list[Any]) -> None:
        server = self._servers[event.server]
        waiting = server.waiting.get(event.instance_id, [])
        if (event.kind != NOT_REGISTERED or event.retried or not server.healthy
                or len(waiting) >= self.config.max_waiting):
            self._counters["give_ups"] += 1
            out.append(GiveUp(event.server, event.request))
            return
        if server.instances.pop(event.instance_id, None) is not None:
            self._counters["instances_lost"] += 1
        server.waiting[event.instance_id] = [*waiting, event.request]
        self._register(event.server, server, event.instance_id, out)


def _server_of(event: Any) -> Hashable:
    server: Hashable = event.server
    return server


_WATCHED = (HealthState.HEALTHY, HealthState.PROBING)
# What the transport feeds (TimerFired is not addressed to a server: it runs the due timers).
_INPUTS = (HeartbeatReply, HeartbeatUnsent, Connected, RegistrationSent, InstanceRegistered, InstanceUnregistered,
           RegistrationFailed, InstancePingRefused, RequestRefused)

# One server's health: (its state, event) -> (handler, next state). handle runs it; the dispatcher
# assigns the next state (HealthMonitor._set_state).
TABLE: Table[HealthState] = Table("HealthMonitor (one server's health, epoch and instances)", HealthState,
                                  HealthState.ABSENT, {
    **{(HealthState.ABSENT, e): (HealthMonitor._on_unknown_server, HealthState.ABSENT) for e in _INPUTS},
    (HealthState.HEALTHY, HeartbeatDue): (HealthMonitor._on_heartbeat_due, HealthState.HEALTHY),
    (HealthState.HEALTHY, HeartbeatTimeout): (HealthMonitor._on_timeout, HealthState.PROBING),
    (HealthState.PROBING, ProbeDue): (HealthMonitor._on_probe_due, HealthState.PROBING),
    **{(s, HeartbeatReply): (HealthMonitor._on_reply, HealthState.HEALTHY) for s in _WATCHED},
    **{(s, HeartbeatUnsent): (HealthMonitor._on_unsent, s) for s in _WATCHED},
    (HealthState.HEALTHY, Connected): (HealthMonitor._on_connected_healthy, HealthState.HEALTHY),
    (HealthState.PROBING, Connected): (HealthMonitor._on_connected_probing, HealthState.PROBING),
    (HealthState.HEALTHY, RegistrationRetryDue): (HealthMonitor._on_registration_retry_due, HealthState.HEALTHY),
    **{(s, RegistrationSent): (HealthMonitor._on_registration_sent, s) for s in _WATCHED},
    **{(s, InstanceRegistered): (HealthMonitor._on_registered, s) for s in _WATCHED},
    **{(s, InstanceUnregistered): (HealthMonitor._on_unregistered, s) for s in _WATCHED},
    **{(s, RegistrationFailed): (HealthMonitor._on_registration_failed, s) for s in _WATCHED},
    **{(s, InstancePingRefused): (HealthMonitor._on_ping_refused, s) for s in _WATCHED},
    **{(s, RequestRefused): (HealthMonitor._on_refused, s) for s in _WATCHED},
}, assigns=True)
"""An event naming a server this monitor does not watch is ``ABSENT`` and only counted in
``stale_replies``. A timer runs only in the state that makes it due (``_run_due``), so no other
timer pair ever runs; the dispatcher would count one in ``stale_events``."""
TABLES: dict[str, Table[Any]] = {TABLE.name: TABLE}
