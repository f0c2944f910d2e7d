"""Effects: what a machine asks its runtime to do. A machine never performs one itself.

Server effects: ``Reply``, ``ErrorReply``, ``StartTransfer``, ``ProbeL2``, ``ReadL2``, ``WriteL2``,
``InstanceReaped``, ``LookupWorkFailed``, ``CarveL1``; with ``ServerConfig.kv_events``, also the facts a router needs: ``ChunksStored``,
``ChunksRemoved``, ``AllChunksCleared``.
Client effects: ``SendRequest``, ``CopyBlocks``.
Every effect is an ``attrs`` frozen class; a runtime dispatches on its type.
"""
from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any, Union

import attrs

from mpcache.core_sm.chunks import ObjectKey, TokenIds
from mpcache.core_sm.errors import ProtocolError
from mpcache.core_sm.messages import OpId, Placement, ReplyTo, ServerRequest, TransferKind


def _tuple(value: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(value)


@attrs.frozen
class Reply:
    """Send ``result`` (None, bool, int, or a result class from ``mpcache.core_sm.messages``) to the
    requester behind ``reply_to``."""

    reply_to: ReplyTo
    result: object = None


@attrs.frozen
class ErrorReply:
    """Send the typed error ``error`` to the requester behind ``reply_to``."""

    reply_to: ReplyTo
    error: ProtocolError


@attrs.frozen
class StartTransfer:
    """Server-driven copy. STORE: engine blocks → the slots; RETRIEVE: slots → engine blocks,
    not writing the first ``skip_first_n_tokens`` tokens of ``[start, end)``. ``block_ids`` are
    the request's, covering ``[start, end)``; chunk ``c`` starts at token ``c * chunk_size``.
    The runtime reports ``TransferFinished(transfer_id, ok)`` once the copy has really completed
    (device event observed), never before -- also for a transfer the server already failed at
    its lease TTL: the slots stay quarantined until then. ``reply_to`` identifies the original
    request (the runtime keeps its event handle under it). ``not_after``: the STORE's deadline
    (None: none); a runtime whose copy queue is backed up may fail a STORE copy not yet begun by
    then (``TransferFinished(ok=False)``) -- the worker frees blocks given up on after it.
    ``object_bytes``: the size of one object of the instance (bytes a placement's slot holds)."""

    transfer_id: int
    kind: TransferKind
    instance_id: int
    request_id: str
    reply_to: ReplyTo
    start: int
    end: int
    placements: tuple[Placement, ...] = attrs.field(converter=_tuple)
    block_ids: tuple[int, ...] = attrs.field(converter=_tuple)
    skip_first_n_tokens: int = 0
    not_after: float | None = None
    object_bytes: int = 0


@attrs.frozen
class ProbeL2:
    """Ask L2 which of ``keys`` it holds (no data moves); answer
    ``L2ProbeFinished(probe_id, present)`` with one bool per key, in order. Only emitted with
    ``ServerConfig.l2_probe``."""

    probe_id: int
    keys: tuple[ObjectKey, ...] = attrs.field(converter=_tuple)


@attrs.frozen
class ReadL2:
    """Load each ``(key, slot)`` from L2 into its slot; answer
    ``L2ReadFinished(read_id, loaded)`` with one bool per item, in order -- always, even after
    the server gave up on the read at its lease TTL: the slots stay quarantined until then.
    ``object_bytes``: the size of each object (what a slot receives); 0 when no instance of
    that model is registered on this server, so the size is not known and not checked."""

    read_id: int
    items: tuple[tuple[ObjectKey, int], ...] = attrs.field(converter=_tuple)
    object_bytes: int = 0


@attrs.frozen
class WriteL2:
    """Write each ``(key, slot)`` to L2 (write-behind). The slots stay leased until
    ``L2WriteFinished(write_id, ok)`` (or the lease TTL), and are never given to another object
    before it arrives. ``object_bytes``: the size of each object (bytes of its slot to write)."""

    write_id: int
    items: tuple[tuple[ObjectKey, int], ...] = attrs.field(converter=_tuple)
    object_bytes: int = 0


@attrs.frozen
class LookupWorkFailed:
    """A lookup already acknowledged (``ServerConfig.ack_first``) could not do its work (hash,
    leases, L2 start): the job resolves as 0 hits and holds no leases of that lookup. Nothing a
    client sends can cause it -- every check that can fail runs before the ack -- so the runtime
    logs it as a server fault. ``reason`` names the exception."""

    request_id: str
    reason: str


@attrs.frozen
class InstanceReaped:
    """Engine instance ``instance_id`` sent no heartbeat for ``instance_ttl`` and was reaped:
    release what the runtime keeps for it (GPU IPC mappings, staging memory). Its in-flight
    copies must still be reported (``TransferFinished``); its later requests are refused
    ``not_registered``."""

    instance_id: int


@attrs.frozen
class AttachInstance:
    """core_sm accepted the server-driven registration ``registration_id`` of ``instance_id``
    (its owner, its fields): now, and only now, the runtime opens the instance's KV memory (CUDA
    IPC handles) and answers ``InstanceAttached``; core_sm replies to the registration then.
    Decide, then act: a registration core_sm refuses (another peer's instance, a bad field) never
    reaches the transfer engine. The runtime answers before it handles another event."""

    instance_id: int
    registration_id: int
    reply_to: ReplyTo


@attrs.frozen
class DetachInstance:
    """The owner unregistered ``instance_id``, registered it engine-driven instead, or its
    attachment failed: the runtime releases the KV memory it opened for it (what is queued still
    lands and is reported)."""

    instance_id: int


@attrs.frozen
class ScrubSlots:
    """Written before served: an engine-driven STORE plan hands ``slots`` to the engine, and a
    commit with ``ok`` makes them READY whatever the engine wrote -- so the runtime zeroes their
    first ``nbytes`` bytes (the object size) now, before the plan's reply, which follows this
    effect. A slot's previous object (another tenant's, maybe) is never what a commit exposes;
    what the engine did not write reads as zeros."""

    slots: tuple[int, ...] = attrs.field(converter=_tuple)
    nbytes: int


@attrs.frozen
class CarveL1:
    """core_sm cut L1 into ``num_slots`` slots of ``slot_bytes`` (its slots follow the objects
    registered: ``mpcache.core_sm.l1_slots``): the runtime's pool addresses slot ``s`` at
    ``s * slot_bytes`` from now on. Asked only while L1 holds nothing, before the registration
    that caused it is attached or answered."""

    slot_bytes: int
    num_slots: int


class Medium(enum.Enum):
    """Where a chunk is held: L1 (this server's shared memory) or L2 (its tier)."""

    L1 = "L1"
    L2 = "L2"


@attrs.frozen
class StoredChunk:
    """One chunk a server holds for every KV rank: its prefix hash, the previous chunk's (None
    for chunk 0), its tokens, and the key parts a router may filter on (``cache_salt``,
    ``KeyExtras.identity`` and the chunk's own extra)."""

    chunk_hash: bytes
    parent_hash: bytes | None
    token_ids: TokenIds
    cache_salt: str = ""
    identity: str = ""
    chunk_extra: bytes = b""


@attrs.frozen
class ChunksStored:
    """These chunks became held in ``medium`` (every rank's object of each). Emitted once per
    chunk until it leaves the medium; L2 chunks are never reported removed (a tier may drop
    objects unseen), so L2 reports are hints."""

    medium: Medium
    chunks: tuple[StoredChunk, ...] = attrs.field(converter=_tuple)


@attrs.frozen
class ChunksRemoved:
    """These chunks, reported stored in ``medium`` before, are no longer held there whole."""

    medium: Medium
    chunk_hashes: tuple[bytes, ...] = attrs.field(converter=_tuple)


@attrs.frozen
class AllChunksCleared:
    """A clear: forget every chunk reported before (what survived it is not reported again)."""


@attrs.frozen
class SendRequest:
    """Client side: send ``request`` (a server request with ``reply_to=None``) to ``server``.
    Its answer comes back as ``ReplyReceived(server, correlation, result)`` or
    ``RequestFailed(server, correlation, error)``."""

    server: int
    correlation: int
    request: ServerRequest


@attrs.frozen
class CopyBlocks:
    """Engine-driven, worker side: copy between engine blocks and L1 slots for op ``op``
    (STORE: blocks → slots; RETRIEVE: slots → blocks, not writing the first
    ``skip_first_n_tokens`` tokens of ``[start, end)``), then report ``CopyFinished(op, ok)``."""

    op: OpId
    direction: TransferKind
    transfer_id: int
    start: int
    end: int
    placements: tuple[Placement, ...] = attrs.field(converter=_tuple)
    block_ids: tuple[int, ...] = attrs.field(converter=_tuple)
    skip_first_n_tokens: int = 0


Effect = Union[
    Reply, ErrorReply, StartTransfer, ProbeL2, ReadL2, WriteL2, InstanceReaped, AttachInstance, DetachInstance, CarveL1,
    ScrubSlots, LookupWorkFailed, ChunksStored, ChunksRemoved, AllChunksCleared, SendRequest, CopyBlocks,
]
