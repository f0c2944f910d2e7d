"""The engine-facing side of mpcache, importable without vLLM.

Two shells around core_sm machines, in the order an engine step uses them:

* ``SchedulerAdapter`` (scheduler process): core_sm's ``StepPlanner`` (which owns the
  ``LookupClient``) over one or more servers. Its methods carry vLLM's scheduler calls as planner
  events and return what the planner answers; it decides nothing itself. ``StepPlan`` (core_sm)
  is the per-step metadata the workers receive (plain, picklable). Never blocks.
* ``WorkerAdapter`` (worker process): stores and retrieves over one server, a thin shell around
  core_sm's ``TransferClient``; for CPU engines it maps the server's L1 segment and copies blocks
  itself (engine-driven) with the ``kernels`` CPU gather/scatter.

The vLLM connector (``mpcache.runtime_zmq.vllm_connector``) only translates vLLM objects into calls on
these classes, so tests can drive them in vLLM's exact call order with no vLLM installed.
"""
from __future__ import annotations

import functools
import logging
import mmap
import os
import queue
import secrets
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from mpcache.core_sm.blocks import chunk_copies
from mpcache.core_sm.effects import CopyBlocks, SendRequest
from mpcache.core_sm.errors import ErrorKind, ProtocolError, refusal
from mpcache.core_sm.keys import NO_EXTRAS, KeyExtras
from mpcache.core_sm.client_config import (
    ConnectorSettings,
    lookup_client_config,
    server_for_rank,
    transfer_op_timeout,
)
from mpcache.core_sm.lookup_client import LookupClient
from mpcache.core_sm.kv_groups import KVGroup, group_retrieve_skip, several, split_group_blocks
from mpcache.core_sm.messages import (
    CopyFinished,
    EngineFinished,
    RegisterInstance,
    ReplyReceived,
    RequestFailed,
    Retrieve,
    ServerEpoch,
    ServerHealth,
    Store,
    SubmitRetrieve,
    SubmitStore,
    TimerFired,
    TransferKind,
    TransferPlan,
)
from mpcache.core_sm.planner import (
    BlocksAllocated,
    MatchAnswer,
    MatchRequest,
    PlannerConfig,
    RequestFinished,
    RequestTracker,
    ScheduledRequest,
    StepPlan,
    StepPlanner,
    StepScheduled,
)
from mpcache.core_sm.transfer_client import TransferClient, TransferClientConfig
from mpcache.runtime_zmq.wire import PlanMemory, plan_memory_from_wire, request_to_wire, result_from_wire
from mpcache.runtime_zmq.client import MPCacheClient, RemoteError, server_url
from mpcache.runtime_zmq.recorder import MachineRecord, recording

log = logging.getLogger("mpcache.worker")

# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------

CONFIG_PREFIX = "mpcache."


def _parse_urls(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        parts = [part.strip() for part in value.split(",")]
    elif isinstance(value, (list, tuple)):
        parts = [str(part).strip() for part in value]
    else:
        raise ValueError(f"{CONFIG_PREFIX}server_urls: expected a list or a comma-separated string, got {value!r}")
    urls = tuple(server_url(part) for part in parts if part)
    if not urls:
        raise ValueError(f"{CONFIG_PREFIX}server_urls: no server given")
    return urls


@attrs.frozen
class ConnectorConfig:
    """The connector's settings, read from ``kv_connector_extra_config`` keys ``mpcache.*``.

    * ``server_urls``: one URL per server (``tcp://host:port`` or ``ipc:///path``); a list or a
      comma-separated string; ``host:port`` gets ``tcp://``. Several servers: every lookup goes
      to all of them (the hit is the minimum); worker rank ``r`` stores to and loads from server
      ``r * len(server_urls) // world_size``.
    * ``request_timeout_s``: a request with no reply after this long fails (lookup → 0 hits,
      retrieve → load error, store → dropped).
    * ``connect_timeout_s``: how long the first contact (chunk size) may take at start. A server
      that has not answered by then is down: vLLM starts anyway, its lookups miss and its stores
      are dropped until the server's heartbeat answers (the worker then registers); the chunk
      size is ``chunk_size`` if set, else the server default 256.
    * ``connect_strict``: refuse to start instead, with an error that names the URL.
    * ``chunk_size``: if set, the chunk size the servers must report (a safety check).
    * ``store_decode_tokens``: also store chunks completed by generated tokens (default: only
      prompt chunks).
    * ``model_identity``: a string that names the model's weights fleet-wide (a checkpoint
      digest or release tag); part of every chunk key, so engines whose weights differ under
      one model name never share KV.
    * ``lookup_wait_ms``: how long vLLM's scheduler may wait for a new request's lookup answer
      before answering "not yet" (which costs the request an engine step); an L1 answer takes
      well under 1 ms. 0: never wait.
    * ``lookup_wait_idle_ms``: while the engine is idle (nothing ran in its last step and no
      request holds blocks), each scheduling step may wait this long for pending lookups:
      blocking then delays no one, and a lookup that reads L2 takes tens of ms, which vLLM
      would otherwise spin empty steps through
      (``core_sm.planner.PlannerConfig.lookup_wait_idle``). 0: as ``lookup_wait_ms``.
    * ``lookup_status_wait``: ask for a lookup's result with WAIT_PREFETCH_STATUS, which the
      server answers the moment the lookup (an L2 read included) is done, instead of polling
      QUERY_PREFETCH_STATUS every 5 ms.
    * ``lookup_answer_in_ack``: each LOOKUP asks the server for its hit count in the ack, so an
      L1 hit (no L2 read) is answered in one round trip instead of two (LOOKUP, then the status
      query). A lookup that reads L2, or a server that does not know the request, is acked
      without a count and asked for its status as before. Default on.
    * ``sync_load_max_tokens``: loads of at most this many tokens finish within the step that
      schedules the request (vLLM's synchronous load) instead of a later one. 0: always
      asynchronous. Not set: the planner's default for the engine's device
      (``core_sm.planner.default_sync_load_max_tokens``: every load on CPU, none on GPU).
    * ``lease_ttl_s``: the servers' ``--lease-ttl`` (default 300, as theirs). A request that
      waits in vLLM's queue renews its hit's read leases every half of it and loads only while
      a quarter is left; set it no higher than the servers' (lower only renews more often).
    """

    server_urls: tuple[str, ...] = attrs.field(default=("tcp://127.0.0.1:5555",), converter=_parse_urls)
    request_timeout_s: float = attrs.field(default=5.0, converter=float)
    connect_timeout_s: float = attrs.field(default=5.0, converter=float)
    chunk_size: int | None = attrs.field(default=None, converter=attrs.converters.optional(int))
    store_decode_tokens: bool = attrs.field(default=False)
    connect_strict: bool = attrs.field(default=False)
    model_identity: str = attrs.field(default="", converter=str)
    lookup_wait_ms: float = attrs.field(default=5.0, converter=float)
    lookup_wait_idle_ms: float = attrs.field(default=50.0, converter=float)
    lookup_status_wait: bool = attrs.field(default=True)
    lookup_answer_in_ack: bool = attrs.field(default=True)
    sync_load_max_tokens: int | None = attrs.field(default=None, converter=attrs.converters.optional(int))
    lease_ttl_s: float = attrs.field(default=300.0, converter=float)

    @lookup_wait_ms.validator
    @lookup_wait_idle_ms.validator
    def _wait(self, attribute: attrs.Attribute[float], value: float) -> None:
        if not 0 <= value <= 1000:
            raise ValueError(f"{CONFIG_PREFIX}{attribute.name} must be between 0 and 1000, got {value}")

    @sync_load_max_tokens.validator
    def _sync(self, attribute: attrs.Attribute[int | None], value: int | None) -> None:
        if value is not None and value < 0:
            raise ValueError(f"{CONFIG_PREFIX}{attribute.name} must be >= 0, got {value}")

    @request_timeout_s.validator
    @connect_timeout_s.validator
    @lease_ttl_s.validator
    def _positive(self, attribute: attrs.Attribute[float], value: float) -> None:
        if not value > 0:
            raise ValueError(f"{CONFIG_PREFIX}{attribute.name} must be > 0, got {value}")

    @store_decode_tokens.validator
    @connect_strict.validator
    @lookup_status_wait.validator
    @lookup_answer_in_ack.validator
    def _boolean(self, attribute: attrs.Attribute[bool], value: object) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"{CONFIG_PREFIX}{attribute.name} must be true or false, got {value!r}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Read the ``mpcache.*`` keys; an unknown ``mpcache.`` key is an error (a typo must not
        silently fall back to a default)."""
        known = {field.name for field in attrs.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in (extra or {}).items():
            if not key.startswith(CONFIG_PREFIX):
                continue
            name = key[len(CONFIG_PREFIX):]
            if name not in known:
                raise ValueError(
                    f"unknown kv_connector_extra_config key {key!r}; known: "
                    + ", ".join(sorted(CONFIG_PREFIX + k for k in known))
                )
            kwargs[name] = value
        return cls(**kwargs)

    def settings(self) -> ConnectorSettings:
        """What these settings say to the client machines (core_sm's configuration builder)."""
        return ConnectorSettings(request_timeout=self.request_timeout_s, lookup_status_wait=self.lookup_status_wait,
                                 lookup_answer_in_ack=self.lookup_answer_in_ack)

    def server_for_rank(self, rank: int, world_size: int) -> str:
        """The server a worker rank stores to and loads from (core_sm's placement, which the
        scheduler's lookups follow too)."""
        return self.server_urls[server_for_rank(rank, world_size, len(self.server_urls))]


# --------------------------------------------------------------------------------------------
# The runtime under both adapters: core_sm effects → ZMQ requests, replies → core_sm events
# --------------------------------------------------------------------------------------------


class ServerUnreachable(ConnectionError):
    """The connector could not reach an mpcache server when it started."""
# How far past the transfer machine's own bound (``TransferClient.settled_by``) the worker still
# waits for a step's synchronous loads: a few pump intervals (the wait pumps every 50 ms).
_SETTLE_SLACK_S = 0.5
# Timer firings one pump makes at most while the machine's next deadline stays due.
_TIMER_ROUNDS = 8


class _ServerLinks:
    """One ``MPCacheClient`` per server, index = core_sm's ``server`` number.

    ``send`` turns a ``SendRequest`` effect into a request whose completion (reply, error reply,
    timeout, server declared unhealthy) becomes exactly one ``ReplyReceived`` or
    ``RequestFailed`` event; health changes become ``ServerHealth`` events, the server's start id
    (first seen, then every change: a restart) ``ServerEpoch`` events. Events are queued by
    the client thread and handed to the owner's machine by ``drain`` on the owner's thread, so a
    machine is only ever touched by one thread at a time (the owner holds its lock).
    """

    def __init__(self, urls: Sequence[str], config: ConnectorConfig) -> None:
        self.urls = tuple(urls)
        self._events: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._timeout = config.request_timeout_s
        self._plan_segments: dict[int, PlanMemory] = {}
        self._plan_lock = threading.Lock()
        # Server-driven (GPU) engines: the registration's memory fields and the event source.
        self.gpu_registration: dict[str, Any] | None = None
        self.record_event: Any = None
        self.clients = []
        try:
            for index, url in enumerate(self.urls):
                client = MPCacheClient(
                    url,
                    request_timeout=config.request_timeout_s,
                    connect_timeout=config.connect_timeout_s,
                    wait_connected=False,
                )
                self.clients.append(client)
                client.on_epoch(functools.partial(self._on_epoch, index))
                client.on_health(functools.partial(self._on_health, index))
                if client.epoch is not None:
                    # learned before the callback was registered (repeating it is harmless)
                    self._on_epoch(index, client.epoch)
            for url, client in zip(self.urls, self.clients):
                if not client.wait_healthy(config.connect_timeout_s):
                    message = (
                        f"mpcache server at {url} did not answer within {config.connect_timeout_s:g} s "
                        f"(mpcache.connect_timeout_s); start it first, e.g. `mpcache-server --port "
                        f"{url.rsplit(':', 1)[-1] if url.startswith('tcp://') else 'PORT'}`, or fix "
                        f"mpcache.server_urls"
                    )
                    if config.connect_strict:
                        raise ServerUnreachable(message)
                    log.warning("%s; starting without it: its lookups miss until it answers "
                                "(mpcache.connect_strict: refuse to start instead)", message)
        except BaseException:
            self.close()
            raise

    def _on_health(self, server: int, healthy: bool) -> None:
        self._events.put(ServerHealth(server, healthy))

    def _on_epoch(self, server: int, epoch: int | str) -> None:
        # A changed start id: the server restarted (core_sm fails what was in flight on it and
        # registers again), even if no heartbeat was lost.
        self._events.put(ServerEpoch(server, epoch))

    def call(self, server: int, op: str, *args: Any) -> Any:
        """A blocking request (start-up only: chunk size, registration)."""
        return self.clients[server].call(op, *args, timeout=self._timeout)

    def send(self, effect: Any) -> None:
        request = effect.request
        if isinstance(request, (Store, Retrieve)):
            # Server-driven (GPU): the wire carries the engine's interprocess event as well.
            if self.record_event is None:
                raise RuntimeError("server-driven transfer without a registered GPU cache")
            op, args = request_to_wire(request, event_handle=self.record_event())
        elif isinstance(request, RegisterInstance) and not request.engine_driven:
            # The machine's (re-)registration names the engine; the runtime adds the memory.
            op, args = request_to_wire(request, layout_extra=self.gpu_registration)
        else:
            op, args = request_to_wire(request)
        future = self.clients[effect.server].submit(op, *args, timeout=self._timeout)
        future.add_done_callback(lambda done, effect=effect: self._completed(effect, done))

    def _completed(self, effect: Any, future: Any) -> None:
        try:
            value = future.result()
        except RemoteError as exc:  # the server's refusal or the link's verdict, by its kind's name
            self._events.put(RequestFailed(effect.server, effect.correlation, refusal(exc.kind, exc.message)))
            return
        except Exception as exc:  # closed client, cancelled future: the request is lost
            self._events.put(
                RequestFailed(effect.server, effect.correlation, ProtocolError(ErrorKind.UNHEALTHY, repr(exc)))
            )
            return
        try:
            result = result_from_wire(effect.request, value)
            memory = plan_memory_from_wire(value) if isinstance(result, TransferPlan) and result.ok else None
        except Exception as exc:
            self._events.put(
                RequestFailed(effect.server, effect.correlation, ProtocolError(ErrorKind.UNDECODABLE, repr(exc)))
            )
            return
        if memory is not None:
            # Recorded before the machine sees the plan: its copy maps the plan's segment.
            with self._plan_lock:
                self._plan_segments[result.transfer_id] = memory
                while len(self._plan_segments) > 4096:  # plans never copied (refused, abandoned)
                    self._plan_segments.pop(next(iter(self._plan_segments)))
        self._events.put(ReplyReceived(effect.server, effect.correlation, result))

    def plan_segment(self, transfer_id: int) -> PlanMemory | None:
        """The memory of an engine-driven plan received (taken once)."""
        with self._plan_lock:
            return self._plan_segments.pop(transfer_id, None)

    def drain(self, wait: float = 0.0) -> list[object]:
        """The queued events; with ``wait > 0``, first block up to that long for one to arrive
        (a caller waiting on a reply sleeps on the queue, it does not spin)."""
        events = []
        if wait > 0:
            try:
                events.append(self._events.get(timeout=wait))
            except queue.Empty:
                return events
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                return events

    def healthy(self, server: int) -> bool:
        return bool(self.clients[server].healthy)

    def close(self) -> None:
        for client in self.clients:
            client.close()


class _MachineShell:
    """Owns one core_sm machine: every event goes through ``_handle`` under one lock, the
    machine's runtime effects (``SendRequest``, ``CopyBlocks``) are performed at once, and
    ``_pump`` feeds it the queued completions and its timer. The machine never runs on the
    client thread. ``_handle`` returns the machine's answers (planner effects) to the caller."""

    def __init__(self, links: _ServerLinks, machine: Any, clock: Any) -> None:
        self._links = links
        self._machine = machine
        self._clock = clock
        self._lock = threading.RLock()
        self._record: MachineRecord | None = None  # MPCACHE_RECORD (runtime_zmq.recorder)

    def _handle(self, event: object) -> list[Any]:
        """Feed a caller's event, after the queued ones: they happened before this call (a link
        that saw its server come back, or go down, before vLLM submitted this step's loads), and
        a machine fed them later would decide the call on a view it no longer holds."""
        with self._lock:
            for queued in self._links.drain():
                self._apply(self._feed(queued, self._clock()))
            return self._apply(self._feed(event, self._clock()))

    def _feed(self, event: object, now: float) -> list[Any]:
        """The machine's ``handle`` (the one call every event goes through, recorded when asked)."""
        effects: list[Any] = self._machine.handle(event, now)
        if self._record is not None:
            self._record.step(now, event, effects)
        return effects

    def _apply(self, effects: Iterable[Any]) -> list[Any]:
        answers = []
        for effect in effects:
            if isinstance(effect, SendRequest):
                self._links.send(effect)
            elif isinstance(effect, CopyBlocks):
                self._copy(effect)
            elif isinstance(effect, (MatchAnswer, StepPlan)):
                answers.append(effect)
            else:
                raise TypeError(f"unexpected effect {effect!r} from {type(self._machine).__name__}")
        return answers

    def _copy(self, effect: Any) -> None:
        raise TypeError(f"{type(self).__name__} does not copy blocks")

    def _pump(self, wait: float = 0.0) -> None:
        with self._lock:  # drained under the lock too: two threads must not reorder completions
            for event in self._links.drain(wait):
                self._apply(self._feed(event, self._clock()))
            # every timer due now fires (a timer's work may arm another already due: a load given
            # up on after its fence's end has passed), bounded in case a deadline never moves
            for _ in range(_TIMER_ROUNDS):
                deadline = self._machine.next_deadline()
                now = self._clock()
                if deadline is None or deadline > now:
                    break
                self._apply(self._feed(TimerFired(), now))


class SchedulerAdapter(_MachineShell):
    """vLLM's scheduler calls on core_sm's ``StepPlanner`` over every configured server.

    Each method is one planner event in vLLM's words and returns the planner's answer; see
    ``mpcache.core_sm.planner`` for what they mean (hits, loadable tokens, lease ranges, plans,
    preemption). A server that is down counts as a miss until its heartbeat answers again.
    Thread-safe; never blocks after ``connect``."""

    def __init__(self, links: _ServerLinks, machine: StepPlanner, clock: Any = None) -> None:
        super().__init__(links, machine, clock or time.monotonic)
        self.planner = machine
        self._record = recording("planner", self._clock(), {"planner": machine.config,
                                                            "lookup_client": machine.lookups.config})
        for server in range(len(links.urls)):
            self._handle(ServerHealth(server, links.healthy(server)))

    @classmethod
    def connect(cls, config: ConnectorConfig, *, model_name: str, world_size: int, block_size: int,
                load: bool = True, store: bool = True, cpu_engine: bool = False,
                kv_groups: tuple[KVGroup, ...] = ()) -> SchedulerAdapter:
        """Connect to every server and agree on the chunk size; raises ``ServerUnreachable`` (a
        ``ConnectionError``) naming the server that did not answer, ``ValueError`` if the servers
        disagree on the chunk size or it is not a multiple of ``block_size``. ``load`` /
        ``store``: vLLM's kv_role (consumer / producer). ``cpu_engine``: the workers' KV is in
        host memory (the default of ``sync_load_max_tokens``)."""
        links = _ServerLinks(config.server_urls, config)
        try:
            chunk_size = _agreed_chunk_size(links, config.chunk_size)
            if config.chunk_size is not None and config.chunk_size != chunk_size:
                raise ValueError(f"mpcache.chunk_size is {config.chunk_size} but the server uses {chunk_size}")
            lookups = LookupClient(lookup_client_config(config.settings(), num_servers=len(links.urls),
                                                        model_name=model_name, world_size=world_size,
                                                        chunk_size=chunk_size))
            planner_config = PlannerConfig(chunk_size, block_size, store_decode_tokens=config.store_decode_tokens,
                                           load=load, store=store, lookup_wait=config.lookup_wait_ms / 1000.0,
                                           lookup_wait_idle=config.lookup_wait_idle_ms / 1000.0,
                                           cpu_engine=cpu_engine, lease_ttl=config.lease_ttl_s, kv_groups=kv_groups)
            if config.sync_load_max_tokens is not None:
                planner_config = attrs.evolve(planner_config, sync_load_max_tokens=config.sync_load_max_tokens)
            planner = StepPlanner(planner_config, lookups)
            return cls(links, planner)
        except BaseException:
            links.close()
            raise

    @property
    def chunk_size(self) -> int:
        return int(self.planner.config.chunk_size)

    def tracker(self, request_id: str) -> RequestTracker | None:
        with self._lock:
            return self.planner.tracker(request_id)

    def get_num_new_matched_tokens(
        self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, num_computed_tokens: int,
        cache_salt: str = "", extras: KeyExtras = NO_EXTRAS, *, max_load_tokens: int | None = None,
        max_offload_tokens: int | None = None,
    ) -> tuple[int | None, bool]:
        self._pump()
        event = MatchRequest(request_id, token_ids, num_prompt_tokens, num_computed_tokens, cache_salt or "",
                             extras, max_load_tokens, max_offload_tokens)
        while True:
            answer = next((a for a in self._handle(event) if isinstance(a, MatchAnswer)), None)
            if answer is None:
                return 0, False  # the planner failed internally (counted): compute everything
            left = -1.0 if answer.wait_until is None else answer.wait_until - self._clock()
            if answer.tokens is not None or left <= 0:
                return answer.tokens, answer.load_async
            # The planner allows a short wait for the lookup's answer: sleep on the reply queue
            # (bounded by the machine's own timer), then ask the same question again.
            deadline = self.planner.next_deadline()
            if deadline is not None:
                left = min(left, max(deadline - self._clock(), 0.0))
            self._pump(wait=max(left, 1e-4))

    def update_state_after_alloc(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int,
                                 other_group_block_ids: Sequence[Sequence[int]] = ()) -> None:
        """``block_ids``: the request's blocks (of the first KV-cache group);
        ``other_group_block_ids``: with several groups, those of the others, one list per group."""
        self._handle(BlocksAllocated(request_id, tuple(block_ids), num_external_tokens,
                                     tuple(tuple(g) for g in other_group_block_ids)))

    def build_plan(self, scheduled: Iterable[ScheduledRequest], preempted: Iterable[str] = ()) -> StepPlan:
        # Every step, even one that matches no request (a full scheduler): the planner's timer
        # renews the leases of requests waiting in the queue.
        self._pump()
        for answer in self._handle(StepScheduled(tuple(scheduled), tuple(preempted))):
            if isinstance(answer, StepPlan):
                return answer
        return StepPlan()  # the planner failed internally (counted): this step moves nothing

    def request_finished(self, request_id: str) -> bool:
        """Always True: the worker reports every finished request once in ``sending`` when
        none of its transfers is in flight any more, and only then may vLLM free its blocks."""
        self._pump()
        self._handle(RequestFinished(request_id))
        return True

    def poll(self) -> None:
        """Feed the machine what arrived (replies, health changes, its timer)."""
        self._pump()

    def close(self) -> None:
        self._links.close()


DEFAULT_CHUNK_SIZE = 256  # mpcache-server's default --chunk-size


def _agreed_chunk_size(links: _ServerLinks, configured: int | None = None) -> int:
    """The chunk size every reachable server reports; with none reachable (lazy start), the
    configured one or the server default."""
    up = [server for server in range(len(links.urls)) if links.healthy(server)]
    sizes = [int(links.call(server, "get_chunk_size")) for server in up]
    if len(set(sizes)) > 1:
        detail = ", ".join(f"{links.urls[server]}: {size}" for server, size in zip(up, sizes))
        raise ValueError(f"mpcache servers disagree on the chunk size ({detail}); start them with the same --chunk-size")
    if sizes:
        return sizes[0]
    chunk_size = configured if configured is not None else DEFAULT_CHUNK_SIZE
    log.warning("no mpcache server reachable yet: assuming chunk size %d (set mpcache.chunk_size to the "
                "servers' --chunk-size if it differs)", chunk_size)
    return chunk_size


class WorkerAdapter(_MachineShell):
    """Worker-side stores and retrieves over this rank's server (core_sm ``TransferClient``).

    CPU engines (host KV tensors in vLLM's CPU layout ``[NB, NH, BS, 2*HS]``) use the
    engine-driven path: the machine's ``CopyBlocks`` effects run the ``kernels`` CPU gather (store)
    or scatter (retrieve) between the engine's blocks and the L1 slots of the server's
    shared-memory segment, on the caller's thread.

    * ``register_kv_caches(kv_caches)``: registers the engine (blocking, errors raised here).
    * ``submit_stores(ops)`` returns once every store's blocks have been copied into L1 (or the
      store failed or was dropped), bounded by the request timeout, so the engine may reuse the
      blocks right after; the commit completes asynchronously.
    * ``submit_retrieves(ops)`` returns at once; ``poll`` and ``finished`` complete them; a
      synchronous one (``SubmitRetrieve.synchronous``) is complete when it returns.
    * ``finished(engine_finished_ids)`` → ``(sending, recving)``: the machine's report, each id
      once; every id the engine finished comes back in ``sending`` once nothing of it is in flight.
    * ``load_errors()`` → block ids whose load failed since the last call (the engine recomputes).
    """

    def __init__(self, links: _ServerLinks, *, chunk_size: int, model_name: str, world_size: int, rank: int, block_size: int, request_timeout_s: float, clock: Any = None) -> None:
        super().__init__(links, None, clock or time.monotonic)
        self.chunk_size = chunk_size
        self.model_name = model_name
        self.world_size = world_size
        self.rank = rank
        self.block_size = block_size
        self.request_timeout_s = request_timeout_s
        # Random, not derived from the pid: engines in different containers sharing one server
        # can have the same pid, and a registration replaces the one with the same id (F13).
        self.instance_id = secrets.randbits(63)
        self._transfers: list[Any] = []  # engine-driven: one CpuKVTransfer per part, over the L1 segment
        self._geometry: Any = None
        self._layers: list[Any] = []
        # engine-driven: (KV-cache group or None for the only one, its geometry, its layers, its
        # byte offset in an object): an object holds the groups' layers group after group
        self._parts: list[tuple[KVGroup | None, Any, list[Any], int]] = []
        self._segment: Any = None
        self._segment_path = ""
        self._slot_bytes = 0

    @classmethod
    def connect(cls, config: ConnectorConfig, *, model_name: str, world_size: int, rank: int, block_size: int) -> WorkerAdapter:
        """Connect to this rank's server; raises ``ServerUnreachable`` naming it if it does not
        answer within ``connect_timeout_s``, ``ValueError`` on a chunk size the engine's blocks
        do not divide."""
        links = _ServerLinks([config.server_for_rank(rank, world_size)], config)
        try:
            chunk_size = _agreed_chunk_size(links, config.chunk_size)
            if chunk_size % block_size:
                raise ValueError(
                    f"mpcache chunk size {chunk_size} is not a multiple of the engine block size {block_size}"
                )
            return cls(
                links,
                chunk_size=chunk_size,
                model_name=model_name,
                world_size=world_size,
                rank=rank,
                block_size=block_size,
                request_timeout_s=config.request_timeout_s,
            )
        except BaseException:
            links.close()
            raise

    @property
    def machine(self) -> Any:
        """The core_sm ``TransferClient`` (after ``register_kv_caches``)."""
        return self._machine

    # ------------------------------------------------------------------ registration

    def register_kv_caches(self, kv_caches: Mapping[str, Any], kv_groups: Sequence[KVGroup] = (),
                           group_layer_names: Sequence[Sequence[str]] = ()) -> None:
        """Register the engine's per-layer KV tensors (in layer order).

        Several KV-cache groups (``kv_groups``, CPU engines only; ``group_layer_names``: the
        layers of each): an object holds every group's layers, group after group, and each
        group's are copied with that group's blocks (an op carries them group after group,
        ``core_sm.kv_groups.join_group_blocks``).

        CPU tensors (vLLM's CPU layout): engine-driven, the worker copies. CUDA tensors (vLLM's
        ``[2, NB, BS, NH, HS]`` layout, or FlashInfer's ``[NB, 2, BS, NH, HS]``; an HND stride
        order is recognised): server-driven, the server opens them by CUDA IPC handle and copies
        after an interprocess event the worker records with each store / retrieve.
        Raises ``ValueError`` on an unexpected layout, the server's error (e.g. ``too_large``:
        a chunk does not fit an L1 slot) as ``RuntimeError``."""
        from mpcache.kernels.layouts import KVGeometry, PagedLayout

        layers = list(kv_caches.values())
        if not layers:
            raise ValueError("no KV cache tensors to register")
        first = layers[0]
        device = getattr(getattr(first, "device", None), "type", "cpu")
        if device == "cuda":
            self._register_gpu(layers)
            return
        if device != "cpu":
            raise NotImplementedError(f"KV caches on {device}: mpcache supports CPU and CUDA engines")
        shape = tuple(int(d) for d in first.shape)
        for name, layer in kv_caches.items():
            if tuple(int(d) for d in layer.shape) != shape or layer.dtype != first.dtype:
                raise ValueError(f"layer {name}: shape {tuple(layer.shape)} {layer.dtype} differs from {shape} {first.dtype}")
        if len(shape) != 4 or shape[3] % 2 or shape[2] != self.block_size:
            raise ValueError(
                f"expected vLLM's CPU layout [num_blocks, num_heads, block_size={self.block_size}, 2*head_size], got {shape}"
            )
        num_blocks, num_heads, block_size, two_head = shape

        def geometry_of(num_layers: int) -> KVGeometry:
            return KVGeometry(PagedLayout.CPU, num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                              num_heads=num_heads, head_size=two_head // 2, itemsize=int(first.element_size()),
                              chunk_tokens=self.chunk_size)

        parts: list[tuple[KVGroup | None, Any, list[Any], int]] = []
        if several(kv_groups):
            if len(group_layer_names) != len(kv_groups):
                raise ValueError(f"{len(group_layer_names)} lists of layer names for {len(kv_groups)} KV-cache groups")
            named = [name for names in group_layer_names for name in names]
            if sorted(named) != sorted(kv_caches):
                raise ValueError("the KV-cache groups' layers are not the KV caches registered")
            offset = 0
            for group, names in zip(kv_groups, group_layer_names):
                group_layers = [kv_caches[name] for name in names]
                part_geometry = geometry_of(len(group_layers))
                parts.append((group, part_geometry, group_layers, offset))
                offset += part_geometry.slot_bytes
            object_bytes = offset
        else:
            parts.append((None, geometry_of(len(layers)), layers, 0))
            object_bytes = parts[0][1].slot_bytes
        layout = {
            "model_name": self.model_name,
            "world_size": self.world_size,
            "object_bytes": object_bytes,
            "engine_driven": True,
        }
        # Registered once here so a refusal is an error at start, not silent misses later; the
        # machine registers again (idempotent) whenever the server comes back.
        self._register_at_start(layout)
        self._layers = layers
        self._geometry = parts[0][1]
        self._parts = parts
        self._warm_up_kernels()
        self._start_transfer_client(object_bytes, engine_driven=True)

    def _register_at_start(self, layout: dict[str, Any]) -> None:
        """Register now, so a refusal stops the engine at start with the server's reason; a server
        not reachable yet (lazy start) is registered by the machine when it answers."""
        if not self._links.healthy(0):
            log.warning("mpcache server %s is not reachable: the KV caches are registered when it answers",
                        self._links.urls[0])
            return
        try:
            self._links.call(0, "register_instance", self.instance_id, layout)
        except RemoteError as exc:
            raise RuntimeError(f"mpcache server {self._links.urls[0]} refused the KV cache registration: {exc}") from exc

    def _start_transfer_client(self, object_bytes: int, *, engine_driven: bool) -> None:
        """The worker's core_sm bookkeeping, once the KV caches are registered; it then learns
        the server's health (and registers the instance through core_sm)."""
        with self._lock:
            self._machine = TransferClient(
                TransferClientConfig(
                    instance_id=self.instance_id,
                    model_name=self.model_name,
                    world_size=self.world_size,
                    worker_id=self.rank,
                    chunk_size=self.chunk_size,
                    object_bytes=object_bytes,
                    engine_driven=engine_driven,
                    server=0,
                    op_timeout=transfer_op_timeout(ConnectorSettings(self.request_timeout_s)),
                )
            )
            self._record = recording("transfer_client", self._clock(), {"transfer_client": self._machine.config},
                                     {"rank": self.rank})
        self._handle(ServerHealth(0, self._links.healthy(0)))

    def _register_gpu(self, layers: list[Any]) -> None:
        import torch

        from mpcache.kernels.layouts import KVGeometry, PagedLayout
        from mpcache.runtime_zmq.gpu_ipc import device_uuid, export_event, export_kv_tensors

        name, views = _gpu_physical_layout(layers, self.block_size)
        first = views[0]
        shape = tuple(int(d) for d in first.shape)
        if name in ("nhd", "flashinfer"):
            num_heads, head_size = shape[3], shape[4]
        else:
            num_heads, head_size = shape[2], shape[4]
        num_blocks = shape[1] if name.startswith("nhd") or name == "hnd" else shape[0]
        geometry = KVGeometry(
            PagedLayout(name),
            num_layers=len(views),
            num_blocks=num_blocks,
            block_size=self.block_size,
            num_heads=num_heads,
            head_size=head_size,
            itemsize=int(first.element_size()),
            chunk_tokens=self.chunk_size,
        )
        ordinal = first.device.index if first.device.index is not None else torch.cuda.current_device()
        # One interprocess event, recorded on the engine's current stream before every store or
        # retrieve request: the server's copy waits on it (a later record only waits longer). Its
        # handle goes with the registration too, so the server opens it then, not on the first request.
        event = torch.cuda.Event(interprocess=True)
        event.record()
        handle = export_event(event)
        gpu_fields = {
            "kv_layout": name,
            "num_blocks": num_blocks,
            "block_size": self.block_size,
            "num_heads": num_heads,
            "head_size": head_size,
            "itemsize": int(first.element_size()),
            "device_uuid": device_uuid(ordinal),
            "tensors": export_kv_tensors(views),
            "event_handles": [handle],
        }
        layout = {
            "model_name": self.model_name,
            "world_size": self.world_size,
            "object_bytes": geometry.slot_bytes,
            "engine_driven": False,
            **gpu_fields,
        }
        self._register_at_start(layout)

        def record() -> bytes:
            event.record()
            return handle

        self._links.gpu_registration = gpu_fields
        self._links.record_event = record
        self._gpu_event = event
        self._layers = views
        self._geometry = geometry
        self._start_transfer_client(geometry.slot_bytes, engine_driven=False)

    @property
    def engine_driven(self) -> bool:
        return self._machine is not None and bool(self._machine.config.engine_driven)

    def _warm_up_kernels(self) -> None:
        """Load (or compile) the copy kernels now, not on the first request's critical path."""
        import numpy as np

        from mpcache.kernels.cpu import CpuKVTransfer

        bpc = self.chunk_size // self.block_size
        for _group, geometry, layers, _offset in self._parts:
            scratch = CpuKVTransfer(geometry, layers, np.zeros(geometry.slot_bytes, dtype=np.uint8))
            scratch.gather(np.zeros((0, bpc), dtype=np.int64), np.zeros(0, dtype=np.int64))
            scratch.scatter(np.zeros(0, dtype=np.int64), np.zeros((0, bpc), dtype=np.int64))

    def _map_segment(self, path: str, slot_bytes: int) -> None:
        """Map the server's L1 segment (again after a server restart: a new segment)."""
        import numpy as np

        from mpcache.kernels.cpu import CpuKVTransfer

        fd = os.open(path, os.O_RDWR)
        try:
            stat = os.fstat(fd)
            size = stat.st_size
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        view = np.frombuffer(mapping, dtype=np.uint8)
        transfers = [CpuKVTransfer(geometry, layers, view) for _group, geometry, layers, _offset in self._parts]
        old = self._segment
        self._segment, self._segment_path, self._slot_bytes, self._transfers = mapping, path, slot_bytes, transfers
        if stat.st_blocks * 512 >= size:
            # The server reserved the segment's memory: map its pages in now, off the request
            # path, so the first copies do not pay a page fault per 4 KiB. (A sparse segment,
            # --no-l1-reserve, is left alone: this would allocate all of it.)
            threading.Thread(target=self._prefault, args=(mapping, view), name="mpcache-prefault", daemon=True).start()
        if old is not None:
            try:
                old.close()
            except BufferError:  # a numpy view of it is still alive somewhere: leave it mapped
                pass

    def _prefault(self, mapping: mmap.mmap, view: Any) -> None:
        from mpcache.kernels.cpu import prefault

        t0 = time.monotonic()
        # ``view`` keeps the mapping open until this returns; it stops once a new segment replaced it.
        done = prefault(view, keep_going=lambda: self._segment is mapping)
        log.debug("mpcache: L1 segment pages mapped in %.0f ms (%s)", (time.monotonic() - t0) * 1e3,
                  "done" if done else "not supported by this kernel")

    # ------------------------------------------------------------------ per step

    def submit_retrieves(self, ops: Iterable[SubmitRetrieve]) -> None:
        """Submit the step's retrieves. The synchronous ones (``SubmitRetrieve.synchronous``: the
        step's forward reads their blocks) are complete when this returns -- copied, or failed
        into ``load_errors()`` -- bounded by the request timeout; the transfer machine never
        reports them in ``finished``'s recving (vLLM never waits for them)."""
        self._require_registered()
        waiting = set()
        for op in ops:
            self._handle(op)
            if op.synchronous:
                waiting.add(op.request_id)
        self._pump()
        if not waiting:
            return
        # The machine settles every load by a time it names (``settled_by``: its op timeouts and
        # late-copy fences; later as an op advances): the wait asks it each time it looks, after a
        # pump (so a timer due now has fired), and gives up only a pump interval past that bound,
        # which only a bug of the machine reaches.
        started = self._clock()
        while True:
            with self._lock:
                # A sync load's request has no other op yet: its ops are this step's retrieves.
                settled_by = self._machine.settled_by(waiting)
            if settled_by is None:
                return
            now = self._clock()
            if now > settled_by + _SETTLE_SLACK_S:
                log.error("mpcache: synchronous loads of %s still unsettled %.1f s after the machine's own bound "
                          "(%.1f s after they were submitted); their blocks may not be loaded", sorted(waiting),
                          now - settled_by, now - started)
                return
            self._pump(wait=min(max(settled_by + _SETTLE_SLACK_S - now, 0.001), 0.05))

    def submit_stores(self, ops: Iterable[SubmitStore]) -> None:
        self._require_registered()
        for op in ops:
            self._handle(op)
        if self.engine_driven:
            # Copy out of the blocks now: after this step vLLM may hand them to another request.
            self.wait_for_store_copies()

    def wait_for_store_copies(self) -> None:
        """Return once no store may still read engine blocks: engine-driven, every store got its
        plan (and was copied at once); server-driven, every STORE was answered (the server
        answers after its copy completed). Bounded by the request timeout (the machine fails
        the op then). Needed before vLLM reuses blocks (preemption)."""
        if self._machine is None:
            return
        deadline = time.monotonic() + self.request_timeout_s + 1.0
        self._pump()
        while True:
            with self._lock:
                if not self._machine.stores_reading_blocks():
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._pump(wait=min(left, 0.05))

    def poll(self) -> None:
        if self._machine is not None:
            self._pump()

    def finished(self, engine_finished_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        if self._machine is None:
            return set(), set()
        ids = tuple(sorted(engine_finished_ids))
        if ids:
            self._handle(EngineFinished(ids))
        self._pump()
        with self._lock:
            sending, recving = self._machine.finished()
        return set(sending), set(recving)

    def load_errors(self) -> set[int]:
        if self._machine is None:
            return set()
        with self._lock:
            return set(self._machine.load_errors())

    def failed_loads(self) -> set[str]:
        """Requests a retrieve of which failed since the last call (their blocks are in
        ``load_errors()``); clears. With several KV-cache groups vLLM takes a failure this way:
        block ids are per group and cannot name a request."""
        if self._machine is None:
            return set()
        with self._lock:
            return set(self._machine.failed_retrieves())

    def _require_registered(self) -> None:
        if self._machine is None:
            raise RuntimeError("register_kv_caches() must come before stores and retrieves")

    # ------------------------------------------------------------------ copies

    def _copy(self, effect: Any) -> None:
        ok = True
        try:
            memory = self._links.plan_segment(effect.transfer_id)
            if memory is None:
                raise RuntimeError(f"no segment known for transfer {effect.transfer_id}")
            path, slot_bytes = memory.segment, memory.slot_bytes
            if self._segment is None or self._segment_path != path or self._slot_bytes != slot_bytes:
                self._map_segment(path, slot_bytes)
            groups = [group for group, _g, _l, _o in self._parts]
            block_ids = (split_group_blocks(effect.block_ids, len(groups)) if len(groups) > 1
                         else (effect.block_ids,))
            for (group, _geometry, _layers, offset), transfer, blocks in zip(self._parts, self._transfers, block_ids):
                skip = effect.skip_first_n_tokens
                if group is not None and effect.direction is TransferKind.RETRIEVE:
                    # a window's blocks before its first live one are vLLM's null block: not written
                    skip = group_retrieve_skip(group, effect.start, effect.end, skip)
                copies = chunk_copies(effect.direction, effect.start, effect.end, effect.placements, blocks,
                                      skip, self.chunk_size, self.block_size)
                self._copy_part(transfer, effect.direction, copies, slot_bytes, offset)
        except Exception:
            log.exception("mpcache: copy for transfer %s failed", effect.transfer_id)
            ok = False
        self._apply(self._feed(CopyFinished(effect.op, ok), self._clock()))

    @staticmethod
    def _copy_part(transfer: Any, direction: TransferKind, copies: Sequence[Any], slot_bytes: int, offset: int) -> None:
        """One part's (all layers, or one KV-cache group's) copies; ``offset``: where the part
        starts in an object."""
        import numpy as np

        if copies and direction is TransferKind.STORE:
            transfer.gather(np.asarray([c.block_ids for c in copies], dtype=np.int64),
                            [c.slot * slot_bytes + offset for c in copies])
        elif copies and not any(c.skip_blocks for c in copies[1:]):
            # One kernel call for the whole retrieve (the skip is a prefix: only the first
            # chunk can keep leading blocks unwritten); a launch per chunk costs more than
            # the copy on a busy host.
            transfer.scatter([c.slot * slot_bytes + offset for c in copies],
                             np.asarray([c.block_ids for c in copies], dtype=np.int64), copies[0].skip_blocks)
        else:
            for copy in copies:
                transfer.scatter([copy.slot * slot_bytes + offset], np.asarray([copy.block_ids], dtype=np.int64),
                                 copy.skip_blocks)

    def close(self) -> None:
        try:
            if self._machine is not None:
                self._links.clients[0].submit("unregister_instance", self.instance_id)
        finally:
            self._links.close()
            self._transfers = []
            if self._segment is not None:
                try:
                    self._segment.close()
                except BufferError:
                    pass
                self._segment = None


def _gpu_physical_layout(layers: Sequence[Any], block_size: int) -> tuple[str, list[Any]]:
    """The kernels' name of vLLM's CUDA KV layout, and contiguous views in that physical order.

    vLLM hands each layer as a logical ``[2, NB, BS, NH, HS]`` (flash-attn) or
    ``[NB, 2, BS, NH, HS]`` (FlashInfer) tensor; an HND cache is the same logical shape with the
    ``NH`` and ``BS`` strides swapped."""
    first = layers[0]
    shape = tuple(int(d) for d in first.shape)
    if len(shape) != 5 or shape[2] != block_size or 2 not in shape[:2]:
        raise ValueError(
            f"expected vLLM's CUDA layout [2, num_blocks, block_size={block_size}, heads, head_size] "
            f"(or FlashInfer's [num_blocks, 2, ...]), got {shape}"
        )
    flashinfer = shape[0] != 2  # [NB, 2, ...]; vLLM's own layout leads with K/V
    for layer in layers:
        if tuple(int(d) for d in layer.shape) != shape or layer.dtype != first.dtype or layer.device != first.device:
            raise ValueError(f"KV layers differ: {tuple(layer.shape)} {layer.dtype} vs {shape} {first.dtype}")
    if all(layer.is_contiguous() for layer in layers):
        return ("flashinfer" if flashinfer else "nhd"), list(layers)
    swapped = [layer.transpose(2, 3) for layer in layers]
    if all(view.is_contiguous() for view in swapped):
        return ("flashinfer_hnd" if flashinfer else "hnd"), swapped
    raise ValueError("KV tensors are neither contiguous nor an HND permutation of their logical layout")
