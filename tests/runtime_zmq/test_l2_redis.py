"""The Redis L2 tier against a real redis-server: binary round trips, TTL, prefix, two tier
instances sharing one Redis (the multi-node story), clear errors when Redis is unreachable."""
from __future__ import annotations

import os
import threading
import time

import pytest

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install '.[redis]')")

from mpcache.runtime_zmq.l2 import L2Error, L2Tier, L2Unavailable, RedisTier, open_tier  # noqa: E402

try:
    from .redis_server import RedisServer, free_port, redis_server, redis_url  # noqa: F401
except ImportError:
    from redis_server import RedisServer, free_port, redis_server, redis_url  # type: ignore[no-redef]  # noqa: F401


def test_round_trip(redis_url: str) -> None:
    tier = open_tier(redis_url)
    try:
        assert isinstance(tier, RedisTier)
        assert isinstance(tier, L2Tier)
        key = bytes(range(256))  # every byte value, NUL included
        assert tier.read(key) is None
        assert not tier.contains(key)
        value = os.urandom(1 << 20)
        tier.write(key, value)
        assert tier.contains(key)
        assert tier.read(key) == value
        tier.write(key, b"")
        assert tier.read(key) == b""
        tier.write_many([(b"a", b"1"), (b"b", b"2")])
        assert tier.read_many([b"a", b"nope", b"b"]) == [b"1", None, b"2"]
        assert tier.read_many([]) == []
    finally:
        tier.close()


def test_keys_are_prefixed(redis_url: str) -> None:
    raw = redis.Redis.from_url(redis_url)
    tier = open_tier(redis_url)
    other = open_tier(redis_url + "?prefix=other:")
    try:
        tier.write(b"\x01\x02", b"v")
        assert raw.get(b"mpcache:\x01\x02") == b"v"
        assert other.read(b"\x01\x02") is None  # another namespace in the same database
        other.write(b"\x01\x02", b"w")
        assert raw.get(b"other:\x01\x02") == b"w"
        assert tier.read(b"\x01\x02") == b"v"
    finally:
        tier.close()
        other.close()
        raw.close()


def test_ttl(redis_url: str) -> None:
    raw = redis.Redis.from_url(redis_url)
    tier = open_tier(redis_url + "?ttl=1")
    plain = open_tier(redis_url)
    try:
        tier.write(b"short", b"v")
        tier.write_many([(b"short2", b"w")])
        plain.write(b"long", b"v")
        assert 0 < raw.pttl(b"mpcache:short") <= 1000
        assert 0 < raw.pttl(b"mpcache:short2") <= 1000
        assert raw.ttl(b"mpcache:long") == -1
        assert "ttl 1 s" in tier.name
        deadline = time.monotonic() + 5
        while tier.contains(b"short") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tier.read(b"short") is None
        assert plain.read(b"long") == b"v"
    finally:
        tier.close()
        plain.close()
        raw.close()


def test_database_number_is_honoured(redis_server: RedisServer, redis_url: str) -> None:
    db0 = open_tier(f"redis://127.0.0.1:{redis_server.port}/0")
    db3 = open_tier(f"redis://127.0.0.1:{redis_server.port}/3")
    try:
        db3.write(b"k", b"in three")
        assert db0.read(b"k") is None
        assert db3.read(b"k") == b"in three"
    finally:
        db0.close()
        db3.close()
        redis.Redis(port=redis_server.port, db=3).flushdb()


def test_two_tiers_share_one_redis(redis_url: str) -> None:
    """Two servers (here: two tier instances, each with its own pool) see each other's objects."""
    node_a = open_tier(redis_url)
    node_b = open_tier(redis_url)
    try:
        chunks = [(b"chunk-%02d" % i, os.urandom(4096)) for i in range(32)]
        node_a.write_many(chunks)
        assert node_b.read_many([k for k, _ in chunks]) == [v for _, v in chunks]
        assert all(node_b.contains(k) for k, _ in chunks)
        node_b.write(b"from-b", b"hello")
        assert node_a.read(b"from-b") == b"hello"
    finally:
        node_a.close()
        node_b.close()


def test_thread_safety(redis_url: str) -> None:
    tier = open_tier(redis_url + "?pool=4")
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(200):
                key = b"t%d-%d" % (t, i)
                value = key * 10
                tier.write(key, value)
                if tier.read(key) != value:
                    errors.append(AssertionError(f"bad value for {key!r}"))
        except BaseException as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tier.close()
    assert errors == []


def test_unreachable_redis_fails_fast_and_clearly() -> None:
    port = free_port()  # nothing listens here
    started = time.monotonic()
    tier = open_tier(f"redis://127.0.0.1:{port}/0?timeout=0.5")  # opening does not connect
    try:
        with pytest.raises(L2Unavailable, match=rf"redis://127.0.0.1:{port}/0.*unreachable"):
            tier.ping()
    finally:
        tier.close()
    assert time.monotonic() - started < 5


def test_password_is_not_leaked_in_errors() -> None:
    port = free_port()
    tier = open_tier(f"redis://:s3cret@127.0.0.1:{port}/0?timeout=0.5")
    try:
        with pytest.raises(L2Unavailable) as info:
            tier.ping()
    finally:
        tier.close()
    assert "s3cret" not in str(info.value) and "s3cret" not in tier.name and "s3cret" not in repr(tier)
    assert "***" in str(info.value)


def test_redis_dying_under_a_tier_gives_clear_errors() -> None:
    with RedisServer() as server:
        tier = open_tier(server.url + "?timeout=0.5")
        tier.write(b"k", b"v")
        assert tier.read(b"k") == b"v"
        server.stop()
        with pytest.raises(L2Unavailable, match="unreachable"):
            tier.read(b"k")
        with pytest.raises(L2Unavailable, match="unreachable"):
            tier.write(b"k", b"v")
        with pytest.raises(L2Unavailable, match="unreachable"):
            tier.contains(b"k")
        tier.close()
    with pytest.raises(L2Error, match="closed"):
        tier.read(b"k")


def test_redis_restart_is_picked_up() -> None:
    """After Redis comes back (same port), the pool reconnects by itself."""
    with RedisServer() as server:
        tier = open_tier(server.url + "?timeout=0.5")
        port = server.port
        server.stop()
        with pytest.raises(L2Unavailable):
            tier.read(b"k")
    with RedisServer(port=port):
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    tier.write(b"k", b"again")
                    break
                except L2Unavailable:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            assert tier.read(b"k") == b"again"
        finally:
            tier.close()


@pytest.mark.parametrize(
    "url, message",
    [
        ("redis://127.0.0.1:6379/0?ttl=0", "ttl must be positive"),
        ("redis://127.0.0.1:6379/0?ttl=x", "ttl must be an integer"),
        ("redis://127.0.0.1:6379/0?color=1", "unknown parameter"),
        ("redis://127.0.0.1:6379/abc", "database must be a number"),
        ("redis:///0", "needs a host"),
        ("redis://127.0.0.1:99999/0", "[Pp]ort"),
    ],
)
def test_bad_urls(url: str, message: str) -> None:
    with pytest.raises(L2Error, match=message):
        open_tier(url)
