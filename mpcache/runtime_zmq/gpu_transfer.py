"""The GPU transfer engine: runs core_sm's ``StartTransfer`` effects for server-driven (GPU)
instances (the ``TransferExecutor`` seam of ``runtime_zmq/transfer.py``).

Per registered instance it holds the worker's per-layer KV tensors, opened once from CUDA IPC
handles (bytes plus shape / dtype / strides / device UUID — no pickle), a dedicated stream and a
``mpcache.kernels.gpu.CudaKVTransfer`` between those tensors and the pinned L1 segment.

A transfer is enqueued, never waited on: ``start`` (the server's loop thread) plans it
(``plan_rows``, core_sm's ``chunk_copies``), checks it, and writes it into the instance's copy
lane, a thread inside one compiled function that holds no GIL (``kernels.gpu.make_copy_lane``):
``cuStreamWaitEvent`` on the worker's interprocess event → gather / scatter → ``cuEventRecord`` of
our completion event, in the order the loop wrote them. Where there is no compiled enqueue, off
x86-64 (the lane and its readers rely on x86's store order), or for a transfer of more chunks
than one call takes, the loop makes those calls itself (after the lane has emptied: only one
thread makes an instance's calls at a time). One waiter thread per instance queries its
completion events in stream order with ``cuEventQuery`` (never a blocking wait), sleeping until
the link model expects the oldest to be done, and only then calls ``done(transfer_id, ok)``. No
Python ever runs in a CUDA host callback, so the host-callback / GIL deadlock of LMCache PR #2733
cannot happen here.

Registration layout (the worker's ``register_instance`` payload; ``export_kv_tensors`` in
``runtime_zmq/gpu_ipc.py`` makes ``tensors``)::

    {"kv_layout": "nhd" | "hnd" | "flashinfer" | "flashinfer_hnd" | "mla",
     "num_blocks": int, "block_size": int, "num_heads": int, "head_size": int, "itemsize": int,
     "device_uuid": bytes (16), "object_bytes": int,
     "tensors": [{"handle": bytes (64), "offset": int, "nbytes": int, "shape": [...],
                  "strides": [...], "dtype": str, "itemsize": int}, ...],  # one per layer
     "event_handles": [bytes (64), ...]}  # optional: interprocess events opened at registration
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import os
import platform
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpcache.core_sm.blocks import chunk_copies
from mpcache.core_sm.effects import StartTransfer
from mpcache.core_sm.messages import TransferKind
from mpcache.runtime_zmq import gpu_ipc
from mpcache.runtime_zmq.l1_pool import SharedMemoryPool
from mpcache.runtime_zmq.transfer import DoneFn

log = logging.getLogger("mpcache.gpu")

MAX_OPEN_WORKER_EVENTS = 256
# An engine may name, in its registration layout (``event_handles``), the interprocess events it
# will send with its requests: they are opened at registration (opening one on the first request
# cost it ~0.6 ms on an H200), not on its first request's critical path.
MAX_REGISTERED_EVENTS = 16
IPC_EVENT_HANDLE_BYTES = 64  # sizeof(CUipcEventHandle)
_POLL_MAX = 64  # events one poll looks at (the first in line decides; the rest ride along)
_POLL_FINE_S = 10e-6  # a waiter's first pause between looks while a copy is due (its first 2 ms late)
_POLL_FINE_MAX_S = 100e-6  # ... doubling up to this
_POLL_AIM_EARLY_S = 2 * _POLL_FINE_S  # the first look, this long before the link model's end
_POLL_FINE_SPAN_S = 0.002  # the fine looks go on this long after the first
_POLL_MID_S = 0.0005  # then a look this often ...
_POLL_MID_SPAN_S = 0.05  # ... until this late, then
_POLL_SLOW_S = 0.005  # this often
_POLL_CALL_MAX_S = 0.1  # one poll call's longest sleep: the waiter then sees its state again
_LANE_LOOK_S = 20e-6  # how soon a waiter looks again for a row its instance's copy lane has not done
_WATCH_LOOK_S = 0.05  # how often the waiter of a watching lane looks at its instance's state ...
_WATCH_IDLE_S = 1.0  # ... and with nothing in flight (a new transfer does not wake it)


def registered_event_handles(layout: Mapping[str, Any]) -> list[bytes]:
    """The layout's optional ``event_handles``: at most ``MAX_REGISTERED_EVENTS`` distinct
    ``IPC_EVENT_HANDLE_BYTES``-byte handles. ``ValueError`` (the registration is refused) otherwise."""
    handles = layout.get("event_handles", ())
    if not isinstance(handles, (list, tuple)):
        raise ValueError(f"event_handles must be a list of handles, not {type(handles).__name__}")
    if len(handles) > MAX_REGISTERED_EVENTS:
        raise ValueError(f"event_handles: {len(handles)} handles, at most {MAX_REGISTERED_EVENTS}")
    out: list[bytes] = []
    for i, h in enumerate(handles):
        if type(h) is not bytes or len(h) != IPC_EVENT_HANDLE_BYTES:
            raise ValueError(f"event_handles[{i}]: an interprocess event handle is {IPC_EVENT_HANDLE_BYTES} bytes")
        if h not in out:
            out.append(h)
    return out


@dataclass(frozen=True)
class TransferRows:
    """One transfer as kernel calls: ``block_ids[i]`` ↔ the slot at byte ``slot_offsets[i]``;
    ``skip_blocks`` leading blocks of the flattened list are not written (retrieve only)."""

    block_ids: np.ndarray  # [n_chunks, blocks_per_chunk] int64
    slot_offsets: np.ndarray  # [n_chunks] int64, bytes into the pool
    skip_blocks: int


def plan_rows(st: StartTransfer, chunk_tokens: int, block_size: int, slot_bytes: int) -> TransferRows:
    """Map a ``StartTransfer`` to kernel rows (``mpcache.core_sm.blocks.chunk_copies`` decides which
    chunks and blocks). Only the first row can be partly skipped, so one ``skip_blocks`` for the
    flattened list says it all. Raises ``ValueError`` on inconsistent input."""
    copies = chunk_copies(st.kind, st.start, st.end, st.placements, st.block_ids, st.skip_first_n_tokens,
                          chunk_tokens, block_size)
    bpc = chunk_tokens // block_size
    table = np.asarray([c.block_ids for c in copies], dtype=np.int64).reshape(len(copies), bpc)
    offsets = np.asarray([c.slot * slot_bytes for c in copies], dtype=np.int64)
    return TransferRows(table, offsets, copies[0].skip_blocks if copies else 0)


def check_layer_ranges(layers: Sequence[tuple[int, int, int, int]], layer_bytes: int) -> None:
    """Refuse a registration whose tensors do not lie inside their allocations or overlap.

    ``layers``: per layer ``(allocation base, allocation size, offset, nbytes)`` as this process
    sees them (base and size from ``cuMemGetAddressRange`` on the opened IPC handle, offset and
    nbytes as the engine declared them). Every layer must be exactly ``layer_bytes`` long, start
    at a non-negative offset and end inside its allocation, and no two layers may share a byte
    (the kernels would then write one layer's blocks over another's). Raises ``ValueError``."""
    spans: list[tuple[int, int, int]] = []
    for i, (base, size, offset, nbytes) in enumerate(layers):
        if nbytes != layer_bytes:
            raise ValueError(f"layer {i}: declares {nbytes} B, its shape needs {layer_bytes} B")
        if offset < 0 or offset + nbytes > size:
            raise ValueError(f"layer {i}: bytes [{offset}, {offset + nbytes}) lie outside its {size}-byte allocation")
        spans.append((base + offset, base + offset + nbytes, i))
    spans.sort()
    for (a0, a1, i), (b0, b1, j) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ValueError(f"layers {i} and {j} overlap in device memory")


class LinkModel:
    """When one direction's copies end: a copy with the link to itself takes ``lat + n / rate``;
    one queued behind others ends ``n / rate`` after the one ahead of it. The rate is learned
    from queued copies seen to end back to back (the time between two ends is the later one's
    bytes), the latency from lone copies; each a running mean of the last ~5 (the first sample
    taken whole). A sample over 3x what the model says (+ 1 ms) is not taught: an engine whose
    event fired late makes a copy look slow, not the link. ``rate`` stays within [1/4, 2] x the
    configured rate, ``lat`` within [0, 10 ms]. ``sooner``: a copy was found done already at
    the first look, so the model says too late by an unknown amount: 5% less (of the latency
    for a lone copy while it has any, else of the time per byte)."""

    ALPHA = 0.2
    SOONER = 0.95

    def __init__(self, rate: float, lat: float = 0.0) -> None:
        self.configured = rate
        self.rate = rate
        self.lat = lat
        self._n_rate = self._n_lat = 0

    def duration(self, nbytes: int) -> float:
        return self.lat + nbytes / self.rate

    def learn_alone(self, nbytes: int, seconds: float) -> None:
        if seconds > 3.0 * self.duration(nbytes) + 0.001:
            return
        self._n_lat += 1
        a = max(self.ALPHA, 1.0 / self._n_lat)
        self.lat = min(max((1 - a) * self.lat + a * (seconds - nbytes / self.rate), 0.0), 0.01)

    def learn_queued(self, nbytes: int, seconds: float) -> None:
        if seconds <= 0.0 or seconds > 3.0 * nbytes / self.rate + 0.001:
            return
        self._n_rate += 1
        a = max(self.ALPHA, 1.0 / self._n_rate)
        per_byte = (1 - a) / self.rate + a * seconds / nbytes
        self._set_rate(1.0 / per_byte)

    def sooner(self, alone: bool) -> None:
        if alone and self.lat > 1e-6:
            self.lat *= self.SOONER
        else:
            self._set_rate(self.rate / self.SOONER)

    def _set_rate(self, rate: float) -> None:
        self.rate = min(max(rate, 0.25 * self.configured), 2.0 * self.configured)


@dataclass(eq=False)  # one transfer is one object: the lines find and remove it by identity
class _Pending:
    transfer_id: int
    done: DoneFn
    ok: bool
    nbytes: int
    entries: list[int]  # descriptor ring entries its kernels read (CudaKVTransfer.neutralize)
    pool_dma: bool  # a staging STORE: DMAs into L1 slots that neutralize cannot cancel
    expected_done: float  # monotonic time the link model expects it done (when to poll)
    event: Any = None  # our completion event, recorded after its copies
    deadline: float = 0.0  # set when it becomes first in its instance's line
    enqueued_ns: int = 0  # perf_counter_ns when start() returned: the flight time's start
    kind: TransferKind = TransferKind.STORE
    started: float = 0.0  # monotonic time it was enqueued
    alone: bool = False  # started with nothing ahead of it on the link (its flight says the link's latency)
    starts: int = 0  # its direction's start count after its own start (none after it: alone throughout)
    lane_seq: int = -1  # its row in the instance's copy lane (-1: the loop enqueued it); the
    # waiter looks at its event only once the lane has done that row (``absorbed``)
    absorbed: bool = True
    enqueued_mono_ns: int = 0  # time.monotonic_ns() at the same point (a watching lane's clock)


# os.eventfd_write releases the GIL around its write(2), and a thread waiting for the GIL (a
# waiter, an L2 worker) then runs in the middle of the loop's start of a transfer: the loop waits
# for it to give the GIL back. Through ctypes.PyDLL the call keeps the GIL. Adding 1 to an eventfd
# never blocks (only an overflow of its 64-bit count would; the lane reads it back to 0).
_LIBC_GIL_HELD = ctypes.PyDLL(None, use_errno=True)
_write_holding_gil = _LIBC_GIL_HELD["write"]
_write_holding_gil.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
_write_holding_gil.restype = ctypes.c_ssize_t
_EVENTFD_ONE = ctypes.c_uint64(1)


def eventfd_add_one(fd: int) -> None:
    """``os.eventfd_write(fd, 1)`` without letting go of the GIL. Raises OSError."""
    if _write_holding_gil(fd, ctypes.byref(_EVENTFD_ONE), 8) != 8:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


class _CopyLane:
    """One instance's copy lane (``kernels.gpu.make_copy_lane``): its rows, control words and
    eventfd, and the thread that runs it. The loop writes rows (``write``); the waiter reads
    what the lane did (``take``)."""

    def __init__(self, instance_id: int, state: dict[str, Any], rows: int, ordinal: int, geometry: Any,
                 wake_fd: int = -1) -> None:
        from mpcache.kernels import gpu as kg

        self.kg = kg
        self.geometry = geometry
        self._check = (int(geometry.num_blocks), int(geometry.lane_bytes), int(geometry.slot_bytes // geometry.lane_bytes))
        self.state = state
        self.cfg = state["cfg"]
        self.max_chunks = int(self.cfg[kg.G_MAX_CHUNKS])
        self.bpc = int(self.cfg[kg.G_BPC])
        self.pool_lanes = int(state["pool_lanes"])
        self.rows = np.zeros((rows, kg.lane_row_width(self.max_chunks, self.bpc, int(self.cfg[kg.G_USED]))), dtype=np.int64)
        self.bases_at = kg.H_IDS + self.max_chunks * self.bpc
        self.used_at = self.rows.shape[1] - int(self.cfg[kg.G_USED])
        self.ctl = np.zeros(kg.C_COUNT, dtype=np.int64)
        # wake_fd >= 0: the lane also sees its rows' copies end and wakes the loop (collect)
        self.watch = np.zeros(kg.WATCH_COUNT, dtype=np.int64)
        self.watch[kg.WATCH_WAKE_FD] = wake_fd
        for i, seconds in ((kg.WATCH_AIM_EARLY, _POLL_AIM_EARLY_S), (kg.WATCH_FINE, _POLL_FINE_S), (kg.WATCH_FINE_MAX, _POLL_FINE_MAX_S),
                           (kg.WATCH_FINE_SPAN, _POLL_FINE_SPAN_S), (kg.WATCH_MID, _POLL_MID_S),
                           (kg.WATCH_MID_SPAN, _POLL_MID_SPAN_S), (kg.WATCH_SLOW, _POLL_SLOW_S)):
            self.watch[i] = round(seconds * 1e9)
        self.ctl[kg.C_WATCH] = 1 if wake_fd >= 0 else 0
        self.ctl[kg.C_WATCH_OFF] = 0 if wake_fd >= 0 else 1
        self.collected = 0  # rows whose completion has been handed on (GpuTransferExecutor._collect)
        self.written = 0
        self.efd = os.eventfd(0)
        self._fn = kg.fast_copy_lane()
        self._fill = kg.fill_lane_row
        self._ordinal = ordinal
        self.thread = threading.Thread(target=self._run, name=f"mpcache-gpu-lane-{instance_id}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        gpu_ipc.ensure_context(self._ordinal)
        if self.watching():
            self.kg.fine_timer_slack()  # its 10 us pauses between looks are 10 us, not 60
        s = self.state
        self._fn(self.ctl, self.rows, self.efd, np.zeros(4, np.int64), np.zeros(2, np.int64), s["st"], s["ring"],
                 s["rel"], s["desc"], s["runs"], s["used"], s["pieces"], s["npieces"], s["one_piece"], s["cfg"],
                 self.watch)

    def write(self, store: bool, ids: np.ndarray, offsets: np.ndarray, skip: int, staging: bool, worker_event: int,
              completion_event: int, due_ns: int = 0) -> int:
        """Check one call and hand it to the lane (``ids`` and ``offsets`` as ``kernels.cpu.check_shapes``
        gives them; ``staging``: through the device staging buffer, as ``CudaKVTransfer.uses_staging``
        decided; ``due_ns``: when the link model expects its copy done, monotonic ns); its row
        number. Raises ValueError on a bad block id or slot offset, nothing handed."""
        seq = self.written
        row = self.rows[seq % self.rows.shape[0]]
        num_blocks, lane_bytes, slot_lanes = self._check
        err = self._fill(row, ids, offsets, not store, skip, staging, worker_event, completion_event, time.monotonic_ns(),
                         num_blocks, lane_bytes, slot_lanes, self.pool_lanes, self.bases_at)
        if err:
            from mpcache.kernels.cpu import call_error

            raise call_error(self.geometry, err)
        row[self.kg.H_T_DUE] = due_ns
        return self._hand_over(seq)

    def watch_row(self, completion_event: int, due_ns: int) -> int:
        """A row for a transfer the loop enqueued itself (its completion event recorded; 0: none):
        the lane makes no calls for it, only watches its event in turn. Its row number."""
        kg = self.kg
        seq = self.written
        row = self.rows[seq % self.rows.shape[0]]
        row[kg.H_KIND], row[kg.H_N], row[kg.H_CEV] = kg.K_WATCH, 0, completion_event
        row[kg.H_T_HAND], row[kg.H_T_DUE] = time.monotonic_ns(), due_ns
        return self._hand_over(seq)

    def _hand_over(self, seq: int) -> int:
        self.written = seq + 1
        self.ctl[self.kg.C_WRITTEN] = seq + 1  # after the row: the lane reads the count, then the row
        eventfd_add_one(self.efd)
        return seq

    def done_through(self) -> int:
        """Rows the lane has done (each one's outcome written)."""
        return int(self.ctl[self.kg.C_DONE])

    def seen_through(self) -> int:
        """Rows the watching lane has seen complete (each one's ``seen`` written)."""
        return int(self.ctl[self.kg.C_SEEN])

    def watching(self) -> bool:
        return bool(self.ctl[self.kg.C_WATCH])

    def stop_watching(self) -> None:
        """The lane is to look at no more events. It may still be in the middle of one look (and
        then see one more row end: ``seen_through`` may move once more); it answers
        ``ctl[C_WATCH_OFF]`` when it next comes round, which may be after the row it is enqueuing.
        Whoever takes a transfer off the line under the executor's lock reports it."""
        kg = self.kg
        if self.ctl[kg.C_WATCH] != 0:
            self.ctl[kg.C_WATCH_OFF] = 0
            self.ctl[kg.C_WATCH] = 0  # after the answer's reset: the lane answers only once it sees this
            eventfd_add_one(self.efd)

    def take(self, seq: int) -> tuple[bool, bool, list[int], int, int]:
        """A done row: (enqueued without error, its completion event recorded, the descriptor
        entries its kernels read, ns from the hand-over to the lane taking it, ns the lane spent)."""
        kg = self.kg
        row = self.rows[seq % self.rows.shape[0]]
        head = row[: kg.H_IDS].tolist()  # one read of the outcome's words, as Python ints
        used = row[self.used_at : self.used_at + head[kg.H_NUSED]].tolist() if head[kg.H_NUSED] else []
        return (self.enqueued(head), bool(head[kg.H_RECORDED]), used, head[kg.H_T_PICK] - head[kg.H_T_HAND],
                head[kg.H_T_DONE] - head[kg.H_T_PICK])

    def head(self, seq: int) -> list[int]:
        """A row's header words (``H_*``), read once, as Python ints."""
        return self.rows[seq % self.rows.shape[0], : self.kg.H_IDS].tolist()  # type: ignore[no-any-return]

    def enqueued(self, head: list[int]) -> bool:
        """Whether the lane enqueued the row's calls without error (an error is logged)."""
        kg = self.kg
        err = head[kg.H_ERR]
        if err not in (0, kg.LANE_SKIPPED):
            where = {kg.W_LAUNCH: "cuLaunchKernel", kg.W_RECORD: "cuEventRecord", kg.W_WAIT: "cuStreamWaitEvent",
                     kg.W_COPY: "staging DMA"}.get(head[kg.H_WHERE], "driver call")
            if err == kg.ERR_RING_FULL:
                log.warning("copy lane: descriptor ring full, a transfer was not enqueued")
            else:
                log.error("copy lane: %s failed: CUDA error %d", where, err - 1000)
        return bool(err == 0)

    def idle(self, timeout: float) -> bool:
        """Wait (briefly: the lane takes microseconds a row) until the lane has done every row."""
        end = time.monotonic() + timeout
        while self.done_through() < self.written:
            if time.monotonic() >= end:
                return False
            time.sleep(20e-6)
        return True

    def fail(self) -> None:
        """Rows the lane has not taken yet are skipped (nothing enqueued for them)."""
        self.ctl[self.kg.C_FAILED] = 1

    def stop(self) -> None:
        self.ctl[self.kg.C_STOP] = 1
        os.eventfd_write(self.efd, 1)
        self.thread.join(5.0)
        if not self.thread.is_alive():
            os.close(self.efd)


class _Opened:
    """CUDA IPC memory handles opened in this process, by handle bytes: one open per
    allocation however many layers or instances use it, closed when the last one goes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_handle: dict[bytes, list[int]] = {}  # handle -> [address, users]

    def open(self, handle: bytes) -> int:
        with self._lock:
            entry = self._by_handle.get(handle)
            if entry is None:
                entry = self._by_handle[handle] = [gpu_ipc.open_memory(handle), 0]
            entry[1] += 1
            return entry[0]

    def close(self, handle: bytes) -> None:
        with self._lock:
            entry = self._by_handle.get(handle)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._by_handle[handle]
        try:
            gpu_ipc.close_memory(entry[0])
        except Exception:
            log.exception("cuIpcCloseMemHandle failed")


class _Instance:
    """One registered engine: its tensors, stream, transfers in flight (in stream order) and
    the one waiter thread that observes them."""

    def __init__(self, instance_id: int, geometry: Any, transfer: Any, handles: list[bytes], stream_handle: Any,
                 pool_slot_bytes: int, lock: threading.Lock) -> None:
        self.instance_id = instance_id
        self.geometry = geometry
        self.transfer = transfer
        self.pool_slot_bytes = pool_slot_bytes
        self.handles = handles
        self.stream_handle = stream_handle
        self.worker_events: OrderedDict[bytes, Any] = OrderedDict()
        self.pending: deque[_Pending] = deque()
        self.cond = threading.Condition(lock)
        self.state = "live"  # live -> closing (unregistered) | failed (an event never fired)
        self.links: dict[TransferKind, LinkModel] = {}  # when its copies end (set by the executor)
        self.busy_until = {TransferKind.STORE: 0.0, TransferKind.RETRIEVE: 0.0}  # its line's last expected end
        self.last_end = {TransferKind.STORE: 0.0, TransferKind.RETRIEVE: 0.0}  # its waiter last saw one end
        self.waiter: threading.Thread | None = None
        self.lane: _CopyLane | None = None  # None: the loop makes this instance's driver calls

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
    ``mode`` / ``max_ctas`` / ``threads`` / ``max_chunks`` / ``staging_min_chunks`` /
    ``pipeline_pieces``: passed to ``CudaKVTransfer`` (``auto``: zero-copy for small batches,
    pipelined staging for large). ``transfer_timeout_s``: how long a transfer may stay first in
    its instance's line before the instance is failed (its engine's event never fired).
    ``link_gbps``: the copy rate the waiters assume to know when to look (not a limit).
    ``copy_lanes``: each instance's driver calls made by its copy lane (where the compiled enqueue
    runs); False: by the loop thread, as a before / after. ``lane_completions``: with copy lanes,
    each lane also sees its transfers' copies end and wakes the loop, which reports them
    (``collect_completions``), with no Python thread between; the waiter thread then only keeps
    the deadline and takes over for what the lane cannot see (a failure, an event never
    recorded, closing). Needs the loop's wake-up descriptor (``wake_loop_with``)."""

    def __init__(self, chunk_tokens: int, *, mode: str = "auto", max_ctas: int = 16, threads: int = 512,
                 max_chunks: int = 32, staging_min_chunks: int = 4, pipeline_pieces: int = 8,
                 transfer_timeout_s: float = 30.0, link_gbps: float = 60.0, max_in_flight: int = 128,
                 warm_events: int = 256, copy_lanes: bool = True, lane_completions: bool = False) -> None:
        # a lane's rows and counts are plain stores read by another thread in the order written:
        # x86's memory order gives that; elsewhere the loop makes the calls
        self.copy_lanes = copy_lanes and platform.machine() in ("x86_64", "AMD64")
        self.lane_completions = lane_completions and self.copy_lanes
        self._wake_fd = -1  # the loop's wake-up (wake_loop_with): a watching lane writes a byte to it
        self.chunk_tokens = chunk_tokens
        self.mode = mode
        self.max_ctas = max_ctas
        self.threads = threads
        self.max_chunks = max_chunks
        self.staging_min_chunks = staging_min_chunks
        self.pipeline_pieces = pipeline_pieces
        self.transfer_timeout_s = transfer_timeout_s
        self.link_bytes_per_s = link_gbps * 1e9
        # when the waiters expect a copy to end, per direction, learned from the copies they see end
        # (per instance: each one's LinkModel, in _Instance.links)
        self._starts = {TransferKind.STORE: 0, TransferKind.RETRIEVE: 0}  # copies started, per direction
        # how a waiter observes its events: cuda-bindings queries from Python until warm_up
        # finds the compiled poller (kernels.gpu.make_event_poller), which runs without the GIL
        self._poll: Callable[[list[Any], float, float, float, float], tuple[list[bool], int]] = self._python_poll
        self.poll_path = "python"
        self.max_in_flight = max_in_flight
        self.warm_events = warm_events
        self._instances: dict[int, _Instance] = {}
        self._draining: list[_Instance] = []  # unregistered or failed, copies still queued
        self._pools: dict[int, tuple[SharedMemoryPool, int]] = {}  # id(pool) -> (pool, device address)
        self._opened = _Opened()
        self._lock = threading.Lock()
        self._free_events: list[Any] = []
        self._link_busy_until = {TransferKind.STORE: 0.0, TransferKind.RETRIEVE: 0.0}
        self._closing = False
        self._ordinal = 0
        self.on_instance_failed: Callable[[int, str], None] | None = None  # set by the server
        self._stats = {"started": 0, "finished": 0, "failed": 0, "bytes": 0, "instances_failed": 0,
                       "events_created": 0, "start_ns": 0, "plan_ns": 0, "enqueue_ns": 0, "wait_ns": 0, "polls": 0, "flight_ns": 0,
                       "handoff_ns": 0, "lane_ns": 0, "lane_looks": 0}

    def warm_up(self, pool: SharedMemoryPool | None = None, ordinal: int = 0) -> None:
        """Do at server start what would otherwise stall the first registration or the first
        requests (the server loop answers nothing meanwhile): CUDA context, kernel JIT for
        8-byte lanes, pinning the L1 segment (seconds for a large one), and a pool of
        completion events, each recorded once."""
        from mpcache.kernels.gpu import warm_kernels

        gpu_ipc.ensure_context(ordinal)
        self._ordinal = ordinal
        warm_kernels()
        if self.copy_lanes:
            from mpcache.kernels.gpu import fast_copy_lane, warm_copy_lane

            warm_copy_lane(fast_copy_lane())  # compiled now, not on the first registration
        self._use_compiled_poller()
        if pool is not None:
            self._pool_device_address(pool)
        self._add_events(self.warm_events)

    # ---- TransferExecutor -------------------------------------------------------------------
    def register_instance(self, instance_id: int, layout: Mapping[str, Any], pool: SharedMemoryPool) -> str | None:
        try:
            self._register(instance_id, layout, pool)
        except Exception as e:
            log.warning("GPU registration of instance %d refused: %s", instance_id, e)
            return f"GPU registration failed: {type(e).__name__}: {e}"[:400]
        return None

    def unregister_instance(self, instance_id: int) -> None:
        """Stop taking transfers for the instance. Never waits: what is queued still lands, is
        reported by the instance's waiter, and only then are its handles closed."""
        with self._lock:
            inst = self._instances.pop(instance_id, None)
            if inst is None:
                return
            inst.state = "closing"
            idle = not inst.pending
            if not idle:
                self._draining.append(inst)
            inst.cond.notify()
        if idle and inst.waiter is None:
            self._release(inst)

    def start(self, transfer: StartTransfer, event_handle: bytes, done: DoneFn) -> None:
        t0 = time.perf_counter_ns()
        inst = self._instances.get(transfer.instance_id)
        if inst is None:
            done(transfer.transfer_id, False)
            return
        if len(inst.pending) >= self.max_in_flight:
            log.warning("transfer %d: instance %d has %d transfers in flight already", transfer.transfer_id,
                        transfer.instance_id, len(inst.pending))
            done(transfer.transfer_id, False)
            return
        try:
            rows = plan_rows(transfer, self.chunk_tokens, inst.geometry.block_size, inst.pool_slot_bytes)
        except ValueError as e:
            log.warning("transfer %d: %s", transfer.transfer_id, e)
            done(transfer.transfer_id, False)
            return
        lane = inst.lane
        if lane is not None:
            if rows.block_ids.shape[0] <= lane.max_chunks:
                self._hand_to_lane(inst, lane, transfer, rows, event_handle, done, t0)
                return
            if not lane.idle(1.0):  # one thread makes the instance's calls at a time
                log.warning("transfer %d: the copy lane of instance %d is still busy", transfer.transfer_id,
                            transfer.instance_id)
                done(transfer.transfer_id, False)
                return
        t1 = time.perf_counter_ns()
        ok = True
        t_wait = t1
        entries: list[int] = []
        store = transfer.kind is TransferKind.STORE
        n = rows.block_ids.shape[0]
        pool_dma = False
        now = time.monotonic()
        # earlier copies still queued, this engine's or another's in the same direction (the
        # link model says so): overlap them (staging) rather than compete for the link
        busy = bool(inst.pending) or self._link_busy_until[transfer.kind] > now
        alone = not busy  # nothing ahead of it on the link: its flight says the link's latency
        self._starts[transfer.kind] += 1
        try:
            if event_handle:
                # the worker's forward pass (store) or its reads of those blocks (retrieve)
                # must be ordered before our copy; waiting is on the device, not here
                inst.transfer.wait_event(inst.worker_event(event_handle))
            t_wait = time.perf_counter_ns()
            for b in range(0, n, self.max_chunks):
                ids = rows.block_ids[b : b + self.max_chunks]
                offs = rows.slot_offsets[b : b + self.max_chunks]
                if store:
                    pool_dma |= inst.transfer.uses_staging(ids.shape[0], busy)
                    entries += inst.transfer.gather(ids, offs, join=False, busy=busy)
                else:
                    skip = min(max(rows.skip_blocks - b * inst.geometry.blocks_per_chunk, 0), ids.size)
                    entries += inst.transfer.scatter(offs, ids, skip, join=False, busy=busy)
        except Exception:
            log.exception("transfer %d could not be enqueued", transfer.transfer_id)
            ok = False  # anything already enqueued still has to land before the slots move on
        t2 = time.perf_counter_ns()
        nbytes = n * inst.geometry.slot_bytes
        p = _Pending(transfer.transfer_id, done, ok, nbytes, entries, pool_dma, self._expected_end(inst, transfer.kind, nbytes, now),
                     kind=transfer.kind, started=now, alone=alone, starts=self._starts[transfer.kind])
        with self._lock:
            p.event = self._free_events.pop() if self._free_events else None
        try:
            if p.event is None:
                p.event = self._new_event()
            # after every copy of this transfer (its DMAs may still run on the copy stream)
            inst.transfer.record_completion(p.event)
        except Exception:
            # the waiter records one later (a later record covers this transfer's copies too)
            log.exception("transfer %d: no completion event yet", transfer.transfer_id)
            p.event = None
        if lane is not None and lane.watching():  # the lane watches its event in turn, with its own rows'
            from mpcache.kernels.gpu import as_handle

            p.lane_seq = lane.watch_row(as_handle(p.event) if p.event is not None else 0, int(p.expected_done * 1e9))
            p.absorbed = False
        self._line_up(inst, p, now, t0, t1, t_wait, t2)

    def _expected_end(self, inst: _Instance, kind: TransferKind, nbytes: int, now: float) -> float:
        """When a copy of ``nbytes`` started now should end, by the instance's own line: alone,
        its latency then its bytes; queued, its bytes after the copy ahead of it (at the rate this
        instance's copies move at, which another engine's copies on the same link lower)."""
        self._link_busy_until[kind] = max(self._link_busy_until[kind], now) + nbytes / self.link_bytes_per_s
        link = inst.links[kind]
        expected = max(inst.busy_until[kind], now + link.lat) + nbytes / link.rate
        inst.busy_until[kind] = expected
        return expected

    def _line_up(self, inst: _Instance, p: _Pending, now: float, t0: int, t1: int, t_wait: int, t2: int) -> None:
        """Put a started transfer at the end of its instance's line (the waiter's), counting the
        host time its start took: planned at ``t1``, its event found at ``t_wait``, handed to the
        device (or the lane) at ``t2``."""
        with self._lock:
            self._stats["started"] += 1
            self._stats["bytes"] += p.nbytes
            p.enqueued_ns = time.perf_counter_ns()
            p.enqueued_mono_ns = time.monotonic_ns()
            self._stats["start_ns"] += p.enqueued_ns - t0
            self._stats["plan_ns"] += t1 - t0
            self._stats["enqueue_ns"] += t2 - t1
            self._stats["wait_ns"] += t_wait - t1
            if not inst.pending:
                p.deadline = now + self.transfer_timeout_s
                if inst.lane is None or not inst.lane.watching():  # (a watching lane's waiter looks every 50 ms)
                    inst.cond.notify()
            inst.pending.append(p)

    def _hand_to_lane(self, inst: _Instance, lane: _CopyLane, transfer: StartTransfer, rows: TransferRows,
                      event_handle: bytes, done: DoneFn, t0: int) -> None:
        """``start`` for an instance with a copy lane: check the call, then write it into the lane
        (the lane makes its driver calls); the waiter looks at its event once the lane is done."""
        from mpcache.kernels.cpu import check_shapes
        from mpcache.kernels.gpu import as_handle

        t1 = time.perf_counter_ns()
        store = transfer.kind is TransferKind.STORE
        skip = 0 if store else rows.skip_blocks
        try:
            ids, offsets = check_shapes(inst.geometry, rows.block_ids, rows.slot_offsets, skip)
            worker = as_handle(inst.worker_event(event_handle)) if event_handle else 0
        except Exception as e:
            log.warning("transfer %d: %s", transfer.transfer_id, e)
            done(transfer.transfer_id, False)
            return
        n = offsets.shape[0]
        now = time.monotonic()
        busy = bool(inst.pending) or self._link_busy_until[transfer.kind] > now
        with self._lock:
            event = self._free_events.pop() if self._free_events else None
        if event is None:
            event = self._new_event()
        t_wait = time.perf_counter_ns()
        # decided once, here: the lane takes it as written, and a staging STORE's DMAs into L1 are
        # what keeps it held past a failure (pool_dma)
        staging = inst.transfer.uses_staging(n, busy)
        nbytes = n * inst.geometry.slot_bytes
        kind = transfer.kind
        before = (self._link_busy_until[kind], inst.busy_until[kind])
        expected = self._expected_end(inst, kind, nbytes, now)  # the row carries it (a watching lane's first look)
        try:  # the ids and offsets are checked as the row is written (one compiled call)
            seq = lane.write(store, ids, offsets, skip, staging, worker, as_handle(event), int(expected * 1e9))
        except ValueError as e:
            self._link_busy_until[kind], inst.busy_until[kind] = before  # nothing went on the link
            with self._lock:
                self._free_events.append(event)
            log.warning("transfer %d: %s", transfer.transfer_id, e)
            done(transfer.transfer_id, False)
            return
        self._starts[kind] += 1
        t2 = time.perf_counter_ns()
        p = _Pending(transfer.transfer_id, done, True, nbytes, [], store and staging, expected, event=event, kind=kind,
                     started=now, alone=not busy, starts=self._starts[kind], lane_seq=seq, absorbed=False)
        self._line_up(inst, p, now, t0, t1, t_wait, t2)

    def wake_loop_with(self, fd: int) -> None:
        """The loop's wake-up descriptor (a pipe's write end): a watching lane writes a byte to it
        when it sees a copy end; the loop then calls ``collect_completions``. For instances
        registered from now on."""
        self._wake_fd = fd

    def collect_completions(self) -> None:
        """Report the transfers the instances' lanes have seen complete (the loop calls it when
        woken, before it reads its completion queue)."""
        with self._lock:  # (a waiter may fail or release an instance meanwhile)
            everyone = [*self._instances.values(), *self._draining]
        for inst in everyone:
            lane = inst.lane
            if lane is not None and lane.collected < lane.seen_through():
                self._collect(inst)

    def _collect(self, inst: _Instance) -> None:
        """Report the leading transfers the instance's lane has seen complete (the loop, or the
        waiter when it takes over or the loop has stopped): each one exactly once, its link
        model taught, the next one's deadline set."""
        lane = inst.lane
        assert lane is not None
        seen = lane.seen_through()
        finished: list[_Pending] = []
        with self._lock:  # taken off the line here, so the loop and the waiter never both report one
            while inst.pending and 0 <= inst.pending[0].lane_seq < seen:
                finished.append(inst.pending.popleft())
            lane.collected = max(lane.collected, seen)
            if not finished:
                return
            if not inst.pending and inst.state != "live":
                inst.cond.notify()  # the waiter releases the instance
        kg = lane.kg
        t_seen = handoff_ns = lane_ns = looks = 0
        out = []
        for p in finished:
            # what the lane did and saw: its event was recorded (the lane watches no other), and
            # it has ended, so nothing of its copies is left to neutralize
            h = lane.head(p.lane_seq)
            ok = p.ok and h[kg.H_Q] == 0
            if not p.absorbed:
                ok = lane.enqueued(h) and ok
                handoff_ns += h[kg.H_T_PICK] - h[kg.H_T_HAND]
                lane_ns += h[kg.H_T_DONE] - h[kg.H_T_PICK]
                p.absorbed = True
            t_seen = h[kg.H_T_SEEN]
            seen_at = t_seen / 1e9
            polls = h[kg.H_POLLS]
            looks += polls
            self._learn(inst, p, seen_at, exact=polls > 1 and h[kg.H_PAUSE] <= 0.1 * (seen_at - p.started) * 1e9,
                        early=polls == 1 and h[kg.H_AIMED] != 0)
            out.append((p, ok, t_seen - p.enqueued_mono_ns))
        self._finished(inst, out, t_seen / 1e9, handoff_ns, lane_ns, looks)

    def _absorb(self, inst: _Instance, pending: Sequence[_Pending]) -> int:
        """Take what the lane did for the leading transfers it has done; how many lead (the
        waiter looks only at their events: one the lane has not recorded yet would read done)."""
        lane = inst.lane
        k = 0
        for p in pending:
            if not p.absorbed:
                if lane is None or lane.done_through() <= p.lane_seq:
                    break
                ok, recorded, used, handoff_ns, lane_ns = lane.take(p.lane_seq)
                if used:  # (a transfer the loop enqueued, watched by the lane, keeps its own)
                    p.entries = used
                if inst.state == "failed":  # failed before the waiter saw the lane's work
                    inst.transfer.neutralize(used)
                    ok = False
                p.ok = p.ok and ok
                if not recorded and p.event is not None:  # a later event covers its copies (the waiter records one)
                    with self._lock:
                        self._free_events.append(p.event)
                    p.event = None
                with self._lock:
                    self._stats["handoff_ns"] += handoff_ns
                    self._stats["lane_ns"] += lane_ns
                p.absorbed = True
            k += 1
        return k

    def close(self) -> None:
        """Stop the waiters after what is queued has landed (up to the transfer timeout for an
        instance whose engine's event never fires, which is then left behind), then release."""
        with self._lock:
            self._closing = True
            everyone = list(self._instances.values()) + self._draining
            self._instances.clear()
            for inst in everyone:
                if inst.state == "live":
                    inst.state = "closing"
                inst.cond.notify()
        for inst in everyone:  # the loop's wake-up is closed after this: no lane may write it then
            if inst.lane is not None:
                inst.lane.watch[inst.lane.kg.WATCH_WAKE_FD] = -1
        queued = 0  # instances whose copies are still queued (an engine's event that never fired)
        for inst in everyone:
            if inst.waiter is not None:
                # a failed instance's copies may never end: do not wait for them
                inst.waiter.join(0.5 if inst.state == "failed" else self.transfer_timeout_s + 5.0)
                if inst.waiter.is_alive():
                    log.error("GPU instance %d: copies still queued at close; its handles stay open", inst.instance_id)
                    queued += 1
                    continue
            elif not inst.pending:
                self._release(inst)
        if queued:
            # cuMemHostUnregister waits for the copies queued on L1 (behind an event that may never
            # fire): the process would hang in close. Its exit unpins the segment instead.
            log.error("L1 stays pinned: %d GPU instance(s) still have copies queued", queued)
            self._pools.clear()
        for pool, _ in self._pools.values():
            try:
                gpu_ipc.unregister_host(pool.address)
            except Exception:
                log.exception("cuMemHostUnregister failed")
        self._pools.clear()
        for ev in self._free_events:
            gpu_ipc.destroy_event(ev)
        self._free_events.clear()

    # ---- telemetry -------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counters for metrics: started / finished / failed transfers, bytes, in flight,
        instances failed, completion events created after warm-up, host ns spent in start."""
        with self._lock:
            out = dict(self._stats)
            out["in_flight"] = sum(len(i.pending) for i in (*self._instances.values(), *self._draining))
            out["instances"] = len(self._instances)
            out["memcpy_batch"] = int(any(i.transfer.memcpy_path == "batch" for i in self._instances.values()))
            live = list(self._instances.values())
            for kind in TransferKind:  # the mean over the live instances' models
                out[f"link_mbps_{kind.value}"] = int(sum(i.links[kind].rate for i in live) / len(live) / 1e6) if live else 0
                out[f"link_lat_us_{kind.value}"] = int(sum(i.links[kind].lat for i in live) / len(live) * 1e6) if live else 0
            out["poll_compiled"] = int(self.poll_path == "compiled")
        return out

    # ---- internals -------------------------------------------------------------------------
    def _register(self, instance_id: int, layout: Mapping[str, Any], pool: SharedMemoryPool) -> None:
        from numba import cuda

        from mpcache.kernels.gpu import CudaKVTransfer, raw_stream, span_device_buffers
        from mpcache.kernels.layouts import KVGeometry, PagedLayout

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
        event_handles = registered_event_handles(layout)
        self._ordinal = gpu_ipc.device_ordinal_for_uuid(bytes(layout["device_uuid"]))
        gpu_ipc.ensure_context(self._ordinal)
        if instance_id in self._instances:
            self.unregister_instance(instance_id)  # re-registering replaces
        handles: list[bytes] = []
        try:
            ranges = []
            pointers = []
            for t in tensors:
                h = bytes(t["handle"])
                address = self._opened.open(h)
                handles.append(h)
                base, size = gpu_ipc.allocation_range(address)
                offset = int(t["offset"]) + (address - base)
                ranges.append((base, size, offset, int(t.get("nbytes", geometry.layer_elements() * geometry.itemsize))))
                pointers.append(base + offset)
            check_layer_ranges(ranges, geometry.layer_elements() * geometry.itemsize)
            span, offsets = span_device_buffers(pointers, geometry.layer_elements() * geometry.itemsize, geometry.lane_dtype)
            pool_dev = self._pool_device_address(pool)
            lane = geometry.lane_bytes
            pool_lanes = cuda.from_cuda_array_interface(
                {"shape": (pool.size // lane,), "typestr": geometry.lane_dtype.str, "data": (pool_dev, False),
                 "version": 3, "strides": None}, owner=None, sync=False)
            stream = cuda.stream()
            transfer = CudaKVTransfer(geometry, span, offsets, pool_lanes, mode=self.mode, max_ctas=self.max_ctas,
                                      threads=self.threads, stream=stream, max_chunks=self.max_chunks,
                                      staging_min_chunks=self.staging_min_chunks, pipeline_pieces=self.pipeline_pieces)
        except BaseException:
            for h in handles:
                self._opened.close(h)
            raise
        inst = self._add_instance(instance_id, geometry, transfer, handles, raw_stream(stream), pool.slot_bytes)
        self._open_registered_events(inst, event_handles)
        log.info("GPU instance %d: %d layers %s, %s mode, launch path %s, staging DMAs %s %s", instance_id,
                 geometry.num_layers, geometry.layout.value, self.mode, transfer.launch_path, transfer.memcpy_path,
                 transfer.memcpy_error)

    def _add_instance(self, instance_id: int, geometry: Any, transfer: Any, handles: list[bytes], stream_handle: Any,
                      slot_bytes: int) -> _Instance:
        inst = _Instance(instance_id, geometry, transfer, handles, stream_handle, slot_bytes, self._lock)
        inst.links = {kind: LinkModel(self.link_bytes_per_s) for kind in TransferKind}
        lane_state = transfer.lane_state() if self.copy_lanes and hasattr(transfer, "lane_state") else None
        if lane_state is not None:
            wake_fd = self._wake_fd if self.lane_completions else -1
            inst.lane = _CopyLane(instance_id, lane_state, max(self.max_in_flight, 1), self._ordinal, geometry, wake_fd)
            inst.lane.start()
        inst.waiter = threading.Thread(target=self._wait, args=(inst,), name=f"mpcache-gpu-waiter-{instance_id}", daemon=True)
        with self._lock:
            self._instances[instance_id] = inst
            short = self.warm_events - len(self._free_events)
        inst.waiter.start()
        if short > 0:
            self._add_events(short)  # the first requests must not pay for event creation
        return inst

    def _open_registered_events(self, inst: _Instance, event_handles: list[bytes]) -> None:
        """Open the engine's announced interprocess events now; one that cannot be opened
        refuses the registration (the instance is removed again)."""
        for i, h in enumerate(event_handles):
            try:
                inst.worker_event(h)
            except Exception as e:
                self.unregister_instance(inst.instance_id)
                raise ValueError(f"event_handles[{i}] cannot be opened: {e}") from e

    def _add_events(self, n: int) -> None:
        events = [gpu_ipc.create_completion_event() for _ in range(n)]
        with self._lock:
            self._free_events.extend(events)

    def _new_event(self) -> Any:
        ev = gpu_ipc.create_completion_event()
        with self._lock:
            self._stats["events_created"] += 1
        return ev

    def _pool_device_address(self, pool: SharedMemoryPool) -> int:
        entry = self._pools.get(id(pool))
        if entry is None:
            entry = (pool, gpu_ipc.register_host(pool.address, pool.size))
            self._pools[id(pool)] = entry
        return entry[1]

    def _use_compiled_poller(self) -> None:
        """Waiters poll with the compiled, GIL-free poller from now on (real GPU only)."""
        from mpcache.kernels.gpu import as_handle, fast_poller

        fn = fast_poller()
        scratch = threading.local()

        def poll(events: list[Any], wake: float, end: float, every: float, most: float) -> tuple[list[bool], int]:
            a = getattr(scratch, "arrays", None)
            if a is None:
                a = scratch.arrays = (np.zeros(_POLL_MAX, np.uint64), np.zeros(_POLL_MAX, np.int64), np.zeros(2, np.int64))
            handles, status, ts = a
            n = len(events)
            for i, ev in enumerate(events):
                handles[i] = as_handle(ev)
            k, polls = fn(handles, n, status, int(wake * 1e9), int(end * 1e9), int(every * 1e9), int(most * 1e9), ts)
            return [v == 0 for v in status[:k].tolist()], int(polls)

        poll(self._free_events[:1], 0.0, 0.0, 0.0, 0.0)  # compiled now, not on a first transfer
        self._poll = poll
        self.poll_path = "compiled"

    def _python_poll(self, events: list[Any], wake: float, end: float, every: float, most: float) -> tuple[list[bool], int]:
        """The poller's contract in Python (cuda-bindings queries): sleep until ``wake``, then
        query ``events`` in stream order, first ``every`` s apart, each pause twice the last up
        to ``most``, until the first is no longer pending (returns each leading one's success)
        or ``end`` passes (returns none); and the polls."""
        drv = gpu_ipc.driver()
        ready = drv.CUresult.CUDA_SUCCESS
        not_ready = drv.CUresult.CUDA_ERROR_NOT_READY
        polls = 0
        now = time.monotonic()
        if now < wake:
            time.sleep(min(wake, end) - now)
        while True:
            out: list[bool] = []
            for ev in events:
                (err,) = drv.cuEventQuery(ev)
                if err == not_ready:
                    break  # one stream: nothing after it is done either
                out.append(err == ready)
            polls += 1
            now = time.monotonic()
            if out or now >= end:
                return out, polls
            time.sleep(max(0.0, min(now + every, end) - now))
            every = min(2 * every, most)

    def _wait(self, inst: _Instance) -> None:
        """The instance's waiter: polls its transfers' completion events in stream order
        (``cuEventQuery``, never a blocking wait), reports each exactly once, and fails the
        instance if its first transfer outlives the timeout. It sleeps until the link model
        says the first transfer should be done, then looks 10 us later, then 20, 40, 80, 100 us
        apart, less often once late.
        With the compiled poller, sleeping and polling hold no GIL: the thread takes it only
        to report what ended. With a copy lane it looks only at the transfers the lane has done
        (``_absorb``): an event the lane has not recorded yet would read as done."""
        gpu_ipc.ensure_context(self._ordinal)
        if inst.lane is not None and inst.lane.watching() and self._watch(inst):
            self._release(inst)
            return
        if self.poll_path == "compiled":
            from mpcache.kernels.gpu import fine_timer_slack

            fine_timer_slack()  # its 10 us polls are 10 us, not 60
        while True:
            with self._lock:
                while not inst.pending and inst.state == "live":
                    inst.cond.wait()
                if not inst.pending:
                    break  # unregistered / failed / closing, nothing left in flight
                snapshot = list(itertools.islice(inst.pending, _POLL_MAX))
            if inst.lane is not None:
                k = self._absorb(inst, snapshot)
                if k == 0:  # the lane has not done the first yet (it takes microseconds)
                    head = snapshot[0]
                    now = time.monotonic()
                    if now >= head.deadline and inst.state != "failed":
                        self._fail(inst, now)
                    else:  # its event is looked at only when due: no need to hurry before
                        time.sleep(min(max(head.expected_done - _POLL_AIM_EARLY_S - now, _LANE_LOOK_S), 0.001))
                    continue
                snapshot = snapshot[:k]
            events: list[Any] = []
            for p in snapshot:
                if p.event is None:
                    p.event = self._late_event(inst)
                    if p.event is None:
                        break
                events.append(p.event)
            head = snapshot[0]
            now = time.monotonic()
            overdue = now >= head.deadline and inst.state != "failed"
            # the first look a little before the model's end: usually it then finds the copy
            # still running and the next look, 10 us on, sees it end (a sample for the model)
            due = head.expected_done - _POLL_AIM_EARLY_S
            late = now - due
            wake = max(now, due)
            if overdue:
                wake = end = every = most = now  # one last look before the instance is failed
            elif inst.state == "failed":
                every = most = 0.05
                end = now + 0.05
            elif late < _POLL_FINE_SPAN_S:
                # 10 us, then 20, 40, 80, 100: a good model is answered within 10 us, a wrong
                # one with a handful of looks
                every, most, end = _POLL_FINE_S, _POLL_FINE_MAX_S, due + _POLL_FINE_SPAN_S
            elif late < _POLL_MID_SPAN_S:
                every = most = _POLL_MID_S
                end = now + 0.01
            else:
                every = most = _POLL_SLOW_S
                end = now + 0.05
            end = max(min(end, head.deadline, wake + _POLL_CALL_MAX_S), wake)
            oks, polls = self._poll(events, wake, end, every, most) if events else ([], 0)
            with self._lock:
                self._stats["polls"] += polls
            if not oks:
                if overdue:
                    self._fail(inst, time.monotonic())
                elif not events:
                    time.sleep(0.05)  # no event could be recorded yet: try again later
                continue
            seen = time.monotonic()
            # a look found the first still pending one pause before: it ended at ``seen``
            # within that pause, a sample worth learning from if that is 10% of its flight
            pause = min(every * 2 ** max(polls - 2, 0), most)
            self._learn(inst, head, seen, exact=polls > 1 and pause <= 0.1 * (seen - head.started),
                        early=polls == 1 and wake == due)
            self._report(inst, [(p, p.ok and ok) for p, ok in zip(snapshot, oks)], seen)
        self._release(inst)

    def _watch(self, inst: _Instance) -> bool:
        """The waiter of an instance whose lane watches its copies end (the loop reports them):
        it wakes only for the first transfer's deadline, to collect what the loop has not (it
        may have stopped), and to take over -- the instance failed, closing, the deadline passed,
        or the lane met a row with no event. True: nothing is left (the instance is released);
        False: the lane no longer watches and the Python waiter goes on from what it saw."""
        lane = inst.lane
        assert lane is not None
        behind = 0  # what the lane had seen at the last look: the loop collects it before the next
        while True:
            if lane.collected < behind or self._closing:
                self._collect(inst)  # the loop has not for a whole look (it has stopped, or is stuck)
            behind = lane.seen_through()
            with self._lock:
                if not inst.pending and inst.state != "live":
                    return True
                now = time.monotonic()
                head = inst.pending[0] if inst.pending else None
                if (self._closing or inst.state == "failed" or not lane.watching()
                        or (head is not None and now >= head.deadline)):
                    break
                # (a transfer put in line meanwhile is seen at most a tenth of its timeout late)
                idle = min(_WATCH_IDLE_S, 0.1 * self.transfer_timeout_s)
                inst.cond.wait(idle if head is None else min(_WATCH_LOOK_S, head.deadline - now))
        lane.stop_watching()
        self._collect(inst)  # what it saw before (the loop collects a last one it may see)
        return False

    def _learn(self, inst: _Instance, head: _Pending, seen: float, *, exact: bool, early: bool) -> None:
        """Teach the instance's ``LinkModel`` of its direction a copy seen to end at ``seen``: ``exact`` (a
        look found it still running one poll before): a lone copy (and none other started
        before it ended) took ``seen - started``; a queued one, started before the direction's
        last copy ended, moved its bytes since that end (its own line's copies run one after
        another; another engine's share the link at the same time). ``early`` (already done at the first look): the model says too late, by how much
        is unknown (``LinkModel.sooner``; such a model would learn nothing else, as every copy
        is then found done)."""
        link = inst.links[head.kind]
        last = inst.last_end[head.kind]
        inst.last_end[head.kind] = seen
        if early:
            link.sooner(head.alone and self._starts[head.kind] == head.starts)
        elif not exact:
            pass
        elif head.alone:
            if self._starts[head.kind] == head.starts:  # none started during its flight either
                link.learn_alone(head.nbytes, seen - head.started)
        elif head.started < last:  # it waited for the copy that ended at ``last``: then moved
            link.learn_queued(head.nbytes, seen - last)

    def _late_event(self, inst: _Instance) -> Any:
        """An event after everything the instance's streams hold now (this thread may not use
        the transfer's own ordering events: the loop thread does)."""
        drv = gpu_ipc.driver()
        try:
            streams = inst.transfer.raw_streams()
            ev = self._new_event()
            for other in streams[1:]:
                join = self._new_event()
                gpu_ipc.check(drv.cuEventRecord(join, other), "cuEventRecord")
                gpu_ipc.check(drv.cuStreamWaitEvent(streams[0], join, 0), "cuStreamWaitEvent")
                gpu_ipc.destroy_event(join)  # the wait holds what it needs
            gpu_ipc.check(drv.cuEventRecord(ev, streams[0]), "cuEventRecord")
            return ev
        except Exception:
            log.exception("GPU instance %d: still no completion event", inst.instance_id)
            return None

    def _report(self, inst: _Instance, finished: list[tuple[_Pending, bool]], now: float) -> None:
        seen_ns = time.perf_counter_ns()
        with self._lock:  # (one the loop collected meanwhile, as its lane saw it end, is the loop's)
            mine = [(p, ok) for p, ok in finished if p in inst.pending]
            for p, _ in mine:
                inst.pending.remove(p)
        # enqueued to seen done by this waiter: the copy plus the waiter's detection delay
        self._finished(inst, [(p, ok, seen_ns - p.enqueued_ns) for p, ok in mine], now)

    def _finished(self, inst: _Instance, finished: list[tuple[_Pending, bool, int]], now: float, handoff_ns: int = 0,
                  lane_ns: int = 0, lane_looks: int = 0) -> None:
        """Count, free and report transfers taken off the instance's line (ok, ns in flight; what
        their lane did and the looks it took to see them end, when it watched)."""
        with self._lock:
            self._stats["handoff_ns"] += handoff_ns
            self._stats["lane_ns"] += lane_ns
            self._stats["lane_looks"] += lane_looks
            for p, ok, flight_ns in finished:
                self._stats["flight_ns"] += flight_ns
                self._stats["finished" if ok else "failed"] += 1
                if p.event is not None:
                    self._free_events.append(p.event)
            if inst.pending:
                inst.pending[0].deadline = now + self.transfer_timeout_s
        for p, ok, _ in finished:
            try:
                p.done(p.transfer_id, ok)
            except Exception:
                log.exception("completion callback for transfer %d failed", p.transfer_id)

    def _fail(self, inst: _Instance, now: float) -> None:
        """The first transfer has waited past the timeout (its engine's event never fired, or
        the engine's GPU work hangs): unregister the instance, make its queued kernels no-ops,
        and report at once every transfer whose queued work can no longer touch L1. The first
        one (its kernel may be starting right now) and staging STOREs (their DMAs into L1
        slots cannot be cancelled) are reported when their copies have really ended, so their
        slots stay pinned until then."""
        with self._lock:
            if self._instances.get(inst.instance_id) is inst:
                del self._instances[inst.instance_id]
            if inst not in self._draining:
                self._draining.append(inst)
            inst.state = "failed"
            self._stats["instances_failed"] += 1
        lane = inst.lane
        if lane is not None:  # the rows it has not taken are skipped; what it enqueued is neutralized
            lane.fail()
            if not lane.idle(1.0):
                log.error("GPU instance %d: its copy lane did not finish its rows", inst.instance_id)
            self._absorb(inst, list(inst.pending))
        with self._lock:
            queued = list(inst.pending)
        for p in queued:
            inst.transfer.neutralize(p.entries)
            p.ok = False  # whatever still runs was (or may have been) cut short
        with self._lock:  # (a lock operation is a full barrier: the zeroed counts are visible)
            released = [p for p in queued[1:] if not p.pool_dma and p in inst.pending]
            for p in released:
                inst.pending.remove(p)
                self._stats["failed"] += 1
            held = len(inst.pending)
        for p in released:
            try:
                gpu_ipc.destroy_event(p.event)  # it may still be recorded on the stuck stream
            except Exception:
                pass
            try:
                p.done(p.transfer_id, False)
            except Exception:
                log.exception("completion callback for transfer %d failed", p.transfer_id)
        log.error("GPU instance %d failed: a transfer has not finished %.1f s after it came first in line (the engine's "
                  "event never fired?); instance unregistered, %d transfers failed now, %d reported when their copies end",
                  inst.instance_id, self.transfer_timeout_s, len(released), held)
        tell = self.on_instance_failed
        if tell is not None:  # the server hands it to core_sm (registration, plans, quota)
            try:
                tell(inst.instance_id, f"a GPU transfer did not finish {self.transfer_timeout_s:g} s after it came "
                                       "first in line")
            except Exception:
                log.exception("reporting the failure of instance %d failed", inst.instance_id)

    def _release(self, inst: _Instance) -> None:
        """Close what the instance opened; only once nothing of it is queued on the device."""
        with self._lock:
            if inst in self._draining:
                self._draining.remove(inst)
        if inst.lane is not None:
            inst.lane.stop()
        for ev in inst.worker_events.values():
            try:
                gpu_ipc.destroy_event(ev)
            except Exception:
                log.exception("cuEventDestroy failed")
        inst.worker_events.clear()
        for h in inst.handles:
            self._opened.close(h)
        inst.handles = []
