"""Redis L2 with credentials and TLS, against real redis-servers: `requirepass`, an ACL user that
may touch only `mpcache:*` keys, and `rediss://` with a throwaway CA. The password travels in a
0600 file (``password_file=``), never on a command line, and never appears in a name, an error or
a server's log."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (pip install '.[redis]')")

from live_server import ServerProcess, wait_for  # noqa: E402
from mpcache.runtime_zmq.client import MPCacheClient  # noqa: E402
from mpcache.runtime_zmq.l2 import L2Error, L2Unavailable, open_tier  # noqa: E402
from test_server_ops import key, register, store_chunks, tokens  # noqa: E402

try:
    from redis_server import RedisServer, TlsFiles  # noqa: E402
except ImportError:  # pragma: no cover
    pytest.skip("tests/runtime_zmq/redis_server.py not importable", allow_module_level=True)

PASSWORD = "pw-9f3a-not-on-argv"


def _password_file(text: str = PASSWORD) -> str:
    path = os.path.join(tempfile.mkdtemp(prefix="mpcache-pw-"), "redis.pw")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return path


def _start(**kw: Any) -> RedisServer:
    try:
        server = RedisServer(**kw)
        server.start()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return server


@pytest.fixture(scope="module")
def acl_redis() -> Iterator[RedisServer]:
    server = _start(config=[
        f"requirepass {PASSWORD}-default",
        # a user for mpcache alone: its own key prefix, only the commands the tier sends
        f"user mpcache on >{PASSWORD} ~mpcache:* resetchannels -@all +get +set +mget +exists +del +ping",
    ])
    yield server
    server.stop()


def test_requirepass_and_acl_user(acl_redis: RedisServer) -> None:
    port = acl_redis.port
    good = open_tier(f"redis://mpcache@127.0.0.1:{port}/0?password_file={_password_file()}&timeout=1")
    default_user = open_tier(f"redis://127.0.0.1:{port}/0?password_file={_password_file(PASSWORD + '-default')}")
    try:
        good.ping()
        good.write_many([(b"k", b"v")])
        assert good.read_many([b"k", b"x"]) == [b"v", None] and good.contains_many([b"k"]) == [True]
        good.delete(b"k")
        assert good.read(b"k") is None
        default_user.ping()
        assert PASSWORD not in good.name and PASSWORD not in repr(good)
    finally:
        good.close()
        default_user.close()
    cases = [
        (f"redis://127.0.0.1:{port}/0?timeout=1", "ping"),  # no password
        (f"redis://mpcache@127.0.0.1:{port}/0?password_file={_password_file('wrong')}", "ping"),
        (f"redis://mpcache:{PASSWORD}x@127.0.0.1:{port}/0", "ping"),  # wrong, in the URL
        (f"redis://mpcache@127.0.0.1:{port}/0?password_file={_password_file()}&prefix=other:", "write"),
    ]
    for url, what in cases:
        tier = open_tier(url)
        try:
            with pytest.raises(L2Unavailable, match="authentication failed|not authorized") as info:
                tier.ping() if what == "ping" else tier.write(b"k", b"v")
            assert PASSWORD not in str(info.value)
        finally:
            tier.close()


def test_password_file_must_be_private() -> None:
    path = _password_file()
    os.chmod(path, 0o644)
    with pytest.raises(L2Error, match="chmod 600"):
        open_tier(f"redis://u@127.0.0.1:6379/0?password_file={path}")


def test_tls() -> None:
    try:
        tls = TlsFiles(tempfile.mkdtemp(prefix="mpcache-tls-"))
    except FileNotFoundError as e:
        pytest.skip(str(e))
    server = _start(tls=tls)
    try:
        assert server.url.startswith("rediss://")
        tier = open_tier(f"{server.url}?ca={tls.ca}&timeout=2")
        try:
            tier.write(b"k", b"over tls")
            assert tier.read(b"k") == b"over tls"
        finally:
            tier.close()
        plain = open_tier(f"redis://127.0.0.1:{server.port}/0?timeout=1")
        try:
            with pytest.raises(L2Unavailable):
                plain.ping()
        finally:
            plain.close()
        untrusted = open_tier(f"{server.url}?timeout=2")  # the system CAs do not know ours
        try:
            with pytest.raises(L2Unavailable):
                untrusted.ping()
        finally:
            untrusted.close()
    finally:
        server.stop()
    with pytest.raises(L2Error, match="TLS scheme"):
        open_tier(f"redis://127.0.0.1:1/0?ca={tls.ca}")


def test_server_with_an_acl_user_never_logs_the_password(
    start_server: Callable[..., ServerProcess], acl_redis: RedisServer
) -> None:
    secret = tempfile.mkdtemp(prefix="mpcache-secret-") + "/s"
    url = f"redis://mpcache@127.0.0.1:{acl_redis.port}/0?password_file={_password_file()}"
    sp = start_server("--l2", url, "--l2-secret-file", secret, "--log-level", "DEBUG")
    with MPCacheClient(sp.url, request_timeout=5.0) as c:
        register(c, 1)
        assert store_chunks(c, tokens(2, seed=4), "w", iid=1, seed=1)["stored"] == 2
        c.lookup(key(tokens(2, seed=4), "r")).result(5)
        assert c.wait_prefetch_status("r", 5.0).result(6) == 2
        assert all(PASSWORD not in str(t) for t in c.health()["l2_tiers"])
        # the write-behind went through the ACL user
        assert wait_for(lambda: c.stats()["l2_writes"] >= 2 and c.stats()["l2_in_flight"] == 0, timeout=5.0)
        assert c.stats()["l2_errors"] == 0
    sp.terminate()
    assert PASSWORD not in sp.output()
