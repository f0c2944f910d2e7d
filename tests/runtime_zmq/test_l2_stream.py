"""Reads from Redis land straight in their L1 slots (issue "Latency", item 5): the tier hands each
value over before it is read (``RedisTier.read_into``), the L2 worker reads the seal's header into
a small buffer and the payload into the slot, feeding the MAC piece by piece as it arrives. A
value damaged anywhere, cut short, too long or absent is a miss (counted, logged, deleted where it
is damaged), the other values of the read still load, the connection stays in step, and a read
given up at its deadline writes no slot after it was reported."""
from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install '.[redis]')")

from mpcache.core_sm.chunks import ObjectKey  # noqa: E402
from mpcache.core_sm.effects import ReadL2, WriteL2  # noqa: E402
from mpcache.core_sm.messages import L2ReadFinished, L2WriteFinished  # noqa: E402
from mpcache.runtime_zmq.l1_pool import SharedMemoryPool  # noqa: E402
from mpcache.runtime_zmq.l2 import READ_WINDOW, REDIS_SPREAD, RedisTier, ValueStream, open_tier  # noqa: E402
from mpcache.runtime_zmq.l2_seal import HEADER_BYTES, Opening, Rejection, Sealer  # noqa: E402
from mpcache.runtime_zmq.l2_worker import READ_PIECE_BYTES, L2Options, L2Worker, storage_key  # noqa: E402

try:
    from .redis_server import RedisServer, redis_server, redis_url  # noqa: F401
except ImportError:
    from redis_server import RedisServer, redis_server, redis_url  # type: ignore[no-redef]  # noqa: F401

SLOT = 4 << 20  # several MAC pieces per object


class Harness:
    def __init__(self, tiers: list[Any], **options: Any) -> None:
        self.dir = tempfile.mkdtemp(prefix="mpcache-l2s-")
        self.pool = SharedMemoryPool(8 * SLOT, SLOT, directory=self.dir)
        self.posted: list[Any] = []
        self.cond = threading.Condition()
        options.setdefault("secret_file", os.path.join(self.dir, "secret"))
        self.worker = L2Worker(tiers, self.pool, self.post, workers=2, options=L2Options(**options))

    def post(self, ev: Any) -> None:
        with self.cond:
            self.posted.append(ev)
            self.cond.notify_all()

    def wait_for(self, pred: Callable[[list[Any]], bool], timeout: float = 20.0) -> list[Any]:
        with self.cond:
            assert self.cond.wait_for(lambda: pred(self.posted), timeout), self.posted
            return list(self.posted)

    def store(self, items: Sequence[tuple[ObjectKey, int, bytes]]) -> None:
        for _, slot, data in items:
            self.pool.write(slot, data)
            self.worker.note_slot_size(slot, len(data))
        ident = 900 + len(self.posted)
        self.worker.write(WriteL2(ident, tuple((k, slot) for k, slot, _ in items)))
        self.wait_for(lambda p: L2WriteFinished(ident, True) in p)

    def load(self, keys: Sequence[ObjectKey], slots: Sequence[int], object_bytes: int = 0) -> tuple[bool, ...]:
        ident = 100 + len(self.posted)
        self.worker.read(ReadL2(ident, tuple(zip(keys, slots)), object_bytes))
        got = self.wait_for(lambda p: any(isinstance(e, L2ReadFinished) and e.read_id == ident for e in p))
        return next(e.loaded for e in got if isinstance(e, L2ReadFinished) and e.read_id == ident)

    def close(self) -> None:
        self.worker.close()
        self.pool.close()


def _keys(n: int) -> list[ObjectKey]:
    return [ObjectKey(bytes([7, i]) * 8, 0) for i in range(n)]


def _wait(pred: Callable[[], bool], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def test_an_opening_checks_a_payload_fed_in_pieces() -> None:
    sealer = Sealer(bytes(range(32)))
    payload = os.urandom(3 * READ_PIECE_BYTES + 17)
    blob = sealer.seal(b"k", payload)
    opening = sealer.opening(b"k", blob[:HEADER_BYTES], len(blob))
    assert isinstance(opening, Opening) and opening.size == len(payload)
    for at in range(HEADER_BYTES, len(blob), 1 << 20):
        opening.update(memoryview(blob)[at:at + (1 << 20)])
    assert opening.verify()
    short = sealer.opening(b"k", blob[:HEADER_BYTES], len(blob))
    assert isinstance(short, Opening)
    short.update(memoryview(blob)[HEADER_BYTES:-1])
    assert not short.verify()  # a byte missing is never a match
    assert sealer.opening(b"k", blob[:HEADER_BYTES], len(blob) - 1) is Rejection.SHORT
    assert sealer.opening(b"k", blob[:HEADER_BYTES], len(blob) + 1) is Rejection.LONG
    assert sealer.opening(b"k", b"MPL3" + blob[4:HEADER_BYTES], len(blob)) is Rejection.BAD_HEADER
    assert sealer.opening(b"k", blob[:10], len(blob)) is Rejection.SHORT


def test_read_into_hands_each_value_over_and_drops_what_is_left(redis_url: str) -> None:
    tier = open_tier(redis_url)
    assert isinstance(tier, RedisTier)
    try:
        values = {b"v%d" % i: os.urandom((3 << 20) + i) for i in range(6)}  # past any socket buffer
        tier.write_many(list(values.items()))
        keys = [b"v0", b"absent", b"v1", b"v2", b"v3", b"v4", b"v5"]
        for _ in range(2):  # the second round on connections the first left behind
            got: dict[int, bytes | None] = {}
            lock = threading.Lock()

            def on_value(i: int, stream: ValueStream | None) -> None:
                if stream is None:
                    with lock:
                        got[i] = None
                    return
                want = stream.size if i % 2 == 0 else 1000  # odd ones: read a little, leave the rest
                buf = bytearray(want)
                stream.read_exact(memoryview(buf))
                with lock:
                    got[i] = bytes(buf)

            tier.read_into(keys, on_value)
            assert got[1] is None
            for i, k in enumerate(keys):
                if k in values:
                    assert got[i] == (values[k] if i % 2 == 0 else values[k][:1000]), k
        assert tier._buffers._free == []  # no value was ever held in a receive buffer
    finally:
        tier.close()


def test_read_into_keeps_few_values_waiting_in_redis(redis_url: str) -> None:
    """Redis copies a value into its reply buffer when it runs the GET: a connection has at most
    READ_WINDOW GETs outstanding, so a read of many large objects never has Redis hold them all."""
    tier = RedisTier(redis_url, pool_size=1)  # one connection carries the whole read
    admin = redis.Redis.from_url(redis_url)
    try:
        value = os.urandom(8 << 20)
        tier.write_many([(b"w%d" % i, value) for i in range(8)])
        held: list[int] = []

        def on_value(i: int, stream: ValueStream | None) -> None:
            assert stream is not None
            if i == 0:  # the first value waits unread while Redis runs what it was sent
                time.sleep(0.5)
                held.append(max(int(c["omem"]) for c in admin.client_list()))
            stream.drain(bytearray(1 << 20))

        tier.read_into([b"w%d" % i for i in range(8)], on_value)
        assert READ_WINDOW == 2 and held and held[0] < 3 * (8 << 20), held  # two values, not all eight
    finally:
        admin.close()
        tier.close()


def test_a_redis_read_lands_in_its_slots_with_no_value_buffer(redis_url: str) -> None:
    tier = open_tier(redis_url)
    assert isinstance(tier, RedisTier)
    h = Harness([tier])
    try:
        ks = _keys(4)
        data = [os.urandom(3 << 20) for _ in range(3)]
        h.store([(ks[0], 0, data[0]), (ks[2], 1, data[1]), (ks[3], 2, data[2])])
        assert h.load(ks, [4, 5, 6, 7]) == (True, False, True, True)
        assert [bytes(h.pool.view(s, 3 << 20)) for s in (4, 6, 7)] == data
        assert tier._buffers._free == []  # read into the slots, not into buffers of the tier
    finally:
        h.close()


def test_a_damaged_piece_is_a_miss_deleted_and_the_others_load(redis_url: str) -> None:
    tier = open_tier(redis_url)
    raw = redis.Redis.from_url(redis_url)
    h = Harness([tier])
    try:
        ks = _keys(3)
        data = [os.urandom(3 << 20) for _ in range(3)]
        h.store([(k, i, d) for i, (k, d) in enumerate(zip(ks, data))])
        rkey = b"mpcache:" + storage_key(ks[1])
        at = HEADER_BYTES + 2 * READ_PIECE_BYTES + 12345  # in the third piece of the payload
        byte = raw.getrange(rkey, at, at)
        raw.setrange(rkey, at, bytes([byte[0] ^ 1]))
        assert h.load(ks, [4, 5, 6]) == (True, False, True)
        assert bytes(h.pool.view(4, 3 << 20)) == data[0] and bytes(h.pool.view(6, 3 << 20)) == data[2]
        s = h.worker.stats()
        assert s["l2_rejected"] == 1 and s["l2_rejected_forged"] == 1
        assert raw.exists(rkey) == 0  # the damaged object is gone from the tier
        assert h.load(ks, [4, 5, 6]) == (True, False, True)  # and stays a miss
    finally:
        raw.close()
        h.close()


def test_cut_long_and_tiny_values_are_misses_and_replies_stay_in_step(redis_url: str) -> None:
    tier = open_tier(redis_url)
    raw = redis.Redis.from_url(redis_url)
    h = Harness([tier])
    try:
        ks = _keys(5)
        data = [os.urandom(3 << 20) for _ in range(5)]
        for _ in range(REDIS_SPREAD):  # every pooled connection meets the bad values
            h.store([(k, i, d) for i, (k, d) in enumerate(zip(ks, data))])
            sealed = [raw.get(b"mpcache:" + storage_key(k)) for k in ks]
            raw.set(b"mpcache:" + storage_key(ks[1]), sealed[1][: 2 << 20])  # cut short
            raw.set(b"mpcache:" + storage_key(ks[2]), sealed[2] + b"tail")  # too long
            raw.set(b"mpcache:" + storage_key(ks[3]), b"\x01")  # shorter than a header
            assert h.load(ks, [3, 4, 5, 6, 7]) == (True, False, False, False, True)
            assert bytes(h.pool.view(3, 3 << 20)) == data[0] and bytes(h.pool.view(7, 3 << 20)) == data[4]
        s = h.worker.stats()
        assert s["l2_rejected_short"] == 2 * REDIS_SPREAD and s["l2_rejected_long"] == REDIS_SPREAD
    finally:
        raw.close()
        h.close()


def test_a_value_of_another_size_is_a_miss_kept_for_its_readers(redis_url: str) -> None:
    tier = open_tier(redis_url)
    raw = redis.Redis.from_url(redis_url)
    h = Harness([tier])
    try:
        k = _keys(1)[0]
        h.store([(k, 0, b"s" * 2048)])
        assert h.load([k], [1], object_bytes=4096) == (False,)
        assert h.worker.stats()["l2_rejected_wrong_size"] == 1
        assert raw.exists(b"mpcache:" + storage_key(k)) == 1
        assert h.load([k], [1], object_bytes=2048) == (True,)
    finally:
        raw.close()
        h.close()


class _PausingStream:
    """A sealed value served in 64 KiB reads that pauses after ``pause_at`` bytes until ``go``."""

    def __init__(self, blob: bytes, pause_at: int, go: threading.Event, log: list[str]) -> None:
        self._blob = memoryview(blob)
        self.size = len(blob)
        self.remaining = len(blob)
        self._pause_at = pause_at
        self._go = go
        self._log = log

    def wait(self) -> None:
        if self.size - self.remaining >= self._pause_at:
            self._go.wait(30)

    def read_some(self, view: memoryview) -> int:
        at = self.size - self.remaining
        n = min(len(view), self.remaining, 64 << 10)
        view[:n] = self._blob[at:at + n]
        self.remaining -= n
        self._log.append("read")
        return n

    def read_exact(self, view: memoryview) -> None:
        have = 0
        while have < len(view):
            self.wait()
            have += self.read_some(view[have:])


class _StreamingFake:
    """A tier with only ``write_many`` and ``read_into``; values pause half way through."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.calls: list[str] = []
        self.go = threading.Event()
        self.go.set()
        self.log: list[str] = []

    def write_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        self.data.update((k, bytes(v)) for k, v in items)

    def read_into(self, keys: Sequence[bytes], on_value: Callable[[int, Any], None]) -> None:
        self.calls.append(f"read_into:{len(keys)}")
        for i, k in enumerate(keys):
            v = self.data.get(k)
            on_value(i, None if v is None else _PausingStream(v, len(v) // 2, self.go, self.log))

    def close(self) -> None:
        pass


def test_a_streamed_read_past_its_deadline_writes_no_slot_after_it() -> None:
    tier = _StreamingFake()
    h = Harness([tier], deadline_s=0.3, min_bytes_per_s=1e12)
    try:
        k = _keys(1)[0]
        h.store([(k, 0, os.urandom(3 << 20))])
        h.pool.write(3, b"\x5a" * (3 << 20))
        tier.go.clear()  # the value stops half way, until after the deadline
        ident = 100 + len(h.posted)
        h.worker.read(ReadL2(ident, ((k, 3),)))
        h.wait_for(lambda p: L2ReadFinished(ident, (False,)) in p)
        reads = len(tier.log)
        tier.go.set()
        assert _wait(lambda: h.worker.in_flight == 0)
        assert len(tier.log) == reads  # nothing more was read after the deadline
        assert bytes(h.pool.view(3, 3 << 20)[(2 << 20):]) == b"\x5a" * (1 << 20)  # the slot's tail untouched
        assert tier.calls == ["read_into:1"]
        assert h.worker.stats()["l2_deadline_expired"] == 1 and h.worker.errors == 0
    finally:
        h.close()


# ------------------------------------------------------------------------------------ writes


def test_write_parts_stores_the_parts_joined_with_its_ttl(redis_url: str) -> None:
    tier = RedisTier(redis_url, ttl_s=100)
    raw = redis.Redis.from_url(redis_url)
    try:
        a, b = os.urandom(48), os.urandom((3 << 20) + 5)
        tier.write_parts([(b"p%d" % i, lambda: (a, memoryview(b))) for i in range(2 * REDIS_SPREAD)] + [(b"e", lambda: ())])
        for i in range(2 * REDIS_SPREAD):
            assert raw.get(b"mpcache:p%d" % i) == a + b
            assert 0 < raw.ttl(b"mpcache:p%d" % i) <= 100
        assert raw.get(b"mpcache:e") == b""
    finally:
        raw.close()
        tier.close()


def test_a_redis_write_sends_from_the_slot_without_a_sealed_copy(redis_url: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def no_copy(*args: Any) -> bytes:
        raise AssertionError("a sealed copy of the object was made")

    monkeypatch.setattr(Sealer, "seal", no_copy)
    tier = open_tier(redis_url)
    h = Harness([tier])
    try:
        ks = _keys(3)
        data = [os.urandom(3 << 20) for _ in range(3)]
        h.store([(k, i, d) for i, (k, d) in enumerate(zip(ks, data))])
        assert h.load(ks, [4, 5, 6]) == (True, True, True)
        assert [bytes(h.pool.view(s, 3 << 20)) for s in (4, 5, 6)] == data
        assert h.worker.stats()["l2_writes"] == 3
    finally:
        h.close()


class _PausingWriter(_StreamingFake):
    """``write_parts`` that sends each value in 64 KiB pieces under the guard, pausing half way
    through until ``go``."""

    def write_parts(self, items: Sequence[tuple[bytes, Callable[[], Sequence[Any]]]],
                    guard: Callable[[], Any] | None = None) -> None:
        assert guard is not None
        for key, make in items:
            out = bytearray()
            for part in make():
                view = memoryview(part)
                for at in range(0, len(view), 64 << 10):
                    if len(out) > (1 << 20):
                        self.go.wait(30)
                    with guard():
                        out += view[at:at + (64 << 10)]
                        self.log.append("sent")
            self.data[key] = bytes(out)


def test_a_streamed_write_past_its_deadline_stops_reading_its_slots() -> None:
    tier = _PausingWriter()
    h = Harness([tier], deadline_s=0.3, min_bytes_per_s=1e12)
    try:
        k = _keys(1)[0]
        h.pool.write(0, os.urandom(3 << 20))
        h.worker.note_slot_size(0, 3 << 20)
        tier.go.clear()
        h.worker.write(WriteL2(900, ((k, 0),)))
        h.wait_for(lambda p: L2WriteFinished(900, False) in p)
        sent = len(tier.log)
        tier.go.set()
        assert _wait(lambda: h.worker.in_flight == 0)
        assert len(tier.log) == sent and tier.data == {}  # not a byte more, nothing stored
        assert h.worker.stats()["l2_deadline_expired"] == 1 and h.worker.errors == 0
    finally:
        h.close()
