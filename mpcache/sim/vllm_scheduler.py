"""A model of vLLM's scheduler, calling a KV connector's scheduler half in vLLM's order.

This is the one model of vLLM in mpcache: the simulator's engine (``sim/engine.py``, over
core_sm's ``StepPlanner`` on a simulated node) and the adapter tests' engine
(``tests/runtime_zmq/adapter_driver.py``, over ``mpcache.runtime_zmq.adapters.SchedulerAdapter`` and
real servers) both schedule through ``SchedulerModel``. It decides only what vLLM decides
(reference/vllm_connector.md; vLLM 0.32 ``Scheduler.schedule`` and ``KVCacheManager``):

* the waiting queue, first come first served; at most ``max_running`` requests hold blocks and
  run (vLLM's ``max_num_seqs``): a full scheduler does not reach its waiting requests;
* the engine's own prefix-cache hit: whole blocks, never the last token;
* ``get_num_new_matched_tokens`` -> ``None`` keeps the request waiting (asked again next step);
* blocks: a request is admitted only if the pool holds blocks for its whole prompt (and the
  caller does not say it is short for it: blocks other work holds, ``admit(short=True)``); an
  async load's first ``update_state_after_alloc`` names the blocks of the tokens it will hold
  once loaded, the second (when the load landed) all of them; a synchronous load
  (``load_async=False`` with tokens to load) gets them all at once and is scheduled in the same
  step, its load finished before that step's forward;
* the step's ``ScheduledRequest``s and preempted ids, handed to ``build_connector_meta``;
* preemption (blocks back at once, recompute from scratch), load errors (recompute from the
  first bad block), finish (``request_finished``; blocks freed only once every worker reported
  the request in ``sending``);
* KV-cache groups (``kv_groups``, vLLM's hybrid KV-cache manager): each group its own block
  table, allocated from the one pool; a sliding-window group's blocks that hold only tokens
  before the window of the computed tokens are vLLM's null block (``NULL_BLOCK``, never
  allocated): a new request's prefix (prefix-cache hit and external tokens) gets it for them,
  as ``SlidingWindowManager`` does; the groups after the first go to the connector as
  ``other_group_block_ids``.

Protocol decisions (loadable tokens, leases, what to store) are the connector's; data, time and
workers are the caller's.
"""
from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable, Sequence
from typing import Protocol

import attrs

from mpcache.core_sm.keys import NO_EXTRAS, KeyExtras
from mpcache.core_sm.kv_groups import GroupKind, KVGroup
from mpcache.core_sm.planner import ScheduledRequest, StepPlan

NULL_BLOCK = 0  # vLLM's null block: what a window group's table holds for blocks it dropped


class Connector(Protocol):
    """The scheduler half of a KV connector, in vLLM's words (``SchedulerAdapter``'s methods)."""

    def get_num_new_matched_tokens(
        self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, num_computed_tokens: int,
        cache_salt: str = "", extras: KeyExtras = NO_EXTRAS, *, max_load_tokens: int | None = None,
        max_offload_tokens: int | None = None,
    ) -> tuple[int | None, bool]: ...

    def update_state_after_alloc(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int,
                                 other_group_block_ids: Sequence[Sequence[int]] = ()) -> None: ...

    def build_plan(self, scheduled: Iterable[ScheduledRequest], preempted: Iterable[str] = ()) -> StepPlan: ...

    def request_finished(self, request_id: str) -> bool: ...


class Status(str, enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # vLLM's WAITING_FOR_REMOTE_KVS: blocks held, the load in flight
    RUNNING = "running"
    FINISHED = "finished"  # vLLM is done with it; ``freed`` once every worker reported "sending"


class Admission(enum.Enum):
    """What ``admit`` did with a waiting request this step."""

    FULL = "full"  # the scheduler runs max_running requests: not reached
    PENDING = "pending"  # the connector answered None: asked again next step
    NO_BLOCKS = "no_blocks"  # the pool is short: stays waiting
    LOADING = "loading"  # blocks allocated, the connector loads ``external`` tokens, asynchronously
    SYNC_LOAD = "sync_load"  # blocks allocated, ``external`` tokens load before this step's forward
    RUNNING = "running"  # blocks allocated, nothing to load: compute


@attrs.define
class QueuedRequest:
    """One request as vLLM's scheduler tracks it."""

    request_id: str
    tokens: list[int]
    apc_blocks: int = 0  # blocks of the prompt the engine's own prefix cache holds
    cache_salt: str = ""
    extras: KeyExtras = NO_EXTRAS
    max_load_tokens: int | None = None
    max_offload_tokens: int | None = None
    status: Status = Status.WAITING
    blocks: list[int] = attrs.Factory(list)  # the first KV-cache group's block table
    # with several KV-cache groups: the tables of the groups after the first (NULL_BLOCK: dropped)
    group_blocks: list[list[int]] = attrs.Factory(list)
    engine_hit: int = 0  # tokens the prefix cache gave at the last admission
    external: int = 0  # tokens the connector loads (the last admission)
    computed: int = 0  # tokens whose KV the engine holds (prefix cache, load, forward)
    preempted: bool = False
    freed: bool = False  # finished and its blocks are back in the pool
    unsent: set[Hashable] = attrs.Factory(set)  # workers yet to report it in sending
    num_prompt: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.num_prompt = len(self.tokens)


class SchedulerModel:
    """vLLM's scheduler for one engine (see the module docstring). ``admit``, ``load_landed``,
    ``schedule``, ``preempt``, ``recompute_from``, ``finish``, ``sent`` and ``end_step`` are the
    scheduler's moves; the caller decides when each happens (steps, time, workers)."""

    def __init__(self, connector: Connector, block_size: int, num_blocks: int,
                 max_running: int | None = None, kv_groups: Sequence[KVGroup] = ()) -> None:
        self.connector = connector
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_running = max_running
        # several groups: the tables of the groups after the first are the model's too
        self.groups: tuple[KVGroup, ...] = tuple(kv_groups) if len(kv_groups) > 1 else ()
        # with several groups block 0 is the null block, never handed out
        self.free_blocks = list(range(1 if self.groups else 0, num_blocks))
        self.block_owner: dict[int, str] = {}
        self.requests: dict[str, QueuedRequest] = {}
        self._scheduled: list[ScheduledRequest] = []
        self._preempted: list[str] = []

    # ------------------------------------------------------------------ queries

    def engine_prefix_hit(self, req: QueuedRequest) -> int:
        """vLLM's own prefix-cache hit: whole blocks, and never the last token
        (``KVCacheManager.get_computed_blocks`` caps it one token short of the request)."""
        return min(req.apc_blocks, (len(req.tokens) - 1) // self.block_size) * self.block_size

    def running(self) -> int:
        return sum(1 for r in self.requests.values() if r.status in (Status.LOADING, Status.RUNNING))

    def blocks_in_use(self) -> int:
        return self.num_blocks - (1 if self.groups else 0) - len(self.free_blocks)

    def dropped_blocks(self, group: KVGroup, computed: int) -> int:
        """How many leading blocks of ``group``'s table are the null block once ``computed``
        tokens are computed: a sliding window's blocks holding only tokens before
        ``computed - window + 1`` (vLLM ``SlidingWindowManager.get_num_skipped_tokens``); none
        for the other kinds."""
        if group.kind is not GroupKind.SLIDING_WINDOW:
            return 0
        return max(0, computed - group.window + 1) // self.block_size

    def tables(self, req: QueuedRequest) -> list[list[int]]:
        """Every group's block table, the first group's first."""
        return [req.blocks, *req.group_blocks]

    def waiting(self) -> list[QueuedRequest]:
        return [r for r in self.requests.values() if r.status is Status.WAITING]

    # ------------------------------------------------------------------ moves

    def add(self, req: QueuedRequest) -> QueuedRequest:
        self.requests[req.request_id] = req
        return req

    def admit(self, req: QueuedRequest, running: int | None = None, short: bool = False) -> Admission:
        """One waiting request's turn in this step: ask the connector, allocate, tell it.
        ``running``: requests already running this step (default: counted now); ``short``: the
        pool has no blocks for it this step whatever it holds (blocks of work the caller does not
        model: the connector is asked, the request stays waiting, ``NO_BLOCKS``)."""
        assert req.status is Status.WAITING
        if self.max_running is not None and (self.running() if running is None else running) >= self.max_running:
            return Admission.FULL
        apc = self.engine_prefix_hit(req)
        external, load_async = self.connector.get_num_new_matched_tokens(
            req.request_id, req.tokens, req.num_prompt, apc, req.cache_salt, req.extras,
            max_load_tokens=req.max_load_tokens, max_offload_tokens=req.max_offload_tokens)
        if external is None:
            return Admission.PENDING
        if external < 0 or apc + external >= req.num_prompt or (external == 0 and load_async):
            raise AssertionError(f"{req.request_id}: the connector answered ({external}, {load_async}) for "
                                 f"{req.num_prompt} prompt tokens, {apc} held by the engine")
        need = -(-len(req.tokens) // self.block_size)
        dropped = [self.dropped_blocks(g, apc + external) for g in self.groups[1:]]
        if short or len(self.free_blocks) < need + sum(need - d for d in dropped):
            return Admission.NO_BLOCKS  # vLLM keeps it waiting and asks again next step
        req.blocks = self._take(req, need)
        req.group_blocks = [[NULL_BLOCK] * d + self._take(req, need - d) for d in dropped]
        req.engine_hit, req.external, req.computed = apc, external, apc + external
        # An async load's blocks are those of the tokens it will hold once loaded; the rest are
        # the model's reservation, named when the load lands.
        held = -(-(apc + external) // self.block_size) if load_async else need
        self._allocated(req, held, external)
        if load_async:
            req.status = Status.LOADING
            return Admission.LOADING
        req.status = Status.RUNNING
        return Admission.SYNC_LOAD if external > 0 else Admission.RUNNING

    def load_landed(self, req: QueuedRequest) -> None:
        """Every worker reported the load in ``recving``: vLLM calls update_state_after_alloc
        again and the request runs."""
        assert req.status is Status.LOADING
        self._allocated(req, len(req.blocks), 0)
        req.status = Status.RUNNING

    def recompute_from(self, req: QueuedRequest, bad_blocks: Iterable[int]) -> int:
        """vLLM's recompute policy for load errors: the request computes again from its first
        bad block. Returns the tokens it still holds."""
        bad = set(bad_blocks) - {NULL_BLOCK} if self.groups else set(bad_blocks)
        for table in self.tables(req):
            for index, block in enumerate(table):
                if block in bad:
                    req.computed = min(req.computed, index * self.block_size)
                    break
        return req.computed

    def recompute_failed_load(self, req: QueuedRequest) -> int:
        """vLLM's answer to a load failed by request id (several KV-cache groups: block ids
        cannot name a request): the request computes every token past its prefix-cache hit.
        Returns the tokens it still holds."""
        req.computed = min(req.computed, req.engine_hit)
        return req.computed

    def schedule(self, req: QueuedRequest, num_tokens: int, new_blocks: Sequence[int] | None = None,
                 replaces: bool = False) -> None:
        """This step computes ``num_tokens`` more of ``req`` (from ``req.computed``);
        ``new_blocks``: blocks it got this step (``replaces``: its whole list)."""
        others: tuple[tuple[int, ...], ...] = ()
        if self.groups and new_blocks is not None:
            # the other groups' blocks of the same positions in their tables
            first = len(req.blocks) - len(new_blocks)
            others = tuple(tuple(table[first:]) for table in req.group_blocks)
        self._scheduled.append(ScheduledRequest(req.request_id, req.computed, num_tokens,
                                                None if new_blocks is None else tuple(new_blocks), replaces,
                                                others))

    def schedule_prefill(self, req: QueuedRequest) -> int:
        """The request's first scheduled step (new, or resumed after preemption or a load):
        every token not held yet, with its whole block list. Returns the tokens scheduled."""
        n = len(req.tokens) - req.computed
        self.schedule(req, n, req.blocks, True)
        return n

    def grow(self, req: QueuedRequest, num_tokens: int) -> list[int]:
        """Blocks for ``num_tokens`` tokens (a decode step); returns the new ones."""
        new: list[int] = []
        while len(req.blocks) * self.block_size < num_tokens:
            new.extend(self._take(req, 1))
            req.blocks.append(new[-1])
            for table in req.group_blocks:
                table.extend(self._take(req, 1))
        return new

    def preempt(self, req: QueuedRequest) -> None:
        """vLLM preemption: the blocks go back at once; the request waits and recomputes from
        scratch (what the prefix cache still holds of it: ``apc_blocks``, the caller's)."""
        self._free(req)
        req.status = Status.WAITING
        req.computed = req.engine_hit = req.external = 0
        req.preempted = True
        self._preempted.append(req.request_id)

    def finish(self, req: QueuedRequest, workers: Iterable[Hashable]) -> bool:
        """vLLM ``request_finished`` (finished or aborted). True: its blocks stay until every one
        of ``workers`` reported it in ``sending`` (``sent``); False: it held none, done now."""
        assert self.connector.request_finished(req.request_id) is True
        req.status = Status.FINISHED
        if not req.blocks:
            req.freed = True
            return False
        req.unsent = set(workers)
        return True

    def sent(self, req: QueuedRequest, worker: Hashable) -> bool:
        """``worker`` reported ``req`` in ``sending``; True when that frees its blocks."""
        req.unsent.discard(worker)
        if req.status is not Status.FINISHED or req.freed or req.unsent:
            return False
        self._free(req)
        req.freed = True
        return True

    def end_step(self) -> StepPlan:
        """vLLM ``build_connector_meta``: the step's scheduled requests and preemptions."""
        scheduled, preempted = tuple(self._scheduled), tuple(self._preempted)
        self._scheduled, self._preempted = [], []
        return self.connector.build_plan(scheduled, preempted)

    def _take(self, req: QueuedRequest, n: int) -> list[int]:
        taken = [self.free_blocks.pop() for _ in range(n)]
        for b in taken:
            self.block_owner[b] = req.request_id
        return taken

    def _allocated(self, req: QueuedRequest, held: int, external: int) -> None:
        """``update_state_after_alloc`` with the first ``held`` blocks of every group."""
        if not self.groups:
            self.connector.update_state_after_alloc(req.request_id, req.blocks[:held], external)
            return
        self.connector.update_state_after_alloc(req.request_id, req.blocks[:held], external,
                                                [table[:held] for table in req.group_blocks])

    def _free(self, req: QueuedRequest) -> None:
        for table in reversed(self.tables(req)):
            live = [b for b in table if not (self.groups and b == NULL_BLOCK)]
            for b in live:
                self.block_owner.pop(b, None)
            self.free_blocks.extend(reversed(live))
        req.blocks = []
        req.group_blocks = []
