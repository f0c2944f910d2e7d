"""L2 outages: a Redis down at start (L1-only, reconnect with backoff, or refuse with
--l2-require), a hung Redis (SIGSTOP) that must not pin L1 slots past the effect deadline, the
circuit breaker, a bounded queue that drops write-behind first, and batched tier calls."""
from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from live_server import ServerProcess, wait_for
from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.effects import ProbeL2, ReadL2, WriteL2
from mpcache.core_sm.messages import L2ProbeFinished, L2ReadFinished, L2WriteFinished
from mpcache.runtime_zmq.client import MPCacheClient
from mpcache.runtime_zmq.l1_pool import SharedMemoryPool
from mpcache.runtime_zmq.l2 import L2Unavailable, open_tier
from mpcache.runtime_zmq.l2_health import Breaker, BreakerState
from mpcache.runtime_zmq.l2_worker import L2Options, L2Worker
from test_server_ops import key, tokens

redis_server_mod = pytest.importorskip("redis_server")
RedisServer = redis_server_mod.RedisServer
free_port = redis_server_mod.free_port


def test_breaker_opens_backs_off_and_closes() -> None:
    b = Breaker(threshold=3, backoff_s=1.0, backoff_max_s=4.0)
    assert b.allow(0.0)
    assert not b.failure(0.0) and not b.failure(0.1)
    assert b.failure(0.2) and b.state is BreakerState.OPEN
    assert not b.allow(0.5) and not b.due(0.5)
    assert b.due(1.2) and b.allow(1.2) and b.state is BreakerState.HALF_OPEN
    assert not b.allow(1.3)  # one trial at a time
    b.failure(1.4)  # the trial failed: open again, backoff doubled
    assert b.state is BreakerState.OPEN and b.retry_at == pytest.approx(3.4)
    assert b.allow(3.5)
    b.failure(3.5)
    assert b.allow(7.5)
    b.failure(7.5)
    assert b.retry_at == pytest.approx(11.5)  # capped at 4 s
    assert b.allow(11.6)
    b.success()
    assert b.state is BreakerState.CLOSED and b.backoff_s == 1.0 and b.allow(11.7)
    assert b.allow(20.0)  # a trial that never reported is retried after one backoff


class Recorder:
    """An in-memory tier that records its calls (and can be made to block)."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.calls: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def read(self, k: bytes) -> bytes | None:
        self.calls.append("read")
        return self.data.get(k)

    def read_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        self.gate.wait(30)
        self.calls.append(f"read_many:{len(keys)}")
        return [self.data.get(k) for k in keys]

    def contains(self, k: bytes) -> bool:
        self.calls.append("contains")
        return k in self.data

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        self.calls.append(f"contains_many:{len(keys)}")
        return [k in self.data for k in keys]

    def write(self, k: bytes, v: bytes) -> None:
        self.data[k] = v

    def write_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        self.gate.wait(30)
        self.calls.append(f"write_many:{len(items)}")
        for k, v in items:
            self.data[k] = v

    def close(self) -> None:
        self.gate.set()


class Harness:
    def __init__(self, tiers: list[Any], workers: int = 2, **options: Any) -> None:
        self.dir = tempfile.mkdtemp(prefix="mpcache-l2o-")
        self.pool = SharedMemoryPool(16 << 20, 1 << 20, directory=self.dir)
        self.posted: list[Any] = []
        self.cond = threading.Condition()
        options.setdefault("secret_file", os.path.join(self.dir, "secret"))
        self.worker = L2Worker(tiers, self.pool, self.post, workers=workers, options=L2Options(**options))

    def post(self, ev: Any) -> None:
        with self.cond:
            self.posted.append(ev)
            self.cond.notify_all()

    def wait_for(self, pred: Callable[[list[Any]], bool], timeout: float = 10.0) -> list[Any]:
        with self.cond:
            assert self.cond.wait_for(lambda: pred(self.posted), timeout), self.posted
            return list(self.posted)

    def close(self) -> None:
        self.worker.close()
        self.pool.close()


def _keys(n: int, seed: int = 0) -> list[ObjectKey]:
    return [ObjectKey(bytes([seed, i]) * 8, 0) for i in range(n)]


def test_reads_probes_and_writes_are_one_batched_call_per_tier() -> None:
    tier = Recorder()
    h = Harness([tier])
    try:
        ks = _keys(4)
        h.worker.write(WriteL2(1, tuple((k, i) for i, k in enumerate(ks))))
        h.wait_for(lambda p: L2WriteFinished(1, True) in p)
        h.worker.probe(ProbeL2(2, tuple(ks) + (ObjectKey(b"\x09" * 16, 0),)))
        h.wait_for(lambda p: L2ProbeFinished(2, (True,) * 4 + (False,)) in p)
        h.worker.read(ReadL2(3, tuple((k, 4 + i) for i, k in enumerate(ks))))
        h.wait_for(lambda p: L2ReadFinished(3, (True,) * 4) in p)
        assert tier.calls == ["write_many:4", "contains_many:5", "read_many:4"]
    finally:
        h.close()


def test_full_queue_drops_write_behind_first() -> None:
    tier = Recorder()
    tier.gate.clear()  # the only worker blocks in the tier
    h = Harness([tier], workers=1, queue_max=2, deadline_s=30)
    try:
        k = _keys(8)
        h.worker.read(ReadL2(1, ((k[0], 0),)))  # runs (blocked)
        time.sleep(0.1)
        h.worker.write(WriteL2(2, ((k[1], 1),)))  # queued
        h.worker.write(WriteL2(3, ((k[2], 2),)))  # queued: the queue is full now
        h.worker.write(WriteL2(4, ((k[3], 3),)))  # dropped at once: a write into a full queue
        h.wait_for(lambda p: L2WriteFinished(4, False) in p)
        h.worker.read(ReadL2(5, ((k[4], 4),)))  # a read pushes out the oldest queued write
        h.wait_for(lambda p: L2WriteFinished(2, False) in p)
        h.worker.read(ReadL2(6, ((k[5], 5),)))  # and the next one
        h.wait_for(lambda p: L2WriteFinished(3, False) in p)
        h.worker.read(ReadL2(7, ((k[6], 6),)))  # a queue full of reads refuses a read
        h.wait_for(lambda p: L2ReadFinished(7, (False,)) in p)
        s = h.worker.stats()
        assert s["l2_writes_dropped"] == 3 and s["l2_reads_refused"] == 1 and s["l2_queued"] == 2
        tier.gate.set()
        h.wait_for(lambda p: len(p) == 7)
        assert h.worker.in_flight == 0
    finally:
        h.close()


def test_deadline_fails_a_stuck_read_and_the_late_bytes_never_reach_the_slot() -> None:
    tier = Recorder()
    ks = _keys(1)
    h = Harness([tier], deadline_s=0.3, min_bytes_per_s=1e12)
    try:
        h.worker.write(WriteL2(1, ((ks[0], 0),)))
        h.wait_for(lambda p: L2WriteFinished(1, True) in p)
        tier.gate.clear()
        h.pool.write(3, b"\x5a" * 4096)
        started = time.monotonic()
        h.worker.read(ReadL2(2, ((ks[0], 3),)))
        h.wait_for(lambda p: L2ReadFinished(2, (False,)) in p)
        assert 0.25 < time.monotonic() - started < 1.5
        tier.gate.set()  # the tier answers, late: its bytes are dropped
        assert wait_for(lambda: h.worker.in_flight == 0, timeout=5.0)
        assert bytes(h.pool.view(3, 4096)) == b"\x5a" * 4096
        assert h.worker.stats()["l2_deadline_expired"] == 1
    finally:
        h.close()


def test_redis_down_at_start_runs_l1_only_then_reconnects() -> None:
    port = free_port()
    tier = open_tier(f"redis://127.0.0.1:{port}/0?timeout=0.3")
    h = Harness([tier], breaker_backoff_s=0.2, breaker_backoff_max_s=0.5)
    try:
        assert h.worker.tier_states()[0]["state"] == "open"
        started = time.monotonic()
        h.worker.read(ReadL2(1, ((_keys(1)[0], 0),)))
        h.wait_for(lambda p: L2ReadFinished(1, (False,)) in p)
        assert time.monotonic() - started < 0.2  # skipped, not waited for
        with RedisServer(port=port):
            assert wait_for(lambda: h.worker.tier_states()[0]["state"] == "closed", timeout=10.0)
            k = _keys(1, seed=5)[0]
            h.pool.write(0, b"r" * 100)
            h.worker.note_slot_size(0, 100)
            h.worker.write(WriteL2(2, ((k, 0),)))
            h.wait_for(lambda p: L2WriteFinished(2, True) in p)
            h.worker.read(ReadL2(3, ((k, 1),)))
            h.wait_for(lambda p: L2ReadFinished(3, (True,)) in p)
    finally:
        h.close()


def test_required_tier_down_refuses_to_start() -> None:
    tier = open_tier(f"redis://127.0.0.1:{free_port()}/0?timeout=0.3")
    with pytest.raises(L2Unavailable, match="required"):
        Harness([tier], require=True)


@pytest.fixture
def stoppable_redis() -> Iterator[Any]:
    try:
        server = RedisServer()
        server.start()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    yield server
    try:
        os.kill(server.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    server.stop()


def test_hung_redis_never_pins_slots_past_the_deadline(
    start_server: Callable[..., ServerProcess], stoppable_redis: Any
) -> None:
    secret = tempfile.mkdtemp(prefix="mpcache-secret-") + "/s"
    sp = start_server("--l2", stoppable_redis.url + "?timeout=5", "--l2-deadline", "1", "--l2-secret-file", secret,
                      "--no-l2-probe")
    c = MPCacheClient(sp.url, request_timeout=10.0)
    try:
        os.kill(stoppable_redis.pid, signal.SIGSTOP)
        durations = []
        for i in range(4):
            started = time.monotonic()
            c.lookup(key(tokens(1, seed=i), f"hung{i}")).result(5)
            assert c.wait_prefetch_status(f"hung{i}", 10.0).result(12) == 0  # a miss, not an error
            durations.append(time.monotonic() - started)
            assert wait_for(lambda: c.stats()["pinned_effects"] == 0, timeout=3.0)  # slots back
        s = c.stats()
        assert s["quarantined_slots"] == 0 and s["free_slots"] == s["l1_num_slots"]
        # the first reads ran into the deadline (~1 s each), which opened the breaker; from then
        # on the tier is skipped but for one trial per backoff (which is again held to the deadline)
        assert s["l2_deadline_expired"] >= 3 and s["l2_breaker_opened"] >= 1
        assert all(d < 3.0 for d in durations), durations
        assert c.health()["l2_tiers"][0]["state"] in ("open", "half_open")
        os.kill(stoppable_redis.pid, signal.SIGCONT)
        assert wait_for(lambda: c.health()["l2_tiers"][0]["state"] == "closed", timeout=15.0)
    finally:
        c.close()


def test_server_starts_l1_only_or_refuses_with_l2_require(start_server: Callable[..., ServerProcess]) -> None:
    secret = tempfile.mkdtemp(prefix="mpcache-secret-") + "/s"
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0?timeout=0.3"
    sp = start_server("--l2", url, "--l2-secret-file", secret)
    with MPCacheClient(sp.url, request_timeout=5.0) as c:
        c.lookup(key(tokens(1), "l1only")).result(5)
        assert c.wait_prefetch_status("l1only", 5.0).result(6) == 0
        assert c.health()["l2_tiers"][0]["state"] in ("open", "half_open")
    sp.terminate()
    out = sp.output()
    assert "starting L1-only" in out and "hunter2" not in out and ":***@" in out
    with pytest.raises(RuntimeError, match="required and does not answer") as info:
        start_server("--l2", url, "--l2-secret-file", secret, "--l2-require")
    assert "hunter2" not in str(info.value)


def test_disk_tier_has_a_default_cap(tmp_path: Any) -> None:
    tier = open_tier(f"disk:{tmp_path / 'l2'}")
    try:
        st = os.statvfs(str(tmp_path))
        assert tier.max_bytes is not None  # type: ignore[attr-defined]
        assert 0 < tier.max_bytes <= st.f_bavail * st.f_frsize  # type: ignore[attr-defined]
        assert "cap" in tier.name
    finally:
        tier.close()


def test_large_effects_move_in_bounded_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    import mpcache.runtime_zmq.l2_worker as l2w

    monkeypatch.setattr(l2w, "BATCH_BYTES", 3 << 20)  # three 1 MiB objects per tier call
    tier = Recorder()
    h = Harness([tier])
    try:
        ks = _keys(8)
        h.worker.write(WriteL2(1, tuple((k, i) for i, k in enumerate(ks)), object_bytes=1 << 20))
        h.wait_for(lambda p: L2WriteFinished(1, True) in p)
        h.worker.read(ReadL2(2, tuple((k, 8 + i) for i, k in enumerate(ks)), object_bytes=1 << 20))
        h.wait_for(lambda p: L2ReadFinished(2, (True,) * 8) in p)
        assert tier.calls == ["write_many:3", "write_many:3", "write_many:2",
                              "read_many:3", "read_many:3", "read_many:2"]
    finally:
        h.close()


class StreamingRecorder(Recorder):
    """A Recorder that hands values over one by one (``read_each``), as the Redis tier does;
    ``between`` is waited for before each value after the first."""

    def __init__(self) -> None:
        super().__init__()
        self.between = threading.Event()
        self.between.set()

    def read_each(self, keys: Sequence[bytes], on_value: Callable[[int, memoryview | None], None],
                  limit: int | None = None) -> None:
        self.calls.append(f"read_each:{len(keys)}")
        for i, k in enumerate(keys):
            if i:
                self.between.wait(30)
            v = self.data.get(k)
            on_value(i, None if v is None else memoryview(bytearray(v)))


def test_a_streaming_tier_loads_each_value_into_its_slot() -> None:
    tier = StreamingRecorder()
    h = Harness([tier])
    try:
        ks = _keys(3)
        for i in range(3):
            h.pool.write(i, bytes([i + 1]) * 5000)
            h.worker.note_slot_size(i, 5000)
        h.worker.write(WriteL2(1, tuple((k, i) for i, k in enumerate(ks))))
        h.wait_for(lambda p: L2WriteFinished(1, True) in p)
        h.worker.read(ReadL2(2, ((ks[0], 8), (ObjectKey(b"\x09" * 16, 0), 9), (ks[2], 10))))
        h.wait_for(lambda p: L2ReadFinished(2, (True, False, True)) in p)
        assert bytes(h.pool.view(8, 5000)) == b"\x01" * 5000 and bytes(h.pool.view(10, 5000)) == b"\x03" * 5000
        assert tier.calls == ["write_many:3", "read_each:3"]
    finally:
        h.close()


def test_a_streaming_read_past_its_deadline_writes_no_slot_after_it() -> None:
    tier = StreamingRecorder()
    ks = _keys(2)
    h = Harness([tier], deadline_s=0.3, min_bytes_per_s=1e12)
    try:
        h.worker.write(WriteL2(1, ((ks[0], 0), (ks[1], 1))))
        h.wait_for(lambda p: L2WriteFinished(1, True) in p)
        h.pool.write(3, b"\x5a" * 4096)
        h.pool.write(4, b"\x5a" * 4096)
        tier.between.clear()  # the first value lands, the second only after the deadline
        h.worker.read(ReadL2(2, ((ks[0], 3), (ks[1], 4))))
        h.wait_for(lambda p: L2ReadFinished(2, (False, False)) in p)
        tier.between.set()
        assert wait_for(lambda: h.worker.in_flight == 0, timeout=5.0)
        assert bytes(h.pool.view(4, 4096)) == b"\x5a" * 4096  # the late value never reached its slot
        assert h.worker.stats()["l2_deadline_expired"] == 1
    finally:
        h.close()
