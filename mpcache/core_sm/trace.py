"""Traces of the server machine: its event stream as a runtime fed it, replayable exactly.

A trace is a header (the ``ServerConfig``, a format version, whether token ids are kept) and one
record per ``LookupServer.handle`` call: ``[now, event, effects]``. ``TraceCodec`` turns events
and effects into plain JSON-ready values and back; ``replay`` feeds a fresh ``LookupServer``
with the same events at the same times and reports every record whose effects differ from the
recorded ones (a divergence: the machines are not what produced the trace, or not
deterministic).

**No prompt text by default.** A key's token ids are recorded as its chunk hashes (as the
server computed them, extras folded in) plus the token count; a replayed key carries them in
``PrehashedTokens`` (``mpcache.core_sm.keys``) and the server uses them instead of hashing (``ServerContext.hashes``).
Token ids anywhere else (the KV-event effects' ``StoredChunk``) are recorded as their count
only. ``keep_tokens=True`` records the token ids themselves.

Values: attrs instances as ``{"$": class name, field: value}``, tuples and lists as lists
(decoded as tuples), bytes as ``{"b": hex}``, enums as ``{"e": "Class.NAME"}``, floats that JSON
cannot hold (inf, nan) as ``{"f": repr}``. Classes come from ``mpcache.core_sm.messages``,
``mpcache.core_sm.effects``, ``mpcache.core_sm.keys``, ``mpcache.core_sm.errors`` and ``mpcache.core_sm.server_core`` (its
``ServerConfig``), and -- for the client machines' recordings (``mpcache.runtime_zmq.recorder``,
replayed by ``mpcache.sim.prod_replay``) -- from the planner's, lookup and transfer clients',
server link's and health monitor's modules; a class whose name one of the first already uses is
written ``module.Name`` (``server_link.Reply``). A value of another type raises ``TypeError``
when encoding, unless the codec was given ``Opaque`` numbering: then it is written ``{"o": n}``,
the n-th distinct object of that run (a caller's future, a frame a link carries but never looks
into), and read back as ``Opaque(n)``, which is written ``{"o": n}`` again.
"""
from __future__ import annotations

import enum
import functools
import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

import attrs

from mpcache.core_sm import effects as _effects
from mpcache.core_sm import errors as _errors
from mpcache.core_sm import health as _health
from mpcache.core_sm import keys as _keys
from mpcache.core_sm import kv_groups as _kv_groups
from mpcache.core_sm import lookup_ops as _lookup_ops
from mpcache.core_sm import messages as _messages
from mpcache.core_sm import planner_ops as _planner_ops
from mpcache.core_sm import server_core
from mpcache.core_sm import server_link as _server_link
from mpcache.core_sm import transfer_ops as _transfer_ops
from mpcache.core_sm.chunks import TokenIds
from mpcache.core_sm.keys import PrehashedTokens

FORMAT = 1
_CLASSES: dict[str, type] = {}
_NAMES: dict[type, str] = {}


def _register(module: ModuleType) -> None:
    short = module.__name__.rpartition(".")[2]
    for name, value in vars(module).items():
        if isinstance(value, type) and (attrs.has(value) or issubclass(value, enum.Enum)):
            if value in _NAMES:
                continue
            taken = _CLASSES.get(name)
            written = name if taken is None or taken is value else f"{short}.{name}"
            _CLASSES.setdefault(written, value)
            _NAMES[value] = written


# the server's trace classes first: their names are the format's (version 1) as they were
for _module in (_messages, _effects, _keys, _errors, _planner_ops, _lookup_ops, _transfer_ops, _server_link,
                _health, _kv_groups):
    _register(_module)


@attrs.frozen
class Opaque:
    """An object a machine carries but never looks into (a caller's future, the frames a link
    sends), replayed as its number in the recorded run."""

    n: int


class OpaqueNumbers:
    """The recorder's numbering of opaque objects: the same object, the same number, for as
    long as it lives (held weakly where it can be, so a long recording does not keep every
    future alive)."""

    def __init__(self) -> None:
        self._numbers: dict[int, tuple[Any, int]] = {}
        self._next = 0

    def number(self, value: object) -> int:
        held = self._numbers.get(id(value))
        if held is not None:
            holder, known = held
            if (holder() if isinstance(holder, weakref.ref) else holder) is value:
                return known
        n = self._next
        self._next += 1
        key = id(value)
        ref: Any
        try:
            ref = weakref.ref(value, functools.partial(self._forget, key))
        except TypeError:  # not weakly referable: kept (the recorder's runs are short)
            ref = value
        self._numbers[key] = (ref, n)
        return n

    def _forget(self, key: int, _gone: object) -> None:
        self._numbers.pop(key, None)


def _class(name: str) -> type:
    found = _CLASSES.get(name)
    if found is None:
        _register(server_core)
        found = _CLASSES[name]
    return found


def _name_of(cls: type) -> str:
    name = _NAMES.get(cls)
    if name is None:
        _register(server_core)
        name = _NAMES.get(cls, cls.__name__)
    return name


class TraceCodec:
    """Events and effects to JSON-ready values and back (module doc). ``hashes_of(key)``: the
    chunk hashes the recorder stores for a key when token ids are not kept."""

    def __init__(self, keep_tokens: bool = False, hashes_of: Any = None, opaque: OpaqueNumbers | None = None) -> None:
        self.keep_tokens = keep_tokens
        self.hashes_of = hashes_of
        self.opaque = opaque

    def encode(self, value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"f": repr(value)}
        if isinstance(value, (bytes, bytearray, memoryview)):
            return {"b": bytes(value).hex()}
        if isinstance(value, enum.Enum):
            return {"e": f"{type(value).__name__}.{value.name}"}
        if isinstance(value, TokenIds):
            if self.keep_tokens:
                return {"t": value.packed.hex(), "n": len(value)}
            return {"n": len(value)}
        if isinstance(value, _messages.CacheKey) and not self.keep_tokens:
            out = self._attrs(value)
            hashes = self.hashes_of(value) if self.hashes_of is not None else ()
            out["token_ids"] = {"n": len(value.token_ids), "h": [h.hex() for h in hashes]}
            return out
        if type(value) is Opaque:
            return {"o": value.n}
        if attrs.has(type(value)):
            return self._attrs(value)
        if isinstance(value, (tuple, list)):
            return [self.encode(v) for v in value]
        if isinstance(value, dict):
            return {"d": [[self.encode(k), self.encode(v)] for k, v in value.items()]}
        if self.opaque is not None:
            return {"o": self.opaque.number(value)}
        raise TypeError(f"cannot trace a {type(value).__name__}")

    def _attrs(self, value: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"$": _name_of(type(value))}
        for field in attrs.fields(type(value)):
            out[field.name] = self.encode(getattr(value, field.name))
        return out

    def decode(self, value: Any) -> Any:
        if isinstance(value, list):
            return tuple(self.decode(v) for v in value)
        if not isinstance(value, dict):
            return value
        if "$" in value:
            cls = _class(value["$"])
            kwargs = {k: self.decode(v) for k, v in value.items() if k != "$"}
            tokens = kwargs.get("token_ids")
            if isinstance(tokens, PrehashedTokens):
                kwargs["token_ids"] = b""
                obj = cls(**kwargs)
                object.__setattr__(obj, "token_ids", tokens)  # the converter would copy it
                return obj
            return cls(**kwargs)
        if "b" in value:
            return bytes.fromhex(value["b"])
        if "e" in value:
            cls_name, _, member = value["e"].partition(".")
            return _class(cls_name)[member]  # type: ignore[index]
        if "f" in value:
            return float(value["f"])
        if "o" in value:
            return Opaque(value["o"])
        if "d" in value:
            return {self.decode(k): self.decode(v) for k, v in value["d"]}
        if "t" in value:
            return TokenIds.from_packed(bytes.fromhex(value["t"]))
        if "h" in value:
            return PrehashedTokens.make(value["n"], [bytes.fromhex(h) for h in value["h"]])
        if "n" in value:
            return PrehashedTokens.make(value["n"], ())
        raise ValueError(f"not a trace value: {value!r}")


@attrs.frozen
class Divergence:
    """Record ``index`` (an event of type ``event``) produced other effects than recorded."""

    index: int
    event: str
    recorded: Any
    replayed: Any


def header(config: Any, keep_tokens: bool, part: int = 0) -> dict[str, Any]:
    """The first line of a trace file (``part`` > 0: a rotated file that starts mid-run). The
    chunk-chain key is a secret and never written: the header names its fingerprint only."""
    from mpcache.core_sm.chunks import PUBLIC_CHAIN_KEY, ChunkChain

    chain = ChunkChain(config.chain_key)
    return {"mpcache_trace": FORMAT, "keep_tokens": keep_tokens, "part": part,
            "chain_fingerprint": chain.fingerprint,
            "config": TraceCodec().encode(attrs.evolve(config, chain_key=PUBLIC_CHAIN_KEY))}


def replay(head: dict[str, Any], records: Iterable[Sequence[Any]], max_divergences: int = 20,
           chain_key: bytes | None = None, make_server: Callable[[Any], Any] | None = None,
           judge: Callable[[Any], str | None] | None = None) -> tuple[int, list[Divergence]]:
    """Re-run the server machine on a trace; returns (records replayed, divergences).

    A trace without token ids (the default) replays as is: its keys carry the hashes the server
    computed. A ``keep_tokens`` trace is hashed again, so it needs the server's ``chain_key``
    (``ValueError`` without it, or with a key whose fingerprint is not the trace's).
    ``make_server`` builds the machine from the trace's ``ServerConfig`` (default
    ``LookupServer``; the simulator passes its own); ``judge(server)`` runs after every event and
    a message it returns is a divergence too (``recorded`` None, ``replayed`` the message)."""
    from mpcache.core_sm.chunks import ChunkChain
    from mpcache.core_sm.server import LookupServer, ServerConfig

    if head.get("mpcache_trace") != FORMAT:
        raise ValueError(f"not an mpcache trace of format {FORMAT}: {head.get('mpcache_trace')!r}")
    codec = TraceCodec(keep_tokens=bool(head.get("keep_tokens")))
    config = codec.decode(head["config"])
    if not isinstance(config, ServerConfig):
        raise ValueError("the trace header holds no ServerConfig")
    if chain_key is not None:
        if ChunkChain(chain_key).fingerprint != head.get("chain_fingerprint"):
            raise ValueError("the chunk key given is not the one the traced server used (fingerprints differ)")
        config = attrs.evolve(config, chain_key=chain_key)
    elif codec.keep_tokens and head.get("chain_fingerprint") != ChunkChain(config.chain_key).fingerprint:
        raise ValueError("this trace keeps token ids, so replaying it hashes them again: give the traced "
                         "server's chunk key (its --chunk-key-file)")
    server = LookupServer(config) if make_server is None else make_server(config)
    # Replayed effects are encoded as recorded: keys by their hashes, so both sides compare alike.
    out_codec = TraceCodec(keep_tokens=codec.keep_tokens, hashes_of=_hashes_of(server))
    divergences: list[Divergence] = []
    n = 0
    for n, (now, event, effects) in enumerate(records, 1):
        ev = codec.decode(event)
        effects_now = server.handle(ev, float(now))
        if server.deferred_work:  # ack_first: the runtime recorded the lookup's work with its ack
            effects_now += server.run_deferred()
        got = out_codec.encode(effects_now)
        if got != effects and len(divergences) < max_divergences:
            divergences.append(Divergence(n - 1, type(ev).__name__, effects, got))
        finding = judge(server) if judge is not None else None
        if finding is not None and len(divergences) < max_divergences:
            divergences.append(Divergence(n - 1, type(ev).__name__, None, finding))
    return n, divergences


def _hashes_of(server: Any) -> Any:
    def hashes(key: _messages.CacheKey) -> tuple[bytes, ...]:
        found, _err = server.ctx.hashes(key, key.end // server.config.chunk_size)
        return tuple(found)
    return hashes
