"""Events the machines handle, and the result types that travel back.

Three groups:

* **Server requests** (``ServerRequest``): what a client sends; the ``LookupServer``'s events.
  Each carries ``reply_to``, an opaque hashable routing token chosen by the runtime (ZMQ: peer
  identity + uid + op; simulator: node + message id). A client machine emits a request with
  ``reply_to=None``; the runtime fills it in with ``attrs.evolve``. Every request gets exactly one
  ``Reply`` or ``ErrorReply`` carrying the same ``reply_to``.
* **Server internal events**: completions the server's runtime reports (a transfer, an L2 read,
  an L2 write) and ``TimerFired``.
* **Client events**: what the scheduler/worker runtime feeds ``LookupClient`` and
  ``TransferClient`` (calls from vLLM, replies and failures from the transport, health).

Constructors check shapes only (types are converted where cheap: token ids become a tuple).
Semantic checks (chunk alignment, cache_salt, worker_id range, registration) happen in
``handle`` and come back as a typed ``ErrorReply`` -- so a runtime that could build the event
never sees an exception from the machine. A runtime that cannot build an event from a wire
payload (``TypeError``/``ValueError`` from the constructor) answers ``ErrorKind.UNDECODABLE``.
"""
from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable
from typing import Union, get_args

import attrs

from mpcache.core_sm.chunks import TokenIds, as_token_ids
from mpcache.core_sm.errors import ProtocolError
from mpcache.core_sm.keys import NO_EXTRAS, KeyExtras

ReplyTo = Hashable
# Who sent a request, as the runtime knows it (ZMQ: the ROUTER identity of the connection;
# simulator: the node). Set by the runtime, never by a client; None: an in-process caller. What a
# request creates (a job, its leases, a plan, a transfer, a registration) belongs to its peer,
# and a request from another peer naming it is refused ``FORBIDDEN`` with nothing changed.
Peer = Hashable
# (chunk_index, slot): chunk_index counts from the start of the token sequence (token
# offset chunk_index * chunk_size); slot is an L1 slot id in [0, num_slots).
Placement = tuple[int, int]
# An operation of the transfer client: (request_id, sequence number within that request).
OpId = tuple[str, int]


def _int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _optional_int_tuple(value: Iterable[int] | None) -> tuple[int, ...] | None:
    return None if value is None else tuple(value)


def _placements(value: Iterable[tuple[int, int]]) -> tuple[Placement, ...]:
    return tuple((int(c), int(s)) for c, s in value)


def _non_negative(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, not {value}")


class TransferKind(enum.Enum):
    """Direction of a KV transfer, seen from L1: STORE = engine → L1, RETRIEVE = L1 → engine."""

    STORE = "store"
    RETRIEVE = "retrieve"


@attrs.frozen
class CacheKey:
    """LMCache's IPC cache key, as on its wire.

    ``worker_id`` is None for a scheduler-side key (it covers every KV rank), else the KV rank
    this worker stores/retrieves. ``token_ids`` is the request's full token sequence; the key
    addresses tokens ``[start, end)``. ``request_id`` is not part of the cache identity (it is
    the owner of leases and the job id); ``cache_salt`` is, and so are ``extras`` (LoRA adapter,
    KV dtype, model revision, multimodal / prompt-embedding hashes: ``mpcache.core_sm.keys``).

    ``token_ids`` is a ``mpcache.core_sm.chunks.TokenIds``: give packed little-endian uint32 ``bytes``
    (taken as is, as the wire delivers them) or a sequence of ints (packed once, here); keys
    built from either form of the same tokens are equal.
    """

    model_name: str
    world_size: int
    worker_id: int | None
    token_ids: TokenIds = attrs.field(converter=as_token_ids)
    start: int
    end: int
    request_id: str
    cache_salt: str = ""
    extras: KeyExtras = NO_EXTRAS


# ---------------------------------------------------------------------------------------------
# Server requests (the LookupServer's events)


@attrs.frozen
class Ping:
    """Heartbeat. Reply: ``True``. With ``instance_id`` (an engine instance's liveness, sent
    whatever its traffic): refreshes that registered instance so it is not reaped after
    ``ServerConfig.instance_ttl``; an unknown or reaped id is refused ``NOT_REGISTERED``. Without
    (LMCache's plain ping): names nothing."""

    instance_id: int | None = None
    reply_to: ReplyTo = attrs.field(default=None, kw_only=True)
    peer: Peer = attrs.field(default=None, kw_only=True)


@attrs.frozen
class GetChunkSize:
    """Reply: the server's chunk size in tokens (int)."""

    reply_to: ReplyTo = attrs.field(default=None, kw_only=True)
    peer: Peer = attrs.field(default=None, kw_only=True)


@attrs.frozen
class Lookup:
    """Scheduler-side LOOKUP (``key.worker_id`` None, ``key.start`` 0, ``key.end`` chunk-aligned).

    Leases the L1 prefix for ``key.request_id`` (``num_readers`` read counts per object: MLA with
    TP > 1 has several ranks reading one object), may start an L2 prefetch for the rest, registers
    the prefetch job. Reply: ``None`` (the ack). A duplicate for a live job is acked without new
    leases.

    ``ranks``: the KV ranks this server holds for the request (tensor-parallel ranks spread over
    several servers); a chunk hits when every one of those ranks is readable, and only those
    ranks are leased or read from L2. ``None``: every rank in ``[0, key.world_size)``. Empty,
    duplicated or out-of-range ranks are a VALIDATION error.

    ``answer_in_ack`` (mpcache's own; LMCache's clients never set it): the sender takes a hit
    count in place of the nil ack. A server that knows the count when it handles the lookup (the
    prefix is leased from L1 and no L2 step is needed or possible) replies with it, and the job
    is answered as a status query would have answered it (a later status query repeats the same
    count from its tombstone); otherwise the ack is ``None`` as always and the sender asks for
    the status. A server that does not know the field acks ``None``: the sender cannot tell it
    from a lookup whose count was not known yet.
    """

    key: CacheKey
    num_readers: int = attrs.field(default=1, validator=_non_negative)
    ranks: tuple[int, ...] | None = attrs.field(default=None, converter=_optional_int_tuple)
    answer_in_ack: bool = attrs.field(default=False, kw_only=True, validator=attrs.validators.instance_of(bool))
    reply_to: ReplyTo = attrs.field(default=None, kw_only=True)
    peer: Peer = attrs.field(default=None, kw_only=True)


def lookup_num_readers(num_kv_readers: int, tp_size: int | None, world_size: int) -> int:
    """``Lookup.num_readers`` for LMCache's wire fields: the key's ``num_kv_readers`` when it is
    given (> 0, later LMCache versions), else the April 2026 rule from the lookup's legacy
    ``tp_size`` payload (None when absent): ``tp = tp_size if tp_size > 1 else world_size``,
    ``1 + (tp - 1 if tp > world_size else 0)`` -- so MLA with TP > 1 (the key's world size is
    ``total / TP``) takes one read count per TP rank, everything else one."""
    if num_kv_readers > 0:
        return num_kv_readers
    tp = tp_size if tp_size is not None and tp_size > 1 else world_size
    return tp if tp > world_size else 1


@attrs.frozen
class QueryPrefetchStatus:
    """Reply: ``None`` while the job runs, the hit count in **chunks** when done, ``0`` if the id
    is unknown (never seen, reaped, ended, or the server restarted). Repeats after completion
    answer the same count from a tombstone."""

    request_id: str
    reply_to: ReplyTo = attrs.field(default=None, kw_only=True)
    peer: Peer = attrs.field(default=None, kw_only=True)


@attrs.frozen
class WaitPrefetchStatus:
    """Like ``QueryPrefetchStatus`` but a running job is answered when it completes, or with
    ``None`` after ``timeout`` seconds (no polling)."""

    request_id: str
    timeout: float
    reply_to: ReplyTo = attrs.field(default=None, kw_only=True)
    peer: Peer = attrs.field(default=None, kw_only=True)


@attrs.frozen
class FreeLookupLocks:
    """Release the read leases ``key.request_id``'s lookups took on chunks
    ``[floor(start/C), floor(end/C))`` (every rank). Only that request's leases; idempotent.
    Reply: ``None``. A range outside the token sequence (start > end, end > len(tokens)) is a
    VALIDATION error."""

    key: CacheKey
    reply_to: ReplyTo = attrs.field(default=None, kw_only=True)
    peer: Peer = attrs.field(default=None, kw_only=True)


@attrs.frozen
class EndSession:
    """Drop the request's job, tombstone and waiters (a waiter is answered ``0``) and release
    every lease the request still owns. Reply: ``None``."""

    request_id: str
    reply_to: ReplyTo = attrs.field(default=None, kw_only=True)
    peer: Peer = attrs.field(default=None, kw_only=True)


@attrs.frozen
class Clear:
    """Drop L1 objects. ``force=True``: every object, leased or not (lookup leases are released as
    CLEAR), except objects an in-flight transfer or L2 write is copying right now (kept with all
    their leases) and objects being written -- those finish normally. ``force=False``: only ready, unleased objects.
    Reply: ``None``."""

    force: bool = True
    reply_to: ReplyTo = attrs.field(default=None, kw_only=True)
    peer: Peer = attrs.field(default=None, kw_only=True)
    # Set by the runtime when the caller presented the admin credential: clear is refused
    # FORBIDDEN otherwise.
    admin: bool = attrs.field(default=False, kw_only=True)


@attrs.frozen
class RegisterInstance:
    """A worker (one KV rank of one engine) announces itself. ``object_bytes``: bytes of one
    chunk of one rank (must fit an L1 slot, else TOO_LARGE). ``engine_driven``: the engine copies
    (Prepare*/CommitTransfer) instead of the server (Store/Retrieve). Re-registering the same id
    replaces the entry. Reply: the registration's id (``int``): new when the instance was not
    registered or registers different fields, kept when it registers the same fields again (an
    idempotent re-registration); a resend after ``NOT_REGISTERED`` names it (``Store.registration``)."""

    instance_id: int
    model_name: str
    world_size: int
    object_bytes: int
    engine_driven: bool = False
    reply_to: ReplyTo = attrs.field(default=None, kw_only=True)
    peer: Peer = attrs.field(default=None, kw_only=True)


@attrs.frozen
class UnregisterInstance:
    """Forget an instance (unknown ids are fine). Reply: ``None``."""

    instance_id: int
    reply_to: ReplyTo = attrs.field(default=None, kw_only=True)
    peer: Peer = attrs.field(default=None, kw_only=True)


@attrs.frozen
class Store:
    """Server-driven STORE of ``[start, end)`` (chunk-aligned) for rank ``key.worker_id``.

    Chunks already in L1 (or being written) are skipped; the rest are write-reserved and a
    ``StartTransfer`` is emitted. Reply after ``TransferFinished``: ``StoreResult``; a store
    whose chunks another in-flight store is writing is answered only once that write ends.
    ``block_ids`` is passed through to ``StartTransfer`` untouched (the runtime's copy needs it).

    ``not_after`` (keyword-only, default None = no deadline, as LMCache's clients send it): an
    absolute time on the clock the server's ``now`` comes from (one host's monotonic clock in
    production, virtual time in the simulator); a STORE handled after it is refused with a
    ``TIMEOUT`` error, before any slot is reserved or copy started. The worker sets it so that
    once it has passed (plus a copy grace) a STORE it gave up on can no longer read its blocks.

    ``registration`` (keyword-only, default None): set only on a resend after ``NOT_REGISTERED``
    -- the id of the registration the resend follows (``RegisterInstance``'s reply). The server
    runs it only while that registration is the instance's current one (else ``NOT_REGISTERED``),
    and tells it apart from the original it repeats: a network duplicate of the original still
    gets the original's remembered refusal, the resend is a new op (``server_transfers``)."""

    key: CacheKey
    instance_id: int
    block_ids: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)
    reply_to: ReplyTo = attrs.field(default=None, kw_only=True)
    peer: Peer = attrs.field(default=None, kw_only=True)
    not_after: float | None = attrs.field(default=None, kw_only=True)
    registration: int | None = attrs.field(default=None, kw_only=True)


@attrs.frozen
class Retrieve:
    """Server-driven RETRIEVE of ``[start, end)`` for rank ``key.worker_id``. All or nothing: if any
    object is not readable the reply is ``RetrieveResult(ok=False)`` at once and nothing is
    copied. Otherwise ``StartTransfer``; after ``TransferFinished`` the request's read lease (one
    count per object) is released and ``RetrieveResult`` is sent. The first
    ``skip_first_n_tokens`` tokens of the range must not be written to the engine.
    ``not_after``: as for ``Store`` (handled after it: ``TIMEOUT`` error, no copy, no lease).
    ``registration``: as for ``Store`` (a resend after ``NOT_REGISTERED`` names the registration
    it follows)."""

    key: CacheKey
    instance_id: int
    block_ids: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)
    skip_first_n_tokens: int = attrs.field(default=0, validator=_non_negative)
    reply_to: ReplyTo = attrs.field(default=None, kw_only=True)
    peer: Peer = attrs.field(default=None, kw_only=True)
    not_after: float | None = attrs.field(default=None, kw_only=True)
    registration: int | None = attrs.field(default=None, kw_only=True)


@attrs.frozen
class PrepareStore:
    """Engine-driven STORE, step 1. Reply at once: ``TransferPlan`` (slots to copy into); the
    engine copies, then sends ``CommitTransfer``. An uncommitted plan expires after the lease
    TTL (its write reservations are dropped). ``not_after``: as for ``Store`` (refused after it)."""

    key: CacheKey
    instance_id: int
    reply_to: ReplyTo = attrs.field(default=None, kw_only=True)
    peer: Peer = attrs.field(default=None, kw_only=True)
    not_after: float | None = attrs.field(default=None, kw_only=True)


@attrs.frozen
class PrepareRetrieve:
    """Engine-driven RETRIEVE, step 1. Reply at once: ``TransferPlan`` (``ok=False`` and no
    commit needed if any object is not readable)."""

    key: CacheKey
    instance_id: int
    skip_first_n_tokens: int = attrs.field(default=0, validator=_non_negative)
    reply_to: ReplyTo = attrs.field(default=None, kw_only=True)
    peer: Peer = attrs.field(default=None, kw_only=True)


@attrs.frozen
class CommitTransfer:
    """Engine-driven, step 2: the engine's copy for ``transfer_id`` finished (``ok``). Reply:
    ``StoreResult`` or ``RetrieveResult``. Unknown / expired id: UNKNOWN_TRANSFER error."""

    transfer_id: int
    ok: bool
    reply_to: ReplyTo = attrs.field(default=None, kw_only=True)
    peer: Peer = attrs.field(default=None, kw_only=True)


ServerRequest = Union[
    Ping,
    GetChunkSize,
    Lookup,
    QueryPrefetchStatus,
    WaitPrefetchStatus,
    FreeLookupLocks,
    EndSession,
    Clear,
    RegisterInstance,
    UnregisterInstance,
    Store,
    Retrieve,
    PrepareStore,
    PrepareRetrieve,
    CommitTransfer,
]
SERVER_REQUEST_TYPES: tuple[type, ...] = get_args(ServerRequest)  # one list: the Union above

# ---------------------------------------------------------------------------------------------
# Server internal events


@attrs.frozen
class TransferFinished:
    """The server runtime's copy for a ``StartTransfer`` completed (device event observed)."""

    transfer_id: int
    ok: bool


@attrs.frozen
class InstanceFailed:
    """The server runtime gave up on engine instance ``instance_id`` (its GPU transfer engine
    saw a copy never start or never end: the engine's event never fired, or its GPU work hangs)
    and dropped what it kept for it. The server releases the instance as for a reap: its
    registration goes, its uncommitted plans fail; its running copies still end by their
    ``TransferFinished``. Counted ``instances_failed``; an id not registered (any more) is a
    stale event. ``reason`` is for the log. ``failed_at``: when the runtime gave up (on the
    clock it passes to ``handle``); a registration made at or after it is the engine's new
    one (it registered again while this event was queued) and stays: the event is stale for
    it. None: the event fails whichever registration holds the id."""

    instance_id: int
    reason: str = ""
    failed_at: float | None = None


@attrs.frozen
class PeerGone:
    """The runtime saw the connection of ``peer`` close, and that peer cannot come back: its
    routing id was made by zmq for that connection (a client without an explicit identity, e.g.
    LMCache's, gets a new one when it reconnects). Its instances are released as for a reap
    (registration, plans; ``DetachInstance`` for a server-driven one) and no id is kept for it,
    so the client, now another peer, registers them again by the ``NOT_REGISTERED`` path instead
    of being refused ``FORBIDDEN`` until a reap. Counted ``instances_of_gone_peers``."""

    peer: Peer


@attrs.frozen
class InstanceAttached:
    """The runtime's answer to ``AttachInstance``: ``error`` None when the instance's KV memory
    is open (core_sm replies the registration's id), else why it could not be -- VALIDATION when
    the transfer engine refused the layout, INTERNAL when it crashed (core_sm drops the
    registration, asks ``DetachInstance`` and answers that error)."""

    instance_id: int
    registration_id: int
    error: ProtocolError | None = None
    reply_to: ReplyTo = attrs.field(default=None, kw_only=True)


def _bools(values: Iterable[bool]) -> tuple[bool, ...]:
    """Converter: any iterable of flags, kept as a tuple (typed, so callers may pass a list)."""
    return tuple(values)


def _request_ids(values: Iterable[str]) -> tuple[str, ...]:
    """Converter: any iterable of request ids, kept as a tuple. A lone ``str`` is refused (it
    would become one id per character)."""
    if isinstance(values, str):
        raise TypeError(f"request_ids must be an iterable of ids, not the str {values!r}")
    return tuple(values)


@attrs.frozen
class L2ReadFinished:
    """A ``ReadL2`` completed: ``loaded[i]`` says whether item ``i`` was written into its slot."""

    read_id: int
    loaded: tuple[bool, ...] = attrs.field(converter=_bools)


@attrs.frozen
class L2ProbeFinished:
    """A ``ProbeL2`` completed: ``present[i]`` says whether L2 holds key ``i`` (a hint: the read
    that follows may still miss)."""

    probe_id: int
    present: tuple[bool, ...] = attrs.field(converter=_bools)


@attrs.frozen
class L2WriteFinished:
    """A ``WriteL2`` completed (``ok`` False: the L2 tier refused or failed)."""

    write_id: int
    ok: bool


@attrs.frozen
class TimerFired:
    """The deadline from ``next_deadline()`` passed (any machine). Spurious firings are fine."""


ServerEvent = Union[
    ServerRequest, TransferFinished, InstanceFailed, InstanceAttached, PeerGone, L2ReadFinished,
    L2ProbeFinished, L2WriteFinished, TimerFired,
]

# ---------------------------------------------------------------------------------------------
# Results (the ``result`` of a Reply)


@attrs.frozen
class StoreResult:
    """``ok``: the transfer succeeded. ``stored``: chunks now written by this store;
    ``skipped``: chunks already present, being written by another store, or without a slot."""

    ok: bool
    stored: int = 0
    skipped: int = 0


@attrs.frozen
class RetrieveResult:
    """``ok``: every chunk of the range was copied. ``chunks``: chunks in the range."""

    ok: bool
    chunks: int = 0


@attrs.frozen
class TransferPlan:
    """Engine-driven plan: copy chunk ``c`` from/to slot ``s`` for each ``(c, s)`` in
    ``placements``, skipping the first ``skip_first_n_tokens`` tokens of the range when writing
    into the engine. ``ok=False`` (retrieve of an unreadable range): nothing to do, no commit;
    ``transfer_id`` is then -1. A plan with ``ok=True`` must be committed, even if empty.
    ``object_bytes``: the size of one object of the instance (what a slot holds; 0: unknown), for
    the runtime -- it is not sent on the wire."""

    transfer_id: int
    placements: tuple[Placement, ...] = attrs.field(converter=_placements)
    ok: bool = True
    kind: TransferKind = TransferKind.STORE
    skip_first_n_tokens: int = 0
    object_bytes: int = 0


# ---------------------------------------------------------------------------------------------
# Client events (LookupClient and TransferClient)


@attrs.frozen
class ReplyReceived:
    """The transport delivered the reply to request ``correlation`` sent to ``server``."""

    server: int
    correlation: int
    result: object = None


@attrs.frozen
class RequestFailed:
    """Request ``correlation`` to ``server`` got an error reply, or the transport gave up on it."""

    server: int
    correlation: int
    error: ProtocolError


@attrs.frozen
class ServerHealth:
    """The runtime's heartbeat changed its view of ``server``. Unhealthy: every outstanding
    request to it resolves as failed now, and new work skips it until healthy again."""

    server: int
    healthy: bool


@attrs.frozen
class ServerEpoch:
    """The runtime learned ``server``'s start id (``epoch``; from a ping reply, say). A value
    different from the last one fed means the server restarted and lost every job, lease,
    transfer and registration: the client resolves what was in flight on it (as for
    ``ServerHealth(False)``) and, if it registers, registers again. The first value fed is only
    remembered."""

    server: int
    epoch: int | str


@attrs.frozen
class SubmitLookup:
    """vLLM ``maybe_submit_lookup_request``: start a lookup (ignored if the id is already known)."""

    request_id: str
    token_ids: TokenIds = attrs.field(converter=as_token_ids)  # packed once, here
    cache_salt: str = ""
    extras: KeyExtras = NO_EXTRAS


@attrs.frozen
class Cleanup:
    """vLLM ``cleanup_lookup_result``: forget the lookup's client state (and its cached result)."""

    request_id: str


@attrs.frozen
class FreeUnusedLeases:
    """vLLM ``free_lookup_locks``: release server leases on tokens ``[start, end)`` (every
    healthy server)."""

    request_id: str
    token_ids: TokenIds = attrs.field(converter=as_token_ids)  # packed once, here
    start: int
    end: int
    cache_salt: str = ""
    extras: KeyExtras = NO_EXTRAS


@attrs.frozen
class EndRequest:
    """vLLM ``request_finished`` on the scheduler: END_SESSION on every healthy server."""

    request_id: str


@attrs.frozen
class SubmitStore:
    """Worker: store tokens ``[start, end)`` from the engine blocks ``block_ids`` (covering that
    range)."""

    request_id: str
    token_ids: tuple[int, ...] = attrs.field(converter=_int_tuple)
    start: int
    end: int
    block_ids: tuple[int, ...] = attrs.field(converter=_int_tuple)
    cache_salt: str = ""
    extras: KeyExtras = NO_EXTRAS


@attrs.frozen
class SubmitRetrieve:
    """Worker: load tokens ``[start, end)`` into ``block_ids``, not writing the first
    ``skip_first_n_tokens`` tokens (blocks vLLM already shares).

    ``synchronous``: vLLM loads it within the step that schedules the request (the planner's
    ``StepPlan.sync_loads``): the worker waits while ``TransferClient.loading`` names it, and its
    completion is never reported in ``finished()``'s recving (vLLM does not wait for it)."""

    request_id: str
    token_ids: tuple[int, ...] = attrs.field(converter=_int_tuple)
    start: int
    end: int
    block_ids: tuple[int, ...] = attrs.field(converter=_int_tuple)
    skip_first_n_tokens: int = 0
    cache_salt: str = ""
    extras: KeyExtras = NO_EXTRAS
    synchronous: bool = False


@attrs.frozen
class CopyFinished:
    """Engine-driven: the worker runtime finished the ``CopyBlocks`` of op ``op``."""

    op: OpId
    ok: bool


@attrs.frozen
class Abort:
    """The engine aborted the request: its blocks stay held until every in-flight op completes;
    then it is reported once in ``finished()``'s sending set."""

    request_id: str


@attrs.frozen
class EngineFinished:
    """vLLM ``get_finished(finished_req_ids)``: these requests finished in the engine."""

    request_ids: tuple[str, ...] = attrs.field(converter=_request_ids)


ClientEvent = Union[
    ReplyReceived,
    RequestFailed,
    ServerHealth,
    ServerEpoch,
    SubmitLookup,
    Cleanup,
    FreeUnusedLeases,
    EndRequest,
    SubmitStore,
    SubmitRetrieve,
    CopyFinished,
    Abort,
    EngineFinished,
    TimerFired,
]
