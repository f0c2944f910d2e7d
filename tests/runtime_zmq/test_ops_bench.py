"""`mpcache-bench server` prints its table (against its own server, and against --url)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

from live_server import REPO, ServerProcess


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mpcache.bench.bench_cli", "server", *argv], capture_output=True, text=True,
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), timeout=120)


def test_bench_server_against_its_own_server() -> None:
    out = run("--lookups", "30", "--in-flight", "4")
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.strip().splitlines()[-2:]
    assert header.split()[:3] == ["lookups", "tokens", "each"] and row.split()[:3] == ["30", "1024", "4"]


def test_bench_server_against_a_running_server(start_server: Callable[..., ServerProcess]) -> None:
    sp = start_server()
    out = run("--url", sp.url, "--lookups", "10", "--chunks", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1].split()[:2] == ["10", "256"]
