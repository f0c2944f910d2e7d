"""The transfer client's records: its config, an op's states with the allowed-transition table
the walk tests read, one op (a store or retrieve of one request) and one request's ops.

``core_sm.transfer_client.TransferClient`` is the machine that keeps them; it re-exports these
names, so ``from core_sm.transfer_client import TransferClientConfig, OpState`` keeps working.
"""
from __future__ import annotations

import enum

import attrs

from core_sm.chunks import DEFAULT_CHUNK_SIZE
from core_sm.messages import (
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

__all__ = ["DEFAULT_STORE_WINDOW", "EVENTS", "TRANSITIONS", "OpState", "RequestRecord",
           "TransferClientConfig", "TransferOp"]


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
    registration_timeout: float = 10.0  # an unanswered RegisterInstance counts as failed after this
    registration_retry: float = 0.5  # delay before re-sending a failed registration; doubles...
    registration_retry_max: float = 5.0  # ...up to this
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


# The one transition table: (op's state, event type) -> allowed next states. A reply or failure
# for another correlation (stale, another op's) leaves the op where it is.
TRANSITIONS: dict[tuple[OpState, type], frozenset[OpState]] = {
    (OpState.ABSENT, SubmitStore): frozenset({OpState.SENT, OpState.ABSENT}),
    (OpState.ABSENT, SubmitRetrieve): frozenset({OpState.SENT, OpState.ABSENT}),
    (OpState.ABSENT, ReplyReceived): frozenset({OpState.ABSENT}),
    (OpState.ABSENT, RequestFailed): frozenset({OpState.ABSENT}),
    (OpState.ABSENT, CopyFinished): frozenset({OpState.ABSENT}),
    (OpState.SENT, ReplyReceived): frozenset({OpState.ABSENT, OpState.COPYING, OpState.COMMITTING, OpState.SENT}),
    (OpState.SENT, RequestFailed): frozenset({OpState.ABSENT, OpState.SENT}),
    (OpState.SENT, CopyFinished): frozenset({OpState.SENT}),
    (OpState.SENT, ServerHealth): frozenset({OpState.SENT, OpState.ABSENT}),
    (OpState.SENT, TimerFired): frozenset({OpState.SENT, OpState.ABSENT}),
    (OpState.COPYING, CopyFinished): frozenset({OpState.COMMITTING, OpState.ABSENT, OpState.COPYING}),  # another op's: stays
    (OpState.COPYING, ReplyReceived): frozenset({OpState.COPYING}),
    (OpState.COPYING, RequestFailed): frozenset({OpState.COPYING}),
    (OpState.COPYING, ServerHealth): frozenset({OpState.COPYING}),
    (OpState.COPYING, TimerFired): frozenset({OpState.COPYING}),
    (OpState.COMMITTING, ReplyReceived): frozenset({OpState.ABSENT, OpState.COMMITTING}),
    (OpState.COMMITTING, RequestFailed): frozenset({OpState.ABSENT, OpState.COMMITTING}),
    (OpState.COMMITTING, CopyFinished): frozenset({OpState.COMMITTING}),
    (OpState.COMMITTING, ServerHealth): frozenset({OpState.COMMITTING, OpState.ABSENT}),
    (OpState.COMMITTING, TimerFired): frozenset({OpState.COMMITTING, OpState.ABSENT}),
    **{(s, Abort): frozenset({s}) for s in OpState},
    **{(s, EngineFinished): frozenset({s}) for s in OpState},
    (OpState.ABSENT, ServerHealth): frozenset({OpState.ABSENT}),
    (OpState.ABSENT, TimerFired): frozenset({OpState.ABSENT}),
    # A new epoch is a restart: as ServerHealth(False) then (True).
    (OpState.ABSENT, ServerEpoch): frozenset({OpState.ABSENT}),
    (OpState.SENT, ServerEpoch): frozenset({OpState.SENT, OpState.ABSENT}),
    (OpState.COPYING, ServerEpoch): frozenset({OpState.COPYING}),
    (OpState.COMMITTING, ServerEpoch): frozenset({OpState.COMMITTING, OpState.ABSENT}),
}
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
    state: OpState
    correlation: int | None
    sent_at: float
    transfer_id: int = -1
    copy_ok: bool = True
    incarnation: int = 0  # the client's count of server losses when the op was submitted
    registration: int = 0  # registrations acked when the op's last request was sent
    not_after: float | None = None  # a server-driven store's deadline at the server


@attrs.define
class RequestRecord:
    """One request's ops in flight; dropped once nothing is in flight (and, if the engine
    finished it, once it has been queued for the ``sending`` report)."""

    request_id: str
    next_seq: int = 0  # ops submitted so far
    ops: dict[OpId, TransferOp] = attrs.Factory(dict)
    engine_finished: bool = False
    retrieve_failed: bool = False  # a retrieve failed since the request was last reported
    recving_fenced: bool = False  # its retrieves are done; recving waits for the fence
    fenced_load_errors: list[int] = attrs.Factory(list)  # reported with that recving
