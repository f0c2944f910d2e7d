"""mpcache's wire codec: ZMQ multipart frames <-> typed requests and replies.

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

Nothing here knows protocol semantics: decoding checks shapes and types only, and produces plain
Python values (``WireKey`` for LMCache's ``IPCCacheServerKey`` map). ``runtime_zmq.bridge`` turns
them into core_sm events. Decoding never raises: every failure is a ``DecodeError`` value.

Token ids become a ``core_sm.chunks.TokenIds`` (one packed little-endian uint32 buffer): a msgpack
bin of packed ids (mpcache's client) is wrapped as received; LMCache's list of ints is scanned out
of the frame by a compiled decoder (``runtime_zmq.tokens``) into one uint32 buffer. Neither form
costs a Python object per token.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Final

import attrs
import msgpack  # type: ignore[import-untyped]

from core_sm.chunks import TokenIds, as_token_ids, pack_tokens
from core_sm.messages import CacheKey
from core_sm.keys import NO_EXTRAS, KeyExtras
from runtime_zmq.tokens import decode_key_frame

# ---------------------------------------------------------------------------------------------
# Error kinds on the wire (lower-case names of core_sm's ErrorKind; the codec's own failures use
# the same vocabulary so a client sees one set of kinds).


class WireErrorKind(str, enum.Enum):
    UNKNOWN_OP = "unknown_op"
    BAD_ARITY = "bad_arity"
    UNDECODABLE = "undecodable"
    VALIDATION = "validation"
    TOO_LARGE = "too_large"
    INTERNAL = "internal"
    TIMEOUT = "timeout"
    SHUTTING_DOWN = "shutting_down"


ERROR_OP: Final = "error"
ERROR_OP_FRAME: Final = msgpack.packb(ERROR_OP)


@attrs.frozen
class Limits:
    """Resource limits applied while decoding (configurable from the CLI)."""

    max_frame_bytes: int = 64 * 1024 * 1024
    max_frames: int = 16
    max_tokens: int = 1 << 20
    max_block_ids: int = 1 << 20


# ---------------------------------------------------------------------------------------------
# Parameter types


class P(enum.Enum):
    """The shape a payload frame must decode to."""

    INT = "int"
    OPT_INT = "int | None"
    FLOAT = "float"
    OPT_FLOAT = "float | None"
    STR = "str"
    BOOL = "bool"
    BYTES = "bytes"
    KEY = "IPCCacheServerKey"
    INT_LIST = "list[int]"
    MAP = "map"
    LIST = "list"
    ANY = "any"


@attrs.frozen
class WireKey:
    """LMCache's ``IPCCacheServerKey`` as decoded from its msgpack map (unknown fields ignored)."""

    model_name: str
    world_size: int
    worker_id: int | None
    token_ids: TokenIds = attrs.field(converter=as_token_ids)
    start: int
    end: int
    request_id: str
    cache_salt: str = ""
    num_kv_readers: int = 0
    extras: KeyExtras = NO_EXTRAS


@attrs.frozen
class OpSpec:
    name: str
    legacy_id: int | None
    params: tuple[P, ...]
    # how many trailing params may be left out (LMCache's defaulted parameters)
    optional_tail: int = 0


def _spec(name: str, legacy: int | None, *params: P, optional_tail: int = 0) -> OpSpec:
    return OpSpec(name, legacy, tuple(params), optional_tail)


# The operations mpcache serves. Control plane: LMCache's names, legacy ids and payloads.
# Data plane: mpcache's own (documented in docs/protocol.md); they have no legacy id.
OPS: Final[tuple[OpSpec, ...]] = (
    _spec("noop", 24),
    _spec("ping", 22, P.OPT_INT, optional_tail=1),
    _spec("get_chunk_size", 21),
    _spec("lookup", 8, P.KEY, P.INT, optional_tail=1),
    _spec("query_prefetch_status", 9, P.STR),
    _spec("wait_prefetch_status", 10, P.STR, P.FLOAT),
    _spec("free_lookup_locks", 12, P.KEY, P.INT, optional_tail=1),
    _spec("end_session", 13, P.STR),
    _spec("clear", 20, P.BOOL, optional_tail=1),
    # LMCache 0.5.6: (instance_id, model_name, records); April 2026: (records,)
    _spec("report_block_allocation", 23, P.ANY, P.ANY, P.ANY, optional_tail=2),
    # GPU, server-driven: key, instance_id, block_ids, event_ipc_handle[, skip_first_n_tokens]
    # [, not_after] (mpcache's deadline; LMCache's clients leave it out)
    _spec("store", 6, P.KEY, P.INT, P.INT_LIST, P.BYTES, P.OPT_FLOAT, optional_tail=1),
    _spec("retrieve", 7, P.KEY, P.INT, P.INT_LIST, P.BYTES, P.INT, P.OPT_FLOAT, optional_tail=2),
    # mpcache's own
    _spec("health", None),
    _spec("stats", None),
    _spec("l1_info", None),
    _spec("register_instance", None, P.INT, P.MAP),
    _spec("unregister_instance", None, P.INT),
    _spec("prepare_store", None, P.KEY, P.INT, P.OPT_FLOAT, optional_tail=1),
    _spec("prepare_retrieve", None, P.KEY, P.INT, P.INT, optional_tail=1),
    _spec("commit_store", None, P.INT, P.BOOL),
    _spec("commit_retrieve", None, P.INT, P.BOOL),
)

OPS_BY_NAME: Final[dict[str, OpSpec]] = {s.name: s for s in OPS}
OPS_BY_LEGACY_ID: Final[dict[int, OpSpec]] = {s.legacy_id: s for s in OPS if s.legacy_id is not None}

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

# ---------------------------------------------------------------------------------------------
# Decoded request / failures


@attrs.frozen
class Request:
    """A well-formed request. ``uid_frame``/``op_frame`` are echoed unchanged in the reply."""

    identity: bytes
    uid_frame: bytes
    op_frame: bytes
    uid: int
    op: str
    args: tuple[Any, ...]


@attrs.frozen
class DecodeError:
    """A request that can be answered (its uid is readable) but not served."""

    identity: bytes
    uid_frame: bytes
    uid: int
    op: str | None
    kind: WireErrorKind
    message: str


@attrs.frozen
class Unattributable:
    """A message with no readable uid: counted, never answered."""

    reason: str


class _Bad(Exception):
    def __init__(self, kind: WireErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def _unpack(frame: bytes) -> Any:
    # raw=False: str frames decode as str and invalid utf-8 fails; ext types are not decoded into
    # objects (they stay ExtType and then fail the type checks); no pickle anywhere.
    return msgpack.unpackb(frame, raw=False, strict_map_key=False, use_list=True)


def _type_name(v: Any) -> str:
    return type(v).__name__


def _as_int(v: Any, what: str) -> int:
    if type(v) is not int:
        raise _Bad(WireErrorKind.UNDECODABLE, f"{what}: expected int, got {_type_name(v)}")
    return v


def _as_str(v: Any, what: str) -> str:
    if type(v) is not str:
        raise _Bad(WireErrorKind.UNDECODABLE, f"{what}: expected str, got {_type_name(v)}")
    return v


def _as_int_list(v: Any, what: str, limit: int) -> tuple[int, ...]:
    if type(v) is not list:
        raise _Bad(WireErrorKind.UNDECODABLE, f"{what}: expected list[int], got {_type_name(v)}")
    if len(v) > limit:
        raise _Bad(WireErrorKind.TOO_LARGE, f"{what}: {len(v)} items, limit {limit}")
    # Element types are checked where the values are used (token packing rejects non-ints and
    # out-of-range values in C); here only the container is checked, keeping the hot path lean.
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
            raise _Bad(WireErrorKind.UNDECODABLE, f"key.token_ids: {len(v)} bytes is not a whole number of uint32")
        if len(v) // 4 > limit:
            raise _Bad(WireErrorKind.TOO_LARGE, f"key.token_ids: {len(v) // 4} items, limit {limit}")
        return TokenIds.from_packed(v)
    if type(v) is not list:
        raise _Bad(WireErrorKind.UNDECODABLE, f"key.token_ids: expected list[int] or bin, got {_type_name(v)}")
    if len(v) > limit:
        raise _Bad(WireErrorKind.TOO_LARGE, f"key.token_ids: {len(v)} items, limit {limit}")
    # Packed once, in C (array.fromlist). A list holding something other than uint32 ids is kept
    # as given; core_sm answers it with a validation error when it hashes the key.
    return TokenIds.from_ints(v)


_KEY_REQUIRED: Final = ("model_name", "world_size", "token_ids", "start", "end", "request_id")


def decode_key(v: Any, limits: Limits) -> WireKey:
    """Decode LMCache's ``IPCCacheServerKey`` msgpack map. Unknown fields are ignored."""
    if type(v) is not dict:
        raise _Bad(WireErrorKind.UNDECODABLE, f"key: expected map, got {_type_name(v)}")
    missing = [f for f in _KEY_REQUIRED if f not in v]
    if missing:
        raise _Bad(WireErrorKind.UNDECODABLE, f"key: missing fields {missing}")
    worker_id = v.get("worker_id")
    if worker_id is not None:
        worker_id = _as_int(worker_id, "key.worker_id")
    salt = v.get("cache_salt", "")
    if salt is None:
        salt = ""
    readers = v.get("num_kv_readers", 0)
    if readers is None:
        readers = 0
    extras = _decode_extras(v.get("key_identity"), v.get("chunk_extras"), limits)
    return WireKey(
        model_name=_as_str(v["model_name"], "key.model_name"),
        world_size=_as_int(v["world_size"], "key.world_size"),
        worker_id=worker_id,
        token_ids=_as_token_ids(v["token_ids"], limits.max_tokens),
        start=_as_int(v["start"], "key.start"),
        end=_as_int(v["end"], "key.end"),
        request_id=_as_str(v["request_id"], "key.request_id"),
        cache_salt=_as_str(salt, "key.cache_salt"),
        num_kv_readers=_as_int(readers, "key.num_kv_readers"),
        extras=extras,
    )


def _decode_extras(identity: Any, chunk_extras: Any, limits: Limits) -> KeyExtras:
    """mpcache's key fields beyond LMCache's (``core_sm.keys``); absent or nil = none."""
    if identity is None and chunk_extras is None:
        return NO_EXTRAS
    identity = "" if identity is None else _as_str(identity, "key.key_identity")
    if chunk_extras is None:
        chunk_extras = []
    if type(chunk_extras) is not list:
        raise _Bad(WireErrorKind.UNDECODABLE, f"key.chunk_extras: expected list[bin], got {_type_name(chunk_extras)}")
    if len(chunk_extras) > limits.max_tokens:
        raise _Bad(WireErrorKind.TOO_LARGE, f"key.chunk_extras: {len(chunk_extras)} items, limit {limits.max_tokens}")
    for extra in chunk_extras:
        if type(extra) is not bytes:
            raise _Bad(WireErrorKind.UNDECODABLE, f"key.chunk_extras: expected bin items, got {_type_name(extra)}")
    return KeyExtras(identity, tuple(chunk_extras))


def encode_key(key: WireKey | CacheKey, num_kv_readers: int | None = None) -> dict[str, Any]:
    """The msgpack map LMCache's client sends for ``key`` (used by mpcache's client and the
    bridge); token ids in mpcache's packed form when possible. ``num_kv_readers`` defaults to
    the key's own (0 for a core_sm ``CacheKey``, which carries none). mpcache's own key fields
    (``key_identity``, ``chunk_extras``) are added only when the key has extras, so a key
    without them is byte-for-byte LMCache's."""
    if num_kv_readers is None:
        num_kv_readers = key.num_kv_readers if isinstance(key, WireKey) else 0
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
    if p is P.INT:
        return _as_int(v, what)
    if p is P.OPT_INT:
        return None if v is None else _as_int(v, what)
    if p is P.FLOAT:
        if type(v) is float or type(v) is int:
            return float(v)
        raise _Bad(WireErrorKind.UNDECODABLE, f"{what}: expected float, got {_type_name(v)}")
    if p is P.OPT_FLOAT:
        if v is None:
            return None
        if type(v) is float or type(v) is int:
            return float(v)
        raise _Bad(WireErrorKind.UNDECODABLE, f"{what}: expected float or nil, got {_type_name(v)}")
    if p is P.STR:
        return _as_str(v, what)
    if p is P.BOOL:
        # LMCache coerces int <-> bool payloads; accept 0/1 ints as bools.
        if type(v) is bool:
            return v
        if type(v) is int and v in (0, 1):
            return bool(v)
        raise _Bad(WireErrorKind.UNDECODABLE, f"{what}: expected bool, got {_type_name(v)}")
    if p is P.BYTES:
        if type(v) is bytes:
            return v
        raise _Bad(WireErrorKind.UNDECODABLE, f"{what}: expected bytes, got {_type_name(v)}")
    if p is P.KEY:
        return decode_key(v, limits)
    if p is P.INT_LIST:
        return _as_int_list(v, what, limits.max_block_ids)
    if p is P.MAP:
        if type(v) is dict:
            return v
        raise _Bad(WireErrorKind.UNDECODABLE, f"{what}: expected map, got {_type_name(v)}")
    if p is P.LIST:
        if type(v) is list:
            return v
        raise _Bad(WireErrorKind.UNDECODABLE, f"{what}: expected list, got {_type_name(v)}")
    return v  # P.ANY


def decode_request(frames: Sequence[bytes], limits: Limits) -> Request | DecodeError | Unattributable:
    """Decode one ROUTER message. Never raises."""
    n = len(frames)
    if n < 2:
        return Unattributable(f"{n} frame(s): no uid frame")
    identity = frames[0]
    uid_frame = frames[1]
    try:
        if len(uid_frame) > 16:
            raise ValueError("uid frame too long")
        uid = _unpack(uid_frame)
    except Exception:
        return Unattributable("uid frame is not msgpack")
    if type(uid) is not int:
        return Unattributable(f"uid is {_type_name(uid)}, not int")

    op_name: str | None = None
    try:
        if n < 3:
            raise _Bad(WireErrorKind.BAD_ARITY, "message has no op frame")
        if n > limits.max_frames + 3:
            raise _Bad(WireErrorKind.BAD_ARITY, f"{n - 3} payload frames, limit {limits.max_frames}")
        for f in frames[2:]:
            if len(f) > limits.max_frame_bytes:
                raise _Bad(WireErrorKind.TOO_LARGE, f"frame of {len(f)} bytes, limit {limits.max_frame_bytes}")
        op_frame = frames[2]
        try:
            op_raw = _unpack(op_frame)
        except Exception:
            raise _Bad(WireErrorKind.UNDECODABLE, "op frame is not msgpack") from None
        spec: OpSpec | None
        if type(op_raw) is str:
            spec = OPS_BY_NAME.get(op_raw)
            if spec is None:
                raise _Bad(WireErrorKind.UNKNOWN_OP, f"unknown operation {op_raw[:64]!r}")
        elif type(op_raw) is int:
            spec = OPS_BY_LEGACY_ID.get(op_raw)
            if spec is None:
                unserved = LEGACY_UNSERVED.get(op_raw)
                what = f" ({unserved}: not served by mpcache)" if unserved else ""
                raise _Bad(WireErrorKind.UNKNOWN_OP, f"unknown operation id {op_raw}{what}")
        else:
            raise _Bad(WireErrorKind.UNKNOWN_OP, f"op is {_type_name(op_raw)}, not str or int")
        op_name = spec.name
        payloads = frames[3:]
        np_, nmax = len(payloads), len(spec.params)
        if not (nmax - spec.optional_tail <= np_ <= nmax):
            want = str(nmax) if spec.optional_tail == 0 else f"{nmax - spec.optional_tail}..{nmax}"
            raise _Bad(WireErrorKind.BAD_ARITY, f"{spec.name}: {np_} payload(s), expected {want}")
        args = []
        for i, f in enumerate(payloads):
            what = f"{spec.name} payload {i}"
            try:
                # A key's list-form token ids go straight into a uint32 buffer (runtime_zmq.tokens);
                # any frame the scanner declines is decoded the ordinary way.
                v = decode_key_frame(f) if spec.params[i] is P.KEY else None
                if v is None:
                    v = _unpack(f)
            except Exception:
                raise _Bad(WireErrorKind.UNDECODABLE, f"{what}: not msgpack") from None
            args.append(_decode_param(spec.params[i], v, what, limits))
        return Request(identity, uid_frame, op_frame, uid, spec.name, tuple(args))
    except _Bad as e:
        return DecodeError(identity, uid_frame, uid, op_name, e.kind, e.message)
    except Exception as e:  # a decoder bug must still produce a reply
        return DecodeError(identity, uid_frame, uid, op_name, WireErrorKind.INTERNAL, f"decode failed: {e!r}"[:500])


# ---------------------------------------------------------------------------------------------
# Encoding

def encode_reply(identity: bytes, uid_frame: bytes, op_frame: bytes, result: Any) -> list[bytes]:
    """Success reply: the result frame is present only when ``result`` is not None."""
    if result is None:
        return [identity, uid_frame, op_frame]
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

