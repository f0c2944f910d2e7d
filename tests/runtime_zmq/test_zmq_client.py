"""The client's contract: futures from many threads, per-request timeouts, health, close; and the
server's metrics endpoint."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from live_server import ServerProcess, wait_for
from mpcache.runtime_zmq.client import ClientClosed, MPCacheClient, RemoteError
from test_server_ops import key, tokens


def test_many_threads_share_one_client(client: MPCacheClient) -> None:
    def worker(n: int) -> list[object]:
        out: list[object] = []
        for i in range(50):
            if i % 3 == 0:
                out.append(client.call("query_prefetch_status", f"t{n}-{i}"))
            elif i % 3 == 1:
                out.append(client.submit("get_chunk_size").result(5))
            else:
                f = client.submit("noop")
                while not f.done():  # polling done() only: the client thread must deliver it
                    time.sleep(0.001)
                out.append(f.result())
        return out

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(worker, range(8)))
    for out in results:
        assert out == [0, 256, "OK"] * 16 + [0, 256]


def test_callbacks_only_futures_resolve(client: MPCacheClient) -> None:
    got: list[object] = []
    ev = threading.Event()
    futs = [client.submit("noop") for _ in range(20)]
    for f in futs:
        f.add_done_callback(lambda f: (got.append(f.result()), len(got) == 20 and ev.set()))
    assert ev.wait(5.0)
    assert got == ["OK"] * 20


def test_request_timeout_and_late_reply_ignored(start_server: Callable[..., ServerProcess]) -> None:
    sp = start_server("--l2", "python:slow_tier:make?delay=60")
    c = MPCacheClient(sp.url, request_timeout=5.0)
    try:
        c.lookup(key(tokens(2), "slow")).result(5)
        t0 = time.monotonic()
        # the server holds the reply 2 s; the client gives up after 0.3 s
        f = c.submit("wait_prefetch_status", "slow", 2.0, timeout=0.3)
        with pytest.raises(RemoteError) as e:
            f.result()
        assert e.value.kind == "timeout"
        assert time.monotonic() - t0 < 4.0  # loose bound for loaded CI; the kind proves who won
        time.sleep(2.0)  # the late reply arrives and is dropped
        assert c.noop() == "OK"
        assert c.healthy
    finally:
        c.close()


def test_unreachable_server_fails_fast_and_close_fails_pending() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    c = MPCacheClient(f"tcp://127.0.0.1:{port}", connect_timeout=0.5)
    assert not c.healthy
    assert time.monotonic() - t0 < 4.0
    with pytest.raises(RemoteError) as e:
        c.call("noop", timeout=1.0)
    assert e.value.kind == "not_sent"  # not connected: refused at once, nothing buffered
    c.close()
    with pytest.raises(ClientClosed):
        c.call("noop")


def test_health_callbacks_follow_the_server(start_server: Callable[..., ServerProcess]) -> None:
    sp = start_server()
    seen: list[bool] = []
    c = MPCacheClient(sp.url, heartbeat_interval=0.1, heartbeat_timeout=0.5)
    c.on_health(seen.append)
    try:
        assert c.healthy
        sp.kill()
        assert wait_for(lambda: seen[-1:] == [False], timeout=5.0)
        assert not c.healthy
    finally:
        c.close()


def test_metrics_endpoint(start_server: Callable[..., ServerProcess]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sp = start_server("--metrics-port", str(port))
    c = MPCacheClient(sp.url)
    try:
        c.noop()
        with pytest.raises(RemoteError):
            c.call("bogus")
        c.lookup(key(tokens(1), "m1")).result(5)
        time.sleep(1.2)  # gauges are refreshed once a second
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'mpcache_requests_total{op="noop",outcome="ok"}' in body
        assert 'mpcache_errors_total{kind="unknown_op"} 1.0' in body
        assert 'mpcache_request_latency_seconds_bucket{le="+Inf",op="lookup"} 1.0' in body
        assert 'mpcache_l1_leases_held 0.0' in body and 'mpcache_state{name="leases_held"}' not in body
        assert 'mpcache_state{name="jobs"}' in body
    finally:
        c.close()


def test_bookkeeping_stays_bounded(client: MPCacheClient) -> None:
    # long timeouts: answered requests must not pile up in the client's timeout heap
    for _ in range(3000):
        client.call("noop", timeout=300.0)
    assert client.link.pending_count() <= 1  # at most an in-flight heartbeat
    assert client.link.deadline_entries() <= 2 * 1 + 1024 + 1


def test_a_callback_may_block_on_another_request(client: MPCacheClient) -> None:
    inner: list[object] = []

    def on_done(_f: object) -> None:
        # runs on whichever thread delivered the first reply; it must not deadlock the client
        inner.append(client.call("get_chunk_size", timeout=3.0))

    f = client.submit("noop")
    f.add_done_callback(on_done)
    assert client.call("noop") == "OK"  # this thread may be the one reading replies
    assert f.result(5) == "OK"
    assert wait_for(lambda: inner == [256], timeout=5.0)


def test_a_frozen_server_is_declared_unhealthy_then_recovers(start_server: Callable[..., ServerProcess]) -> None:
    import signal

    sp = start_server()
    c = MPCacheClient(sp.url, request_timeout=30.0, heartbeat_interval=0.2, heartbeat_timeout=0.8)
    assert sp.proc is not None
    try:
        sp.proc.send_signal(signal.SIGSTOP)  # alive, connected, silent
        f = c.submit("noop")
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as e:
            f.result(10)
        assert e.value.kind == "unhealthy"  # failed by the heartbeat, long before its own 30 s
        assert time.monotonic() - t0 < 6.0
        sp.proc.send_signal(signal.SIGCONT)
        assert c.wait_healthy(5.0)
        assert c.noop() == "OK"
    finally:
        sp.proc.send_signal(signal.SIGCONT)
        c.close()


def test_a_server_restarted_between_heartbeats_is_reported_by_its_epoch(start_server: Callable[..., ServerProcess]) -> None:
    path = os.path.join(tempfile.mkdtemp(prefix="mpcache-epoch-"), "mpcache.sock")
    old = start_server("--ipc", path)
    epochs: list[int | str] = []
    health: list[bool] = []
    c = MPCacheClient(old.url, heartbeat_interval=1.0, heartbeat_timeout=3.0, wait_connected=False)
    c.on_epoch(epochs.append)
    c.on_health(health.append)
    try:
        assert c.wait_healthy(5.0)
        first = c.health()["epoch"]
        assert isinstance(first, int)
        assert wait_for(lambda: epochs == [first])
        assert c.epoch == first
        # The new server binds the same path while the old one still runs (the client stays
        # connected to the old one); the old one dies right after a heartbeat, and the client
        # reconnects before the next: no heartbeat is lost, the health never drops.
        start_server("--ipc", path)
        beat = c.heartbeat_at
        assert wait_for(lambda: c.heartbeat_at != beat)
        old.kill()
        assert wait_for(lambda: len(epochs) == 2, timeout=5.0)
        assert epochs[1] != first and c.epoch == epochs[1]
        assert c.health()["epoch"] == epochs[1]
        assert health == [True]
    finally:
        c.close()
