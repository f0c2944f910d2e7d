"""A server-driven STORE with a deadline, refused not_registered (its instance was failed or
reaped), is resent after the client registers the instance again -- naming that registration --
and goes through, although the server remembers the original's refusal; the original sent
again (as a network duplicate would be) still copies nothing."""
from __future__ import annotations

import time

from mpcache.runtime_zmq.client import MPCacheClient
from test_executor_fails_instance import LAYOUT, StuckExecutor, serve_in_thread
from test_server_ops import key, tokens


def test_a_store_refused_not_registered_is_resent_naming_the_new_registration_and_lands() -> None:
    executor = StuckExecutor()
    executor.stuck = False  # every copy finishes
    server, loop = serve_in_thread(executor)
    c = MPCacheClient(server.bound_url, request_timeout=5.0)
    try:
        first = c.register_instance(7, LAYOUT).result(5)
        assert isinstance(first, int) and c.register_instance(7, LAYOUT).result(5) == first  # alike: same id
        executor.fail(7)  # the instance is gone from core_sm, as after a reap
        assert c.stats()["instances"] == 0
        toks = tokens(2, seed=11)
        args = (key(toks, "s", worker_id=0), 7, list(range(32)), b"E" * 64, time.monotonic() + 20.0)
        _handle, ok = c.submit("store", *args).result(10)
        assert ok is True
        stats = c.stats()
        assert stats["instances"] == 1 and stats["resends_run"] == 1 and stats["transfers_started"] == 1
        monitor = c.link.monitor.stats()
        assert monitor["reregistrations"] == 1 and monitor["resends"] == 1 and monitor["give_ups"] == 0
        # the original's bytes again: its remembered refusal, so the client resends it once more
        # (naming the same registration: the resend's remembered answer) -- no second copy
        _handle, ok = c.submit("store", *args).result(10)
        stats = c.stats()
        assert ok is True and stats["transfers_started"] == 1 and stats["duplicate_transfers"] == 2
        c.lookup(key(toks, "r")).result(5)
        assert c.query_prefetch_status("r").result(5) == 2  # the resend's store is a hit
    finally:
        c.close()
        server.stop()
        loop.join(10)
        assert not loop.is_alive()
