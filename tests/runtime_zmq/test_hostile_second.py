"""Hostile clients, second round, against a real server process: a reaped id stays its owner's,
an engine-driven store is written before it is served, a message that never ends is bounded, a
routing id is no bearer secret, and the IPC socket and logs stay tidy."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from live_server import RawDealer, ServerProcess, wait_for
from mpcache.runtime_zmq.client import MPCacheClient, RemoteError
from test_server_ops import OBJ_BYTES, key, register, store_chunks, tokens

P = msgpack.packb


def _error_kind(reply: list[bytes]) -> str:
    assert reply[1] == P("error"), reply[:3]
    return str(msgpack.unpackb(reply[2], raw=False)["kind"])


def _layout() -> dict[str, Any]:
    return {"model_name": "m", "world_size": 1, "object_bytes": OBJ_BYTES, "engine_driven": True}


def test_a_reaped_instance_id_is_not_anyones(start_server: Callable[..., ServerProcess]) -> None:
    # Finding 4: once the victim's instance was reaped, an attacker registered the victim's id
    # and the victim was locked out (forbidden) for good. The id now stays the victim's.
    ttl = 1.0
    sp = start_server("--instance-ttl", str(ttl))
    victim = MPCacheClient(sp.url, request_timeout=5.0, heartbeat_interval=30.0, heartbeat_timeout=60.0)
    attacker = RawDealer(sp.url)
    try:
        register(victim, 5)
        assert victim.ping(5) is True  # watched from its first heartbeat on, then silent
        assert wait_for(lambda: victim.stats()["instances_reaped"] == 1, timeout=5 * ttl)
        reply = attacker.request([P(1), P("register_instance"), P(5), P(_layout())])
        assert _error_kind(reply) == "forbidden"
        # the victim's next store finds its instance reaped, registers it again and completes
        assert store_chunks(victim, tokens(2, seed=3), "w", iid=5, seed=3)["ok"]
        assert victim._monitor.stats()["reregistrations"] == 1
    finally:
        attacker.close()
        victim.close()


def test_an_engine_driven_commit_without_writing_serves_zeros_never_old_bytes(
    start_server: Callable[..., ServerProcess],
) -> None:
    # Finding 8: commit_store(ok=True) without writing made whatever the slots held READY, and
    # freed slots are reused lowest-first: a tenant read another tenant's evicted KV. The plan's
    # slots are now zeroed before the plan is answered.
    from live_server import ADMIN_TOKEN
    from mpcache.runtime_zmq.l1_pool import MappedSegment

    sp = start_server()
    victim = MPCacheClient(sp.url, request_timeout=5.0)
    attacker = MPCacheClient(sp.url, request_timeout=5.0)
    try:
        register(victim, 1)
        register(attacker, 2)
        assert store_chunks(victim, tokens(3, seed=5), "v", iid=1, seed=5)["ok"]
        victim.clear(True, ADMIN_TOKEN).result(5)  # the slots are free again, their bytes kept
        toks = tokens(3, seed=8)
        plan = attacker.prepare_store(key(toks, "a", worker_id=0), 2).result(5)
        assert plan["ok"] and len(plan["placements"]) == 3
        assert attacker.commit_store(plan["transfer_id"], True).result(5)["ok"]  # nothing written
        attacker.lookup(key(toks, "r")).result(5)
        assert attacker.wait_prefetch_status("r", 10.0).result(15) == 3
        got = attacker.prepare_retrieve(key(toks, "r", worker_id=0), 2).result(5)
        assert got["ok"] and sorted(s for _c, s, _o in got["placements"]) == sorted(s for _c, s, _o in plan["placements"])
        seg = MappedSegment(got["segment"], got["slot_bytes"], 1 << 30)
        try:
            for _chunk, slot, _off in got["placements"]:
                assert bytes(seg.view(slot, OBJ_BYTES)) == bytes(OBJ_BYTES)  # zeros, not the victim's
        finally:
            seg.close()
        attacker.commit_retrieve(got["transfer_id"], True).result(5)
    finally:
        attacker.close()
        victim.close()


def test_a_clean_stop_removes_the_ipc_socket(start_server: Callable[..., ServerProcess]) -> None:
    sp = start_server(transport="ipc")
    path = sp.url[len("ipc://"):]
    assert os.path.exists(path)
    with MPCacheClient(sp.url, request_timeout=5.0) as c:
        assert c.healthy
    assert sp.terminate() == 0
    assert not os.path.exists(path)
    # a supervisor's replacement took the path over: the old server's stop leaves the new socket
    old = start_server("--ipc", path)
    new = start_server("--ipc", path)
    assert old.terminate() == 0
    with MPCacheClient(new.url, request_timeout=5.0) as c:
        assert c.health()["pid"] == new.proc.pid
    assert new.terminate() == 0
    assert not os.path.exists(path)


def test_a_repeated_registration_logs_at_debug(start_server: Callable[..., ServerProcess]) -> None:
    # The vLLM connector's worker showed three `registration accepted` lines at INFO: its own and
    # the repeats of its transport and machine (same fields, same registration id).
    sp = start_server()
    with MPCacheClient(sp.url, request_timeout=5.0) as c:
        for _ in range(3):
            register(c, 3)
        other = dict(_layout(), object_bytes=OBJ_BYTES // 2)  # other fields: a new registration
        assert isinstance(c.register_instance(3, other).result(5), int)
        c.unregister_instance(3).result(5)
    assert wait_for(lambda: any("instance 3 unregistration accepted" in x for x in sp.log))
    accepted = [x for x in sp.log if "instance 3 registration accepted" in x]
    assert len(accepted) == 2, accepted
