"""``mpcache-cli`` against a running server: ping, health, stats [--json], clear, bench; a server
that is not there is exit status 3 with one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
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
    assert out.returncode == 0 and "ping: ok in" in out.stdout and "noop: ok in" in out.stdout, out.stdout
    # HOST:PORT is the connector's form of an address too (it was zmq's "Invalid argument")
    out = cli("--url", sp.url.removeprefix("tcp://"), "ping")
    assert out.returncode == 0 and "ping: ok in" in out.stdout, out.stderr
    out = cli("--url", sp.url, "health", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["status"] == "ok"
    out = cli("--url", sp.url, "health")
    assert out.returncode == 0 and out.stdout.splitlines()[0].split() == ["status", "ok"], out.stdout
    assert re.search(r"^chunk size +256 tokens$", out.stdout, re.M) and re.search(r"^L2 tier +none$", out.stdout, re.M)
    assert "<" not in out.stdout and "True" not in out.stdout and "'" not in out.stdout, out.stdout
    out = cli("--url", sp.url, "stats")
    assert out.returncode == 0, out.stderr
    assert "hit tokens" in out.stdout and "512 of 512 (100.0%)" in out.stdout
    assert "L1 objects                         2" in out.stdout
    out = cli("--url", sp.url, "stats", "--json")
    assert json.loads(out.stdout)["hit_chunks"] == 2
    out = cli("--url", sp.url, "clear")
    assert out.returncode != 0 and "forbidden" in out.stdout + out.stderr  # clear is an admin operation
    out = cli("--url", sp.url, "clear", "--admin-token-file", str(token))
    assert out.returncode == 0 and out.stdout.strip() == "clear: done", out.stdout
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


def test_the_timeout_is_the_time_it_takes() -> None:
    """``--timeout 1`` gives up on a dead server after about 1 s (it took the client's 5 s connect
    wait plus the timeout: 6 s while saying 1 s). The margin is the interpreter's start."""
    t0 = time.monotonic()
    out = cli("--url", "127.0.0.1:1", "--timeout", "1", "ping")
    took = time.monotonic() - t0
    assert out.returncode == 3 and "within 1 s" in out.stderr, out.stderr
    assert took < 4.0, f"--timeout 1 took {took:.1f} s"


def test_url_forms() -> None:
    from mpcache.runtime_zmq import admin_cli

    args, _ = admin_cli.cfg.parse(admin_cli.build_parser(), ["--url", "localhost:5555", "ping"], {})
    assert args.url == "tcp://localhost:5555"
    args, _ = admin_cli.cfg.parse(admin_cli.build_parser(), ["ping"], {"MPCACHE_URL": "ipc:///run/mpcache.sock"})
    assert args.url == "ipc:///run/mpcache.sock"
    for url in ("http://127.0.0.1:9555", "HTTPS://host:9555/metrics"):
        out = cli("--url", url, "ping")
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert "this is the ZMQ address" in out.stderr and "not the HTTP port" in out.stderr
    out = cli("--url", "a:1,b:2", "ping")
    assert out.returncode == 2 and "one address" in out.stderr
    out = cli("--url", "tcp://127.0.0.1", "ping")  # no port: zmq's "Invalid argument", now a usage error
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "use tcp://HOST:PORT" in out.stderr, out.stderr


def test_values_are_printed_for_people() -> None:
    from mpcache.runtime_zmq.admin_cli import human

    assert human(True) == "yes" and human("OK") == "OK" and human(None) == "-"
    assert human("<RedisTier redis://h:6379/0>") == "redis://h:6379/0"
    assert human(["<DiskTier disk:/var/cache/mpcache, cap 10 B>"]) == "disk:/var/cache/mpcache, cap 10 B"


def test_usage_errors_are_one_line() -> None:
    out = cli("frobnicate")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and out.stderr.startswith("mpcache-cli: error:")
    out = cli("bench", "--lookups", "0")
    assert out.returncode == 2 and "must be > 0" in out.stderr


def test_slot_sizes_are_printed_in_the_unit_that_shows_them() -> None:
    # slots follow the objects registered: a 4 KiB slot printed as "0 MiB" said nothing
    from mpcache.runtime_zmq.admin_cli import _size

    assert _size(4096) == "4 KiB" and _size(3 << 20) == "3 MiB" and _size(33554432) == "32 MiB"
