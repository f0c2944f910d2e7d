"""Fixtures: real mpcache-server processes (``python -m mpcache.runtime_zmq.cli``) on a free TCP port or a
temporary ipc path, and clients connected to them."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mpcache.runtime_zmq.client import MPCacheClient

from live_server import ADMIN_TOKEN, HERE, REPO, RawDealer, ServerProcess, wait_for  # noqa: F401 (fixtures use them; tests import live_server)


@pytest.fixture
def start_server() -> Iterator[Callable[..., ServerProcess]]:
    """``start_server(*flags, transport="tcp"|"ipc")`` → a running ServerProcess."""
    started: list[ServerProcess] = []
    tmp = tempfile.mkdtemp(prefix="mpcache-test-")
    token_file = os.path.join(tmp, "admin.token")
    with open(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(ADMIN_TOKEN)

    def start(*flags: str, transport: str = "tcp", env: dict[str, str] | None = None) -> ServerProcess:
        args = list(flags)
        if transport == "ipc":
            args += ["--ipc", os.path.join(tmp, f"sock{len(started)}", "mpcache.sock")]
        elif "--port" not in args:
            args += ["--port", "0"]
        if "--l1-size-gb" not in args:
            args += ["--l1-size-gb", "0.25", "--slot-mb", "1"]
        if "--admin-token-file" not in args:
            args += ["--admin-token-file", token_file]
        sp = ServerProcess(args, env).start()
        started.append(sp)
        return sp

    yield start
    for sp in started:
        sp.kill()


@pytest.fixture(params=["tcp", "ipc"])
def transport(request: Any) -> str:
    return str(request.param)


@pytest.fixture
def server(start_server: Callable[..., ServerProcess], transport: str) -> ServerProcess:
    return start_server(transport=transport)


@pytest.fixture
def client(server: ServerProcess) -> Iterator[MPCacheClient]:
    c = MPCacheClient(server.url, request_timeout=5.0)
    assert c.healthy
    yield c
    c.close()


@pytest.fixture
def raw(server: ServerProcess) -> Iterator[RawDealer]:
    r = RawDealer(server.url)
    yield r
    r.close()
