"""The HTTP side's connections are capped (hostile finding 11): it ran one thread per
connection, uncapped, so a client that opened connections and sent nothing grew the server by a
thread (and its stack) each. Beyond ``MAX_CONNECTIONS`` a connection is answered 503 and closed."""
from __future__ import annotations

import socket
import time
from collections.abc import Callable

from live_server import ServerProcess, wait_for
from mpcache.runtime_zmq import http

MAX_CONNECTIONS = getattr(http, "MAX_CONNECTIONS", 32)  # the cap (32 when the code had none)
from test_ops_http import get, http_url


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("Threads:")))


def test_idle_connections_beyond_the_cap_cost_no_thread(start_server: Callable[..., ServerProcess]) -> None:
    sp = start_server()
    assert sp.proc is not None
    base = http_url(sp)
    host, port = base.removeprefix("http://").rsplit(":", 1)
    assert get(base + "/healthz")[0] == 200
    before = threads(sp.proc.pid)
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(MAX_CONNECTIONS + 40)]
    try:
        time.sleep(1.0)
        assert threads(sp.proc.pid) - before <= MAX_CONNECTIONS + 2
        # the connections past the cap were answered 503 and closed by the server
        refused = 0
        for s in idle[MAX_CONNECTIONS:]:
            s.settimeout(2)
            data = s.recv(200)
            if data.startswith(b"HTTP/1.1 503") or data == b"":
                refused += 1
        assert refused == 40
    finally:
        for s in idle:
            s.close()
    # the slots come back: probes work again
    assert wait_for(lambda: get(base + "/healthz")[0] == 200, timeout=15)
