"""``MPCacheConnector``: vLLM's KV-connector API on top of mpcache's adapters.

Load it with configuration only::

    kv_transfer_config={
        "kv_connector": "MPCacheConnector",
        "kv_connector_module_path": "mpcache.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"mpcache.server_urls": "tcp://127.0.0.1:5555"},
    }

The class is instantiated twice, once per role, usually in two processes: the scheduler copy
drives core_sm's ``StepPlanner`` through a ``SchedulerAdapter``, the worker copy core_sm's
``TransferClient`` through a ``WorkerAdapter``. Everything here translates vLLM objects into
adapter calls; every decision lives in core_sm. See docs/vllm.md.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

try:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
    )
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
    except ImportError:  # pragma: no cover - a vLLM before the hybrid KV-cache manager
        SupportsHMA = None
except ImportError as exc:  # pragma: no cover - exercised by a test without vLLM
    raise ImportError(
        "mpcache.runtime_zmq.vllm_connector needs vLLM; install it with: pip install 'mpcache[vllm]' "
        f"(import failed: {exc})"
    ) from exc

from mpcache.core_sm.kv_groups import GroupKind, KVGroup, layout_identity, several, unrestorable
from mpcache.core_sm.planner import ScheduledRequest, StepPlan
from mpcache.runtime_zmq.adapters import ConnectorConfig, SchedulerAdapter, WorkerAdapter
from mpcache.runtime_zmq import vllm_stats
from mpcache.runtime_zmq.vllm_keys import RequestKeyer, UnkeyableRequest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("mpcache.vllm")

__all__ = ["MPCacheConnector", "MPCacheConnectorMetadata"] + (["MPCacheHMAConnector"] if SupportsHMA is not None else [])

# vLLM's KV-cache spec classes by name (the most specific first; a subclass matches its base's
# entry unless listed before it): what core_sm.kv_groups calls each group.
_SPEC_KINDS = (
    ("SlidingWindowSpec", GroupKind.SLIDING_WINDOW),
    ("ChunkedLocalAttentionSpec", GroupKind.OTHER),
    ("CrossAttentionSpec", GroupKind.OTHER),
    ("MambaSpec", GroupKind.RECURRENT),
    ("FullAttentionSpec", GroupKind.FULL),  # MLA's spec is one
)


def kv_groups_of(kv_cache_config: Any) -> tuple[KVGroup, ...]:
    """vLLM's KV-cache groups as core_sm's ``KVGroup``s (read by attribute: no vLLM import)."""
    out = []
    for index, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        spec = group.kv_cache_spec
        names = {klass.__name__ for klass in type(spec).__mro__}
        kind = next((k for name, k in _SPEC_KINDS if name in names), GroupKind.OTHER)
        window = int(getattr(spec, "sliding_window", 0) or 0) if kind is GroupKind.SLIDING_WINDOW else 0
        if kind is GroupKind.SLIDING_WINDOW and window < 1:
            kind = GroupKind.OTHER
        out.append(KVGroup(kind, max(1, int(getattr(spec, "block_size", 1) or 1)), window, name=f"group {index}"))
    return tuple(out)


def _split_groups(block_ids: Any) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """A request's block ids as vLLM passes them, one list per KV-cache group: the first
    group's, and the others' (empty with one group)."""
    groups = tuple(tuple(g) for g in block_ids)
    if not groups:
        return (), ()
    return groups[0], groups[1:]


def group_layer_names(kv_cache_config: Any) -> tuple[tuple[str, ...], ...]:
    """The layer names of each KV-cache group, in vLLM's order (read by attribute)."""
    return tuple(tuple(group.layer_names) for group in getattr(kv_cache_config, "kv_cache_groups", None) or ())


class MPCacheConnectorMetadata(KVConnectorMetadata):
    """The scheduler's per-step plan for the workers (plain data: vLLM pickles it)."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan

    def __repr__(self) -> str:
        plan = self.plan
        return (
            f"MPCacheConnectorMetadata(retrieves={len(plan.retrieves)}, stores={len(plan.stores)}, "
            f"preempted={len(plan.preempted)})"
        )


def _model_identity(vllm_config: VllmConfig) -> tuple[str, int, int, int]:
    model_name = str(vllm_config.model_config.model)
    parallel = vllm_config.parallel_config
    world_size = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
    block_size = int(vllm_config.cache_config.block_size)
    return model_name, world_size, int(parallel.rank), block_size


def _cpu_engine(vllm_config: VllmConfig) -> bool:
    """Whether the workers' KV caches are in host memory (vLLM's CPU platform)."""
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    if device is None:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    return str(device) == "cpu"


def _token_cap(params: dict[str, Any], name: str, request_id: str) -> int | None:
    """A per-request ``kv_transfer_params`` token cap (vLLM OffloadingConnector's convention:
    a non-negative int, 0 opts out; anything else is ignored with a warning)."""
    raw = params.get(name)
    if raw is None:
        return None
    if type(raw) is int and raw >= 0:
        return raw
    logger.warning("request %s: %s must be a non-negative int, got %r; ignoring", request_id, name, raw)
    return None


class MPCacheConnector(KVConnectorBase_V1):
    """vLLM KV connector that offloads to and loads from mpcache servers."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer_config = self._kv_transfer_config
        vllm_stats.check_extra_config(transfer_config.kv_connector_extra_config)
        self._stats = vllm_stats.TransferRecorder()
        self._config = ConnectorConfig.from_extra_config(transfer_config.kv_connector_extra_config)
        self._is_producer = bool(transfer_config.is_kv_producer)
        self._is_consumer = bool(transfer_config.is_kv_consumer)
        model_name, world_size, rank, block_size = _model_identity(vllm_config)
        self._block_size = block_size
        self._kv_groups = kv_groups_of(kv_cache_config)
        # why these KV-cache groups cannot be restored (None: they can): every request a miss
        self._unrestorable = unrestorable(self._kv_groups, _cpu_engine(vllm_config))
        # several groups restored: failed loads are reported by request id, never by block id
        self._several_groups = self._unrestorable is None and several(self._kv_groups)
        self._planner: SchedulerAdapter | None = None
        self._keyer: RequestKeyer | None = None
        self._worker: WorkerAdapter | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._planner = SchedulerAdapter.connect(
                self._config, model_name=model_name, world_size=world_size, block_size=block_size,
                load=self._is_consumer, store=self._is_producer, cpu_engine=_cpu_engine(vllm_config),
                kv_groups=self._kv_groups,
            )
            if self._unrestorable is not None:
                logger.warning("mpcache: %s; every request of this engine reports 0 external tokens and "
                               "nothing is stored", self._unrestorable)
            # Refuses (at start) an engine configuration whose KV mpcache cannot key.
            self._keyer = RequestKeyer.from_vllm_config(vllm_config, self._planner.chunk_size, self._config.model_identity,
                                                        kv_layout=layout_identity(self._kv_groups))
            if self._several_groups:
                logger.info("mpcache restores %d KV-cache groups (%s), each chunk's object holding all of them",
                            len(self._kv_groups), layout_identity(self._kv_groups))
        else:
            self._worker = WorkerAdapter.connect(
                self._config, model_name=model_name, world_size=world_size, rank=rank, block_size=block_size
            )
        logger.info(
            "mpcache connector (%s) for %s, world size %d, servers %s",
            role.name.lower(),
            model_name,
            world_size,
            ",".join(self._config.server_urls),
        )

    # A dropped store is a future miss, never a correctness problem: vLLM need not hold a
    # preempted request back for it.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._planner is not None and self._keyer is not None
        tracker = self._planner.tracker(request.request_id)
        if tracker is not None:
            extras = tracker.extras
        else:
            try:
                extras = self._keyer.extras(request)
            except UnkeyableRequest as exc:
                # Unknown to the planner, the request is neither loaded nor stored.
                logger.warning("mpcache skips a request it cannot key: %s", exc)
                return 0, False
        params = request.kv_transfer_params or {}
        return self._planner.get_num_new_matched_tokens(
            request.request_id,
            request.all_token_ids,
            request.num_prompt_tokens,
            num_computed_tokens,
            request.cache_salt or "",
            extras,
            max_load_tokens=_token_cap(params, "max_load_tokens", request.request_id),
            max_offload_tokens=_token_cap(params, "max_offload_tokens", request.request_id),
        )

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._planner is not None
        first, others = _split_groups(blocks.get_block_ids())
        self._planner.update_state_after_alloc(request.request_id, first, num_external_tokens, others)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._planner is not None
        scheduled: list[ScheduledRequest] = []
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            first, others = _split_groups(new.block_ids)
            scheduled.append(
                ScheduledRequest(new.req_id, new.num_computed_tokens, num_scheduled.get(new.req_id, 0), first, True,
                                 others)
            )
        cached = scheduler_output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[index]
            first, others = ((), ()) if new_blocks is None else _split_groups(new_blocks)
            scheduled.append(
                ScheduledRequest(
                    request_id,
                    cached.num_computed_tokens[index],
                    num_scheduled.get(request_id, 0),
                    None if new_blocks is None else first,
                    request_id in cached.resumed_req_ids,
                    others,
                )
            )
        plan = self._planner.build_plan(scheduled, scheduler_output.preempted_req_ids or ())
        return MPCacheConnectorMetadata(plan)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._planner is not None
        delay = self._planner.request_finished(request.request_id)
        # groups it cannot restore: the workers registered nothing and report no request, so
        # vLLM must not wait for them to free the blocks
        return delay and self._unrestorable is None, None

    def update_connector_output(self, connector_output: Any) -> None:
        # Completions reach vLLM's scheduler directly; the planner needs none of them.
        return None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        if self._unrestorable is not None:  # nothing is stored or loaded (the scheduler says why)
            logger.info("mpcache worker registers no KV cache: %s", self._unrestorable)
            return
        if self._several_groups:
            self._worker.register_kv_caches(kv_caches, self._kv_groups, group_layer_names(self._kv_cache_config))
        else:
            self._worker.register_kv_caches(kv_caches)
        num_blocks = getattr(self._kv_cache_config, "num_blocks", 0) or 0
        self._stats.bytes_per_token = vllm_stats.bytes_per_token(kv_caches, num_blocks, self._block_size)

    def _plan(self) -> StepPlan | None:
        if self._connector_metadata is None:
            return None
        metadata = self._connector_metadata
        assert isinstance(metadata, MPCacheConnectorMetadata)
        return metadata.plan

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self._worker is not None
        if isinstance(kv_connector_metadata, MPCacheConnectorMetadata) and kv_connector_metadata.plan.preempted:
            # The preempted requests' blocks are about to be reused: no read of them may be left
            # for later (GPU: the server's STORE copies must have completed).
            self._worker.wait_for_store_copies()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        plan = self._plan()
        if plan is not None and plan.retrieves:
            # vLLM calls this before the forward when the step has synchronous loads: those are
            # complete (or failed into load errors) when submit_retrieves returns.
            self._stats.retrieves_submitted(plan.retrieves)
            self._worker.submit_retrieves(plan.retrieves)
            self._stats.finished((), plan.sync_loads)
        self._worker.poll()

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are whole-request: an asynchronous one is scheduled only after it finished, a
        # synchronous one finished in start_load_kv, so no layer ever waits here.
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        # Stores are submitted once per step in wait_for_save, for whole chunks.
        return None

    def wait_for_save(self) -> None:
        assert self._worker is not None
        plan = self._plan()
        if plan is not None and plan.stores:
            self._worker.submit_stores(plan.stores)
            self._stats.stores_submitted(plan.stores)
        self._worker.poll()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving = self._worker.finished(finished_req_ids)
        self._stats.finished(sending, recving)
        if self._several_groups:
            # Block ids are per group: vLLM takes a failed (asynchronous) load by request id.
            failed = self._worker.failed_loads()
            return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving | failed,
                                              failed_recving=failed)
        # A failed load is reported through get_block_ids_with_load_errors (single KV group).
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        errors = set(self._worker.load_errors())
        self._stats.finished((), (), load_failed_blocks=len(errors))
        # several groups: vLLM stops on block-level errors (their ids name no request); the
        # failed requests went out in get_transfer_results' failed_recving
        return set() if self._several_groups else errors

    # ------------------------------------------------------------------ stats (vLLM's /metrics)

    def get_kv_connector_stats(self) -> vllm_stats.MPCacheConnectorStats | None:
        data = self._stats.take()
        return None if data is None else vllm_stats.MPCacheConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> vllm_stats.MPCacheConnectorStats | None:
        return vllm_stats.MPCacheConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> vllm_stats.MPCachePromMetrics:
        return vllm_stats.MPCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ both

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._planner is not None:
            self._planner.close()


if SupportsHMA is not None:

    class MPCacheHMAConnector(MPCacheConnector, SupportsHMA):
        """``MPCacheConnector`` for vLLM's hybrid KV-cache manager (``kv_connector:
        "MPCacheHMAConnector"``): vLLM keeps a hybrid model's KV-cache groups apart only for a
        ``SupportsHMA`` connector, and runs some models (Mamba hybrids) only with one. What each
        group needs to resume a prefix is core_sm's (``core_sm.kv_groups``): one full-attention or
        sliding-window group is loaded and stored as by ``MPCacheConnector``; full-attention and
        sliding-window groups mixed (CPU engines) are stored together, one object per chunk
        holding every group's layers, and loaded together (asynchronously: a failure goes back
        by request id); groups this version cannot restore make every request a miss, logged
        once at start with the reason. The plain class stays without ``SupportsHMA``: vLLM then
        runs a sliding-window model as one group, which mpcache restores."""

        def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                        ) -> tuple[bool, dict[str, Any] | None]:
            return self.request_finished(request, list(_split_groups(block_ids)[0]))
