"""Test helpers for core_sm: key builders and a server harness that checks every request is
answered exactly once."""
from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import attrs

from mpcache.core_sm.effects import (
    AttachInstance,
    DetachInstance,
    Effect,
    ErrorReply,
    InstanceReaped,
    ProbeL2,
    ReadL2,
    Reply,
    StartTransfer,
    WriteL2,
)
from mpcache.core_sm.errors import ErrorKind, ProtocolError
from mpcache.core_sm.messages import CacheKey, InstanceAttached, RegisterInstance
from mpcache.core_sm.server import LookupServer, ServerConfig

C = 4  # a tiny chunk size keeps token lists short
T = TypeVar("T")
Pick = Callable[[Sequence[T]], T]  # "choose one of these": Hypothesis draws, or every_choice
MODEL = "m"


def tokens(n_chunks: int, seed: int = 0, extra: int = 0) -> tuple[int, ...]:
    """n_chunks full chunks (plus ``extra`` trailing tokens); different seeds diverge at chunk 0."""
    return tuple(seed * 1000 + i for i in range(n_chunks * C + extra))


def key(rid: str, toks: tuple[int, ...], start: int = 0, end: int | None = None,
        worker_id: int | None = None, world_size: int = 1, salt: str = "") -> CacheKey:
    if end is None:
        end = len(toks) // C * C
    return CacheKey(MODEL, world_size, worker_id, toks, start, end, rid, salt)


class ServerHarness:
    """Drives a LookupServer; numbers each request's reply_to and records its replies. As a
    runtime does, it answers ``AttachInstance`` at once (``attach_error``: the transfer engine's
    refusal, None to accept) and keeps ``attached``: the instances whose KV memory it holds open."""

    def __init__(self, config: ServerConfig | None = None, server: LookupServer | None = None,
                 **kw: Any) -> None:
        cfg = config or ServerConfig(chunk_size=C, num_slots=kw.pop("num_slots", 64),
                                     slot_bytes=100, **kw)
        self.server = server or LookupServer(cfg)
        self.now = 0.0
        self._ids = itertools.count(1)
        self.replies: dict[Hashable, list[Effect]] = {}
        self.outstanding: set[Hashable] = set()
        self.transfers: dict[int, StartTransfer] = {}
        self.reads: dict[int, ReadL2] = {}
        self.probes: dict[int, ProbeL2] = {}
        self.writes: dict[int, WriteL2] = {}
        self.log: list[Effect] = []
        self.attach_error: str | None = None
        self.attached: set[int] = set()

    def send(self, request: Any) -> Hashable:
        """Feed a request; returns its reply_to."""
        rt = ("req", next(self._ids))
        self.outstanding.add(rt)
        self.feed(attrs.evolve(request, reply_to=rt))
        return rt

    def feed(self, event: Any) -> list[Effect]:
        effects = self.server.handle(event, self.now)
        self._absorb(effects)
        self.server.check_invariants()
        if type(self.server) is LookupServer:  # every transition the fixed server makes is a row
            assert self.server.stats()["table_violations"] == 0, event
        return effects

    def _absorb(self, effects: list[Effect]) -> None:
        for e in effects:
            self.log.append(e)
            if isinstance(e, (Reply, ErrorReply)):
                assert e.reply_to in self.outstanding or e.reply_to in self.replies, e
                self.replies.setdefault(e.reply_to, []).append(e)
                assert len(self.replies[e.reply_to]) == 1, f"two replies for {e.reply_to}"
                self.outstanding.discard(e.reply_to)
            elif isinstance(e, StartTransfer):
                self.transfers[e.transfer_id] = e
            elif isinstance(e, ReadL2):
                self.reads[e.read_id] = e
            elif isinstance(e, ProbeL2):
                self.probes[e.probe_id] = e
            elif isinstance(e, WriteL2):
                self.writes[e.write_id] = e
            elif isinstance(e, AttachInstance):
                if self.attach_error is None:
                    self.attached.add(e.instance_id)
                refused = None if self.attach_error is None else ProtocolError(ErrorKind.VALIDATION, self.attach_error)
                self.feed(InstanceAttached(e.instance_id, e.registration_id, refused, reply_to=e.reply_to))
            elif isinstance(e, (DetachInstance, InstanceReaped)):
                self.attached.discard(e.instance_id)

    def advance(self, dt: float) -> list[Effect]:
        self.now += dt
        from mpcache.core_sm.messages import TimerFired

        return self.feed(TimerFired())

    def reply(self, rt: Hashable) -> Effect | None:
        got = self.replies.get(rt)
        return got[0] if got else None

    def result(self, rt: Hashable) -> object:
        r = self.reply(rt)
        assert isinstance(r, Reply), f"expected a Reply for {rt}, got {r}"
        return r.result

    def error_kind(self, rt: Hashable) -> object:
        r = self.reply(rt)
        assert isinstance(r, ErrorReply), f"expected an ErrorReply for {rt}, got {r}"
        return r.error.kind

    def call(self, request: Any) -> object:
        """Send and return the immediate result (asserts one came)."""
        return self.result(self.send(request))

    def register(self, instance_id: int = 1, world_size: int = 1, object_bytes: int = 10,
                 engine_driven: bool = False) -> None:
        registration = self.call(RegisterInstance(instance_id, MODEL, world_size, object_bytes, engine_driven))
        assert isinstance(registration, int)  # the registration's id (what a resend names)

    def finish_all_transfers(self, ok: bool = True) -> None:
        from mpcache.core_sm.messages import TransferFinished

        for tid in list(self.transfers):
            del self.transfers[tid]
            self.feed(TransferFinished(tid, ok))

    def store(self, toks: tuple[int, ...], rid: str = "writer", worker_id: int = 0,
              world_size: int = 1, start: int = 0, end: int | None = None, ok: bool = True) -> object:
        from mpcache.core_sm.messages import Store

        rt = self.send(Store(key(rid, toks, start, end, worker_id, world_size), 1))
        self.finish_all_transfers(ok)
        return self.result(rt)


def every_choice(run: Callable[[Pick[Any]], None]) -> None:
    """Call ``run(pick)`` once per combination of the options its ``pick`` calls offer."""
    prefix: list[int] = []
    while True:
        sizes: list[int] = []

        def pick(options: Sequence[Any]) -> Any:
            i = prefix[len(sizes)] if len(sizes) < len(prefix) else 0
            sizes.append(len(options))
            return options[i]

        run(pick)
        chosen = prefix + [0] * (len(sizes) - len(prefix))
        k = len(sizes) - 1
        while k >= 0 and chosen[k] + 1 >= sizes[k]:
            k -= 1
        if k < 0:
            return
        prefix = chosen[:k] + [chosen[k] + 1]
