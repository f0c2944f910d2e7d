"""Fixtures: real mpcache-server processes (``python -m mpcache.runtime_zmq.cli``) on a free TCP port or a
temporary ipc path, and clients connected to them."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mpcache.runtime_zmq.client import MPCacheClient
from mpcache.tools.server_process import ServerProcess as ChildServer

HERE = os.path.dirname(os.path.realpath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


class ServerProcess:
    """One ``mpcache-server`` child process. ``url`` is known once it printed its ready line."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        if "--metrics-port" not in args and "--no-metrics" not in args:
            args = [*args, "--metrics-port", "0"]  # a free port: tests run servers side by side
        self.args = args
        self.env = env
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.log: list[str] = []

    def start(self, timeout: float = 30.0) -> ServerProcess:
        env = dict(os.environ)
        env.update(self.env or {})
        # this folder for test-only tiers (slow_tier); the helper puts the repo first
        env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
        child = ChildServer(self.args, repo=REPO, env=env, ready_timeout=timeout)
        self.proc, self.url, self.log, self._pump = child.proc, child.url, child.log, child.pump
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def terminate(self, timeout: float = 10.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def output(self, timeout: float = 10.0) -> str:
        """Everything the process printed (stdout and stderr), once it exited."""
        assert self.proc is not None
        self.proc.wait(timeout)
        self._pump.join(timeout)
        return "\n".join(self.log)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


# Every server the fixture starts has this admin token (clear needs it: docs/security.md);
# a test clears with ``client.clear(force, ADMIN_TOKEN)``.
ADMIN_TOKEN = "mpcache-test-admin-token-0123456789"


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


def wait_for(pred: Callable[[], bool], timeout: float = 5.0, interval: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return pred()


class RawDealer:
    """A bare DEALER socket speaking frames, for wire-level tests (what LMCache's client sends)."""

    def __init__(self, url: str) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(url)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout: float = 5.0) -> list[bytes] | None:
        if self.sock.poll(int(timeout * 1000)):
            return list(self.sock.recv_multipart())
        return None

    def request(self, frames: list[bytes], timeout: float = 5.0) -> list[bytes]:
        self.send(frames)
        reply = self.recv(timeout)
        assert reply is not None, f"no reply to {frames[:2]!r}"
        return reply

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def raw(server: ServerProcess) -> Iterator[RawDealer]:
    r = RawDealer(server.url)
    yield r
    r.close()
