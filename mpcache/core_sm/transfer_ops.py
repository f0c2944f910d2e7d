"""The transfer client's records: its config, the states of its three tables (its server link,
one request, one op), its typed timers and internal events, the specific events its guards tell a
raw event apart into (so that each row of its tables names one next state), one op (a store or
retrieve of one request) and one request's ops.

``mpcache.core_sm.transfer_client.TransferClient`` is the machine that keeps them; it re-exports these
names, so ``from mpcache.core_sm.transfer_client import TransferClientConfig, OpState`` keeps working.
"""
from __future__ import annotations

import enum

import attrs

from mpcache.core_sm.chunks import DEFAULT_CHUNK_SIZE
from mpcache.core_sm.errors import ProtocolError
from mpcache.core_sm.messages import (
    Abort,
    CacheKey,
    CopyFinished,
    EngineFinished,
    OpId,
    ReplyReceived,
    RequestFailed,
    ServerEpoch,
    ServerHealth,
    SubmitRetrieve,
    SubmitStore,
    TimerFired,
    TransferKind,
)
from mpcache.core_sm.timers import Timer

__all__ = ["DEFAULT_STORE_WINDOW", "EVENTS", "CopyOfLostServer", "CopyPlanned", "CopySkipped", "FenceEnd",
           "InFlightEnded", "LinkState", "OpServerLost", "OpState", "OpTimeout", "RegistrationAnswered", "RepeatedEnd",
           "ReportedRequestIdle", "RequestDrained", "RequestEnded", "RequestIdle", "RequestRecord", "ServerDown",
           "ServerUp", "TransferClientConfig", "TransferOp", "TransferRequestState"]


DEFAULT_STORE_WINDOW = 30.0


@attrs.frozen
class TransferClientConfig:
    instance_id: int = 0
    model_name: str = ""
    world_size: int = 1
    worker_id: int = 0
    chunk_size: int = DEFAULT_CHUNK_SIZE
    object_bytes: int = 0
    engine_driven: bool = False
    server: int = 0
    op_timeout: float | None = None  # waiting on the server longer than this fails the op
    reported_cap: int = 100_000  # ids remembered to keep reports exactly-once
    # A server-driven STORE's not_after is sent_at + this (None: op_timeout, else 30 s).
    transfer_timeout: float | None = None
    # How long a copy the server began by not_after may still read the blocks.
    copy_grace: float = 1.0

    def transfer_window(self) -> float:
        if self.transfer_timeout is not None:
            return self.transfer_timeout
        return self.op_timeout if self.op_timeout is not None else DEFAULT_STORE_WINDOW


class OpState(enum.Enum):
    ABSENT = "absent"  # never submitted, or done
    SENT = "sent"  # request sent, reply awaited
    COPYING = "copying"  # engine-driven: CopyBlocks emitted, CopyFinished awaited
    COMMITTING = "committing"  # engine-driven: CommitTransfer sent, reply awaited


class LinkState(enum.Enum):
    """The client's server as its link reports it (``ServerHealth``, ``ServerEpoch``); whether
    the instance is registered there is the link's (``ServerLink``), not the client's."""

    OTHER = "other"  # a server index that is not this client's
    DOWN = "down"  # unhealthy: nothing is sent, new ops fail at once
    UP = "up"  # healthy


class TransferRequestState(enum.Enum):
    """One request id on the worker."""

    ABSENT = "absent"  # no op, never reported in sending (or forgotten since)
    ACTIVE = "active"  # ops in flight (or fenced); the engine has not finished it
    FINISHING = "finishing"  # the engine finished or aborted it; ops in flight (or fenced)
    REPORTED = "reported"  # reported in sending, remembered so a repeat finish is ignored


# The events a TransferClient takes (what the runtime feeds it).
EVENTS = (SubmitStore, SubmitRetrieve, ReplyReceived, RequestFailed, CopyFinished, ServerHealth,
          TimerFired, Abort, EngineFinished, ServerEpoch)


@attrs.define
class TransferOp:
    """One store or retrieve of one request, from submit to its final reply."""

    op: OpId
    kind: TransferKind
    key: CacheKey
    block_ids: tuple[int, ...]
    skip_first_n_tokens: int
    state: OpState  # filed SENT by its submit; assigned by the op table after that
    correlation: int | None
    sent_at: float
    transfer_id: int = -1
    copy_ok: bool = True
    incarnation: int = 0  # the client's count of server losses when the op was submitted
    not_after: float | None = None  # a server-driven store's deadline at the server


@attrs.define
class RequestRecord:
    """One request's ops in flight; dropped once nothing is in flight (and, if the engine
    finished it, once it has been queued for the ``sending`` report)."""

    request_id: str
    next_seq: int = 0  # ops submitted so far
    ops: dict[OpId, TransferOp] = attrs.Factory(dict)
    engine_finished: bool = False  # FINISHING: assigned by the request table, never by a handler
    retrieve_failed: bool = False  # a retrieve failed since the request was last reported
    recving_fenced: bool = False  # its retrieves are done; recving waits for the fence
    fenced_load_errors: list[int] = attrs.Factory(list)  # reported with that recving
    synchronous: bool = False  # its last retrieve is a synchronous load: no recving report


# ------------------------------------------------------------------ typed timers, internal events


@attrs.frozen
class OpTimeout(Timer):
    """``op_timeout`` after an op's request went out: still unanswered, the op fails."""

    op: OpId
    sent_at: float


@attrs.frozen
class FenceEnd(Timer):
    """A request's late-copy fence is over: its blocks are reported (sending / recving)."""

    request_id: str
    until: float


@attrs.frozen
class RegistrationAnswered:
    """Internal: the reply to the client's one registration (``error`` None: acked). Only
    counted: registering again is its link's decision."""

    error: ProtocolError | None


@attrs.frozen
class OpServerLost:
    """Internal: the server became unhealthy or restarted while ``op`` waited on it."""

    op: OpId


@attrs.frozen
class RequestEnded:
    """Internal: ``Abort(request_id)``, or one id of ``EngineFinished``: the engine is done with it."""

    request_id: str


@attrs.frozen
class InFlightEnded:
    """Internal: an op or the fence of the request ended (a row that ended it names it): its row
    decides whether the request is done (the specific events below) or still in flight."""

    request_id: str


# ------------------------------------------------------------------ specific events (guards)
# ``TransferClient``'s guards turn a raw event into one of these before its row is looked up, so
# that each row names one next state; each has its raw event's fields.


@attrs.frozen
class ServerUp(ServerHealth):
    """``ServerHealth(server, True)`` for this client's server."""


@attrs.frozen
class ServerDown(ServerHealth):
    """``ServerHealth(server, False)`` for this client's server: the ops waiting on it fail."""


@attrs.frozen
class RepeatedEnd(RequestEnded):
    """The engine finished (or aborted) an id already reported in ``sending``: counted, not
    reported again."""


@attrs.frozen
class RequestDrained(InFlightEnded):
    """Nothing of a request the engine finished is in flight any more: reported in ``sending``."""


@attrs.frozen
class RequestIdle(InFlightEnded):
    """Nothing of a request the engine still runs is in flight any more: forgotten."""


@attrs.frozen
class ReportedRequestIdle(InFlightEnded):
    """As ``RequestIdle``, for an id reported in ``sending`` before (it had ops again): forgotten,
    its id still remembered as reported."""


@attrs.frozen
class CopyPlanned(ReplyReceived):
    """An engine-driven op's ``TransferPlan(ok=True)``: the worker copies (``CopyBlocks``)."""


@attrs.frozen
class CopySkipped(ReplyReceived):
    """A retrieve's ``TransferPlan(ok=True)`` after the engine finished the request: committed
    not ok at once, no copy (nobody reads the blocks)."""


@attrs.frozen
class CopyOfLostServer(CopyFinished):
    """An engine copy that finished after the server that planned it was lost (unhealthy now, or
    lost since the op was submitted): never committed, the op fails."""
