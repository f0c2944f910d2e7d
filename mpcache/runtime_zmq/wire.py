"""mpcache's wire codec: ZMQ multipart frames <-> core_sm requests and results, in one table.

Contract (see docs/protocol.md and LMCache's MP wire format):

* A request, as the ROUTER socket sees it, is ``[identity, uid, op, payload_1 .. payload_n]``;
  every frame after the identity is msgpack. ``uid`` is a msgpack int; ``op`` is an operation
  name (msgpack str) or, for the operations LMCache numbered, its legacy msgpack int.
* A success reply is ``[identity, uid, op]`` when the result is ``None`` and
  ``[identity, uid, op, result]`` otherwise; the ``uid`` and ``op`` frames are echoed byte for
  byte, so a client matches the reply exactly as it matches LMCache's server's replies.
* An error reply is ``[identity, uid, "error", {"kind": str, "message": str, "op": str | None}]``.
  The distinct ``op`` value makes LMCache's client fail that one request cleanly ("operation does
  not match") instead of mis-decoding an error as a result.
* A message whose uid frame is not a msgpack int cannot be attributed: ``decode_request`` reports
  it as ``Unattributable`` and the server counts it and sends nothing.

``OPS`` is the one table: for each operation its name, LMCache's legacy id, the shape of every
payload, the msgpack limits each payload is decoded under, the core_sm request it builds
(``to_event``) and the payloads a core_sm request is sent as (``request_to_wire``). The key map
(LMCache's ``IPCCacheServerKey``) decodes straight into ``mpcache.core_sm.messages.CacheKey``.

Bounds come before any work (``Limits``): a payload is unpacked under per-payload msgpack limits
(``max_str_len``, ``max_bin_len``, ``max_array_len``, ``max_map_len``) and a cap on the number of
containers one frame may hold, so a frame of millions of empty maps fails after a few hundred
instead of allocating them; world size, names, request ids, token and block-id counts, chunks x
ranks and deadlines are checked before the request reaches core_sm. Each refusal is one
``DecodeError`` (``too_large`` or ``undecodable``/``validation``). Decoding never raises.

Token ids become a ``mpcache.core_sm.chunks.TokenIds`` (one packed little-endian uint32 buffer): a msgpack
bin of packed ids (mpcache's client) is wrapped as received; LMCache's list of ints is scanned out
of the frame by a compiled decoder (``mpcache.runtime_zmq.tokens``) into one uint32 buffer. Neither form
costs a Python object per token.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import attrs
import msgpack  # type: ignore[import-untyped]

from mpcache.core_sm import messages as m
from mpcache.core_sm.chunks import TokenIds, pack_tokens
from mpcache.core_sm.errors import ErrorKind
from mpcache.core_sm.health import RESENDS_NAMING_REGISTRATION
from mpcache.core_sm.keys import MAX_CHUNK_EXTRA_LEN, MAX_IDENTITY_LEN, NO_EXTRAS, KeyExtras
from mpcache.core_sm.messages import CacheKey, TransferKind, TransferPlan
from mpcache.runtime_zmq.tokens import decode_key_frame

ERROR_OP: Final = "error"
ERROR_OP_FRAME: Final = msgpack.packb(ERROR_OP)

@attrs.frozen
class Limits:
    """Bounds applied while receiving and decoding, before any work (configurable from the CLI).

    ``max_frame_bytes`` / ``max_message_bytes`` / ``max_frames``: one frame, a whole message, and
    payload frames per message. ``max_name_bytes``: model name and request id (UTF-8 bytes).
    ``max_world_size``: the key's world size (and reader / tp counts). ``max_chunk_ranks``: chunks
    a key covers times the ranks it names (what a lookup or a lock release iterates).
    ``max_deadline_s``: a ``not_after`` further than this past the server's clock is clamped to it.
    ``max_containers``: maps + arrays in one payload frame."""

    max_frame_bytes: int = 16 * 1024 * 1024
    max_message_bytes: int = 32 * 1024 * 1024
    max_frames: int = 16
    # 512k: the most a lookup may cost the loop is bounded by its keyed chunk hashing (about
    # 4.4 ms per million tokens, docs/security.md), and one message must stay under 10 ms
    max_tokens: int = 1 << 19
    # token ids as a msgpack list that the compiled scanner (runtime_zmq.tokens) declines, or
    # before it has loaded, cost one Python int each (about 4 ms per 128k on a 2-core box): such a
    # list is refused past this length (the packed bin, mpcache's client's form, never is)
    max_list_tokens: int = 1 << 17
    max_block_ids: int = 1 << 17
    max_name_bytes: int = 256
    max_salt_bytes: int = 1024
    max_world_size: int = 4096
    max_chunk_ranks: int = 1 << 16
    max_deadline_s: float = 60.0
    max_containers: int = 1024
    max_layout_bytes: int = 4 * 1024 * 1024
    chunk_size: int = 256


# ---------------------------------------------------------------------------------------------
# Payload shapes


class P(enum.Enum):
    """The shape a payload frame must decode to."""

    INT = "int"
    OPT_INT = "int | None"
    FLOAT = "float"
    OPT_FLOAT = "float | None"
    STR = "str"
    OPT_STR = "str | None"
    ID = "request id"
    BOOL = "bool"
    BYTES = "bytes"
    KEY = "IPCCacheServerKey"
    INT_LIST = "list[int]"
    MAP = "map"
    ANY = "any"


# The members as module names: ``P.KEY`` is an attribute lookup through the enum's metaclass
# (0.2 us each), and the decoder tests a payload's shape against several of them per frame.
_INT, _OPT_INT, _FLOAT, _OPT_FLOAT = P.INT, P.OPT_INT, P.FLOAT, P.OPT_FLOAT
_STR, _OPT_STR, _ID, _BOOL, _BYTES = P.STR, P.OPT_STR, P.ID, P.BOOL, P.BYTES
_KEY, _INT_LIST, _MAP = P.KEY, P.INT_LIST, P.MAP


@attrs.frozen
class UnpackLimits:
    """msgpack's own limits for one payload frame (``msgpack.unpackb`` keyword arguments)."""

    max_str_len: int
    max_bin_len: int
    max_array_len: int
    max_map_len: int


# id(limits) -> (limits, {shape: its msgpack limits}); the Limits object is kept, so an id reused
# after it was freed can never match
_LIMITS_TABLES: dict[int, tuple[Limits, dict[str, UnpackLimits]]] = {}

# A key's fields besides its token ids: names, salt, identity, one 64-byte extra per chunk.
_KEY_FIELDS_BYTES: Final = 512 * 1024

# A payload of the wrong type still decodes (small) so its refusal names the type; a big one of
# any type stops at msgpack's limit.
_SMALL: Final = 64


def _unpack_limits(p: P, limits: Limits) -> UnpackLimits:
    """msgpack's limits for a payload of shape ``p``: computed once per ``Limits`` (a server
    keeps one for its life), not per frame."""
    table = _LIMITS_TABLES.get(id(limits))
    if table is None or table[0] is not limits:
        if len(_LIMITS_TABLES) >= 64:  # tests build many Limits; a server one
            _LIMITS_TABLES.clear()
        table = _LIMITS_TABLES[id(limits)] = (limits, {q._name_: _compute_unpack_limits(q, limits) for q in P})
    # keyed by the member's name: an Enum member hashes in Python (0.4 us), its name's str in C
    return table[1][p._name_]


def _compute_unpack_limits(p: P, limits: Limits) -> UnpackLimits:
    if p is P.KEY:
        # strings: model name, request id, salt; a bin or an array: the token ids
        strings = max(limits.max_salt_bytes, limits.max_name_bytes, MAX_IDENTITY_LEN)
        return UnpackLimits(strings, 4 * limits.max_tokens, min(limits.max_tokens, limits.max_list_tokens), 32)
    if p is P.INT_LIST:
        return UnpackLimits(_SMALL, _SMALL, limits.max_block_ids, _SMALL)
    if p in (P.STR, P.OPT_STR, P.ID):
        return UnpackLimits(limits.max_name_bytes, _SMALL, _SMALL, _SMALL)
    if p is P.BYTES:
        return UnpackLimits(_SMALL, 4096, _SMALL, _SMALL)  # a CUDA IPC event handle is 64 bytes
    if p is P.MAP:  # a GPU registration: one map per KV tensor, each with a 64-byte handle
        return UnpackLimits(4096, limits.max_layout_bytes, limits.max_containers, limits.max_containers)
    if p is P.ANY:  # report_block_allocation records: observability only
        return UnpackLimits(limits.max_name_bytes, 4096, limits.max_block_ids, _SMALL)
    return UnpackLimits(_SMALL, _SMALL, _SMALL, _SMALL)  # scalars


class _Bad(Exception):
    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class _ContainerBudget:
    """Counts the maps and arrays one frame decodes into and stops the decoder past ``limit``
    (msgpack calls the hooks once per container, in C otherwise)."""

    __slots__ = ("left",)

    def __init__(self, limit: int) -> None:
        self.left = limit

    def _spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise _Bad(ErrorKind.TOO_LARGE, "too many maps/arrays in one payload")

    def on_list(self, v: list[Any]) -> list[Any]:
        self._spend()
        return v

    def on_map(self, v: dict[Any, Any]) -> dict[Any, Any]:
        self._spend()
        return v


def _unpack(frame: bytes | memoryview, ul: UnpackLimits | None = None, containers: int = 1 << 30) -> Any:
    # raw=False: str frames decode as str and invalid utf-8 fails; ext types are not decoded into
    # objects (they stay ExtType and then fail the type checks); no pickle anywhere.
    if ul is None:
        return msgpack.unpackb(frame, raw=False, strict_map_key=False, use_list=True)
    budget = _ContainerBudget(containers)
    return msgpack.unpackb(
        frame, raw=False, strict_map_key=False, use_list=True,
        max_str_len=ul.max_str_len, max_bin_len=ul.max_bin_len, max_array_len=ul.max_array_len,
        max_map_len=ul.max_map_len, max_ext_len=0, list_hook=budget.on_list, object_hook=budget.on_map,
    )


def _type_name(v: Any) -> str:
    return type(v).__name__


def _as_int(v: Any, what: str) -> int:
    if type(v) is not int:
        raise _Bad(ErrorKind.UNDECODABLE, f"{what}: expected int, got {_type_name(v)}")
    return v


def _as_str(v: Any, what: str, limit: int) -> str:
    if type(v) is not str:
        raise _Bad(ErrorKind.UNDECODABLE, f"{what}: expected str, got {_type_name(v)}")
    if len(v) > limit or (not v.isascii() and len(v.encode("utf-8", "surrogatepass")) > limit):
        raise _Bad(ErrorKind.TOO_LARGE, f"{what}: longer than {limit} bytes")
    return v


def _as_int_list(v: Any, what: str, limit: int) -> tuple[int, ...]:
    if type(v) is not list:
        raise _Bad(ErrorKind.UNDECODABLE, f"{what}: expected list[int], got {_type_name(v)}")
    if len(v) > limit:
        raise _Bad(ErrorKind.TOO_LARGE, f"{what}: {len(v)} items, limit {limit}")
    # Element types are checked where the values are used (core_sm's converters); the container
    # and its length are checked here.
    return tuple(v)


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """mpcache's compact form of ``token_ids``: little-endian uint32 bytes (a msgpack bin).
    Decoding it costs no Python object per token; LMCache's list form is accepted as well."""
    return pack_tokens(token_ids)


def token_ids_for_wire(token_ids: Sequence[int]) -> bytes | list[int]:
    """The packed form when every id is a uint32, else the list (the server then answers the
    bad ids with a validation error instead of the client failing to encode). A ``TokenIds``
    is sent as it is held, with no repacking."""
    if isinstance(token_ids, TokenIds):
        return token_ids.packed if token_ids.valid else list(token_ids)
    try:
        return pack_token_ids(token_ids)
    except (OverflowError, TypeError, ValueError):
        return list(token_ids)


def _as_token_ids(v: Any, limit: int) -> TokenIds:
    if type(v) is bytes:
        if len(v) % 4:
            raise _Bad(ErrorKind.UNDECODABLE, f"key.token_ids: {len(v)} bytes is not a whole number of uint32")
        if len(v) // 4 > limit:
            raise _Bad(ErrorKind.TOO_LARGE, f"key.token_ids: {len(v) // 4} items, limit {limit}")
        return TokenIds.from_packed(v)
    if type(v) is not list:
        raise _Bad(ErrorKind.UNDECODABLE, f"key.token_ids: expected list[int] or bin, got {_type_name(v)}")
    if len(v) > limit:
        raise _Bad(ErrorKind.TOO_LARGE, f"key.token_ids: {len(v)} items, limit {limit}")
    # Packed once, in C (array.fromlist). A list holding something other than uint32 ids is kept
    # as given; core_sm answers it with a validation error when it hashes the key.
    return TokenIds.from_ints(v)


# A lookup key's field asking for the hit count in the ack (core_sm.messages.Lookup.answer_in_ack):
# mpcache's own, sent only when set (encode_lookup); absent or false: the nil ack as always.
ANSWER_IN_ACK_FIELD: Final = "answer_in_ack"


@attrs.frozen
class KeyPayload:
    """A decoded key payload: the core_sm key and, beside it, what core_sm's key does not carry:
    LMCache's ``num_kv_readers`` (a lookup's read count) and mpcache's ``answer_in_ack`` (a
    lookup's)."""

    key: CacheKey
    num_kv_readers: int = 0
    answer_in_ack: bool = False


_KEY_REQUIRED: Final = ("model_name", "world_size", "token_ids", "start", "end", "request_id")
_KEY_REQUIRED_SET: Final = frozenset(_KEY_REQUIRED)


def decode_key(v: Any, limits: Limits) -> CacheKey:
    """Decode LMCache's ``IPCCacheServerKey`` msgpack map into a ``CacheKey``, bounded by
    ``limits``. Unknown fields are ignored. Raises ``_Bad`` (kind and message) when refused."""
    return _key_payload(v, limits).key


def _key_payload(v: Any, limits: Limits) -> KeyPayload:
    if type(v) is not dict:
        raise _Bad(ErrorKind.UNDECODABLE, f"key: expected map, got {_type_name(v)}")
    if not _KEY_REQUIRED_SET <= v.keys():
        missing = [f for f in _KEY_REQUIRED if f not in v]
        raise _Bad(ErrorKind.UNDECODABLE, f"key: missing fields {missing}")
    world_size = _as_int(v["world_size"], "key.world_size")
    if not 1 <= world_size <= limits.max_world_size:
        raise _Bad(ErrorKind.VALIDATION, f"key.world_size must be in [1, {limits.max_world_size}], not {world_size}")
    worker_id = v.get("worker_id")
    if worker_id is not None:
        worker_id = _as_int(worker_id, "key.worker_id")
    salt = v.get("cache_salt", "")
    if salt is None:
        salt = ""
    readers = v.get("num_kv_readers", 0)
    if readers is None:
        readers = 0
    readers = _as_int(readers, "key.num_kv_readers")
    if not 0 <= readers <= limits.max_world_size:
        raise _Bad(ErrorKind.VALIDATION, f"key.num_kv_readers must be in [0, {limits.max_world_size}], not {readers}")
    token_ids = _as_token_ids(v["token_ids"], limits.max_tokens)
    chunks = -(-len(token_ids) // max(1, limits.chunk_size))
    ranks = world_size if worker_id is None else 1
    if chunks * ranks > limits.max_chunk_ranks:
        raise _Bad(ErrorKind.TOO_LARGE, f"key covers {chunks} chunks x {ranks} ranks, limit {limits.max_chunk_ranks}")
    # core_sm checks the extras against the key's own chunks; here: no more than the largest key has
    extras = _decode_extras(v.get("key_identity"), v.get("chunk_extras"), -(-limits.max_tokens // max(1, limits.chunk_size)))
    key = CacheKey(
        model_name=_as_str(v["model_name"], "key.model_name", limits.max_name_bytes),
        world_size=world_size,
        worker_id=worker_id,
        token_ids=token_ids,
        start=_as_int(v["start"], "key.start"),
        end=_as_int(v["end"], "key.end"),
        request_id=_as_str(v["request_id"], "key.request_id", limits.max_name_bytes),
        cache_salt=_as_str(salt, "key.cache_salt", limits.max_salt_bytes),
        extras=extras,
    )
    answer_in_ack = v.get(ANSWER_IN_ACK_FIELD) or False  # absent or nil: not asked
    if type(answer_in_ack) is not bool:
        raise _Bad(ErrorKind.UNDECODABLE, f"key.{ANSWER_IN_ACK_FIELD}: expected bool, got {_type_name(answer_in_ack)}")
    return KeyPayload(key, readers, answer_in_ack)


def _decode_extras(identity: Any, chunk_extras: Any, max_chunks: int) -> KeyExtras:
    """mpcache's key fields beyond LMCache's (``mpcache.core_sm.keys``); absent or nil = none. At most
    ``max_chunks`` extras, each at most ``MAX_CHUNK_EXTRA_LEN`` bytes."""
    if identity is None and chunk_extras is None:
        return NO_EXTRAS
    identity = "" if identity is None else _as_str(identity, "key.key_identity", MAX_IDENTITY_LEN)
    if chunk_extras is None:
        chunk_extras = []
    if type(chunk_extras) is not list:
        raise _Bad(ErrorKind.UNDECODABLE, f"key.chunk_extras: expected list[bin], got {_type_name(chunk_extras)}")
    if len(chunk_extras) > max_chunks:
        raise _Bad(ErrorKind.TOO_LARGE, f"key.chunk_extras: {len(chunk_extras)} items for {max_chunks} chunks")
    for extra in chunk_extras:
        if type(extra) is not bytes:
            raise _Bad(ErrorKind.UNDECODABLE, f"key.chunk_extras: expected bin items, got {_type_name(extra)}")
        if len(extra) > MAX_CHUNK_EXTRA_LEN:
            raise _Bad(ErrorKind.TOO_LARGE, f"key.chunk_extras: an item of {len(extra)} bytes, limit {MAX_CHUNK_EXTRA_LEN}")
    return KeyExtras(identity, tuple(chunk_extras))


def encode_key(key: CacheKey, num_kv_readers: int = 0) -> dict[str, Any]:
    """The msgpack map LMCache's client sends for ``key``; token ids in mpcache's packed form
    when possible. mpcache's own key fields (``key_identity``, ``chunk_extras``) are added only
    when the key has extras, so a key without them is byte-for-byte LMCache's."""
    out: dict[str, Any] = {
        "model_name": key.model_name,
        "world_size": key.world_size,
        "worker_id": key.worker_id,
        "token_ids": token_ids_for_wire(key.token_ids),
        "start": key.start,
        "end": key.end,
        "request_id": key.request_id,
        "cache_salt": key.cache_salt,
        "request_configs": None,
        "num_kv_readers": num_kv_readers,
    }
    if not key.extras.empty:
        out["key_identity"] = key.extras.identity
        out["chunk_extras"] = list(key.extras.chunk_extras)
    return out


def _decode_param(p: P, v: Any, what: str, limits: Limits) -> Any:
    if p is _KEY:
        return _key_payload(v, limits)
    if p is _INT:
        return _as_int(v, what)
    if p is _OPT_INT:
        return None if v is None else _as_int(v, what)
    if p is _FLOAT or p is _OPT_FLOAT:
        if v is None and p is _OPT_FLOAT:
            return None
        if type(v) is float or type(v) is int:
            f = float(v)
            if f != f:
                raise _Bad(ErrorKind.VALIDATION, f"{what}: NaN")
            return f
        raise _Bad(ErrorKind.UNDECODABLE, f"{what}: expected float{' or nil' if p is _OPT_FLOAT else ''}, got {_type_name(v)}")
    if p is _STR or p is _ID:
        return _as_str(v, what, limits.max_name_bytes)
    if p is _OPT_STR:
        return None if v is None else _as_str(v, what, limits.max_name_bytes)
    if p is _BOOL:
        # LMCache coerces int <-> bool payloads; accept 0/1 ints as bools.
        if type(v) is bool:
            return v
        if type(v) is int and v in (0, 1):
            return bool(v)
        raise _Bad(ErrorKind.UNDECODABLE, f"{what}: expected bool, got {_type_name(v)}")
    if p is _BYTES:
        if type(v) is bytes:
            return v
        raise _Bad(ErrorKind.UNDECODABLE, f"{what}: expected bytes, got {_type_name(v)}")
    if p is _INT_LIST:
        return _as_int_list(v, what, limits.max_block_ids)
    if p is _MAP:
        if type(v) is dict:
            return v
        raise _Bad(ErrorKind.UNDECODABLE, f"{what}: expected map, got {_type_name(v)}")
    return v  # P.ANY


# ---------------------------------------------------------------------------------------------
# Building core_sm requests (server side) and their payloads (client side)


class BadRequest(Exception):
    """The wire request decoded but cannot become a core_sm request (UNDECODABLE)."""


@attrs.frozen
class Request:
    """A well-formed request. ``uid_frame``/``op_frame`` are echoed unchanged in the reply."""

    identity: bytes
    uid_frame: bytes
    op_frame: bytes
    uid: int
    op: str
    args: tuple[Any, ...]


def _opt(a: tuple[Any, ...], i: int, default: Any = None) -> Any:
    return a[i] if len(a) > i else default


def _clamp(not_after: float | None, now: float | None, limits: Limits) -> float | None:
    """A client's deadline, at most ``max_deadline_s`` past the server's clock: a far-future
    ``not_after`` would keep a remembered answer (and its block ids) alive for ever."""
    if not_after is None or now is None:
        return not_after
    return min(not_after, now + limits.max_deadline_s)


def _check_blocks(key: CacheKey, block_ids: tuple[int, ...]) -> tuple[int, ...]:
    # a block holds at least one token: more blocks than tokens is no engine's request
    if len(block_ids) > max(1, len(key.token_ids)):
        raise BadRequest(f"{len(block_ids)} block ids for {len(key.token_ids)} tokens")
    return block_ids


def _layout_field(layout: dict[str, Any], name: str, typ: type) -> Any:
    if name not in layout:
        raise BadRequest(f"register_instance layout: missing {name!r}")
    v = layout[name]
    if type(v) is not typ:
        raise BadRequest(f"register_instance layout: {name} must be {typ.__name__}")
    return v


def _register(a: tuple[Any, ...], rt: Any, peer: Any, now: float | None, limits: Limits) -> m.RegisterInstance:
    layout = a[1]
    model_name = _layout_field(layout, "model_name", str)
    if len(model_name.encode("utf-8", "surrogatepass")) > limits.max_name_bytes:
        raise BadRequest(f"register_instance layout: model_name longer than {limits.max_name_bytes} bytes")
    world_size = _layout_field(layout, "world_size", int)
    if not 1 <= world_size <= limits.max_world_size:
        raise BadRequest(f"register_instance layout: world_size must be in [1, {limits.max_world_size}]")
    return m.RegisterInstance(
        instance_id=a[0], model_name=model_name, world_size=world_size,
        object_bytes=_layout_field(layout, "object_bytes", int),
        engine_driven=bool(layout.get("engine_driven", False)), reply_to=rt, peer=peer,
    )


def _lookup(a: tuple[Any, ...], rt: Any, peer: Any, now: float | None, limits: Limits) -> m.Lookup:
    k: KeyPayload = a[0]
    tp_size = _opt(a, 1)
    if tp_size is not None and not 0 <= tp_size <= limits.max_world_size:
        raise BadRequest(f"lookup tp_size must be in [0, {limits.max_world_size}], not {tp_size}")
    readers = m.lookup_num_readers(k.num_kv_readers, tp_size, k.key.world_size)
    # mpcache's trailing ``ranks``: the KV ranks this server holds for the request (tensor-parallel
    # ranks spread over servers); LMCache's clients leave it out (every rank). core_sm refuses
    # empty, repeated or out-of-range ranks. The key's ``answer_in_ack`` field: see encode_lookup.
    return m.Lookup(k.key, num_readers=readers, ranks=_opt(a, 2), answer_in_ack=k.answer_in_ack,
                    reply_to=rt, peer=peer)


def encode_lookup(req: m.Lookup) -> tuple[Any, ...]:
    """A lookup's payloads: ``(key, 1[, ranks])``. ``answer_in_ack`` travels as a field of the key
    map (``"answer_in_ack": true``), present only when set: a server that does not know it
    ignores an unknown key field and acks nil as always (a trailing payload would be refused for
    its arity), and a lookup without it is byte for byte LMCache's."""
    key = encode_key(req.key, req.num_readers)
    if req.answer_in_ack:
        key[ANSWER_IN_ACK_FIELD] = True
    return (key, 1, *(() if req.ranks is None else (list(req.ranks),)))


def _store(a: tuple[Any, ...], rt: Any, peer: Any, now: float | None, limits: Limits) -> m.Store:
    key = a[0].key
    return m.Store(key, a[1], block_ids=_check_blocks(key, a[2]), reply_to=rt, peer=peer,
                   not_after=_clamp(_opt(a, 4), now, limits), registration=_opt(a, 5))


def _retrieve(a: tuple[Any, ...], rt: Any, peer: Any, now: float | None, limits: Limits) -> m.Retrieve:
    key = a[0].key
    return m.Retrieve(key, a[1], block_ids=_check_blocks(key, a[2]), skip_first_n_tokens=_opt(a, 4, 0), reply_to=rt,
                      peer=peer, not_after=_clamp(_opt(a, 5), now, limits), registration=_opt(a, 6))


def _named_registration(req: m.Store | m.Retrieve) -> tuple[int, ...]:
    """The trailing ``registration`` payload: only a resend names one, so an original request's
    payloads stay what a server without the field accepts."""
    return () if req.registration is None else (req.registration,)


def _clear(a: tuple[Any, ...], rt: Any, peer: Any, now: float | None, limits: Limits) -> m.Clear:
    return m.Clear(force=_opt(a, 0, False), reply_to=rt, peer=peer)


# (payloads, reply_to, peer, now, limits) -> the core_sm request
Build = Callable[[tuple[Any, ...], Any, Any, "float | None", Limits], Any]
Encode = Callable[[Any, "bytes | None", "Mapping[str, Any] | None"], tuple[Any, ...]]


def _needs_handle(req: Any, handle: bytes | None) -> bytes:
    if handle is None:
        raise TypeError(f"{type(req).__name__} (server-driven) needs the engine's event_handle")
    return handle


def _register_payloads(req: Any, _h: bytes | None, extra: Mapping[str, Any] | None) -> tuple[Any, ...]:
    layout = {"model_name": req.model_name, "world_size": req.world_size, "object_bytes": req.object_bytes,
              "engine_driven": req.engine_driven}
    if extra:
        layout = {**extra, **layout}  # the machine's fields win
    return (req.instance_id, layout)


@attrs.frozen
class OpSpec:
    """One row of the codec table.

    ``params``: payload shapes; ``optional_tail``: how many trailing payloads may be left out
    (LMCache's defaulted parameters). ``request_type`` / ``build``: the core_sm request this op
    becomes (None: answered by the runtime, no protocol state). ``encode``: the payloads a
    client sends for a ``request_type`` request."""

    name: str
    legacy_id: int | None
    params: tuple[P, ...]
    optional_tail: int = 0
    request_type: type | None = None
    build: Build | None = None
    encode: Encode | None = None


def _spec(name: str, legacy: int | None, *params: P, optional_tail: int = 0, request_type: type | None = None,
          build: Build | None = None, encode: Encode | None = None) -> OpSpec:
    return OpSpec(name, legacy, tuple(params), optional_tail, request_type, build, encode)


# The operations mpcache serves. Control plane: LMCache's names, legacy ids and payloads.
# Data plane: mpcache's own (documented in docs/protocol.md); they have no legacy id.
OPS: Final[tuple[OpSpec, ...]] = (
    _spec("noop", 24),
    # ping([instance_id]): LMCache's heartbeat sends none (or nil); mpcache's engines name each
    # registered instance, whose liveness at the server it is (--instance-ttl)
    _spec("ping", 22, P.OPT_INT, optional_tail=1, request_type=m.Ping,
          build=lambda a, rt, pr, now, lim: m.Ping(_opt(a, 0), reply_to=rt, peer=pr),
          encode=lambda r, h, x: () if r.instance_id is None else (r.instance_id,)),
    _spec("get_chunk_size", 21, request_type=m.GetChunkSize,
          build=lambda a, rt, pr, now, lim: m.GetChunkSize(reply_to=rt, peer=pr), encode=lambda r, h, x: ()),
    # lookup(key[, tp_size][, ranks]): ranks is mpcache's, sent only when the engine's ranks are
    # spread over several servers; the key map may carry mpcache's ``answer_in_ack`` (encode_lookup)
    _spec("lookup", 8, P.KEY, P.INT, P.INT_LIST, optional_tail=2, request_type=m.Lookup, build=_lookup,
          encode=lambda r, h, x: encode_lookup(r)),
    _spec("query_prefetch_status", 9, P.ID, request_type=m.QueryPrefetchStatus,
          build=lambda a, rt, pr, now, lim: m.QueryPrefetchStatus(a[0], reply_to=rt, peer=pr), encode=lambda r, h, x: (r.request_id,)),
    _spec("wait_prefetch_status", 10, P.ID, P.FLOAT, request_type=m.WaitPrefetchStatus,
          build=lambda a, rt, pr, now, lim: m.WaitPrefetchStatus(a[0], min(a[1], lim.max_deadline_s), reply_to=rt, peer=pr),
          encode=lambda r, h, x: (r.request_id, float(r.timeout))),
    _spec("free_lookup_locks", 12, P.KEY, P.INT, optional_tail=1, request_type=m.FreeLookupLocks,
          build=lambda a, rt, pr, now, lim: m.FreeLookupLocks(a[0].key, reply_to=rt, peer=pr), encode=lambda r, h, x: (encode_key(r.key), 1)),
    _spec("end_session", 13, P.ID, request_type=m.EndSession,
          build=lambda a, rt, pr, now, lim: m.EndSession(a[0], reply_to=rt, peer=pr), encode=lambda r, h, x: (r.request_id,)),
    # clear(force[, admin_token]): the token is mpcache's (docs/security.md); LMCache sends (force,)
    _spec("clear", 20, P.BOOL, P.OPT_STR, optional_tail=2, request_type=m.Clear, build=_clear,
          encode=lambda r, h, x: (r.force,)),
    # LMCache 0.5.6: (instance_id, model_name, records); April 2026: (records,)
    _spec("report_block_allocation", 23, P.ANY, P.ANY, P.ANY, optional_tail=2),
    # GPU, server-driven: key, instance_id, block_ids, event_ipc_handle[, skip_first_n_tokens]
    # [, not_after][, registration] (mpcache's deadline, and the registration a resend after
    # not_registered follows -- always the last payload, sent only by a resend; LMCache's
    # clients leave both out)
    _spec("store", 6, P.KEY, P.INT, P.INT_LIST, P.BYTES, P.OPT_FLOAT, P.OPT_INT, optional_tail=2,
          request_type=m.Store, build=_store,
          encode=lambda r, h, x: (encode_key(r.key), r.instance_id, list(r.block_ids), _needs_handle(r, h), r.not_after,
                                  *_named_registration(r))),
    _spec("retrieve", 7, P.KEY, P.INT, P.INT_LIST, P.BYTES, P.INT, P.OPT_FLOAT, P.OPT_INT, optional_tail=3,
          request_type=m.Retrieve, build=_retrieve,
          encode=lambda r, h, x: (encode_key(r.key), r.instance_id, list(r.block_ids), _needs_handle(r, h),
                                  r.skip_first_n_tokens, r.not_after, *_named_registration(r))),
    # mpcache's own
    _spec("health", None),
    _spec("stats", None),
    _spec("l1_info", None),
    _spec("register_instance", None, P.INT, P.MAP, request_type=m.RegisterInstance, build=_register, encode=_register_payloads),
    _spec("unregister_instance", None, P.INT, request_type=m.UnregisterInstance,
          build=lambda a, rt, pr, now, lim: m.UnregisterInstance(a[0], reply_to=rt, peer=pr), encode=lambda r, h, x: (r.instance_id,)),
    _spec("prepare_store", None, P.KEY, P.INT, P.OPT_FLOAT, optional_tail=1, request_type=m.PrepareStore,
          build=lambda a, rt, pr, now, lim: m.PrepareStore(a[0].key, a[1], reply_to=rt, peer=pr, not_after=_clamp(_opt(a, 2), now, lim)),
          encode=lambda r, h, x: (encode_key(r.key), r.instance_id, r.not_after)),
    _spec("prepare_retrieve", None, P.KEY, P.INT, P.INT, optional_tail=1, request_type=m.PrepareRetrieve,
          build=lambda a, rt, pr, now, lim: m.PrepareRetrieve(a[0].key, a[1], skip_first_n_tokens=_opt(a, 2, 0), reply_to=rt, peer=pr),
          encode=lambda r, h, x: (encode_key(r.key), r.instance_id, r.skip_first_n_tokens)),
    # the op name only labels the direction for humans; the server keys on transfer_id
    _spec("commit_store", None, P.INT, P.BOOL, request_type=m.CommitTransfer,
          build=lambda a, rt, pr, now, lim: m.CommitTransfer(a[0], a[1], reply_to=rt, peer=pr), encode=lambda r, h, x: (r.transfer_id, r.ok)),
    _spec("commit_retrieve", None, P.INT, P.BOOL,
          build=lambda a, rt, pr, now, lim: m.CommitTransfer(a[0], a[1], reply_to=rt, peer=pr)),
)

OPS_BY_NAME: Final[dict[str, OpSpec]] = {s.name: s for s in OPS}
OPS_BY_LEGACY_ID: Final[dict[int, OpSpec]] = {s.legacy_id: s for s in OPS if s.legacy_id is not None}
OPS_BY_REQUEST_TYPE: Final[dict[type, OpSpec]] = {s.request_type: s for s in OPS if s.request_type is not None}

# LMCache's numbered operations that mpcache does not serve (so an "unknown op" error can name them)
LEGACY_UNSERVED: Final[dict[int, str]] = {
    1: "register_kv_cache",
    2: "unregister_kv_cache",
    3: "register_q_cache",
    4: "unregister_q_cache",
    5: "store_q",
    11: "query_prefetch_lookup_hits",
    14: "register_kv_cache_engine_driven_context",
    15: "unregister_kv_cache_engine_driven_context",
    16: "prepare_store (LMCache payloads)",
    17: "commit_store (LMCache payloads)",
    18: "prepare_retrieve (LMCache payloads)",
    19: "commit_retrieve (LMCache payloads)",
    32: "get_experimental",
}


def to_event(req: Request, reply_to: Any, now: float | None = None, limits: Limits = Limits(), peer: Any = None) -> Any:
    """The core_sm request for ``req`` (``now``: the server's clock, for clamping deadlines;
    ``peer``: who sent it, as the transport knows it -- what core_sm's ownership checks compare).
    Raises ``BadRequest`` (or the constructors' TypeError / ValueError) when the payload cannot
    build one; the server answers UNDECODABLE."""
    spec = OPS_BY_NAME[req.op]
    if spec.build is None:
        raise BadRequest(f"operation {req.op!r} has no core_sm request")
    return spec.build(req.args, reply_to, peer, now, limits)


def request_to_wire(
    req: Any, *, event_handle: bytes | None = None, layout_extra: Mapping[str, Any] | None = None
) -> tuple[str, tuple[Any, ...]]:
    """``(op, payloads)`` for a core_sm server request (``SendRequest.request``).

    * ``Store`` / ``Retrieve`` (server-driven, GPU) need ``event_handle``: the interprocess CUDA
      event the engine recorded before the request, which the server's copy waits on; without it
      ``TypeError``. ``not_after`` (absolute seconds on the host's monotonic clock, or nil) is the
      request's deadline at the server; ``PrepareStore`` carries it too, as a third payload.
    * ``RegisterInstance``: ``layout_extra`` is merged into the layout map (a GPU engine's CUDA
      IPC handles and geometry, which core_sm does not model).

    Raises ``TypeError`` for a request with no client-side wire form."""
    spec = OPS_BY_REQUEST_TYPE.get(type(req))
    if spec is None or spec.encode is None:
        raise TypeError(f"{type(req).__name__} has no wire form on this path")
    return spec.name, spec.encode(req, event_handle, layout_extra)


def resend_payloads(op: str | int, payloads: Sequence[bytes], registration: int | None) -> list[bytes]:
    """The payload frames of a resend after ``not_registered`` (``core_sm.health.resend_of`` for a
    transport that keeps the frames it sent): a ``store`` / ``retrieve`` names ``registration``
    -- the registration it follows -- as its last payload (an optional payload before it that was
    left out is sent as what leaving it out means: nil, or a retrieve's skip of 0); any other op,
    or ``registration`` None, goes unchanged."""
    spec = OPS_BY_NAME.get(op) if isinstance(op, str) else OPS_BY_LEGACY_ID.get(op)
    if registration is None or spec is None or spec.request_type not in RESENDS_NAMING_REGISTRATION:
        return list(payloads)
    last = len(spec.params) - 1  # where the registration goes (the codec rows above)
    frames = list(payloads[:last])
    frames += [_LEFT_OUT[p] for p in spec.params[len(frames):last]]
    frames.append(msgpack.packb(registration))
    return frames


# An optional store / retrieve payload left out, sent explicitly: skip_first_n_tokens 0, no deadline.
_LEFT_OUT: Final = {P.INT: msgpack.packb(0), P.OPT_FLOAT: msgpack.packb(None)}


# ---------------------------------------------------------------------------------------------
# Decoding a message


@attrs.frozen
class DecodeError:
    """A request that can be answered (its uid is readable) but not served."""

    identity: bytes
    uid_frame: bytes
    uid: int
    op: str | None
    kind: ErrorKind
    message: str


@attrs.frozen
class Unattributable:
    """A message with no readable uid: counted, never answered."""

    reason: str


# msgpack's unsigned int headers: first byte -> the frame's whole length
_UINT_FRAME_LEN: Final = {0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9}


def decode_uid(uid_frame: bytes | memoryview) -> int | None:
    """The uid a frame carries, or None when it is not a short msgpack int."""
    n = len(uid_frame)
    if n > 16 or n == 0:
        return None
    # the forms every client sends (a positive fixint or a uint 8..64) without msgpack's call
    b0 = uid_frame[0]
    if b0 < 0x80:
        return b0 if n == 1 else None
    if _UINT_FRAME_LEN.get(b0) == n:
        return int.from_bytes(uid_frame[1:], "big")
    try:
        uid = _unpack(uid_frame)
    except Exception:
        return None
    return uid if type(uid) is int else None


def refusal(frames: Sequence[bytes | memoryview], kind: ErrorKind, message: str) -> DecodeError | Unattributable:
    """The answer to a message refused before decoding (too big, too many frames): ``frames``
    holds at least what arrived of identity and uid."""
    if len(frames) < 2:
        return Unattributable(message)
    uid = decode_uid(frames[1])
    if uid is None:
        return Unattributable(message)
    return DecodeError(bytes(frames[0]), bytes(frames[1]), uid, None, kind, message)


# op frame (msgpack of the name, or of LMCache's legacy id) -> its row: the op frame is a
# dictionary key, not a msgpack call
_SPEC_BY_OP_FRAME: Final[dict[bytes, OpSpec]] = {
    **{msgpack.packb(s.name): s for s in OPS},
    **{msgpack.packb(s.legacy_id): s for s in OPS if s.legacy_id is not None},
}


def _short_str(f: bytes | memoryview, limit: int) -> str | None:
    """A msgpack fixstr/str8 frame of at most ``limit`` bytes of valid UTF-8, decoded without
    msgpack (request ids: the payload of most requests); None: take the ordinary path, which
    gives the same value or the same refusal."""
    n = len(f)
    if n == 0:
        return None
    b0 = f[0]
    if 0xA0 <= b0 <= 0xBF:
        start = 1
        size = b0 & 0x1F
    elif b0 == 0xD9 and n >= 2:
        start = 2
        size = f[1]
    else:
        return None
    if start + size != n or size > limit:
        return None
    try:
        return bytes(f[start:]).decode("utf-8")
    except UnicodeDecodeError:
        return None


# A key map's ``token_ids`` field name (a fixstr), and the bin headers (bin8/16/32) of mpcache's
# packed ids after it. It is looked for in the frame's first bytes: LMCache's field order puts it
# after the model name (at most max_name_bytes) and two small ints.
_TOKEN_IDS_FIELD: Final = msgpack.packb("token_ids")
_BIN_HEADERS: Final = frozenset({0xC4, 0xC5, 0xC6})
_PACKED_IDS_WINDOW: Final = 512


def _packed_token_ids(frame: bytes | memoryview) -> bool:
    """Whether a key frame (most likely) carries its token ids packed, as a bin: then the list-form
    scanner (runtime_zmq.tokens), which declines a bin, is not run for nothing. Only a shortcut:
    the ordinary decode gives the same value or refusal whichever way this answers (a list-form
    frame it mistakes, say a model name holding these bytes, only costs msgpack's slower walk)."""
    head = bytes(frame[:_PACKED_IDS_WINDOW])
    at = head.find(_TOKEN_IDS_FIELD) + len(_TOKEN_IDS_FIELD)
    return len(_TOKEN_IDS_FIELD) <= at < len(head) and head[at] in _BIN_HEADERS


def _spec_of_op_frame(op_frame: bytes) -> OpSpec:
    """The row of an op frame that is not in the byte table (e.g. a non-canonical msgpack
    encoding of a name or id); raises ``_Bad`` for an unknown or malformed op."""
    try:
        op_raw = _unpack(op_frame)
    except Exception:
        raise _Bad(ErrorKind.UNDECODABLE, "op frame is not msgpack") from None
    spec: OpSpec | None
    if type(op_raw) is str:
        spec = OPS_BY_NAME.get(op_raw)
        if spec is None:
            raise _Bad(ErrorKind.UNKNOWN_OP, f"unknown operation {op_raw[:64]!r}")
        return spec
    if type(op_raw) is int:
        spec = OPS_BY_LEGACY_ID.get(op_raw)
        if spec is None:
            unserved = LEGACY_UNSERVED.get(op_raw)
            what = f" ({unserved}: not served by mpcache)" if unserved else ""
            raise _Bad(ErrorKind.UNKNOWN_OP, f"unknown operation id {op_raw}{what}")
        return spec
    raise _Bad(ErrorKind.UNKNOWN_OP, f"op is {_type_name(op_raw)}, not str or int")


def decode_request(frames: Sequence[bytes | memoryview], limits: Limits) -> Request | DecodeError | Unattributable:
    """Decode one ROUTER message. Never raises. Payload frames may be memoryviews of the
    socket's buffers (decoded without a copy)."""
    n = len(frames)
    if n < 2:
        return Unattributable(f"{n} frame(s): no uid frame")
    identity = bytes(frames[0])
    uid_frame = bytes(frames[1])
    uid = decode_uid(uid_frame)
    if uid is None:
        return Unattributable("uid frame is not a msgpack int")

    op_name: str | None = None
    try:
        if n < 3:
            raise _Bad(ErrorKind.BAD_ARITY, "message has no op frame")
        if n > limits.max_frames + 3:
            raise _Bad(ErrorKind.TOO_LARGE, f"{n - 3} payload frames, limit {limits.max_frames}")
        total = 0
        for f in frames[2:]:
            if len(f) > limits.max_frame_bytes:
                raise _Bad(ErrorKind.TOO_LARGE, f"frame of {len(f)} bytes, limit {limits.max_frame_bytes}")
            total += len(f)
        if total > limits.max_message_bytes:
            raise _Bad(ErrorKind.TOO_LARGE, f"message of {total} bytes, limit {limits.max_message_bytes}")
        if len(frames[2]) > 70:
            raise _Bad(ErrorKind.UNKNOWN_OP, "op frame longer than any operation name")
        op_frame = bytes(frames[2])
        spec = _SPEC_BY_OP_FRAME.get(op_frame)
        if spec is None:
            spec = _spec_of_op_frame(op_frame)
        op_name = spec.name
        payloads = frames[3:]
        np_, nmax = len(payloads), len(spec.params)
        if not (nmax - spec.optional_tail <= np_ <= nmax):
            want = str(nmax) if spec.optional_tail == 0 else f"{nmax - spec.optional_tail}..{nmax}"
            raise _Bad(ErrorKind.BAD_ARITY, f"{spec.name}: {np_} payload(s), expected {want}")
        args: list[Any] = []
        params = spec.params
        for i, f in enumerate(payloads):
            p = params[i]
            if p is _ID or p is _STR:
                short = _short_str(f, limits.max_name_bytes)
                if short is not None:
                    args.append(short)
                    continue
            elif (p is _INT or p is _OPT_INT) and len(f) == 1 and f[0] < 0x80:
                args.append(f[0])  # a positive fixint (a tp size, an instance id): msgpack's value
                continue
            what = f"{spec.name} payload {i}"
            try:
                ul = _unpack_limits(p, limits)
                v = None
                if p is _KEY:
                    # The biggest key is 1M list-form ids of 5 bytes each plus its short fields:
                    # a bigger frame is refused before anything walks it.
                    if len(f) > 5 * limits.max_tokens + _KEY_FIELDS_BYTES:
                        raise _Bad(ErrorKind.TOO_LARGE, f"{what}: a key frame of {len(f)} bytes")
                    # A key's list-form token ids go straight into a uint32 buffer
                    # (runtime_zmq.tokens), the rest of the map under the same limits; a frame the
                    # scanner declines (or that is not a map at all) is decoded the ordinary way.
                    if f and (0x80 <= f[0] <= 0x8F or f[0] in (0xDE, 0xDF)) and not _packed_token_ids(f):
                        v = decode_key_frame(f, lambda rest: _unpack(rest, ul, limits.max_containers))
                if v is None:
                    v = _unpack(f, ul, limits.max_containers)
            except _Bad:
                raise
            except ValueError as e:  # msgpack's limits ("... exceeds max_..._len(N)")
                kind = ErrorKind.TOO_LARGE if "exceeds max" in str(e) else ErrorKind.UNDECODABLE
                hint = " (longer token lists must be sent packed, as a bin of uint32)" if p is _KEY and "array" in str(e) else ""
                raise _Bad(kind, f"{what}: {e}"[:300] + hint) from None
            except Exception:
                raise _Bad(ErrorKind.UNDECODABLE, f"{what}: not msgpack") from None
            args.append(_decode_param(p, v, what, limits))
        return Request(identity, uid_frame, op_frame, uid, spec.name, tuple(args))
    except _Bad as e:
        return DecodeError(identity, uid_frame, uid, op_name, e.kind, e.message)
    except Exception as e:  # a decoder bug must still produce a reply
        return DecodeError(identity, uid_frame, uid, op_name, ErrorKind.INTERNAL, f"decode failed: {e!r}"[:500])


# ---------------------------------------------------------------------------------------------
# Results (server side) and their decoding (client side)


def plan_to_wire(plan: TransferPlan, segment: str, slot_bytes: int) -> dict[str, Any]:
    """An engine-driven plan with the memory behind each slot: ``[chunk_index, slot, offset]``."""
    return {
        "transfer_id": plan.transfer_id,
        "ok": plan.ok,
        "kind": plan.kind.value,
        "skip_first_n_tokens": plan.skip_first_n_tokens,
        "segment": segment,
        "slot_bytes": slot_bytes,
        "placements": [[c, s, s * slot_bytes] for c, s in plan.placements],
    }


def result_to_wire(op: str, result: Any, *, event_handle: bytes = b"", segment: str = "", slot_bytes: int = 0) -> Any:
    """The msgpack value of a reply to ``op`` carrying core_sm's ``result``.

    Server-driven ``store``/``retrieve`` keep LMCache's ``(event_handle, ok)`` shape."""
    if isinstance(result, m.StoreResult):
        if op == "store":
            return [event_handle, result.ok]
        return {"ok": result.ok, "stored": result.stored, "skipped": result.skipped}
    if isinstance(result, m.RetrieveResult):
        if op == "retrieve":
            return [event_handle, result.ok]
        return {"ok": result.ok, "chunks": result.chunks}
    if isinstance(result, TransferPlan):
        return plan_to_wire(result, segment, slot_bytes)
    return result


@attrs.frozen
class PlanMemory:
    """Where an engine-driven plan's slots live: placement ``(chunk, slot)`` is bytes
    ``[slot * slot_bytes, slot * slot_bytes + object_bytes)`` of the file ``segment`` (a server
    that restarted has a new one)."""

    segment: str
    slot_bytes: int


def plan_memory_from_wire(value: Any) -> PlanMemory:
    """The memory half of a ``prepare_store`` / ``prepare_retrieve`` reply (what
    ``result_to_wire``'s ``segment`` and ``slot_bytes`` put there; ``result_from_wire`` gives the
    ``TransferPlan``). Raises ``ValueError`` if the reply has none."""
    if not isinstance(value, dict) or not isinstance(value.get("segment"), str) or type(value.get("slot_bytes")) is not int:
        raise ValueError(f"not a plan with its memory: {value!r:.200}")
    return PlanMemory(value["segment"], value["slot_bytes"])


def result_from_wire(req: Any, value: Any) -> Any:
    """Decode a reply value into the result type core_sm's client machines expect.

    Server-driven ``Store`` / ``Retrieve``: LMCache's ``[event_handle, ok]`` becomes
    ``StoreResult(ok)`` / ``RetrieveResult(ok)`` (the server answers after its copy completed on
    the device, so the handle adds nothing to wait for); any other shape raises ``ValueError``."""
    if isinstance(req, (m.Store, m.Retrieve)):
        if not (isinstance(value, (list, tuple)) and len(value) == 2):
            raise ValueError(f"unexpected reply {value!r:.200} to a server-driven {type(req).__name__}")
        ok = bool(value[1])
        return m.StoreResult(ok=ok) if isinstance(req, m.Store) else m.RetrieveResult(ok=ok)
    if isinstance(req, (m.PrepareStore, m.PrepareRetrieve)) and isinstance(value, dict):
        kind = TransferKind(value.get("kind", "store"))
        return TransferPlan(
            transfer_id=int(value["transfer_id"]),
            placements=[(int(p[0]), int(p[1])) for p in value["placements"]],
            ok=bool(value["ok"]),
            kind=kind,
            skip_first_n_tokens=int(value.get("skip_first_n_tokens", 0)),
        )
    if isinstance(req, m.CommitTransfer) and isinstance(value, dict):
        if "chunks" in value:
            return m.RetrieveResult(ok=bool(value["ok"]), chunks=int(value["chunks"]))
        return m.StoreResult(ok=bool(value["ok"]), stored=int(value.get("stored", 0)), skipped=int(value.get("skipped", 0)))
    return value


# ---------------------------------------------------------------------------------------------
# Encoding frames


# the result frames of the commonest replies (hit counts, "OK"), encoded once
_INT_RESULT_FRAMES: Final = tuple(msgpack.packb(i) for i in range(4097))
_OK_FRAME: Final = msgpack.packb("OK")


def encode_reply(identity: bytes, uid_frame: bytes, op_frame: bytes, result: Any) -> list[bytes]:
    """Success reply: the result frame is present only when ``result`` is not None."""
    if result is None:
        return [identity, uid_frame, op_frame]
    t = type(result)
    if t is int and 0 <= result < len(_INT_RESULT_FRAMES):
        return [identity, uid_frame, op_frame, _INT_RESULT_FRAMES[result]]
    if t is str and result == "OK":
        return [identity, uid_frame, op_frame, _OK_FRAME]
    return [identity, uid_frame, op_frame, msgpack.packb(result, use_bin_type=True)]


def encode_error(identity: bytes, uid_frame: bytes, op: str | None, kind: str, message: str) -> list[bytes]:
    body = {"kind": kind, "message": message, "op": op}
    return [identity, uid_frame, ERROR_OP_FRAME, msgpack.packb(body, use_bin_type=True)]


def encode_request(uid: int, op: str | int, args: Sequence[Any]) -> list[bytes]:
    """Client side: ``[uid, op, payload...]`` (the DEALER adds no identity)."""
    out = [msgpack.packb(uid), msgpack.packb(op)]
    for a in args:
        out.append(msgpack.packb(a, use_bin_type=True))
    return out


def pack(v: Any) -> bytes:
    data: bytes = msgpack.packb(v, use_bin_type=True)
    return data
