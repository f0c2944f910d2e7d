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
import select
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
        self.fail_record: set[int] = set()  # events the compiled code's record of fails
        self.copy_s = 0.0  # an event reads pending this long after its record (a copy's time)
        self.t_recorded: dict[int, float] = {}
        self.launches: list[int] = []  # the first block id of each zero-copy launch's descriptor
        self.hold = threading.Event()
        self.hold.set()
        self.desc: np.ndarray | None = None
        self._keep: list[Any] = []
        self.CUresult = SimpleNamespace(CUDA_SUCCESS=SUCCESS, CUDA_ERROR_NOT_READY=NOT_READY)

    def query(self, ev: int) -> int:
        with self.lock:
            stream = self.recorded.get(int(ev))
            t = self.t_recorded.get(int(ev), 0.0)
        if stream is not None and (stream in self.stuck or time.monotonic() < t + self.copy_s):
            return NOT_READY
        return SUCCESS

    def cuEventQuery(self, ev: Any) -> tuple[int]:  # the waiter's Python poll
        return (self.query(int(ev)),)

    def cuEventRecord(self, ev: Any, stream: Any) -> tuple[int]:  # a late event (_late_event)
        with self.lock:
            self.recorded[int(ev)] = int(stream)
            self.t_recorded[int(ev)] = time.monotonic()
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
                if a[0] in self.fail_record:
                    return 999
                with self.lock:
                    self.recorded[a[0]] = a[1]
                    self.t_recorded[a[0]] = time.monotonic()
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
    dev.fail_record.clear()
    dev.copy_s = 0.0
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
        self.threads: dict[int, int] = {}  # transfer -> the thread that reported it
        self.at: dict[int, float] = {}  # transfer -> when it was reported
        self.twice: list[int] = []  # transfers reported more than once

    def __call__(self, tid: int, ok: bool) -> None:
        with self.lock:
            if tid in self.results:  # (raising here would only be logged: the executor guards its callbacks)
                self.twice.append(tid)
                return
            self.results[tid] = ok
            self.threads[tid] = threading.get_ident()
            self.at[tid] = time.monotonic()

    def wait(self, tids: set[int], timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                assert not self.twice, f"reported twice: {self.twice}"
                if tids <= set(self.results):
                    return
            time.sleep(0.002)
        raise AssertionError(f"not reported in time: {sorted(tids - set(self.results))}")


class Loop:
    """The server loop's part in lane completions: woken through its pipe (the wake-up a watching
    lane writes), it collects what the lanes saw end, as ``Server.drain_completions`` does."""

    def __init__(self, ex: GpuTransferExecutor) -> None:
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        ex.wake_loop_with(self.w)
        self.ex = ex
        self.stopped = False
        self.wakes = 0
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stopped:
            if select.select([self.r], [], [], 0.05)[0]:
                self.wakes += 1
                try:
                    os.read(self.r, 4096)
                except BlockingIOError:
                    pass
            self.ex.collect_completions()

    def close(self) -> None:
        self.stopped = True
        self.thread.join(5.0)
        os.close(self.r)
        os.close(self.w)


def executor(completions: str, **kw: Any) -> tuple[GpuTransferExecutor, Loop | None]:
    """An executor whose waiters see the copies end (``waiter``) or whose lanes do (``lane``,
    with a loop collecting them)."""
    ex = GpuTransferExecutor(C, lane_completions=completions == "lane", **kw)
    return ex, (Loop(ex) if completions == "lane" else None)


COMPLETIONS = pytest.mark.parametrize("completions", ["waiter", "lane"])


@COMPLETIONS
def test_the_loop_hands_over_and_the_waiter_waits_for_the_lane(lanes: Device, completions: str) -> None:
    """The loop only writes rows: it goes on while the lane is held inside a launch, and nothing
    is reported before the lane has recorded each transfer's event (unrecorded, it would read
    done); then every transfer lands, in the order the loop started them. With lane completions
    the loop reports them (the lane saw them end) and the waiter never looks at an event."""
    dev = lanes
    ex, loop = executor(completions, transfer_timeout_s=5.0, warm_events=4)
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
    if loop is not None:
        assert set(done.threads.values()) == {loop.thread.ident} and s["polls"] == 0 and loop.wakes >= 1
        assert s["lane_looks"] >= 5  # (at least one look a transfer, the lane's)
        assert inst.lane.watching() and inst.lane.seen_through() == 5
    ex.close()
    assert not inst.lane.thread.is_alive() and dev.closed == [0x1000]  # type: ignore[attr-defined]
    if loop is not None:
        loop.close()


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


@COMPLETIONS
def test_a_stuck_engine_fails_and_its_lane_skips_what_it_has_not_taken(lanes: Device, completions: str) -> None:
    """The engine's event never fires: the first transfer outlives the timeout, the instance is
    failed, the rows the (held) lane had not taken are skipped and nothing is launched for them;
    what it had enqueued is neutralized (so a zero-copy store behind the first is reported at
    once, as when the loop enqueues it), and the first is reported once its copy really ends.
    With lane completions the waiter takes over at the deadline (the lane stops watching)."""
    dev = lanes
    ex, loop = executor(completions, transfer_timeout_s=0.3, warm_events=4)
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
    if loop is not None:
        assert not inst.lane.watching()
        loop.close()


@COMPLETIONS
def test_unregistered_with_rows_in_its_lane(lanes: Device, completions: str) -> None:
    """Unregistering never waits: what was handed to the lane lands, and the memory is closed and
    the lane stopped only after that."""
    dev = lanes
    ex, loop = executor(completions, transfer_timeout_s=5.0, warm_events=4)
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
    if loop is not None:
        assert set(done.threads.values()) == {loop.thread.ident}
        loop.close()


@COMPLETIONS
def test_a_transfer_larger_than_one_call_waits_for_the_lane_and_goes_the_loops_way(lanes: Device, completions: str) -> None:
    """(With lane completions the lane still watches the loop's transfer, in turn: a K_WATCH row.)"""
    dev = lanes
    ex, loop = executor(completions, transfer_timeout_s=5.0, warm_events=4, max_chunks=MAX_CHUNKS)
    done = Done()
    inst, transfer = add(ex, dev, 4, b"\x04" * 64)
    ex.start(st(1, 4, 10), b"", done)
    ex.start(st(2, 4, 100, n_chunks=MAX_CHUNKS + 2), b"", done)  # two calls: the loop makes them
    ex.start(st(3, 4, 30), b"", done)
    done.wait({1, 2, 3})
    assert all(done.results.values()) and dev.launches == [10, 30] and transfer.python_calls == 2
    assert inst.lane.done_through() == (3 if loop is not None else 2)
    ex.close()
    if loop is not None:
        assert set(done.threads.values()) == {loop.thread.ident}
        loop.close()


def one_lane_transfer(dev: Device, iid: int) -> tuple[GpuTransferExecutor, Loop, Done, Any]:
    """An executor with lane completions and a collecting loop, instance ``iid`` registered, and
    transfer 1 (a store of block 10) started on it."""
    ex, loop = executor("lane", transfer_timeout_s=5.0, warm_events=4)
    assert loop is not None
    done = Done()
    inst, _ = add(ex, dev, iid, bytes([iid]) * 64)
    ex.start(st(1, iid, 10), b"", done)
    return ex, loop, done, inst


def test_a_row_with_no_event_hands_the_watching_to_the_waiter(lanes: Device) -> None:
    """The lane could not record a transfer's completion event: it stops watching there, and the
    waiter goes on in Python (an event recorded after everything queued covers that transfer);
    what the lane saw before is the loop's, nothing is reported twice or lost."""
    dev = lanes
    ex, loop, done, inst = one_lane_transfer(dev, 7)
    done.wait({1})
    dev.fail_record.add(ex._free_events[-1])  # the next transfer's completion event
    for tid in (2, 3, 4):
        ex.start(st(tid, 7, 10 * tid), b"", done)
    done.wait({2, 3, 4})
    assert done.results == {1: True, 2: False, 3: True, 4: True}  # 2: its record failed
    assert done.threads[1] == loop.thread.ident and done.threads[3] == inst.waiter.ident
    assert not inst.lane.watching() and inst.lane.seen_through() == 1 and ex.stats()["polls"] >= 1
    ex.start(st(5, 7, 50), b"", done)  # the waiter's from now on
    done.wait({5})
    assert done.results[5] and done.threads[5] == inst.waiter.ident
    ex.close()
    loop.close()


def test_close_with_copies_in_flight_and_no_loop_left(lanes: Device) -> None:
    """The loop has stopped collecting (the server is shutting down): closing still reports every
    transfer (the waiters take over) and returns at once after the copies end."""
    dev = lanes
    ex, loop = executor("lane", transfer_timeout_s=5.0, warm_events=4)
    assert loop is not None
    loop.close()
    done = Done()
    inst, _ = add(ex, dev, 8, b"\x08" * 64)
    dev.hold.clear()
    for tid in (1, 2, 3):
        ex.start(st(tid, 8, 10 * tid), b"", done)
    threading.Timer(0.1, dev.hold.set).start()
    t0 = time.monotonic()
    ex.close()
    assert time.monotonic() - t0 < 2.0 and done.results == {1: True, 2: True, 3: True}
    assert not inst.lane.thread.is_alive() and inst.lane.watch[kg.WATCH_WAKE_FD] == -1


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


@COMPLETIONS
def test_a_copy_is_reported_after_it_ends_and_teaches_the_link_model(lanes: Device, completions: str) -> None:
    """Each fake copy takes 1.5 ms (its event reads pending until then) where the configured link
    says 1 ms: every transfer is reported after its copy ended, and the lone copies seen to end
    teach the instance's link model their latency (~0.5 ms), whoever looks at the events."""
    dev = lanes
    dev.copy_s = 0.0015
    ex, loop = executor(completions, transfer_timeout_s=5.0, warm_events=4, link_gbps=SLOT_LANES * LANE / 1e6)
    done = Done()
    inst, _ = add(ex, dev, 9, b"\x09" * 64)
    for tid in range(1, 9):
        t0 = time.monotonic()
        ex.start(st(tid, 9, 10 * tid), b"", done)
        done.wait({tid})
        assert done.results[tid] and done.at[tid] - t0 >= 0.0015
        time.sleep(0.005)
    lat = inst.links[TransferKind.STORE].lat
    assert 0.2e-3 < lat < 1.5e-3, lat
    if loop is not None:
        assert set(done.threads.values()) == {loop.thread.ident} and ex.stats()["polls"] == 0
    ex.close()
    if loop is not None:
        loop.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_lane_completions_report_each_transfer_once_whatever_happens(lanes: Device, seed: int) -> None:
    """A seeded mix on two instances with lane completions: copies of random lengths, transfers
    too large for one call (the loop's, watched by the lane), an event the lane cannot record
    (the waiter takes over), one engine stuck past the deadline (failed), one unregistered with
    copies in flight, the loop pausing its collects, then closing. Every started transfer is
    reported exactly once (Done refuses a second report) and nothing is left in flight."""
    import random

    rng = random.Random(seed)
    dev = lanes
    ex, loop = executor("lane", transfer_timeout_s=0.4, warm_events=8, max_chunks=MAX_CHUNKS)
    assert loop is not None
    done = Done()
    insts = {iid: add(ex, dev, iid, bytes([iid]) * 64)[0] for iid in (11, 12)}
    started: set[int] = set()
    tid = 0
    stuck_at = rng.randrange(90, 110)
    gone_at = rng.randrange(40, 80)
    no_event_at = rng.randrange(10, 40)
    for step in range(120):
        dev.copy_s = rng.choice((0.0, 0.0002, 0.001))
        iid = rng.choice((11, 12))
        if step == stuck_at:
            dev.stuck.add(COMPUTE)  # both engines' events stop firing ...
            threading.Timer(0.6, dev.stuck.clear).start()  # ... past the deadline
        if step == gone_at:
            ex.unregister_instance(12)
        if step == no_event_at and ex._free_events:
            dev.fail_record.add(ex._free_events[-1])
        if step % 30 == 29:
            loop.stopped = True  # the loop is busy elsewhere for a while
            loop.thread.join(5.0)
            time.sleep(rng.uniform(0.0, 0.1))
            loop.stopped = False
            loop.thread = threading.Thread(target=loop.run, daemon=True)
            loop.thread.start()
        tid += 1
        n = rng.choice((1, 1, 2, MAX_CHUNKS + 1))
        ex.start(st(tid, iid, 8 * (tid % 400), n_chunks=n), b"", done)
        started.add(tid)
        if rng.random() < 0.3:
            time.sleep(rng.uniform(0.0, 0.003))
    done.wait(started, timeout=20.0)
    time.sleep(0.1)
    assert set(done.results) == started and done.twice == []
    ok = sum(done.results.values())
    assert 0 < ok < len(started) and all(i.state != "live" for i in insts.values())  # the mix happened
    ex.close()
    loop.close()
    assert ex.stats()["in_flight"] == 0
    for inst in insts.values():
        assert not inst.lane.thread.is_alive() and not inst.waiter.is_alive()


def test_a_transfer_the_loop_collected_is_not_reported_again_by_the_waiter(lanes: Device) -> None:
    """The race at a take-over: the waiter (going on in Python) found a transfer's copy ended
    while the loop collected the same transfer, as its lane had seen it end just before it
    stopped watching. Whoever takes it off the line reports it; the other reports nothing."""
    dev = lanes
    ex, loop, done, inst = one_lane_transfer(dev, 13)
    p = inst.pending[0]  # the waiter's snapshot
    done.wait({1})  # the loop collected it
    ex._report(inst, [(p, True)], time.monotonic())  # the waiter's report of its snapshot
    assert done.twice == [] and ex.stats()["finished"] == 1
    ex.close()
    loop.close()
