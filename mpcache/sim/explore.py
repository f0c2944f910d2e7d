"""``mpcache-sim explore``: every interleaving of a small world, over the very core_sm machines.

Contract:

* **Actors** are the production machines (or a legacy profile's subclasses of them): one
  ``LookupServer`` per server, one ``LookupClient`` per engine (the scheduler side of the
  connector) and, per engine and server, the ``ServerLink`` (with its ``HealthMonitor``) that
  production's client and the simulator's nodes run, all built from the world's connector
  settings by ``core_sm/client_config.py`` (the link as ``sim/transport.py`` builds it). In a worker
  world each engine's ``TransferClient`` too (its registration, pings and ``ops`` retrieves, the
  server's copies done at once); in a planner world the scheduler is the connector's
  ``StepPlanner`` over the lookup client, driven by vLLM's calls (match, allocate + plan, preempt,
  finish), its planned retrieves run by the worker where there is one. The server's runtime is
  the explorer's: it answers ``AttachInstance`` at once and keeps what its transfer engine holds
  (which peer's registration of each instance: ``AttachInstance`` opens it, ``DetachInstance``
  and a reap close it), and runs a ``StartTransfer``'s copy at once; with two KV-cache groups
  (``kv_window``) that copy writes each group's blocks of the engine as production's worker
  splits them (``sim/groups.py``'s ``group_copies``, the random simulator's).
* **Network**: a bag (multiset) of frames in flight, ``Frame(kind, engine, server, corr,
  incarnation, body)``, ``corr`` the link's uid. The client's ``SendRequest`` is submitted to its
  link, whose ``Transmit`` puts the frame in the bag. A request frame delivered to server s becomes
  the request with ``reply_to=("sched<e>", corr, incarnation)`` and ``peer="sched<e>"``; the
  server's ``Reply`` / ``ErrorReply`` become reply frames, fed to the link, whose ``Completed`` /
  ``Failed`` (a reply, or its own verdict: a request's deadline passed) reach the client as
  ``ReplyReceived`` / ``RequestFailed``. Heartbeats run every ``heartbeat_interval`` until the
  world's ``horizon`` (periodic timers would make the space infinite); by default the first is
  beyond it (not modelled). A deadline that is never due (infinite) is no deadline.
* **Actions** of a state, in a fixed order (the search is deterministic): deliver any frame;
  drop or duplicate one (while ``faults`` lasts); advance the clock to the earliest deadline of
  any machine and fire what is due (while frames are in flight this is a slow network and costs
  a fault); the next step of each request's script (``submit``, ``check`` once the client
  answers, ``cleanup``, ``end``); abort (``EndRequest``) or cancel (``Cleanup``) a request
  whose lookup is pending (while ``aborts`` lasts); crash + restart a server (while ``restarts`` lasts: a fresh machine, frames to the old
  incarnation are lost, each client is fed ``ServerEpoch``); crash an engine (while ``crashes``
  lasts: its requests end unanswered, its frames are lost, the servers keep what it held until
  their TTLs reap it); an adversarial tenant's request (while ``attacks`` lasts): FREE or
  END_SESSION naming a request id it saw, or REGISTER_INSTANCE of a worker's registered instance.
* **World state**: the machines are shared between a state and its successors and copied only
  when an action touches them (copy on write, by ``explore_state.clone``); a server, a lookup
  client and a link (with its monitor) are kept as their ``state_values()`` instead
  (``explore_state.Held``, with the machine's next deadline and counters), and restored in place
  (``restore(values)``) into the one machine the explorer keeps per slot before a step or a read
  (a copy is mostly wiring: bound tables and routes); a machine's step is
  remembered per machine object and events (``Explorer._step``: the same step from the same
  machine, by another interleaving, takes the machine made the first time); ``Explorer.fingerprint``
  hashes a canonical snapshot of each machine (cached per machine object while it lives, written
  by marshal) plus the frame bag and the oracles' own bookkeeping. During a search the collector
  runs on the young generation only, after each expanded state (the copies made for states
  already seen are garbage then; the stored states are not walked again). Time is kept absolute
  (sound: two different states never merge; finite here because the clock only moves to
  deadlines). **Symmetry**: engines are relabelled in the sorted order of
  their label-free signature (their client, script and frames) before the fingerprint is taken.
* **Oracles**: the simulator's own judgements, imported from ``sim/checks/`` (one module per oracle) (F11 reply
  accounting, core_sm invariants, bytes accounting, F4 duplicate leases, F9 over-release, F5 status
  before lookup, F2 lost hit, F8 leases after a clean end, F12/F8 drained after every TTL; the
  planner's F8 at allocation, F21, F20 and F2 placement on each planned retrieve; a resend refused
  not_registered and a request parked at quiescence, LIVENESS; F23 on each copy, which must run
  through the registration its instance's owner made; F24 after a retrieve's copy of several
  KV-cache groups, on the blocks vLLM reads to resume), plus the
  table-violation and internal-error counters of every machine, **deadlock** (no enabled action
  while a script is unfinished) and **bounded liveness**: a lookup still unresolved
  ``liveness_bound`` virtual seconds after the last fault is F1; one resolved by the client's
  timeout on a path with no fault is ``LIVENESS``.
* **Coverage**: every row of every table of the explored machines, reached or not.
* **Tapes**: a counterexample is saved as JSON (world, profile, actions, and ``sim_world``: the
  same counterexample as the choices of a scripted ``sim.World``, see "tapes in sim.World"
  below); ``replay_world_tape`` runs it in the ordinary simulated world with its oracles,
  ``replay_tape`` again on the explorer's fresh machines, each printing one line per handled
  event in the simulator's timeline format, and reports the violation it reproduces.

BFS gives shortest counterexamples; ``dfs=True`` explores depth first.
"""
from __future__ import annotations

import copy
import gc
import hashlib
import json
import marshal
import math
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from mpcache.core_sm.client_config import ConnectorSettings, lookup_client_config
from mpcache.core_sm.effects import (
    AttachInstance,
    DetachInstance,
    ErrorReply,
    InstanceReaped,
    Reply,
    SendRequest,
    StartTransfer,
)
from mpcache.core_sm.errors import ErrorKind
from mpcache.core_sm.health import TABLES as HEALTH_TABLES
from mpcache.core_sm.health import RESENDABLE_AFTER_NOT_REGISTERED, HealthMonitor, resend_of
from mpcache.core_sm.lookup_client import TABLES as CLIENT_TABLES
from mpcache.core_sm.lookup_client import LookupClient, LookupClientConfig, LookupState
from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.kv_groups import GroupKind, KVGroup, first_live_token
from mpcache.core_sm.messages import (
    Cleanup,
    EndRequest,
    EndSession,
    FreeLookupLocks,
    InstanceAttached,
    Lookup,
    Ping,
    QueryPrefetchStatus,
    RegisterInstance,
    ReplyReceived,
    RequestFailed,
    ServerEpoch,
    ServerHealth,
    SubmitLookup,
    SubmitRetrieve,
    TimerFired,
    TransferFinished,
    TransferKind,
    UnregisterInstance,
    WaitPrefetchStatus,
)
from mpcache.core_sm.planner import TABLE as PLANNER_TABLE
from mpcache.core_sm.planner import BlocksAllocated, MatchAnswer, MatchRequest, PlannerConfig, RequestFinished, StepPlan, StepPlanner, StepScheduled
from mpcache.core_sm.server import TABLES as SERVER_TABLES
from mpcache.core_sm.server import LookupServer, ServerConfig
from mpcache.core_sm.server_core import RequestKey
from mpcache.core_sm.server_instances import InstanceState
from mpcache.core_sm.server_link import Completed, Failed, Heartbeat, InstancePing, Role, ServerLink, Submit, Transmit
from mpcache.core_sm.transfer_client import TABLES as TRANSFER_TABLES
from mpcache.core_sm.transfer_client import TransferClient, TransferClientConfig
from mpcache.core_sm.server_link import Reply as LinkReply
from mpcache.sim import checks
from mpcache.sim.adversary import ADVERSARY, TENANT_HARMED, honest_state
from mpcache.sim.transport import Outbound, sim_link_config
from mpcache.sim.explore_state import (Held, clone, deep_size, dispatchers, dispatchers_of, next_deadline, restorable,
                                       snapshot)
from mpcache.sim.groups import group_copies
from mpcache.sim.oracles import Violation
from mpcache.sim.profiles import Profile, acted_first
from mpcache.sim.trace import short

CHUNK = 16
PROMPT = tuple(range(2 * CHUNK))  # every request asks for the same two chunks (shared objects)
SCRIPT = ("submit", "check", "cleanup", "end")
PLANNER_STEPS = ("match", "alloc", "preempt", "finish")  # a planner world's script steps
BLOCKS = (0, 1)  # the blocks vLLM allocates a request: the whole prompt (block size = chunk size)
ATTACKS = ("free", "end")  # what the adversary sends naming a request id it saw
# and naming a worker's instance it saw registered: a REGISTER_INSTANCE of it (core_sm refuses it)
INSTANCE_ATTACKS = ("register",)
NULL_BLOCK = 0  # vLLM's null block: what a window group's table holds for the blocks it dropped
ROUTING = next(iter(SERVER_TABLES))
BY_VALUES_CAP = 50_000  # stored machines' snapshots and steps kept by their values (Explorer._snap, _step_held), at most
TAPE_FORMAT = "mpcache-explore-tape/2"  # /1 had no ``sim_world``  # the server's routing table (every event passes it)


@attrs.frozen
class XWorld:
    """A small world: what is explored, and the bounds."""

    name: str = "custom"
    engines: int = 1
    servers: int = 1
    requests: int = 1  # per engine
    faults: int = 0  # drops + duplicates + slow frames, in total
    restarts: int = 0  # server crash + restart, in total
    aborts: int = 0  # requests aborted while their lookup is pending, in total
    crashes: int = 0  # engine crashes, in total (its requests end unanswered, its frames are lost)
    # requests of an adversarial tenant (sim/adversary.py's peer) naming an honest request id it
    # saw: FREE_LOOKUP_LOCKS or END_SESSION, in total
    attacks: int = 0
    # each engine also runs one worker: the connector's TransferClient, which registers its engine
    # instance with the server through a link of its own (one server; restarts only while a
    # heartbeat is still due before the horizon, so every restart can be noticed)
    workers: bool = False
    instance_ttl: float | None = None  # the server reaps an instance silent this long (None: never)
    # worker ops in total: a worker retrieves the prompt's first chunk (the server runs the copy
    # at once, as sim/world.py does), refused not_registered where a restart left it unknown
    ops: int = 0
    # each engine's scheduler is the connector's StepPlanner (over its LookupClient), driven in
    # vLLM's call order by the planner script: match (until answered), allocate and plan (one
    # scheduler step), (preempt, match, allocate and plan,) finish
    planner: bool = False
    preempt: bool = False  # the planner script preempts the request after its plan and resumes it
    load_cap: int | None = None  # the request's max_load_tokens (vLLM's kv_transfer_params cap)
    # a second KV-cache group (vLLM's hybrid KV-cache manager), a sliding window of this many
    # tokens beside the full-attention one, on a CPU engine (0: one full-attention group). A planner
    # world with workers: the planner keys and plans both groups, the copy a retrieve's
    # StartTransfer stands for writes each group's blocks (``sim/groups.py``), judged by F24
    kv_window: int = 0
    lease_renewals: int = 1  # the planner's max_lease_renewals (production's 16 only repeats the first)
    stored: int = 1  # chunks of the prompt each server holds in L1 at the start (hits)
    # times each request's script asks check(), or in a planner world matches (vLLM asks again on a
    # reschedule: a request that waits for blocks is matched at every step)
    checks: int = 1
    max_jobs: int = 100_000  # the server's cap on live prefetch jobs (beyond: TOO_LARGE)
    liveness_bound: float = 0.5  # virtual seconds after the last fault a lookup may stay unresolved
    # The connector's settings (core_sm/client_config.py builds the lookup client and every
    # ServerLink from them, as for the simulator): status by WAIT_PREFETCH_STATUS (production's
    # default) or by polling; each request's own timeout (the lookup is bounded by two of them);
    # heartbeats every heartbeat_interval (beyond the horizon: not modelled).
    wait: bool = False
    request_timeout: float = 0.05
    heartbeat_interval: float = 100.0
    heartbeat_timeout: float = 250.0
    answer_in_ack: bool = False  # the connector's lookup_answer_in_ack: a hit's count in the LOOKUP's ack
    horizon: float = 10.0  # the health monitor's timers (heartbeats) run until then (virtual seconds)
    max_depth: int = 80
    max_states: int = 500_000
    symmetry: bool = True

    def script(self) -> tuple[str, ...]:
        if self.planner:
            again = ("preempt", "match", "alloc") if self.preempt else ()
            return ("match",) * self.checks + ("alloc",) + again + ("finish",)
        return ("submit",) + ("check",) * self.checks + ("cleanup", "end")


# The connector's lookup_answer_in_ack on (production's default in the connector): the LOOKUP's
# ack carries the hit count, the client asks no status query. Worlds of their own, beside the
# default ones (which keep the status query's path explored): the first is in ``ci``.
ONE_TRIP: list[XWorld] = [
    # ci-1e1s-faults's world: a drop, duplicate or slow frame and a server restart
    XWorld("ci-1e1s-one-trip", engines=1, servers=1, requests=1, faults=1, restarts=1, answer_in_ack=True),
    XWorld("one-trip-2e1s", engines=2, servers=1, requests=1, answer_in_ack=True),
    XWorld("one-trip-1e1s-abort", engines=1, servers=1, requests=1, aborts=1, crashes=1, answer_in_ack=True),
    XWorld("one-trip-1e2s-faults", engines=1, servers=2, requests=1, faults=1, answer_in_ack=True),
    XWorld("one-trip-1e1s-planner", engines=1, servers=1, requests=1, planner=True, preempt=True, answer_in_ack=True),
]

WORLDS: dict[str, list[XWorld]] = {
    # what `make test` explores completely (tests/sim/test_explore.py)
    "ci": [XWorld("ci-2e1s", engines=2, servers=1, requests=1),
           XWorld("ci-1e1s-faults", engines=1, servers=1, requests=1, faults=1, restarts=1),
           XWorld("ci-1e1s-abort", engines=1, servers=1, requests=1, aborts=1, crashes=1),
           XWorld("ci-1e2s", engines=1, servers=2, requests=1),
           # status by WAIT_PREFETCH_STATUS (production's default), one drop/duplicate/slow frame
           XWorld("ci-1e1s-wait", engines=1, servers=1, requests=1, faults=1, wait=True),
           # heartbeats every 0.2 s for the first 0.3 s and a restart: a 100 s timeout, so a heartbeat
           # the horizon stopped is no dead server, but one lost to the restart times it out
           XWorld("ci-1e1s-heartbeat", engines=1, servers=1, requests=1, restarts=1, heartbeat_interval=0.2,
                  heartbeat_timeout=100.0, horizon=0.3),
           # one worker (no request: with one, 8,700 states) registers its instance and pings it; the
           # server reaps an instance silent 0.3 s
           XWorld("ci-1e1s-worker", engines=1, servers=1, requests=0, workers=True, heartbeat_interval=0.2,
                  heartbeat_timeout=100.0, horizon=0.5, instance_ttl=0.3),
           # an adversarial tenant frees or ends one request id it saw (F22: nothing of the honest moves)
           XWorld("ci-1e1s-adversary", engines=1, servers=1, requests=1, attacks=1),
           # the connector's planner drives the lookup: match, allocate and plan, preempt, match
           # again, allocate and plan, finish; its lease renewal (one) as the clock moves
           XWorld("ci-1e1s-planner", engines=1, servers=1, requests=1, planner=True, preempt=True),
           ONE_TRIP[0]],
    "tiny": [XWorld("tiny", engines=1, servers=1, requests=1)],
    "one-trip": ONE_TRIP,
    # the planner's retrieve run by the engine's worker (registered, its copy done by the server)
    "planner": [XWorld("planner-worker", engines=1, servers=1, requests=1, planner=True, workers=True)],
    "medium": [XWorld("medium", engines=2, servers=1, requests=1, restarts=1)],
    "large": [XWorld("large", engines=3, servers=2, requests=1, faults=2, restarts=1)],
}

# The world a legacy profile is explored in: the smallest that shows its bug.
PROFILE_WORLDS: dict[str, XWorld] = {
    # the request waits for blocks, so vLLM matches it again at the next step: the old adapter asks
    # the lookup client again, which polls the popped job forever
    "unknown-none": XWorld("unknown-none", planner=True, checks=2, liveness_bound=0.1, max_depth=200),
    "resend-status": XWorld("resend-status", faults=1),
    "overwrite-dup": XWorld("overwrite-dup", faults=1),
    "no-ack-wait": XWorld("no-ack-wait", faults=1),
    "leak-on-abort": XWorld("leak-on-abort", aborts=1),
    # two engines' planners hit the same two chunks, each loading only the first (its load cap):
    # each frees the second's leases at allocation, and the legacy server releases the other
    # engine's lease when it finds its own already gone
    "release-all": XWorld("release-all", engines=2, planner=True, stored=2, load_cap=CHUNK, lease_renewals=0),
    # a full job table refuses the second engine's LOOKUP: the refusal must reach it
    "silent-errors": XWorld("silent-errors", engines=2, max_jobs=1),
    "no-reaper": XWorld("no-reaper", aborts=1),
    # a WAIT_PREFETCH_STATUS (production's status query) lost or slow: only the link's deadline
    # on it bounds the lookup
    "wait-lost": XWorld("wait-lost", faults=1, wait=True),
    # a worker registered, the server restarts while heartbeats still run: only the epoch the
    # heartbeat brings or the refused instance ping makes the worker register again
    "missed-epoch": XWorld("missed-epoch", requests=0, workers=True, restarts=1, heartbeat_interval=0.2,
                           heartbeat_timeout=100.0, horizon=0.5),
    # a registered worker pings every 0.2 s; the server reaps an instance silent for 0.3 s
    "idle-reap": XWorld("idle-reap", requests=0, workers=True, heartbeat_interval=0.2, heartbeat_timeout=100.0,
                        horizon=0.5, instance_ttl=0.3),
    # another tenant frees the request id it saw: only ownership keeps the leases
    "trust-all": XWorld("trust-all", attacks=1),
    # the planner's worlds. A whole-prompt hit loaded only up to the request's load cap: the
    # leases past it must be freed at allocation (F8)
    "planner-tail-leak": XWorld("planner-tail-leak", planner=True, stored=2, load_cap=CHUNK),
    # preempted after its plan and resumed: the one lookup's leases are spent (F21)
    "preempt-reuse": XWorld("preempt-reuse", planner=True, preempt=True),
    # the request waits (the clock moves to the servers' lease expiry) between its answered
    # match and its allocation: the planner must renew or give the hit up (F20)
    "lease-expiry-under-queue": XWorld("lease-expiry-under-queue", planner=True),
    # two servers, one rank each: each rank loads from the server that leased its part (F2); no
    # renewal (with one, the renewing lookup to both servers interleaves into thousands of states)
    "placement-mismatch": XWorld("placement-mismatch", planner=True, servers=2, lease_renewals=0),
    # a worker's retrieve overtakes its registration (no request, no heartbeat, no fault): refused
    # not_registered, the link must park it, register again and resend it once (no-reregister:
    # parked forever); with a server whose registration replaces the last, the worker's own
    # registration and its link's re-registration both land and the second orphans the resend
    # (double-register)
    "no-reregister": XWorld("no-reregister", requests=0, workers=True, ops=1),
    "double-register": XWorld("double-register", requests=0, workers=True, ops=1),
    # a model with two KV-cache groups (full attention, a one-chunk sliding window): the planner's
    # retrieve of the one-chunk hit, run by the worker, must write both groups' blocks (F24); no
    # lease renewal (not needed: 312 states for production instead of 658)
    "hma-partial-group": XWorld("hma-partial-group", planner=True, workers=True, kv_window=CHUNK, lease_renewals=0),
    # a registered worker and its retrieve; an adversarial tenant registers the worker's instance
    # in its own name (core_sm refuses it): the copy must still run through the owner's
    # registration (F23)
    "act-first": XWorld("act-first", requests=0, workers=True, ops=1, attacks=1),
}


@attrs.frozen
class Frame:
    kind: str  # "req" | "rep"
    engine: int
    server: int
    corr: int
    incarnation: int
    body: Any
    about: tuple[str, str | None] = ("", None)  # a reply: its request's type and request id
    node: int = 0  # the engine's node: 0 its scheduler (lookup client), 1 its worker (transfer client)


@attrs.frozen
class Check:
    """vLLM's ``check()`` of a request's lookup, as a step of the lookup client (``Explorer._step``)."""

    request_id: str


@attrs.define
class ServerBook:
    """What the oracles remember about one server incarnation (copied with the server)."""

    # reply_to -> (request type, request id) of each request handled and not yet answered
    awaiting: dict[Any, tuple[str, str | None]] = attrs.Factory(dict)
    lookups: frozenset[str] = frozenset()  # request ids whose LOOKUP it handled (F5)
    last_session: dict[str, str] = attrs.Factory(dict)  # request id -> "lookup" / "end"

    def copy(self) -> ServerBook:
        return ServerBook(dict(self.awaiting), self.lookups, dict(self.last_session))


@attrs.define
class XState:
    now: float
    servers: list[Any]
    clients: list[Any]
    links: list[Any]  # [(node * engines + engine) * servers + server] -> that node's ServerLink to that server
    books: list[ServerBook]
    frames: list[Frame]
    scripts: list[tuple[int, ...]]  # [engine] -> per request, index into the script (len: done)
    incarnation: list[int]
    released: frozenset[tuple[str, int]]  # (request id, server) a FREE / END_SESSION was sent to
    hits: tuple[tuple[tuple[str, int], int], ...]  # (request id, server) -> hit chunks delivered (F2)
    faults: int
    restarts: int
    aborts: int
    crashes: int = 0
    attacks: int = 0
    workers: list[Any] = attrs.Factory(list)  # [engine] -> its worker's TransferClient (workers worlds)
    seen: tuple[tuple[tuple[int, int], float], ...] = ()  # (server, instance) -> its last ping handled
    reaped: tuple[tuple[tuple[int, int], float], ...] = ()  # (server, instance) -> when it was reaped
    clean: bool = True  # no drop, duplicate or restart on the path so far
    timely: bool = True  # no slow frame on the path so far
    last_fault: float = 0.0
    submitted: tuple[tuple[str, float], ...] = ()  # request id -> when its lookup was submitted
    # planner worlds: request id -> the tokens its last answered match said would be loaded
    matched: tuple[tuple[str, int], ...] = ()
    loads: tuple[tuple[str, int], ...] = ()  # request id -> retrieves planned for it (F21)
    # request id -> when its hit's leases were due to expire when last seen held (F20), and the
    # servers' incarnations then (a restart takes leases: no expiry)
    lease_seen: tuple[tuple[str, float, tuple[int, ...]], ...] = ()
    ops: int = 0
    # (engine, server, link uid) -> (the registration a resend names, that server's incarnation)
    resent: tuple[tuple[tuple[int, int, int], tuple[int, int]], ...] = ()
    # (server, instance) -> the peer whose registration the server's transfer engine holds for it
    # (the runtime's side of a registration: AttachInstance opens it, DetachInstance and a reap
    # close it; a restart loses them all)
    mappings: tuple[tuple[tuple[int, int], str], ...] = ()
    # (engine, block id) -> what a copy wrote there: (chunk, KV-cache group, block of the chunk)
    kv: tuple[tuple[tuple[int, int], tuple[int, int, int]], ...] = ()
    owned: set[tuple[str, int]] = attrs.Factory(set)  # machines copied in this transition

    def child(self) -> XState:
        return XState(self.now, list(self.servers), list(self.clients), list(self.links), list(self.books),
                      list(self.frames),
                      list(self.scripts), list(self.incarnation), self.released, self.hits, self.faults,
                      self.restarts, self.aborts, self.crashes, self.attacks, list(self.workers), self.seen,
                      self.reaped, self.clean, self.timely, self.last_fault, self.submitted, self.matched,
                      self.loads, self.lease_seen, self.ops, self.resent, self.mappings, self.kv)


@attrs.define
class Node:
    """One explored state in the search: its parent and the action that led here (the path)."""

    state: XState
    depth: int
    parent: Node | None
    action: tuple[str, Any] | None

    def path(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        node: Node | None = self
        while node is not None and node.action is not None:
            out.append(node.action)
            node = node.parent
        return out[::-1]


class Explorer:
    def __init__(self, world: XWorld, profile: Any = None, keep_values: bool = True) -> None:
        """``keep_values``: a state keeps a machine that has ``state_values()`` as its values,
        restored in place when touched (off: every machine copied, as a profile's subclass is)."""
        self.world = world
        self.keep_values = keep_values
        self.profile_name: str = getattr(profile, "name", "default")
        self.server_class: type[LookupServer] = getattr(profile, "server_class", LookupServer)
        self.client_class: type[LookupClient] = getattr(profile, "lookup_client_class", LookupClient)
        self.link_class: type[ServerLink] = getattr(profile, "link_class", ServerLink)
        self.worker_class: type[TransferClient] = getattr(profile, "transfer_client_class", TransferClient)
        self.nodes = 2 if world.workers else 1
        if world.workers and world.servers != 1:
            raise ValueError("a world with workers has one server")
        self.monitor_class: type[HealthMonitor] = getattr(profile, "health_monitor_class", HealthMonitor)
        self.planner_class: type[StepPlanner] = getattr(profile, "planner_class", StepPlanner)
        # the engine's KV-cache groups (() : one full-attention group, the plain path)
        self.groups: tuple[KVGroup, ...] = ()
        if world.kv_window:
            if not (world.planner and world.workers):
                raise ValueError("a world with a second KV-cache group runs the planner and a worker")
            self.groups = (KVGroup(GroupKind.FULL, CHUNK, name="full"),
                           KVGroup(GroupKind.SLIDING_WINDOW, CHUNK, window=world.kv_window, name="window"))
        self.profile: Any = profile if profile is not None else Profile()
        timeout = getattr(profile, "lookup_timeout", None)
        self.script = world.script()
        # The production machines must never count a table violation or an internal error; a
        # legacy profile changes transitions on purpose and is judged by the oracles alone, as in
        # the simulator (core_sm/table.py).
        self.strict = self.profile_name == "default"
        self.reached: set[tuple[str, str, str]] = set()
        self.states = 0
        self.transitions = 0
        self.depth = 0
        self.complete = False
        self.violation: tuple[Violation, list[tuple[str, Any]]] | None = None
        self.seconds = 0.0
        self.cpu_seconds = 0.0  # the search's CPU time (process time): comparable on a shared box
        self.bytes_per_state = 0.0
        self.lines: list[str] | None = None  # timeline lines, kept only when replaying
        self._tape: tuple[Any, dict[str, Any]] | None = None  # the counterexample's tape, once written
        self._effects: list[Any] = []  # the last scheduler event's effects (a planner's answers)
        self._static: dict[int, Any] = {}  # what every copy shares: tables, configs, frozen rows
        self._pinned: list[Any] = []  # keeps what _static names alive (ids stay unique)
        # machine id -> (a weak reference to it, relabelling key -> its snapshot)
        self._snaps: dict[int, tuple[weakref.ref[Any], dict[Any, Any]]] = {}
        self._renames: dict[Any, dict[str, str]] = {}  # relabellings, by engine or engine order
        self._scripts: dict[tuple[int, ...], bytes] = {}  # an engine's script steps, written
        self.remember_steps = True  # Explorer._step: a machine's steps remembered (off: copied and run each time)
        self.step_hits = 0  # steps taken from what was remembered
        self._node_bytes = 0.0
        self._truncated = False
        self.server_config = ServerConfig(chunk_size=CHUNK, num_slots=8, slot_bytes=4096, lease_ttl=2.0,
                                          tombstone_ttl=1.0, abandoned_job_ttl=1.0, instance_ttl=world.instance_ttl,
                                          ack_first=True, max_jobs=world.max_jobs)
        # The connector's machines as production's builder makes them (core_sm/client_config.py),
        # from the world's settings: one rank per server (rank placement), results kept 1 s, a
        # poll after a None answer 10 ms later; a profile varies the lookup's bound by name.
        settings = ConnectorSettings(request_timeout=world.request_timeout, lookup_status_wait=world.wait,
                                     heartbeat_interval=world.heartbeat_interval,
                                     heartbeat_timeout=world.heartbeat_timeout,
                                     lookup_answer_in_ack=world.answer_in_ack)
        config = lookup_client_config(settings, num_servers=world.servers, model_name="x",
                                      world_size=world.servers, chunk_size=CHUNK)
        self.client_config: LookupClientConfig = attrs.evolve(config, poll_interval=0.01, result_ttl=1.0)
        if timeout is not None:
            self.client_config = attrs.evolve(self.client_config, lookup_timeout=timeout)
        # Every engine's transport to every server: the simulator's link (sim/transport.py builds it
        # with client_config's settings), the profile's subclass if it has one.
        self.link_config = sim_link_config(settings)
        self._seed_keys = self._prompt_keys()
        # A restarted server is a copy of this fresh one: its rows share the same frozen parts.
        self._fresh_server = self._hold(self.new_server())
        # The machine each slot's stored values are restored into (``Held``), and the values it
        # holds now (None: changed since, by the transition that owns it).
        self._work: dict[tuple[str, int], Any] = {}
        # a stored machine's snapshot by its class, relabelling key and values (_snap)
        self._by_values: dict[tuple[Any, Any, Any], bytes] = {}
        # a stored machine's remembered steps by its class, values and the step (_step_held)
        self._steps_by_values: dict[tuple[Any, Any, Any], tuple[Any, tuple[Any, ...]]] = {}
        self._at: dict[tuple[str, int], Held | None] = {}
        self._fresh_client = self._hold(self.new_client())  # a crashed engine's client (never touched again)
        self._fresh_link = self._hold(self.new_link())  # and its links
        self._fresh_workers = [self.new_worker(e) for e in range(world.engines)] if world.workers else []

    # ------------------------------------------------------------------ machines
    def _prompt_keys(self) -> list[Any]:
        """The L1 objects of the prompt's first ``stored`` chunks, as a server names them."""
        client = LookupClient(self.client_config)
        sends = [e for e in client.handle(SubmitLookup("seed", PROMPT), 0.0) if isinstance(e, SendRequest)]
        lookup = sends[0].request
        assert isinstance(lookup, Lookup)
        self._lookup_key = lookup.key  # what the adversary saw on the wire (its request id replaced)
        server = LookupServer(self.server_config)
        hashes, err = server.ctx.hashes(lookup.key, len(PROMPT) // CHUNK)
        assert err is None
        self._hashes = list(hashes)  # every chunk of the prompt (where a load reads its leases)
        return [ObjectKey(h, rank) for h in hashes[:self.world.stored] for rank in range(self.client_config.world_size)]

    def new_server(self) -> LookupServer:
        server = self.server_class(self.server_config)
        for key in self._seed_keys:  # a warm L1: what earlier traffic stored
            server.index.reserve_write(key, "seed", 1024, 0.0)
            server.index.finish_write(key, "seed", 0.0)
        self._share(server)
        return server

    def new_client(self) -> Any:
        """An engine's scheduler: its LookupClient or, in a planner world, the connector's
        StepPlanner over one (vLLM's GPU engine: block size = chunk size, leases as the server's)."""
        client = self.client_class(self.client_config)
        if self.world.planner:
            planner = self.planner_class(PlannerConfig(CHUNK, CHUNK, lease_ttl=self.server_config.lease_ttl,
                                                     max_lease_renewals=self.world.lease_renewals,
                                                     # several groups are restored on a CPU engine only
                                                     cpu_engine=bool(self.groups), kv_groups=self.groups), client)
            self._share(planner)
            return planner
        self._share(client)
        return client

    @staticmethod
    def lookups(client: Any) -> LookupClient:
        """The lookup client of an engine's scheduler (a planner's own)."""
        lc: LookupClient = client.lookups if isinstance(client, StepPlanner) else client
        return lc

    def new_worker(self, e: int) -> TransferClient:
        """Engine ``e``'s worker: instance ``e + 1``, rank 0, server-driven, its ops bounded by
        the request timeout (as the connector's)."""
        worker = self.worker_class(TransferClientConfig(
            instance_id=e + 1, model_name="x", world_size=1, worker_id=0, chunk_size=CHUNK, object_bytes=1024,
            server=0, op_timeout=self.world.request_timeout))
        self._share(worker)
        return worker

    def new_link(self) -> ServerLink:
        # Its first heartbeat one interval from the start (the simulator draws the phase in
        # [0, interval]): with the default interval, beyond the horizon (heartbeats not modelled).
        cfg = self.link_config
        start = self.world.heartbeat_interval
        link = self.link_class(cfg, start, self.monitor_class(cfg.health, start))
        self._share(link)
        return link

    def _hold(self, machine: Any) -> Any:
        """A new machine as a stored state keeps it: its values where it can be restored from
        them (``explore_state.Held``), else the machine itself (copied when touched)."""
        return Held(machine, self.world.horizon) if self.keep_values and restorable(machine) else machine

    def _restored(self, slot: tuple[str, int], held: Held) -> Any:
        """The slot's machine, made the one ``held`` describes (restored in place unless it is
        that one already). Reading it is free; a caller that changes it sets ``_at[slot]`` to
        None first."""
        work = self._work.get(slot)
        if work is None:
            kind = slot[0]
            work = self._work[slot] = self.new_client() if kind == "c" else self.new_link() if kind == "l" \
                else self.new_server()  # "s" a server, "x" a server's scratch copy (its drained verdict)
            assert type(work) is held.cls
            self._at[slot] = None
        if self._at.get(slot) is not held:
            work.restore(held.values)
            self._at[slot] = held
        return work

    def server(self, st: XState, s: int) -> LookupServer:
        """Server ``s`` in ``st`` (to read; ``_own_server`` or ``_step`` to change it)."""
        x = st.servers[s]
        server: LookupServer = self._restored(("s", s), x) if type(x) is Held else x
        return server

    def client(self, st: XState, e: int) -> Any:
        """Engine ``e``'s scheduler in ``st`` (to read; ``_own_client`` or ``_step`` to change it)."""
        x = st.clients[e]
        return self._restored(("c", e), x) if type(x) is Held else x

    def _freeze(self, st: XState) -> None:
        """The end of a transition: a slot's machine it changed in place is kept as values."""
        work = self._work
        for kind, machines in (("s", st.servers), ("c", st.clients), ("l", st.links)):
            for i, x in enumerate(machines):
                if type(x) is not Held and work.get((kind, i)) is x:
                    held = machines[i] = Held(x, self.world.horizon)
                    self._at[(kind, i)] = held

    def _share(self, machine: Any) -> None:
        """Register what a copy of ``machine`` may share with it: its dispatchers' tables and
        frozen rows, its configuration; and give every dispatcher a trace (coverage)."""
        for d in dispatchers(machine):
            d.trace = []
            for obj in d.shared_parts():
                self._static[id(obj)] = obj
                self._pinned.append(obj)
        monitor = getattr(machine, "monitor", None)
        for cfg in (self.server_config, self.client_config, getattr(machine, "config", None),
                    getattr(monitor, "config", None)):
            if cfg is not None:
                self._static[id(cfg)] = cfg
                self._pinned.append(cfg)

    def initial(self) -> XState:
        w = self.world
        st = XState(0.0, [self._hold(self.new_server()) for _ in range(w.servers)], [self._hold(self.new_client()) for _ in range(w.engines)],
                    [self._hold(self.new_link()) for _ in range(self.nodes * w.engines * w.servers)],
                    [ServerBook() for _ in range(w.servers)], [], [(0,) * w.requests for _ in range(w.engines)],
                    [0] * w.servers, frozenset(), (), w.faults, w.restarts, w.aborts, w.crashes, w.attacks,
                    [self.new_worker(e) for e in range(w.engines)] if w.workers else [])
        st.ops = w.ops
        for e in range(len(st.workers)):
            # the runtime tells a worker its server is healthy at start (the connector waits for
            # it): the worker registers its instance
            v = self._worker_event(st, e, ServerHealth(0, True))
            assert v is None, v
        self._freeze(st)
        st.owned = set()
        return st

    def _own(self, st: XState, key: tuple[str, int], slots: list[Any], i: int) -> Any:
        """The machine in ``slots[i]`` of ``st``, made ``st``'s own to change: restored in place
        from its values (``Held``), or copied, once per state."""
        if key not in st.owned:
            st.owned.add(key)
            x = slots[i]
            if type(x) is Held:
                slots[i] = self._restored(key, x)
                self._at[key] = None  # changed in place from here; _freeze keeps its values
            else:
                slots[i] = clone(x, dict(self._static))
        return slots[i]

    def _own_server(self, st: XState, s: int) -> LookupServer:
        server: LookupServer = self._own(st, ("s", s), st.servers, s)
        self._own_book(st, s)
        return server

    def _own_book(self, st: XState, s: int) -> ServerBook:
        if ("b", s) not in st.owned:
            st.owned.add(("b", s))
            st.books[s] = st.books[s].copy()
        return st.books[s]

    def _step(self, st: XState, slot: tuple[str, int], calls: tuple[Any, ...]) -> tuple[Any, list[Any]]:
        """The machine in ``slot`` (``("s", server)``, ``("c", engine)``, ``("l", link index)``,
        ``("w", engine)``) handles ``calls`` at ``st.now`` (events, ``None`` for its
        ``run_deferred()``, a ``Check`` for a lookup client's ``check()``): the machine after them, in the slot, and their effects.

        A machine in a stored state never changes, and its handling is a function of the
        machine and the events alone, so the step is remembered per machine object (while it
        lives) and per events (their canonical snapshot, written by marshal, which tells
        ``True`` from ``1``) and time: the same step from the same machine -- another
        interleaving of the other machines' actions -- takes the machine made the first time
        (while it lives: a step whose state was seen already is forgotten with it) instead of
        a copy and a run. That machine stays shared: the slot is not owned, so a later change in
        the transition copies it again. A machine the transition owns already (copied by
        ``_own_*``) just handles them."""
        kind, i = slot
        machines: list[Any] = st.servers if kind == "s" else st.clients if kind == "c" else st.links if kind == "l" \
            else st.workers
        machine = machines[i]
        now = st.now
        if slot in st.owned:
            return machine, self._run(machine, calls, now)
        if type(machine) is Held:
            return self._step_held(machines, slot, machine, calls, now)
        if not self.remember_steps:
            st.owned.add(slot)
            machines[i] = machine = clone(machine, dict(self._static))
            return machine, self._run(machine, calls, now)
        key = ("step", now, *((type(c), marshal.dumps(snapshot(c, {}), 2)) for c in calls))
        cache = self._cache(machine)
        hit = cache.get(key)
        if hit is not None:
            after = hit[0]()
            if after is not None:
                self.step_hits += 1
                machines[i] = after
                return after, list(hit[1])
        after = clone(machine, dict(self._static))
        effects = self._run(after, calls, now)
        cache[key] = (weakref.ref(after), tuple(effects))
        machines[i] = after
        return after, effects

    def _step_held(self, machines: list[Any], slot: tuple[str, int], held: Held, calls: tuple[Any, ...],
                   now: float) -> tuple[Any, list[Any]]:
        """``_step`` of a machine kept as values: the slot's machine restored from them runs the
        calls and the slot keeps its values after (remembered as ``_step`` remembers a copy's,
        and by the values too: equal values are an equal machine, whichever path made them)."""
        i = slot[1]
        key = ("step", now, *((type(c), marshal.dumps(snapshot(c, {}), 2)) for c in calls))
        cache = self._cache(held) if self.remember_steps else {}
        hit = cache.get(key)
        if hit is None and self.remember_steps:
            hit = self._steps_by_values.get((held.cls, held.values, key))
        if hit is not None:
            after = hit[0]()
            if after is not None:
                self.step_hits += 1
                machines[i] = after
                return self._restored(slot, after), list(hit[1])
        work = self._restored(slot, held)
        self._at[slot] = None
        effects = self._run(work, calls, now)
        after = machines[i] = Held(work, self.world.horizon)
        self._at[slot] = after
        if self.remember_steps:
            steps = self._steps_by_values
            if len(steps) >= BY_VALUES_CAP:  # it keeps values alive: bounded
                steps.clear()
            cache[key] = steps[(held.cls, held.values, key)] = (weakref.ref(after), tuple(effects))
        return work, effects

    @staticmethod
    def _run(machine: Any, calls: tuple[Any, ...], now: float) -> list[Any]:
        effects: list[Any] = []
        for call in calls:
            if call is None:
                effects += machine.run_deferred()
            elif type(call) is Check:
                machine.check(call.request_id)
            else:
                effects += machine.handle(call, now)
        return effects

    def _own_client(self, st: XState, e: int) -> Any:
        return self._own(st, ("c", e), st.clients, e)

    def _own_link(self, st: XState, e: int, s: int, node: int = 0) -> ServerLink:
        i = (node * self.world.engines + e) * self.world.servers + s
        link: ServerLink = self._own(st, ("l", i), st.links, i)
        return link

    def link(self, st: XState, e: int, s: int, node: int = 0) -> ServerLink:
        """Engine ``e``'s node's link to server ``s`` in ``st`` (to read; ``_own_link`` or
        ``_step`` to change it)."""
        i = (node * self.world.engines + e) * self.world.servers + s
        x = st.links[i]
        link: ServerLink = self._restored(("l", i), x) if type(x) is Held else x
        return link

    def _own_worker(self, st: XState, e: int) -> TransferClient:
        if ("w", e) not in st.owned:
            st.owned.add(("w", e))
            st.workers[e] = clone(st.workers[e], dict(self._static))
        worker: TransferClient = st.workers[e]
        return worker

    # ------------------------------------------------------------------ actions
    def actions(self, st: XState) -> Iterator[tuple[str, Any]]:
        seen: set[Frame] = set()
        for i, f in enumerate(st.frames):
            if f in seen:
                continue  # identical frames of the bag: one action
            seen.add(f)
            yield ("deliver", i)
            if st.faults > 0:
                yield ("drop", i)
                yield ("dup", i)
        # Heartbeats (periodic: the space would be infinite) run until the horizon; a deadline
        # that is never due (a legacy link's infinite wait) is none.
        horizon = self.world.horizon
        deadlines = [d for m in (*st.servers, *st.clients, *st.links, *st.workers)
                     if (d := self._deadline(m, horizon)) is not None and d < math.inf]
        # The network is fast beside every timeout: the clock moves only once nothing is in
        # flight, unless the fault budget pays for a slow frame (a deadline passing under it).
        if deadlines and (not st.frames or st.faults > 0):
            yield ("tick", min(deadlines))
        for e, script in enumerate(st.scripts):
            for r, step in enumerate(script):
                if step >= len(self.script):
                    continue
                if self.script[step] in ("check", "match") and self.lookups(self.client(st, e)).state(rid(e, r)) not in (
                        LookupState.DONE, LookupState.ABSENT):
                    if st.aborts > 0:
                        yield ("abort", (e, r))
                        if not self.world.planner:  # vLLM's cleanup_lookup_result; the planner has none
                            yield ("cancel", (e, r))
                    continue
                yield ("step", (e, r))
        if st.restarts > 0 and not (self.world.workers and st.now + self.world.heartbeat_interval > self.world.horizon):
            for s in range(len(st.servers)):
                yield ("restart", s)
        if st.ops > 0:
            for e in range(len(st.workers)):
                if st.workers[e] is not self._fresh_workers[e]:
                    yield ("op", e)
        if st.crashes > 0:
            for e, script in enumerate(st.scripts):
                if any(step < len(self.script) for step in script):
                    yield ("crash", e)
        if st.attacks > 0:
            for e, r in sorted({parse_rid(x) for x, _t in st.submitted}):
                for s in range(len(st.servers)):
                    for kind in ATTACKS:
                        yield ("attack", (kind, e, r, s))
            for e, worker in enumerate(st.workers):
                if worker is self._fresh_workers[e]:
                    continue
                for s in range(len(st.servers)):
                    if self.server(st, s).instance_state(e + 1) is InstanceState.REGISTERED:
                        for kind in INSTANCE_ATTACKS:
                            yield ("attack", (kind, e, 0, s))

    def _deadline(self, machine: Any, horizon: float) -> float | None:
        """``next_deadline(machine, horizon)`` of a machine in a stored state (it never changes),
        kept per machine object."""
        if type(machine) is Held:
            assert horizon == self.world.horizon
            soon: float | None = machine.soon
            return soon
        entry = self._snaps.get(id(machine))
        cache = entry[1] if entry is not None else self._cache(machine)
        key = ("deadline", horizon)
        d = cache.get(key, cache)
        if d is cache:
            d = cache[key] = next_deadline(machine, horizon)
        return d  # type: ignore[no-any-return]

    def describe(self, st: XState, action: tuple[str, Any]) -> str:
        kind, arg = action
        if kind in ("deliver", "drop", "dup"):
            f = st.frames[arg]
            peer = node_name(f.node, f.engine)
            who = f"{peer} -> server{f.server}" if f.kind == "req" else f"server{f.server} -> {peer}"
            return f"{kind} {who} #{f.corr} {short(f.body, 90)}"
        if kind == "tick":
            return f"clock -> {arg:.3f}" + (f" ({len(st.frames)} frame(s) still in flight: slow)" if st.frames else "")
        if kind == "step":
            e, r = arg
            return f"sched{e} {self.script[st.scripts[e][r]]} {rid(e, r)}"
        if kind in ("abort", "cancel"):
            e, r = arg
            call = "request_finished" if kind == "abort" else "cleanup_lookup_result"
            return f"sched{e} {kind} {rid(e, r)} ({call} while its lookup is pending)"
        if kind == "crash":
            return f"crash sched{arg} (its requests end unanswered, its frames are lost)"
        if kind == "op":
            return f"{node_name(1, arg)} retrieve {rid(arg, 0)} [0, {CHUNK})"
        if kind == "attack":
            what, e, r, s = arg
            if what in INSTANCE_ATTACKS:
                return f"{ADVERSARY} sends server{s} {what} naming instance {e + 1} (registered by {node_name(1, e)})"
            return f"{ADVERSARY} sends server{s} {what} naming {rid(e, r)} (a request id it saw)"
        return f"restart server{arg}"

    def _fault(self, st: XState, slow: bool = False) -> None:
        """A fault on the path: a lost, duplicated or restarted message (``clean`` off: the
        simulator's "touched"), or a slow frame (``timely`` off: a deadline passed under it)."""
        if slow:
            st.timely = False
        else:
            st.clean = False
        st.last_fault = st.now

    def apply(self, st: XState, action: tuple[str, Any]) -> Violation | None:
        """Run ``action`` on ``st`` (a child: machines copied as touched, or restored from the
        values the state keeps and kept as values again after); the first oracle violation it
        causes, or None."""
        v = self._apply(st, action)
        self._freeze(st)
        return v

    def _apply(self, st: XState, action: tuple[str, Any]) -> Violation | None:
        kind, arg = action
        if self.lines is not None:
            self.lines.append(f"{st.now:12.6f} {'-':<11} {self.describe(st, action)}")
        if kind == "drop":
            st.frames.pop(arg)
            st.faults -= 1
            self._fault(st)
            return None
        if kind == "dup":
            st.frames.append(st.frames[arg])
            st.faults -= 1
            self._fault(st)
            return None
        if kind == "deliver":
            return self._deliver(st, st.frames.pop(arg))
        if kind == "tick":
            if st.frames:
                st.faults -= 1
                self._fault(st, slow=True)
            st.now = max(st.now, arg)
            for s in range(len(st.servers)):
                x = st.servers[s]
                d = x.deadline if type(x) is Held else x.next_deadline()
                if d is not None and d <= st.now:
                    v = self._server_event(st, s, TimerFired(), None)
                    if v:
                        return v
            for e in range(len(st.clients)):
                for node in range(self.nodes):
                    for s in range(len(st.servers)):
                        x = st.links[(node * len(st.clients) + e) * len(st.servers) + s]
                        d = x.deadline if type(x) is Held else x.next_deadline()
                        if d is not None and d <= st.now:
                            v = self._link_event(st, e, s, TimerFired(), node)
                            if v:
                                return v
                if st.workers:
                    d = st.workers[e].next_deadline()
                    if d is not None and d <= st.now:
                        v = self._worker_event(st, e, TimerFired())
                        if v:
                            return v
                x = st.clients[e]
                d = x.deadline if type(x) is Held else x.next_deadline()
                if d is not None and d <= st.now:
                    v = self._client_event(st, e, TimerFired())
                    if v:
                        return v
            return None
        if kind in ("step", "abort", "cancel"):
            e, r = arg
            scripts = list(st.scripts[e])
            step = self.script[scripts[r]]
            if kind == "abort":  # vLLM's request_finished while the lookup is pending; not a fault
                st.aborts -= 1
                step = self.script[-1]
                scripts[r] = len(self.script) - 1
            elif kind == "cancel":  # vLLM's cleanup_lookup_result while it is pending
                st.aborts -= 1
                step = "cleanup"
                scripts[r] = self.script.index("cleanup")
            scripts[r] += 1
            st.scripts[e] = tuple(scripts)
            if step == "submit":
                st.submitted = (*st.submitted, (rid(e, r), st.now))
                return self._client_event(st, e, SubmitLookup(rid(e, r), PROMPT))
            if step in PLANNER_STEPS:
                return self._planner_step(st, e, r, step, scripts)
            if step == "check":
                if self.lines is not None:  # a replay prints check()'s answer
                    result = self._own_client(st, e).check(rid(e, r))
                    self.lines.append(f"{st.now:12.6f} {'sched' + str(e):<11} check({rid(e, r)}) -> {result}")
                else:
                    self._step(st, ("c", e), (Check(rid(e, r)),))  # a legacy client may send again here
                return self._client_event(st, e, TimerFired())  # sends what check() queued
            return self._client_event(st, e, Cleanup(rid(e, r)) if step == "cleanup" else EndRequest(rid(e, r)))
        if kind == "attack":
            return self._attack(st, *arg)
        if kind == "op":  # the worker's retrieve of the prompt's first chunk (a plan's op)
            st.ops -= 1
            return self._worker_event(st, arg, SubmitRetrieve(rid(arg, 0), PROMPT[:CHUNK], 0, CHUNK, BLOCKS[:1]))
        if kind == "crash":  # the engine process dies: the servers keep its jobs and leases (TTLs reap them)
            e = arg
            st.crashes -= 1
            self._fault(st)
            st.scripts[e] = (len(self.script),) * len(st.scripts[e])
            st.frames = [f for f in st.frames if f.engine != e]
            st.clients[e] = self._fresh_client
            for node in range(self.nodes):
                for s in range(len(st.servers)):
                    st.links[(node * len(st.clients) + e) * len(st.servers) + s] = self._fresh_link
            if st.workers:
                st.workers[e] = self._fresh_workers[e]
            st.kv = tuple(x for x in st.kv if x[0][0] != e)  # its memory is gone
            return None
        # restart
        s = arg
        # every restart's server is the one fresh machine, shared (copied when it handles a frame,
        # its steps and snapshots remembered once for every state restarted into it)
        st.servers[s] = self._fresh_server
        st.owned.discard(("s", s))
        st.owned.add(("b", s))
        st.books[s] = ServerBook()
        st.incarnation[s] += 1
        st.frames = [f for f in st.frames if not (f.server == s and f.incarnation != st.incarnation[s])]
        st.mappings = tuple(x for x in st.mappings if x[0][0] != s)  # the runtime's with it
        st.restarts -= 1
        self._fault(st)
        for e in range(len(st.clients)):
            v = self._client_event(st, e, ServerEpoch(s, st.incarnation[s]))
            if v:
                return v
        return None

    def _deliver(self, st: XState, f: Frame) -> Violation | None:
        if f.kind == "req":
            if f.incarnation != st.incarnation[f.server]:
                return None  # the connection to that incarnation is gone
            peer = node_name(f.node, f.engine)
            event = attrs.evolve(f.body, reply_to=(peer, f.corr, f.incarnation), peer=peer)
            return self._server_event(st, f.server, event, event.reply_to)
        # A reply reaches the engine's link to that server, which correlates it by uid.
        body = f.body
        if isinstance(body, ErrorReply):
            named = dict(st.resent).get((f.engine, f.server, f.corr)) if f.node == 1 else None
            request = self.link(st, f.engine, f.server, f.node).request_of(f.corr)
            if body.error.kind is ErrorKind.NOT_REGISTERED and named is not None and isinstance(request, Outbound) \
                    and named[1] == st.incarnation[f.server] and isinstance(getattr(request.request, "instance_id", None), int):
                iid = request.request.instance_id
                v = self._violation(st, node_name(f.node, f.engine), checks.resend_refused(
                    type(request.request).__name__, request.correlation, f.server, named[0],
                    self.server(st, f.server).instances.registration_id(iid), (f.server, iid) in dict(st.reaped)))
                if v:
                    return v
            event = LinkReply(f.corr, False, body.error, body.error.kind.value)
        elif type(self.link(st, f.engine, f.server, f.node).request_of(f.corr)) is Heartbeat:
            # a heartbeat's reply carries the answering server's start id (its incarnation), as
            # the simulator's does
            event = LinkReply(f.corr, True, {"epoch": st.incarnation[f.server]})
        else:
            request = self.link(st, f.engine, f.server, f.node).request_of(f.corr)  # None: the link gave up on it
            if isinstance(request, Outbound) and type(request.request) in (QueryPrefetchStatus, WaitPrefetchStatus):
                self._note_hit(st, f.engine, f.server, request.request.request_id, body.result)
            event = LinkReply(f.corr, True, body.result)
        return self._link_event(st, f.engine, f.server, event, f.node)

    def _link_event(self, st: XState, e: int, s: int, event: Any, node: int = 0) -> Violation | None:
        """One event into the link of engine ``e``'s scheduler (``node`` 0) or worker (1) to server
        ``s``; its effects performed in its order: frames into the bag, answers to its machine,
        health and epoch verdicts to it."""
        name = node_name(node, e)
        deliver = self._client_event if node == 0 else self._worker_event
        internal = self.link(st, e, s, node).counters["internal_errors"]
        link, effects = self._step(st, ("l", (node * self.world.engines + e) * self.world.servers + s), (event,))
        if self.lines is not None:
            self.lines.append(f"{st.now:12.6f} {name:<11} link{s}: {short(event)} -> "
                              f"[{', '.join(short(x) for x in effects)}]")
        self._drain(link)
        if self.strict and link.counters["internal_errors"] != internal:
            return Violation("SAFETY", st.now, name, f"internal error in the link on {short(event)}")
        for effect in effects:
            v: Violation | None = None
            if isinstance(effect, Transmit):
                request = effect.request
                if isinstance(request, Outbound):
                    body = request.request
                    if effect.resend:
                        # the resend after not_registered names the registration it follows
                        body = resend_of(body, effect.registration)
                        if effect.registration is not None and getattr(body, "registration", None) is not None:
                            st.resent = tuple(sorted({**dict(st.resent), (e, s, effect.uid): (
                                effect.registration, st.incarnation[s])}.items()))
                    if type(body) is Lookup and body.ranks is not None:
                        # production's wire form of a lookup carries no ranks (as sim/engine.py)
                        body = attrs.evolve(body, ranks=None)
                else:
                    body = Ping(request.instance_id) if isinstance(request, InstancePing) else Ping()
                st.frames.append(Frame("req", e, s, effect.uid, st.incarnation[s], body, node=node))
            elif isinstance(effect, Completed):
                correlation = effect.token
                assert isinstance(correlation, int)
                v = deliver(st, e, ReplyReceived(s, correlation, effect.value))
            elif isinstance(effect, Failed):
                assert isinstance(effect.token, int)
                v = deliver(st, e, RequestFailed(s, effect.token, effect.protocol_error()))
            elif isinstance(effect, (ServerHealth, ServerEpoch)):
                v = deliver(st, e, attrs.evolve(effect, server=s))
            if v:
                return v
        return None

    def _note_hit(self, st: XState, e: int, s: int, request_id: str, result: Any) -> None:
        """A status answer reaches a lookup still waiting for this server: it must count (F2)."""
        if not isinstance(result, int) or isinstance(result, bool):
            return
        client = self.lookups(self.client(st, e))
        pending = client.pending(request_id)
        leg = pending.legs.get(s) if pending is not None and client.state(request_id) is not LookupState.DONE else None
        if leg is not None and leg.chunks is None:
            hits = dict(st.hits)
            key = (request_id, s)
            hits[key] = max(hits.get(key, 0), result)
            st.hits = tuple(sorted(hits.items()))

    def _violation(self, st: XState, node: str, finding: checks.Finding | None) -> Violation | None:
        return None if finding is None else Violation(finding[0], st.now, node, finding[1])

    def _server_event(self, st: XState, s: int, event: Any, via: Any) -> Violation | None:
        stored = st.servers[s]
        book = self._own_book(st, s)
        node = f"server{s}"
        # what the server counted before, read without restoring it (a remembered step needs none)
        counters = stored.counters  # a Held keeps a copy: read without a restore
        before = (counters["table_violations"], counters["internal_errors"])
        name = type(event).__name__
        if via is not None:
            book.awaiting[via] = (name, request_id_of(event))
            if type(event) in (QueryPrefetchStatus, WaitPrefetchStatus):
                in_flight = any(f.kind == "req" and f.server == s and f.incarnation == st.incarnation[s]
                                and type(f.body) is Lookup and f.body.key.request_id == event.request_id
                                for f in st.frames)
                v = self._violation(st, node, checks.status_before_lookup(event.request_id, book.lookups,
                                                                          in_flight, node))
                if v:
                    return v
        leases_before = self.server(st, s).leases_by_owner() if type(event) is FreeLookupLocks else None
        if leases_before is not None:  # time-driven expiries first, as the simulator's probe does
            server, early = self._step(st, ("s", s), (TimerFired(),))
            self._emit(st, s, early, {e.reply_to: book.awaiting.pop(e.reply_to) for e in early
                                      if (type(e) is Reply or type(e) is ErrorReply) and e.reply_to in book.awaiting})
            leases_before = server.leases_by_owner()
        if type(event) is Ping and isinstance(event.instance_id, int) and \
                self.server(st, s).instance_state(event.instance_id) is InstanceState.REGISTERED:
            st.seen = tuple(sorted({**dict(st.seen), (s, event.instance_id): st.now}.items()))
        if type(event) is Lookup:
            book.lookups = book.lookups | {event.key.request_id}
            book.last_session[event.key.request_id] = "lookup"
        elif type(event) is EndSession:
            book.last_session[event.request_id] = "end"
        if self.profile.act_before_decide:
            self._act_first(st, s, event)
        server, effects = self._step(st, ("s", s), (event, None))
        for attach in [x for x in effects if type(x) is AttachInstance]:
            # the runtime opens the instance's memory core_sm accepted and answers at once (as
            # sim/world.py does): core_sm replies to the registration then
            server, more = self._step(st, ("s", s), (InstanceAttached(
                attach.instance_id, attach.registration_id, None, reply_to=attach.reply_to),))
            effects += more
        self._map(st, s, effects)
        for start in [x for x in effects if type(x) is StartTransfer]:
            # the runtime's copy, at once: core_sm answers the op then
            v, ok = self._copy(st, s, start)
            if v:
                return v
            server, more = self._step(st, ("s", s), (TransferFinished(start.transfer_id, ok), None))
            effects += more
        counters = server.counters
        self.reached.add((ROUTING, "SERVING", name))  # the routing table keeps no trace
        if self.lines is not None:
            self.lines.append(f"{st.now:12.6f} {node:<11} server: {short(event)} -> "
                              f"[{', '.join(short(e) for e in effects)}]")
        about = {eff.reply_to: book.awaiting[eff.reply_to] for eff in effects
                 if (type(eff) is Reply or type(eff) is ErrorReply) and eff.reply_to in book.awaiting}
        v = self._violation(st, node, checks.reply_accounting(book.awaiting, event, via, effects))
        if v:
            return v
        self._emit(st, s, effects, about)
        for reap in [x for x in effects if type(x) is InstanceReaped]:
            st.reaped = tuple(sorted({**dict(st.reaped), (s, reap.instance_id): st.now}.items()))
            e = reap.instance_id - 1  # engine e's worker is instance e + 1
            if 0 <= e < len(st.workers) and st.workers[e] is not self._fresh_workers[e]:
                v = self._violation(st, node, checks.reaped_while_live(
                    node_name(1, e), reap.instance_id, node, dict(st.seen).get((s, reap.instance_id)),
                    self.server_config.instance_ttl, st.now))
                if v:
                    return v
        v = self._violation(st, node, checks.core_invariants(server))
        if v:
            return v
        if type(event) is Lookup:
            v = self._violation(st, node, checks.duplicate_lookup_leases(
                server, RequestKey(event.peer, event.key.request_id), event.num_readers))
            if v:
                return v
        v = self._violation(st, node, checks.bytes_accounting(server))
        if v:
            return v
        if leases_before is not None:
            assert isinstance(event, FreeLookupLocks)
            v = self._violation(st, node, checks.free_released_others(
                leases_before, server.leases_by_owner(), event.key.request_id))
            if v:
                return v
        self._drain(server)
        if self.strict and (counters["table_violations"], counters["internal_errors"]) != before:
            return Violation("SAFETY", st.now, node, f"table violation or internal error on {short(event)}")
        return None

    def _act_first(self, st: XState, s: int, event: Any) -> None:
        """The legacy runtime (profile ``act-first``): on receipt, before core_sm decides, it
        registers the instance with its transfer engine for whichever peer asked (or unregisters it)."""
        acted = acted_first(event)
        if acted is not None:
            mappings = dict(st.mappings)
            iid, peer = acted
            if peer is None:
                mappings.pop((s, iid), None)
            else:
                mappings[(s, iid)] = peer
            st.mappings = tuple(sorted(mappings.items()))

    def _map(self, st: XState, s: int, effects: list[Any]) -> None:
        """The runtime's transfer engine follows core_sm's effects, in their order: it opens an
        instance's registration for the peer core_sm accepted (``AttachInstance``, answered at
        once) and closes it on ``DetachInstance`` or a reap."""
        mappings = dict(st.mappings)
        for x in effects:
            if type(x) is AttachInstance:
                mappings[(s, x.instance_id)] = str(x.reply_to[0])  # type: ignore[index]
            elif type(x) is DetachInstance or type(x) is InstanceReaped:
                mappings.pop((s, x.instance_id), None)
        st.mappings = tuple(sorted(mappings.items()))

    def _copy(self, st: XState, s: int, start: StartTransfer) -> tuple[Violation | None, bool]:
        """The runtime's copy of a StartTransfer, at once: F23 first (it runs through the
        registration its instance's owner made, ``checks.copy_through_other_registration``); with
        several KV-cache groups a retrieve writes each group's blocks of the engine (or the first
        group's alone: profile ``hma-partial-group``), and F24 judges what vLLM then reads to
        resume (``checks.partial_restore``, the random simulator's judgement). Whether the copy
        succeeded: a plan that does not match its blocks fails it, as production's copier does."""
        node = f"server{s}"
        e = start.instance_id - 1  # engine e's worker is instance e + 1
        if not (0 <= e < len(st.workers)) or st.workers[e] is self._fresh_workers[e]:
            return None, True  # no live honest owner
        v = self._violation(st, node, checks.copy_through_other_registration(
            start.kind.value, start.transfer_id, start.instance_id, node_name(1, e),
            dict(st.mappings).get((s, start.instance_id))))
        if v or not self.groups or start.kind is not TransferKind.RETRIEVE:
            return v, True
        try:
            copies = group_copies(self.groups, start.kind, start.start, start.end, start.placements, start.block_ids,
                                  start.skip_first_n_tokens, CHUNK, CHUNK, self.profile.retrieve_first_group_only)
        except ValueError:
            return None, False
        # an object holds every group's KV of its chunk, group after group: block j of chunk c's
        # part of group g lands in the engine block the copy names
        kv = dict(st.kv)
        for g, part in enumerate(copies):
            for c in part:
                for j in range(c.skip_blocks, len(c.block_ids)):
                    kv[(e, c.block_ids[j])] = (c.chunk, g, j)
        st.kv = tuple(sorted(kv.items()))
        tracker = self.client(st, e).tracker(start.request_id)
        if tracker is None:
            return None, True
        tables = (tuple(tracker.block_ids), *(tuple(t) for t in tracker.other_group_block_ids))
        resume = dict(st.matched).get(start.request_id, 0)  # vLLM goes on from its hit

        def wrong(g: int, i: int) -> str | None:
            want, got = (i, g, 0), kv.get((e, tables[g][i]))  # block size = chunk size
            return None if got == want else f"{_kv(got)} instead of {_kv(want)}"

        finding = checks.partial_restore(start.request_id, self.groups, tables, resume, CHUNK, CHUNK, NULL_BLOCK,
                                         wrong)
        return self._violation(st, node_name(1, e), finding), True

    def _attack(self, st: XState, what: str, e: int, r: int, s: int) -> Violation | None:
        """The adversarial tenant's request, handled by server ``s`` as it arrives, judged by the
        simulator's F22 oracle: no honest tenant's state (sim/adversary.py's ``honest_state``)
        moves. Its replies go back to the adversary, which nobody models further."""
        st.attacks -= 1
        server = self._own_server(st, s)
        book = st.books[s]
        node = f"server{s}"
        counters = server.counters
        before_counts = (counters["table_violations"], counters["internal_errors"])
        early = server.handle(TimerFired(), st.now)  # due time-driven work first, as the oracle does
        self._emit(st, s, early, {x.reply_to: book.awaiting.pop(x.reply_to) for x in early
                                  if (type(x) is Reply or type(x) is ErrorReply) and x.reply_to in book.awaiting})
        before = honest_state(server, set())
        via = (ADVERSARY, self.world.attacks - st.attacks, st.incarnation[s])
        event: Any
        if what == "free":
            event = FreeLookupLocks(attrs.evolve(self._lookup_key, request_id=rid(e, r)), reply_to=via, peer=ADVERSARY)
        elif what == "end":
            event = EndSession(rid(e, r), reply_to=via, peer=ADVERSARY)
        else:  # the worker's instance, registered again in the adversary's name (core_sm refuses it)
            event = RegisterInstance(e + 1, "x", 1, 1024, reply_to=via, peer=ADVERSARY)
        if self.profile.act_before_decide:
            self._act_first(st, s, event)
        effects = server.handle(event, st.now)
        effects += server.run_deferred()
        self._map(st, s, effects)
        if self.lines is not None:
            self.lines.append(f"{st.now:12.6f} {node:<11} server: {short(event)} -> "
                              f"[{', '.join(short(x) for x in effects)}]")
        honest = [x for x in effects if not ((type(x) is Reply or type(x) is ErrorReply) and x.reply_to == via)]
        about = {x.reply_to: book.awaiting[x.reply_to] for x in honest
                 if (type(x) is Reply or type(x) is ErrorReply) and x.reply_to in book.awaiting}
        v = self._violation(st, node, checks.reply_accounting(book.awaiting, event, None, honest))
        if v:
            return v
        self._emit(st, s, honest, about)
        after = honest_state(server, set())
        for part, old in before.items():
            if after[part] != old:
                return Violation(TENANT_HARMED, st.now, node, f"adversary request {short(event, 120)} changed "
                                 f"the honest tenants' {part}: {old!r} -> {after[part]!r}")
        v = self._violation(st, node, checks.core_invariants(server))
        if v:
            return v
        self._drain(server)
        if self.strict and (counters["table_violations"], counters["internal_errors"]) != before_counts:
            return Violation("SAFETY", st.now, node, f"table violation or internal error on {short(event)}")
        return None

    def _emit(self, st: XState, s: int, effects: list[Any], about: dict[Any, tuple[str, str | None]]) -> None:
        for eff in effects:
            if type(eff) is Reply or type(eff) is ErrorReply:
                reply_to: tuple[str, int, int] = eff.reply_to  # type: ignore[assignment]
                peer, corr, inc = reply_to
                node = 1 if peer.startswith("worker") else 0
                st.frames.append(Frame("rep", int(peer[len("worker" if node else "sched"):]), s, corr, inc, eff,
                                       about.get(eff.reply_to, ("", None)), node))

    def _client_event(self, st: XState, e: int, event: Any) -> Violation | None:
        client = self.client(st, e)
        lc = self.lookups(client)
        node = f"sched{e}"
        counters = lc.counters
        own = client.counters  # the planner's, in a planner world (the lookup client's otherwise)
        before = (counters["internal_errors"], counters.get("table_violations", 0), counters["timeouts"],
                  own["internal_errors"], own.get("table_violations", 0))
        watched = [r for r in sorted({k[0] for k, _n in st.hits}) if lc.state(r) is not LookupState.DONE]
        client, effects = self._step(st, ("c", e), (event,))
        lc = self.lookups(client)
        counters = lc.counters
        own = client.counters
        self._effects = effects
        if self.lines is not None:
            self.lines.append(f"{st.now:12.6f} {node:<11} {'planner' if lc is not client else 'lookup'}: "
                              f"{short(event)} -> [{', '.join(short(x) for x in effects)}]")
        for eff in effects:
            if isinstance(eff, SendRequest):
                s = eff.server
                request = eff.request
                if type(request) is FreeLookupLocks or type(request) is EndSession:
                    r = request_id_of(request)
                    st.released = st.released | {(str(r), s)}
                elif type(request) is Lookup and lc is not client:
                    # the planner looks a waiting request up again (a lease renewal): its bound
                    # counts from then
                    submitted = dict(st.submitted)
                    submitted[request.key.request_id] = st.now
                    st.submitted = tuple(sorted(submitted.items()))
        v = self._violation(st, node, checks.core_invariants(client))
        if v:
            return v
        hits = dict(st.hits)
        for r in watched:
            if lc.state(r) is LookupState.DONE and st.clean:
                pending = lc.pending(r)
                assert pending is not None
                message = checks.lost_hit(r, pending.legs, hits, pending.result_tokens)
                if message is not None:
                    return Violation("F2", st.now, node, message)
        self._drain(client)
        after = (counters["internal_errors"], counters.get("table_violations", 0), counters["timeouts"],
                 own["internal_errors"], own.get("table_violations", 0))
        if self.strict and (after[:2], after[3:]) != (before[:2], before[3:]):
            return Violation("SAFETY", st.now, node, f"table violation or internal error on {short(event)}")
        if after[2] != before[2] and st.clean and st.timely:
            return Violation("LIVENESS", st.now, node, "a lookup resolved by the client's timeout with no "
                             "fault or restart on the path: no server answer reached it in time")
        # What it sends goes to its link to that server (the machine production's client runs):
        # a lookup's requests name no engine instance, so the link never parks them.
        for eff in effects:
            if isinstance(eff, SendRequest):
                v = self._link_event(st, e, eff.server, Submit(
                    eff.correlation, Outbound("lookup", eff.correlation, eff.request), None, Role.REQUEST, None))
                if v:
                    return v
        return None

    def _planner_step(self, st: XState, e: int, r: int, step: str, scripts: list[int]) -> Violation | None:
        """One step of a planner world's script: vLLM's scheduler calls into engine ``e``'s
        StepPlanner (as ``sim/engine.py``'s scheduler model makes them), its answers judged by the
        simulator's planner oracles: F8 at the first allocation (every leased range of the hit read
        or freed), and on every planned retrieve F21 (a second load of one lookup), F20 (read
        leases expired under it) and F2 (each rank loads from the server that leased its part)."""
        request_id = rid(e, r)
        node = f"sched{e}"
        again = "preempt" in self.script[:scripts[r] - 1]  # after a preemption
        if step == "match":
            v = self._client_event(st, e, MatchRequest(request_id, PROMPT, len(PROMPT), 0,
                                                       max_load_tokens=self.world.load_cap))
            if v:
                return v
            answers = [x for x in self._effects if type(x) is MatchAnswer]
            if len(answers) != 1:
                return Violation("SAFETY", st.now, node, f"MatchRequest({request_id}) answered {answers!r}")
            tokens = answers[0].tokens
            if tokens is None:  # not yet: vLLM asks again at a later step
                scripts[r] -= 1
                st.scripts[e] = tuple(scripts)
                return None
            st.matched = tuple(sorted({**dict(st.matched), request_id: tokens}.items()))
            tracker = self.client(st, e).tracker(request_id)
            if tokens > 0 and tracker is not None and tracker.hit_tokens:
                earliest, held = self._leases(st, e, request_id, 0, tracker.hit_tokens)
                if held and earliest is not None:
                    seen = {x[0]: x for x in st.lease_seen}
                    seen[request_id] = (request_id, earliest, tuple(st.incarnation))
                    st.lease_seen = tuple(sorted(seen.values()))
            return None
        if step == "alloc":  # the blocks allocated, and the step's plan built (one scheduler step)
            matched = dict(st.matched).get(request_id, 0)
            v = self._client_event(st, e, BlocksAllocated(request_id, BLOCKS, matched,
                                                          other_group_block_ids=self.group_tables(matched)[1:]))
            if v:
                return v
            tracker = self.client(st, e).tracker(request_id)
            if tracker is not None and not again:  # a resumed request's were accounted at its first
                retrieve = tracker.pending_retrieve
                v = self._violation(st, node, checks.leases_unaccounted(
                    request_id, tracker.hit_tokens, tracker.leases_freed,
                    None if retrieve is None else (retrieve.start, retrieve.end)))
                if v:
                    return v
        if step in ("alloc", "preempt"):
            preempted = (request_id,) if step == "preempt" else ()
            v = self._client_event(st, e, StepScheduled((), preempted))
            if v:
                return v
            plans = [x for x in self._effects if type(x) is StepPlan]
            if len(plans) != 1:
                return Violation("SAFETY", st.now, node, f"StepScheduled answered {plans!r}")
            for op in plans[0].retrieves:
                v = self._check_retrieve(st, e, op, again)
                if v:
                    return v
                if st.workers and st.workers[e] is not self._fresh_workers[e]:
                    v = self._worker_event(st, e, op)  # the worker runs the plan's retrieve
                    if v:
                        return v
            return None
        return self._client_event(st, e, RequestFinished(request_id))

    def group_tables(self, computed: int) -> tuple[tuple[int, ...], ...]:
        """A request's block table in each KV-cache group, as vLLM allocates it with ``computed``
        tokens computed (its hit): the first group's ``BLOCKS``, each further group's blocks of
        its own, a window's blocks that fell out of it vLLM's null block."""
        tables: list[tuple[int, ...]] = [BLOCKS]
        for g, group in enumerate(self.groups[1:], start=1):
            live = first_live_token(group, computed) // CHUNK
            tables.append(tuple(NULL_BLOCK if i < live else b + g * len(BLOCKS) + 1 for i, b in enumerate(BLOCKS)))
        return tuple(tables)

    def _leases(self, st: XState, e: int, request_id: str, start: int, end: int) -> tuple[float | None, bool]:
        """The earliest expiry of the read leases engine ``e``'s request holds on tokens
        ``[start, end)`` of every rank at the server that rank loads from, and whether it holds
        all of them (as ``sim/engine.py``'s ``_leases``)."""
        indexes = [self.server(st, self.load_server(rank, request_id)).index
                   for rank in range(self.client_config.world_size)]
        return checks.lease_span(indexes, self._hashes, start // CHUNK, end // CHUNK, f"sched{e}", request_id)

    def load_server(self, rank: int, request_id: str) -> int:
        """The server worker ``rank`` loads a request from: production's placement, unless the
        profile's rule says otherwise."""
        server: int = self.profile.load_server(rank, self.client_config.world_size, self.world.servers, request_id)
        return server

    def _check_retrieve(self, st: XState, e: int, op: Any, again: bool) -> Violation | None:
        """A retrieve the plan carries: F21 (planned twice), F20 (on expired leases), F2 (a rank
        loading from a server that did not lease its part)."""
        node = f"sched{e}"
        request_id = op.request_id
        loads = dict(st.loads)
        loads[request_id] = loads.get(request_id, 0) + 1
        st.loads = tuple(sorted(loads.items()))
        if loads[request_id] > 1:
            finding = checks.load_planned_again(request_id, op.start, op.end, again)
            return Violation(finding[0], st.now, node, finding[1])
        earliest, held = self._leases(st, e, request_id, op.start, op.end)
        last = {x[0]: x for x in st.lease_seen}.get(request_id)
        last_seen = last[1] if last is not None and last[2] == tuple(st.incarnation) else None
        since = dict(st.submitted).get(request_id, 0.0)
        v = self._violation(st, node, checks.retrieve_on_expired_leases(
            request_id, op.start, op.end, st.now, st.now - since, self.server_config.lease_ttl, earliest, held,
            last_seen))
        if v:
            return v
        rps = self.lookups(self.client(st, e)).config.ranks_per_server
        for rank in range(self.client_config.world_size):
            v = self._violation(st, node, checks.misplaced_load(request_id, rank, self.load_server(rank, request_id),
                                                                rps))
            if v:
                return v
        return None

    def _worker_event(self, st: XState, e: int, event: Any) -> Violation | None:
        """One event into engine ``e``'s worker (its TransferClient); what it sends goes to its
        own link, in the role ``sim/transport.py`` gives it (a registration, a request naming the
        instance)."""
        node = node_name(1, e)
        counters = st.workers[e].counters
        before = (counters["internal_errors"], counters.get("table_violations", 0))
        worker, effects = self._step(st, ("w", e), (event,))
        counters = worker.counters
        if self.lines is not None:
            self.lines.append(f"{st.now:12.6f} {node:<11} transfer: {short(event)} -> "
                              f"[{', '.join(short(x) for x in effects)}]")
        v = self._violation(st, node, checks.core_invariants(worker))
        if v:
            return v
        self._drain(worker)
        if self.strict and (counters["internal_errors"], counters.get("table_violations", 0)) != before:
            return Violation("SAFETY", st.now, node, f"table violation or internal error on {short(event)}")
        for eff in effects:
            if isinstance(eff, SendRequest):
                request = eff.request
                role, instance = Role.REQUEST, None
                if isinstance(request, RegisterInstance):
                    role, instance = Role.REGISTRATION, request.instance_id
                elif isinstance(request, UnregisterInstance):
                    role, instance = Role.UNREGISTRATION, request.instance_id
                elif type(request) in RESENDABLE_AFTER_NOT_REGISTERED:
                    instance = getattr(request, "instance_id", None)
                v = self._link_event(st, e, eff.server, Submit(
                    eff.correlation, Outbound("transfer", eff.correlation, request), None, role, instance), 1)
                if v:
                    return v
        return None

    def _drain(self, machine: Any) -> None:
        for d in dispatchers_of(machine):
            if d.trace:
                name = d.table.name
                for state, ev, _after in d.trace:
                    self.reached.add((name, state.name, ev.__name__))
                d.trace.clear()

    # ------------------------------------------------------------------ state oracles
    def unfinished(self, st: XState) -> list[str]:
        return [rid(e, r) for e, s in enumerate(st.scripts) for r, k in enumerate(s) if k < len(self.script)]

    def state_violation(self, st: XState, acts: list[tuple[str, Any]]) -> Violation | None:
        """Oracles on a state as a whole: deadlock, bounded liveness, and at quiescence (every
        script done, nothing in flight) the lease and job accounting after every TTL."""
        pending = self.unfinished(st)
        if not acts and pending:
            return Violation("DEADLOCK", st.now, "world", f"no action enabled; unfinished: {pending}")
        if not acts and not st.frames:
            # nothing left to happen: no refused request still waits on a registration
            for e in range(len(st.workers)):
                for s in range(len(st.servers)):
                    link = self.link(st, e, s, 1)
                    for uid in link.parked_uids():
                        request = link.request_of(uid)
                        parked = checks.parked_request(type(request.request).__name__, request.correlation, s)
                        return Violation(parked[0], st.now, node_name(1, e), parked[1])
            # and every live worker is registered with its server (F13/F19)
            for e, worker in enumerate(st.workers):
                if worker is self._fresh_workers[e]:
                    continue  # its engine crashed
                server = self.server(st, worker.config.server)
                iid = worker.config.instance_id
                s = worker.config.server
                when = dict(st.reaped).get((s, iid))
                if when is not None and when > self.world.horizon:
                    continue  # reaped after its pings stopped at the horizon: rightly, as silent
                if server.instance_state(iid) is not InstanceState.REGISTERED:
                    unregistered = checks.worker_unregistered(node_name(1, e), iid, f"server{s}", st.incarnation[s],
                                                              when is not None)
                    return Violation(unregistered[0], st.now, f"server{s}", unregistered[1])
        submitted = dict(st.submitted)
        for e, script in enumerate(st.scripts):
            for r, step in enumerate(script):
                since = max(st.last_fault, submitted.get(rid(e, r), 0.0))
                if step < len(self.script) and self.script[step] in ("check", "match") and st.now - since > \
                        self.world.liveness_bound and self.lookups(self.client(st, e)).state(rid(e, r)) not in (
                        LookupState.DONE, LookupState.ABSENT):
                    return Violation("F1", st.now, f"sched{e}", f"lookup unresolved: {rid(e, r)} still pending "
                                     f"{st.now - since:.3f} s after its submit or the last fault "
                                     f"(bound {self.world.liveness_bound:g} s)")
        if pending or st.frames:
            return None
        for s, stored in enumerate(st.servers):
            node = f"server{s}"
            if st.clean:
                # a stored server never changes: its leases neither (kept with it)
                cache = self._cache(stored)
                leases = cache.get("leases")
                if leases is None:
                    leases = cache["leases"] = self.server(st, s).leases_by_owner()
                for owner, count in sorted(leases.items(), key=lambda kv: repr(kv[0])):
                    if not isinstance(owner, RequestKey) or count <= 0:
                        continue
                    finding = checks.leases_after_end(
                        owner.request_id, count, (owner.request_id, s) not in st.released,
                        st.books[s].last_session.get(owner.request_id) == "end", "done", node, "")
                    if finding is not None:
                        return Violation(finding[0], st.now, node, finding[1])
            horizon = st.now + 4 * max(self.server_config.lease_ttl, self.server_config.abandoned_job_ttl) + 1.0
            cache = self._cache(stored)  # a stored server never changes: its verdict at a horizon neither
            finding = cache.get(("drained", horizon), cache)
            if finding is cache:
                if type(stored) is Held:  # run on a scratch server restored from its values
                    later = self._restored(("x", s), stored)
                    self._at[("x", s)] = None
                else:
                    later = clone(stored, dict(self._static))
                later.handle(TimerFired(), horizon)
                finding = cache[("drained", horizon)] = checks.drained(later.stats())
            if finding is not None:
                return Violation(finding[0], horizon, node, finding[1])
        return None

    # ------------------------------------------------------------------ fingerprints
    def _snap(self, machine: Any, ren: dict[str, str], key: Any, slot: tuple[str, int] | None = None) -> bytes:
        """The machine's snapshot under a relabelling, cached per machine object (a machine in a
        stored state never changes: it is copied before it is touched) for as long as it lives:
        a weak reference forgets it when the machine goes (a copy made for a state already seen),
        before its id can name another."""
        entry = self._snaps.get(id(machine))
        cache = entry[1] if entry is not None else self._cache(machine)
        cached = cache.get(key)
        if cached is None:
            # marshal's version 2 writes structure only (no references to shared objects), so
            # equal snapshots give equal bytes; five times cheaper than repr
            if type(machine) is Held:
                # the snapshot of the machine its values make: equal values make equal machines,
                # so it is kept by the values too (the same machine reached by another path)
                by_values = self._by_values
                vkey = (machine.cls, key, machine.values)
                cached = by_values.get(vkey)
                if cached is None:
                    assert slot is not None
                    if len(by_values) >= BY_VALUES_CAP:  # it keeps values alive: bounded
                        by_values.clear()
                    cached = by_values[vkey] = marshal.dumps(snapshot(self._restored(slot, machine), ren), 2)
                cache[key] = cached
            else:
                cached = cache[key] = marshal.dumps(snapshot(machine, ren), 2)
        assert isinstance(cached, bytes)
        return cached

    def _cache(self, obj: Any) -> dict[Any, Any]:
        """What the fingerprints computed of ``obj`` (a machine, a frame, a book: never changed
        once stored), for as long as it lives."""
        k = id(obj)
        entry = self._snaps.get(k)
        if entry is None:
            entry = self._snaps[k] = (weakref.ref(obj, lambda _ref: self._snaps.pop(k, None)), {})
        return entry[1]

    def _engine_ren(self, e: int) -> dict[str, str]:
        """Engine ``e``'s own requests as R<r> (its label-free signature)."""
        ren = self._renames.get(("E", e))
        if ren is None:
            ren = self._renames[("E", e)] = {rid(e, r): f"R{r}" for r in range(self.world.requests)}
        return ren

    def _frame_key(self, f: Frame, e: int) -> str:
        """A frame of engine ``e`` in its engine's signature: naming the engine as "E"."""
        cache = self._cache(f)
        cached = cache.get(("E", e))
        if cached is None:
            ren = self._renames.get(("F", e))
            if ren is None:
                ren = self._renames[("F", e)] = {f"sched{e}": "E", f"worker{e}": "W", **self._engine_ren(e)}
            cached = cache[("E", e)] = repr(snapshot((f.kind, f.node, f.server, f.corr, f.incarnation, f.body), ren))
        assert isinstance(cached, str)
        return cached

    def _perm_ren(self, pkey: tuple[int, ...]) -> dict[str, str]:
        """The relabelling of engines ``pkey`` names (old engine -> its place in the order)."""
        ren = self._renames.get(pkey)
        if ren is None:
            ren = self._renames[pkey] = {}
            for new, old in enumerate(pkey):
                ren[f"sched{old}"] = f"sched{new}"
                ren[f"worker{old}"] = f"worker{new}"
                for r in range(self.world.requests):
                    ren[rid(old, r)] = rid(new, r)
        return ren

    def fingerprint(self, st: XState) -> bytes:
        n = len(st.clients)
        order = list(range(n))
        # Each client's snapshot names only its own requests, as R<r>: label-free, computed once
        # per client object; its place in the sorted order is its label.
        ns = len(st.servers)
        ne = len(st.clients)
        snap = self._snap
        links = [[(st.links[i], ("l", i)) for i in ((node * ne + e) * ns + s for node in range(self.nodes)
                                                   for s in range(ns))] for e in order]
        sigs = [b"|".join(snap(m, self._engine_ren(e), "E", slot)
                          for m, slot in ((st.clients[e], ("c", e)), *((w, ("w", e)) for w in st.workers[e:e + 1]),
                                          *links[e]))
                # a worker's instance id is not relabelled: it stays in its engine's signature
                + b"".join(b"|iid%d" % w.config.instance_id for w in st.workers[e:e + 1])
                for e in order]
        if self.world.symmetry and n > 1:
            # Sort-based canonical form: each engine's signature names only itself as "E".
            keys = []
            for e in order:
                frames = sorted(self._frame_key(f, e) for f in st.frames if f.engine == e)
                keys.append((sigs[e], st.scripts[e], tuple(frames)))
            order.sort(key=lambda e: keys[e])
        pkey = tuple(order)
        perm = {old: new for new, old in enumerate(order)}
        ren = self._perm_ren(pkey)
        clients = tuple((sigs[old], st.scripts[old]) for old in order)
        bag = tuple(sorted(self._frame_snap(f, perm, ren, pkey) for f in st.frames))
        servers = tuple(self._snap(m, ren, pkey, ("s", s)) for s, m in enumerate(st.servers))
        books = repr(tuple(self._book_snap(b, ren, pkey) for b in st.books))
        extra = (st.now, st.incarnation, sorted((ren.get(r, r), s) for r, s in st.released),
                 sorted((ren.get(r, r), s, h) for (r, s), h in st.hits), st.faults, st.restarts, st.aborts,
                 st.crashes, st.attacks, st.seen, st.reaped,
                 st.clean, st.timely, st.last_fault, sorted((ren.get(r, r), t) for r, t in st.submitted),
                 sorted((ren.get(r, r), n) for r, n in st.matched), sorted((ren.get(r, r), n) for r, n in st.loads),
                 sorted((ren.get(r, r), t, i) for r, t, i in st.lease_seen), st.ops, st.resent,
                 sorted((k, ren.get(p, p)) for k, p in st.mappings), sorted(((perm[e], b), x) for (e, b), x in st.kv))
        scripts = self._scripts
        # each part length-prefixed, hashed at once (the digest of the parts fed one by one)
        data = []
        for part in (*(x for sig, script in clients for x in (sig, scripts.get(script) or scripts.setdefault(
                script, repr(script).encode()))), *servers,
                     repr(bag).encode(), books.encode(), repr(extra).encode()):
            data.append(len(part).to_bytes(8, "little"))
            data.append(part)
        return hashlib.blake2b(b"".join(data), digest_size=16).digest()

    def _frame_snap(self, f: Frame, perm: dict[int, int], ren: dict[str, str], pkey: tuple[int, ...]) -> str:
        """A frame in the bag, its engine relabelled by ``pkey``'s order (cached per frame)."""
        cache = self._cache(f)
        cached = cache.get(pkey)
        if cached is None:
            cached = cache[pkey] = repr(snapshot((f.kind, f.node, perm[f.engine], f.server, f.corr, f.incarnation,
                                                  f.body), ren))
        assert isinstance(cached, str)
        return cached

    def _book_snap(self, b: ServerBook, ren: dict[str, str], pkey: tuple[int, ...]) -> Any:
        """What the oracles remember of one server incarnation, relabelled (cached per book: a
        book in a stored state never changes, it is copied with its server)."""
        cache = self._cache(b)
        cached = cache.get(pkey)
        if cached is None:
            cached = cache[pkey] = snapshot((sorted(repr(snapshot(k, ren)) for k in b.awaiting),
                                             sorted(ren.get(x, x) for x in b.lookups),
                                             sorted((ren.get(k, k), v) for k, v in b.last_session.items())), ren)
        return cached

    # ------------------------------------------------------------------ search
    def run(self, dfs: bool = False, progress: Callable[[str], None] | None = None) -> Explorer:
        t0 = time.perf_counter()
        c0 = time.process_time()
        root = Node(self.initial(), 0, None, None)
        seen: set[bytes] = {self.fingerprint(root.state)}
        frontier: deque[Node] = deque([root])
        pop = frontier.pop if dfs else frontier.popleft
        self._node_bytes = 0.0
        # Every copy of a machine is cyclic (its dispatchers' handlers are bound to it), so the
        # copies of the states already seen are freed only by the collector: the young
        # generation is collected after each expanded state, when they are garbage, and the
        # older ones (the stored states, which stay) are never walked again during the search.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._search(root, seen, frontier, pop, progress, t0)
        finally:
            if collecting:
                gc.enable()
        self.states = len(seen)
        self.seconds = time.perf_counter() - t0
        self.cpu_seconds = time.process_time() - c0
        self.bytes_per_state = self._memory(frontier, seen)
        self.complete = self.violation is None and not self._truncated
        return self

    def _search(self, root: Node, seen: set[bytes], frontier: deque[Node], pop: Callable[[], Node],
                progress: Callable[[str], None] | None, t0: float) -> None:
        truncated = False
        next_report = 10_000
        next_sample = 64
        while frontier:
            node = pop()
            st = node.state
            self.depth = max(self.depth, node.depth)
            acts = list(self.actions(st))
            v = self.state_violation(st, acts)
            if v is not None:
                self.violation = (v, node.path())
                break
            if node.depth >= self.world.max_depth:
                truncated = truncated or bool(acts)
                continue
            for act in acts:
                nxt = st.child()
                v = self.apply(nxt, act)
                nxt.owned = set()
                self.transitions += 1
                if v is not None:
                    self.violation = (v, [*node.path(), act])
                    break
                fp = self.fingerprint(nxt)
                if fp in seen:
                    continue
                seen.add(fp)
                if len(seen) >= self.world.max_states:
                    truncated = True
                    frontier.clear()
                    break
                frontier.append(Node(nxt, node.depth + 1, node, act))
            if self.violation is not None:
                break
            if len(seen) >= next_sample and frontier:
                next_sample *= 4  # a sample walks 20 states: every fourfold growth
                self._node_bytes = self._sample_nodes(frontier)
            if progress is not None and len(seen) >= next_report:
                next_report += 10_000
                rate = len(seen) / (time.perf_counter() - t0)
                progress(f"  {len(seen)} states, frontier {len(frontier)}, depth {node.depth}, {rate:.0f} states/s")
            gc.collect(0)
        self._truncated = truncated

    def _memory(self, frontier: deque[Node], seen: set[bytes]) -> float:
        """Bytes per distinct state: its fingerprint in the seen set, plus what a queued state
        holds that its parent does not (machines are shared until touched), sampled on the
        frontier as the search grows."""
        per_fp = sys.getsizeof(next(iter(seen))) + 32 if seen else 0
        return per_fp + (self._sample_nodes(frontier) if frontier else self._node_bytes)

    def _sample_nodes(self, frontier: deque[Node]) -> float:
        sample = [frontier[i] for i in range(0, len(frontier), max(1, len(frontier) // 20))]
        total = 0
        for node in sample:
            parent = node.parent.state if node.parent is not None else None
            st = node.state
            own = [m for i, m in enumerate(st.servers) if parent is None or parent.servers[i] is not m]
            own += [m for i, m in enumerate(st.clients) if parent is None or parent.clients[i] is not m]
            own += [m for i, m in enumerate(st.links) if parent is None or parent.links[i] is not m]
            own += [m for i, m in enumerate(st.workers) if parent is None or parent.workers[i] is not m]
            total += deep_size([own, st.frames, st.books, st.scripts], self._static) + sys.getsizeof(node)
        return total / len(sample)

    # ------------------------------------------------------------------ coverage
    def all_rows(self) -> list[tuple[str, str, str]]:
        rows: list[tuple[str, str, str]] = []
        explored = (SERVER_TABLES, CLIENT_TABLES, HEALTH_TABLES) + ((TRANSFER_TABLES,) if self.world.workers else ()) + (
            ({PLANNER_TABLE.name: PLANNER_TABLE},) if self.world.planner else ())
        for tables in explored:
            for table in tables.values():
                for (state, ev) in table.rows:
                    rows.append((table.name, state.name, ev.__name__))
        return rows

    def unreached(self) -> list[tuple[str, str, str]]:
        return [r for r in self.all_rows() if r not in self.reached]

    # ------------------------------------------------------------------ tapes
    def tape(self) -> dict[str, Any]:
        """The counterexample as a tape: the explorer's actions and, under ``sim_world``, the
        actions of a scripted ``sim.World`` that show it there (``world_tape``)."""
        assert self.violation is not None
        if self._tape is not None and self._tape[0] is self.violation:
            return self._tape[1]
        v, path = self.violation
        tape = {"format": TAPE_FORMAT, "profile": self.profile_name, "world": attrs.asdict(self.world),
                "actions": [list(a) for a in path], "violation": {"code": v.code, "message": v.message}}
        tape["sim_world"] = world_tape(tape, self.profile)
        self._tape = (self.violation, tape)
        return tape


def replay_tape(tape: dict[str, Any], profile: Any) -> tuple[Violation | None, list[str]]:
    """Run a tape's actions on fresh machines: the violation they cause (or None) and the
    timeline, one line per action and per handled event."""
    world = XWorld(**tape["world"])
    ex = Explorer(world, profile)
    ex.lines = []
    st = ex.initial()
    for kind, arg in tape["actions"]:
        action = (kind, tuple(arg) if isinstance(arg, list) else arg)
        enabled = list(ex.actions(st))
        if action not in enabled:
            ex.lines.append(f"{st.now:12.6f} {'-':<11} tape action {action} is not enabled here")
            return None, ex.lines
        st = st.child()
        v = ex.apply(st, action)
        st.owned = set()
        if v is not None:
            ex.lines.append(f"{v.t:12.6f} {v.node:<11} VIOLATION {v.reason()}")
            return v, ex.lines
    v = ex.state_violation(st, list(ex.actions(st)))
    if v is not None:
        ex.lines.append(f"{v.t:12.6f} {v.node:<11} VIOLATION {v.reason()}")
    return v, ex.lines


def load_tape(path: str) -> dict[str, Any]:
    with open(path) as fh:
        tape: dict[str, Any] = json.load(fh)
    if tape.get("format") not in (TAPE_FORMAT, "mpcache-explore-tape/1"):  # /1: the explorer's actions only
        raise ValueError(f"{path}: not an explore tape")
    return tape


def save_tape(ex: Explorer, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(ex.tape(), fh, indent=1)
        fh.write("\n")


def _kv(label: tuple[int, int, int] | None) -> str:
    """What an engine block holds, in words."""
    return "stale KV" if label is None else f"chunk {label[0]} group {label[1]}'s KV"


def request_id_of(event: Any) -> str | None:
    if type(event) is Lookup or type(event) is FreeLookupLocks:
        return event.key.request_id
    value = getattr(event, "request_id", None)
    return value if isinstance(value, str) else None


def node_name(node: int, engine: int) -> str:
    """The peer name of engine ``engine``'s scheduler (node 0) or worker (node 1)."""
    return f"{'worker' if node else 'sched'}{engine}"


def rid(engine: int, request: int) -> str:
    return f"req{engine}.{request}"


def parse_rid(request_id: str) -> tuple[int, int]:
    e, r = request_id[len("req"):].split(".")
    return int(e), int(r)


def report(ex: Explorer, out: Any = None) -> None:
    out = out or sys.stdout
    w = ex.world
    rate = ex.states / ex.seconds if ex.seconds else 0.0
    cpu_rate = ex.states / ex.cpu_seconds if ex.cpu_seconds else 0.0
    print(f"world {w.name}: {w.engines} engine(s) x {w.servers} server(s) x {w.requests} request(s), "
          f"faults {w.faults}, restarts {w.restarts}, aborts {w.aborts}, crashes {w.crashes}, attacks {w.attacks}, profile {ex.profile_name}, "
          f"symmetry {'on' if w.symmetry else 'off'}", file=out)
    print(f"  {'complete' if ex.complete else 'NOT complete'}: {ex.states} states, {ex.transitions} transitions, "
          f"depth {ex.depth}, {ex.seconds:.1f} s, {rate:.0f} states/s ({cpu_rate:.0f} per CPU second), "
          f"{ex.bytes_per_state:.0f} B/state", file=out)
    if ex.violation is not None:
        v, path = ex.violation
        print(f"  VIOLATION {v.reason()} (counterexample: {len(path)} actions)", file=out)


def report_coverage(ex: Explorer, out: Any = None) -> None:
    out = out or sys.stdout
    rows = ex.all_rows()
    missing = ex.unreached()
    print(f"  coverage: {len(rows) - len(missing)} of {len(rows)} table rows reached; never reached:", file=out)
    for table, state, ev in missing:
        print(f"    {table}: {state} x {ev}", file=out)


# ---------------------------------------------------------------------- tapes in sim.World
# A counterexample runs in the ordinary simulated world too (``sim/world.py``): the explorer's world
# becomes a ``Scenario`` (its engines, servers and requests, the connector's settings, the prompt's
# first ``stored`` chunks in each server's L1 from the start), and its actions become the choices of
# a scripted ``World`` (``World._play``): a frame delivered, dropped or duplicated is the message of
# the net's bag that carries the same request (its link uid mapped to the world's at the first
# frame of it), every other choice the world's own -- the clock moves (``tick``) whenever the
# message the next action moves is not sent yet, so the world's engines (vLLM's scheduler model
# over the planner), links, timers and copies do what the explorer's scripts did; where the
# explorer's clock moves between a request's answered match and its allocation, the world's
# scheduler holds the request (vLLM's pool short for it: asked about at every step, not allocated)
# until the explorer allocates; restarts, engine crashes and aborts are the world's. The world's actions are saved in the tape beside the
# explorer's (``sim_world``); ``replay_world_tape`` runs them, with the world's oracles.

# explorer actions sim.World has no choice for (a tape with one is not written for the world)
NO_WORLD_COUNTERPART = {
    "cancel": "the world's scheduler runs the planner, which has no cleanup_lookup_result (its abort ends the "
              "session instead of freeing the leases)",
}
WORLD_TAPE_WAIT = 10.0  # virtual seconds the guide lets pass looking for one message before it gives up


def world_scenario(world: XWorld) -> Any:
    """The explorer's world as a ``sim.World`` scenario (no random fault: the tape makes them)."""
    from mpcache.sim.net import NetConfig
    from mpcache.sim.scenario import RequestSpec, Scenario, WorldConfig

    cfg = WorldConfig(num_servers=world.servers, num_engines=world.engines, tp=world.servers, chunk_size=CHUNK,
                      block_size=CHUNK, blocks_per_worker=16, l1_slots=8, lease_ttl=2.0, abandoned_job_ttl=1.0,
                      request_timeout=world.request_timeout, heartbeat_interval=world.heartbeat_interval,
                      heartbeat_timeout=world.heartbeat_timeout, lookup_answer_in_ack=world.answer_in_ack,
                      net=NetConfig(min_delay=0.0005, mean_delay=0.0), safety_duration=0.0, liveness_bound=5.0,
                      kv_groups=Explorer(world).groups, cpu_engine=bool(world.kv_window), adversary=world.attacks > 0)
    requests = tuple(RequestSpec(e, rid(e, r), 0.0, PROMPT, preempt=world.preempt, max_load_tokens=world.load_cap)
                     for e in range(world.engines) for r in range(_world_requests(world)))
    return Scenario(0, cfg, requests, (), 0)


def _world_requests(world: XWorld) -> int:
    """Requests per engine in the world: a worker's retrieve with no request in the explorer
    (``XWorld.ops``) is the retrieve the planner plans for one in sim.World, whose scheduler's
    messages the explorer does not model (``Guide``: the world's own, delivered as they come)."""
    return 1 if world.ops and not world.requests else world.requests


def _world_only(world: XWorld, packet: Any) -> bool:
    """A message of the world the explorer's world has no frame for: a scheduler's, where the
    explorer runs workers alone."""
    return not world.requests and any(n.startswith("sched") for n in (packet.src.node, packet.dst.node))


class _TapeWorld:
    """What both directors of a tape's world do: warm each server's L1 as the explorer's world
    starts (``XWorld.stored`` chunks of the prompt, every rank), on every start."""

    def __init__(self, xworld: XWorld) -> None:
        self.xworld = xworld

    def server_started(self, world: Any, host: Any, server: Any) -> None:
        req = world.find_request(rid(0, 0)) if world.scenario.requests else None
        if req is None:
            return
        hashes = req[1].hashes[:self.xworld.stored]
        for h in hashes:
            for rank in range(world.config.tp):
                key = ObjectKey(h, rank)
                slot = server.index.reserve_write(key, "seed", server.config.slot_bytes, world.now())
                server.index.finish_write(key, "seed", world.now())
                if slot is not None:
                    host.slots[slot] = world.expected_chunk(key)
                world.written.add(key)


class TapePlayer(_TapeWorld):
    """Plays a world tape's actions."""

    def __init__(self, xworld: XWorld, actions: list[list[Any]]) -> None:
        super().__init__(xworld)
        self.actions = deque(actions)

    def next_action(self, world: Any) -> list[Any] | None:
        return self.actions.popleft() if self.actions else None


class Guide(_TapeWorld):
    """Writes a world tape from an explorer counterexample (see above): ``steps`` are its actions,
    each with the frame it moves (None for the others)."""

    def __init__(self, xworld: XWorld, steps: list[Step], lost: list[Frame] | None = None) -> None:
        super().__init__(xworld)
        self.steps = deque(steps)
        self.lost = list(lost or ())  # frames in flight when a liveness violation showed: they never arrive
        self.offset = 0.0  # the world's clock minus the explorer's, at the last message both moved
        self.actions: list[list[Any]] = []
        self.uids: dict[tuple[int, int, int, int], int] = {}  # (engine, node, server, explorer uid) -> world uid
        self.taken: set[tuple[str, str, int]] = set()
        self.looking: float | None = None  # since when the guide looks for the next action's message
        self.held: set[str] = set()  # requests the world's scheduler keeps waiting until their allocation

    def _emit(self, action: list[Any]) -> list[Any]:
        self.actions.append(action)
        return action

    def next_action(self, world: Any) -> list[Any] | None:
        while self.steps:
            kind, arg, frame, now, what = self.steps[0]
            if kind == "tick" and world.now() < arg + self.offset and world.timeline.next_time() <= arg + self.offset:
                return self._emit(["tick"])  # the explorer's clock moved: the world's follows
            if frame is not None:
                packet = self._match(world, frame)
                if packet is None:
                    own = next((p for p in world.net.bag or () if _world_only(self.xworld, p)), None)
                    if own is not None:
                        from mpcache.sim.world import packet_text

                        return self._emit(["deliver", own.pid, packet_text(own)])
                    if self.looking is None:
                        self.looking = world.now()
                    if world.now() > self.looking + WORLD_TAPE_WAIT or world.timeline.next_time() == math.inf:
                        from mpcache.sim.world import TapeError

                        raise TapeError(f"no message in the world carries the explorer's frame {frame.kind} "
                                        f"{node_name(frame.node, frame.engine)}/server{frame.server} "
                                        f"#{frame.corr} {short(frame.body, 80)}")
                    return self._emit(["tick"])
                self.looking = None
                self.offset = world.now() - now
                self.steps.popleft()
                from mpcache.sim.world import packet_text

                return self._emit([kind, packet.pid, packet_text(packet)])
            self.steps.popleft()
            if kind == "restart":
                return self._emit(["restart", arg])
            if kind == "crash":
                return self._emit(["crash", arg])
            if kind == "op" and self.xworld.ops > 1:
                from mpcache.sim.world import TapeError

                raise TapeError("a second worker retrieve: the world's one request plans one")
            if kind == "abort":
                return self._emit(["abort", rid(*arg)])
            if kind == "step" and what == "matched" and self._waits_for_blocks(arg):
                self.held.add(rid(*arg))
                return self._emit(["hold", rid(*arg)])
            if kind == "step" and what == "alloc" and rid(*arg) in self.held:
                self.held.discard(rid(*arg))
                return self._emit(["unhold", rid(*arg)])
            if kind == "attack":  # the adversary's request, handled as it arrives
                what, e, r, s = arg
                return self._emit(["attack", what, e if what in INSTANCE_ATTACKS else rid(e, r), s])
            if kind in NO_WORLD_COUNTERPART:
                from mpcache.sim.world import TapeError

                raise TapeError(f"the explorer's {kind} {arg}: {NO_WORLD_COUNTERPART[kind]}")
            # tick, step, op: the world's clock, scheduler and workers take them as they come
        while self.lost:
            packet = self._match(world, self.lost.pop(0))
            if packet is not None:
                from mpcache.sim.world import packet_text

                return self._emit(["drop", packet.pid, packet_text(packet)])
        return None

    def _waits_for_blocks(self, arg: tuple[int, int]) -> bool:
        """Whether the explorer's clock moves between the request's answered match and its
        allocation: the world's scheduler, which allocates in the step the match is answered,
        must then keep it waiting as vLLM does while its block pool is short (``hold``, asking
        the planner again at every step) until the explorer allocates (``unhold``)."""
        for kind, other, _frame, _now, what in self.steps:
            if kind == "step" and other == arg and what == "alloc":
                return False
            if kind == "tick":
                return True
        return False

    def _match(self, world: Any, f: Frame) -> Any:
        from mpcache.sim.ports import ReplyMsg, RequestMsg
        from mpcache.sim.scenario import sched_name, server_name, worker_name

        node = worker_name(f.engine, 0) if f.node else sched_name(f.engine)
        key = (f.engine, f.node, f.server, f.corr)
        uid = self.uids.get(key)
        for p in world.net.bag or ():
            msg = p.message
            if f.kind == "rep":
                if (p.src.node == server_name(f.server) and p.dst.node == node and isinstance(msg, ReplyMsg)
                        and uid is not None and msg.correlation == uid):
                    return p
                continue
            if p.src.node != node or p.dst.node != server_name(f.server) or not isinstance(msg, RequestMsg):
                continue
            if uid is not None:
                if msg.correlation == uid:
                    return p
                continue
            if (_kind_of(msg.request) != _kind_of(f.body) or request_id_of(msg.request) != request_id_of(f.body)
                    or (node, p.dst.node, msg.correlation) in self.taken):
                continue
            self.uids[key] = msg.correlation
            self.taken.add((node, p.dst.node, msg.correlation))
            return p
        return None


def _kind_of(request: Any) -> str:
    """A request's kind as the two worlds compare them: a status query by polling or by wait is
    one (the world's connector asks the way its profile does)."""
    name = type(request).__name__
    return "status" if name in ("QueryPrefetchStatus", "WaitPrefetchStatus") else name


# an explorer action, the frame it moves, the explorer's clock before it and, for a script's step,
# which one ("matched": a match the planner answered)
Step = tuple[str, Any, "Frame | None", float, str]


def explorer_steps(tape: dict[str, Any], profile: Any) -> tuple[list[Step], list[Frame]]:
    """The tape's explorer actions, each with the frame it moves and the explorer's clock before
    it, from a replay in the explorer; and the frames still in flight at its end."""
    world = XWorld(**tape["world"])
    ex = Explorer(world, profile)
    st = ex.initial()
    steps: list[Step] = []
    for kind, arg in tape["actions"]:
        action = (kind, tuple(arg) if isinstance(arg, list) else arg)
        frame = st.frames[int(arg)] if kind in ("deliver", "drop", "dup") else None
        was = st.scripts[arg[0]][arg[1]] if kind == "step" else 0
        now = st.now
        st = st.child()
        violation = ex.apply(st, action)
        what = ""
        if kind == "step":
            what = ex.script[was]
            if what == "match" and st.scripts[arg[0]][arg[1]] > was:
                what = "matched"  # answered (a match not answered yet is asked again)
        steps.append((kind, action[1], frame, now, what))
        if violation is not None:
            break
        st.owned = set()
    return steps, list(st.frames)


def tape_profile(profile: Any, world: XWorld) -> Any:
    """``profile`` with the explorer world's settings of the machines it builds: status by wait or
    by polling, the server's TTLs, job cap and reaper (none unless the world has one) and the
    planner's lease renewals, as ``Explorer`` builds them."""
    p = copy.copy(profile)
    p.lookup_status_wait = world.wait
    p.instance_ttl = world.instance_ttl
    server_config = p.server_config
    p.server_config = lambda cfg: attrs.evolve(server_config(cfg), tombstone_ttl=1.0, max_jobs=world.max_jobs)
    make_planner = p.make_planner

    def planner(cfg: Any) -> Any:
        machine = make_planner(cfg)
        machine.config = attrs.evolve(machine.config, max_lease_renewals=world.lease_renewals)
        return machine

    p.make_planner = planner
    return p


def run_tape_world(xworld: XWorld, director: Any, profile: Any, keep_lines: bool = True) -> tuple[Violation | None, Any]:
    """Run the scripted world: its violation (or None) and the world. A tape that does not fit
    the world (``TapeError``) is no violation; its reason is the trace's last line."""
    from mpcache.sim.runner import run_world
    from mpcache.sim.world import TapeError, World

    w = World(world_scenario(xworld), tape_profile(profile, xworld), keep_lines=keep_lines, director=director)
    violation: Violation | None = None
    try:
        violation = run_world(w)
    except TapeError as exc:
        w.trace.line(w.now(), "-", f"TAPE {exc}")
    return violation, w


def world_tape(tape: dict[str, Any], profile: Any) -> dict[str, Any]:
    """The world's part of an explorer tape: its actions (written by the ``Guide``) and the
    violation the world shows with them (None: none, or the guide found no way)."""
    xworld = XWorld(**tape["world"])
    steps, in_flight = explorer_steps(tape, profile)
    # a liveness violation: what was still in flight then never arrives (slow past every bound)
    guide = Guide(xworld, steps, in_flight if tape["violation"]["code"] in ("F1", "LIVENESS") else [])
    violation, _w = run_tape_world(xworld, guide, profile, keep_lines=False)
    return {"actions": guide.actions,
            "violation": None if violation is None else {"code": violation.code, "message": violation.message}}


def replay_world_tape(tape: dict[str, Any], profile: Any) -> tuple[Violation | None, Any]:
    """Run a tape's ``sim_world`` actions in ``sim.World``: its violation (or None) and the
    world (its timeline in ``trace.lines``)."""
    xworld = XWorld(**tape["world"])
    return run_tape_world(xworld, TapePlayer(xworld, tape["sim_world"]["actions"]), profile)
