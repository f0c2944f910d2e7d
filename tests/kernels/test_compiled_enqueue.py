"""The compiled GPU enqueue (mpcache.kernels.gpu._make_enqueue) against a fake driver: ctypes callbacks
in place of libcuda, so CI checks what a call hands the driver, in which order, without a GPU.
On a GPU the same function is checked end to end by the kernel and server tests."""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

import mpcache.kernels.gpu as kg

U64, U32, INT = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int
PROTOS = {
    "cuLaunchKernel": (U64, U32, U32, U32, U32, U32, U32, U32, U64, U64, U64),
    "cuEventRecord": (U64, U64),
    "cuStreamWaitEvent": (U64, U64, U32),
    "cuEventQuery": (U64,),
    "cuMemcpyAsync": (U64, U64, U64, U64),
    "cuMemcpyBatchAsync_v2": (U64,) * 8,
}
COMPUTE, COPY, ORD0, ORD1 = 100, 200, 11, 12
POOL, STAGING, LANE, SLOT = 1_000_000, 5_000_000, 8, 10  # addresses; lane bytes; lanes per slot


class FakeDriver:
    """Records each call as a tuple; ``fail_launch`` makes that launch (0-based) fail."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.not_ready: set[int] = set()  # events a query reports pending
        self.fail_launch = -1
        self._keep: list[Any] = []

    def __getitem__(self, name: str) -> Any:
        def call(*a: int) -> int:
            if name == "cuEventQuery":
                return kg.CUDA_ERROR_NOT_READY if a[0] in self.not_ready else 0
            if name == "cuLaunchKernel":
                n = sum(1 for c in self.calls if c[0] == "launch")
                self.calls.append(("launch", a[0], a[1], a[8], a[9]))  # function, grid, stream, params
                return 1 if n == self.fail_launch else 0
            if name == "cuEventRecord":
                self.calls.append(("record", a[0], a[1]))
            elif name == "cuStreamWaitEvent":
                self.calls.append(("wait", a[0], a[1]))
            elif name == "cuMemcpyAsync":
                self.calls.append(("copy", a[3], [(a[0], a[1], a[2])]))
            else:
                runs = [tuple(int(x) for x in (ctypes.c_int64 * a[3]).from_address(a[k])) for k in range(3)]
                self.calls.append(("copy", a[7], list(zip(*runs))))
            return 0
        cb = ctypes.CFUNCTYPE(INT, *PROTOS[name])(call)
        self._keep.append(cb)
        return cb


def state(ring: int = 8) -> dict[str, Any]:
    st = np.zeros(kg.S_COUNT, np.int64)
    st[kg.S_RING], st[kg.S_COMPUTE], st[kg.S_COPY], st[kg.S_ORD0], st[kg.S_ORD1] = ring, COMPUTE, COPY, ORD0, ORD1
    st[kg.S_CTAS], st[kg.S_ST_CTAS], st[kg.S_THREADS], st[kg.S_BPC], st[kg.S_SLOT_LANES] = 16, 64, 512, 2, SLOT
    st[kg.S_MAX_CHUNKS], st[kg.S_POOL], st[kg.S_STAGING], st[kg.S_SCALE] = 4, POOL, STAGING, LANE
    st[kg.S_F_G], st[kg.S_F_S], st[kg.S_F_GST], st[kg.S_F_SST] = 1, 2, 3, 4
    runs = np.zeros((3, 4), np.int64)
    st[kg.S_RUNS0], st[kg.S_RUNS1], st[kg.S_RUNS2] = (runs[k].ctypes.data for k in range(3))
    table = np.zeros((7, ring), np.int64)
    table[kg.R_COVER] = np.arange(ring)
    table[kg.R_EVENT] = np.arange(ring) + 300
    for row in (kg.R_P_G, kg.R_P_S, kg.R_P_GST, kg.R_P_SST):
        table[row] = np.arange(ring) + 1000 * row
    rel = np.full((4, 64), -1, np.int64)
    rel[2], rel[3] = np.arange(64) + 400, np.arange(64) + 500
    return {"st": st, "table": table, "rel": rel, "desc": np.zeros((ring, 64), np.int64), "runs": runs,
            "used": np.zeros(9, np.int64)}


def call(enq: Any, s: dict[str, Any], op: int, ids: np.ndarray, bases: np.ndarray, skip: int, pieces: list[list[int]]) -> list[int]:
    n = enq(op, ids, bases, skip, np.array(pieces, np.int64).reshape(-1, 2), s["st"], s["table"], s["rel"], s["desc"],
            s["runs"], s["used"])
    return [int(x) for x in s["used"][:n]]


IDS = np.arange(6, dtype=np.int64) + 40  # 3 chunks of 2 blocks
BASES = np.array([30, 40, 0], np.int64)  # pool slots (lanes): 30 and 40 adjacent


@pytest.fixture(scope="module")
def fake() -> tuple[FakeDriver, Any]:
    drv = FakeDriver()
    return drv, kg._make_enqueue(drv)  # compiled once for the module (~10 s on a small box)


def test_staging_store_then_retrieve_and_zero_copy(fake: tuple[FakeDriver, Any]) -> None:
    drv, enq = fake
    drv.calls.clear()
    s = state()
    assert call(enq, s, kg.OP_STAGING, IDS, BASES, 0, [[0, 1], [1, 3]]) == [0, 1]
    assert s["st"][kg.S_ERR] == 0
    assert drv.calls == [
        ("launch", 3, 64, COMPUTE, 1000 * kg.R_P_GST + 0),  # piece 1: chunk 0 into staging slot 0
        ("record", ORD0, COMPUTE), ("wait", COPY, ORD0),
        ("copy", COPY, [(POOL + 30 * LANE, STAGING, SLOT * LANE)]),
        ("launch", 3, 64, COMPUTE, 1000 * kg.R_P_GST + 1),  # piece 2: chunks 1, 2 (slots 40, 0: two runs)
        ("record", ORD0, COMPUTE), ("wait", COPY, ORD0),
        ("copy", COPY, [(POOL + 40 * LANE, STAGING + 10 * LANE, 80), (POOL, STAGING + 20 * LANE, 80)]),
        ("record", 400, COPY),  # staging run released after the DMAs
        ("record", 301, COMPUTE),  # one event after the call's kernels
    ]
    assert s["desc"][0, :5].tolist() == [1, 0, 0, 40, 41]
    assert s["desc"][1, :8].tolist() == [2, 0, 10, 20, 42, 43, 44, 45]
    assert s["table"][kg.R_COVER, :2].tolist() == [1, 1] and s["rel"][0, :4].tolist() == [0, 0, 0, -1]
    drv.calls.clear()
    # RETRIEVE with 3 blocks held: chunk 0 does not travel, chunk 1 keeps its first block
    assert call(enq, s, kg.OP_STAGING | kg.OP_SCATTER, IDS, BASES, 3, [[0, 1], [1, 2]]) == [2, 3]
    assert drv.calls == [
        ("copy", COPY, [(STAGING, POOL + 40 * LANE, 80)]), ("record", ORD1, COPY), ("wait", COMPUTE, ORD1),
        ("launch", 4, 64, COMPUTE, 1000 * kg.R_P_SST + 2),
        ("copy", COPY, [(STAGING + 10 * LANE, POOL, 80)]), ("record", ORD1, COPY), ("wait", COMPUTE, ORD1),
        ("launch", 4, 64, COMPUTE, 1000 * kg.R_P_SST + 3),
        ("record", 500, COMPUTE), ("record", 303, COMPUTE),
    ]
    assert s["desc"][2, :5].tolist() == [1, 1, 0, 42, 43] and s["desc"][3, :5].tolist() == [1, 0, 10, 44, 45]
    drv.calls.clear()
    # a joined one-chunk STORE takes staging slot 2, which the first STORE's DMAs last read
    assert call(enq, s, kg.OP_STAGING | kg.OP_JOIN, IDS[:2], BASES[:1], 0, [[0, 1]]) == [4]
    assert drv.calls == [
        ("wait", COMPUTE, 400), ("launch", 3, 64, COMPUTE, 1000 * kg.R_P_GST + 4),
        ("record", ORD0, COMPUTE), ("wait", COPY, ORD0), ("copy", COPY, [(POOL + 30 * LANE, STAGING + 20 * LANE, 80)]),
        ("record", 401, COPY), ("record", ORD1, COPY), ("wait", COMPUTE, ORD1), ("record", 304, COMPUTE),
    ]
    drv.calls.clear()
    assert call(enq, s, 0, IDS, BASES, 0, [[0, 0]]) == [5]  # zero-copy: one launch on the pool, 16 CTAs
    assert drv.calls == [("launch", 1, 16, COMPUTE, 1000 * kg.R_P_G + 5), ("record", 305, COMPUTE)]
    assert s["desc"][5, :11].tolist() == [3, 0, 30, 40, 0, 40, 41, 42, 43, 44, 45]


def test_a_full_ring_enqueues_nothing_and_a_failed_launch_stops_the_call(fake: tuple[FakeDriver, Any]) -> None:
    drv, enq = fake
    drv.calls.clear()
    s = state(ring=2)
    assert call(enq, s, 0, IDS, BASES, 0, [[0, 0]]) == [0]
    assert call(enq, s, 0, IDS, BASES, 0, [[0, 0]]) == [1]
    drv.calls.clear()
    drv.not_ready = {300}  # entry 0's kernel has not run yet
    assert call(enq, s, kg.OP_STAGING, IDS, BASES, 0, [[0, 1], [1, 3]]) == []
    assert s["st"][kg.S_ERR] == kg.ERR_RING_FULL and drv.calls == [] and s["st"][kg.S_NEXT] == 0
    s["st"][kg.S_ERR] = 0
    drv.not_ready = set()
    drv.fail_launch = 1
    assert call(enq, s, kg.OP_STAGING, IDS, BASES, 0, [[0, 1], [1, 3]]) == [0, 1]
    assert s["st"][kg.S_ERR] == 1001 and s["st"][kg.S_WHERE] == kg.W_LAUNCH
    names = [c[0] for c in drv.calls]
    assert names == ["launch", "record", "wait", "copy", "launch", "record", "record"]  # no DMA after the failure
    assert drv.calls[-2] == ("record", 400, COPY)  # the staging run released after the DMAs that did go out
    assert drv.calls[-1] == ("record", 301, COMPUTE)  # both entries still covered by an event


# ---- the copy lane: the same calls, made by a thread inside one compiled function ------------

WEV, CEV = 777, 888  # the engine's event, the transfer's completion event


@pytest.fixture(scope="module")
def lane_fn(fake: tuple[FakeDriver, Any]) -> Any:
    lane = kg.make_copy_lane(fake[1])
    kg.warm_copy_lane(lane)  # compiled once for the module, here: not inside a test's timing
    return lane


class Lane:
    """A lane thread over ``state()``: pieces of 1 then the rest (as CudaKVTransfer._pieces with
    growth 4 for up to 4 chunks); each row says whether it goes through staging."""

    def __init__(self, fn: Any, rows: int = 4, ring: int = 8, wake_fd: int = -1) -> None:
        import os
        import threading

        self.s = state(ring)
        mc, bpc = int(self.s["st"][kg.S_MAX_CHUNKS]), int(self.s["st"][kg.S_BPC])
        self.pieces = np.zeros((2, mc + 1, 2, 2), np.int64)
        self.npieces = np.zeros((2, mc + 1), np.int64)
        for m in range(1, mc + 1):
            ps = [(0, 1), (1, m)] if m > 1 else [(0, 1)]
            for sc in (0, 1):
                seq = ps if sc == 0 else [(0, m - 1), (m - 1, m)] if m > 1 else ps
                self.npieces[sc, m] = len(seq)
                self.pieces[sc, m, : len(seq)] = seq
        self.cfg = np.zeros(kg.G_COUNT, np.int64)
        self.cfg[kg.G_BPC] = bpc
        self.cfg[kg.G_MAX_CHUNKS], self.cfg[kg.G_USED] = mc, 3
        self.rows = np.zeros((rows, kg.lane_row_width(mc, bpc, 3)), np.int64)
        self.ctl = np.zeros(kg.C_COUNT, np.int64)
        self.efd = os.eventfd(0)
        self.returned: list[int] = []
        self.watch = np.zeros(kg.WATCH_COUNT, np.int64)  # the waiter's schedule, in ns
        self.watch[[kg.WATCH_WAKE_FD, kg.WATCH_AIM_EARLY, kg.WATCH_FINE, kg.WATCH_FINE_MAX, kg.WATCH_FINE_SPAN, kg.WATCH_MID, kg.WATCH_MID_SPAN,
                    kg.WATCH_SLOW]] = [wake_fd, 20_000, 10_000, 100_000, 2_000_000, 500_000, 50_000_000, 5_000_000]
        self.ctl[kg.C_WATCH] = 1 if wake_fd >= 0 else 0
        s = self.s
        self.thread = threading.Thread(target=lambda: self.returned.append(fn(
            self.ctl, self.rows, self.efd, np.zeros(4, np.int64), np.zeros(2, np.int64), s["st"], s["table"], s["rel"],
            s["desc"], s["runs"], s["used"], self.pieces, self.npieces, np.zeros((1, 2), np.int64), self.cfg,
            self.watch)), daemon=True)
        self.thread.start()
        self.written = 0

    def write(self, kind: int, ids: np.ndarray, bases: np.ndarray, skip: int = 0, staging: bool = False, wev: int = 0,
              cev: int = CEV, due: int = 0) -> int:
        import os

        row = self.rows[self.written % self.rows.shape[0]]
        n = bases.shape[0]
        row[kg.H_KIND], row[kg.H_N], row[kg.H_SKIP], row[kg.H_STAGING], row[kg.H_WEV], row[kg.H_CEV] = kind, n, skip, staging, wev, cev
        row[kg.H_T_DUE] = due
        row[kg.H_IDS : kg.H_IDS + ids.size] = ids
        b0 = kg.H_IDS + int(self.cfg[kg.G_MAX_CHUNKS] * self.cfg[kg.G_BPC])
        row[b0 : b0 + n] = bases
        self.written += 1
        self.ctl[kg.C_WRITTEN] = self.written
        os.eventfd_write(self.efd, 1)
        return self.written - 1

    def wait_done(self, k: int, timeout: float = 10.0) -> None:
        import time

        end = time.monotonic() + timeout
        while self.ctl[kg.C_DONE] < k:
            assert time.monotonic() < end, f"the lane did {self.ctl[kg.C_DONE]} of {k} rows"
            time.sleep(0.001)

    def row(self, seq: int) -> np.ndarray:
        return self.rows[seq % self.rows.shape[0]]

    def stop(self) -> None:
        import os

        self.ctl[kg.C_STOP] = 1
        os.eventfd_write(self.efd, 1)
        self.thread.join(10.0)
        assert not self.thread.is_alive()
        os.close(self.efd)


def test_the_lane_makes_each_rows_calls_in_order_and_writes_the_outcome(fake: tuple[FakeDriver, Any], lane_fn: Any) -> None:
    drv, _ = fake
    drv.calls.clear()
    drv.not_ready = set()
    drv.fail_launch = -1
    lane = Lane(lane_fn)
    try:
        # a lone 1-chunk STORE after the engine's event: zero-copy, its event on the compute stream
        a = lane.write(0, IDS[:2], BASES[:1], wev=WEV)
        lane.wait_done(1)
        assert drv.calls == [("wait", COMPUTE, WEV), ("launch", 1, 16, COMPUTE, 1000 * kg.R_P_G + 0),
                             ("record", 300, COMPUTE), ("record", CEV, COMPUTE)]
        r = lane.row(a)
        assert (r[kg.H_ERR], r[kg.H_RECORDED], r[kg.H_NUSED]) == (0, 1, 1) and r[r.shape[0] - 3] == 0
        assert r[kg.H_T_DONE] >= r[kg.H_T_PICK] > 0
        drv.calls.clear()
        # a 3-chunk STORE through staging, pieces [0,1) [1,3); its copies end on the copy stream
        b = lane.write(0, IDS, BASES, staging=True)
        # and a RETRIEVE of 3 chunks with 3 blocks held (chunk 0 does not travel): staging, m = 2
        c = lane.write(1, IDS, BASES, skip=3, staging=True)
        lane.wait_done(3)
        names = [x[0] for x in drv.calls]
        assert names == ["launch", "record", "wait", "copy", "launch", "record", "wait", "copy", "record", "record",
                         "record",  # b: its completion
                         "copy", "record", "wait", "launch", "copy", "record", "wait", "launch", "record", "record",
                         "record"]  # c: its completion
        i_b = names.index("record", 9) + 1  # after b's release and cover records
        assert drv.calls[10] == ("record", CEV, COPY)  # a staging STORE's completion follows its DMAs
        assert drv.calls[-1] == ("record", CEV, COMPUTE) and i_b == 10
        assert [lane.row(x)[kg.H_NUSED] for x in (b, c)] == [2, 2]
        assert lane.row(c)[lane.rows.shape[1] - 3 : lane.rows.shape[1] - 1].tolist() == [3, 4]
    finally:
        lane.stop()
    assert lane.returned == [3]


def test_the_lane_reports_errors_and_skips_rows_once_failed(fake: tuple[FakeDriver, Any], lane_fn: Any) -> None:
    drv, _ = fake
    drv.calls.clear()
    drv.not_ready = set()
    lane = Lane(lane_fn, rows=2, ring=2)
    try:
        drv.fail_launch = sum(1 for x in drv.calls if x[0] == "launch")  # the next launch fails
        a = lane.write(0, IDS[:2], BASES[:1])
        lane.wait_done(1)
        r = lane.row(a)
        assert r[kg.H_ERR] == 1001 and r[kg.H_WHERE] == kg.W_LAUNCH
        assert r[kg.H_RECORDED] == 1  # still recorded: what went out must land before the slots move on
        drv.fail_launch = -1
        b = lane.write(1, IDS[:2], BASES[:1])  # descriptor entry 1
        lane.wait_done(2)
        assert lane.row(b)[kg.H_ERR] == 0 and lane.row(b)[kg.H_NUSED] == 1
        drv.not_ready = {300}  # entry 0's kernel has not run: the next call finds the ring full
        c = lane.write(1, IDS[:2], BASES[:1])  # (its row reuses a's: two rows)
        lane.wait_done(3)
        assert lane.row(c)[kg.H_ERR] == kg.ERR_RING_FULL and lane.row(c)[kg.H_NUSED] == 0
        assert lane.row(c)[kg.H_RECORDED] == 1
        drv.not_ready = set()
        drv.calls.clear()
        lane.ctl[kg.C_FAILED] = 1  # the instance failed: what the lane has not taken is skipped
        d = lane.write(0, IDS[:2], BASES[:1], wev=WEV)
        lane.wait_done(4)
        assert drv.calls == [] and lane.row(d)[kg.H_ERR] == kg.LANE_SKIPPED and lane.row(d)[kg.H_RECORDED] == 0
    finally:
        drv.fail_launch = -1
        drv.not_ready = set()
        lane.stop()


def test_lane_pause_follows_the_waiters_schedule() -> None:
    watch = np.zeros(kg.WATCH_COUNT, np.int64)
    watch[[kg.WATCH_FINE, kg.WATCH_FINE_MAX, kg.WATCH_FINE_SPAN, kg.WATCH_MID, kg.WATCH_MID_SPAN, kg.WATCH_SLOW]] = [10, 100, 2000, 500, 50000, 5000]
    pauses, last = [], 0
    for _ in range(6):
        last = kg.lane_pause_ns(0, last, watch)
        pauses.append(last)
    assert pauses == [10, 20, 40, 80, 100, 100]
    assert kg.lane_pause_ns(2000, 100, watch) == 500 and kg.lane_pause_ns(50000, 500, watch) == 5000


def test_a_watching_lane_sees_its_rows_end_in_order_and_wakes_the_loop(fake: tuple[FakeDriver, Any], lane_fn: Any) -> None:
    """With a wake-up descriptor the lane also watches: it looks at a row's completion event no
    earlier than just before the row's due time, then at the waiter's pauses; each row it sees
    end is marked, counted (C_SEEN, in order) and a byte goes to the loop. A row the loop
    enqueued itself (K_WATCH) makes no calls and is watched in turn; a row with no recorded event
    ends the watching (the Python waiter goes on), as does the waiter asking it to stop."""
    import os
    import time

    drv, _ = fake
    drv.calls.clear()
    drv.not_ready = set()
    drv.fail_launch = -1
    r, w = os.pipe()
    os.set_blocking(r, False)
    lane = Lane(lane_fn, rows=8, wake_fd=w)

    def wait_seen(k: int) -> None:
        end = time.monotonic() + 10
        while lane.ctl[kg.C_SEEN] < k:
            assert time.monotonic() < end, f"seen {lane.ctl[kg.C_SEEN]} of {k}"
            time.sleep(0.0005)

    try:
        due = time.monotonic_ns() + 80_000_000
        a = lane.write(0, IDS[:2], BASES[:1], cev=901, due=due)  # due in 80 ms
        b = lane.write(kg.K_WATCH, IDS[:0], BASES[:0], cev=902, due=due + 10**10)  # ended: seen right after a
        lane.wait_done(2)
        time.sleep(0.03)
        assert lane.ctl[kg.C_SEEN] == 0  # a's event reads done, but it is not looked at yet
        wait_seen(2)
        ra, rb = lane.row(a), lane.row(b)
        assert ra[kg.H_T_SEEN] >= due - 20_000 and (ra[kg.H_POLLS], ra[kg.H_AIMED], ra[kg.H_Q]) == (1, 1, 0)
        assert (rb[kg.H_POLLS], rb[kg.H_AIMED], rb[kg.H_RECORDED], rb[kg.H_NUSED]) == (1, 0, 1, 0)
        assert [c for c in drv.calls if c[1] == 902] == []  # K_WATCH: no calls
        assert len(os.read(r, 64)) >= 1
        drv.not_ready = {903}  # c's copy runs on: looked at again and again, not seen
        c = lane.write(1, IDS[:2], BASES[:1], cev=903, due=time.monotonic_ns())
        time.sleep(0.05)
        assert lane.ctl[kg.C_SEEN] == 2
        drv.not_ready = set()
        wait_seen(3)
        rc = lane.row(c)
        assert rc[kg.H_POLLS] > 3 and 10_000 <= rc[kg.H_PAUSE] <= 5_000_000 and rc[kg.H_Q] == 0
        # a row whose event was never recorded: the lane stops watching there
        lane.write(kg.K_WATCH, IDS[:0], BASES[:0], cev=0)
        lane.write(0, IDS[:2], BASES[:1], cev=905)
        lane.wait_done(5)
        end = time.monotonic() + 10
        while lane.ctl[kg.C_WATCH_OFF] == 0:
            assert time.monotonic() < end
            time.sleep(0.001)
        assert lane.ctl[kg.C_WATCH] == 0 and lane.ctl[kg.C_SEEN] == 3
    finally:
        lane.stop()
        os.close(r)
        os.close(w)
    # the waiter's stop: it clears C_WATCH and the lane answers C_WATCH_OFF
    r, w = os.pipe()
    lane = Lane(lane_fn, wake_fd=w)
    try:
        drv.not_ready = {906}
        lane.write(0, IDS[:2], BASES[:1], cev=906, due=time.monotonic_ns())
        lane.wait_done(1)
        time.sleep(0.01)
        lane.ctl[kg.C_WATCH] = 0
        os.eventfd_write(lane.efd, 1)
        end = time.monotonic() + 10
        while lane.ctl[kg.C_WATCH_OFF] == 0:
            assert time.monotonic() < end
            time.sleep(0.001)
        drv.not_ready = set()
        time.sleep(0.02)
        assert lane.ctl[kg.C_SEEN] == 0
        lane.ctl[kg.C_FAILED] = 1  # a failed instance's K_WATCH row is not skipped: the loop enqueued it
        x = lane.write(kg.K_WATCH, IDS[:0], BASES[:0], cev=907)
        lane.wait_done(2)
        assert lane.row(x)[kg.H_ERR] == 0 and lane.row(x)[kg.H_RECORDED] == 1
    finally:
        drv.not_ready = set()
        lane.stop()
        os.close(r)
        os.close(w)
