"""A miniature of vLLM's scheduler + workers that calls mpcache's adapters in vLLM's order.

No vLLM, no model: a "forward" writes, for every computed token, a KV vector that is a function
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

from core_sm.keys import NO_EXTRAS, KeyExtras
from core_sm.planner import ScheduledRequest
from runtime_zmq.adapters import ConnectorConfig, SchedulerAdapter, WorkerAdapter

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
class Req:
    request_id: str
    tokens: list[int]
    engine_hit: int = 0
    status: str = "waiting"  # waiting | loading | running | finished
    blocks: list[int] = attrs.Factory(list)
    computed: int = 0
    loaded_tokens: int = 0  # tokens that came from mpcache
    external: int = 0
    finished_reported: int = 0  # workers that reported it in sending
    recv_reported: int = 0
    freed: bool = False
    checked: bool = False
    max_decode: int = 2
    decoded: int = 0
    # What vLLM passes besides the tokens: cache salt, key extras, kv_transfer_params caps.
    cache_salt: str = ""
    extras: KeyExtras = NO_EXTRAS
    max_load_tokens: int | None = None
    max_offload_tokens: int | None = None
    num_prompt: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.num_prompt = len(self.tokens)


class Engine:
    """One scheduler and ``len(worker_urls)`` worker ranks (a TP world)."""

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
    ) -> None:
        """``device="cuda"``: KV caches in vLLM's CUDA layout ``[2, NB, BS, NH, HS]`` on the GPU
        (server-driven transfers); ``"cpu"``: vLLM's CPU layout (engine-driven).
        ``lookup_wait_ms`` / ``sync_load_max_tokens``: the connector's settings (default here: the
        lookup never waited for, every load asynchronous)."""
        self.device = device
        self.config = ConnectorConfig(server_urls=list(server_urls), request_timeout_s=request_timeout_s, connect_timeout_s=5.0, store_decode_tokens=store_decode_tokens,
                                      lookup_wait_ms=lookup_wait_ms, sync_load_max_tokens=sync_load_max_tokens)
        self.planner = SchedulerAdapter.connect(self.config, model_name="tiny", world_size=world_size, block_size=BLOCK,
                                                load=load, store=store)
        self.lookups = self.planner
        self.workers: list[WorkerAdapter] = []
        self.kv: list[dict[str, torch.Tensor]] = []
        for rank in range(world_size):
            worker = WorkerAdapter.connect(self.config, model_name="tiny", world_size=world_size, rank=rank, block_size=BLOCK)
            shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD) if device == "cpu" else (2, NUM_BLOCKS, BLOCK, HEADS, HEAD)
            caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, device=device) for i in range(LAYERS)}
            worker.register_kv_caches(caches)
            self.workers.append(worker)
            self.kv.append(caches)
        self.free_blocks = list(range(NUM_BLOCKS))
        self.requests: dict[str, Req] = {}
        self.finished_for_workers: set[str] = set()
        self.preempted: set[str] = set()
        self.load_errors_seen: set[int] = set()
        self.steps = 0
        self.sync_loads = 0  # requests loaded within the step that scheduled them

    # ------------------------------------------------------------------ requests

    def add(self, request_id: str, tokens: Sequence[int], engine_hit: int = 0, max_decode: int = 2, **keyed: Any) -> Req:
        """``engine_hit``: tokens the engine's own prefix cache holds (block multiple);
        ``max_decode``: tokens generated after the prompt, one per step; ``keyed``: ``Req``'s
        cache_salt / extras / max_load_tokens / max_offload_tokens."""
        assert engine_hit % BLOCK == 0
        req = Req(request_id, list(tokens), engine_hit=engine_hit, max_decode=max_decode, **keyed)
        self.requests[request_id] = req
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
        self._release(req)
        req.status = "waiting"
        req.computed = 0
        req.engine_hit = 0
        self.preempted.add(request_id)

    # ------------------------------------------------------------------ one engine step

    def step(self) -> None:
        self.steps += 1
        scheduled: list[ScheduledRequest] = []
        forward: list[tuple[Req, int]] = []
        sync_loaded: list[Req] = []
        for req in list(self.requests.values()):
            if req.status == "loading" and req.recv_reported == len(self.workers):
                # vLLM: the load finished; the request becomes runnable (2nd alloc call).
                req.status = "running"
                self._check_loaded(req)
                self._grow(req, len(req.tokens))
                self.planner.update_state_after_alloc(req.request_id, req.blocks, 0)
                n = len(req.tokens) - req.computed
                scheduled.append(ScheduledRequest(req.request_id, req.computed, n, tuple(req.blocks), True))
                forward.append((req, n))
            elif req.status == "waiting":
                num_computed = req.engine_hit
                need, load_async = self.planner.get_num_new_matched_tokens(
                    req.request_id, req.tokens, req.num_prompt, num_computed, req.cache_salt, req.extras,
                    max_load_tokens=req.max_load_tokens, max_offload_tokens=req.max_offload_tokens,
                )
                if need is None:
                    continue
                assert need > 0 or not load_async
                assert num_computed + need < req.num_prompt, "at least one prompt token must be left to compute"
                req.external = need
                if need > 0 and not load_async:
                    # vLLM's synchronous load: blocks for the whole prompt now, scheduled this step.
                    self._grow(req, len(req.tokens))
                else:
                    self._grow(req, num_computed + need)
                self._fill_engine_hit(req)
                self.planner.update_state_after_alloc(req.request_id, req.blocks, need)
                req.computed = num_computed + need
                if need > 0 and load_async:
                    req.status = "loading"
                    req.loaded_tokens = need
                    continue
                if need > 0:
                    req.loaded_tokens = need
                    sync_loaded.append(req)
                req.status = "running"
                self._grow(req, len(req.tokens))
                n = len(req.tokens) - req.computed
                scheduled.append(ScheduledRequest(req.request_id, req.computed, n, tuple(req.blocks), True))
                forward.append((req, n))
            elif req.status == "running" and req.decoded < req.max_decode:
                # A decode step: one new token (a function of the sequence so far).
                req.tokens.append((sum(req.tokens) * 31 + len(req.tokens)) % 50_000)
                req.decoded += 1
                old = len(req.blocks)
                self._grow(req, len(req.tokens))
                new_blocks = tuple(req.blocks[old:]) or None
                scheduled.append(ScheduledRequest(req.request_id, req.computed, 1, new_blocks, False))
                forward.append((req, 1))
        plan = self.planner.build_plan(scheduled, self.preempted)
        self.preempted = set()
        finished_ids, self.finished_for_workers = self.finished_for_workers, set()
        errors: set[int] = set()
        assert sorted(plan.sync_loads) == sorted(r.request_id for r in sync_loaded)
        for worker in self.workers:
            if plan.preempted:
                worker.wait_for_store_copies()
            # vLLM calls start_load_kv before the forward when the step has synchronous loads.
            worker.submit_retrieves(plan.retrieves, plan.sync_loads)
        if sync_loaded:
            # A failed synchronous load is reported in this pass; vLLM (recompute policy) then
            # recomputes the request from its first bad block.
            early: set[int] = set().union(*(w.load_errors() for w in self.workers))
            self._apply_load_errors(early)
            for req in sync_loaded:
                self.sync_loads += 1
                bad = [i for i, block in enumerate(req.blocks) if block in early]
                if bad:
                    req.computed = min(req.computed, bad[0] * BLOCK)
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
        for req, n in forward:
            req.computed += n
        self._apply_load_errors(errors)
        for req in self.requests.values():
            if req.status == "finished" and not req.freed and req.finished_reported == len(self.workers):
                self._release(req)
                req.freed = True
            elif req.status == "running" and req.computed == len(req.tokens) and req.decoded >= req.max_decode:
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
        assert self.planner.request_finished(req.request_id) is True
        req.status = "finished"
        self.finished_for_workers.add(req.request_id)

    def _grow(self, req: Req, tokens: int) -> None:
        while len(req.blocks) * BLOCK < tokens:
            req.blocks.append(self.free_blocks.pop(0))

    def _release(self, req: Req) -> None:
        self.free_blocks.extend(req.blocks)
        req.blocks = []

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
            if req.status != "loading":
                continue
            for index, block in enumerate(req.blocks):
                if block in errors:
                    req.computed = min(req.computed, index * BLOCK)
                    req.loaded_tokens = max(0, req.computed - req.engine_hit)
                    break

    def blocks_in_use(self) -> int:
        return NUM_BLOCKS - len(self.free_blocks)

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        self.lookups.close()


def expected_vector(value: float, layer: int, rank: int, device: str = "cpu") -> torch.Tensor:
    """``[HEADS, 2*HEAD]``: K then V of every head of one token."""
    base = torch.arange(HEADS * 2 * HEAD, dtype=torch.float32, device=device).reshape(HEADS, 2 * HEAD) / 1024.0
    return base + value + 1000.0 * layer + 10_000.0 * rank
