"""The ``mpcache-server`` command line: help, environment variables, ipc permissions, start time."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from live_server import REPO, ServerProcess
from mpcache.runtime_zmq.client import MPCacheClient


def test_help_lists_every_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "mpcache.runtime_zmq.cli", "--help"], capture_output=True, text=True, cwd=REPO, timeout=30)
    assert out.returncode == 0
    for flag in ("--host", "--port", "--ipc", "--chunk-size", "--l1-size-gb", "--l2", "--metrics-port", "--log-level", "MPCACHE_"):
        assert flag in out.stdout, flag


def test_environment_variables(start_server: Callable[..., ServerProcess]) -> None:
    sp = start_server(env={"MPCACHE_CHUNK_SIZE": "512", "MPCACHE_LOG_LEVEL": "WARNING"})
    with MPCacheClient(sp.url) as c:
        assert c.get_chunk_size() == 512
    # a flag wins over the environment
    sp2 = start_server("--chunk-size", "128", env={"MPCACHE_CHUNK_SIZE": "512"})
    with MPCacheClient(sp2.url) as c:
        assert c.get_chunk_size() == 128


def test_ipc_socket_is_private_and_default_is_loopback(start_server: Callable[..., ServerProcess]) -> None:
    d = tempfile.mkdtemp(prefix="mpcache-cli-")
    path = os.path.join(d, "run", "mpcache.sock")
    sp = start_server("--ipc", path)
    assert sp.url == "ipc://" + path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    tcp = start_server()
    assert tcp.url.startswith("tcp://127.0.0.1:")


def test_start_to_first_reply_is_fast_with_a_large_l1(start_server: Callable[..., ServerProcess]) -> None:
    t0 = time.monotonic()
    sp = start_server("--l1-size-gb", "64", "--slot-mb", "32", "--no-l1-reserve", "--l1-clamp")  # clamped; never touched
    with MPCacheClient(sp.url) as c:
        assert c.noop() == "OK"
        elapsed = time.monotonic() - t0
        assert c.stats()["l1_segment_created"] is False  # lazily: nothing allocated yet
    # generous bound for a loaded CI machine; the benchmark measures the real figure
    assert elapsed < 5.0
