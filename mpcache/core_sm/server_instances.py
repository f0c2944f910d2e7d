"""Registered engine instances: register, unregister, heartbeats, and the reaping of dead ones
(F13, LMCache #4715).

An event addresses the instance it names (``instance_id``); its state is ``InstanceState``.
``INSTANCE_TABLE`` is what ``handle`` runs, and it *assigns*: each row names one next state, which
``_set_state`` gives the instance after the handler (``ABSENT``: its registration and its
tenant's share of L1 are forgotten). Where the outcome depends on more than the event's type,
a pure guard tells the raw event apart first (``RefusedRegistration``, ``OversizedRegistration``,
``ForeignUnregister``, ``ForeignHeartbeat``, ``SilentInstance``, ``StaleInstanceFailed``,
``StaleInstanceAttached``, ``FailedAttach``), so a handler never refuses or decides. Liveness is independent of traffic: a
``Ping(instance_id=...)`` refreshes an instance (so does any request naming it). An instance's
liveness is watched from its first heartbeat on (a client that never sends one -- LMCache's, or
one built before heartbeats -- is never reaped, as before); one that then stays silent for
``ServerConfig.instance_ttl`` seconds is reaped -- its registration goes, its uncommitted plans
fail (their slots stay quarantined one more lease TTL, as for any expired plan), it is counted
(``instances_reaped``) and the runtime gets ``InstanceReaped(instance_id)`` to release the GPU
mappings and staging memory it keeps for it. A request naming it afterwards gets
``NOT_REGISTERED`` (the client registers again once and resends, naming the new registration's
id, which the registration's reply gives: ``mpcache.core_sm.server_transfers``). A plain ``Ping()`` (LMCache's)
names no instance and is answered ``True``.

``InstanceFailed(instance_id)`` comes from the runtime when its GPU transfer engine gave up on the
instance (a copy whose engine event never fired): the instance is released as a reap releases
it, counted ``instances_failed``, with no ``InstanceReaped`` (the runtime dropped its mappings
already). Its running copies still end by their ``TransferFinished``. The event reaches core_sm
through the runtime's queue, so the engine may have registered the id again meanwhile: a
registration made at or after the event's ``failed_at`` is that new one, and stays (the event
is counted stale).

Ownership: an instance id belongs to the peer that registered it; a request from another peer
naming it (register again, unregister, heartbeat, store, retrieve, prepare) is refused
``FORBIDDEN`` and changes nothing. A reaped or failed instance's id stays its peer's for
``ServerConfig.reserved_id_ttl`` seconds: the owner registers it again (its client does so on
``NOT_REGISTERED``), another peer registering it meanwhile is refused ``FORBIDDEN`` -- else an
attacker that saw the owner fall silent takes its id and locks it out. An unregister frees the id
at once (its owner gave it up). Reservations are bounded (``max_reserved_ids``, oldest first out)
and take no share of L1: only registered instances make a tenant.

Decide, then act: the runtime touches its transfer engine only on core_sm's word. A server-driven
registration that passes every check is held (its instance is registered, its reply waits) and
``AttachInstance`` asks the runtime to open the instance's KV memory; ``InstanceAttached`` answers,
and only then does the registration get its reply -- or, when the memory could not be opened, the
registration is dropped, ``DetachInstance`` asked and the runtime's error answered. An unregister
by the owner (or a server-driven registration replaced by an engine-driven one) asks
``DetachInstance``; a reap says ``InstanceReaped``. A foreign or invalid registration or
unregister never reaches the transfer engine.
"""
from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Hashable
from itertools import repeat
from typing import Any, Protocol

import attrs

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.effects import AttachInstance, CarveL1, DetachInstance, Effect, InstanceReaped, Reply
from mpcache.core_sm.l1_slots import SlotFit, slot_plan
from mpcache.core_sm.errors import ErrorKind, ProtocolError
from mpcache.core_sm.messages import (
    CacheKey,
    InstanceAttached,
    InstanceFailed,
    Peer,
    PeerGone,
    Ping,
    RegisterInstance,
    ReplyTo,
    UnregisterInstance,
)
from mpcache.core_sm.server_core import EFFECT_OWNERS, ServerContext
from mpcache.core_sm.table import Table
from mpcache.core_sm.timers import Timer



class InstanceState(enum.Enum):
    """State of one engine instance id."""

    ABSENT = "absent"  # never registered, unregistered, or reaped
    REGISTERED = "registered"


@attrs.frozen
class InstanceDeadline(Timer):
    """An instance may have been silent for ``instance_ttl``: reap it, or check again later."""

    instance_id: int
    generation: int


@attrs.frozen
class ReleaseOfGonePeer(Timer):
    """``PeerGone`` names a peer; the server releases each instance it holds by this event (made
    there, never sent by a runtime), through this table."""

    instance_id: int


# The specific events the guards classify a raw event into (``InstanceMachine._classify_*``),
# each the event of a row of its own.


@attrs.frozen
class RefusedRegistration(RegisterInstance):
    """A registration refused before anything changes: invalid fields, another peer's instance,
    an id kept for the peer it was reaped from, or the peer's instance cap. ``refusal``: its
    answer."""

    refusal: ProtocolError = attrs.field(kw_only=True)


@attrs.frozen
class OversizedRegistration(RegisterInstance):
    """A registration whose objects are larger than L1's slots will be once its cut has run
    (``InstanceMachine._slot_fit``): refused ``TOO_LARGE`` after the ready objects its cut drops
    are dropped."""


@attrs.frozen
class ForeignUnregister(UnregisterInstance):
    """An unregister of another peer's instance: refused ``FORBIDDEN``."""


@attrs.frozen
class ForeignHeartbeat(Ping):
    """A heartbeat naming another peer's instance: refused ``FORBIDDEN``."""


@attrs.frozen
class SilentInstance(InstanceDeadline):
    """The instance's deadline came and it was not seen for ``instance_ttl``: reaped."""


@attrs.frozen
class StaleInstanceFailed(InstanceFailed):
    """The runtime failed the instance before its current registration (``registered_at >=
    failed_at``): that registration stays."""


@attrs.frozen
class StaleInstanceAttached(InstanceAttached):
    """The runtime's answer to a registration another one replaced meanwhile."""


@attrs.frozen
class FailedAttach(InstanceAttached):
    """The runtime could not open the registration's KV memory: the registration goes."""


@attrs.define
class Instance:
    registration: RegisterInstance
    generation: int  # a registration's timers are not another's
    last_seen: float  # also when it was registered, until traffic moves it
    registered_at: float
    watched: bool = False  # it has sent a heartbeat: reaped when silent for instance_ttl
    peer: Peer = None  # the connection that registered it
    # The id its registration's reply gave (what a resend after NOT_REGISTERED names): kept by a
    # re-registration of the same fields, new after a reap, an unregister or different fields.
    registration_id: int = 0


def _instance_id(ev: Any) -> Hashable:
    iid = getattr(ev, "instance_id", None)
    return iid if isinstance(iid, int) and not isinstance(iid, bool) else None


class TransfersOfInstances(Protocol):
    """What an instance's end reaches: the transfers of the instance (``server_transfers``;
    LookupServer wires it in once both exist)."""

    def instance_gone(self, instance_id: int, now: float, out: list[Effect]) -> None: ...


class InstanceMachine:
    """The server's registered instances (see the module docstring)."""

    # What the server's ``state_values`` carries of this part, and the wiring it leaves out
    # (core_sm/values.py; tests/core_sm/test_state_values.py holds every attribute to one).
    STATE_FIELDS: tuple[str, ...] = ("instances", "reserved")
    WIRING_FIELDS: tuple[str, ...] = ("ctx", "dispatch", "transfers")

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.transfers: TransfersOfInstances  # set by LookupServer once both exist
        self.instances: dict[int, Instance] = {}
        # reaped / failed ids: instance id -> (its peer, until when no other peer may register it);
        # insertion order is expiry order (one TTL, a clock that never goes back)
        self.reserved: OrderedDict[int, tuple[Peer, float]] = OrderedDict()
        self.dispatch = INSTANCE_TABLE.bind(self, _instance_id, self.state, ctx.counters, ctx.reply_error,
                                            self._set_state)

    def state(self, instance_id: Hashable) -> InstanceState:
        return InstanceState.REGISTERED if instance_id in self.instances else InstanceState.ABSENT

    def _set_state(self, instance_id: Hashable, state: InstanceState) -> None:
        """INSTANCE_TABLE's assignment. ``ABSENT``: the instance's registration is forgotten, and
        its tenant's share of L1 with it when it was the tenant's last. ``REGISTERED``: its
        registration's record, which the row's handler filed (a new one) or kept, is the one."""
        if state is InstanceState.ABSENT:
            gone = self.instances.pop(instance_id, None)  # type: ignore[call-overload]
            if gone is not None:
                assert isinstance(instance_id, int)
                self._tenant_gone(instance_id, gone)
            return
        assert instance_id in self.instances, "a registered instance without its record"

    def timer_live(self, timer: Timer) -> bool:
        assert isinstance(timer, InstanceDeadline)
        inst = self.instances.get(timer.instance_id)
        return inst is not None and inst.generation == timer.generation

    def registration(self, instance_id: int) -> RegisterInstance | None:
        inst = self.instances.get(instance_id)
        return None if inst is None else inst.registration

    def registration_id(self, instance_id: int) -> int | None:
        """The id of ``instance_id``'s current registration (None: not registered)."""
        inst = self.instances.get(instance_id)
        return None if inst is None else inst.registration_id

    def object_bytes_by_instance(self) -> dict[int, int]:
        """Each registered instance's object size (for status pages and metrics)."""
        return {iid: inst.registration.object_bytes for iid, inst in sorted(self.instances.items())}

    def seen(self, instance_id: int, now: float) -> None:
        """Traffic from ``instance_id`` proves it alive, like a heartbeat."""
        inst = self.instances.get(instance_id)
        if inst is not None:
            inst.last_seen = now

    def _arm(self, inst: Instance, iid: int, now: float) -> None:
        ttl = self.ctx.config.instance_ttl
        if ttl is not None:
            self.ctx.timers.push(inst.last_seen + ttl, InstanceDeadline(iid, inst.generation))

    # ============================================================================= guards
    # Pure: they read the machine and the raw event, and name the specific event whose row runs.

    def _classify_register(self, ev: RegisterInstance, state: InstanceState, now: float) -> RegisterInstance:
        """A registration refused before anything changes (``RefusedRegistration``), one whose
        objects will not fit L1's slots even after its cut (``OversizedRegistration``), or one
        that registers (``RegisterInstance``)."""
        refusal = self._registration_refusal(ev, now)
        fields = (ev.instance_id, ev.model_name, ev.world_size, ev.object_bytes, ev.engine_driven)
        if refusal is not None:
            return RefusedRegistration(*fields, reply_to=ev.reply_to, peer=ev.peer, refusal=refusal)
        fit = self._slot_fit(ev)
        if ev.object_bytes > (self.ctx.index.slot_bytes if fit is None else fit.slot_bytes):
            return OversizedRegistration(*fields, reply_to=ev.reply_to, peer=ev.peer)
        return ev

    def _registration_refusal(self, ev: RegisterInstance, now: float) -> ProtocolError | None:
        ctx = self.ctx
        err = None
        if not isinstance(ev.world_size, int) or ev.world_size < 1:
            err = "world_size must be >= 1"
        elif ev.world_size > ctx.config.max_world_size:
            err = f"world_size {ev.world_size} > {ctx.config.max_world_size}"
        elif not isinstance(ev.model_name, str):
            err = "model_name must be a str"
        elif not isinstance(ev.object_bytes, int) or ev.object_bytes < 0:
            err = "object_bytes must be >= 0"
        if err is not None:
            return ProtocolError(ErrorKind.VALIDATION, err)
        old = self.instances.get(ev.instance_id)
        if old is not None and old.peer != ev.peer:
            return ProtocolError(ErrorKind.FORBIDDEN, "the instance belongs to another peer")
        if old is None and self._reserved_for_another(ev.instance_id, ev.peer, now):
            return ProtocolError(ErrorKind.FORBIDDEN,
                                 "the instance id was reaped recently and is kept for the peer that held it")
        cap = ctx.config.max_instances_per_peer
        if old is None and ev.peer is not None and sum(1 for i in self.instances.values() if i.peer == ev.peer) >= cap:
            return ProtocolError(ErrorKind.TOO_LARGE, f"this connection has {cap} instances registered already")
        return None

    def _classify_unregister(self, ev: UnregisterInstance, state: InstanceState,
                             now: float) -> UnregisterInstance:
        if state is InstanceState.REGISTERED and self.instances[ev.instance_id].peer != ev.peer:
            return ForeignUnregister(ev.instance_id, reply_to=ev.reply_to, peer=ev.peer)
        return ev

    def _classify_ping(self, ev: Ping, state: InstanceState, now: float) -> Ping:
        if state is InstanceState.REGISTERED:
            assert ev.instance_id is not None
            if self.instances[ev.instance_id].peer != ev.peer:
                return ForeignHeartbeat(ev.instance_id, reply_to=ev.reply_to, peer=ev.peer)
        return ev

    def _classify_deadline(self, timer: InstanceDeadline, state: InstanceState, now: float) -> InstanceDeadline:
        """Heartbeats only move ``last_seen`` (no heap entry per ping): at the deadline, an
        instance seen since is checked again later; a silent one (``SilentInstance``) is reaped."""
        ttl = self.ctx.config.instance_ttl
        if state is InstanceState.REGISTERED and ttl is not None:
            if self.instances[timer.instance_id].last_seen + ttl <= now:
                return SilentInstance(timer.instance_id, timer.generation)
        return timer

    def _classify_failed(self, ev: InstanceFailed, state: InstanceState, now: float) -> InstanceFailed:
        """A registration made at or after ``failed_at`` came after the failure: the event is
        stale for it (``StaleInstanceFailed``)."""
        if state is InstanceState.REGISTERED and ev.failed_at is not None:
            if self.instances[ev.instance_id].registered_at >= ev.failed_at:
                return StaleInstanceFailed(ev.instance_id, ev.reason, ev.failed_at)
        return ev

    def _classify_attached(self, ev: InstanceAttached, state: InstanceState, now: float) -> InstanceAttached:
        """The answer to a replaced registration (``StaleInstanceAttached``), the runtime's
        refusal to open the KV memory (``FailedAttach``), or the memory opened."""
        if state is not InstanceState.REGISTERED:
            return ev
        fields = (ev.instance_id, ev.registration_id, ev.error)
        if self.instances[ev.instance_id].registration_id != ev.registration_id:
            return StaleInstanceAttached(*fields, reply_to=ev.reply_to)
        if ev.error is not None:
            return FailedAttach(*fields, reply_to=ev.reply_to)
        return ev

    # ============================================================================= requests

    def _on_register(self, ev: RegisterInstance, now: float, out: list[Effect]) -> None:
        ctx = self.ctx
        old = self.instances.get(ev.instance_id)
        if old is None:
            self._expire_reserved(now)
        self._fit_slots(self._slot_fit(ev), out)
        self.reserved.pop(ev.instance_id, None)
        registration = attrs.evolve(ev, reply_to=None)
        # The same fields again (the transport's and the machine's re-registrations may cross, a
        # duplicate may arrive): the same registration, so a resend naming it still runs.
        same = old is not None and old.registration == registration
        inst = Instance(registration, ctx.new_id(), now, now, peer=ev.peer,
                        registration_id=old.registration_id if same and old is not None else ctx.new_transfer_id())
        self.instances[ev.instance_id] = inst  # the new registration's record (its row: REGISTERED)
        self._shares_changed()
        if old is not None and old.watched:  # registering again: still a heartbeating client
            inst.watched = True
            self._arm(inst, ev.instance_id, now)
        if not ev.engine_driven:  # the server copies: its transfer engine opens the KV memory first
            out.append(AttachInstance(ev.instance_id, inst.registration_id, ev.reply_to))
            return
        if old is not None and not old.registration.engine_driven:
            out.append(DetachInstance(ev.instance_id))
        out.append(Reply(ev.reply_to, inst.registration_id))

    def _on_refused_registration(self, ev: RefusedRegistration, now: float, out: list[Effect]) -> None:
        if ev.refusal.kind is not ErrorKind.VALIDATION and ev.instance_id not in self.instances:
            self._expire_reserved(now)  # a well-formed registration of an unregistered id lets them go
        self.ctx.reply_error(out, ev.reply_to, ev.refusal)

    def _on_oversized_registration(self, ev: OversizedRegistration, now: float, out: list[Effect]) -> None:
        ctx = self.ctx
        if ev.instance_id not in self.instances:
            self._expire_reserved(now)
        self._fit_slots(self._slot_fit(ev), out)  # what it drops goes even so: L1 stays as it is
        ctx.error(out, ev.reply_to, ErrorKind.TOO_LARGE,
                  f"object of {ev.object_bytes} B > slot of {ctx.index.slot_bytes} B: start the server "
                  f"with --slot-mb {-(-ev.object_bytes // (1 << 20))} or more (docs/troubleshooting.md)")

    def _slot_fit(self, ev: RegisterInstance) -> SlotFit | None:
        """What registering ``ev`` does to L1's slots (``mpcache.core_sm.l1_slots``), or None when
        they stay as they are. Changes nothing: ``_fit_slots`` applies it."""
        ctx = self.ctx
        index = ctx.index
        plan = slot_plan(ev.object_bytes, l1_bytes=ctx.config.l1_bytes, align=ctx.config.slot_align,
                         slot_bytes=index.slot_bytes,
                         others_registered=any(iid != ev.instance_id for iid in self.instances))
        if plan is None:
            return None
        cuts = index.can_recarve(plan.num_slots, plan.slot_bytes, drop_ready=plan.drop_ready)
        return SlotFit(plan, cuts, plan.slot_bytes if cuts else index.slot_bytes)

    def _fit_slots(self, fit: SlotFit | None, out: list[Effect]) -> None:
        """Apply ``_slot_fit``'s answer: drop the ready objects it drops (what an in-flight copy
        reads stays, and L1 then stays as it is), and cut L1 again when it said so."""
        if fit is None:
            return
        index = self.ctx.index
        if fit.plan.drop_ready:
            index.clear(False, protected=lambda owner: isinstance(owner, EFFECT_OWNERS))
        if fit.cuts:
            carved = index.recarve(fit.plan.num_slots, fit.plan.slot_bytes)
            assert carved, "L1 was to be empty by now (L1Index.can_recarve)"
            out.append(CarveL1(fit.plan.slot_bytes, fit.plan.num_slots))
            self._shares_changed()

    def _on_attached(self, ev: InstanceAttached, now: float, out: list[Effect]) -> None:
        out.append(Reply(ev.reply_to, ev.registration_id))

    def _on_attach_failed(self, ev: FailedAttach, now: float, out: list[Effect]) -> None:
        self.transfers.instance_gone(ev.instance_id, now, out)
        out.append(DetachInstance(ev.instance_id))
        assert ev.error is not None
        self.ctx.error(out, ev.reply_to, ev.error.kind, ev.error.message)

    def _on_attached_stale(self, ev: InstanceAttached, now: float, out: list[Effect]) -> None:
        """The registration it answers is gone (unregistered or replaced meanwhile): counted; its
        request still gets its one reply."""
        self.ctx.counters["stale_events"] += 1
        if ev.error is None:
            self.ctx.error(out, ev.reply_to, ErrorKind.NOT_REGISTERED,
                           f"registration {ev.registration_id} of instance {ev.instance_id} was replaced")
        else:
            self.ctx.error(out, ev.reply_to, ev.error.kind, ev.error.message)

    def _on_unregister(self, ev: UnregisterInstance, now: float, out: list[Effect]) -> None:
        inst = self.instances.get(ev.instance_id)
        if inst is not None and not inst.registration.engine_driven:
            out.append(DetachInstance(ev.instance_id))
        out.append(Reply(ev.reply_to, None))

    def _on_foreign(self, ev: ForeignUnregister | ForeignHeartbeat, now: float, out: list[Effect]) -> None:
        self.ctx.error(out, ev.reply_to, ErrorKind.FORBIDDEN, "the instance belongs to another peer")

    def _on_plain_ping(self, ev: Ping, now: float, out: list[Effect]) -> None:
        if ev.instance_id is None:
            out.append(Reply(ev.reply_to, True))
        else:
            self.ctx.error(out, ev.reply_to, ErrorKind.NOT_REGISTERED,
                           f"instance {ev.instance_id!r} is not registered")

    def _on_heartbeat(self, ev: Ping, now: float, out: list[Effect]) -> None:
        assert ev.instance_id is not None
        inst = self.instances[ev.instance_id]
        inst.last_seen = now
        if not inst.watched:
            inst.watched = True
            self._arm(inst, ev.instance_id, now)
        self.ctx.counters["heartbeats"] += 1
        out.append(Reply(ev.reply_to, True))

    # ============================================================================= timers

    def _on_deadline(self, timer: InstanceDeadline, now: float, out: list[Effect]) -> None:
        """Seen since its deadline was armed: checked again at its new deadline."""
        self._arm(self.instances[timer.instance_id], timer.instance_id, now)

    def _on_silent(self, timer: SilentInstance, now: float, out: list[Effect]) -> None:
        iid = timer.instance_id
        inst = self.instances[iid]
        self.ctx.counters["instances_reaped"] += 1
        self.transfers.instance_gone(iid, now, out)
        self._reserve(iid, inst.peer, now)
        out.append(InstanceReaped(iid))

    # ============================================================================= runtime

    def _on_failed(self, ev: InstanceFailed, now: float, out: list[Effect]) -> None:
        """The runtime failed the instance (its GPU engine's event never fired): release it as a
        reap does. No ``InstanceReaped``: the runtime already dropped what it kept for it."""
        self.ctx.counters["instances_failed"] += 1
        self.transfers.instance_gone(ev.instance_id, now, out)
        self._reserve(ev.instance_id, self.instances[ev.instance_id].peer, now)

    def _on_failed_stale(self, ev: InstanceFailed, now: float, out: list[Effect]) -> None:
        self.ctx.counters["stale_events"] += 1

    def peer_gone(self, ev: PeerGone, now: float, out: list[Effect]) -> None:
        """``ev.peer`` can never come back: release its instances, forget the ids kept for it."""
        for iid in sorted(iid for iid, inst in self.instances.items() if inst.peer == ev.peer):
            self.dispatch.run(ReleaseOfGonePeer(iid), now, out)
        for iid in [iid for iid, (peer, _until) in self.reserved.items() if peer == ev.peer]:
            del self.reserved[iid]

    def _on_release_of_gone_peer(self, ev: ReleaseOfGonePeer, now: float, out: list[Effect]) -> None:
        inst = self.instances[ev.instance_id]
        self.ctx.counters["instances_of_gone_peers"] += 1
        self.transfers.instance_gone(ev.instance_id, now, out)
        if not inst.registration.engine_driven:
            out.append(DetachInstance(ev.instance_id))

    # ============================================================================= reserved ids

    def _reserve(self, instance_id: int, peer: Peer, now: float) -> None:
        """``instance_id`` went without its owner's word (reaped, failed): keep it for ``peer``."""
        self._expire_reserved(now)
        self.reserved.pop(instance_id, None)
        self.reserved[instance_id] = (peer, now + self.ctx.config.reserved_id_ttl)
        while len(self.reserved) > self.ctx.config.max_reserved_ids:
            self.reserved.popitem(last=False)

    def _expire_reserved(self, now: float) -> None:
        while self.reserved:
            _peer, until = next(iter(self.reserved.values()))
            if until > now:
                return
            self.reserved.popitem(last=False)

    def _reserved_for_another(self, instance_id: int, peer: Peer, now: float) -> bool:
        """Whether ``instance_id`` is kept for another peer than ``peer`` at ``now``. Changes
        nothing (a guard reads it): an entry ``_expire_reserved`` would let go first counts as
        gone."""
        for iid, (_peer, until) in self.reserved.items():
            if until > now:
                break
            if iid == instance_id:
                return False
        kept = self.reserved.get(instance_id)
        return kept is not None and kept[0] != peer

    # ============================================================================= L1 quota

    def _shares_changed(self) -> None:
        """L1 is shared by quota (mpcache.core_sm.l1_quota) among tenants: a tenant is a peer (its
        connection or CURVE key), not an instance it registered, so registering many instances
        takes no more of L1. Each tenant's share is ``num_slots`` over the tenants."""
        tenants = {self._tenant(inst, iid) for iid, inst in self.instances.items()}
        self.ctx.index.quota.tenant_share = max(1, self.ctx.index.num_slots // max(1, len(tenants)))

    @staticmethod
    def _tenant(inst: Instance, instance_id: int) -> Hashable:
        # a registration without a peer (a harness, an in-process caller) is a tenant of its own
        return instance_id if inst.peer is None else ("peer", inst.peer)

    def tenant_of(self, instance_id: int) -> Hashable:
        """Whose L1 charge the objects ``instance_id`` stores are."""
        return self._tenant(self.instances[instance_id], instance_id)

    def _tenant_gone(self, instance_id: int, gone: Instance) -> None:
        """A gone tenant's objects stay readable, charged to no tenant (the first to go): when the
        peer's last instance goes (its other instances keep them charged to it)."""
        tenant = self._tenant(gone, instance_id)
        if not any(self._tenant(inst, iid) == tenant for iid, inst in self.instances.items()):
            self.ctx.index.quota.forget_tenant(tenant)
        self._shares_changed()

    # ============================================================================= for transfers

    def slot_quota(self, instance_id: int | None = None) -> int:
        """L1 slots one instance's in-flight stores may hold reserved: its tenant's share split
        among the tenant's instances (``max_slots_per_instance`` when set)."""
        c = self.ctx.config
        if c.max_slots_per_instance is not None:
            return c.max_slots_per_instance
        share = self.ctx.index.quota.tenant_share or self.ctx.index.num_slots
        inst = self.instances.get(instance_id) if instance_id is not None else None
        if inst is None:
            return max(1, share)
        tenant = self._tenant(inst, instance_id)  # type: ignore[arg-type]
        siblings = sum(1 for iid, i in self.instances.items() if self._tenant(i, iid) == tenant)
        return max(1, share // max(1, siblings))

    def object_bytes_for(self, model_name: str, world_size: int) -> int:
        """The object size of a registered instance of that model, else a whole slot (what a
        reservation must be able to hold)."""
        return self.registered_object_bytes(model_name, world_size) or self.ctx.index.slot_bytes

    def registered_object_bytes(self, model_name: str, world_size: int) -> int:
        """The object size an instance of that model registered, or 0 when none is registered
        here (a server that only serves lookups for a fleet: the size is not known, so an L2
        read must not demand one)."""
        for inst in self.instances.values():
            reg = inst.registration
            if reg.model_name == model_name and reg.world_size == world_size:
                return reg.object_bytes
        return 0

    def owns(self, instance_id: int, peer: Peer) -> bool:
        """Whether ``instance_id`` is registered, by ``peer``."""
        inst = self.instances.get(instance_id) if isinstance(instance_id, int) else None
        return inst is not None and inst.peer == peer

    def worker_keys(self, key: CacheKey, instance_id: int, skip: int, peer: Peer
                    ) -> tuple[RegisterInstance | None, tuple[ObjectKey, ...] | ProtocolError]:
        """The objects of a worker request's range, or why it is refused. Changes nothing (a
        transfer's guard reads it; only the chain's root cache may fill): a request of the
        instance's own peer is traffic that proves it alive, which its handler records
        (``seen``)."""
        ctx = self.ctx
        inst = self.instances.get(instance_id) if isinstance(instance_id, int) else None
        if inst is None:
            return None, ProtocolError(ErrorKind.NOT_REGISTERED, f"instance {instance_id!r} is not registered")
        if inst.peer != peer:
            return None, ProtocolError(ErrorKind.FORBIDDEN, f"instance {instance_id!r} belongs to another peer")
        reg = inst.registration
        err = ctx.validate_key(key, scheduler=False)
        if err is None and (key.model_name != reg.model_name or key.world_size != reg.world_size):
            err = "key model_name/world_size differ from the registered instance"
        if err is None and skip > key.end - key.start:
            err = "skip_first_n_tokens beyond the range"
        hashes: tuple[bytes, ...] = ()
        if err is None:
            hashes, err = ctx.hashes(key, key.end // ctx.config.chunk_size)
        if err is not None:
            return None, ProtocolError(ErrorKind.VALIDATION, err)
        assert key.worker_id is not None
        first = key.start // ctx.config.chunk_size
        # tuple.__new__ makes each ObjectKey in C (a NamedTuple's own __new__ is a Python call)
        return reg, tuple(map(tuple.__new__, repeat(ObjectKey), zip(hashes[first:], repeat(key.worker_id))))


# (state of the instance the event names, event type) -> (handler, next state), which the
# dispatcher assigns (InstanceMachine._set_state). A Ping that names no instance addresses the
# ABSENT row (LMCache's plain ping: True). The guards classify a raw event into the specific one
# whose row applies (a refusal keeps the state the instance was in).
INSTANCE_TABLE: Table[InstanceState] = Table(
    "LookupServer instances (one instance id)", InstanceState, InstanceState.ABSENT, {
    (InstanceState.ABSENT, RegisterInstance): (InstanceMachine._on_register, InstanceState.REGISTERED),
    (InstanceState.REGISTERED, RegisterInstance): (InstanceMachine._on_register, InstanceState.REGISTERED),
    (InstanceState.ABSENT, RefusedRegistration): (InstanceMachine._on_refused_registration, InstanceState.ABSENT),
    (InstanceState.REGISTERED, RefusedRegistration):
        (InstanceMachine._on_refused_registration, InstanceState.REGISTERED),
    (InstanceState.ABSENT, OversizedRegistration):
        (InstanceMachine._on_oversized_registration, InstanceState.ABSENT),
    (InstanceState.REGISTERED, OversizedRegistration):
        (InstanceMachine._on_oversized_registration, InstanceState.REGISTERED),
    (InstanceState.ABSENT, UnregisterInstance): (InstanceMachine._on_unregister, InstanceState.ABSENT),
    (InstanceState.REGISTERED, UnregisterInstance): (InstanceMachine._on_unregister, InstanceState.ABSENT),
    (InstanceState.REGISTERED, ForeignUnregister): (InstanceMachine._on_foreign, InstanceState.REGISTERED),
    (InstanceState.ABSENT, Ping): (InstanceMachine._on_plain_ping, InstanceState.ABSENT),
    (InstanceState.REGISTERED, Ping): (InstanceMachine._on_heartbeat, InstanceState.REGISTERED),
    (InstanceState.REGISTERED, ForeignHeartbeat): (InstanceMachine._on_foreign, InstanceState.REGISTERED),
    (InstanceState.REGISTERED, InstanceDeadline): (InstanceMachine._on_deadline, InstanceState.REGISTERED),
    (InstanceState.REGISTERED, SilentInstance): (InstanceMachine._on_silent, InstanceState.ABSENT),
    (InstanceState.REGISTERED, InstanceFailed): (InstanceMachine._on_failed, InstanceState.ABSENT),
    (InstanceState.REGISTERED, StaleInstanceFailed): (InstanceMachine._on_failed_stale, InstanceState.REGISTERED),
    (InstanceState.ABSENT, InstanceFailed): (InstanceMachine._on_failed_stale, InstanceState.ABSENT),
    (InstanceState.REGISTERED, InstanceAttached): (InstanceMachine._on_attached, InstanceState.REGISTERED),
    (InstanceState.REGISTERED, FailedAttach): (InstanceMachine._on_attach_failed, InstanceState.ABSENT),
    (InstanceState.REGISTERED, StaleInstanceAttached):
        (InstanceMachine._on_attached_stale, InstanceState.REGISTERED),
    (InstanceState.ABSENT, InstanceAttached): (InstanceMachine._on_attached_stale, InstanceState.ABSENT),
    (InstanceState.REGISTERED, ReleaseOfGonePeer): (InstanceMachine._on_release_of_gone_peer, InstanceState.ABSENT),
}, assigns=True, guards={
    RegisterInstance: InstanceMachine._classify_register,
    UnregisterInstance: InstanceMachine._classify_unregister,
    Ping: InstanceMachine._classify_ping,
    InstanceDeadline: InstanceMachine._classify_deadline,
    InstanceFailed: InstanceMachine._classify_failed,
    InstanceAttached: InstanceMachine._classify_attached,
})
INSTANCE_TIMERS = (InstanceDeadline,)
