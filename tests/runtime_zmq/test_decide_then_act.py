"""Decide, then act: the server's transfer engine (the GPU executor on a GPU host) is touched only
after core_sm accepted the request. A register or unregister from a peer that does not own the
instance, or a registration core_sm refuses for its fields, never reaches the executor; so a
tenant's next store cannot be copied through another peer's registration (reading or poisoning
its KV)."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from mpcache.core_sm.effects import StartTransfer
from mpcache.runtime_zmq.client import MPCacheClient, RemoteError
from mpcache.runtime_zmq.server import Server, ServerConfig
from test_server_ops import key, tokens


class RecordingExecutor:
    """Accepts every layout; records what reaches it and which layout each copy used."""

    def __init__(self, refuse: str | None = None) -> None:
        self.refuse = refuse
        self.calls: list[tuple[str, int, Any]] = []
        self.layouts: dict[int, Any] = {}
        self.copied_with: list[Any] = []

    def register_instance(self, instance_id: int, layout: Any, pool: Any) -> str | None:
        self.calls.append(("register", instance_id, dict(layout)))
        if self.refuse is not None:
            return self.refuse
        self.layouts[instance_id] = dict(layout)  # re-registering replaces, as the GPU engine does
        return None

    def unregister_instance(self, instance_id: int) -> None:
        self.calls.append(("unregister", instance_id, None))
        self.layouts.pop(instance_id, None)

    def start(self, transfer: StartTransfer, event_handle: bytes, done: Any) -> None:
        self.copied_with.append(self.layouts.get(transfer.instance_id))
        threading.Timer(0.01, done, args=(transfer.transfer_id, True)).start()

    def close(self) -> None:
        pass


def _layout(tenant: str) -> dict[str, Any]:
    return {"model_name": "m", "world_size": 1, "object_bytes": 4096, "engine_driven": False, "tensors": [tenant]}


@pytest.fixture
def served() -> Iterator[tuple[Server, RecordingExecutor, MPCacheClient, MPCacheClient]]:
    executor = RecordingExecutor()
    d = tempfile.mkdtemp(prefix="mpcache-decide-")
    server = Server(ServerConfig(url=f"ipc://{d}/s.sock", l1_size_bytes=16 << 20, slot_bytes=1 << 20),
                    transfer_executor=executor)
    loop = threading.Thread(target=server.serve_forever, name="server-loop")
    loop.start()
    victim = MPCacheClient(server.bound_url, request_timeout=5.0)
    attacker = MPCacheClient(server.bound_url, request_timeout=5.0)  # another connection: another peer
    try:
        yield server, executor, victim, attacker
    finally:
        victim.close()
        attacker.close()
        server.stop()
        loop.join(10)
        assert not loop.is_alive()


def test_a_foreign_register_or_unregister_never_reaches_the_executor(
        served: tuple[Server, RecordingExecutor, MPCacheClient, MPCacheClient]) -> None:
    server, executor, victim, attacker = served
    assert isinstance(victim.register_instance(7, _layout("victim")).result(5), int)
    with pytest.raises(RemoteError) as e:
        attacker.register_instance(7, _layout("attacker")).result(5)
    assert e.value.kind == "forbidden"
    with pytest.raises(RemoteError) as e:
        attacker.unregister_instance(7).result(5)
    assert e.value.kind == "forbidden"
    assert [(op, iid) for op, iid, _ in executor.calls] == [("register", 7)]
    assert executor.calls[0][2]["tensors"] == ["victim"]
    # the victim's next store is copied through its own registration
    _handle, ok = victim.store(key(tokens(2), "s", worker_id=0), 7, list(range(32)), b"E" * 64).result(5)
    assert ok is True and [lay["tensors"] for lay in executor.copied_with] == [["victim"]]
    assert server.machine.instances.object_bytes_by_instance() == {7: 4096}
    # the owner's unregister is carried out
    assert victim.unregister_instance(7).result(5) is None
    assert [(op, iid) for op, iid, _ in executor.calls] == [("register", 7), ("unregister", 7)]


def test_a_registration_core_sm_refuses_never_reaches_the_executor(
        served: tuple[Server, RecordingExecutor, MPCacheClient, MPCacheClient]) -> None:
    _server, executor, victim, _attacker = served
    bad = dict(_layout("victim"), world_size=0)
    with pytest.raises(RemoteError) as e:
        victim.register_instance(3, bad).result(5)
    assert e.value.kind == "undecodable"  # the wire's bound, before core_sm
    too_large = dict(_layout("victim"), object_bytes=8 << 20)
    with pytest.raises(RemoteError) as e:
        victim.register_instance(3, too_large).result(5)
    assert e.value.kind == "too_large"
    assert executor.calls == []


def test_a_layout_the_executor_refuses_leaves_no_registration() -> None:
    executor = RecordingExecutor(refuse="cannot open the IPC handles")
    d = tempfile.mkdtemp(prefix="mpcache-decide-")
    server = Server(ServerConfig(url=f"ipc://{d}/s.sock", l1_size_bytes=16 << 20, slot_bytes=1 << 20),
                    transfer_executor=executor)
    loop = threading.Thread(target=server.serve_forever, name="server-loop")
    loop.start()
    c = MPCacheClient(server.bound_url, request_timeout=5.0)
    try:
        with pytest.raises(RemoteError) as e:
            c.register_instance(5, _layout("t")).result(5)
        assert e.value.kind == "validation" and "IPC handles" in e.value.message
        assert server.machine.instances.registration(5) is None
        # what it may have kept is released: a refused attach is followed by a detach
        assert [(op, iid) for op, iid, _ in executor.calls] == [("register", 5), ("unregister", 5)]
        with pytest.raises(RemoteError) as e:
            c.store(key(tokens(1), "s", worker_id=0), 5, list(range(16)), b"E" * 64).result(5)
        assert e.value.kind == "not_registered"
    finally:
        c.close()
        server.stop()
        loop.join(10)
