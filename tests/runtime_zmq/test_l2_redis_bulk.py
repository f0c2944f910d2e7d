"""The Redis tier moves large values fast (issue "Latency where users feel it", item 5): a batch is
spread over several pooled connections, and each value is read off its socket into one buffer.
Against a real redis-server: values larger than any socket buffer come back byte-exact, absent
keys are None, an error reply fails the batch and leaves no connection out of step."""
from __future__ import annotations

import os
import threading

import pytest

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install '.[redis]')")

from mpcache.runtime_zmq.l2 import REDIS_SPREAD, L2Error, RedisTier, open_tier  # noqa: E402

try:
    from .redis_server import RedisServer, redis_server, redis_url  # noqa: F401
except ImportError:
    from redis_server import RedisServer, redis_server, redis_url  # type: ignore[no-redef]  # noqa: F401


def _clients(url: str) -> int:
    admin = redis.Redis.from_url(url)
    try:
        return len(admin.client_list()) - 1  # not this one
    finally:
        admin.close()


def test_large_values_round_trip_byte_exact(redis_url: str) -> None:
    tier = open_tier(redis_url)
    try:
        values = [os.urandom((5 << 20) + i) for i in range(5)]  # past any socket buffer, odd sizes
        items = [(b"big-%d" % i, v) for i, v in enumerate(values)]
        tier.write_many(items)
        got = tier.read_many([b"big-0", b"absent", b"big-1", b"big-2", b"big-3", b"big-4", b""])
        assert got[1] is None and got[6] is None
        assert [bytes(g) for g in got if g is not None] == values
        assert tier.read(b"big-3") == values[3]
    finally:
        tier.close()


def test_a_batch_is_spread_over_several_connections(redis_url: str) -> None:
    tier = open_tier(redis_url)
    assert isinstance(tier, RedisTier)
    try:
        before = _clients(redis_url)
        # every share holds its connection until all shares have one: a tier that ran the shares
        # one after another breaks the barrier; without it, a share done before the last began
        # (a loaded box) hands its connection on and the count below is short
        barrier = threading.Barrier(REDIS_SPREAD, timeout=20)
        pool = tier._pool
        borrow = pool.get_connection

        def get_connection(*args: object, **kwargs: object) -> object:
            conn = borrow(*args, **kwargs)
            barrier.wait()
            return conn

        pool.get_connection = get_connection
        try:
            tier.write_many([(b"k%d" % i, os.urandom(4 << 20)) for i in range(2 * REDIS_SPREAD)])
        finally:
            pool.get_connection = borrow
        assert _clients(redis_url) - before == REDIS_SPREAD  # each share had its own connection
        assert all(v is not None for v in tier.read_many([b"k%d" % i for i in range(2 * REDIS_SPREAD)]))
        assert _clients(redis_url) - before == REDIS_SPREAD  # and kept it for the next batch
    finally:
        tier.close()


def test_a_key_of_another_type_is_a_miss_and_replies_stay_in_step(redis_url: str) -> None:
    tier = open_tier(redis_url)
    admin = redis.Redis.from_url(redis_url)
    try:
        tier.write_many([(b"a", b"1" * 100_000), (b"b", b"2")])
        admin.lpush(b"mpcache:list", b"x")  # GET on a list: a WRONGTYPE error reply (MGET: nil)
        for _ in range(2 * REDIS_SPREAD):  # on every pooled connection
            assert tier.read_many([b"a", b"list", b"b"]) == [b"1" * 100_000, None, b"2"]
            assert tier.read_many([b"b", b"a"]) == [b"2", b"1" * 100_000]
    finally:
        admin.close()
        tier.close()


def test_an_error_reply_for_the_batch_fails_it_and_the_next_batch_reads(redis_server: RedisServer) -> None:
    admin = redis.Redis(host="127.0.0.1", port=redis_server.port)
    admin.acl_setuser("reader", enabled=True, passwords=["+pw"], keys=["mpcache:a"], commands=["+get", "+ping"])
    admin.set(b"mpcache:a", b"1")
    admin.set(b"mpcache:b", b"2")
    tier = RedisTier(f"redis://reader:pw@127.0.0.1:{redis_server.port}/0")
    try:
        with pytest.raises(L2Error, match="NOPERM|permission"):
            tier.read_many([b"a", b"b"])  # b is not the reader's: refused, the batch fails
        for _ in range(2 * REDIS_SPREAD):
            assert tier.read_many([b"a", b"a"]) == [b"1", b"1"]
    finally:
        tier.close()
        admin.acl_deluser("reader")
        admin.close()


def test_a_closed_tier_refuses_batches(redis_url: str) -> None:
    tier = open_tier(redis_url)
    tier.write_many([(b"a", b"1"), (b"b", b"2")])
    tier.close()
    with pytest.raises(L2Error, match="closed"):
        tier.read_many([b"a", b"b"])
    with pytest.raises(L2Error, match="closed"):
        tier.write_many([(b"a", b"1"), (b"b", b"2")])


def test_read_each_hands_every_value_over_in_a_reused_buffer(redis_url: str) -> None:
    tier = open_tier(redis_url)
    assert isinstance(tier, RedisTier)
    admin = redis.Redis.from_url(redis_url)
    try:
        values = [os.urandom((3 << 20) + i) for i in range(2 * REDIS_SPREAD)]
        tier.write_many([(b"v%d" % i, v) for i, v in enumerate(values)])
        admin.lpush(b"mpcache:list", b"x")
        keys = [b"v%d" % i for i in range(len(values))] + [b"absent", b"list"]
        for _ in range(2):
            seen: dict[int, bytes | None] = {}
            buffers: set[int] = set()
            lock = threading.Lock()

            def on_value(i: int, view: memoryview | None) -> None:
                with lock:
                    assert i not in seen
                    seen[i] = None if view is None else bytes(view)
                    if view is not None:
                        buffers.add(id(view.obj))

            tier.read_each(keys, on_value)
            assert seen == {**{i: v for i, v in enumerate(values)}, len(values): None, len(values) + 1: None}
            assert len(buffers) <= REDIS_SPREAD  # one buffer per connection, not one per value
        assert len(tier._buffers._free) <= REDIS_SPREAD  # kept for the next read, bounded
    finally:
        admin.close()
        tier.close()


def test_read_each_a_failing_consumer_fails_the_read_and_drops_the_connection(redis_url: str) -> None:
    tier = open_tier(redis_url)
    assert isinstance(tier, RedisTier)
    try:
        tier.write_many([(b"a", b"1" * 200_000), (b"b", b"2" * 200_000)])

        def boom(i: int, view: memoryview | None) -> None:
            raise RuntimeError("consumer failed")

        with pytest.raises(L2Error, match="consumer failed"):
            tier.read_each([b"a", b"b", b"a", b"b"], boom)
        for _ in range(2 * REDIS_SPREAD):  # no pooled connection is left out of step
            assert tier.read_many([b"b", b"a"]) == [b"2" * 200_000, b"1" * 200_000]
    finally:
        tier.close()
