"""The server loop hosted in this process, to inject faults the wire cannot provoke: a raising
core_sm machine, a raising transfer executor, an executor that finishes transfers from its own
thread. Each still gets exactly one reply, and the loop keeps serving."""

from __future__ import annotations

import os
import select
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from mpcache.core_sm.effects import StartTransfer
from mpcache.runtime_zmq.client import MPCacheClient, RemoteError
from mpcache.runtime_zmq.server import CompletionChannel, Server, ServerConfig
from test_server_ops import key, tokens


class RaisingExecutor:
    def register_instance(self, instance_id: int, layout: Any, pool: Any) -> str | None:
        raise RuntimeError("driver exploded")

    def unregister_instance(self, instance_id: int) -> None:
        pass

    def start(self, transfer: StartTransfer, event_handle: bytes, done: Any) -> None:
        raise RuntimeError("never")

    def close(self) -> None:
        pass


class ThreadedExecutor:
    """Accepts any server-driven instance; finishes each transfer ok from another thread."""

    def __init__(self) -> None:
        self.started: list[StartTransfer] = []
        self.handles: list[bytes] = []

    def register_instance(self, instance_id: int, layout: Any, pool: Any) -> str | None:
        return None

    def unregister_instance(self, instance_id: int) -> None:
        pass

    def start(self, transfer: StartTransfer, event_handle: bytes, done: Any) -> None:
        self.started.append(transfer)
        self.handles.append(event_handle)
        threading.Timer(0.05, done, args=(transfer.transfer_id, True)).start()

    def close(self) -> None:
        pass


def _serve(executor: Any) -> Iterator[tuple[Server, MPCacheClient]]:
    d = tempfile.mkdtemp(prefix="mpcache-inproc-")
    server = Server(ServerConfig(url=f"ipc://{d}/s.sock", l1_size_bytes=64 << 20, slot_bytes=1 << 20), transfer_executor=executor)
    loop = threading.Thread(target=server.serve_forever, name="server-loop")
    loop.start()
    c = MPCacheClient(server.bound_url, request_timeout=5.0)
    try:
        yield server, c
    finally:
        c.close()
        server.stop()
        loop.join(10)
        assert not loop.is_alive()


@pytest.fixture
def raising() -> Iterator[tuple[Server, MPCacheClient]]:
    yield from _serve(RaisingExecutor())


@pytest.fixture
def threaded() -> Iterator[tuple[Server, MPCacheClient]]:
    yield from _serve(ThreadedExecutor())


LAYOUT = {"model_name": "m", "world_size": 1, "object_bytes": 4096, "engine_driven": False}


def test_raising_executor_is_answered_internal(raising: tuple[Server, MPCacheClient]) -> None:
    server, c = raising
    with pytest.raises(RemoteError) as e:
        c.register_instance(1, LAYOUT).result(5)
    assert e.value.kind == "internal" and "driver exploded" in e.value.message
    assert c.noop() == "OK"


def test_raising_machine_is_answered_internal(raising: tuple[Server, MPCacheClient], monkeypatch: pytest.MonkeyPatch) -> None:
    server, c = raising

    def boom(event: Any, now: float) -> Any:
        raise ZeroDivisionError("core_sm bug")

    monkeypatch.setattr(server.machine, "handle", boom)
    with pytest.raises(RemoteError) as e:
        c.query_prefetch_status("x").result(5)
    assert e.value.kind == "internal"
    monkeypatch.undo()
    assert c.query_prefetch_status("x").result(5) == 0
    assert c.stats()["outstanding_requests"] == 0


def test_server_driven_store_and_retrieve_through_an_executor(threaded: tuple[Server, MPCacheClient]) -> None:
    server, c = threaded
    executor = server.executor
    assert isinstance(executor, ThreadedExecutor)
    assert isinstance(c.register_instance(4, LAYOUT).result(5), int)
    toks = tokens(2)
    # LMCache's reply shape: (event_handle, ok), after the executor reported completion
    handle, ok = c.store(key(toks, "s", worker_id=0), 4, list(range(32)), b"E" * 64).result(5)
    assert ok is True and isinstance(handle, bytes)
    assert executor.handles == [b"E" * 64]
    assert [p[0] for p in executor.started[0].placements] == [0, 1]
    c.lookup(key(toks, "r")).result(5)
    assert c.query_prefetch_status("r").result(5) == 2
    handle, ok = c.retrieve(key(toks, "r", worker_id=0), 4, list(range(32)), b"F" * 64, 0).result(5)
    assert ok is True
    assert executor.started[-1].kind.value == "retrieve"
    s = c.stats()
    assert s["transfers"] == 0 and s["transfers_in_flight"] == 0 and s["leases_held"] == 0


def test_wake_and_stop_after_shutdown_do_nothing() -> None:
    # A signal handler or a late worker thread may call these while (or after) the server exits.
    channel = CompletionChannel()
    channel.close()
    channel.wake()
    channel.post(object())
    channel.close()
    d = tempfile.mkdtemp(prefix="mpcache-inproc-")
    server = Server(ServerConfig(url=f"ipc://{d}/s.sock", l1_size_bytes=8 << 20, slot_bytes=1 << 20))
    loop = threading.Thread(target=server.serve_forever, name="server-loop")
    loop.start()
    server.stop()
    server.stop()
    loop.join(10)
    assert not loop.is_alive()
    server.stop()
    server.channel.wake()


def test_a_server_never_served_is_closed_once_and_gives_l1_back() -> None:
    # benches and tests drive a server message by message, without its loop, then close it
    d = tempfile.mkdtemp(prefix="mpcache-inproc-")
    server = Server(ServerConfig(url=f"ipc://{d}/s.sock", l1_size_bytes=8 << 20, slot_bytes=1 << 20))
    segment = server.pool.path
    assert server.pool.address and os.path.exists(segment) and not server.stopping  # L1 made on first use
    server.close()
    assert not os.path.exists(segment) and not server.pool.created and server.stopping
    assert server.loaders_running == []  # none started: the loop never ran
    server.close()  # nothing left to release: no error
    server.stop()


def test_store_after_its_not_after_is_refused_and_stores_nothing(threaded: tuple[Server, MPCacheClient]) -> None:
    server, c = threaded
    executor = server.executor
    assert isinstance(executor, ThreadedExecutor)
    assert isinstance(c.register_instance(4, LAYOUT).result(5), int)
    toks = tokens(2)
    # the server's clock is this host's monotonic clock: a deadline one second ago has passed
    late = time.monotonic() - 1.0
    with pytest.raises(RemoteError) as e:
        c.submit("store", key(toks, "s", worker_id=0), 4, list(range(32)), b"E" * 64, late).result(5)
    assert e.value.kind == "timeout"
    assert executor.started == []  # no copy
    s = c.stats()
    assert s["late_transfers_refused"] == 1 and s["transfers"] == 0 and s["objects"] == 0
    c.lookup(key(toks, "r")).result(5)
    assert c.query_prefetch_status("r").result(5) == 0
    # the same STORE with a deadline ahead is served, and one without any (LMCache's form) too
    ahead = time.monotonic() + 30.0
    _handle, ok = c.submit("store", key(toks, "s", worker_id=0), 4, list(range(32)), b"E" * 64, ahead).result(5)
    assert ok is True and len(executor.started) == 1
    _handle, ok = c.store(key(tokens(1, seed=3), "t", worker_id=0), 4, list(range(16)), b"E" * 64).result(5)
    assert ok is True


class MisreportingExecutor(ThreadedExecutor):
    """Reports every transfer twice, under a wrong id, from another thread."""

    def start(self, transfer: StartTransfer, event_handle: bytes, done: Any) -> None:
        self.started.append(transfer)

        def twice() -> None:
            done(transfer.transfer_id + 1000, True)
            done(transfer.transfer_id, False)

        threading.Timer(0.05, twice).start()


def test_each_transfer_is_reported_to_core_sm_exactly_once() -> None:
    for served in _serve(MisreportingExecutor()):
        server, c = served
        assert isinstance(c.register_instance(4, LAYOUT).result(5), int)
        _handle, ok = c.store(key(tokens(2), "s", worker_id=0), 4, list(range(32)), b"E" * 64).result(5)
        assert ok is True  # the first report counts
        time.sleep(0.2)
        s = c.stats()
        assert s["stale_events"] == 0 and s["transfers_in_flight"] == 0 and s["pinned_effects"] == 0


def test_raising_executor_start_still_finishes_the_transfer(raising: tuple[Server, MPCacheClient], monkeypatch: pytest.MonkeyPatch) -> None:
    server, c = raising
    monkeypatch.setattr(server.executor, "register_instance", lambda *a: None)
    assert isinstance(c.register_instance(4, LAYOUT).result(5), int)
    _handle, ok = c.store(key(tokens(2), "s", worker_id=0), 4, list(range(32)), b"E" * 64).result(5)
    assert ok is False
    s = c.stats()
    assert s["transfers"] == 0 and s["transfers_in_flight"] == 0 and s["pinned_effects"] == 0
    assert s["quarantined_slots"] == 0 and s["free_slots"] == s["l1_num_slots"]


def test_replies_held_in_a_receive_batch_all_go_out_in_order(threaded: tuple[Server, MPCacheClient]) -> None:
    """Replies wait for the end of their receive batch (one wake-up of zmq's I/O thread per
    batch): 200 pipelined requests, more than one batch's hold of replies, each answered once, in
    order, and a request alone after them is answered at once."""
    import msgpack  # type: ignore[import-untyped]
    import zmq

    server, _c = threaded
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.bound_url)
    try:
        ops = ["noop", "query_prefetch_status"] * 100
        for uid, op in enumerate(ops):
            frames = [msgpack.packb(uid), msgpack.packb(op)] + ([msgpack.packb(f"r{uid}")] if op != "noop" else [])
            sock.send_multipart(frames)
        got = []
        for _ in ops:
            assert sock.poll(5000), f"{len(got)} of {len(ops)} replies"
            reply = sock.recv_multipart()
            got.append((msgpack.unpackb(reply[0]), msgpack.unpackb(reply[1])))
        assert got == list(enumerate(ops))
        assert not sock.poll(100)  # nothing twice
        t0 = time.monotonic()
        sock.send_multipart([msgpack.packb(999), msgpack.packb("noop")])
        assert sock.poll(2000) and msgpack.unpackb(sock.recv_multipart()[0]) == 999
        assert time.monotonic() - t0 < 1.0
    finally:
        sock.close()


def test_lookup_ack_leaves_before_its_work(threaded: tuple[Server, MPCacheClient], monkeypatch: pytest.MonkeyPatch) -> None:
    """core_sm acknowledges a lookup before its work (ack_first); the loop sends the ack first,
    then runs the work: a slow lease walk injected here does not delay the ack."""
    server, c = threaded
    assert isinstance(c.register_instance(4, LAYOUT).result(5), int)
    toks = tokens(2)
    _handle, ok = c.store(key(toks, "s", worker_id=0), 4, list(range(32)), b"E" * 64).result(5)
    assert ok is True
    machine = server.machine
    real = machine._lease_prefix_for_lookup
    work_done = threading.Event()

    def slow_leases(*args: Any) -> int:
        time.sleep(0.5)
        try:
            return real(*args)  # type: ignore[no-any-return]
        finally:
            work_done.set()

    monkeypatch.setattr(machine, "_lease_prefix_for_lookup", slow_leases)
    lookup = c.lookup(key(toks, "r"))
    assert lookup.result(5) is None
    assert not work_done.is_set(), "the ack waited for the lookup's work"
    # the status the client sends after the ack sees the work's result
    assert c.query_prefetch_status("r").result(5) == 2
    assert work_done.is_set()
    assert c.stats()["leases_held"] == 2


def test_one_request_in_flight_ends_its_batch_without_a_failing_receive(threaded: tuple[Server, MPCacheClient],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """After each message the loop asks zmq whether another is waiting; with one request in flight
    nothing is, and the batch ends (its reply goes out) without a receive failing with zmq.Again."""
    import zmq

    server, c = threaded
    assert c.noop() == "OK"  # the connection is up
    real = server._receive
    received, failed = [0], [0]

    def counted(sock: Any) -> Any:
        try:
            out = real(sock)
        except zmq.Again:
            failed[0] += 1
            raise
        received[0] += 1
        return out

    monkeypatch.setattr(server, "_receive", counted)
    for _ in range(20):
        assert c.noop() == "OK"
    assert received[0] >= 20
    assert failed[0] == 0


def test_the_loop_collects_what_lanes_saw_without_losing_a_wake_up() -> None:
    """An executor whose copy lanes see copies end (no Python thread) wakes the loop through the
    channel's pipe and is collected from in each drain: after the wake-ups are read (a lane's
    byte written during the collect wakes the loop again) and before the queue is (what the
    collect posts is in this drain)."""
    from mpcache.runtime_zmq.transfer import NoDeviceExecutor

    class LaneExecutor(NoDeviceExecutor):
        def __init__(self) -> None:
            self.wake_fd = -1
            self.collects = 0

        def wake_loop_with(self, fd: int) -> None:
            self.wake_fd = fd

        def collect_completions(self) -> None:
            self.collects += 1
            server.channel.post("collected")
            os.write(self.wake_fd, b"x")  # a lane seeing one more end meanwhile

    d = tempfile.mkdtemp(prefix="mpcache-inproc-")
    executor = LaneExecutor()
    server = Server(ServerConfig(url=f"ipc://{d}/s.sock", l1_size_bytes=8 << 20, slot_bytes=1 << 20),
                    transfer_executor=executor)
    try:
        assert executor.wake_fd == server.channel.wake_fd
        seen: list[object] = []
        assert server.channel.drain(executor.collect_completions) == ["collected"]
        assert select.select([server.channel.fd], [], [], 0)[0]  # the lane's byte is still there
        assert os.read(server.channel.fd, 64) == b"x"  # (and only it: the collect's post woke nobody)
        os.write(executor.wake_fd, b"x")
        server.metrics.on_completion = lambda ev, now: seen.append(ev) or True  # type: ignore[method-assign]
        server.drain_completions()
        assert executor.collects == 2 and seen == ["collected"]
        replaced = LaneExecutor()
        server.executor = replaced  # a replacement is wired the same way
        assert replaced.wake_fd == server.channel.wake_fd
    finally:
        server.close()
