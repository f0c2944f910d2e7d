"""The lookup client's records: its config, the states of its two tables (one lookup, one
server), its typed timers and internal event, the specific events its guards tell a raw event
apart into (so that each row of its tables names one next state), and one lookup's bookkeeping
(``PendingLookup`` with one ``ServerLeg`` per server).

``mpcache.core_sm.lookup_client.LookupClient`` is the machine that keeps them; it re-exports these
names, so ``from mpcache.core_sm.lookup_client import LookupClientConfig, LookupState`` keeps working.
"""
from __future__ import annotations

import enum
from collections.abc import Iterable

import attrs

from mpcache.core_sm.chunks import DEFAULT_CHUNK_SIZE
from mpcache.core_sm.messages import (
    CacheKey,
    Cleanup,
    EndRequest,
    FreeUnusedLeases,
    ReplyReceived,
    RequestFailed,
    ServerEpoch,
    ServerHealth,
    SubmitLookup,
    TimerFired,
)
from mpcache.core_sm.timers import Timer

__all__ = ["EVENTS", "FinalHitCount", "HitCount", "HitCountLastAck", "InvalidSubmit", "LastLookupAck", "LegLost",
           "LookupAck", "LookupClientConfig", "LookupDeadline", "LookupState", "PendingLookup", "Requery",
           "ResultExpiry", "ServerHealthy", "ServerLeg", "ServerUnhealthy", "ServerView", "StatusPending", "StatusResend",
           "UnservedSubmit"]


def _ranks_per_server(value: Iterable[Iterable[int]] | None) -> tuple[tuple[int, ...], ...] | None:
    return None if value is None else tuple(tuple(ranks) for ranks in value)


@attrs.frozen
class LookupClientConfig:
    num_servers: int = 1
    model_name: str = ""
    world_size: int = 1
    chunk_size: int = DEFAULT_CHUNK_SIZE
    num_readers: int = 1  # read counts per object (MLA with TP > 1: TP)
    poll_interval: float = 0.005  # delay before re-querying after a None answer
    lookup_timeout: float = 30.0  # a lookup unresolved by then resolves to 0
    result_ttl: float = 600.0  # a DONE result never cleaned up is forgotten after this
    use_wait: bool = False  # WAIT_PREFETCH_STATUS instead of polling QUERY_PREFETCH_STATUS
    wait_timeout: float = 1.0
    fire_and_forget_cap: int = 10_000  # replies to FREE/END we still recognise
    # Ask each server for the hit count in the LOOKUP's ack (``Lookup.answer_in_ack``): a server
    # that knows it then (an L1 hit, no L2 step) answers in one round trip; a nil ack (an L2 step
    # left, or a server that does not know the field) is followed by the status query as always.
    answer_in_ack: bool = False
    # The KV ranks each server holds (tensor-parallel ranks spread over servers): entry s goes to
    # server s as ``Lookup.ranks``; a server with no entry holds no rank and is not asked (more
    # servers than ranks). None: every server holds every rank of world_size.
    ranks_per_server: tuple[tuple[int, ...], ...] | None = attrs.field(
        default=None, converter=_ranks_per_server)

    def __attrs_post_init__(self) -> None:
        rps = self.ranks_per_server
        if rps is None:
            return
        if len(rps) != self.num_servers:
            raise ValueError(f"ranks_per_server names {len(rps)} servers, not num_servers={self.num_servers}")
        if not any(rps):
            raise ValueError("ranks_per_server names no rank at all")
        for ranks in rps:
            if len(set(ranks)) != len(ranks) or not all(
                    isinstance(r, int) and 0 <= r < self.world_size for r in ranks):
                raise ValueError(f"ranks_per_server entry {ranks!r}: distinct ranks in [0, {self.world_size}) needed")


class LookupState(enum.Enum):
    ABSENT = "absent"
    AWAITING_ACK = "awaiting_ack"  # some server has not acked its LOOKUP
    QUERYING = "querying"  # every server acked; waiting for hit counts
    DONE = "done"  # result cached


class ServerView(enum.Enum):
    """One server, as the lookup client sees it."""

    UNKNOWN = "unknown"  # not one of the client's num_servers
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


# The events a LookupClient takes (what the runtime feeds it).
EVENTS = (SubmitLookup, ReplyReceived, RequestFailed, ServerHealth, TimerFired, Cleanup,
          EndRequest, FreeUnusedLeases, ServerEpoch)


# ------------------------------------------------------------------ typed timers, internal events


@attrs.frozen
class LookupDeadline(Timer):
    """``lookup_timeout`` after the submit: a lookup still pending resolves to 0."""

    request_id: str
    serial: int


@attrs.frozen
class Requery(Timer):
    """``poll_interval`` after a ``None`` status answer from ``server``: ask it again."""

    request_id: str
    serial: int
    server: int


@attrs.frozen
class StatusResend(Timer):
    """``poll_interval`` after a status query (legacy hook only): maybe abandon it, send another."""

    request_id: str
    serial: int
    server: int
    correlation: int


@attrs.frozen
class ResultExpiry(Timer):
    """``result_ttl`` after the result: a DONE result never cleaned up is forgotten."""

    request_id: str
    serial: int


@attrs.frozen
class LegLost:
    """Internal: ``server`` became unhealthy or restarted while this lookup waited on it."""

    request_id: str
    server: int


# ------------------------------------------------------------------ specific events (guards)
# ``LookupClient``'s guards turn a raw event into one of these before its row is looked up; each
# is the raw event's class with the same fields, so the handler reads it as it came.


@attrs.frozen
class InvalidSubmit(SubmitLookup):
    """A first submit with a bad cache salt or token ids that are not uint32: resolved to 0 at
    once, nothing sent."""


@attrs.frozen
class UnservedSubmit(SubmitLookup):
    """A first submit with nothing to look up (under one chunk) or a server it must ask
    unhealthy: resolved to 0 at once, nothing sent."""


@attrs.frozen
class LookupAck(ReplyReceived):
    """The ack of a LOOKUP (no hit count in it, or one the client did not ask for); another
    server still owes its ack."""


@attrs.frozen
class LastLookupAck(ReplyReceived):
    """The ack of a LOOKUP (no hit count in it); every server has now acked or answered."""


@attrs.frozen
class StatusPending(ReplyReceived):
    """A status reply of None: the server's job is still pending; ask again after poll_interval."""


@attrs.frozen
class HitCount(ReplyReceived):
    """A server's hit count -- a status reply's, or a LOOKUP ack's when ``answer_in_ack`` asked
    for it -- that leaves the lookup waiting: some server still owes its count, and (in
    AWAITING_ACK) some server still owes its ack."""


@attrs.frozen
class HitCountLastAck(ReplyReceived):
    """A hit count that leaves the lookup waiting for other counts but settles the last ack
    owed: an ack carrying it from the last server to ack, or (a client that queries before the
    ack) a status reply that overtook that server's ack."""


@attrs.frozen
class FinalHitCount(ReplyReceived):
    """A hit count that resolves the lookup: 0 (or not a count: a bad reply, taken as 0), or
    the last count owed."""


@attrs.frozen
class ServerHealthy(ServerHealth):
    """``ServerHealth(server, True)`` for one of the client's servers."""


@attrs.frozen
class ServerUnhealthy(ServerHealth):
    """``ServerHealth(server, False)`` for one of the client's servers: the lookups waiting on
    it resolve to 0."""


@attrs.define
class ServerLeg:
    """One server's part of one lookup."""

    server: int
    lookup_correlation: int | None = None  # LOOKUP in flight
    acked: bool = False
    query_correlation: int | None = None  # the one status query in flight
    query_sent_at: float = 0.0
    next_query_at: float | None = None  # re-query time after a None answer
    chunks: int | None = None  # this server's answer


@attrs.define
class PendingLookup:
    request_id: str
    key: CacheKey
    legs: dict[int, ServerLeg]
    deadline: float
    result_tokens: int | None = None
    expires_at: float = 0.0
    serial: int = 0  # this (re)activation's: the timers armed for it name it
    # Assigned by the lookup table's dispatcher (a row's next state), never by a handler.
    state: LookupState = LookupState.ABSENT

    def state_by_legs(self) -> LookupState:
        """The state its result and legs say it is in (``check_invariants`` holds the assigned
        state to it)."""
        if self.result_tokens is not None:
            return LookupState.DONE
        if all(leg.acked or leg.chunks is not None for leg in self.legs.values()):
            return LookupState.QUERYING
        return LookupState.AWAITING_ACK


