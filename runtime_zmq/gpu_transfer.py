"""The GPU transfer engine: runs core_sm's ``StartTransfer`` effects for server-driven (GPU)
instances (the ``TransferExecutor`` seam of ``runtime_zmq/transfer.py``).

Per registered instance it holds the worker's per-layer KV tensors, opened once from CUDA IPC
handles (bytes plus shape / dtype / strides / device UUID — no pickle), a dedicated stream and a
``kernels.gpu.CudaKVTransfer`` between those tensors and the pinned L1 segment.

A transfer is enqueued, never waited on, by ``start`` (the server's loop thread):
``cuStreamWaitEvent`` on the worker's interprocess event → gather / scatter → ``cuEventRecord`` of
our completion event. One polling thread waits for the oldest completion event with
``cuEventSynchronize`` (the driver call releases the GIL; the thread holds no lock meanwhile),
then queries the others, and only then calls ``done(transfer_id, ok)``. No Python ever runs in a
CUDA host callback, so the host-callback / GIL deadlock of LMCache PR #2733 cannot happen here.

Registration layout (the worker's ``register_instance`` payload; ``export_kv_tensors`` in
``runtime_zmq/gpu_ipc.py`` makes ``tensors``)::

    {"kv_layout": "nhd" | "hnd" | "flashinfer" | "flashinfer_hnd" | "mla",
     "num_blocks": int, "block_size": int, "num_heads": int, "head_size": int, "itemsize": int,
     "device_uuid": bytes (16), "object_bytes": int,
     "tensors": [{"handle": bytes (64), "offset": int, "nbytes": int, "shape": [...],
                  "strides": [...], "dtype": str, "itemsize": int}, ...]}   # one per layer
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from core_sm.blocks import chunk_copies
from core_sm.effects import StartTransfer
from core_sm.messages import TransferKind
from runtime_zmq import gpu_ipc
from runtime_zmq.l1_pool import SharedMemoryPool
from runtime_zmq.transfer import DoneFn

log = logging.getLogger("mpcache.gpu")

MAX_OPEN_WORKER_EVENTS = 256


@dataclass(frozen=True)
class TransferRows:
    """One transfer as kernel calls: ``block_ids[i]`` ↔ the slot at byte ``slot_offsets[i]``;
    ``skip_blocks`` leading blocks of the flattened list are not written (retrieve only)."""

    block_ids: np.ndarray  # [n_chunks, blocks_per_chunk] int64
    slot_offsets: np.ndarray  # [n_chunks] int64, bytes into the pool
    skip_blocks: int


def plan_rows(st: StartTransfer, chunk_tokens: int, block_size: int, slot_bytes: int) -> TransferRows:
    """Map a ``StartTransfer`` to kernel rows (``core_sm.blocks.chunk_copies`` decides which
    chunks and blocks). Only the first row can be partly skipped, so one ``skip_blocks`` for the
    flattened list says it all. Raises ``ValueError`` on inconsistent input."""
    copies = chunk_copies(st.kind, st.start, st.end, st.placements, st.block_ids, st.skip_first_n_tokens,
                          chunk_tokens, block_size)
    bpc = chunk_tokens // block_size
    table = np.asarray([c.block_ids for c in copies], dtype=np.int64).reshape(len(copies), bpc)
    offsets = np.asarray([c.slot * slot_bytes for c in copies], dtype=np.int64)
    return TransferRows(table, offsets, copies[0].skip_blocks if copies else 0)


@dataclass
class _Pending:
    transfer_id: int
    event: Any
    done: DoneFn
    ok: bool


class _Instance:
    def __init__(self, geometry: Any, transfer: Any, addresses: list[int], stream_handle: Any, pool_slot_bytes: int) -> None:
        self.geometry = geometry
        self.transfer = transfer
        self.pool_slot_bytes = pool_slot_bytes
        self.addresses = addresses
        self.stream_handle = stream_handle
        self.worker_events: OrderedDict[bytes, Any] = OrderedDict()

    def worker_event(self, handle: bytes) -> Any:
        ev = self.worker_events.get(handle)
        if ev is None:
            ev = self.worker_events[handle] = gpu_ipc.open_event(handle)
            while len(self.worker_events) > MAX_OPEN_WORKER_EVENTS:
                _, old = self.worker_events.popitem(last=False)
                gpu_ipc.destroy_event(old)
        else:
            self.worker_events.move_to_end(handle)
        return ev


class GpuTransferExecutor:
    """``TransferExecutor`` for GPU engines. ``chunk_tokens``: the server's chunk size.
    ``mode`` / ``max_ctas`` / ``threads`` / ``max_chunks`` / ``staging_min_chunks``: passed to
    ``CudaKVTransfer`` (``auto``: zero-copy for small batches, pipelined staging for large)."""

    def __init__(self, chunk_tokens: int, *, mode: str = "auto", max_ctas: int = 16, threads: int = 512,
                 max_chunks: int = 32, staging_min_chunks: int = 4) -> None:
        self.chunk_tokens = chunk_tokens
        self.mode = mode
        self.max_ctas = max_ctas
        self.threads = threads
        self.max_chunks = max_chunks
        self.staging_min_chunks = staging_min_chunks
        self._instances: dict[int, _Instance] = {}
        self._pools: dict[int, tuple[SharedMemoryPool, int]] = {}  # id(pool) -> (pool, device address)
        self._cond = threading.Condition(threading.Lock())
        self._pending: deque[_Pending] = deque()
        self._free_events: list[Any] = []
        self._closing = False
        self._poller: threading.Thread | None = None
        self._ordinal = 0
        self._stats = {"started": 0, "finished": 0, "failed": 0, "bytes": 0}

    def warm_up(self, pool: SharedMemoryPool | None = None, ordinal: int = 0) -> None:
        """Do at server start what would otherwise stall the first registration (the server
        loop answers nothing meanwhile, and clients declare it dead after a few seconds): CUDA
        context, kernel JIT for 8-byte lanes, and pinning the L1 segment (seconds for a large
        one)."""
        from kernels.gpu import warm_kernels

        gpu_ipc.ensure_context(ordinal)
        warm_kernels()
        if pool is not None:
            self._pool_device_address(pool)

    # ---- TransferExecutor -------------------------------------------------------------------
    def register_instance(self, instance_id: int, layout: Mapping[str, Any], pool: SharedMemoryPool) -> str | None:
        try:
            self._register(instance_id, layout, pool)
        except Exception as e:
            log.warning("GPU registration of instance %d refused: %s", instance_id, e)
            return f"GPU registration failed: {type(e).__name__}: {e}"[:400]
        return None

    def unregister_instance(self, instance_id: int) -> None:
        inst = self._instances.pop(instance_id, None)
        if inst is None:
            return
        inst.transfer.stream.synchronize()  # releases the GIL; the stream's last copies land
        for ev in inst.worker_events.values():
            gpu_ipc.destroy_event(ev)
        for addr in inst.addresses:
            gpu_ipc.close_memory(addr)

    def start(self, transfer: StartTransfer, event_handle: bytes, done: DoneFn) -> None:
        inst = self._instances.get(transfer.instance_id)
        if inst is None:
            done(transfer.transfer_id, False)
            return
        try:
            rows = plan_rows(transfer, self.chunk_tokens, inst.geometry.block_size, inst.pool_slot_bytes)
        except ValueError as e:
            log.warning("transfer %d: %s", transfer.transfer_id, e)
            done(transfer.transfer_id, False)
            return
        ok = True
        stream = inst.stream_handle
        try:
            if event_handle:
                # the worker's forward pass (store) or its reads of those blocks (retrieve)
                # must be ordered before our copy; waiting is on the device, not here
                gpu_ipc.check(gpu_ipc._driver().cuStreamWaitEvent(stream, inst.worker_event(event_handle), 0), "cuStreamWaitEvent")
            n = rows.block_ids.shape[0]
            for b in range(0, n, self.max_chunks):
                ids = rows.block_ids[b : b + self.max_chunks]
                offs = rows.slot_offsets[b : b + self.max_chunks]
                if transfer.kind is TransferKind.STORE:
                    inst.transfer.gather(ids, offs)
                else:
                    skip = min(max(rows.skip_blocks - b * inst.geometry.blocks_per_chunk, 0), ids.size)
                    inst.transfer.scatter(offs, ids, skip)
        except Exception:
            log.exception("transfer %d could not be enqueued", transfer.transfer_id)
            ok = False  # anything already enqueued still has to land before the slots move on
        with self._cond:
            event = self._free_events.pop() if self._free_events else None
        try:
            if event is None:
                event = gpu_ipc.create_completion_event()
            gpu_ipc.check(gpu_ipc._driver().cuEventRecord(event, stream), "cuEventRecord")
        except Exception:
            # no event to observe: wait for the stream here (rare; releases the GIL) so the
            # slots are not handed on while a copy may still be running
            log.exception("transfer %d: no completion event", transfer.transfer_id)
            inst.transfer.stream.synchronize()
            with self._cond:
                self._stats["failed"] += 1
            done(transfer.transfer_id, False)
            return
        with self._cond:
            self._stats["started"] += 1
            self._stats["bytes"] += int(rows.block_ids.shape[0]) * inst.geometry.slot_bytes
            self._pending.append(_Pending(transfer.transfer_id, event, done, ok))
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._poller is not None:
            self._poller.join()
            self._poller = None
        for iid in list(self._instances):
            self.unregister_instance(iid)
        for pool, _ in self._pools.values():
            gpu_ipc.unregister_host(pool.address)
        self._pools.clear()
        for ev in self._free_events:
            gpu_ipc.destroy_event(ev)
        self._free_events.clear()

    # ---- telemetry -------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counters for metrics: started / finished / failed transfers, bytes, in flight."""
        with self._cond:
            out = dict(self._stats)
            out["in_flight"] = len(self._pending)
        return out

    # ---- internals -------------------------------------------------------------------------
    def _register(self, instance_id: int, layout: Mapping[str, Any], pool: SharedMemoryPool) -> None:
        from numba import cuda

        from kernels.gpu import CudaKVTransfer, raw_stream, span_device_buffers
        from kernels.layouts import KVGeometry, PagedLayout

        tensors = list(layout["tensors"])
        geometry = KVGeometry(
            PagedLayout(layout.get("kv_layout", "nhd")), num_layers=len(tensors), num_blocks=int(layout["num_blocks"]),
            block_size=int(layout["block_size"]), num_heads=int(layout["num_heads"]), head_size=int(layout["head_size"]),
            itemsize=int(layout["itemsize"]), chunk_tokens=self.chunk_tokens,
        )
        if geometry.slot_bytes > pool.slot_bytes:
            raise ValueError(f"a chunk of this cache is {geometry.slot_bytes} B, an L1 slot {pool.slot_bytes} B")
        want_shape = list(geometry.layer_shape())
        want_strides = [int(np.prod(want_shape[i + 1 :])) for i in range(len(want_shape))]
        for i, t in enumerate(tensors):
            if list(t["shape"]) != want_shape or list(t["strides"]) != want_strides or int(t["itemsize"]) != geometry.itemsize:
                raise ValueError(f"layer {i}: shape {t['shape']} strides {t['strides']} is not a contiguous {want_shape}")
        self._ordinal = gpu_ipc.device_ordinal_for_uuid(bytes(layout["device_uuid"]))
        gpu_ipc.ensure_context(self._ordinal)
        if instance_id in self._instances:
            self.unregister_instance(instance_id)  # re-registering replaces
        addresses: list[int] = []
        try:
            for t in tensors:
                addresses.append(gpu_ipc.open_memory(bytes(t["handle"])))
            pointers = [a + int(t["offset"]) for a, t in zip(addresses, tensors)]
            span, offsets = span_device_buffers(pointers, geometry.layer_elements() * geometry.itemsize, geometry.lane_dtype)
            pool_dev = self._pool_device_address(pool)
            lane = geometry.lane_bytes
            pool_lanes = cuda.from_cuda_array_interface(
                {"shape": (pool.size // lane,), "typestr": geometry.lane_dtype.str, "data": (pool_dev, False),
                 "version": 3, "strides": None}, owner=None, sync=False)
            stream = cuda.stream()
            transfer = CudaKVTransfer(geometry, span, offsets, pool_lanes, mode=self.mode, max_ctas=self.max_ctas,
                                      threads=self.threads, stream=stream, max_chunks=self.max_chunks,
                                      staging_min_chunks=self.staging_min_chunks)
        except BaseException:
            for a in addresses:
                gpu_ipc.close_memory(a)
            raise
        self._instances[instance_id] = _Instance(geometry, transfer, addresses, raw_stream(stream), pool.slot_bytes)
        self._start_poller()
        log.info("GPU instance %d: %d layers %s, %s mode, launch path %s", instance_id, geometry.num_layers,
                 geometry.layout.value, self.mode, transfer.launch_path)

    def _pool_device_address(self, pool: SharedMemoryPool) -> int:
        entry = self._pools.get(id(pool))
        if entry is None:
            entry = (pool, gpu_ipc.register_host(pool.address, pool.size))
            self._pools[id(pool)] = entry
        return entry[1]

    def _start_poller(self) -> None:
        if self._poller is None:
            self._poller = threading.Thread(target=self._poll, name="mpcache-gpu-completions", daemon=True)
            self._poller.start()

    def _poll(self) -> None:
        drv = gpu_ipc._driver()
        ready = drv.CUresult.CUDA_SUCCESS
        not_ready = drv.CUresult.CUDA_ERROR_NOT_READY
        gpu_ipc.ensure_context(self._ordinal)
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return  # closing, nothing left in flight
                head = self._pending[0]
            # Block on the device without the GIL (cuda.bindings releases it) and without our lock.
            drv.cuEventSynchronize(head.event)
            with self._cond:
                snapshot = list(self._pending)
            finished: list[tuple[_Pending, bool]] = []
            for p in snapshot:
                (err,) = drv.cuEventQuery(p.event)
                if err == not_ready:
                    continue
                finished.append((p, p.ok and err == ready))
            with self._cond:
                for p, ok in finished:
                    self._pending.remove(p)
                    self._stats["finished" if ok else "failed"] += 1
                    self._free_events.append(p.event)
            for p, ok in finished:
                try:
                    p.done(p.transfer_id, ok)
                except Exception:
                    log.exception("completion callback for transfer %d failed", p.transfer_id)
