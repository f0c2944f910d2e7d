"""A real `redis-server` for tests: started on a free loopback port in a temporary directory.

`RedisServer` is a context manager; `redis_server` (module scope) and `redis_url` (per test,
database flushed first) are pytest fixtures. Tests that use them are skipped, with the reason,
only when the `redis-server` binary is missing; `.ci/run` installs it, so CI runs them.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from types import TracebackType

import pytest

REDIS_BINARY = "redis-server"
SKIP_REASON = (
    "redis-server is not installed (apt-get install redis-server; .ci/run installs it in CI)"
)


class TlsFiles:
    """A throwaway CA and a server certificate for 127.0.0.1 (made with the openssl command)."""

    def __init__(self, directory: str) -> None:
        openssl = shutil.which("openssl")
        if openssl is None:
            raise FileNotFoundError("openssl is not installed")
        self.ca = os.path.join(directory, "ca.crt")
        self.cert = os.path.join(directory, "server.crt")
        self.key = os.path.join(directory, "server.key")
        ca_key = os.path.join(directory, "ca.key")
        csr = os.path.join(directory, "server.csr")
        ext = os.path.join(directory, "san.ext")
        with open(ext, "w") as f:
            f.write("subjectAltName=IP:127.0.0.1\n")

        def run(*args: str) -> None:
            subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60)

        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", self.ca,
            "-days", "1", "-subj", "/CN=mpcache-test-ca")
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", self.key, "-out", csr,
            "-subj", "/CN=127.0.0.1")
        run("x509", "-req", "-in", csr, "-CA", self.ca, "-CAkey", ca_key, "-CAcreateserial",
            "-out", self.cert, "-days", "1", "-extfile", ext)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One `redis-server` process with no persistence, bound to 127.0.0.1 only."""

    def __init__(self, port: int | None = None, start_timeout_s: float = 10.0, *,
                 config: Sequence[str] = (), tls: TlsFiles | None = None,
                 args: Sequence[str] = ()) -> None:
        """`port`: a fixed port (to restart a Redis where clients expect it); default: a free one.
        `config`: redis.conf lines (passwords, ACL users), written to a 0600 file, never on argv.
        `tls`: serve TLS only on the port (the `rediss://` URL), with these certificates.
        `args`: more command-line options (cluster mode)."""
        self._config = list(config)
        self.tls = tls
        self._args = list(args)
        binary = shutil.which(REDIS_BINARY)
        if binary is None:
            raise FileNotFoundError(SKIP_REASON)
        self._binary = binary
        self._start_timeout_s = start_timeout_s
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._fixed_port = port
        self.port = port or 0

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    @property
    def directory(self) -> str:
        assert self._dir is not None
        return self._dir.name

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def start(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="mpcache-redis-")
        # A port picked by the OS may be taken again before redis binds it: retry a few times.
        last_error = ""
        for _ in range(1 if self._fixed_port else 5):
            self.port = self._fixed_port or free_port()
            log = os.path.join(self._dir.name, "redis.log")
            conf = os.path.join(self._dir.name, "redis.conf")
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("\n".join(self._config) + "\n")
            ports = ["--port", str(self.port)]
            if self.tls is not None:
                ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.tls.cert,
                         "--tls-key-file", self.tls.key, "--tls-ca-cert-file", self.tls.ca,
                         "--tls-auth-clients", "no"]
            self._proc = subprocess.Popen(
                [
                    self._binary,
                    conf,
                    "--bind", "127.0.0.1",
                    *ports,
                    "--dir", self._dir.name,
                    "--save", "",
                    "--appendonly", "no",
                    "--daemonize", "no",
                    "--protected-mode", "yes",
                    "--logfile", log,
                    *self._args,
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._wait_ready():
                return
            last_error = self._log_tail(log)
            self._terminate()
        self._cleanup_dir()
        raise RuntimeError(f"redis-server did not start: {last_error}")

    def stop(self) -> None:
        self._terminate()
        self._cleanup_dir()

    def kill(self) -> None:
        """SIGKILL: the process dies at once, as in a crash (its directory stays until stop)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _wait_ready(self) -> bool:
        assert self._proc is not None
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                    s = raw
                    if self.tls is not None:
                        ctx = ssl.create_default_context(cafile=self.tls.ca)
                        s = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):
                        return True
            except OSError:
                pass
            time.sleep(0.02)
        return False

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def _cleanup_dir(self) -> None:
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    @staticmethod
    def _log_tail(log: str) -> str:
        try:
            with open(log, encoding="utf-8", errors="replace") as f:
                return f.read()[-500:]
        except OSError:
            return "(no log)"


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    if shutil.which(REDIS_BINARY) is None:
        pytest.skip(SKIP_REASON)
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The module's Redis, emptied before the test."""
    with socket.create_connection(("127.0.0.1", redis_server.port), timeout=2) as s:
        s.sendall(b"FLUSHALL\r\n")
        assert s.recv(64).startswith(b"+OK")
    return redis_server.url
