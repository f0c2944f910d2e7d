"""When the transfer executor fails an instance by itself (a GPU engine whose event never fires),
core_sm is told (``InstanceFailed``): the instance's registration and plans go, it is counted,
and other instances are untouched. CPU-side: an executor that holds its copies and fails the
instance the way runtime_zmq/gpu_transfer.py does."""
from __future__ import annotations

import tempfile
import threading
import time
from typing import Any

from mpcache.core_sm.effects import StartTransfer
from mpcache.runtime_zmq.client import MPCacheClient
from mpcache.runtime_zmq.server import Server, ServerConfig
from test_server_ops import key, tokens

LAYOUT = {"model_name": "m", "world_size": 1, "object_bytes": 4096, "engine_driven": False}


class StuckExecutor:
    """Accepts server-driven instances; instance 7's copies never finish until it is failed
    (once: after that its copies finish, as a re-registered engine's would)."""

    def __init__(self) -> None:
        self.on_instance_failed: Any = None
        self.held: list[tuple[int, Any]] = []
        self.unregistered: list[int] = []
        self.stuck = True

    def register_instance(self, instance_id: int, layout: Any, pool: Any) -> str | None:
        return None

    def unregister_instance(self, instance_id: int) -> None:
        self.unregistered.append(instance_id)

    def start(self, transfer: StartTransfer, event_handle: bytes, done: Any) -> None:
        if transfer.instance_id == 7 and self.stuck:
            self.held.append((transfer.transfer_id, done))
        else:
            threading.Timer(0.02, done, args=(transfer.transfer_id, True)).start()

    def fail(self, instance_id: int) -> None:
        # what GpuTransferExecutor._fail does, from its waiter thread: tell, then report copies
        assert self.on_instance_failed is not None, "the server must hook itself in"
        self.stuck = False
        self.on_instance_failed(instance_id, "a GPU transfer did not finish 30 s after it came first in line")
        for tid, done in self.held:
            done(tid, False)
        self.held.clear()

    def close(self) -> None:
        pass


def serve_in_thread(executor: StuckExecutor) -> tuple[Server, threading.Thread]:
    """An in-process server with ``executor`` as its transfer engine, its loop on a thread."""
    d = tempfile.mkdtemp(prefix="mpcache-ifail-")
    server = Server(ServerConfig(url=f"ipc://{d}/s.sock", l1_size_bytes=16 << 20, slot_bytes=1 << 20,
                                 l1_reserve=False), transfer_executor=executor)
    loop = threading.Thread(target=server.serve_forever, name="server-loop")
    loop.start()
    return server, loop


def test_an_instance_the_executor_fails_is_released_in_core_sm_and_others_go_on() -> None:
    executor = StuckExecutor()
    server, loop = serve_in_thread(executor)
    c = MPCacheClient(server.bound_url, request_timeout=5.0)
    try:
        assert isinstance(c.register_instance(7, LAYOUT).result(5), int)
        assert isinstance(c.register_instance(8, LAYOUT).result(5), int)
        stuck = c.store(key(tokens(2), "s7", worker_id=0), 7, list(range(32)), b"E" * 64)
        deadline = time.monotonic() + 5
        while not executor.held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert executor.held and not stuck.done()
        threading.Thread(target=executor.fail, args=(7,)).start()
        _handle, ok = stuck.result(5)
        assert ok is False
        s = c.stats()
        assert s["instances_failed"] == 1 and s["instances"] == 1 and s["pinned_slots"] == 0
        # instance 8 is untouched: its store lands and is a hit
        _handle, ok = c.store(key(tokens(2, seed=5), "s8", worker_id=0), 8, list(range(32)), b"F" * 64).result(5)
        assert ok is True
        c.lookup(key(tokens(2, seed=5), "r8")).result(5)
        assert c.query_prefetch_status("r8").result(5) == 2
        # instance 7's next request is refused not_registered; the client registers it again
        # by itself and the request then succeeds
        _handle, ok = c.store(key(tokens(1, seed=3), "s7b", worker_id=0), 7, list(range(16)), b"E" * 64).result(10)
        assert ok is True and c.stats()["instances"] == 2
    finally:
        c.close()
        server.stop()
        loop.join(10)
        assert not loop.is_alive()
