"""Helpers the live-server tests import by name (``from live_server import ...``): a real
``mpcache-server`` child process, the fixture's admin token, ``wait_for`` and a raw DEALER.

Kept out of ``conftest.py`` on purpose: several test folders have a conftest, and importing one
by module name resolves to whichever folder pytest put first on ``sys.path``."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable

from mpcache.bench.server_process import ServerProcess as ChildServer

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
