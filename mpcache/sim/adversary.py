"""The adversarial client: a node that attacks the other tenants of a shared server.

A world whose scenario has ``WorldConfig.adversary`` set runs one extra node, ``adv0``. It is a
raw protocol client with its own identity (the world fills every request's ``peer`` with the
sending node's name) and no registered instance. From its own RNG stream (derived from the
scenario's ``net_seed``: adding it leaves every other draw of a seed as it was) it sends, through
SimNet like any client:

* other tenants' request ids: status queries, waits, FREE_LOOKUP_LOCKS, END_SESSION and
  duplicate LOOKUPs naming them;
* commits of transfer ids it saw in other tenants' plans (before or after their own commit),
  replayed, or guessed (63-bit random);
* STORE / RETRIEVE / PREPARE_* / REGISTER / UNREGISTER / heartbeats naming other tenants'
  instances, and worker requests for an instance nobody registered; a REGISTER of an instance
  the server reaped, racing its owner's registering again;
* ``clear`` without the admin credential;
* oversized and malformed requests: ``world_size`` 2**40, too many chunks, bad ranks, a
  ``not_after`` in the past or far in the future, a negative timeout;
* replays of honest requests it observed arriving at a server (the simulated network is a shared
  host: it sees what the servers receive and answer);
* lookups of its own (an ``adv-`` request id over a prompt it saw), which may only touch its own
  state.

The oracle (``F22``, "tenant harmed") runs around every adversary event a server handles: the
server's due time-driven work runs first (an extra ``TimerFired``), then the honest tenants'
state is snapshotted -- request-id owners, jobs, tombstones, read leases per owner, transfers and
plans, registered instances, readable objects -- the event is handled, and the snapshot must be
unchanged (an adversary LOOKUP may evict, as any tenant's may: only there may a readable object
go). No object may become readable by an adversary event: it has nothing of its own to store.
An instance id nobody holds may go to the adversary (it raced the owner's first registration),
except one reaped from its honest owner in this incarnation and not given up since: taking that
locks the owner out (hostile finding 4).
"""
from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from mpcache.core_sm.chunks import TokenIds
from mpcache.core_sm.effects import InstanceReaped, Reply
from mpcache.core_sm.messages import (
    SERVER_REQUEST_TYPES,
    CacheKey,
    Clear,
    CommitTransfer,
    EndSession,
    FreeLookupLocks,
    Lookup,
    Ping,
    PrepareRetrieve,
    PrepareStore,
    QueryPrefetchStatus,
    RegisterInstance,
    Retrieve,
    Store,
    TimerFired,
    TransferPlan,
    UnregisterInstance,
    WaitPrefetchStatus,
)
from mpcache.core_sm.server_core import RequestKey
from mpcache.runtime_trio import Address
from mpcache.sim.evolve import evolve
from mpcache.sim.ports import SERVER, ReplyMsg, RequestMsg
from mpcache.sim.scenario import server_name


class ServerView(Protocol):
    """What the adversary reads of a simulated server (``mpcache.sim.server_host.ServerHost``)."""

    index: int
    name: str
    incarnation: int
    node: Any
    up: bool


class AdversaryWorld(Protocol):
    """What the adversary needs of the world it attacks (``mpcache.sim.world.World`` is one):
    written against this, the adversary imports no world (the world makes the adversary)."""

    config: Any
    scenario: Any
    net: Any
    phase: str
    timeline: Any
    trace: Any
    touched: set[str]

    @property
    def servers(self) -> Sequence[ServerView]: ...

    def now(self) -> float: ...

    def violation(self, code: str, node: str, message: str) -> None: ...

    def touch_all_live(self) -> None: ...

ADVERSARY = "adv0"
MACHINE = "adv"
PREFIX = "adv-"  # the adversary's own request ids
TENANT_HARMED = "F22"
# The kinds of attack, drawn uniformly per message.
ATTACKS = (
    "query", "wait", "free", "end", "lookup_foreign", "commit_seen", "commit_guess", "store_foreign",
    "retrieve_foreign", "prepare_foreign", "register_foreign", "unregister_foreign", "ping_foreign",
    "unregistered", "clear", "world_size", "too_many_chunks", "bad_ranks", "not_after", "bad_timeout",
    "replay", "own_lookup",
)


class Adversary:
    def __init__(self, world: AdversaryWorld) -> None:
        self.world = world
        self.rng = random.Random(f"{world.scenario.net_seed}:adversary")
        # what it saw, as (server index, value)
        self.request_ids: deque[tuple[int, str]] = deque(maxlen=64)
        self.lookup_keys: deque[tuple[int, CacheKey]] = deque(maxlen=32)
        self.worker_keys: deque[tuple[int, CacheKey]] = deque(maxlen=32)
        self.instances: deque[tuple[int, int]] = deque(maxlen=32)
        self.transfers: deque[tuple[int, int]] = deque(maxlen=32)
        self.observed: deque[tuple[int, Any]] = deque(maxlen=64)
        self.own_ids: deque[str] = deque(maxlen=16)
        self.reaped: deque[tuple[int, int]] = deque(maxlen=32)  # instances it saw reaped
        # the oracle's: (server name, incarnation, instance id) reaped from an honest owner, until
        # that owner unregisters it
        self.kept: set[tuple[str, int, int]] = set()
        self.correlation = 0
        # request ids the adversary's own LOOKUPs created, per server incarnation
        self.claimed: dict[tuple[str, int], set[RequestKey]] = {}
        self.stats: dict[str, int] = {"adversary_sent": 0, "adversary_refused": 0, "adversary_answered": 0}

    # =========================================================================== attacking
    def start(self, t0: float) -> None:
        self.world.timeline.at(t0 + self.rng.uniform(0.0, 0.05), self._attack)

    def _attack(self) -> None:
        world = self.world
        if world.phase != "safety":
            return  # heal: the adversary stops with the faults
        kind = self.rng.choice(ATTACKS)
        server = self.rng.randrange(world.config.num_servers)
        request = self._build(kind, server)
        if request is not None:
            self.correlation += 1
            world.trace.line(world.now(), ADVERSARY, f"adversary {kind}")
            # Straight onto the network: the world's per-request bookkeeping (lookups in flight,
            # releases sent) is about the honest clients.
            world.net.send(Address(ADVERSARY, MACHINE), Address(server_name(server), SERVER),
                           RequestMsg(server, self.correlation, request))
            self.stats["adversary_sent"] += 1
        world.timeline.after(self.rng.expovariate(1 / 0.02), self._attack)

    def _pick(self, seq: deque[Any]) -> Any:
        return seq[self.rng.randrange(len(seq))] if seq else None

    def _seen(self, seq: deque[tuple[int, Any]], server: int) -> Any:
        """Something seen at ``server`` (an id named there is its owner's there)."""
        here = [v for s, v in seq if s == server]
        return here[self.rng.randrange(len(here))] if here else None

    def _owned(self, server: int, rid: str) -> bool:
        """The id has an owner on that server now (what the adversary saw there): a LOOKUP of it
        is an attack on that owner, not a claim of a name nobody holds (see docs/simulator.md)."""
        host = self.world.servers[server]
        if not host.up or host.node is None:
            return False
        jobs = host.node.machines["server"].jobs
        return any(k.request_id == rid and k.peer != ADVERSARY for k in (*jobs.jobs, *jobs.tombstones))

    def _registered(self, server: int, iid: int) -> bool:
        host = self.world.servers[server]
        return host.up and host.node is not None and iid in host.node.machines["server"].instances.instances

    def _base_key(self) -> CacheKey:
        key = self._pick(self.lookup_keys)
        if key is not None:
            return key[1]  # type: ignore[no-any-return]
        cfg = self.world.config
        from mpcache.sim.profiles import MODEL
        return CacheKey(MODEL, cfg.tp, None, tuple(range(1, cfg.chunk_size + 1)), 0, cfg.chunk_size, PREFIX + "0")

    def _own_id(self) -> str:
        rid = f"{PREFIX}{self.correlation}"
        self.own_ids.append(rid)
        return rid

    def _build(self, kind: str, server: int) -> Any:
        rng, now = self.rng, self.world.now()
        rid = self._seen(self.request_ids, server)
        iid = self._seen(self.instances, server)
        wkey = self._seen(self.worker_keys, server)
        blocks = tuple(rng.randrange(0, 64) for _ in range(rng.randint(1, 4)))
        if kind == "query":
            return QueryPrefetchStatus(rid) if rid is not None else None
        if kind == "wait":
            return WaitPrefetchStatus(rid, rng.choice((0.0, 0.01, 0.5))) if rid is not None else None
        if kind == "free":
            key = self._seen(self.lookup_keys, server)
            return FreeLookupLocks(key) if key is not None else None
        if kind == "end":
            return EndSession(rid) if rid is not None else None
        if kind == "lookup_foreign":
            key = self._seen(self.lookup_keys, server)
            return Lookup(key) if key is not None and self._owned(server, key.request_id) else None
        if kind == "commit_seen":
            tid = self._seen(self.transfers, server)
            return CommitTransfer(tid, rng.random() < 0.7) if tid is not None else None
        if kind == "commit_guess":
            return CommitTransfer(rng.getrandbits(63), rng.random() < 0.7)
        if kind == "store_foreign":
            return Store(wkey, iid, blocks) if wkey is not None and iid is not None else None
        if kind == "retrieve_foreign":
            return Retrieve(wkey, iid, blocks) if wkey is not None and iid is not None else None
        if kind == "prepare_foreign":
            if wkey is None or iid is None:
                return None
            return PrepareStore(wkey, iid) if rng.random() < 0.5 else PrepareRetrieve(wkey, iid)
        if kind == "register_foreign":
            reaped = self._seen(self.reaped, server)
            if reaped is not None and not self._registered(server, reaped) and rng.random() < 0.5:
                iid = reaped  # race the owner's registering again after its reap
            elif iid is None or not self._registered(server, iid):
                return None
            return RegisterInstance(iid, wkey.model_name if wkey else "x", self.world.config.tp, 64)
        if kind == "unregister_foreign":
            return UnregisterInstance(iid) if iid is not None else None
        if kind == "ping_foreign":
            return Ping(iid) if iid is not None else None
        if kind == "unregistered":
            key = wkey if wkey is not None else attrs.evolve(self._base_key(), worker_id=0)
            return Store(key, 10**9 + rng.randrange(100), blocks, not_after=now + 1.0)
        if kind == "clear":
            return Clear(rng.random() < 0.5)  # admin stays False: the adversary has no credential
        if kind == "world_size":
            return Lookup(attrs.evolve(self._base_key(), world_size=2**40, request_id=self._own_id()))
        if kind == "too_many_chunks":
            C = self.world.config.chunk_size
            n = (1 << 16) + 1  # ServerConfig.max_chunks_per_request + 1
            # eight random tokens repeated to n * C, packed once (a million-int tuple took ms)
            eight = TokenIds.from_ints([rng.randrange(1, 50000) for _ in range(8)]).packed
            reps, rest = divmod(n * C, 8)
            packed = eight * reps
            if rest:  # (a whole number of eights with a power-of-two chunk size: no second copy)
                packed += eight[: 4 * rest]
            tokens = TokenIds.from_packed(packed)
            return Lookup(CacheKey(self._base_key().model_name, self.world.config.tp, None, tokens, 0,
                                   n * C, self._own_id()))
        if kind == "bad_ranks":
            ranks = rng.choice(((-1,), (0, 0), (self.world.config.tp + 3,), ()))
            return Lookup(attrs.evolve(self._base_key(), request_id=self._own_id()), ranks=ranks)
        if kind == "not_after":
            if wkey is None or iid is None:
                return None
            when = rng.choice((now - 5.0, now + 1e9, float("inf")))
            return Retrieve(wkey, iid, blocks, not_after=when) if rng.random() < 0.5 else \
                Store(wkey, iid, blocks, not_after=when)
        if kind == "bad_timeout":
            return WaitPrefetchStatus(rid if rid is not None else PREFIX + "x", rng.choice((-1.0, float("nan"))))
        if kind == "replay":
            old = self._seen(self.observed, server)
            if type(old) is Lookup and not self._owned(server, old.key.request_id):
                return None
            if type(old) is RegisterInstance and not self._registered(server, old.instance_id):
                return None
            return old
        if kind == "own_lookup":
            key = attrs.evolve(self._base_key(), request_id=self._own_id())
            return Lookup(key) if rng.random() < 0.6 else EndSession(self._pick(self.own_ids))
        raise AssertionError(kind)

    # =========================================================================== observing
    def observe(self, server: int, event: Any, effects: list[Any]) -> None:
        """An honest event ``server`` handled (and its effects): learn ids, keys, plans."""
        self._note_reaps(server, effects)
        t = type(event)
        if t is UnregisterInstance and any(type(e) is Reply and e.reply_to == event.reply_to for e in effects):
            host = self.world.servers[server]
            self.kept.discard((host.name, host.incarnation, event.instance_id))  # its owner gave it up
        if t is Lookup:
            self.lookup_keys.append((server, event.key))
            self.request_ids.append((server, event.key.request_id))
        elif t in (Store, Retrieve, PrepareStore, PrepareRetrieve):
            self.worker_keys.append((server, event.key))
            self.instances.append((server, event.instance_id))
        elif t is CommitTransfer:
            self.transfers.append((server, event.transfer_id))
        elif t is RegisterInstance:
            self.instances.append((server, event.instance_id))
        if t is Clear or t not in SERVER_REQUEST_TYPES or getattr(event, "reply_to", None) is None:
            return  # operator clears carry the credential; internal events are no requests
        self.observed.append((server, evolve(event, reply_to=None)))
        for effect in effects:
            if type(effect) is Reply and type(effect.result) is TransferPlan:
                self.transfers.append((server, effect.result.transfer_id))

    def _note_reaps(self, server: int, effects: list[Any]) -> None:
        host = self.world.servers[server]
        for effect in effects:
            if type(effect) is InstanceReaped:
                self.reaped.append((server, effect.instance_id))
                self.kept.add((host.name, host.incarnation, effect.instance_id))

    def on_reply(self, msg: ReplyMsg) -> None:
        if msg.error is None:
            self.stats["adversary_answered"] += 1
        else:
            self.stats["adversary_refused"] += 1
            name = f"refused {msg.error.kind.value}"
            self.stats[name] = self.stats.get(name, 0) + 1

    # =========================================================================== the oracle
    @staticmethod
    def sent(event: Any) -> bool:
        via = getattr(event, "reply_to", None)
        return getattr(via, "node", None) == ADVERSARY

    def judge(self, server: Any, host: ServerView, event: Any, now: float) -> list[Any]:
        """Handle an adversary event on ``server`` and check that no honest tenant's state moved."""
        effects: list[Any] = server.handle(TimerFired(), now)
        self._note_reaps(host.index, effects)
        claimed = self.claimed.setdefault((host.name, host.incarnation), set())
        before = honest_state(server, claimed)
        effects += server.handle(event, now)
        if server.deferred_work:  # an acknowledged lookup's work belongs inside the window too
            effects += server.run_deferred()
        after = honest_state(server, claimed)
        # The adversary's requests are keyed by its own peer, so nothing it creates is a
        # tenant's. Only a server that ignores peers (trust-all) files them under a tenant's key:
        # a job it so creates is its own state from now on (its honest namesake, coming later,
        # shares it: a fault that hit it, so the leak and miss oracles do not judge it).
        for key in after["jobs"].keys() - before["jobs"].keys():
            claimed.add(key)
            self.world.touched.add(key.request_id)
        for iid in after["instances"].keys() - before["instances"].keys():
            if after["instances"][iid][0] != ADVERSARY:
                continue
            if (host.name, host.incarnation, iid) in self.kept:  # its owner is locked out
                self._harm(host, event, "instances", f"instance {iid} reaped from its owner",
                           f"instance {iid} registered by {ADVERSARY}")
                continue
            before["instances"][iid] = after["instances"][iid]  # claimed the same way (a race with its owner)
            self.world.touch_all_live()
        after = honest_state(server, claimed)
        for iid in after["instances"].keys() - before["instances"].keys():
            if after["instances"][iid][0] == ADVERSARY:
                before["instances"][iid] = after["instances"][iid]
        may_evict = type(event) is Lookup
        for part in before:
            old, new = before[part], after[part]
            if part == "readable" and may_evict:
                old, new = frozenset(), new - old
            if old != new:
                self._harm(host, event, part, old, new)
        return effects

    def _harm(self, host: ServerView, event: Any, part: str, old: Any, new: Any) -> None:
        from mpcache.sim.trace import short
        if isinstance(old, dict) and isinstance(new, dict):
            changed = sorted((k for k in old.keys() | new.keys() if old.get(k) != new.get(k)), key=repr)[:3]
            detail = "; ".join(f"{k!r}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
        else:
            detail = f"{len(old - new)} gone, {len(new - old)} new" if isinstance(old, frozenset) else f"{old} -> {new}"
        self.world.violation(TENANT_HARMED, host.name, f"adversary request {short(event, 120)} changed the honest "
                             f"tenants' {part}: {detail}")


def honest_state(server: Any, claimed: set[RequestKey]) -> dict[str, Any]:
    """What belongs to the honest tenants on one server, as comparable values. The adversary
    registers no instance, so every instance, transfer and plan is an honest tenant's; a request
    (peer, request id) is a tenant's unless the adversary sent it."""
    def _honest(key: Any) -> bool:
        return not (isinstance(key, RequestKey) and (key.peer == ADVERSARY or key.request_id.startswith(PREFIX)
                                                     or key in claimed))

    jobs = server.jobs
    index = server.index
    return {
        "request ids": {k: n for k, n in jobs.repeats.items() if _honest(k)},
        "jobs": {k: (j.serial, j.hits, frozenset(j.freed_chunks or ()), j.peer)
                 for k, j in jobs.jobs.items() if _honest(k)},
        "tombstones": {rid: v for rid, v in jobs.tombstones.items() if _honest(rid)},
        "leases": {o: n for o, n in index.leases_by_owner().items() if _honest(o)},
        "transfers": {tid: (t.kind, t.request_id, t.instance_id, t.peer, t.deadline)
                      for tid, t in server.transfers.transfers.items()},
        "instances": {iid: (i.peer, i.registration) for iid, i in server.instances.instances.items()},
        "readable": frozenset(k for k in index.objects() if index.is_readable(k)),
    }
