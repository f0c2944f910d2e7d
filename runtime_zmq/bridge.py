"""Wire values <-> core_sm messages. Shapes only: every protocol decision is core_sm's.

Server side: ``to_event(request, reply_to)`` builds the core_sm request for a decoded wire
request, and ``result_to_wire(op, result, ...)`` turns a core_sm result into the msgpack value of
the reply. Client side, the mirror image: ``request_to_wire(request, ...)`` gives ``(op, args)``
for a core_sm request (what a ``SendRequest`` effect carries), and ``result_from_wire`` decodes a
reply back into the result type core_sm expects.

What the wire carries and core_sm does not travels beside the core_sm values, in both
directions: a server-driven STORE / RETRIEVE's interprocess event handle (``event_handle=`` on
both sides), the memory behind an engine-driven plan's slots (``result_to_wire(...,
segment=, slot_bytes=)`` / ``plan_memory_from_wire``), and a GPU engine's registration fields
(``request_to_wire(..., layout_extra=)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from core_sm import messages as m
from core_sm.messages import TransferKind, TransferPlan
from runtime_zmq.wire import Request, WireKey, encode_key


class BadRequest(Exception):
    """The wire request decoded but cannot become a core_sm request (UNDECODABLE)."""


def to_cache_key(k: WireKey) -> m.CacheKey:
    return m.CacheKey(
        model_name=k.model_name,
        world_size=k.world_size,
        worker_id=k.worker_id,
        token_ids=k.token_ids,
        start=k.start,
        end=k.end,
        request_id=k.request_id,
        cache_salt=k.cache_salt,
        extras=k.extras,
    )


def _layout_field(layout: dict[str, Any], name: str, typ: type) -> Any:
    if name not in layout:
        raise BadRequest(f"register_instance layout: missing {name!r}")
    v = layout[name]
    if typ is int and (type(v) is not int):
        raise BadRequest(f"register_instance layout: {name} must be int")
    if typ is str and type(v) is not str:
        raise BadRequest(f"register_instance layout: {name} must be str")
    if typ is bool and type(v) is not bool:
        raise BadRequest(f"register_instance layout: {name} must be bool")
    return v


def to_event(req: Request, reply_to: Any) -> Any:
    """The core_sm request for ``req``. Raises ``BadRequest`` (or the constructors' TypeError /
    ValueError) when the payload cannot build one; the server answers UNDECODABLE."""
    op, a = req.op, req.args
    if op == "lookup":
        key: WireKey = a[0]
        tp_size = a[1] if len(a) > 1 else None
        readers = m.lookup_num_readers(key.num_kv_readers, tp_size, key.world_size)
        return m.Lookup(to_cache_key(key), num_readers=readers, reply_to=reply_to)
    if op == "query_prefetch_status":
        return m.QueryPrefetchStatus(a[0], reply_to=reply_to)
    if op == "wait_prefetch_status":
        return m.WaitPrefetchStatus(a[0], a[1], reply_to=reply_to)
    if op == "free_lookup_locks":
        return m.FreeLookupLocks(to_cache_key(a[0]), reply_to=reply_to)
    if op == "end_session":
        return m.EndSession(a[0], reply_to=reply_to)
    if op == "clear":
        return m.Clear(force=a[0] if a else False, reply_to=reply_to)
    if op == "ping":
        return m.Ping(reply_to=reply_to)
    if op == "get_chunk_size":
        return m.GetChunkSize(reply_to=reply_to)
    if op == "register_instance":
        layout = a[1]
        return m.RegisterInstance(
            instance_id=a[0],
            model_name=_layout_field(layout, "model_name", str),
            world_size=_layout_field(layout, "world_size", int),
            object_bytes=_layout_field(layout, "object_bytes", int),
            engine_driven=bool(layout.get("engine_driven", False)),
            reply_to=reply_to,
        )
    if op == "unregister_instance":
        return m.UnregisterInstance(a[0], reply_to=reply_to)
    if op == "store":
        not_after = a[4] if len(a) > 4 else None
        return m.Store(to_cache_key(a[0]), a[1], block_ids=a[2], reply_to=reply_to, not_after=not_after)
    if op == "retrieve":
        skip = a[4] if len(a) > 4 else 0
        not_after = a[5] if len(a) > 5 else None
        return m.Retrieve(
            to_cache_key(a[0]), a[1], block_ids=a[2], skip_first_n_tokens=skip, reply_to=reply_to, not_after=not_after
        )
    if op == "prepare_store":
        not_after = a[2] if len(a) > 2 else None
        return m.PrepareStore(to_cache_key(a[0]), a[1], reply_to=reply_to, not_after=not_after)
    if op == "prepare_retrieve":
        skip = a[2] if len(a) > 2 else 0
        return m.PrepareRetrieve(to_cache_key(a[0]), a[1], skip_first_n_tokens=skip, reply_to=reply_to)
    if op in ("commit_store", "commit_retrieve"):
        return m.CommitTransfer(a[0], a[1], reply_to=reply_to)
    raise BadRequest(f"operation {op!r} has no core_sm request")


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


# ---------------------------------------------------------------------------------------------
# Client side


def key_to_wire(key: m.CacheKey, num_kv_readers: int = 0) -> dict[str, Any]:
    """The key map a request carries (``wire.encode_key``)."""
    return encode_key(key, num_kv_readers)


def request_to_wire(
    req: Any, *, event_handle: bytes | None = None, layout_extra: Mapping[str, Any] | None = None
) -> tuple[str, tuple[Any, ...]]:
    """``(op, payloads)`` for a core_sm server request (``SendRequest.request``).

    * ``Store`` / ``Retrieve`` (server-driven, GPU) need ``event_handle``: the interprocess CUDA
      event the engine recorded before the request, which the server's copy waits on
      (``("store", (key, instance_id, block_ids, event_handle, not_after))``, ``("retrieve", (key,
      instance_id, block_ids, event_handle, skip_first_n_tokens, not_after))``); without it
      ``TypeError``. ``not_after`` (absolute seconds on the host's monotonic clock, or nil) is the
      request's deadline at the server; ``PrepareStore`` carries it too, as a third payload.
    * ``RegisterInstance``: ``layout_extra`` is merged into the layout map (a GPU engine's CUDA
      IPC handles and geometry, which core_sm does not model).

    Raises ``TypeError`` for a request with no client-side wire form."""
    if isinstance(req, (m.Store, m.Retrieve)):
        if event_handle is None:
            raise TypeError(f"{type(req).__name__} (server-driven) needs the engine's event_handle")
        key = key_to_wire(req.key)
        if isinstance(req, m.Store):
            return "store", (key, req.instance_id, list(req.block_ids), event_handle, req.not_after)
        return "retrieve", (key, req.instance_id, list(req.block_ids), event_handle, req.skip_first_n_tokens, req.not_after)
    if isinstance(req, m.Lookup):
        return "lookup", (key_to_wire(req.key, req.num_readers), 1)
    if isinstance(req, m.QueryPrefetchStatus):
        return "query_prefetch_status", (req.request_id,)
    if isinstance(req, m.WaitPrefetchStatus):
        return "wait_prefetch_status", (req.request_id, float(req.timeout))
    if isinstance(req, m.FreeLookupLocks):
        return "free_lookup_locks", (key_to_wire(req.key), 1)
    if isinstance(req, m.EndSession):
        return "end_session", (req.request_id,)
    if isinstance(req, m.Clear):
        return "clear", (req.force,)
    if isinstance(req, m.Ping):
        return "ping", ()
    if isinstance(req, m.GetChunkSize):
        return "get_chunk_size", ()
    if isinstance(req, m.RegisterInstance):
        layout = {"model_name": req.model_name, "world_size": req.world_size, "object_bytes": req.object_bytes, "engine_driven": req.engine_driven}
        if layout_extra:
            layout = {**layout_extra, **layout}  # the machine's fields win
        return "register_instance", (req.instance_id, layout)
    if isinstance(req, m.UnregisterInstance):
        return "unregister_instance", (req.instance_id,)
    if isinstance(req, m.PrepareStore):
        return "prepare_store", (key_to_wire(req.key), req.instance_id, req.not_after)
    if isinstance(req, m.PrepareRetrieve):
        return "prepare_retrieve", (key_to_wire(req.key), req.instance_id, req.skip_first_n_tokens)
    if isinstance(req, m.CommitTransfer):
        # the op name only labels the direction for humans; the server keys on transfer_id
        return "commit_store", (req.transfer_id, req.ok)
    raise TypeError(f"{type(req).__name__} has no wire form on this path")


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
