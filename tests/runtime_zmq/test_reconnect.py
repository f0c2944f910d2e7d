"""A restarted server is found as soon as the client's connection to it is back: the socket
monitor's handshake event makes the HealthMonitor probe at once, whatever its backoff."""
from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import msgpack  # type: ignore[import-untyped]

from mpcache.runtime_zmq import auth
from mpcache.runtime_zmq.client import MPCacheClient
from live_server import RawDealer, ServerProcess, wait_for

RECONNECT_IVL_MAX = 0.2
BACKOFF_MAX = 1.6


def first_health_answer(url: str, timeout: float = 10.0) -> float:
    """``time.monotonic()`` when a fresh connection's ``health`` request is first answered."""
    raw = RawDealer(url)
    try:
        reply = raw.request([msgpack.packb(1), msgpack.packb("health")], timeout)
        at = time.monotonic()
        assert msgpack.unpackb(reply[1]) == "health"
        return at
    finally:
        raw.close()


def test_a_restarted_server_is_healthy_again_within_a_reconnect_interval(
        start_server: Callable[..., ServerProcess]) -> None:
    old = start_server()
    port = old.url.rsplit(":", 1)[1]
    health: list[bool] = []
    c = MPCacheClient(old.url, reconnect_ivl_max=RECONNECT_IVL_MAX, heartbeat_interval=0.2,
                      heartbeat_timeout=0.5, heartbeat_backoff_max=BACKOFF_MAX)
    c.on_health(health.append)
    try:
        assert c.healthy and c.heartbeat_period == 0.2
        first_epoch = c.epoch
        old.kill()  # SIGKILL: no goodbye on the wire
        assert wait_for(lambda: not c.healthy, timeout=3.0)
        # silent for the timeout: probes back off to the cap (0.2, 0.4, 0.8, 1.6 s)
        assert wait_for(lambda: c.heartbeat_period == BACKOFF_MAX, timeout=5.0)
        start_server("--port", port)
        answered = first_health_answer(f"tcp://127.0.0.1:{port}")
        assert c.wait_healthy(5.0)
        recovered = time.monotonic()
        # Without the connection event the next probe would come up to BACKOFF_MAX after the
        # reconnect: 1.8 s. With it, one reconnect interval plus a round trip (the margin is for
        # a loaded test machine).
        assert recovered - answered < RECONNECT_IVL_MAX + 0.3, recovered - answered
        assert health == [False, True] and c.epoch != first_epoch
        assert c.heartbeat_period == 0.2 and c.noop() == "OK"
    finally:
        c.close()


def test_close_closes_the_connection_monitor(start_server: Callable[..., ServerProcess]) -> None:
    sp = start_server()
    c = MPCacheClient(sp.url)
    mon = c._conn_events
    c.close()
    assert mon.closed and c._sock.closed


def test_a_refused_handshake_is_logged_once_not_per_attempt(start_server: Callable[..., ServerProcess],
                                                              tmp_path: Any, caplog: Any) -> None:
    keys, other = str(tmp_path / "keys"), str(tmp_path / "other")
    auth.keygen(keys, "engine")
    auth.keygen(other, "intruder")
    sp = start_server("--curve-dir", keys)
    # the intruder's client trusts the right server key, but the server does not know its key
    shutil.copy(os.path.join(keys, "server.key"), os.path.join(other, "server.key"))
    caplog.set_level(logging.INFO, logger="mpcache.client")
    c = MPCacheClient(sp.url, curve_dir=other, curve_client="intruder", reconnect_ivl_max=0.1,
                      wait_connected=False)
    try:
        def refusals() -> list[str]:
            return [r.getMessage() for r in caplog.records if "refused the connection's handshake" in r.getMessage()]

        assert wait_for(lambda: len(refusals()) >= 1, timeout=5.0)
        time.sleep(0.5)  # several more attempts, each refused
        assert len(refusals()) == 1 and "authentication failed" in refusals()[0]
        assert not c.healthy
    finally:
        c.close()
