"""Profiles: which machines a world runs. `default` is production core_sm, unchanged.

Each legacy profile puts one historical LMCache bug back by *substituting a subclass* of a
core_sm machine that overrides one of its extension-point methods (docs/core_sm.md) -- core_sm
itself has no flags for them. The simulator must catch each one with a violation whose code
names the failure (reference/lmcache_mp.md §F); tests/sim/test_profiles.py proves it does
within 200 seeds.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.effects import Effect, ErrorReply, Reply
from mpcache.core_sm.errors import ProtocolError
from mpcache.core_sm.client_config import (ConnectorSettings, lookup_client_config, server_for_rank,
                                           transfer_op_timeout)
from mpcache.core_sm.health import GiveUp, HealthMonitor, Register, Resend
from mpcache.core_sm.l1_index import ReleaseReason
from mpcache.core_sm.lookup_client import LookupClient, LookupClientConfig, PendingLookup, ServerLeg
from mpcache.core_sm.messages import (
    Clear,
    Lookup,
    Ping,
    RegisterInstance,
    ReplyTo,
    ServerEpoch,
    UnregisterInstance,
    WaitPrefetchStatus,
)
from mpcache.core_sm.server_instances import InstanceState
from mpcache.core_sm.planner import (
    BlocksAllocated,
    LookupAnswered,
    MatchAnswer,
    MatchRequest,
    PlannerConfig,
    RequestState,
    RequestTracker,
    StepPlanner,
)
from mpcache.core_sm.server import LookupServer, PrefetchJob, RequestKey, ServerConfig
from mpcache.core_sm.server_link import Role, ServerLink, ServerLinkConfig, Submit
from mpcache.core_sm.transfer_client import TransferClient, TransferClientConfig, TransferOp
from mpcache.sim.scenario import WorldConfig

MODEL = "sim-model"


class Profile:
    name = "default"
    failure = ""  # the §F failure this profile puts back
    # other failures the bug put back leads to first on some seeds (a consequence, not a miss)
    also: tuple[str, ...] = ()
    description = "production core_sm machines, unchanged"
    server_class: type[LookupServer] = LookupServer
    lookup_client_class: type[LookupClient] = LookupClient
    transfer_client_class: type[TransferClient] = TransferClient
    planner_class: type[StepPlanner] = StepPlanner
    health_monitor_class: type[HealthMonitor] = HealthMonitor
    lookup_timeout: float | None = None  # None: the connector's (two request timeouts)
    lookup_status_wait: bool = True  # the connector's default: status by WAIT_PREFETCH_STATUS
    # Simulated worlds last seconds, so the server reaps a silent instance after 4 s, not the
    # production 60: longer than the heartbeat timeout (2.5 s) and the longest scheduled partition
    # (3 s), so a live worker is reaped only after it has seen the server down (and registers
    # again on recovery), and every world has idle gaps longer than the TTL (after its traffic).
    instance_ttl: float = 4.0
    # Every client node's transport: core_sm's ServerLink, the machine runtime_zmq's client runs
    # (it registers again and resends a request refused not_registered once); a legacy client's
    # is a subclass.
    link_class: type[ServerLink] = ServerLink
    # The server's runtime registers with its transfer engine only on core_sm's AttachInstance; a
    # legacy runtime does it on receipt, for any peer (act-first).
    act_before_decide: bool = False
    # Several KV-cache groups (sim/groups.py): the worker's retrieve writes the first group's
    # blocks alone, the object's other groups' parts left unread (the hit still reported).
    retrieve_first_group_only: bool = False

    def server_config(self, cfg: WorldConfig) -> ServerConfig:
        return ServerConfig(
            chunk_size=cfg.chunk_size,
            num_slots=cfg.l1_slots,
            slot_bytes=4096,
            lease_ttl=cfg.lease_ttl,
            tombstone_ttl=5.0,
            tombstone_cap=1000,
            abandoned_job_ttl=cfg.abandoned_job_ttl,
            l2_enabled=cfg.l2_enabled,
            l2_probe=cfg.l2_enabled and cfg.l2_probe,
            l2_read_timeout=2.0,
            write_behind=cfg.l2_enabled,
            high_watermark=0.9,
            low_watermark=0.7,
            store_threshold=cfg.store_threshold,
            instance_ttl=self.instance_ttl,
            chain_key=cfg.chain_key,
            ack_first=True,  # as runtime_zmq: the node runs a lookup's work after its ack
        )

    def load_server(self, rank: int, world_size: int, num_servers: int, request_id: str) -> int:
        """The server worker ``rank`` loads a request from: where it stores, by production's
        placement (``core_sm.client_config.server_for_rank``, which the lookups follow too)."""
        return server_for_rank(rank, world_size, num_servers)

    def make_server(self, cfg: WorldConfig) -> LookupServer:
        return self.server_class(self.server_config(cfg))

    def make_lookup_client(self, cfg: WorldConfig) -> LookupClient:
        """The connector's lookup client as core_sm's builder makes it from the world's settings
        (status by WAIT_PREFETCH_STATUS, the lookup bounded by two request timeouts); a profile
        varies it by name (``lookup_timeout``, ``lookup_status_wait``)."""
        config = lookup_client_config(settings_of(cfg, self), num_servers=cfg.num_servers, model_name=MODEL,
                                      world_size=cfg.tp, chunk_size=cfg.chunk_size)
        # results kept a minute: a simulated world lasts about that long
        config = attrs.evolve(config, result_ttl=60.0)
        if self.lookup_timeout is not None:
            config = attrs.evolve(config, lookup_timeout=self.lookup_timeout)
        return self.lookup_client_class(config)

    def make_planner(self, cfg: WorldConfig) -> StepPlanner:
        """The scheduler's machine: the planner MPCacheConnector runs, over this profile's
        lookup client."""
        return self.planner_class(PlannerConfig(cfg.chunk_size, cfg.block_size, lease_ttl=cfg.lease_ttl,
                                                lookup_wait=cfg.lookup_wait, lookup_wait_idle=cfg.lookup_wait_idle,
                                                sync_load_max_tokens=cfg.sync_load_max_tokens,
                                                cpu_engine=cfg.cpu_engine, kv_groups=cfg.kv_groups),
                                  self.make_lookup_client(cfg))

    def make_link(self, config: ServerLinkConfig, start: float) -> ServerLink:
        """A client node's transport to one server: this profile's link and health monitor,
        built at ``start`` from ``config`` (``sim.transport.sim_link_config``)."""
        return self.link_class(config, start, self.health_monitor_class(config.health, start))

    def make_transfer_client(self, cfg: WorldConfig, rank: int, instance_id: int, server: int) -> TransferClient:
        return self.transfer_client_class(TransferClientConfig(
            instance_id=instance_id,
            model_name=MODEL,
            world_size=cfg.tp,
            worker_id=rank,
            chunk_size=cfg.chunk_size,
            object_bytes=cfg.chunk_size * 64,
            engine_driven=cfg.engine_driven,
            server=server,
            op_timeout=transfer_op_timeout(settings_of(cfg, self)),
        ))


# ----------------------------------------------------------------------------------------------
# unknown-none (F1): the #2733-era server answers None for an unknown id and keeps no tombstone;
# the adapter keeps no result cache, so asking again after the answer polls a popped job forever.


class UnknownNoneServer(LookupServer):
    def _status_for_unknown(self, key: RequestKey) -> int | None:
        return None

    def _keeps_tombstones(self) -> bool:
        return False


class NoCacheLookupClient(LookupClient):
    """check() of a finished lookup asks the server again (the adapter did not cache it)."""

    def _keep_result_after_check(self, pending: PendingLookup) -> bool:
        # Only a lookup every server acked and answered is asked again (the old adapter blocked
        # on the ack and dropped a lookup that failed, so those were never re-polled).
        return not all(leg.acked for leg in pending.legs.values())


class NoCachePlanner(StepPlanner):
    """The old adapter's get_num_new_matched_tokens: every match asks the lookup client's
    check(), an answered one too (it kept no result), and a None is "not yet"."""

    _answered_now: str | None = None  # the match that just took the lookup's answer (one check())

    def _on_lookup_answered(self, event: LookupAnswered, now: float, out: list[Any]) -> None:
        super()._on_lookup_answered(event, now, out)
        self._answered_now = event.request_id

    def _on_match(self, event: MatchRequest, now: float, out: list[Any]) -> None:
        answered_now, self._answered_now = self._answered_now == event.request_id, None
        if not answered_now and self.lookups.check(event.request_id) is None:
            out.append(MatchAnswer(event.request_id, None, True))
            return
        super()._on_match(event, now, out)


class UnknownNone(Profile):
    name = "unknown-none"
    failure = "F1"
    description = "server: unknown id -> None, no tombstone; client and adapter: no result cache, no timeout"
    server_class = UnknownNoneServer
    lookup_client_class = NoCacheLookupClient
    planner_class = NoCachePlanner
    lookup_timeout = float("inf")
    # the client asks again after the answer, so in deep queues a waiting request's lease
    # renewal resolves to a stale answer (its hit loads on expired leases, F20) or its status
    # query overtakes the renewal's LOOKUP (F5) before the poll-forever shows
    also = ("F20", "F5")


# ----------------------------------------------------------------------------------------------
# resend-status (F2): the client abandons an unanswered status query after one poll interval
# and sends another; the April server pops the job on its first answer and keeps no tombstone.


class PopOnceServer(LookupServer):
    def _keeps_tombstones(self) -> bool:
        return False


class ResendingLookupClient(LookupClient):
    def _should_resend_status(self, pending: PendingLookup, leg: ServerLeg, now: float) -> bool:
        return True


class ResendStatus(Profile):
    name = "resend-status"
    failure = "F2"
    description = "client resends status queries it stopped waiting for; server pops on first answer"
    server_class = PopOnceServer
    lookup_client_class = ResendingLookupClient


# ----------------------------------------------------------------------------------------------
# overwrite-dup (F4): a duplicate LOOKUP replaces the live job and leases again.


class OverwriteDupServer(LookupServer):
    def _overwrites_duplicate(self, job: PrefetchJob, event: Lookup) -> bool:
        return True

    def _lease_for_lookup(self, owner: RequestKey, key: ObjectKey, num_readers: int, now: float) -> None:
        self.index.lease_read(key, owner, num_readers, now)  # count-only locks: no top-up
        self.index.touch(key)


class OverwriteDup(Profile):
    name = "overwrite-dup"
    failure = "F4"
    description = "server: a duplicate LOOKUP overwrites the job and takes a second set of leases"
    server_class = OverwriteDupServer


# ----------------------------------------------------------------------------------------------
# no-ack-wait (F5): the client queries status without waiting for the LOOKUP ack (#4935 era),
# and the server's handler pool may run the query first.


class NoAckWaitLookupClient(LookupClient):
    def _wait_for_ack(self, pending: PendingLookup, server: int) -> bool:
        return False


class NoAckWait(Profile):
    name = "no-ack-wait"
    failure = "F5"
    description = "client: status query sent with the LOOKUP, not after its ack"
    lookup_client_class = NoAckWaitLookupClient


# ----------------------------------------------------------------------------------------------
# leak-on-abort (F8): a request aborted while its lookup is pending only drops the tracker:
# no FREE, no END_SESSION reaches the servers.


class LeakOnAbortLookupClient(LookupClient):
    def _end_pending_lookup(self, pending: PendingLookup, now: float, out: list[Effect]) -> None:
        pass


class LeakOnAbort(Profile):
    name = "leak-on-abort"
    failure = "F8"
    description = "client: abort while the lookup is pending drops state without FREE/END_SESSION"
    lookup_client_class = LeakOnAbortLookupClient


# ----------------------------------------------------------------------------------------------
# release-all (F9): FREE_LOOKUP_LOCKS releases one count of *whoever* holds each key.


class ReleaseAllServer(LookupServer):
    def _release_for_free_lookup_locks(self, request: RequestKey, keys: Sequence[ObjectKey], now: float) -> int:
        released = 0
        for key in keys:
            owners = [o for o in self.index.owners_of(key) if isinstance(o, RequestKey)]
            owner = request if request in owners else (owners[0] if owners else None)
            if owner is not None:
                released += self.index.release_read(key, owner, 1, ReleaseReason.FREE, now)
        return released


class ReleaseAll(Profile):
    name = "release-all"
    failure = "F9"
    description = "server: FREE_LOOKUP_LOCKS releases every key in range, whoever leased it"
    server_class = ReleaseAllServer
    # the adversary's FREE_LOOKUP_LOCKS releases an honest tenant's leases: the same bug, seen by
    # the tenant oracle first in worlds that run the adversary
    also = ("F22",)


# ----------------------------------------------------------------------------------------------
# silent-errors (F11): a handler that fails sends nothing back.


class SilentErrorsServer(LookupServer):
    def _reply_error(self, out: list[Effect], reply_to: ReplyTo, error: ProtocolError) -> None:
        pass


class SilentErrors(Profile):
    name = "silent-errors"
    failure = "F11"
    description = "server: a request that fails gets no reply at all"
    server_class = SilentErrorsServer


# ----------------------------------------------------------------------------------------------
# no-reaper (F12): abandoned jobs (never queried) are never reaped.


class NoReaperServer(LookupServer):
    def _reaps_abandoned_jobs(self) -> bool:
        return False


class NoReaper(Profile):
    name = "no-reaper"
    failure = "F12"
    description = "server: abandoned prefetch jobs are never reaped"
    server_class = NoReaperServer


# planner-tail-leak (F8): the connector frees only the leases in front of the retrieve, not those
# past the allocated blocks or the request's load cap; they stay leased until the request ends.
class TailLeakPlanner(StepPlanner):
    def unused_lease_ranges(self, hit: int, start: int, end: int) -> list[tuple[int, int]]:
        return [r for r in super().unused_lease_ranges(hit, start, end) if r[0] == 0 and (end <= start or r[1] <= start)]


class PlannerTailLeak(Profile):
    name = "planner-tail-leak"
    failure = "F8"
    description = "planner: leases past the retrieved range (load cap, uncovered tail) are never freed"
    planner_class = TailLeakPlanner


# preempt-reuse: a preempted request, seen again, is answered from its old lookup's hit and
# loads again -- on leases its first load used or its first allocation freed.
class PreemptReusePlanner(StepPlanner):
    def _match_after_allocation(self, tracker: RequestTracker, event: MatchRequest, out: list[Any]) -> None:
        tracker.engine_hit_tokens = event.num_computed_tokens
        loadable = self.loadable_tokens(tracker)
        if loadable > event.num_computed_tokens:
            tokens = loadable - event.num_computed_tokens
            tracker.sync_load = tokens <= self.config.sync_load_max_tokens and self._sync_loads_allowed
            out.append(MatchAnswer(tracker.request_id, tokens, not tracker.sync_load))
        else:
            out.append(MatchAnswer(tracker.request_id, 0, False))

    def _on_blocks(self, event: BlocksAllocated, now: float, out: list[Any]) -> None:
        tracker = self._trackers[event.request_id]
        if tracker.state is RequestState.PREEMPTED and event.num_external_tokens > 0:
            self._on_allocated(event, now, out)
        else:
            super()._on_blocks(event, now, out)


class PreemptReuse(Profile):
    name = "preempt-reuse"
    failure = "F21"
    description = "planner: after preemption the request loads again from its lookup's (spent) leases"
    planner_class = PreemptReusePlanner
    also = ("F20",)  # the reused leases may have expired meanwhile (a deep queue)


# lease-expiry-under-queue (F20, LMCache #4691): the planner neither renews a waiting request's
# read leases nor checks their age before loading, so a request that waited in a deep queue longer
# than the lease TTL loads a hit whose leases are gone (an evicted object: a load error).
class NoRenewalPlanner(StepPlanner):
    def renew_at(self, tracker: RequestTracker) -> float | None:
        return None

    def leases_loadable(self, tracker: RequestTracker, now: float) -> bool:
        return True


class LeaseExpiryUnderQueue(Profile):
    name = "lease-expiry-under-queue"
    failure = "F20"
    description = "planner: a hit's read leases are never renewed while the request waits in a deep queue"
    planner_class = NoRenewalPlanner


# missed-epoch (F13): a restart between two heartbeats goes unnoticed -- the worker does not fail
# what was in flight on the new epoch, and its connection never registers again (not on the new
# epoch, not on the not_registered answers that follow).
class MissedEpochTransferClient(TransferClient):
    def _on_epoch(self, ev: ServerEpoch, now: float, out: list[Effect]) -> None:
        if ev.server == self.config.server:
            self._epoch = ev.epoch


class NoReregisterLink(ServerLink):
    """A legacy transport: it never registers again (the worker's one registration is all), so a
    refusal goes straight to its caller and a refused instance ping, a new epoch, a recovery or a
    failed registration change nothing."""

    def _on_submit(self, ev: Submit, now: float, out: list[Any]) -> None:
        if ev.role is Role.REQUEST and ev.instance is not None:
            ev = attrs.evolve(ev, instance=None)  # nothing to wait for: never parked
        super()._on_submit(ev, now, out)

    def _do_register(self, effect: Register, now: float, out: list[Any]) -> None:
        return None


class MissedEpoch(Profile):
    name = "missed-epoch"
    failure = "F13"
    description = "worker: a server restart between two heartbeats is not noticed; never registers again"
    transfer_client_class = MissedEpochTransferClient
    link_class = NoReregisterLink


# trust-all (F22): the server before ownership -- every request is trusted as if its own peer
# had created what it names, and any caller may clear. The ownership checks compare the event's
# ``peer`` (and Clear's ``admin``), so the one place to turn them all off is where events enter.
class TrustAllServer(LookupServer):
    def handle(self, event: Any, now: float) -> list[Effect]:
        if getattr(event, "peer", None) is not None:
            event = attrs.evolve(event, peer=None)
        if type(event) is Clear:
            event = attrs.evolve(event, admin=True)
        return super().handle(event, now)


class TrustAll(Profile):
    name = "trust-all"
    failure = "F22"
    description = "server: no ownership -- any peer may use another's request ids, transfers, instances; clear needs no admin"
    server_class = TrustAllServer


# idle-reap (F19, LMCache #4715): the server counts only traffic as liveness (an instance
# heartbeat is answered but refreshes nothing), so a live instance idle for instance_ttl is
# reaped; the worker never registers again on not_registered, so its retrieves fail forever.
class TrafficLivenessServer(LookupServer):
    def _on_ping(self, ev: Ping, now: float, out: list[Effect]) -> None:
        inst = self.instances.instances.get(ev.instance_id) if ev.instance_id is not None else None
        if inst is None:
            super()._on_ping(ev, now, out)
            return
        seen = inst.last_seen
        super()._on_ping(ev, now, out)
        inst.last_seen = seen


class IdleReap(Profile):
    name = "idle-reap"
    failure = "F19"
    description = "server: only traffic keeps an instance alive (idle ones reaped); worker: never registers again"
    server_class = TrafficLivenessServer
    link_class = NoReregisterLink


# act-first (F23): the runtime before "decide, then act" -- it registered (and unregistered) an
# instance with its GPU transfer engine on receipt, then asked core_sm, which refused a foreign
# peer FORBIDDEN; the engine's "re-registering replaces" had already put the other peer's
# mapping under the owner's instance, so the owner's next copy ran through it.
def acted_first(event: Any) -> tuple[int, str | None] | None:
    """What the legacy runtime (profile ``act-first``) did with its transfer engine on receipt of
    ``event``, for whichever peer asked, before core_sm decided: ``(instance, peer)`` it registered
    the instance for that peer (replacing any mapping), ``(instance, None)`` it unregistered it;
    None: nothing."""
    t = type(event)
    if t is RegisterInstance and not event.engine_driven and event.peer is not None:
        return event.instance_id, str(event.peer)
    if t is UnregisterInstance:
        return event.instance_id, None
    return None


class ActFirst(Profile):
    name = "act-first"
    failure = "F23"
    also = ("F22",)
    description = "server runtime: registers with its transfer engine before core_sm's ownership check"
    act_before_decide = True


# hma-partial-group (F24, LMCache #2863): with several KV-cache groups the worker's retrieve
# copies only the first (full-attention) group's blocks out of each object, while the hit is
# reported for every layer: vLLM goes on over stale KV in the window groups' layers.
class HmaPartialGroup(Profile):
    name = "hma-partial-group"
    failure = "F24"
    description = "worker: a retrieve writes the first KV-cache group's blocks only, the hit reported for all"
    retrieve_first_group_only = True


# wait-lost (F1): the client trusted the server's WAIT_PREFETCH_STATUS to answer within its wait,
# so the transport set no deadline of its own on it and the lookup had no bound: a wait or its
# reply lost in the network (a drop, a short partition) is never retried and the lookup hangs.
class WaitTrustingLink(ServerLink):
    def _on_submit(self, ev: Submit, now: float, out: list[Any]) -> None:
        if type(getattr(ev.request, "request", None)) is WaitPrefetchStatus:
            ev = attrs.evolve(ev, timeout=math.inf)  # the sim's frame: Outbound(machine, correlation, request)
        super()._on_submit(ev, now, out)


class WaitLost(Profile):
    name = "wait-lost"
    failure = "F1"
    description = "client: a WAIT_PREFETCH_STATUS has no deadline and the lookup no bound; a lost reply hangs it"
    link_class = WaitTrustingLink
    lookup_timeout = math.inf


# no-reregister: a transport that parks a request refused not_registered on a registration of its
# own that it never sends; only that registration would release it (not the worker's own, not its
# deadline), so it waits forever. Caught by the transport oracle (nothing parked after
# quiescence); the instance may also show as never registered again (F19/F13) first.
class ParkForeverLink(ServerLink):
    def _do_register(self, effect: Register, now: float, out: list[Any]) -> None:
        return None

    def _do_resend(self, effect: Resend, now: float, out: list[Any]) -> None:
        return None

    def _do_give_up(self, effect: GiveUp, now: float, out: list[Any]) -> None:
        if type(effect.request) is int and self.parked(effect.request):
            return None
        super()._do_give_up(effect, now, out)

    def _on_timer(self, ev: Any, now: float, out: list[Any]) -> None:
        parked = {uid: self._pending.pop(uid) for uid in self.parked_uids()}
        super()._on_timer(ev, now, out)
        self._pending.update(parked)


class NoReregister(Profile):
    name = "no-reregister"
    failure = "LIVENESS"
    also = ("F19", "F13")
    description = "client link: after not_registered it parks the request forever and never registers again"
    link_class = ParkForeverLink


# placement-mismatch (F2): a worker stores to its rank's server but loads from the server the
# request id picks (spreading loads over servers): a rank whose hit another server answered and
# leased loads it from one that holds none of it.
class PlacementMismatch(Profile):
    name = "placement-mismatch"
    failure = "F2"
    description = "worker: loads from the server the request id picks, not the one its rank stores to"

    def load_server(self, rank: int, world_size: int, num_servers: int, request_id: str) -> int:
        return int(request_id[1:] or 0) % num_servers if request_id[1:].isdigit() else 0


# double-register: the server before re-registrations were made idempotent -- each registration
# replaces the last (the old one dropped, its transfers with it; a new id). The worker's own
# registration and its link's re-registration after a not_registered both land (in the explorer's
# world), and the worker's machine registers again itself too, beside its link, as before the two
# merged (in the simulator's): the second orphans what the first released, and the resends naming
# it are refused not_registered and given up.
class ReplacingRegistrationServer(LookupServer):
    def handle(self, event: Any, now: float) -> list[Effect]:
        if type(event) is RegisterInstance and self.instance_state(event.instance_id) is InstanceState.REGISTERED:
            dropped = super().handle(UnregisterInstance(event.instance_id, peer=event.peer), now)
            # the server's own unregister answers nobody
            effects = [e for e in dropped if not (isinstance(e, (Reply, ErrorReply)) and e.reply_to is None)]
            return effects + super().handle(event, now)
        return super().handle(event, now)


class SecondRegistererTransferClient(TransferClient):
    """The worker's machine before the merge into its link: it also decides re-registration
    itself, on a first or new epoch and on a not_registered answer, beside its link."""

    def _on_epoch(self, ev: ServerEpoch, now: float, out: list[Effect]) -> None:
        old = self._epoch
        super()._on_epoch(ev, now, out)
        if old != ev.epoch and self._healthy:  # the first epoch too: which incarnation took it?
            self._register_again(out)

    def _on_not_registered(self, op: TransferOp, now: float, out: list[Effect]) -> None:
        super()._on_not_registered(op, now, out)
        if self._healthy and self._registration_correlation is None:
            self._register_again(out)

    def _register_again(self, out: list[Effect]) -> None:
        self._counters["registrations"] += 1
        self._registration_correlation = self._send(self.registration_request(), None, out)


class DoubleRegister(Profile):
    name = "double-register"
    failure = "LIVENESS"
    description = "server: a registration replaces the last (new id); the worker and its link both register again"
    server_class = ReplacingRegistrationServer
    transfer_client_class = SecondRegistererTransferClient


def settings_of(cfg: WorldConfig, profile: Profile) -> ConnectorSettings:
    """The connector settings of the simulated world (its heartbeat knobs, production's others)."""
    return ConnectorSettings(request_timeout=cfg.request_timeout, lookup_status_wait=profile.lookup_status_wait,
                             lookup_answer_in_ack=cfg.lookup_answer_in_ack,
                             heartbeat_interval=cfg.heartbeat_interval, heartbeat_timeout=cfg.heartbeat_timeout)


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (Profile(), UnknownNone(), ResendStatus(), OverwriteDup(), NoAckWait(), LeakOnAbort(),
              ReleaseAll(), SilentErrors(), NoReaper(), PlannerTailLeak(), PreemptReuse(), MissedEpoch(),
              TrustAll(), IdleReap(), LeaseExpiryUnderQueue(), ActFirst(), WaitLost(), NoReregister(),
              PlacementMismatch(), DoubleRegister(), HmaPartialGroup())
}

LEGACY = [name for name in PROFILES if name != "default"]


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise SystemExit(f"unknown profile {name!r}; choose from: {', '.join(PROFILES)}") from None


_ = (attrs, Reply)
