"""LMCache 0.5.6's own request client against an mpcache server (control plane). Skipped when
the LMCache venv (tools/lmcache_venv.sh → .venv-lmcache) is not there."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

from live_server import HERE, REPO, ServerProcess
from mpcache.runtime_zmq.client import MPCacheClient
from test_server_ops import register, store_chunks, tokens

LMCACHE_PY = os.path.join(REPO, ".venv-lmcache", "bin", "python")

pytestmark = pytest.mark.skipif(not os.path.exists(LMCACHE_PY), reason="no .venv-lmcache (bash tools/lmcache_venv.sh)")


def test_lmcache_client_drives_the_control_plane(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server()  # tcp only: LMCache's import alone takes seconds
    hit = tokens(2, seed=17)
    with MPCacheClient(server.url) as c:
        register(c, 1)
        assert store_chunks(c, hit, "w")["stored"] == 2
    out = subprocess.run(
        [LMCACHE_PY, os.path.join(HERE, "lmcache_client_script.py"), server.url, json.dumps(hit)],
        capture_output=True, text=True, timeout=120, cwd=HERE,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    ok = {k: v[1] for k, v in r.items() if v[0] == "ok"}
    assert ok["noop"] == "OK" and ok["get_chunk_size"] == 256 and ok["ping"] is True
    assert ok["lookup_miss"] is None and ok["status_miss"] == 0
    assert ok["status_unknown"] == 0 and ok["wait_unknown"] == 0
    assert ok["lookup_hit"] is None and ok["status_hit"] == 2 and ok["status_hit_again"] == 2
    for name in ("free_lookup_locks", "end_session", "report_block_allocation"):
        assert ok[name] is None, name
    # clear is an admin operation and LMCache's client sends no token: a clean per-request error
    assert r["clear"][0] == "exc"
    # an error is a clean per-request exception in LMCache's client, and the link keeps working
    assert r["bad_range_free"][0] == "exc" and "does not match" in r["bad_range_free"][2]
    assert ok["noop_after"] == "OK"
    with MPCacheClient(server.url) as c:
        assert c.stats()["leases_held"] == 0
