"""The step planner's records (core_sm.planner's ``StepPlanner`` runs them): its configuration
(``PlannerConfig``), the events vLLM's scheduler calls become (``MatchRequest``,
``BlocksAllocated``, ``StepScheduled``, ``RequestPreempted``, ``RequestScheduled``,
``LeaseRenewalDue``, ``RequestFinished``), the specific events its guards tell those apart into
(``FirstMatchWithoutLookup``, ``LookupAnswered``, ``MatchRenewing``, ``MatchGivingUp``,
``RenewalStale``, ``RenewalOfMiss``, ``RenewalGivingUp``, ``RequestResumed``), its answers
(``MatchAnswer``, ``StepPlan``) and the per-request state (``RequestState``, ``RequestTracker``). Data only: every decision is in
core_sm.planner. Kept apart so the machine reads in one sitting, as lookup_ops.py and
transfer_ops.py are for theirs."""
from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Any, Union

import attrs

from mpcache.core_sm.effects import Effect
from mpcache.core_sm.keys import NO_EXTRAS, KeyExtras
from mpcache.core_sm.kv_groups import KVGroup
from mpcache.core_sm.messages import (
    ReplyReceived,
    RequestFailed,
    ServerEpoch,
    ServerHealth,
    SubmitRetrieve,
    SubmitStore,
    TimerFired,
)
from mpcache.core_sm.timers import Timer


def _ids(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _group_ids(groups: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(_ids(g) for g in groups)


def _strs(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted({str(v) for v in values}))


SYNC_LOAD_ALL = 1 << 40  # more tokens than any prompt: every load is synchronous


def default_sync_load_max_tokens(cpu_engine: bool) -> int:
    """``PlannerConfig.sync_load_max_tokens`` when not set: every load on a CPU engine, none on
    a GPU engine (see ``PlannerConfig``)."""
    return SYNC_LOAD_ALL if cpu_engine else 0


@attrs.frozen
class PlannerConfig:
    """``chunk_size``: the servers' (a multiple of ``block_size``, the engine's). ``load`` /
    ``store``: vLLM's kv_role (a consumer loads, a producer stores; kv_both does both).

    Steps a hit waits (vLLM's floor is one: the step that computes the last prompt token):

    * ``lookup_wait``: seconds after a request's first ``MatchRequest`` during which the caller
      may wait for the lookup's answer and ask again (``MatchAnswer.wait_until``), instead of
      answering "not yet" and costing the request a step; 0: never wait. It is also the budget
      of one scheduling pass (the matches between two ``StepScheduled``): however many new
      requests a pass sees, it waits at most this long in all.
    * ``lookup_wait_idle``: used instead when it is larger and the engine is idle (its last
      step scheduled nothing and no request the planner tracks has blocks: running, loading or
      preempted): every scheduling pass of an idle engine may wait this long, counted from the
      pass's start, for pending lookups. Blocking a scheduler that has nothing to run delays no
      one, while answering "not yet" at once makes vLLM spin empty steps that take the CPU the
      server's L2 read needs (a lookup that reads L2 takes tens of ms, more on a loaded host).
      0: as ``lookup_wait``.
    * ``sync_load_max_tokens``: a load of at most this many tokens is synchronous
      (``load_async=False``): vLLM schedules the request in the same step, and the workers finish
      the load before that step's forward (``StepPlan.sync_loads``); larger loads are
      asynchronous (the request waits in WAITING_FOR_REMOTE_KVS for a later step). 0: always
      asynchronous. Default by ``cpu_engine`` (``default_sync_load_max_tokens``).
    * ``cpu_engine``: the workers' KV caches are in host memory (vLLM's CPU platform). There
      the worker copies on the step's thread whether the load is synchronous or not, so every
      load is synchronous by default and saves the request a step; on a GPU the server's copy
      overlaps the forward, so every load is asynchronous by default."""

    chunk_size: int
    block_size: int
    store_decode_tokens: bool = False
    load: bool = True
    store: bool = True
    lookup_wait: float = 0.0
    lookup_wait_idle: float = 0.0
    cpu_engine: bool = False
    sync_load_max_tokens: int = attrs.field(
        default=attrs.Factory(lambda self: default_sync_load_max_tokens(self.cpu_engine), takes_self=True)
    )
    # The servers' read lease TTL (mpcache-server --lease-ttl); None: leases never expire.
    lease_ttl: float | None = 300.0
    max_lease_renewals: int = 16  # lookups again per request (the server allows 64 lookups per id)
    # The engine's KV-cache groups (vLLM's hybrid KV-cache manager; core_sm.kv_groups); empty:
    # one full-attention group. Groups this version cannot restore make every request a miss.
    kv_groups: tuple[KVGroup, ...] = ()

    def __attrs_post_init__(self) -> None:
        if self.lease_ttl is not None and not self.lease_ttl > 0:
            raise ValueError(f"lease_ttl must be > 0 or None, not {self.lease_ttl}")
        if self.max_lease_renewals < 0:
            raise ValueError(f"max_lease_renewals must be >= 0, not {self.max_lease_renewals}")
        if self.block_size <= 0 or self.chunk_size <= 0 or self.chunk_size % self.block_size:
            raise ValueError(
                f"mpcache chunk size {self.chunk_size} is not a multiple of the engine block size {self.block_size}; "
                f"start the server with --chunk-size a multiple of {self.block_size}"
            )
        for name, wait in (("lookup wait", self.lookup_wait), ("idle lookup wait", self.lookup_wait_idle)):
            if not 0 <= wait <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1 s (it blocks the scheduler), got {wait}")
        if self.sync_load_max_tokens < 0:
            raise ValueError(f"sync_load_max_tokens must be >= 0, got {self.sync_load_max_tokens}")


# ------------------------------------------------------------------------------------ events


@attrs.frozen
class MatchRequest:
    """vLLM ``get_num_new_matched_tokens``. ``token_ids``: the request's tokens -- may be vLLM's
    live list, which grows with decode tokens; the planner reads the prefixes it needs when it
    needs them. ``num_computed_tokens``: what the engine's prefix cache holds. ``extras``: the
    request's key extras (LoRA, multimodal...: ``mpcache.core_sm.keys``). ``max_load_tokens`` /
    ``max_offload_tokens``: vLLM ``kv_transfer_params`` caps (as its OffloadingConnector: at most
    that many tokens loaded beyond the engine's own hit / stored, in whole chunks; 0 opts out).
    Only the first ``MatchRequest`` of a request sets salt, extras and caps."""

    request_id: str
    token_ids: Sequence[int] = attrs.field(eq=False)
    num_prompt_tokens: int
    num_computed_tokens: int
    cache_salt: str = ""
    extras: KeyExtras = NO_EXTRAS
    max_load_tokens: int | None = None
    max_offload_tokens: int | None = None


@attrs.frozen
class BlocksAllocated:
    """vLLM ``update_state_after_alloc``: the request's blocks (its whole list, in order);
    ``other_group_block_ids``: with several KV-cache groups, those of the groups after the
    first (``block_ids``), one tuple per group."""

    request_id: str
    block_ids: tuple[int, ...] = attrs.field(converter=_ids)
    num_external_tokens: int
    other_group_block_ids: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=_group_ids)


@attrs.frozen
class ScheduledRequest:
    """One request scheduled this step. ``block_ids``: its new blocks (None: none);
    ``replaces_blocks``: they are its whole list (a new or resumed request), not an append.
    ``num_computed_tokens``: computed before this step; ``num_scheduled_tokens``: by this step.
    ``other_group_block_ids``: with several KV-cache groups, the new blocks of the groups after
    the first, one tuple per group."""

    request_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: tuple[int, ...] | None = attrs.field(converter=attrs.converters.optional(_ids))
    replaces_blocks: bool = False
    other_group_block_ids: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=_group_ids)


def _scheduled(values: Iterable[ScheduledRequest]) -> tuple[ScheduledRequest, ...]:
    return tuple(values)


@attrs.frozen
class StepScheduled:
    """vLLM ``build_connector_meta``: what this step schedules and which requests it preempted."""

    scheduled: tuple[ScheduledRequest, ...] = attrs.field(converter=_scheduled)
    preempted: tuple[str, ...] = attrs.field(default=(), converter=_strs)


@attrs.frozen
class RequestPreempted:
    """Part of a ``StepScheduled``: the request's blocks were taken back."""

    request_id: str


@attrs.frozen
class RequestScheduled:
    """Part of a ``StepScheduled``: one scheduled request."""

    request: ScheduledRequest

    @property
    def request_id(self) -> str:
        return self.request.request_id


@attrs.frozen
class LeaseRenewalDue(Timer):
    """The planner's typed timer: the leases of a waiting request's hit are half way to expiry.
    ``leased_at`` names the lookup whose leases they are (a later one makes it stale)."""

    request_id: str
    leased_at: float


@attrs.frozen
class RequestFinished:
    """vLLM ``request_finished`` (finished, aborted or stopped)."""

    request_id: str


# ------------------------------------------------------------------ specific events (guards)
# ``StepPlanner``'s guards turn a raw event into one of these before its row is looked up, so that
# each row names one next state; a subclass has its raw event's fields, and the handler reads it
# as it came.


@attrs.frozen
class FirstMatchWithoutLookup(MatchRequest):
    """A request's first ``MatchRequest`` that asks no lookup: loads are off (a kv_producer),
    its KV-cache groups cannot be restored, or its load cap ends within the engine's own hit. Its
    hit is 0."""


@attrs.frozen
class LookupAnswered:
    """A match or a renewal of a LOOKING_UP request whose lookup has answered ``hit_tokens``
    (the lookup client's ``check``): that is the hit now, and the event runs again, MATCHED."""

    request_id: str
    hit_tokens: int


@attrs.frozen
class MatchRenewing(MatchRequest):
    """A match of a hit vLLM would load whose leases may expire before the retrieve reaches the
    server (less than a quarter of a TTL left), with a renewal left: the request is looked up
    again, and vLLM told to wait."""


@attrs.frozen
class MatchGivingUp(MatchRequest):
    """As ``MatchRenewing`` with no renewal left: the hit is given up (its leases freed) and the
    match answers 0: the request recomputes."""


@attrs.frozen
class RenewalStale(LeaseRenewalDue):
    """A renewal whose lookup is no longer the one holding the leases (a later one does, or the
    hit was given up)."""


@attrs.frozen
class RenewalOfMiss(LeaseRenewalDue):
    """A renewal of a matched request whose hit is 0: no lease to renew."""


@attrs.frozen
class RenewalGivingUp(LeaseRenewalDue):
    """A renewal of a matched hit with no renewal left: the hit is given up (its leases freed)."""


@attrs.frozen
class RequestResumed(RequestScheduled):
    """A preempted request scheduled with new blocks (its whole list): it runs again."""


# ------------------------------------------------------------------------------------ effects


@attrs.frozen
class MatchAnswer:
    """The answer to a ``MatchRequest``: vLLM's ``(num_external_tokens, load_async)``.
    ``wait_until`` (only with ``tokens=None``): the caller may wait for replies until then and
    send the same ``MatchRequest`` again (``PlannerConfig.lookup_wait``); None: answer vLLM now."""

    request_id: str
    tokens: int | None
    load_async: bool
    wait_until: float | None = None


@attrs.frozen
class StepPlan:
    """One step's instructions to every worker (plain data: vLLM pickles it). ``preempted``:
    requests whose blocks were just taken back; workers finish reading them before the forward."""

    retrieves: tuple[SubmitRetrieve, ...] = ()
    stores: tuple[SubmitStore, ...] = ()
    preempted: tuple[str, ...] = ()
    # Requests among ``retrieves`` vLLM loads synchronously: their loads complete before this
    # step's forward, and are not reported as finished receiving (vLLM never waited for them).
    sync_loads: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.retrieves or self.stores or self.preempted)


PlannerEvent = Union[MatchRequest, BlocksAllocated, StepScheduled, RequestFinished, ReplyReceived,
                     RequestFailed, ServerHealth, ServerEpoch, TimerFired]
PlannerEffect = Union[Effect, MatchAnswer, StepPlan]
# Handlers append PlannerEffects; the shared table types them as effects of any machine.
Out = list[Any]
LOOKUP_EVENTS = (ReplyReceived, RequestFailed, ServerHealth, ServerEpoch, TimerFired)


# ------------------------------------------------------------------------------------ state


class RequestState(enum.Enum):
    ABSENT = "absent"  # unknown, or finished
    LOOKING_UP = "looking_up"  # lookup submitted, hit unknown
    MATCHED = "matched"  # hit known, no blocks yet
    RUNNING = "running"  # blocks allocated: lookups are over for it
    PREEMPTED = "preempted"  # blocks taken back; resumes with new blocks and recomputes


@attrs.define
class RequestTracker:
    """What the planner knows of one request between its first ``MatchRequest`` and
    ``RequestFinished``."""

    request_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    cache_salt: str = ""
    extras: KeyExtras = NO_EXTRAS
    load_limit: int | None = None  # tokens [0, load_limit) may be loaded; None: no cap
    store_limit: int | None = None  # tokens [0, store_limit) may be stored; None: no cap
    state: RequestState = RequestState.ABSENT  # assigned by the planner's table, never by a handler
    hit_tokens: int | None = None  # the lookup's result (a multiple of the chunk size)
    engine_hit_tokens: int = 0  # the engine's own prefix-cache hit when the result was used
    pending_retrieve: SubmitRetrieve | None = None  # for the next plan
    first_match_at: float = 0.0  # when vLLM first asked (the lookup wait runs from here)
    sync_load: bool = False  # the load was answered synchronous (load_async=False)
    block_ids: list[int] = attrs.Factory(list)
    # with several KV-cache groups: the blocks of the groups after the first, one list per group
    other_group_block_ids: list[list[int]] = attrs.Factory(list)
    stored_until: int = 0  # tokens [0, stored_until) are stored or their store is planned
    leases_freed: tuple[tuple[int, int], ...] = ()  # the token ranges freed at allocation
    leased_at: float | None = None  # when the lookup whose leases back the hit was sent
    lease_renewals: int = 0  # lookups again to renew them

    def num_blocks(self) -> int:
        """Blocks every group holds (vLLM keeps one entry per block in each group's list)."""
        return min([len(self.block_ids), *(len(g) for g in self.other_group_block_ids)])

    def prompt(self) -> tuple[int, ...]:
        return tuple(self.token_ids[: self.num_prompt_tokens])

