"""What a server does before its first reply (docs/benchmarks.md "Start-up path").

* L1's reservation (``--l1-reserve``, the default) runs beside the loop: the server answers while
  the kernel commits the segment's pages, a use of the segment waits for it, and no room is still
  a start error (``serve_forever`` raises it after a clean shutdown; ``mpcache-server`` exits 1).
* The modules a default server needs to answer do not pull in numpy/numba (the token scanner
  loads them on its thread) or asyncio (CURVE's authenticator only)."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest

from live_server import wait_for
from mpcache.runtime_zmq import l1_pool
from mpcache.runtime_zmq.client import MPCacheClient
from mpcache.runtime_zmq.http import OpsHttpServer
from mpcache.runtime_zmq.server import Server, ServerConfig


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _server(shm: str) -> Server:
    d = tempfile.mkdtemp(prefix="mpcache-reserve-")
    return Server(ServerConfig(url=f"ipc://{d}/s.sock", l1_size_bytes=8 << 20, slot_bytes=1 << 20, shm_dir=shm))


def test_the_server_answers_while_l1_is_reserved_and_the_segment_waits_for_it(monkeypatch: Any, tmp_path: Any) -> None:
    release = threading.Event()
    entered = threading.Event()
    real = os.posix_fallocate

    def slow(fd: int, offset: int, length: int) -> None:
        entered.set()
        assert release.wait(30)
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", slow)
    server = _server(str(tmp_path))
    loop = threading.Thread(target=server.serve_forever, name="server-loop")
    loop.start()
    c = MPCacheClient(server.bound_url, request_timeout=10.0)
    try:
        assert entered.wait(10)
        assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(server.pool.path)]  # owned from the start
        assert c.health()["status"] == "ok"  # answered while the reservation is still running
        assert not server.pool.created and server.l1_reserving
        http = OpsHttpServer(server, "127.0.0.1", 0)
        try:  # not ready while reserving: a store would wait for the reservation
            assert wait_for(lambda: server.metrics.serving, timeout=10.0)
            status, body = _get(http.url + "/readyz")
            assert status == 503 and "reserved" in body["checks"]["l1"], body
        finally:
            http.close()
        segment = c.submit("l1_info")  # needs the segment: waits for the reservation
        assert not segment.done()
        release.set()
        assert segment.result(10)["segment"] == server.pool.path
        assert os.stat(server.pool.path).st_blocks * 512 >= 8 << 20  # reserved, not sparse
        assert wait_for(lambda: not server.l1_reserving, timeout=10.0)
    finally:
        release.set()
        c.close()
        server.stop()
        loop.join(10)
    assert not loop.is_alive() and list(tmp_path.iterdir()) == []


def test_no_room_for_l1_stops_the_server_with_the_error_and_leaves_nothing(monkeypatch: Any, tmp_path: Any) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    server = _server(str(tmp_path))
    with pytest.raises(l1_pool.ReservationError, match="lower --l1-size-gb"):
        server.serve_forever()
    assert server.start_error is not None
    assert list(tmp_path.iterdir()) == []


def test_the_start_up_imports_leave_the_heavy_modules_to_who_needs_them() -> None:
    code = ("import sys, mpcache.runtime_zmq.cli, mpcache.runtime_zmq.server; "
            "print(' '.join(m for m in ('numpy', 'numba', 'asyncio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == []
