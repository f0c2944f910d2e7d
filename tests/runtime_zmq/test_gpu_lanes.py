"""The GPU executor with copy lanes, without a GPU: the compiled lane and enqueue call a fake
driver (ctypes callbacks) that remembers which stream each event was recorded on, and the
waiter's queries ask the same fake. An event nobody recorded reads done, as on a real device, so
a waiter that looked at a transfer's event before its lane had recorded it would report the
transfer early: these tests hold the lane inside a launch to catch that."""
from __future__ import annotations

import ctypes
import errno
import itertools
import os
import platform
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import mpcache.kernels.gpu as kg
from mpcache.core_sm.effects import StartTransfer
from mpcache.core_sm.messages import TransferKind
from mpcache.runtime_zmq import gpu_ipc
from mpcache.runtime_zmq.gpu_transfer import GpuTransferExecutor
from tests.kernels.test_compiled_enqueue import INT, PROTOS  # the driver functions' ctypes prototypes

# the executor runs copy lanes on x86-64 only (their rows are read in the order written)
pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="copy lanes run on x86-64 only")

SUCCESS, NOT_READY = 0, 600
COMPUTE, COPY = 100, 200
C, BS = 8, 4  # chunk tokens, block size: 2 blocks per chunk
SLOT_LANES, LANE = 10, 8
MAX_CHUNKS = 4


class Device:
    """The fake driver: both the ctypes functions the compiled code calls and the cuda-bindings
    style object ``gpu_ipc.driver()`` gives the waiter. A stream in ``stuck`` never finishes what
    is recorded on it (an engine's event that never fires); ``hold`` keeps launches waiting."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.recorded: dict[int, int] = {}  # event -> stream it was last recorded on
        self.stuck: set[int] = set()
        self.launches: list[int] = []  # the first block id of each zero-copy launch's descriptor
        self.hold = threading.Event()
        self.hold.set()
        self.desc: np.ndarray | None = None
        self._keep: list[Any] = []
        self.CUresult = SimpleNamespace(CUDA_SUCCESS=SUCCESS, CUDA_ERROR_NOT_READY=NOT_READY)

    def query(self, ev: int) -> int:
        with self.lock:
            stream = self.recorded.get(int(ev))
        return NOT_READY if stream is not None and stream in self.stuck else SUCCESS

    def cuEventQuery(self, ev: Any) -> tuple[int]:  # the waiter's Python poll
        return (self.query(int(ev)),)

    def cuEventRecord(self, ev: Any, stream: Any) -> tuple[int]:  # a late event (_late_event)
        with self.lock:
            self.recorded[int(ev)] = int(stream)
        return (SUCCESS,)

    def cuStreamWaitEvent(self, stream: Any, ev: Any, flags: int) -> tuple[int]:
        return (SUCCESS,)

    def __getitem__(self, name: str) -> Any:  # the compiled code's libcuda
        def call(*a: int) -> int:
            if name == "cuEventQuery":
                return self.query(a[0])
            if name == "cuLaunchKernel":
                assert self.hold.wait(10.0)
                r = (a[9] - 1000 * kg.R_P_G) % 1000  # the descriptor entry (packed argument ids below)
                assert self.desc is not None
                self.launches.append(int(self.desc[r, kg.D_SLOTS + int(self.desc[r, kg.D_NCHUNKS])]))
            elif name == "cuEventRecord":
                with self.lock:
                    self.recorded[a[0]] = a[1]
            return SUCCESS
        cb = ctypes.CFUNCTYPE(INT, *PROTOS[name])(call)
        self._keep.append(cb)
        return cb


@pytest.fixture(scope="module")
def device_and_lane() -> tuple[Device, Any]:
    dev = Device()
    enqueue = kg._make_enqueue(dev)
    lane = kg.make_copy_lane(enqueue)
    kg.warm_copy_lane(lane)  # compiled once for the module, as the server does at start
    return dev, lane


class Transfer:
    """CudaKVTransfer's face to the executor, zero-copy, its compiled state on the fake device."""

    memcpy_path = "none"
    mode = "zerocopy"

    def __init__(self, dev: Device, ring: int = 16) -> None:
        st = np.zeros(kg.S_COUNT, np.int64)
        st[kg.S_RING], st[kg.S_COMPUTE], st[kg.S_COPY] = ring, COMPUTE, COPY
        st[kg.S_CTAS], st[kg.S_THREADS], st[kg.S_BPC], st[kg.S_SLOT_LANES], st[kg.S_MAX_CHUNKS] = 4, 64, 2, SLOT_LANES, MAX_CHUNKS
        st[kg.S_F_G], st[kg.S_F_S] = 1, 2
        table = np.zeros((7, ring), np.int64)
        table[kg.R_COVER] = np.arange(ring)
        table[kg.R_EVENT] = np.arange(ring) + 5000  # the ring's own events
        for row in (kg.R_P_G, kg.R_P_S):
            table[row] = np.arange(ring) + 1000 * kg.R_P_G  # (both: the launch callback finds the entry)
        self.desc = np.zeros((ring, 64), np.int64)
        dev.desc = self.desc
        self.neutralized: list[int] = []
        self.python_calls = 0
        cfg = np.zeros(kg.G_COUNT, np.int64)
        cfg[kg.G_BPC], cfg[kg.G_MAX_CHUNKS], cfg[kg.G_USED] = 2, MAX_CHUNKS, 2
        self.state = {"st": st, "ring": table, "rel": np.full((4, 64), -1, np.int64), "desc": self.desc,
                      "runs": np.zeros((3, 1), np.int64), "used": np.zeros(2, np.int64),
                      "pieces": np.zeros((2, MAX_CHUNKS + 1, 1, 2), np.int64), "npieces": np.ones((2, MAX_CHUNKS + 1), np.int64),
                      "one_piece": np.zeros((1, 2), np.int64), "cfg": cfg, "pool_lanes": 1 << 20}

    def lane_state(self) -> dict[str, Any]:
        return self.state

    def uses_staging(self, n: int, busy: bool = False) -> bool:
        return False

    def raw_streams(self) -> list[Any]:
        return [COMPUTE]

    def neutralize(self, entries: list[int]) -> None:
        self.neutralized += entries
        for r in entries:
            self.desc[r, kg.D_NCHUNKS] = 0

    # the loop's own path, for a transfer of more chunks than the lane takes
    def wait_event(self, ev: Any) -> None:
        pass

    def gather(self, ids: Any, offs: Any, **kw: Any) -> list[int]:
        self.python_calls += 1
        return []

    scatter = gather  # type: ignore[assignment]

    def record_completion(self, ev: Any) -> None:
        gpu_ipc.driver().cuEventRecord(ev, COMPUTE)


@pytest.fixture
def lanes(device_and_lane: tuple[Device, Any], monkeypatch: pytest.MonkeyPatch) -> Device:
    dev, lane = device_and_lane
    dev.recorded.clear()
    dev.stuck.clear()
    dev.launches.clear()
    dev.hold.set()
    closed: list[int] = []
    events = itertools.count(1)
    monkeypatch.setattr(kg, "fast_copy_lane", lambda: lane)
    monkeypatch.setattr(gpu_ipc, "driver", lambda: dev)
    monkeypatch.setattr(gpu_ipc, "ensure_context", lambda ordinal=0: None)
    monkeypatch.setattr(gpu_ipc, "create_completion_event", lambda: next(events))
    monkeypatch.setattr(gpu_ipc, "destroy_event", lambda ev: None)
    monkeypatch.setattr(gpu_ipc, "open_event", lambda h: 9000 + h[0])
    monkeypatch.setattr(gpu_ipc, "open_memory", lambda h: 0x1000 * h[0])
    monkeypatch.setattr(gpu_ipc, "close_memory", closed.append)
    dev.closed = closed  # type: ignore[attr-defined]
    return dev


def add(ex: GpuTransferExecutor, dev: Device, iid: int, handle: bytes) -> tuple[Any, Transfer]:
    transfer = Transfer(dev)
    geometry = SimpleNamespace(block_size=BS, blocks_per_chunk=C // BS, slot_bytes=SLOT_LANES * LANE, num_blocks=4096,
                               lane_bytes=LANE)
    ex._opened.open(handle)
    inst = ex._add_instance(iid, geometry, transfer, [handle], COMPUTE, SLOT_LANES * LANE)
    assert inst.lane is not None
    return inst, transfer


def st(tid: int, iid: int, block: int, n_chunks: int = 1) -> StartTransfer:
    """A store whose first block id names it (``Device.launches``)."""
    return StartTransfer(tid, TransferKind.STORE, iid, f"r{tid}", None, 0, n_chunks * C,
                         tuple((i, i) for i in range(n_chunks)), tuple(range(block, block + 2 * n_chunks)), 0)


class Done:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.results: dict[int, bool] = {}

    def __call__(self, tid: int, ok: bool) -> None:
        with self.lock:
            assert tid not in self.results, f"transfer {tid} reported twice"
            self.results[tid] = ok

    def wait(self, tids: set[int], timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if tids <= set(self.results):
                    return
            time.sleep(0.002)
        raise AssertionError(f"not reported in time: {sorted(tids - set(self.results))}")


def test_the_loop_hands_over_and_the_waiter_waits_for_the_lane(lanes: Device) -> None:
    """The loop only writes rows: it goes on while the lane is held inside a launch, and nothing
    is reported before the lane has recorded each transfer's event (unrecorded, it would read
    done); then every transfer lands, in the order the loop started them."""
    dev = lanes
    ex = GpuTransferExecutor(C, transfer_timeout_s=5.0, warm_events=4)
    done = Done()
    inst, transfer = add(ex, dev, 1, b"\x01" * 64)
    dev.hold.clear()
    t0 = time.monotonic()
    for tid in range(1, 6):
        ex.start(st(tid, 1, 100 * tid), b"e" * 64, done)
    assert time.monotonic() - t0 < 1.0
    time.sleep(0.1)
    assert done.results == {} and inst.lane.done_through() == 0
    dev.hold.set()
    done.wait(set(range(1, 6)))
    assert all(done.results.values()) and dev.launches == [100 * t for t in range(1, 6)]
    s = ex.stats()
    assert s["started"] == 5 and s["finished"] == 5 and s["lane_ns"] > 0 and s["handoff_ns"] > 0
    ex.close()
    assert not inst.lane.thread.is_alive() and dev.closed == [0x1000]  # type: ignore[attr-defined]


def test_a_bad_block_id_is_refused_before_the_lane_sees_it(lanes: Device) -> None:
    """The loop checks a call's block ids and slots as it writes the row: a block id past the
    engine's cache fails that transfer at once, nothing is handed over or launched, its
    completion event goes back to the free list, and the next transfer takes the same row."""
    dev = lanes
    ex = GpuTransferExecutor(C, transfer_timeout_s=5.0, warm_events=4)
    done = Done()
    inst, _ = add(ex, dev, 6, b"\x06" * 64)
    ex.start(st(1, 6, 10), b"", done)
    done.wait({1})
    free = len(ex._free_events)
    ex.start(st(2, 6, 4095), b"", done)  # blocks 4095 and 4096 of a 4096-block cache
    assert done.results.get(2) is False and inst.lane.written == 1 and len(ex._free_events) == free
    ex.start(st(3, 6, 30), b"", done)
    done.wait({3})
    assert done.results[3] and dev.launches == [10, 30] and inst.lane.written == 2
    s = ex.stats()
    assert s["started"] == 2 and s["finished"] == 2
    ex.close()


def test_a_stuck_engine_fails_and_its_lane_skips_what_it_has_not_taken(lanes: Device) -> None:
    """The engine's event never fires: the first transfer outlives the timeout, the instance is
    failed, the rows the (held) lane had not taken are skipped and nothing is launched for them;
    what it had enqueued is neutralized (so a zero-copy store behind the first is reported at
    once, as when the loop enqueues it), and the first is reported once its copy really ends."""
    dev = lanes
    ex = GpuTransferExecutor(C, transfer_timeout_s=0.3, warm_events=4)
    done = Done()
    inst, transfer = add(ex, dev, 2, b"\x02" * 64)
    dev.stuck.add(COMPUTE)
    ex.start(st(1, 2, 10), b"e" * 64, done)
    end = time.monotonic() + 5
    while inst.lane.done_through() < 1 and time.monotonic() < end:
        time.sleep(0.001)
    dev.hold.clear()  # the lane is held inside transfer 2's launch across the failure
    for tid in (2, 3, 4):
        ex.start(st(tid, 2, 10 * tid), b"e" * 64, done)
    threading.Timer(0.6, dev.hold.set).start()  # after the failure (at 0.3 s)
    done.wait({2, 3, 4}, timeout=10.0)
    assert inst.state == "failed" and not any(done.results[t] for t in (2, 3, 4))
    assert dev.launches == [10, 20]  # 3 and 4 were skipped: never launched
    assert sorted(set(transfer.neutralized)) == [0, 1]  # 2's kernel, launched after the failure, too
    assert 1 not in done.results  # its kernel may be running: held until its copy ends
    dev.stuck.clear()
    done.wait({1})
    assert not done.results[1]
    inst.waiter.join(5.0)
    assert not inst.lane.thread.is_alive() and dev.closed == [0x2000]  # type: ignore[attr-defined]
    ex.close()


def test_unregistered_with_rows_in_its_lane(lanes: Device) -> None:
    """Unregistering never waits: what was handed to the lane lands, and the memory is closed and
    the lane stopped only after that."""
    dev = lanes
    ex = GpuTransferExecutor(C, transfer_timeout_s=5.0, warm_events=4)
    done = Done()
    inst, _ = add(ex, dev, 3, b"\x03" * 64)
    dev.hold.clear()
    for tid in (1, 2, 3):
        ex.start(st(tid, 3, 10 * tid), b"", done)
    ex.unregister_instance(3)
    time.sleep(0.05)
    assert done.results == {} and dev.closed == []  # type: ignore[attr-defined]
    dev.hold.set()
    done.wait({1, 2, 3})
    assert all(done.results.values()) and dev.launches == [10, 20, 30]
    inst.waiter.join(5.0)
    assert dev.closed == [0x3000] and not inst.lane.thread.is_alive()  # type: ignore[attr-defined]
    ex.close()


def test_a_transfer_larger_than_one_call_waits_for_the_lane_and_goes_the_loops_way(lanes: Device) -> None:
    dev = lanes
    ex = GpuTransferExecutor(C, transfer_timeout_s=5.0, warm_events=4, max_chunks=MAX_CHUNKS)
    done = Done()
    inst, transfer = add(ex, dev, 4, b"\x04" * 64)
    ex.start(st(1, 4, 10), b"", done)
    ex.start(st(2, 4, 100, n_chunks=MAX_CHUNKS + 2), b"", done)  # two calls: the loop makes them
    done.wait({1, 2})
    assert all(done.results.values()) and dev.launches == [10] and transfer.python_calls == 2
    assert inst.lane.done_through() == 1
    ex.close()


def test_without_lanes_the_loop_makes_the_calls(lanes: Device) -> None:
    ex = GpuTransferExecutor(C, warm_events=2, copy_lanes=False)
    transfer = Transfer(lanes)
    inst = ex._add_instance(5, SimpleNamespace(block_size=BS, blocks_per_chunk=2, slot_bytes=80, num_blocks=64, lane_bytes=8),
                            transfer, [], COMPUTE, 80)
    assert inst.lane is None
    ex.close()


def test_the_loop_wakes_a_lane_holding_the_gil() -> None:
    """The loop's wake-up of a lane (an eventfd add that keeps the GIL) adds one per call, as
    os.eventfd_write does, and says why it failed."""
    from mpcache.runtime_zmq.gpu_transfer import eventfd_add_one

    fd = os.eventfd(0)
    eventfd_add_one(fd)
    eventfd_add_one(fd)
    assert os.eventfd_read(fd) == 2
    os.close(fd)
    with pytest.raises(OSError) as e:
        eventfd_add_one(fd)
    assert e.value.errno == errno.EBADF
