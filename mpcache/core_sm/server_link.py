"""``ServerLink``: one client node's connection to one server -- request uids and correlation,
per-request deadlines, heartbeats and epoch, instance liveness pings, registration memory and
every decision to register an instance again (a first or new epoch, a recovery, a
``not_registered`` refusal, a failed registration after its backoff: its monitor's table),
parking after ``not_registered``, one resend naming the registration, give-up -- as a pure
machine. The node's own machines register an instance once (``TransferClient``: at its first
healthy server) and never again. A transport (``mpcache.runtime_zmq.client.MPCacheClient``) only moves what it says.

Contract
--------
``handle(event, now) -> effects`` never raises; ``next_deadline()`` is the next request deadline
or health timer (``TimerFired`` runs every due one). The link owns a ``HealthMonitor``
(``monitor``, one server) and performs its effects itself: the transport never sees a
``SendHeartbeat``, ``Register``, ``Resend`` or ``GiveUp``, only the frames to move.

Events the transport feeds:

* ``Submit(token, request, timeout, role, instance)``: the caller's request (``token``: the
  transport's handle for its answer, a future say; ``request``: opaque to the link, whatever the
  transport encodes). ``role`` says what it is to the link: ``REQUEST`` (``instance`` set: it
  names that engine instance and may be parked and resent once after ``not_registered``),
  ``REGISTRATION`` of ``instance`` (remembered, the last one per instance, as what a
  re-registration sends; the monitor keeps the instance registered from then on:
  ``RegistrationSent``), ``UNREGISTRATION`` of ``instance`` (forgotten; its pings stop).
* ``Reply(uid, ok, value, kind)``: the answer to the frame ``Transmit(uid)`` sent (``kind``: the
  error kind when not ``ok``; ``value``: the result, or the transport's error object). A uid the
  link does not hold (a late reply to a request that timed out or failed) is counted only.
* ``SendFailed(uid, message)``: the transport could not send that frame (no connection).
* ``Connected()``: the transport's connection was (re)established (a probe goes now).
* ``TimerFired()``; ``Close()``: every request still pending fails ``closed``.

Effects the transport performs:

* ``Transmit(uid, request, registration)``: send ``request`` under ``uid``; ``request`` is the
  caller's, the remembered registration, ``Heartbeat()`` or ``InstancePing(instance_id)``.
  ``registration`` is not None on a resend after a re-registration: the transport sends
  ``health.resend_of(request, registration)`` (its wire form), which names the registration so
  the server tells the resend from a network duplicate.
* ``Completed(token, value)`` / ``Failed(token, kind, message, error, request)``: the caller's
  answer. ``error`` is the server's refusal as the transport gave it (None for the link's own
  verdicts: ``timeout`` after the request's deadline, ``unhealthy`` when the send failed or the
  server stopped answering, ``not_registered``, ``closed``).
* ``ServerHealth(0, healthy)`` / ``ServerEpoch(0, epoch)``: the monitor's verdicts, in its order.

A request is answered exactly once: by its reply, its deadline (a parked request's deadline
still runs: it fails with the refusal it got), a failed send, the server going unhealthy
(``fail_pending``: nothing waits on a dead server) or ``Close``. Heartbeats and pings are not
callers' requests: their deadline only drops the entry (the monitor's own timeout decides).
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Union

import attrs

from mpcache.core_sm.errors import ProtocolError, refusal
from mpcache.core_sm.health import (
    Connected,
    FailPending,
    GiveUp,
    HealthConfig,
    HealthMonitor,
    HeartbeatReply,
    HeartbeatUnsent,
    InstancePingRefused,
    InstanceRegistered,
    InstanceUnregistered,
    Register,
    RegistrationFailed,
    RegistrationSent,
    RequestRefused,
    Resend,
    SendHeartbeat,
    SendInstancePing,
)
from mpcache.core_sm.messages import ServerEpoch, ServerHealth, TimerFired
from mpcache.core_sm.timers import Timer, TimerHeap

SERVER = 0  # the link's one server, in its monitor

TIMEOUT, UNHEALTHY, NOT_REGISTERED_KIND, CLOSED = "timeout", "unhealthy", "not_registered", "closed"
NOT_SENT = "not_sent"  # SendFailed: the frame never left, so the server cannot act on it


@attrs.frozen
class ServerLinkConfig:
    health: HealthConfig  # one server; fail_pending is what a link with requests of its own runs
    request_timeout: float = 30.0  # a Submit without its own timeout
    reply_timeout: float | None = None  # a heartbeat's or ping's entry (None: health.timeout)
    max_registrations: int = 1024  # remembered registrations (an engine has a handful)

    def __attrs_post_init__(self) -> None:
        if self.health.num_servers != 1 or self.request_timeout <= 0 or self.max_registrations < 1:
            raise ValueError(f"bad server link config {self!r}: one server, request_timeout > 0")


def client_link_config(*, request_timeout: float = 30.0, heartbeat_interval: float = 1.0,
                       heartbeat_timeout: float = 3.0, heartbeat_backoff_max: float | None = None,
                       reconnect_ivl_max: float = 1.0) -> ServerLinkConfig:
    """The link of a client that runs requests of its own (the connector's, ``mpcache-cli``'s),
    from its settings: heartbeats every ``heartbeat_interval``, the server unhealthy after
    ``heartbeat_timeout`` without a reply (every pending request then fails: nothing waits on a
    dead server), probes every 0.1 s while unhealthy, backed off up to ``heartbeat_backoff_max``
    (default: the larger of the interval and the transport's reconnect interval, so a probe never
    waits much longer than a reconnect). The simulator builds its links here too."""
    backoff_max = max(heartbeat_interval, reconnect_ivl_max) if heartbeat_backoff_max is None else heartbeat_backoff_max
    return ServerLinkConfig(
        HealthConfig(1, heartbeat_interval, heartbeat_timeout, backoff_max=backoff_max,
                     probe_interval=min(0.1, heartbeat_interval), fail_pending=True),
        request_timeout=request_timeout)


class Role(enum.Enum):
    """What a pending frame is to the link."""

    REQUEST = "request"
    REGISTRATION = "registration"
    UNREGISTRATION = "unregistration"
    HEARTBEAT = "heartbeat"
    INSTANCE_PING = "instance_ping"


# ------------------------------------------------------------------------------------ the link's own requests


@attrs.frozen
class Heartbeat:
    """The link's heartbeat (the transport sends its ``health`` op: the reply carries the epoch)."""


@attrs.frozen
class InstancePing:
    """The link's liveness ping for a registered instance (``ping(instance_id)``)."""

    instance_id: int


# ------------------------------------------------------------------------------------ events


@attrs.frozen
class Submit:
    token: Hashable
    request: Any
    timeout: float | None = None
    role: Role = Role.REQUEST
    instance: int | None = None


@attrs.frozen
class Reply:
    uid: int
    ok: bool
    value: Any = None
    kind: str | None = None


@attrs.frozen
class SendFailed:
    uid: int
    message: str = "server not connected"


@attrs.frozen
class Close:
    pass


LinkEvent = Union[Submit, Reply, SendFailed, Connected, TimerFired, Close]

# ------------------------------------------------------------------------------------ effects


@attrs.frozen
class Transmit:
    uid: int
    request: Any
    registration: int | None = None  # a resend naming this registration (health.resend_of)
    resend: bool = False


@attrs.frozen
class Completed:
    token: Hashable
    value: Any


@attrs.frozen
class Failed:
    token: Hashable
    kind: str
    message: str
    error: Any = None  # the server's refusal as the transport gave it, if any
    request: Any = None

    def protocol_error(self) -> ProtocolError:
        """What the request's machine is told: the server's refusal, else the link's verdict."""
        return self.error if isinstance(self.error, ProtocolError) else refusal(self.kind, self.message)


LinkEffect = Union[Transmit, Completed, Failed, ServerHealth, ServerEpoch]


@attrs.define
class _Pending:
    token: Hashable | None
    request: Any
    deadline: float
    role: Role
    instance: int | None = None
    retried: bool = False
    refusal: tuple[str, Any] | None = None  # parked: (kind, error) waiting on the monitor's verdict


@attrs.frozen
class RequestDeadline(Timer):
    """The deadline of the frame sent under ``uid`` (a uid is sent once: a resend is a new uid).
    Live while ``uid`` is pending; an answered one goes stale and fires as nothing."""

    uid: int


# Stale deadline entries the link may hold beyond twice its pending frames before a rebuild: at
# 10k calls/s with a 300 s timeout answered entries would otherwise linger by the million.
DEADLINE_SLACK = 1024


class ServerLink:
    def __init__(self, config: ServerLinkConfig, now: float = 0.0, monitor: HealthMonitor | None = None) -> None:
        """``monitor``: the health monitor to own (a simulator profile's subclass, say); by
        default one built from ``config.health``."""
        self.config = config
        self.monitor = HealthMonitor(config.health, now) if monitor is None else monitor
        self._pending: dict[int, _Pending] = {}
        # one RequestDeadline per pending frame (answered ones linger, stale, until due or a
        # rebuild; next_deadline names them, as it always has: firing one does nothing)
        self._deadlines = TimerHeap(self._deadline_live, DEADLINE_SLACK, live_count=self.pending_count)
        self._next_uid = 1
        self._registrations: dict[int, Any] = {}  # instance -> its last registration request
        self._heartbeat_at: float | None = None
        self._counters = {"internal_errors": 0, "late_replies": 0, "transmits": 0, "timeouts": 0,
                          "send_failures": 0, "parked": 0}
        self._events: dict[type, Callable[[Any, float, list[Any]], None]] = {
            Submit: self._on_submit, Reply: self._on_reply, SendFailed: self._on_send_failed,
            Connected: self._on_connected, TimerFired: self._on_timer, Close: self._on_close}
        self._monitor_effects: dict[type, Callable[[Any, float, list[Any]], None]] = {
            SendHeartbeat: self._do_heartbeat, SendInstancePing: self._do_instance_ping,
            ServerHealth: self._pass, ServerEpoch: self._pass, FailPending: self._do_fail_pending,
            Register: self._do_register, Resend: self._do_resend, GiveUp: self._do_give_up}

    # ------------------------------------------------------------------------------ queries

    def healthy(self) -> bool:
        return self.monitor.healthy(SERVER)

    def epoch(self) -> int | str | None:
        return self.monitor.epoch(SERVER)

    def period(self) -> float:
        return self.monitor.period(SERVER)

    @property
    def heartbeat_at(self) -> float | None:
        """``now`` of the last heartbeat reply (None before the first)."""
        return self._heartbeat_at

    def request_of(self, uid: int) -> Any:
        """The request a pending ``uid`` carries (None: not pending), for the transport to decode
        its reply."""
        p = self._pending.get(uid)
        return None if p is None else p.request

    def pending_count(self) -> int:
        return len(self._pending)

    def parked(self, uid: int) -> bool:
        """Whether ``uid`` was refused and waits on the monitor's verdict (resend or give-up)."""
        p = self._pending.get(uid)
        return p is not None and p.refusal is not None

    def parked_uids(self) -> list[int]:
        return sorted(u for u, p in self._pending.items() if p.refusal is not None)

    def deadline_entries(self) -> int:
        """Entries in the deadline heap (answered ones linger until due or a rebuild)."""
        return len(self._deadlines)

    def registration(self, instance: int) -> Any:
        """The last registration request remembered for ``instance`` (None: none)."""
        return self._registrations.get(instance)

    # What ``state_values`` carries, and the wiring it leaves out (tests/core_sm/test_state_values.py).
    STATE_FIELDS = ("monitor", "_pending", "_deadlines", "_next_uid", "_registrations", "_heartbeat_at", "_counters")
    WIRING_FIELDS = ("config", "_events", "_monitor_effects")

    def state_values(self) -> tuple[Any, ...]:
        """The link's changing state as immutable values (its pending requests, deadline heap,
        registrations, counters and its monitor's values), the wiring left out: ``restore`` on a
        link of the same configuration makes it this one."""
        return (tuple([(uid, (p.token, p.request, p.deadline, p.role, p.instance, p.retried, p.refusal))
                       for uid, p in self._pending.items()]),
                self._deadlines.state_values(), self._next_uid, tuple(self._registrations.items()), self._heartbeat_at,
                tuple(self._counters.values()), self.monitor.state_values())

    def restore(self, values: tuple[Any, ...]) -> None:
        """Become, in place, the link whose ``state_values()`` gave ``values`` (its monitor too)."""
        pending, deadlines, self._next_uid, registrations, self._heartbeat_at, counters, monitor = values
        self._pending = {uid: _Pending(*p) for uid, p in pending}
        self._deadlines.restore(deadlines)
        self._registrations = dict(registrations)
        own = self._counters
        own.update(zip(tuple(own), counters))
        self.monitor.restore(monitor)

    @property
    def counters(self) -> Mapping[str, int]:
        """The machine's own counters, live (read them; ``stats()`` is a copy with more)."""
        return self._counters

    def stats(self) -> dict[str, int]:
        return {**self._counters, **{f"health_{k}": v for k, v in self.monitor.stats().items()}}

    def request_deadlines(self) -> list[tuple[float, int]]:
        """``(deadline, uid)`` of every request still pending, in firing order. The deadline
        heap keeps an answered request's entry until it is due (firing it does nothing), so
        ``next_deadline`` may name one: a checker that compares states wants the live ones."""
        return [(d, t.uid) for d, t in self._deadlines.live_entries() if isinstance(t, RequestDeadline)]

    def next_deadline(self) -> float | None:
        health = self.monitor.next_deadline()
        first = self._deadlines.first_deadline()
        if first is None:
            return health
        return first if health is None else min(health, first)

    def _deadline_live(self, timer: Timer) -> bool:
        return isinstance(timer, RequestDeadline) and timer.uid in self._pending

    # ------------------------------------------------------------------------------ handle

    def handle(self, event: LinkEvent, now: float) -> list[LinkEffect]:
        out: list[Any] = []
        try:
            handler = self._events.get(type(event))
            if handler is None:
                self._counters["internal_errors"] += 1
            else:
                handler(event, now, out)
        except Exception:
            self._counters["internal_errors"] += 1
        return out

    def _feed(self, event: Any, now: float, out: list[Any]) -> None:
        """One monitor event; its effects performed here, in its order."""
        for effect in self.monitor.handle(event, now):
            self._monitor_effects[type(effect)](effect, now, out)

    def _transmit(self, p: _Pending, now: float, out: list[Any], registration: int | None = None,
                  resend: bool = False) -> int:
        uid = self._next_uid
        self._next_uid += 1
        self._pending[uid] = p
        self._deadlines.push(p.deadline, RequestDeadline(uid))
        self._counters["transmits"] += 1
        out.append(Transmit(uid, p.request, registration, resend))
        return uid

    def _fail(self, p: _Pending, kind: str, message: str, out: list[Any]) -> None:
        if p.token is not None:
            out.append(Failed(p.token, kind, message, None, p.request))

    def _answer_refusal(self, p: _Pending, out: list[Any], kind: str, message: str) -> None:
        """``p`` fails: with the refusal it was parked on if any, else ``kind``."""
        if p.token is None:
            return
        if p.refusal is not None:
            out.append(Failed(p.token, p.refusal[0], "", p.refusal[1], p.request))
        else:
            out.append(Failed(p.token, kind, message, None, p.request))

    # ------------------------------------------------------------------------------ transport events

    def _on_submit(self, ev: Submit, now: float, out: list[Any]) -> None:
        timeout = self.config.request_timeout if ev.timeout is None else ev.timeout
        if ev.role is Role.REGISTRATION and ev.instance is not None:
            self._registrations.pop(ev.instance, None)
            self._registrations[ev.instance] = ev.request
            while len(self._registrations) > self.config.max_registrations:
                self._registrations.pop(next(iter(self._registrations)))
            self._feed(RegistrationSent(SERVER, ev.instance), now, out)
        elif ev.role is Role.UNREGISTRATION and ev.instance is not None:
            self._registrations.pop(ev.instance, None)
            self._feed(InstanceUnregistered(SERVER, ev.instance), now, out)
        instance = ev.instance if ev.role in (Role.REQUEST, Role.REGISTRATION) else None
        role = Role.REQUEST if ev.role is Role.UNREGISTRATION else ev.role
        self._transmit(_Pending(ev.token, ev.request, now + timeout, role, instance), now, out)

    def _on_reply(self, ev: Reply, now: float, out: list[Any]) -> None:
        p = self._pending.pop(ev.uid, None)
        if p is None:
            self._counters["late_replies"] += 1
            return
        if p.refusal is not None:
            # another reply to a request already refused and parked (a network duplicate of the
            # refusal): its answer is its resend's, or the monitor's verdict -- never this one
            self._pending[ev.uid] = p
            self._counters["late_replies"] += 1
            return
        if p.role is Role.REQUEST:
            if ev.ok:
                out.append(Completed(p.token, ev.value))
            elif p.instance is None:
                out.append(Failed(p.token, ev.kind or "internal", "", ev.value, p.request))
            else:
                # a refusal of a request naming an instance: the monitor decides (resend or give
                # up); parked under its uid, its deadline still runs
                p.refusal = (ev.kind or "internal", ev.value)
                self._pending[ev.uid] = p
                self._counters["parked"] += 1
                self._feed(RequestRefused(SERVER, p.instance, ev.uid, ev.kind or "internal", p.retried), now, out)
        elif p.role is Role.HEARTBEAT:
            self._heartbeat_at = now
            value = ev.value
            epoch = value.get("epoch") if ev.ok and isinstance(value, dict) else None
            self._feed(HeartbeatReply(SERVER, epoch if type(epoch) in (int, str) else None), now, out)
        elif p.role is Role.INSTANCE_PING:
            if not ev.ok and p.instance is not None:
                self._feed(InstancePingRefused(SERVER, p.instance, ev.kind or "internal"), now, out)
        else:  # REGISTRATION: the caller's, or one the monitor asked for (no token)
            if p.token is not None:
                out.append(Completed(p.token, ev.value) if ev.ok
                           else Failed(p.token, ev.kind or "internal", "", ev.value, p.request))
            if p.instance is not None:
                # the reply is the registration's id, which a resend names (None: a server's nil)
                registration = ev.value if ev.ok and type(ev.value) is int else None
                self._feed(InstanceRegistered(SERVER, p.instance, registration) if ev.ok
                           else RegistrationFailed(SERVER, p.instance), now, out)

    def _on_send_failed(self, ev: SendFailed, now: float, out: list[Any]) -> None:
        p = self._pending.pop(ev.uid, None)
        if p is None:
            return
        self._counters["send_failures"] += 1
        if p.role is Role.HEARTBEAT:
            self._feed(HeartbeatUnsent(SERVER), now, out)
            return
        self._fail(p, NOT_SENT, ev.message, out)
        if p.role is Role.REGISTRATION and p.instance is not None:
            self._feed(RegistrationFailed(SERVER, p.instance), now, out)

    def _on_connected(self, ev: Connected, now: float, out: list[Any]) -> None:
        self._feed(Connected(SERVER), now, out)

    def _on_timer(self, ev: TimerFired, now: float, out: list[Any]) -> None:
        while (timer := self._deadlines.pop_due(now)) is not None:
            assert isinstance(timer, RequestDeadline)
            p = self._pending.pop(timer.uid)
            if p.role is Role.REQUEST or p.role is Role.REGISTRATION:
                self._counters["timeouts"] += 1
                self._answer_refusal(p, out, TIMEOUT, "no reply within the request timeout")
            if p.role is Role.REGISTRATION and p.instance is not None:
                self._feed(RegistrationFailed(SERVER, p.instance), now, out)
        health = self.monitor.next_deadline()
        if health is not None and health <= now:
            self._feed(TimerFired(), now, out)

    def _on_close(self, ev: Close, now: float, out: list[Any]) -> None:
        for p in self._pending.values():
            self._fail(p, CLOSED, "client closed", out)
        self._pending.clear()
        self._deadlines.clear()

    # ------------------------------------------------------------------------------ the monitor's effects

    def _pass(self, effect: Any, now: float, out: list[Any]) -> None:
        out.append(effect)

    def _reply_deadline(self, now: float) -> float:
        c = self.config
        return now + (c.health.timeout if c.reply_timeout is None else c.reply_timeout)

    def _do_heartbeat(self, effect: SendHeartbeat, now: float, out: list[Any]) -> None:
        self._transmit(_Pending(None, Heartbeat(), self._reply_deadline(now), Role.HEARTBEAT), now, out)

    def _do_instance_ping(self, effect: SendInstancePing, now: float, out: list[Any]) -> None:
        self._transmit(_Pending(None, InstancePing(effect.instance_id), self._reply_deadline(now), Role.INSTANCE_PING,
                                effect.instance_id), now, out)

    def _do_fail_pending(self, effect: FailPending, now: float, out: list[Any]) -> None:
        for p in self._pending.values():
            self._fail(p, UNHEALTHY, "server stopped answering", out)
        self._pending.clear()
        self._deadlines.clear()

    def _do_register(self, effect: Register, now: float, out: list[Any]) -> None:
        request = self._registrations.get(effect.instance_id)
        if request is None:  # never registered through this link (or forgotten): nothing to send again
            self._feed(InstanceUnregistered(SERVER, effect.instance_id), now, out)
            return
        self._transmit(_Pending(None, request, now + self.config.request_timeout, Role.REGISTRATION,
                                effect.instance_id), now, out)

    def _do_resend(self, effect: Resend, now: float, out: list[Any]) -> None:
        uid = effect.request
        p = self._pending.pop(uid, None) if type(uid) is int else None
        if p is None:
            return  # timed out or failed meanwhile
        p.retried, p.refusal = True, None
        self._transmit(p, now, out, effect.registration, resend=True)

    def _do_give_up(self, effect: GiveUp, now: float, out: list[Any]) -> None:
        uid = effect.request
        p = self._pending.pop(uid, None) if type(uid) is int else None
        if p is not None:
            self._answer_refusal(p, out, NOT_REGISTERED_KIND, "instance not registered")


INPUT_KINDS: tuple[type, ...] = (Submit, Reply, SendFailed, Connected, TimerFired, Close)
"""Every event kind a transport feeds a ``ServerLink`` (a coverage test names them)."""
