"""A miniature of vLLM's scheduler + workers that calls mpcache's adapters in vLLM's order.

The scheduling is the simulator's model of vLLM (``mpcache.sim.vllm_scheduler.SchedulerModel``: queue,
block pool, prefix-cache hit, the connector calls in vLLM's order, synchronous and asynchronous
loads, preemption, recompute, delayed frees), driving the real ``SchedulerAdapter``. No vLLM, no
model: a "forward" writes, for every computed token, a KV vector that is a function
of the token's whole prefix (a rolling hash), so a load is right only if every byte of every
loaded block came from the same prefix. The call order per step follows vLLM 0.32's
``Scheduler.schedule`` and the worker's ``KVConnectorModelRunnerMixin``:

    scheduler: get_num_new_matched_tokens → (allocate) → update_state_after_alloc → build plan
    worker:    handle_preemptions → start_load_kv (retrieves) → forward → wait_for_save (stores)
               → get_finished(finished ids of the previous step) → get_block_ids_with_load_errors
    scheduler: finished_recving → runnable (2nd update_state_after_alloc); finished_sending → free
               blocks; load errors → recompute from the first bad block; finished → request_finished

Block accounting mirrors vLLM: a finished (or aborted) request keeps its blocks until the workers
report it in ``sending`` (all workers, as vLLM aggregates); an abort while the load is in flight
keeps them until ``recving`` or ``sending``.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from mpcache.runtime_zmq.adapters import ConnectorConfig, SchedulerAdapter, WorkerAdapter
from mpcache.sim.vllm_scheduler import Admission, QueuedRequest, SchedulerModel

BLOCK = 16
CHUNK = 64
LAYERS = 2
HEADS = 2
HEAD = 32
NUM_BLOCKS = 256
APC_MARK = 0.25  # added to engine-held (prefix cache) blocks: a load must never overwrite them


def prefix_values(tokens: Sequence[int]) -> list[float]:
    """One value per position, depending on every token up to it."""
    out, h = [], 0
    for t in tokens:
        h = (h * 1_000_003 + int(t) + 1) % 1_048_573
        out.append(float(h))
    return out


@attrs.define
class Req(QueuedRequest):
    """A request of the model (``mpcache.sim.vllm_scheduler.QueuedRequest``: status, blocks, computed,
    external, freed, ...) plus what this engine checks: what was loaded, the workers' reports,
    the decode."""

    loaded_tokens: int = 0  # tokens that came from mpcache
    finished_reported: int = 0  # workers that reported it in sending
    recv_reported: int = 0
    checked: bool = False
    max_decode: int = 2
    decoded: int = 0


class Engine:
    """One scheduler and ``world_size`` worker ranks (a TP world). The scheduling is
    ``mpcache.sim.vllm_scheduler.SchedulerModel`` -- the simulator's model of vLLM -- over the real
    ``SchedulerAdapter``; this class adds the workers' calls and a forward that writes KV."""

    def __init__(
        self,
        server_urls: Sequence[str],
        *,
        world_size: int = 1,
        request_timeout_s: float = 2.0,
        store_decode_tokens: bool = False,
        load: bool = True,
        store: bool = True,
        device: str = "cpu",
        lookup_wait_ms: float = 0.0,
        sync_load_max_tokens: int = 0,
        lookup_wait_idle_ms: float = 0.0,
        lookup_answer_in_ack: bool = True,
    ) -> None:
        """``device="cuda"``: KV caches in vLLM's CUDA layout ``[2, NB, BS, NH, HS]`` on the GPU
        (server-driven transfers); ``"cpu"``: vLLM's CPU layout (engine-driven).
        ``lookup_wait_ms`` / ``sync_load_max_tokens``: the connector's settings (default here: the
        lookup never waited for, idle or not, every load asynchronous)."""
        self.device = device
        self.config = ConnectorConfig(server_urls=list(server_urls), request_timeout_s=request_timeout_s, connect_timeout_s=5.0, store_decode_tokens=store_decode_tokens,
                                      lookup_wait_ms=lookup_wait_ms, sync_load_max_tokens=sync_load_max_tokens,
                                      lookup_wait_idle_ms=lookup_wait_idle_ms, lookup_answer_in_ack=lookup_answer_in_ack)
        self.planner = SchedulerAdapter.connect(self.config, model_name="tiny", world_size=world_size, block_size=BLOCK,
                                                load=load, store=store)
        self.lookups = self.planner
        self.scheduler = SchedulerModel(self.planner, BLOCK, NUM_BLOCKS)
        self.workers: list[WorkerAdapter] = []
        self.kv: list[dict[str, torch.Tensor]] = []
        for rank in range(world_size):
            worker = WorkerAdapter.connect(self.config, model_name="tiny", world_size=world_size, rank=rank, block_size=BLOCK)
            shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD) if device == "cpu" else (2, NUM_BLOCKS, BLOCK, HEADS, HEAD)
            caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, device=device) for i in range(LAYERS)}
            worker.register_kv_caches(caches)
            self.workers.append(worker)
            self.kv.append(caches)
        self.requests: dict[str, Req] = {}
        self.finished_for_workers: set[str] = set()
        self.load_errors_seen: set[int] = set()
        self.steps = 0
        self.sync_loads = 0  # requests loaded within the step that scheduled them

    # ------------------------------------------------------------------ requests

    def add(self, request_id: str, tokens: Sequence[int], engine_hit: int = 0, max_decode: int = 2, **keyed: Any) -> Req:
        """``engine_hit``: tokens the engine's own prefix cache holds (block multiple);
        ``max_decode``: tokens generated after the prompt, one per step; ``keyed``: ``Req``'s
        cache_salt / extras / max_load_tokens / max_offload_tokens."""
        assert engine_hit % BLOCK == 0
        req = Req(request_id, list(tokens), engine_hit // BLOCK, max_decode=max_decode, **keyed)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> None:
        req = self.requests[request_id]
        if req.status == "finished":
            return
        self._finish(req)

    def preempt(self, request_id: str) -> None:
        """vLLM preemption: blocks go back at once, the request recomputes from scratch later."""
        req = self.requests[request_id]
        assert req.status == "running"
        self.scheduler.preempt(req)
        req.apc_blocks = 0  # its prefix-cache blocks went back with the rest: recomputed too

    # ------------------------------------------------------------------ one engine step

    def step(self) -> None:
        self.steps += 1
        model = self.scheduler
        forward: list[tuple[Req, int]] = []
        sync_loaded: list[Req] = []
        for req in list(self.requests.values()):
            if req.status == "loading" and req.recv_reported == len(self.workers):
                # vLLM: the load finished; the request becomes runnable (2nd alloc call).
                self._check_loaded(req)
                model.load_landed(req)
                forward.append((req, model.schedule_prefill(req)))
            elif req.status == "waiting":
                admitted = model.admit(req)
                if admitted in (Admission.PENDING, Admission.FULL, Admission.NO_BLOCKS):
                    continue
                self._fill_engine_hit(req)
                req.loaded_tokens = req.external
                if admitted is Admission.LOADING:
                    continue
                if admitted is Admission.SYNC_LOAD:
                    sync_loaded.append(req)  # vLLM's synchronous load: scheduled this step
                forward.append((req, model.schedule_prefill(req)))
            elif req.status == "running" and req.decoded < req.max_decode:
                # A decode step: one new token (a function of the sequence so far).
                req.tokens.append((sum(req.tokens) * 31 + len(req.tokens)) % 50_000)
                req.decoded += 1
                model.schedule(req, 1, model.grow(req, len(req.tokens)) or None)
                forward.append((req, 1))
        plan = model.end_step()
        finished_ids, self.finished_for_workers = self.finished_for_workers, set()
        errors: set[int] = set()
        assert sorted(plan.sync_loads) == sorted(r.request_id for r in sync_loaded)
        for worker in self.workers:
            if plan.preempted:
                worker.wait_for_store_copies()
            # vLLM calls start_load_kv before the forward when the step has synchronous loads.
            worker.submit_retrieves(plan.retrieves)
        if sync_loaded:
            # A failed synchronous load is reported in this pass; vLLM (recompute policy) then
            # recomputes the request from its first bad block.
            early: set[int] = set().union(*(w.load_errors() for w in self.workers))
            self._apply_load_errors(early)
            for req in sync_loaded:
                self.sync_loads += 1
                if early.intersection(req.blocks):
                    model.recompute_from(req, early)
                    req.loaded_tokens = max(0, req.computed - req.engine_hit)
                else:
                    self._check_loaded(req)
            sync_ids = {id(r) for r in sync_loaded}
            forward = [(r, len(r.tokens) - r.computed) if id(r) in sync_ids else (r, n) for r, n in forward]
        for rank, worker in enumerate(self.workers):
            for req, n in forward:
                self._compute(rank, req, req.computed, req.computed + n)
            worker.submit_stores(plan.stores)
            sending, recving = worker.finished(finished_ids)
            errors |= worker.load_errors()
            for rid in recving:
                assert rid not in plan.sync_loads, f"{rid}: a synchronous load reported as finished receiving"
                self.requests[rid].recv_reported += 1
            for rid in sending:
                self.requests[rid].finished_reported += 1
                model.sent(self.requests[rid], rank)
        for req, n in forward:
            req.computed += n
        self._apply_load_errors(errors)
        for req in self.requests.values():
            if req.status == "running" and req.computed == len(req.tokens) and req.decoded >= req.max_decode:
                self._finish(req)

    def run_until(self, predicate: Any, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"timed out after {self.steps} steps: {self.requests}"
            self.step()
            time.sleep(0.001)

    def run_all(self, timeout: float = 10.0) -> None:
        """Step until every request is finished and its blocks are back."""
        self.run_until(lambda: all(r.status == "finished" and r.freed for r in self.requests.values()), timeout)

    # ------------------------------------------------------------------ internals

    def _finish(self, req: Req) -> None:
        self.scheduler.finish(req, range(len(self.workers)))
        self.finished_for_workers.add(req.request_id)

    def _fill_engine_hit(self, req: Req) -> None:
        values = prefix_values(req.tokens)
        for rank in range(len(self.workers)):
            self._write(rank, req, 0, req.engine_hit, values, APC_MARK)

    def _compute(self, rank: int, req: Req, start: int, end: int) -> None:
        self._write(rank, req, start, end, prefix_values(req.tokens), 0.0)

    def _write(self, rank: int, req: Req, start: int, end: int, values: list[float], mark: float) -> None:
        for name, layer in self.kv[rank].items():
            layer_index = int(name.split(".")[2])
            for pos in range(start, end):
                block, offset = req.blocks[pos // BLOCK], pos % BLOCK
                vector = expected_vector(values[pos], layer_index, rank, self.device) + mark
                if self.device == "cpu":
                    layer[block, :, offset, :] = vector
                else:
                    layer[0, block, offset] = vector[:, :HEAD]
                    layer[1, block, offset] = vector[:, HEAD:]

    def _check_loaded(self, req: Req) -> None:
        """Every loaded token holds its prefix's KV; engine-held blocks were not overwritten."""
        values = prefix_values(req.tokens)
        bad = [p for p in range(req.engine_hit) if not self._holds(req, p, values, APC_MARK)]
        assert not bad, f"{req.request_id}: engine-held positions overwritten by a load: {bad[:5]}"
        bad = [p for p in range(req.engine_hit, req.computed) if not self._holds(req, p, values, 0.0)]
        assert not bad, f"{req.request_id}: loaded positions with wrong KV: {bad[:5]}"
        req.checked = True

    def _holds(self, req: Req, pos: int, values: list[float], mark: float) -> bool:
        block, offset = req.blocks[pos // BLOCK], pos % BLOCK
        for rank in range(len(self.workers)):
            for name, layer in self.kv[rank].items():
                want = expected_vector(values[pos], int(name.split(".")[2]), rank, self.device) + mark
                if self.device == "cpu":
                    got = layer[block, :, offset, :]
                else:
                    got = torch.cat([layer[0, block, offset], layer[1, block, offset]], dim=1)
                if not torch.equal(got, want):
                    return False
        return True

    def _apply_load_errors(self, errors: set[int]) -> None:
        """vLLM (recompute policy): a request with a bad block recomputes from that block."""
        if not errors:
            return
        self.load_errors_seen |= errors
        for req in self.requests.values():
            if req.status == "loading":
                self.scheduler.recompute_from(req, errors)
                req.loaded_tokens = max(0, req.computed - req.engine_hit)

    def blocks_in_use(self) -> int:
        return self.scheduler.blocks_in_use()

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        self.lookups.close()


def expected_vector(value: float, layer: int, rank: int, device: str = "cpu") -> torch.Tensor:
    """``[HEADS, 2*HEAD]``: K then V of every head of one token."""
    base = torch.arange(HEADS * 2 * HEAD, dtype=torch.float32, device=device).reshape(HEADS, 2 * HEAD) / 1024.0
    return base + value + 1000.0 * layer + 10_000.0 * rank
