"""The unauthenticated HTTP side leaks no tenant data (hostile finding 4): a request's
``cache_salt`` (a tenant's isolation secret in vLLM) is in no metric label and not in ``/status``,
and ``/status`` lists registered instance ids only to a request carrying the admin token."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable

from live_server import ADMIN_TOKEN, ServerProcess
from mpcache.runtime_zmq.client import MPCacheClient
from test_ops_http import get, http_url
from test_server_ops import key, register, tokens

SALT = "tenant-7-isolation-secret-5f1c"


def get_with(url: str, headers: dict[str, str]) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_no_salt_in_metrics_or_status_and_ids_only_for_the_admin(start_server: Callable[..., ServerProcess]) -> None:
    sp = start_server()
    base = http_url(sp)
    instance = 918_273_645
    with MPCacheClient(sp.url) as c:
        register(c, instance)
        c.lookup(key(tokens(1, seed=3), "salted-1", salt=SALT)).result(5)
        assert c.wait_prefetch_status("salted-1", 1.0).result(5) == 0
    code, metrics_body = get(base + "/metrics")
    assert code == 200 and "mpcache_lookups_total{" in metrics_body
    assert SALT not in metrics_body and "tenant-7" not in metrics_body
    code, body = get(base + "/status")
    assert code == 200
    assert SALT not in body and "tenant-7" not in body
    status = json.loads(body)
    assert str(instance) not in body and "registrations" not in status
    assert status["registered_instances"] == 1
    (row,) = status["lookups"]
    hashed = row["cache_salt_hash"]
    assert len(hashed) == 16 and f'cache_salt_hash="{hashed}"' in metrics_body  # one tenant, one name
    for wrong in ({"Authorization": "Bearer not-the-token-0123456789"}, {"Authorization": ADMIN_TOKEN}):
        code, body = get_with(base + "/status", wrong)
        assert code == 200 and str(instance) not in body
    code, body = get_with(base + "/status", {"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert code == 200 and SALT not in body
    assert json.loads(body)["registrations"] == [{"instance_id": instance, "object_bytes": 4096}]
