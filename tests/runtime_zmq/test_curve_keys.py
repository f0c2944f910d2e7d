"""CURVE key hygiene (hostile finding 11): a server refuses, with one ``cannot start:`` line, a
secret key that is a symlink or not its own, and an ``authorized/`` directory (or key in it)
that another user could write to -- any of them lets someone else pick the keys it trusts."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from live_server import REPO, ServerProcess
from mpcache.runtime_zmq import auth
from mpcache.runtime_zmq.client import MPCacheClient


def start(keys: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run(
        [sys.executable, "-m", "mpcache.runtime_zmq.cli", "--curve-dir", str(keys), "--port", "0",
         "--l1-size-gb", "0.0625", "--slot-mb", "1", "--no-metrics"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=60)


def symlinked_secret(keys: Path) -> None:
    real = keys.parent / "elsewhere.key_secret"
    shutil.move(keys / "server.key_secret", real)
    (keys / "server.key_secret").symlink_to(real)


def foreign_secret(keys: Path) -> None:
    os.chown(keys / "server.key_secret", 4242, -1)


def open_authorized(keys: Path) -> None:
    (keys / "authorized").chmod(0o777)


def group_writable_authorized(keys: Path) -> None:
    (keys / "authorized").chmod(0o770)


def writable_key_dir(keys: Path) -> None:
    keys.chmod(0o777)


def symlinked_authorized(keys: Path) -> None:
    shutil.move(keys / "authorized", keys.parent / "auth-real")
    (keys / "authorized").symlink_to(keys.parent / "auth-real")


def symlinked_client_key(keys: Path) -> None:
    real = keys.parent / "planted.key"
    shutil.move(keys / "authorized" / "engine.key", real)
    (keys / "authorized" / "engine.key").symlink_to(real)


def writable_client_key(keys: Path) -> None:
    (keys / "authorized" / "engine.key").chmod(0o666)


CASES = [symlinked_secret, open_authorized, group_writable_authorized, writable_key_dir, symlinked_authorized,
         symlinked_client_key, writable_client_key]
if os.geteuid() == 0:
    CASES.append(foreign_secret)  # chown needs root


@pytest.mark.parametrize("spoil", CASES, ids=lambda f: f.__name__)
def test_unsafe_key_files_are_refused_at_start(spoil: Callable[[Path], None], tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    auth.keygen(str(keys), "engine")
    spoil(keys)
    p = start(keys)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "cannot start:" in out, out[-2000:]
    assert "ready" not in p.stdout


def test_keygen_output_is_accepted(start_server: Callable[..., ServerProcess], tmp_path: Any) -> None:
    old = os.umask(0o002)  # a permissive umask must not make keygen's files unacceptable
    try:
        keys = tmp_path / "keys"
        auth.keygen(str(keys), "engine")
    finally:
        os.umask(old)
    sp = start_server("--curve-dir", str(keys))
    with MPCacheClient(sp.url, curve_dir=str(keys), curve_client="engine") as c:
        assert c.noop() == "OK"
