"""``mpcache-cli`` against a running server: ping, health, stats [--json], clear, bench; a server
that is not there is exit status 3 with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from live_server import REPO, ServerProcess
from mpcache.runtime_zmq.client import MPCacheClient
from test_server_ops import key, register, store_chunks, tokens


def cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "mpcache.runtime_zmq.admin_cli", *argv], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=timeout)


def test_commands_against_a_server(start_server: Callable[..., ServerProcess], tmp_path: Any) -> None:
    token = tmp_path / "admin.token"
    token.write_text("a-test-admin-token-of-32-bytes!!\n")
    os.chmod(token, 0o600)
    sp = start_server("--admin-token-file", str(token))
    with MPCacheClient(sp.url) as c:
        register(c, 1)
        toks = tokens(2, seed=3)
        store_chunks(c, toks, "s")
        c.lookup(key(toks, "r")).result(5)
        assert c.wait_prefetch_status("r", 1.0).result(5) == 2
    out = cli("--url", sp.url, "ping")
    assert out.returncode == 0 and "ping: True in" in out.stdout and "noop: 'OK' in" in out.stdout
    out = cli("--url", sp.url, "health")
    assert out.returncode == 0 and json.loads(out.stdout)["status"] == "ok"
    out = cli("--url", sp.url, "stats")
    assert out.returncode == 0, out.stderr
    assert "hit tokens" in out.stdout and "512 of 512 (100.0%)" in out.stdout
    assert "L1 objects                         2" in out.stdout
    out = cli("--url", sp.url, "stats", "--json")
    assert json.loads(out.stdout)["hit_chunks"] == 2
    out = cli("--url", sp.url, "clear")
    assert out.returncode != 0 and "forbidden" in out.stdout + out.stderr  # clear is an admin operation
    out = cli("--url", sp.url, "clear", "--admin-token-file", str(token))
    assert out.returncode == 0 and out.stdout.startswith("clear:")
    out = cli("--url", sp.url, "bench", "--lookups", "40", "--in-flight", "8")
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()[:2]
    assert header.split()[:2] == ["lookups", "tokens"] and row.split()[0] == "40"
    out = cli("bench", "--url", sp.url, "--lookups", "5")  # the URL may follow the subcommand too
    assert out.returncode == 0 and out.stdout.splitlines()[1].split()[0] == "5", out.stderr


def test_unreachable_server_is_exit_3() -> None:
    out = cli("--url", "tcp://127.0.0.1:1", "--timeout", "0.5", "ping")
    assert out.returncode == 3
    assert out.stderr.strip() == "mpcache-cli: no answer from tcp://127.0.0.1:1 within 0.5 s"


def test_usage_errors_are_one_line() -> None:
    out = cli("frobnicate")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and out.stderr.startswith("mpcache-cli: error:")
    out = cli("bench", "--lookups", "0")
    assert out.returncode == 2 and "must be > 0" in out.stderr
