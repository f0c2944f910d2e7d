"""Every L2 effect the server hands to its worker threads is reported back to core_sm, even
after core_sm gave up on it: core_sm keeps the effect's slots pinned (quarantined if their
object was dropped) until the completion arrives, so a lost completion would take slots out of
L1 for good."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable
from typing import Any

from live_server import ServerProcess, wait_for
from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.effects import ProbeL2, ReadL2, WriteL2
from mpcache.core_sm.messages import L2ProbeFinished, L2ReadFinished, L2WriteFinished
from mpcache.runtime_zmq.client import MPCacheClient
from mpcache.runtime_zmq.l1_pool import SharedMemoryPool
from mpcache.runtime_zmq.transfer import L2Worker
from test_server_ops import key, tokens


class BlockingTier:
    """Every operation blocks until ``close``; ``contains`` raises once released."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def read(self, k: bytes) -> bytes | None:
        self.released.wait(30)
        return None

    def write(self, k: bytes, data: bytes) -> None:
        self.released.wait(30)

    def contains(self, k: bytes) -> bool:
        self.released.wait(30)
        raise OSError("tier gone")

    def close(self) -> None:
        self.released.set()


def test_l2_worker_reports_every_effect_even_the_ones_close_cancels() -> None:
    pool = SharedMemoryPool(4 << 20, 1 << 20, directory=tempfile.mkdtemp(prefix="mpcache-l2c-"))
    posted: list[Any] = []
    lock = threading.Lock()

    def post(ev: Any) -> None:
        with lock:
            posted.append(ev)

    worker = L2Worker([BlockingTier()], pool, post, workers=1)
    k = ObjectKey(b"\x01" * 16, 0)
    try:
        worker.read(ReadL2(1, ((k, 0),)))  # runs, blocked in the tier
        worker.read(ReadL2(2, ((k, 1),)))  # queued: cancelled by close
        worker.probe(ProbeL2(3, (k,)))
        worker.write(WriteL2(4, ((k, 2),)))
        assert worker.in_flight == 4
        worker.close()
        assert worker.in_flight == 0
        worker.read(ReadL2(5, ((k, 3),)))  # after close: reported failed at once
    finally:
        pool.close()
    by_id = {getattr(ev, "read_id", getattr(ev, "probe_id", getattr(ev, "write_id", None))): ev for ev in posted}
    assert len(posted) == 5 and sorted(by_id) == [1, 2, 3, 4, 5]
    assert by_id[1] == L2ReadFinished(1, (False,)) and by_id[2] == L2ReadFinished(2, (False,))
    assert by_id[3] == L2ProbeFinished(3, (False,))
    assert by_id[4] == L2WriteFinished(4, False) and by_id[5] == L2ReadFinished(5, (False,))


def test_expired_l2_read_frees_its_slots_when_the_tier_answers(start_server: Callable[..., ServerProcess]) -> None:
    # core_sm gives up on the read at the lease TTL (0.5 s); the tier answers (a miss) after 2 s
    sp = start_server("--l2", "python:slow_tier:make?delay=2", "--no-l2-probe", "--lease-ttl", "0.5",
                      "--l2-read-timeout", "0.3", "--job-ttl", "0.5")
    c = MPCacheClient(sp.url, request_timeout=5.0)
    try:
        c.lookup(key(tokens(1), "slow")).result(5)
        assert c.wait_prefetch_status("slow", 5.0).result(6) == 0  # the L2 timeout resolved it
        assert wait_for(lambda: c.stats()["l2_reads_expired"] == 1, timeout=5.0)
        s = c.stats()
        assert s["quarantined_slots"] == 1 and s["l2_in_flight"] == 1  # the tier still holds it
        assert wait_for(lambda: c.stats()["l2_in_flight"] == 0, timeout=5.0)
        s = c.stats()
        assert s["quarantined_slots"] == 0 and s["pinned_effects"] == 0
        assert s["free_slots"] == s["l1_num_slots"]
    finally:
        c.close()


def test_shutdown_hands_core_sm_the_completion_of_every_l2_effect() -> None:
    from mpcache.runtime_zmq.server import Server, ServerConfig

    tier = BlockingTier()
    d = tempfile.mkdtemp(prefix="mpcache-l2c-")
    server = Server(ServerConfig(url=f"ipc://{d}/s.sock", l1_size_bytes=8 << 20, slot_bytes=1 << 20, l2_probe=False,
                                 l2_workers=1, shutdown_grace=0.2), tiers=[tier])
    loop = threading.Thread(target=server.serve_forever, name="server-loop")
    loop.start()
    c = MPCacheClient(server.bound_url, request_timeout=5.0)
    try:
        c.lookup(key(tokens(1), "a")).result(5)  # its read blocks the only worker
        c.lookup(key(tokens(1, seed=1), "b")).result(5)  # its read waits in the queue
        assert wait_for(lambda: c.stats()["l2_in_flight"] == 2, timeout=5.0)
        waiter = c.wait_prefetch_status("b", 30.0)
        # stop only once the server holds the wait (a request never read is never answered)
        assert wait_for(lambda: c.stats()["waiters"] == 1, timeout=5.0)
        server.stop()
        loop.join(10)
        assert not loop.is_alive()
        assert waiter.exception(5) is not None and waiter.exception().kind == "shutting_down"  # type: ignore[union-attr]
    finally:
        c.close()
    s = server.machine.stats()
    assert s["l2_reads_in_flight"] == 0 and s["pinned_effects"] == 0 and s["quarantined_slots"] == 0
    assert s["free_slots"] == server.pool.num_slots
