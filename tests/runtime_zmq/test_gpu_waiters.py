"""The GPU executor's completion logic without a GPU: a fake CUDA driver whose streams can be
made to hang (an engine's event that never fires). One waiter per instance, cuEventQuery only,
per-transfer deadlines: a stuck instance is failed and unregistered, the others finish on time,
and no slot is reported free while a copy into it may still run."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from mpcache.core_sm.effects import StartTransfer
from mpcache.core_sm.messages import TransferKind
from mpcache.runtime_zmq import gpu_ipc
from mpcache.runtime_zmq.gpu_transfer import (
    IPC_EVENT_HANDLE_BYTES,
    GpuTransferExecutor,
    check_layer_ranges,
    registered_event_handles,
)

SUCCESS, NOT_READY = 0, 600
C, BS = 8, 4  # 2 blocks per chunk


class Stream:
    def __init__(self) -> None:
        self.stuck = False
        self.busy_until = 0.0  # monotonic time its copies end (the query decides, not a timer thread)


class Event:
    stream: Stream | None = None


class Driver:
    CUresult = SimpleNamespace(CUDA_SUCCESS=SUCCESS, CUDA_ERROR_NOT_READY=NOT_READY)

    def __init__(self) -> None:
        self.queries = 0
        self.looks: list[tuple[float, float]] = []  # each query: (when, when its stream's copies end)

    def cuEventQuery(self, ev: Event) -> tuple[int]:
        self.queries += 1
        s = ev.stream
        self.looks.append((time.monotonic(), s.busy_until if s is not None else 0.0))
        return (NOT_READY if s is not None and (s.stuck or time.monotonic() < s.busy_until) else SUCCESS,)

    def cuEventRecord(self, ev: Event, stream: Stream) -> tuple[int]:
        ev.stream = stream
        return (SUCCESS,)

    def cuStreamWaitEvent(self, stream: Stream, ev: Any, flags: int) -> tuple[int]:
        return (SUCCESS,)


class Transfer:
    """Stands in for CudaKVTransfer: records calls; has no synchronize() at all."""

    memcpy_path = "none"

    def __init__(self) -> None:
        self.next = 0
        self.neutralized: list[int] = []

    def uses_staging(self, n: int, busy: bool = False) -> bool:
        return n >= 4

    def completion_stream(self) -> Any:
        return self.stream

    def wait_event(self, ev: Any) -> None:
        pass

    def record_completion(self, ev: Event) -> None:
        ev.stream = self.stream

    def raw_streams(self) -> list[Any]:
        return [self.stream]

    def _call(self) -> list[int]:
        self.next += 1
        return [self.next]

    def gather(self, ids: Any, offs: Any, **kw: Any) -> list[int]:
        return self._call()

    def scatter(self, offs: Any, ids: Any, skip: int, **kw: Any) -> list[int]:
        return self._call()

    def neutralize(self, entries: list[int]) -> None:
        self.neutralized += entries


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    drv = Driver()
    closed: list[int] = []
    monkeypatch.setattr(gpu_ipc, "driver", lambda: drv)
    monkeypatch.setattr(gpu_ipc, "ensure_context", lambda ordinal=0: None)
    monkeypatch.setattr(gpu_ipc, "create_completion_event", Event)
    monkeypatch.setattr(gpu_ipc, "destroy_event", lambda ev: None)
    monkeypatch.setattr(gpu_ipc, "open_event", lambda h: Event())
    monkeypatch.setattr(gpu_ipc, "open_memory", lambda h: 0x1000 * h[0])
    monkeypatch.setattr(gpu_ipc, "close_memory", closed.append)
    return {"driver": drv, "closed": closed}


def geometry() -> Any:
    return SimpleNamespace(block_size=BS, blocks_per_chunk=C // BS, slot_bytes=1 << 20)


def add(ex: GpuTransferExecutor, iid: int, handle: bytes) -> tuple[Any, Stream, Transfer]:
    stream, transfer = Stream(), Transfer()
    transfer.stream = stream  # type: ignore[attr-defined]
    ex._opened.open(handle)
    inst = ex._add_instance(iid, geometry(), transfer, [handle], stream, 1 << 20)
    return inst, stream, transfer


def st(tid: int, iid: int, n_chunks: int, kind: TransferKind = TransferKind.STORE) -> StartTransfer:
    return StartTransfer(tid, kind, iid, f"r{tid}", None, 0, n_chunks * C, tuple((i, i) for i in range(n_chunks)),
                         tuple(range(n_chunks * C // BS)), 0)


class Done:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.results: dict[int, tuple[bool, float]] = {}

    def __call__(self, tid: int, ok: bool) -> None:
        with self.lock:
            assert tid not in self.results, f"transfer {tid} reported twice"
            self.results[tid] = (ok, time.monotonic())

    def wait(self, tids: set[int], timeout: float = 5.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if tids <= set(self.results):
                    return
            time.sleep(0.005)
        raise AssertionError(f"not reported in time: {sorted(tids - set(self.results))}")


def test_a_stuck_instance_is_failed_and_the_others_finish(fake_cuda: dict[str, Any]) -> None:
    ex = GpuTransferExecutor(C, transfer_timeout_s=0.3, warm_events=4)
    done = Done()
    a, a_stream, a_transfer = add(ex, 1, b"\x01" * 64)
    b, b_stream, _ = add(ex, 2, b"\x02" * 64)
    a_stream.stuck = True
    t0 = time.monotonic()
    ex.start(st(10, 1, 1), b"e" * 64, done)  # first in line: held until its copy ends
    ex.start(st(11, 1, 4), b"e" * 64, done)  # staging store: its DMA into L1 cannot be cancelled
    ex.start(st(12, 1, 1), b"e" * 64, done)  # zero-copy store: neutralized, reported at the deadline
    ex.start(st(13, 1, 2, TransferKind.RETRIEVE), b"e" * 64, done)  # retrieve: neutralized, reported
    ex.start(st(20, 2, 2), b"f" * 64, done)
    done.wait({20})
    assert done.results[20][0] is True and done.results[20][1] - t0 < 0.2  # B is not held up by A
    done.wait({12, 13}, timeout=3.0)
    assert not done.results[12][0] and not done.results[13][0]
    assert done.results[12][1] - t0 >= 0.3
    assert 10 not in done.results and 11 not in done.results  # their slots stay pinned
    assert sorted(a_transfer.neutralized) == [1, 2, 3, 4]
    assert 1 not in ex._instances and 2 in ex._instances
    assert ex.stats()["instances_failed"] == 1
    ex.start(st(14, 1, 1), b"e" * 64, done)  # A is unregistered: refused at once
    assert done.results[14][0] is False
    ex.start(st(21, 2, 1), b"f" * 64, done)
    done.wait({21})
    assert done.results[21][0] is True
    assert fake_cuda["closed"] == []  # A's memory stays mapped while its copies are queued
    a_stream.stuck = False  # the engine's event fires at last
    done.wait({10, 11})
    assert not done.results[10][0] and not done.results[11][0]
    a.waiter.join(2.0)
    assert not a.waiter.is_alive() and fake_cuda["closed"] == [0x1000]
    ex.close()
    assert fake_cuda["closed"] == [0x1000, 0x2000]
    s = ex.stats()
    assert s["finished"] == 2 and s["failed"] == 4 and s["in_flight"] == 0


def test_unregister_never_waits_and_closes_after_the_copies(fake_cuda: dict[str, Any]) -> None:
    ex = GpuTransferExecutor(C, transfer_timeout_s=5.0, warm_events=4)
    done = Done()
    inst, stream, _ = add(ex, 1, b"\x03" * 64)
    stream.stuck = True
    ex.start(st(1, 1, 2), b"e" * 64, done)
    t0 = time.monotonic()
    ex.unregister_instance(1)
    assert time.monotonic() - t0 < 0.05 and 1 not in ex._instances
    time.sleep(0.05)
    assert done.results == {} and fake_cuda["closed"] == []
    stream.stuck = False
    done.wait({1})
    assert done.results[1][0] is True  # the copy it had queued really landed
    inst.waiter.join(2.0)
    assert fake_cuda["closed"] == [0x3000]
    ex.close()


def test_waiter_sleeps_until_the_copy_should_be_done(fake_cuda: dict[str, Any]) -> None:
    """A 32-chunk store at 50 GB/s takes ~0.67 ms of link time per MiB chunk here; the waiter
    polls a handful of times, not in a busy loop."""
    ex = GpuTransferExecutor(C, transfer_timeout_s=5.0, warm_events=4, link_gbps=0.5)  # 1 MiB chunk: 2 ms
    done = Done()
    inst, stream, _ = add(ex, 1, b"\x04" * 64)
    # the copy ends at 30 ms, decided by the fake driver's clock: a timer thread started late on
    # a loaded box would leave it "running" past the expected 32 ms, into the 50 us polls
    stream.busy_until = time.monotonic() + 0.03
    before = fake_cuda["driver"].queries
    ex.start(st(1, 1, 16), b"", done)  # 32 ms expected
    done.wait({1})
    assert fake_cuda["driver"].queries - before < 40
    ex.close()


def test_layer_ranges() -> None:
    check_layer_ranges([(0, 1000, 0, 100), (0, 1000, 100, 100), (5000, 100, 0, 100)], 100)
    with pytest.raises(ValueError, match="outside"):
        check_layer_ranges([(0, 1000, 950, 100)], 100)
    with pytest.raises(ValueError, match="outside"):
        check_layer_ranges([(0, 1000, -8, 100)], 100)
    with pytest.raises(ValueError, match="declares"):
        check_layer_ranges([(0, 1000, 0, 64)], 100)
    with pytest.raises(ValueError, match="overlap"):
        check_layer_ranges([(0, 1000, 0, 100), (0, 1000, 50, 100)], 100)
    with pytest.raises(ValueError, match="layers 0 and 2 overlap"):
        check_layer_ranges([(0, 1000, 200, 100), (0, 1000, 0, 100), (0, 1000, 200, 100)], 100)


def test_announced_event_handles_are_checked() -> None:
    ok = [bytes([i]) * IPC_EVENT_HANDLE_BYTES for i in range(3)]
    assert registered_event_handles({}) == []
    assert registered_event_handles({"event_handles": ok + [ok[0]]}) == ok  # repeats opened once
    for bad in ("x" * 64, [b"x" * 63], [bytearray(64)], [ok[0]] * 0 + [None], ok * 6):
        with pytest.raises(ValueError, match="event_handles"):
            registered_event_handles({"event_handles": bad})


def test_announced_events_are_opened_at_registration(fake_cuda: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[bytes] = []
    monkeypatch.setattr(gpu_ipc, "open_event", lambda h: opened.append(h) or Event())
    ex = GpuTransferExecutor(C, warm_events=2)
    handle = b"e" * IPC_EVENT_HANDLE_BYTES
    inst, _stream, _transfer = add(ex, 1, b"\x01h")
    ex._open_registered_events(inst, [handle])
    assert opened == [handle]
    done = Done()
    ex.start(st(1, 1, 1), handle, done)  # the request names the announced event: no second open
    done.wait({1})
    assert opened == [handle] and done.results[1][0]
    ex.close()


def test_an_announced_event_that_cannot_be_opened_refuses_the_registration(
        fake_cuda: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(h: bytes) -> Any:
        raise RuntimeError("cuIpcOpenEventHandle: invalid handle")
    monkeypatch.setattr(gpu_ipc, "open_event", refuse)
    ex = GpuTransferExecutor(C, warm_events=2)
    inst, _stream, _transfer = add(ex, 1, b"\x01h")
    with pytest.raises(ValueError, match=r"event_handles\[0\] cannot be opened"):
        ex._open_registered_events(inst, [b"e" * IPC_EVENT_HANDLE_BYTES])
    done = Done()
    ex.start(st(1, 1, 1), b"", done)  # the instance is gone: its transfers fail at once
    done.wait({1})
    assert done.results[1][0] is False
    ex.close()


def test_the_link_model_learns_when_copies_end(fake_cuda: dict[str, Any]) -> None:
    """Configured at 3x the rate the copies really move at, the waiters learn from the copies
    they see end: the first look then comes when a copy is due, not 5 ms early followed by a
    hundred polls."""
    ex = GpuTransferExecutor(C, transfer_timeout_s=5.0, warm_events=4, link_gbps=1.5)
    real = 0.5e9  # bytes/s: a 4-chunk (4 MiB) copy takes 8.4 ms, the model says 2.8
    done = Done()
    inst, stream, _ = add(ex, 1, b"\x05" * 64)
    drv = fake_cuda["driver"]
    early_ms = []  # how long before its copy ended each transfer's first look came
    for tid in range(1, 15):
        first = len(drv.looks)
        stream.busy_until = time.monotonic() + 4 * (1 << 20) / real
        ex.start(st(tid, 1, 4), b"", done)
        done.wait({tid})
        looked, due = drv.looks[first]
        early_ms.append((due - looked) * 1e3)
    predicted = inst.links[TransferKind.STORE].duration(4 << 20)
    assert 0.0075 <= predicted <= 0.0095, predicted
    assert ex.stats()["link_lat_us_retrieve"] == 0  # the other direction saw no copy
    # taught, the first look comes when the copy is due (5% sooner: 0.4 ms), where the untaught
    # model looked 5.6 ms early. (A loaded box only makes looks later, so this holds under load;
    # counting the looks did not: their number follows how late each pause wakes.)
    assert max(early_ms[-5:]) < 1.5, early_ms
    ex.close()


def test_copies_queued_behind_others_teach_the_link_rate(fake_cuda: dict[str, Any]) -> None:
    """Eight copies started at once end one after another at half the configured rate: each
    after the first moved its bytes between the end before it and its own, which is the
    link's rate; none had the link to itself throughout, so none says its latency. (Their flights
    from their start, k + 1 copies long, would make a copy look up to 8x longer than it is.)"""
    ex = GpuTransferExecutor(C, transfer_timeout_s=5.0, warm_events=4, link_gbps=1.0)
    done = Done()
    inst, _, transfer = add(ex, 1, b"\x06" * 64)
    other, _, _ = add(ex, 2, b"\x07" * 64)  # another engine: its own line, its own model
    copy_s = 4 * (1 << 20) / 0.5e9  # 8.4 ms each; the model says 4.2
    t0 = time.monotonic()
    ends = iter(range(1, 9))

    def record_completion(ev: Event) -> None:  # each copy ends after the one before it
        ev.stream = Stream()
        ev.stream.busy_until = t0 + next(ends) * copy_s

    transfer.record_completion = record_completion  # type: ignore[method-assign]
    for tid in range(1, 9):
        ex.start(st(tid, 1, 4), b"", done)
    done.wait(set(range(1, 9)))
    rate = inst.links[TransferKind.STORE].rate
    assert 430e6 <= rate <= 580e6, rate
    assert other.links[TransferKind.STORE].rate == 1e9
    s = ex.stats()
    assert s["link_mbps_store"] == int((rate + 1e9) / 2 / 1e6)  # the mean over the live instances
    # the first started alone, but the others started during its flight: not the link's latency
    assert s["link_lat_us_store"] == 0
    ex.close()


def test_link_model() -> None:
    from mpcache.runtime_zmq.gpu_transfer import LinkModel

    m = LinkModel(60e9)
    m.learn_alone(32 << 20, 0.25e-3 + (32 << 20) / 60e9)  # the first sample is taken whole
    assert abs(m.lat - 0.25e-3) < 1e-9
    for _ in range(30):
        m.learn_queued(32 << 20, (32 << 20) / 54e9)
    assert abs(m.rate / 54e9 - 1) < 0.01
    for _ in range(30):
        m.learn_alone(32 << 20, 0.25e-3 + (32 << 20) / 54e9)
    assert abs(m.duration(32 << 20) - (0.25e-3 + (32 << 20) / 54e9)) < 2e-6
    lat = m.lat
    m.sooner(alone=True)  # a lone copy found done at the first look: less latency
    assert abs(m.lat - 0.95 * lat) < 1e-12
    rate = m.rate
    m.sooner(alone=False)  # a queued one: a faster link
    assert abs(m.rate - rate / 0.95) < 1.0
    slow = LinkModel(60e9, lat=0.005)  # 5 ms of latency the link no longer has
    for _ in range(60):
        slow.sooner(alone=True)
    assert slow.duration(32 << 20) < 0.001
    wild = LinkModel(60e9)
    wild.learn_alone(32 << 20, 0.8e-3)
    wild.learn_alone(32 << 20, 5.0)  # an engine's event that fired seconds late: not the link
    wild.learn_queued(32 << 20, 5.0)
    assert abs(wild.duration(32 << 20) - 0.8e-3) < 1e-9
    fast = LinkModel(60e9)
    for _ in range(100):
        fast.learn_queued(32 << 20, 1e-9)  # never past 2x the configured rate
        fast.sooner(alone=False)
    assert fast.rate == 120e9


def test_close_leaves_l1_pinned_while_copies_are_queued(fake_cuda: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine's event that never fires holds copies queued on L1: unpinning L1 then would wait
    for them forever (cuMemHostUnregister), so close leaves it pinned and returns; with nothing
    queued it unpins as before."""
    unpinned: list[int] = []
    monkeypatch.setattr(gpu_ipc, "unregister_host", unpinned.append)
    for stuck in (True, False):
        ex = GpuTransferExecutor(C, transfer_timeout_s=0.05, warm_events=2)
        pool = SimpleNamespace(address=0xA000 + stuck)
        ex._pools[id(pool)] = (pool, 0xB000)  # type: ignore[assignment]
        done = Done()
        inst, stream, _ = add(ex, 1, b"\x0b" * 64)
        stream.stuck = stuck
        ex.start(st(1, 1, 1), b"", done)
        t0 = time.monotonic()
        ex.close()
        assert time.monotonic() - t0 < 10.0
        assert unpinned == ([] if stuck else [0xA000])
        assert inst.waiter.is_alive() is stuck
        stream.stuck = False  # let the waiter of the stuck one end
