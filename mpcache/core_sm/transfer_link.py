"""The transfer client's server link -- health, epoch and registration -- as the rows of
``LINK_TABLE``, which ``TransferClient`` executes (``RegistrationLink`` is one of its bases, so a
subclass overriding ``_on_epoch`` or ``_on_not_registered``, a legacy profile, is what runs).

``LinkState`` is derived from the fields: DOWN while unhealthy; REGISTERING while a
``RegisterInstance`` is in flight; RETRY_WAIT while a failed one waits for its backoff; else
REGISTERED once one was acked, UNREGISTERED before. Losing the server (unhealthy, new epoch)
fails every op waiting on it through ``OP_TABLE`` (``OpServerLost``).

Restart detection (F13): a server that restarted between two heartbeats has forgotten the
registration. Either sign of it starts a new one:

* ``ServerEpoch(server, epoch)`` with an epoch different from the last one fed: handled as
  ``ServerHealth(False)`` then ``ServerHealth(True)`` -- what was in flight fails now, and
  ``RegisterInstance`` is sent again.  The *first* epoch fed after a registration went out registers again
  too (idempotent): that registration may have reached an incarnation that has since restarted.
* a ``NOT_REGISTERED`` error for an op sent while the client believed itself registered (and no
  registration was acked after the op was sent): the client marks itself unregistered and sends
  ``RegisterInstance`` once; the failing ops fail as usual (stores finish, retrieves become load
  errors), later ops go out as usual.

A registration that fails, or stays unanswered for ``registration_timeout``, is sent again after
a backoff (``registration_retry`` doubling up to ``registration_retry_max``) while the server is
healthy; ``next_deadline()`` covers it.
"""
from __future__ import annotations

from mpcache.core_sm.effects import Effect
from mpcache.core_sm.messages import OpId, RegisterInstance, ServerEpoch, ServerHealth, ServerRequest
from mpcache.core_sm.table import Dispatcher, Table
from mpcache.core_sm.timers import TimerHeap
from mpcache.core_sm.transfer_ops import (
    LinkState,
    NotRegistered,
    OpServerLost,
    OpState,
    RegistrationAnswered,
    RegistrationRetry,
    RegistrationTimeout,
    TransferClientConfig,
    TransferOp,
)


class RegistrationLink:
    """The link rows and their state; the rest of the machine is ``TransferClient``'s."""

    config: TransferClientConfig
    _counters: dict[str, int]
    _timers: TimerHeap
    _ops: dict[OpId, TransferOp]
    _op_d: Dispatcher[OpState]

    def _init_link(self) -> None:
        self._registration_correlation: int | None = None
        self._registration_retry_at: float | None = None  # a failed registration goes again then
        self._registration_delay = self.config.registration_retry
        self._registrations_acked = 0
        self._incarnation = 0  # bumped whenever the server is lost (unhealthy, new epoch)
        self._epoch: int | str | None = None
        self._healthy = True
        self._registered = False

    def _send(self, request: ServerRequest, op: OpId | None, out: list[Effect]) -> int:
        raise NotImplementedError

    def registered(self) -> bool:
        """Whether the last ``RegisterInstance`` was acked and nothing has shown it lost since."""
        return self._registered

    def registration_request(self) -> RegisterInstance:
        c = self.config
        return RegisterInstance(c.instance_id, c.model_name, c.world_size, c.object_bytes, c.engine_driven)

    def link_state(self) -> LinkState:
        return self._link_state(self.config.server)

    def _link_address(self, event: object) -> object:
        return getattr(event, "server", self.config.server)

    def _link_state(self, server: object) -> LinkState:
        if server != self.config.server:
            return LinkState.OTHER
        if not self._healthy:
            return LinkState.DOWN
        if self._registration_correlation is not None:
            return LinkState.REGISTERING
        if self._registration_retry_at is not None:
            return LinkState.RETRY_WAIT
        return LinkState.REGISTERED if self._registered else LinkState.UNREGISTERED

    # ============================================================================= rows

    def _on_other_server(self, ev: ServerHealth | ServerEpoch, now: float, out: list[Effect]) -> None:
        """Another server's health or epoch: not this client's."""

    def _on_health(self, ev: ServerHealth, now: float, out: list[Effect]) -> None:
        was_healthy = self._healthy
        if not ev.healthy:
            if was_healthy:
                self._lose_server(now, out)
            return
        if not was_healthy:
            self._healthy = True
            self._send_registration(now, out)
        elif not self._registered and self._registration_correlation is None:
            self._send_registration(now, out)  # (a scheduled retry goes now)

    def _on_epoch(self, ev: ServerEpoch, now: float, out: list[Effect]) -> None:
        old, self._epoch = self._epoch, ev.epoch
        if old is None:
            # The first epoch learned after a registration went out cannot tell which server
            # incarnation took that registration (a restart before the first heartbeat reply):
            # register again (idempotent) rather than be unknown to a new server (F13).
            if self._healthy and (self._registered or self._registration_correlation is not None):
                self._counters["registrations_on_first_epoch"] += 1
                self._send_registration(now, out)
            return
        if old == ev.epoch:
            return
        self._counters["server_restarts"] += 1
        if self._healthy:  # else the transition to healthy registers
            self._lose_server(now, out)
            self._healthy = True
            self._send_registration(now, out)

    def _on_registration_answer(self, ev: RegistrationAnswered, now: float, out: list[Effect]) -> None:
        self._registration_correlation = None
        if ev.error is None:
            self._registered = True
            self._registrations_acked += 1
            self._registration_delay = self.config.registration_retry
        else:
            self._registered = False
            self._counters["registration_failures"] += 1
            self._schedule_registration_retry(now)

    def _on_registration_timeout(self, ev: RegistrationTimeout, now: float, out: list[Effect]) -> None:
        self._counters["registration_timeouts"] += 1
        self._registration_correlation = None  # a late answer is stale
        self._schedule_registration_retry(now)

    def _on_registration_retry(self, ev: RegistrationRetry, now: float, out: list[Effect]) -> None:
        self._counters["registration_retries"] += 1
        self._send_registration(now, out)

    def _on_not_registered_reply(self, ev: NotRegistered, now: float, out: list[Effect]) -> None:
        self._on_not_registered(ev.op, now, out)

    def _on_not_registered(self, op: TransferOp, now: float, out: list[Effect]) -> None:
        """The server does not know this instance: it restarted (or dropped it). Register again,
        once: not for an op sent to a server already known lost, nor while a registration is
        under way, nor for an op sent before the current registration was acked."""
        if not self._healthy or op.incarnation != self._incarnation:
            return
        if self._registration_correlation is not None or self._registration_retry_at is not None:
            return
        if self._registered and op.registration != self._registrations_acked:
            return
        self._counters["reregistrations"] += 1
        self._registered = False
        self._send_registration(now, out)

    # ============================================================================= internals

    def _lose_server(self, now: float, out: list[Effect]) -> None:
        """The server is unhealthy (or restarted): ops waiting on it fail now; ops whose engine
        copy runs fail when it finishes; the registration is void."""
        self._healthy = False
        self._incarnation += 1
        self._registered = False
        self._registration_correlation = None
        self._registration_retry_at = None
        self._registration_delay = self.config.registration_retry
        for op_id in list(self._ops):
            if op_id in self._ops:
                self._op_d.run(OpServerLost(op_id), now, out)

    def _send_registration(self, now: float, out: list[Effect]) -> None:
        self._counters["registrations"] += 1
        self._registration_retry_at = None
        corr = self._registration_correlation = self._send(self.registration_request(), None, out)
        self._timers.push(now + self.config.registration_timeout, RegistrationTimeout(corr))

    def _schedule_registration_retry(self, now: float) -> None:
        at = self._registration_retry_at = now + self._registration_delay
        self._registration_delay = min(self._registration_delay * 2, self.config.registration_retry_max)
        self._timers.push(at, RegistrationRetry(at))


_K, _R = LinkState, RegistrationLink

# Its server: (link state, event) -> (handler, next states). handle runs it.
LINK_TABLE: Table[LinkState] = Table("TransferClient (its server: health and registration)", LinkState, _K.OTHER, {
    (_K.OTHER, ServerHealth): (_R._on_other_server, (_K.OTHER,)),
    (_K.OTHER, ServerEpoch): (_R._on_other_server, (_K.OTHER,)),
    (_K.DOWN, ServerHealth): (_R._on_health, (_K.DOWN, _K.REGISTERING)),
    (_K.UNREGISTERED, ServerHealth): (_R._on_health, (_K.DOWN, _K.REGISTERING)),
    (_K.REGISTERING, ServerHealth): (_R._on_health, (_K.DOWN, _K.REGISTERING)),
    (_K.RETRY_WAIT, ServerHealth): (_R._on_health, (_K.DOWN, _K.REGISTERING)),
    (_K.REGISTERED, ServerHealth): (_R._on_health, (_K.DOWN, _K.REGISTERED)),
    # A new epoch is a restart: as ServerHealth(False) then (True).
    (_K.DOWN, ServerEpoch): (_R._on_epoch, (_K.DOWN,)),
    (_K.UNREGISTERED, ServerEpoch): (_R._on_epoch, (_K.UNREGISTERED, _K.REGISTERING)),
    (_K.REGISTERING, ServerEpoch): (_R._on_epoch, (_K.REGISTERING,)),
    (_K.RETRY_WAIT, ServerEpoch): (_R._on_epoch, (_K.RETRY_WAIT, _K.REGISTERING)),
    (_K.REGISTERED, ServerEpoch): (_R._on_epoch, (_K.REGISTERED, _K.REGISTERING)),
    (_K.REGISTERING, RegistrationAnswered): (_R._on_registration_answer, (_K.REGISTERED, _K.RETRY_WAIT)),
    (_K.REGISTERING, RegistrationTimeout): (_R._on_registration_timeout, (_K.RETRY_WAIT,)),
    (_K.RETRY_WAIT, RegistrationRetry): (_R._on_registration_retry, (_K.REGISTERING,)),
    (_K.UNREGISTERED, NotRegistered): (_R._on_not_registered_reply, (_K.REGISTERING,)),
    (_K.REGISTERING, NotRegistered): (_R._on_not_registered_reply, (_K.REGISTERING,)),
    (_K.RETRY_WAIT, NotRegistered): (_R._on_not_registered_reply, (_K.RETRY_WAIT,)),
    (_K.REGISTERED, NotRegistered): (_R._on_not_registered_reply, (_K.REGISTERED, _K.REGISTERING)),
})
