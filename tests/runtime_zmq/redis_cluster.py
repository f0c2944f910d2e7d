"""A real Redis Cluster for tests: N masters (+ one replica each) of `redis-server
--cluster-enabled yes` on free loopback ports, joined by `redis-cli --cluster create`.

`RedisClusterProcesses` is a context manager; `redis_cluster` (module scope) is the pytest fixture.
Skipped, with the reason, only when `redis-server` or `redis-cli` is missing.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from types import TracebackType

import pytest

from redis_server import SKIP_REASON, RedisServer


def _command(port: int, *args: str, timeout: float = 2.0) -> str:
    """One command over RESP, the reply as text (bulk strings decoded, errors as '-ERR ...')."""
    parts = [f"*{len(args)}\r\n"] + [f"${len(a.encode())}\r\n{a}\r\n" for a in args]
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall("".join(parts).encode())
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
            if data.startswith((b"+", b"-", b":")) and data.endswith(b"\r\n"):
                break
            if data.startswith(b"$"):
                head, _, rest = data.partition(b"\r\n")
                if len(rest) >= int(head[1:]) + 2:
                    break
    return data.decode(errors="replace")


def _poll(done: Callable[[], bool], timeout: float, what: str) -> float:
    """Polls ``done`` (a node refusing the connection counts as not yet) every 50 ms; returns
    the seconds it took, or raises ``RuntimeError(what)`` after ``timeout``."""
    started = time.monotonic()
    while True:
        try:
            if done():
                return time.monotonic() - started
        except OSError:
            pass
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"{what} after {timeout} s")
        time.sleep(0.05)


class RedisClusterProcesses:
    def __init__(self, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
            raise FileNotFoundError(SKIP_REASON)
        self.masters = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[RedisServer] = []

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def url(self, query: str = "") -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.ports[: self.masters])
        return f"redis+cluster://{hosts}" + (f"?{query}" if query else "")

    def start(self) -> None:
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                # the other masters keep serving their slots while one is down (docs/fleet.md)
                "--cluster-require-full-coverage", "no"]
        try:
            for _ in range(self.masters * (1 + self.replicas)):
                node = RedisServer(args=args)
                node.start()
                self.nodes.append(node)
            subprocess.run(
                ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                check=True, capture_output=True, timeout=60,
            )
            self.wait_ok(30.0)
            self.wait_replicas(30.0)
        except BaseException:
            self.stop()
            raise

    def info(self, port: int) -> dict[str, str]:
        out: dict[str, str] = {}
        text = _command(port, "CLUSTER", "INFO")
        for line in text.splitlines():
            name, sep, value = line.partition(":")
            if sep:
                out[name.strip()] = value.strip()
        return out

    def wait_ok(self, timeout: float, ports: list[int] | None = None) -> float:
        """Waits until every (live) node reports cluster_state:ok; returns the seconds it took."""
        ports = ports if ports is not None else self.ports
        # cluster_state ok, and every node agrees every slot is served
        return _poll(lambda: all(self.info(p).get("cluster_state") == "ok"
                                 and self.info(p).get("cluster_slots_ok") == "16384" for p in ports),
                     timeout, "Redis Cluster not ok")

    def wait_replicas(self, timeout: float) -> None:
        """Waits until every replica finished its first sync (a replica that never synced refuses
        to take over: its data would be too old)."""
        def synced() -> bool:
            states = [_command(p, "INFO", "replication") for p in self.ports]
            replicas = [t for t in states if "role:slave" in t]
            return len(replicas) == self.masters * self.replicas and all("master_link_status:up" in t for t in replicas)

        _poll(synced, timeout, "Redis Cluster replicas did not sync")

    def wait_failover(self, dead: RedisServer, timeout: float = 30.0) -> float:
        """Waits until the live nodes marked ``dead`` failed and a replica took over its slots
        (every slot served again everywhere); returns the seconds it took."""
        live = [n.port for n in self.nodes if n is not dead]

        def marked_failed(port: int) -> bool:
            for line in _command(port, "CLUSTER", "NODES").splitlines():
                fields = line.split()
                if len(fields) > 2 and fields[1].split("@")[0].endswith(f":{dead.port}"):
                    return "fail" in fields[2] and "fail?" not in fields[2]
            return False

        return _poll(lambda: all(marked_failed(p) for p in live)
                     and all(self.info(p).get("cluster_slots_ok") == "16384" for p in live),
                     timeout, f"no failover of {dead.port}")

    def master_of(self, key: bytes) -> RedisServer:
        """The node that serves ``key``'s slot now."""
        slot = int(_command(self.nodes[0].port, "CLUSTER", "KEYSLOT", key.decode("latin-1")).strip()[1:])
        for node in self.nodes:
            try:
                nodes = _command(node.port, "CLUSTER", "NODES")
            except OSError:
                continue
            for line in nodes.splitlines():
                fields = line.split()
                if len(fields) < 9 or "master" not in fields[2] or "fail" in fields[2]:
                    continue
                for rng in fields[8:]:
                    lo, _, hi = rng.partition("-")
                    if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                        port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
                        return next(n for n in self.nodes if n.port == port)
            break
        raise RuntimeError(f"no master serves slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.nodes = []

    def __enter__(self) -> RedisClusterProcesses:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterProcesses]:
    try:
        cluster = RedisClusterProcesses()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    with cluster:
        yield cluster
