"""The HTTP side: /metrics, /healthz, /readyz, /status, 404 elsewhere; probes go through the loop
with a bound, so a loop that does not run answers 503 instead of hanging the probe."""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from live_server import ServerProcess
from mpcache.runtime_zmq.client import MPCacheClient
from mpcache.runtime_zmq.config import version
from mpcache.runtime_zmq.http import OpsHttpServer
from mpcache.runtime_zmq.server import Server, ServerConfig


def http_url(sp: ServerProcess) -> str:
    return next(line.split()[2] for line in sp.log if line.startswith("mpcache-server http "))


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class DownTier:
    """An L2 tier whose service becomes unreachable once the file named by its argument exists
    (``python:test_ops_http:DownTier?/tmp/flag``); up before, so a required tier lets the server
    start."""

    name = "down-tier"

    def __init__(self, flag: str = "") -> None:
        self.flag = flag

    def _check(self) -> None:
        if os.path.exists(self.flag):
            raise ConnectionError("connection refused")

    def read(self, key: bytes) -> bytes | None:
        self._check()
        return None

    def write(self, key: bytes, data: bytes) -> None:
        self._check()

    def contains(self, key: bytes) -> bool:
        self._check()
        return False

    def read_many(self, keys: Any) -> list[bytes | None]:
        self._check()
        return [None for _ in keys]

    def write_many(self, items: Any) -> None:
        self._check()

    def close(self) -> None:
        pass


def test_endpoints_of_a_running_server(start_server: Callable[..., ServerProcess]) -> None:
    sp = start_server()
    base = http_url(sp)
    with MPCacheClient(sp.url) as c:
        c.noop()
    time.sleep(1.2)  # the first gauge refresh marks the loop serving
    code, body = get(base + "/healthz")
    assert code == 200 and json.loads(body)["status"] == "ok" and json.loads(body)["version"] == version()
    code, body = get(base + "/readyz")
    assert code == 200, body
    assert json.loads(body)["checks"] == {"core_sm": "ok", "l1": "ok"}
    code, body = get(base + "/status")
    status = json.loads(body)
    assert code == 200 and status["version"] == version() and status["url"] == sp.url
    assert status["config"]["chunk_size"] == 256 and status["l1"]["capacity_bytes"] > 0
    assert status["registered_instances"] == 0 and "registrations" not in status and status["ready"] is True
    assert "requests" not in status and "requests" not in status["stats"]  # one count of requests:
    assert status["requests_answered"] >= 1  # every request answered (the noop above)
    code, body = get(base + "/healthcheck")  # LMCache's tools probe this path
    assert code == 200 and json.loads(body)["status"] == "ok" and json.loads(body)["version"] == version()
    code, body = get(base + "/metrics")
    assert code == 200 and "mpcache_build_info{" in body
    for path in ("/", "/metrics/x", "/health", "/favicon.ico"):
        assert get(base + path)[0] == 404, path


def test_readyz_is_503_while_a_required_l2_tier_is_down(start_server: Callable[..., ServerProcess]) -> None:
    flag = os.path.join(tempfile.mkdtemp(prefix="mpcache-down-"), "down")
    sp = start_server("--l2", f"python:test_ops_http:DownTier?{flag}", "--l2-require")
    time.sleep(1.2)
    assert get(http_url(sp) + "/readyz")[0] == 200
    open(flag, "w").close()  # the tier's service goes away
    code, body = get(http_url(sp) + "/readyz")
    assert code == 503, body
    checks = json.loads(body)["checks"]
    assert checks["l2 down-tier"].startswith("down: ConnectionError: connection refused")
    assert checks["l1"] == "ok"
    # liveness is not readiness: the process and its loop are fine
    assert get(http_url(sp) + "/healthz")[0] == 200
    best_effort = start_server("--l2", f"python:test_ops_http:DownTier?{flag}")
    time.sleep(1.2)
    assert get(http_url(best_effort) + "/readyz")[0] == 200


def test_an_embedded_server_serves_the_probes_on_its_metrics_port() -> None:
    import socket
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tempfile.mkdtemp(prefix="mpcache-http-")
    server = Server(ServerConfig(url=f"ipc://{d}/s.sock", l1_size_bytes=8 << 20, slot_bytes=1 << 20, metrics_port=port))
    loop = threading.Thread(target=server.serve_forever)
    loop.start()
    try:
        base = f"http://127.0.0.1:{port}"
        assert wait_ready(base)
        assert get(base + "/healthz")[0] == 200
        assert "mpcache_build_info" in get(base + "/metrics")[1]
    finally:
        server.stop()
        loop.join(30)
    with socket.socket() as s:  # the server closed its own HTTP port when it stopped (no listener)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # its closed connections may wait
        s.bind(("127.0.0.1", port))
        s.listen()


def wait_ready(base: str, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if get(base + "/readyz")[0] == 200:
                return True
        except OSError:
            pass
        time.sleep(0.1)
    return False


def test_probes_answer_503_within_their_bound_when_the_loop_does_not_run() -> None:
    d = tempfile.mkdtemp(prefix="mpcache-http-")
    server = Server(ServerConfig(url=f"ipc://{d}/s.sock", l1_size_bytes=8 << 20, slot_bytes=1 << 20))
    http = OpsHttpServer(server, "127.0.0.1", 0)
    try:
        t0 = time.monotonic()
        code, body = get(http.url + "/healthz")
        assert code == 503 and "did not answer" in json.loads(body)["reason"]
        assert time.monotonic() - t0 < 5.0
        code, body = get(http.url + "/readyz")
        assert code == 503 and json.loads(body)["checks"]["loop"] == "starting"
        assert get(http.url + "/status")[0] == 503
        assert get(http.url + "/metrics")[0] == 200  # metrics never wait for the loop
        server.stop()
        code, body = get(http.url + "/readyz")
        assert code == 503 and json.loads(body)["checks"]["loop"] == "stopping"
        assert json.loads(get(http.url + "/healthz")[1])["status"] == "stopping"
    finally:
        http.close()
        server.channel.close()
        server.sock.close(0)
        server.ctx.term()
