"""What the server's entity machines share: the configuration, the L1 index, one timer heap, the
counters, slot pins of in-flight effects, and key validation / hashing.

``LookupServer`` (core_sm/server.py) builds one ``ServerContext`` and hands it to each entity
machine (jobs, transfers, L2 work, instances); none of them owns another's state, they call one
another's methods (a machine that calls back up the import order -- L2 work into jobs, instances
into transfers -- names what it needs as a small protocol in its own module). Lease/reservation owners are named types here: a ``RequestKey`` (peer,
request id) owns lookup leases, the effect owners own the leases and reservations of copies.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import NamedTuple, Union

import attrs

from mpcache.core_sm.chunks import CHAIN_KEY_BYTES, DEFAULT_CHUNK_SIZE, PUBLIC_CHAIN_KEY, ChunkChain, TokenIds, validate_cache_salt
from mpcache.core_sm.effects import Effect
from mpcache.core_sm.errors import ErrorKind, ProtocolError
from mpcache.core_sm.admission import StoreAdmission
from mpcache.core_sm.holdings import HeldChunks
from mpcache.core_sm.keys import PrehashedTokens, keyed_chunk_hashes, keyed_root, validate_extras
from mpcache.core_sm.l1_index import L1Index
from mpcache.core_sm.messages import CacheKey, Peer, ReplyTo
from mpcache.core_sm.timers import Timer, TimerHeap


@attrs.frozen
class ServerConfig:
    """Server knobs; defaults follow LMCache's where it has one."""

    chunk_size: int = DEFAULT_CHUNK_SIZE
    num_slots: int = 1024
    slot_bytes: int = 1 << 20
    lease_ttl: float = 300.0  # read/write leases and uncommitted engine-driven plans
    tombstone_ttl: float = 60.0
    tombstone_cap: int = 100_000
    abandoned_job_ttl: float = 60.0  # a job never queried is reaped (its leases released)
    l2_enabled: bool = False  # plan ReadL2 for what misses L1
    l2_read_timeout: float = 30.0  # a job whose L2 work is not back resolves with its L1 prefix
    # Ask L2 which objects it has (ProbeL2) before reserving L1 slots for a read: a miss then
    # evicts nothing. Off until every runtime answers ProbeL2 with L2ProbeFinished.
    l2_probe: bool = False
    write_behind: bool = False  # WriteL2 every store once it is ready
    high_watermark: float = 1.0
    low_watermark: float = 1.0
    max_waiters: int = 10_000
    max_chunks_per_request: int = 1 << 16
    # A registered instance that has sent a heartbeat (a Ping naming it) and then neither
    # heartbeats nor sends requests for this long is reaped (None: never).
    instance_ttl: float | None = 60.0
    # Report what is held (ChunksStored / ChunksRemoved / AllChunksCleared: core_sm.holdings).
    kv_events: bool = False
    # Ownership and bounds: what one client may hold or name. Each refusal is one typed error.
    id_seed: int = 0  # keys the transfer-id generator (a runtime passes a random one)
    max_world_size: int = 4096  # world_size of a key or registration; ranks are < it
    max_objects_per_request: int = 1 << 18  # chunks x ranks one request may name
    max_jobs: int = 100_000  # live prefetch jobs in total ...
    max_jobs_per_peer: int = 20_000  # ... and per peer (connection)
    max_transfers_per_instance: int = 1024  # plans and running transfers of one instance
    # L1 slots one instance's in-flight writes may hold reserved (None: a fair share, L1 divided
    # by the instances registered): over it, a store skips chunks instead of evicting other
    # tenants' ready objects for them.
    max_slots_per_instance: int | None = None
    # Instances one peer (connection or CURVE key) may hold registered: L1's quota is per peer, and
    # a peer's in-flight share is split among its instances, so more would only cost the table.
    max_instances_per_peer: int = 64
    # A reaped or failed instance id stays its peer's this long: another peer's registration of it
    # is refused (it would lock the owner out); at most this many ids are kept (oldest go first).
    reserved_id_ttl: float = 300.0
    max_reserved_ids: int = 65_536
    plan_ttl: float = 30.0  # an uncommitted engine-driven plan expires after min(this, lease_ttl)
    max_lookups_per_request: int = 64  # lookups of one request id (each refreshes its leases)
    max_not_after_ahead: float = 60.0  # a not_after is held to at most now + this
    # Store a chunk only once lookups asked for it this many times (core_sm.admission; 0/1: all).
    store_threshold: int = 0
    # Keys the chunk chain (core_sm.chunks.ChunkChain): a server's or fleet's secret, the same on
    # every server sharing an L2 tier. The default is public (tests, the simulator's fixed
    # worlds); runtime_zmq always passes its own.
    chain_key: bytes = attrs.field(default=PUBLIC_CHAIN_KEY, repr=False)
    # Acknowledge a lookup before its work: ``handle(Lookup)`` makes every check that can fail,
    # registers the job and returns the ack; the hashing, L1 leases and L2 start wait for
    # ``LookupServer.run_deferred()`` (a runtime calls it once the ack is sent) or, at the
    # latest, run first thing in the next ``handle``. Off: ``handle`` does it all at once.
    ack_first: bool = False
    # L1's bytes when its slots follow the objects registered (core_sm.l1_slots): the first
    # registration cuts L1 into slots of its object size; 0: ``num_slots`` x ``slot_bytes`` fixed.
    l1_bytes: int = 0
    slot_align: int = 4096  # a carved slot is a multiple of this (the runtime's page size)

    @chain_key.validator
    def _check_chain_key(self, attribute: object, value: bytes) -> None:
        if type(value) is not bytes or len(value) != CHAIN_KEY_BYTES:
            raise ValueError(f"chain_key must be {CHAIN_KEY_BYTES} bytes")


class RequestKey(NamedTuple):
    """A request as the server knows it: the peer that sent it and the request id it named.

    Prefetch jobs, tombstones, status waiters, lookup counts and lookup read leases are keyed by
    it, so two peers naming one request id are two independent requests: neither can see, free,
    end or take over the other's (request ids are often guessable: counters)."""

    peer: Peer
    request_id: str


@attrs.frozen(cache_hash=True)
class TransferOwner:
    """Holds a retrieve's read leases and a store's write reservations during its copy."""

    transfer_id: int


@attrs.frozen(cache_hash=True)
class L2ReadOwner:
    """Holds the write reservations an L2 read loads into."""

    read_id: int


@attrs.frozen(cache_hash=True)
class L2WriteOwner:
    """Holds the read leases of a write-behind while L2 copies the objects."""

    write_id: int


# The owner of an in-flight effect on slots (never a request id): what ``clear`` protects.
EffectOwner = Union[TransferOwner, L2ReadOwner, L2WriteOwner]
EFFECT_OWNERS = (TransferOwner, L2ReadOwner, L2WriteOwner)


class ServerContext:
    """Shared resources of the entity machines (one per ``LookupServer``)."""

    # What the server's ``state_values`` carries of this part, and the wiring it leaves out
    # (core_sm/values.py; tests/core_sm/test_state_values.py holds every attribute to one).
    STATE_FIELDS: tuple[str, ...] = ("pins", "_roots", "_next_id", "_next_transfer", "held", "admission")
    WIRING_FIELDS: tuple[str, ...] = ("config", "index", "counters", "reply_error", "timers", "chain", "_transfer_key")

    def __init__(self, config: ServerConfig, counters: dict[str, int],
                 reply_error: Callable[[list[Effect], ReplyTo, ProtocolError], None],
                 timer_live: Callable[[Timer], bool]) -> None:
        self.config = config
        c = config
        self.index = L1Index(c.num_slots, c.slot_bytes, c.lease_ttl, c.high_watermark, c.low_watermark)
        self.counters = counters
        self.reply_error = reply_error  # the server's hook: every ErrorReply goes through it
        self.timers = TimerHeap(timer_live)
        # Slots pinned in the index by an in-flight effect, per effect. Unpinned by the effect's
        # completion event only (an expired engine-driven plan: one more lease_ttl), whatever
        # the TTLs did meanwhile.
        self.pins: dict[EffectOwner, tuple[int, ...]] = {}
        self.chain = ChunkChain(c.chain_key)
        self._roots: dict[tuple[str, int, str, str], bytes] = {}
        self._next_id = 0
        self._next_transfer = 0
        self._transfer_key = hashlib.blake2b(repr(config.id_seed).encode(), digest_size=32).digest()
        # kv_events: what was reported held; the index lists its drops for report_drops
        self.held: HeldChunks | None = None
        self.admission = StoreAdmission(c.store_threshold) if c.store_threshold > 1 else None
        if c.kv_events:
            self.held = HeldChunks()
            self.index.dropped = []

    def report_drops(self, out: list[Effect]) -> None:
        """kv_events: chunks reported held that lost an L1 object since the last call."""
        dropped = self.index.dropped
        if self.held is not None and dropped:
            self.held.dropped_l1(dropped, out)
            dropped.clear()

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def new_transfer_id(self) -> int:
        """An unguessable 63-bit transfer id (positive, fits msgpack's int64): a keyed hash of a
        counter, so a client cannot commit or finish another's transfer by guessing its id,
        and the same ``id_seed`` gives the same ids (the simulator's seeds replay)."""
        self._next_transfer += 1
        digest = hashlib.blake2b(self._next_transfer.to_bytes(8, "little"), key=self._transfer_key,
                                 digest_size=8).digest()
        return (int.from_bytes(digest, "little") & ((1 << 63) - 1)) or 1

    def error(self, out: list[Effect], reply_to: ReplyTo, kind: ErrorKind, message: str) -> None:
        """Answer ``reply_to`` with a ``kind`` error (through the server's ``_reply_error``)."""
        self.reply_error(out, reply_to, ProtocolError(kind, message))

    def pin(self, owner: EffectOwner, slots: Sequence[int]) -> None:
        """An effect on ``slots`` is in flight: none of them goes to another object before
        ``unpin`` (its completion event), even if its object is dropped meanwhile."""
        if not slots:
            return
        self.pins[owner] = tuple(slots)
        self.index.pin_slots(slots)

    def unpin(self, owner: EffectOwner) -> None:
        slots = self.pins.pop(owner, None)
        if slots:
            self.index.unpin_slots(slots)

    def validate_key(self, key: CacheKey, *, scheduler: bool, aligned: bool = True) -> str | None:
        """None if ``key`` is well formed for a scheduler (``worker_id`` None) or worker request,
        else the reason."""
        if not isinstance(key, CacheKey):
            return "key must be a CacheKey"
        if not isinstance(key.model_name, str):
            return "model_name must be a str"
        if not isinstance(key.world_size, int) or isinstance(key.world_size, bool) or key.world_size < 1:
            return f"world_size must be an int >= 1, not {key.world_size!r}"
        if key.world_size > self.config.max_world_size:
            return f"world_size {key.world_size} > {self.config.max_world_size}"
        if not isinstance(key.request_id, str):
            return "request_id must be a str"
        salt_err = validate_cache_salt(key.cache_salt)
        if salt_err is not None:
            return salt_err
        extras_err = validate_extras(key.extras, self.config.max_chunks_per_request)
        if extras_err is not None:
            return extras_err
        if scheduler:
            if key.worker_id is not None:
                return "a scheduler key has worker_id None"
        elif not isinstance(key.worker_id, int) or not 0 <= key.worker_id < key.world_size:
            return f"worker_id must be in [0, {key.world_size}), not {key.worker_id!r}"
        if not isinstance(key.start, int) or not isinstance(key.end, int):
            return "start and end must be ints"
        if not 0 <= key.start <= key.end <= len(key.token_ids):
            return f"range [{key.start}, {key.end}) outside the {len(key.token_ids)} tokens"
        C = self.config.chunk_size
        if aligned and (key.start % C or key.end % C):
            return f"range [{key.start}, {key.end}) is not aligned to the chunk size {C}"
        if key.end // C > self.config.max_chunks_per_request:
            return "too many chunks in one request"
        objects = (key.end // C - key.start // C) * (key.world_size if scheduler else 1)
        if objects > self.config.max_objects_per_request:
            return f"{objects} objects (chunks x ranks) in one request > {self.config.max_objects_per_request}"
        return None

    def token_error(self, key: CacheKey, num_chunks: int) -> str | None:
        """The reason ``hashes(key, num_chunks)`` would refuse the key's token ids, else None
        (no per-token work: ``TokenIds`` knows whether it packed)."""
        tokens = key.token_ids
        if num_chunks <= 0 or type(tokens) is not TokenIds or tokens.valid:
            return None
        try:
            tokens.packed
        except (ValueError, TypeError, OverflowError) as exc:
            return f"token ids must be uint32: {exc}"
        return None  # pragma: no cover  (an invalid TokenIds raises)

    def hashes(self, key: CacheKey, num_chunks: int) -> tuple[tuple[bytes, ...], str | None]:
        """The first ``num_chunks`` chunk hashes of ``key``, or the reason they cannot be made."""
        tokens = key.token_ids
        if type(tokens) is not TokenIds and isinstance(tokens, PrehashedTokens):
            return tokens.hashes[: max(0, num_chunks)], None  # a replayed trace's key (core_sm.trace)
        ident = (key.model_name, key.world_size, key.cache_salt, key.extras.identity)
        root = self._roots.get(ident)
        if root is None:
            if len(self._roots) >= 1024:
                self._roots.clear()
            root = self._roots[ident] = keyed_root(self.chain.root(*ident[:3]), ident[3])
        try:
            return keyed_chunk_hashes(key.token_ids, self.config.chunk_size, root, num_chunks,
                                      key.extras.chunk_extras, self.chain), None
        except (ValueError, TypeError, OverflowError) as exc:
            return (), f"token ids must be uint32: {exc}"
