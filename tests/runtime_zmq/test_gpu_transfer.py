"""GPU regression test of the server-driven data path (run on a GPU host:
``make test-gpu``).

A worker process exports its KV cache and an interprocess event; the GpuTransferExecutor opens
them and runs STORE / RETRIEVE transfers while other Python threads hammer the GIL, drive CUDA
through torch (launches, syncs, event creation and destruction: the calls that deadlocked with a
Python host callback in LMCache #2733) and read telemetry. Every transfer must report exactly
once, in time (a timeout is a failure), and move the right bytes — including the data the worker
wrote behind a gate the test opens, which the server only sees if its stream waited on the worker's event.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GEO = {"num_layers": 4, "num_blocks": 96, "block_size": 16, "num_heads": 2, "head_size": 64}
CHUNK = 64  # 4 blocks per chunk
BPC = CHUNK // GEO["block_size"]


def _transfer(tid: int, kind: object, start_chunk: int, n_chunks: int, slots: list[int], blocks: list[int], skip: int = 0):  # type: ignore[no-untyped-def]
    from mpcache.core_sm.effects import StartTransfer

    placements = tuple((start_chunk + i, s) for i, s in enumerate(slots))
    return StartTransfer(tid, kind, 1, f"req-{tid}", None, start_chunk * CHUNK, (start_chunk + n_chunks) * CHUNK,
                         placements, tuple(blocks), skip)


# method="thread": a hang inside a CUDA call cannot be interrupted by a signal; the thread method
# prints every thread's stack before it ends the run, so a hang says where it is.
@pytest.mark.timeout(180, method="thread")
@pytest.mark.parametrize("mode,completions", [("zerocopy", "waiter"), ("staging", "waiter"), ("zerocopy", "lane"),
                                              ("staging", "lane")])
def test_transfers_finish_under_gil_and_cuda_pressure(mode: str, completions: str) -> None:
    """``completions``: who sees the copies end -- each instance's waiter thread, or its copy lane
    (``--gpu-completions lane``), with a loop thread collecting them as the server's does."""
    import msgpack
    import os
    import select

    from mpcache.core_sm.messages import TransferKind
    from mpcache.runtime_zmq.gpu_transfer import GpuTransferExecutor
    from mpcache.runtime_zmq.l1_pool import SharedMemoryPool
    from tests.runtime_zmq.gpu_worker import FRESH, POISON, run_worker

    rng = np.random.default_rng(11)
    perm = [int(b) for b in rng.permutation(GEO["num_blocks"])]
    src = perm[: 3 * BPC]  # 3 chunks stored from here (random order)
    dst = perm[3 * BPC : 6 * BPC]  # and retrieved into here
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=run_worker, args=(child, GEO, src, dst, True))
    proc.start()
    stop = threading.Event()
    threads: list[threading.Thread] = []
    ex = None
    pool = None
    gate_open = False
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    try:
        assert parent.poll(120), "worker did not start"
        layout = msgpack.unpackb(parent.recv_bytes())
        slot_bytes = 2 * GEO["num_layers"] * CHUNK * GEO["num_heads"] * GEO["head_size"] * 2
        pool = SharedMemoryPool(16 * slot_bytes, slot_bytes)
        ex = GpuTransferExecutor(CHUNK, mode=mode, max_ctas=8, lane_completions=completions == "lane")
        ex.wake_loop_with(wake_w)
        reason = ex.register_instance(1, layout, pool)
        assert reason is None, reason
        parent.send_bytes(b"registered")
        assert parent.poll(60), "worker sent no event"
        event_handle = parent.recv_bytes()

        def gil_hammer() -> None:
            while not stop.is_set():
                sum(i * i for i in range(5000))

        def cuda_hammer() -> None:
            a = torch.ones(1 << 20, device="cuda")
            while not stop.is_set():
                a.mul_(1.0001)
                e = torch.cuda.Event()
                e.record()
                e.synchronize()
                del e
                torch.cuda.current_stream().synchronize()

        stats_seen: list[dict[str, int]] = []

        def telemetry() -> None:
            while not stop.is_set():
                stats_seen.append(ex.stats())
                time.sleep(0.002)

        def loop() -> None:  # the server loop's part with lane completions: woken, it collects
            while not stop.is_set():
                if select.select([wake_r], [], [], 0.05)[0]:
                    try:
                        os.read(wake_r, 4096)
                    except BlockingIOError:
                        pass
                ex.collect_completions()

        for fn in (gil_hammer, gil_hammer, cuda_hammer, telemetry, loop):
            th = threading.Thread(target=fn, daemon=True)
            th.start()
            threads.append(th)

        finished: queue.Queue[tuple[int, bool]] = queue.Queue()

        def done(tid: int, ok: bool) -> None:
            finished.put((tid, ok))

        # 1: store 3 chunks; must wait for the worker's gated event and see FRESH data
        ex.start(_transfer(1, TransferKind.STORE, 2, 3, [7, 3, 11], src), event_handle, done)
        from mpcache.runtime_zmq import gpu_ipc

        pending = [int(gpu_ipc.driver().cuEventQuery(ev)[0]) for ev in ex._instances[1].worker_events.values()]
        assert pending == [600], f"the worker's event is not pending ({pending}): this test would prove nothing"
        # 2: retrieve them into other blocks, the first block skipped (engine holds 1 block + 3 tokens)
        ex.start(_transfer(2, TransferKind.RETRIEVE, 2, 3, [7, 3, 11], dst, skip=GEO["block_size"] + 3), event_handle, done)
        # 3..: many more round trips under pressure
        n_more = 60
        for k in range(n_more):
            kind = TransferKind.STORE if k % 2 == 0 else TransferKind.RETRIEVE
            blocks = src if kind is TransferKind.STORE else dst
            ex.start(_transfer(3 + k, kind, 2, 3, [7, 3, 11], blocks, skip=GEO["block_size"] + 3), event_handle, done)
        # The worker's event is held by its gate: nothing may finish before it opens, however
        # long we look (a server that did not wait on the event would report at once).
        time.sleep(0.5)
        assert finished.empty(), "a transfer finished while the worker's event was pending"
        pending = [int(gpu_ipc.driver().cuEventQuery(ev)[0]) for ev in ex._instances[1].worker_events.values()]
        assert pending == [600], f"the gate did not hold the worker's event ({pending})"
        released = time.perf_counter()
        parent.send_bytes(b"release")
        gate_open = True
        results: dict[int, bool] = {}
        deadline = time.monotonic() + 60
        while len(results) < 2 + n_more:
            try:
                tid, ok = finished.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"transfers did not finish in time: {sorted(results)} of {2 + n_more}")
            assert tid not in results, f"transfer {tid} reported twice"
            results[tid] = ok
        elapsed = time.perf_counter() - released
        assert all(results.values()), results
        assert elapsed < 60
        time.sleep(0.05)
        assert finished.empty()
        assert stats_seen and ex.stats()["finished"] == 2 + n_more and ex.stats()["in_flight"] == 0
        if completions == "lane":  # the lane saw them all end, the waiter never looked
            assert ex.stats()["polls"] == 0 and ex._instances[1].lane.seen_through() == 2 + n_more

        # bytes: slots hold FRESH K/V for every layer; dst blocks got them, except the skipped one
        for s in (7, 3, 11):
            data = np.frombuffer(pool.read(s, slot_bytes), dtype=np.int16)
            assert (data == FRESH).all(), f"slot {s} does not hold the worker's final data"
        from numba import cuda

        inst = ex._instances[1]
        assert inst.transfer.launch_path == "raw", inst.transfer.launch_error
        assert inst.transfer.enqueue_path == "compiled", inst.transfer.enqueue_error
        base = int(inst.transfer._paged.__cuda_array_interface__["data"][0])
        n_elems = inst.geometry.layer_elements()
        for off in inst.transfer._layer_offsets:
            # one layer at a time: the span between the worker's allocations is not mapped here
            view = cuda.from_cuda_array_interface(
                {"shape": (n_elems,), "typestr": "<i2", "data": (base + off * 8, False), "version": 3, "strides": None},
                owner=None, sync=False)
            layer = view.copy_to_host().reshape(2, GEO["num_blocks"], -1)
            assert (layer[:, dst[0]] == POISON).all(), "a skipped block was written"
            assert (layer[:, dst[1:]] == FRESH).all()
            assert (layer[:, src] == FRESH).all()
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=10)
        if not gate_open:  # a failed check above: the copies queued behind the event must land before close
            parent.send_bytes(b"release")
        if ex is not None:
            ex.close()
        if pool is not None:
            pool.close()
        os.close(wake_r)
        os.close(wake_w)
        parent.send_bytes(b"bye")
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert not any(th.is_alive() for th in threads)


@pytest.mark.timeout(240, method="thread")
def test_bad_ranges_refused_and_a_stuck_engine_fails_alone() -> None:
    """Registration checks each tensor against its real allocation; an engine whose event never
    fires (its GPU work outlives the transfer timeout) is failed and unregistered while another
    engine's transfers finish on time, and the neutralized stores leave their L1 slots alone."""
    import msgpack

    from mpcache.core_sm.messages import TransferKind
    from mpcache.runtime_zmq.gpu_transfer import GpuTransferExecutor
    from mpcache.runtime_zmq.l1_pool import SharedMemoryPool
    from tests.runtime_zmq.gpu_worker import run_worker

    rng = np.random.default_rng(12)
    perm = [int(b) for b in rng.permutation(GEO["num_blocks"])]
    src, dst = perm[: 3 * BPC], perm[3 * BPC : 6 * BPC]
    ctx = mp.get_context("spawn")
    # A: its event is held by a gate until the test releases it; B: recorded at once
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=run_worker, args=(child, GEO, src, dst, gated))
             for (_, child), gated in zip(pipes, (True, False))]
    for p in procs:
        p.start()
    ex = None
    pool = None
    try:
        layouts = []
        for parent, _ in pipes:
            assert parent.poll(120), "worker did not start"
            layouts.append(msgpack.unpackb(parent.recv_bytes()))
        slot_bytes = 2 * GEO["num_layers"] * CHUNK * GEO["num_heads"] * GEO["head_size"] * 2
        pool = SharedMemoryPool(16 * slot_bytes, slot_bytes)
        ex = GpuTransferExecutor(CHUNK, mode="zerocopy", max_ctas=8, transfer_timeout_s=1.0)
        ex.warm_up(pool)

        bad = dict(layouts[0], tensors=[dict(t) for t in layouts[0]["tensors"]])
        bad["tensors"][0]["offset"] = 1 << 40
        assert "outside" in (ex.register_instance(9, bad, pool) or "")
        bad = dict(layouts[0], tensors=[dict(t) for t in layouts[0]["tensors"]])
        bad["tensors"][1] = dict(bad["tensors"][0])
        assert "overlap" in (ex.register_instance(9, bad, pool) or "")
        assert ex.stats()["instances"] == 0

        for iid, layout in ((1, layouts[0]), (2, layouts[1])):
            reason = ex.register_instance(iid, layout, pool)
            assert reason is None, reason
        handles = []
        for parent, _ in pipes:
            parent.send_bytes(b"registered")
            assert parent.poll(60), "worker sent no event"
            handles.append(parent.recv_bytes())
        for s in range(16):
            pool.write(s, bytes([0x5C]) * slot_bytes)

        finished: queue.Queue[tuple[int, bool, float]] = queue.Queue()

        def done(tid: int, ok: bool) -> None:
            finished.put((tid, ok, time.monotonic()))

        t0 = time.monotonic()

        def st(tid: int, iid: int, slots: list[int]):  # type: ignore[no-untyped-def]
            from mpcache.core_sm.effects import StartTransfer

            placements = tuple((i, s) for i, s in enumerate(slots))
            return StartTransfer(tid, TransferKind.STORE, iid, f"r{tid}", None, 0, len(slots) * CHUNK, placements,
                                 tuple(src[: len(slots) * BPC]), 0)

        ex.start(st(1, 1, [1]), handles[0], done)  # A, first in line: waits on A's gated event
        ex.start(st(2, 1, [2]), handles[0], done)  # A, behind it: neutralized
        ex.start(st(3, 1, [3, 4]), handles[0], done)  # A: neutralized
        from mpcache.runtime_zmq import gpu_ipc

        a_event_pending = [int(gpu_ipc.driver().cuEventQuery(ev)[0]) for ev in ex._instances[1].worker_events.values()]
        assert a_event_pending == [600], f"A's event is not pending ({a_event_pending}): the gate did not hold"
        for k in range(10):
            ex.start(st(10 + k, 2, [8 + k % 4]), handles[1], done)  # B: runs while A hangs
        results: dict[int, tuple[bool, float]] = {}
        while len(results) < 12:  # all but the first in line
            tid, ok, at = finished.get(timeout=30)
            assert tid not in results
            results[tid] = (ok, at - t0)
        results_note = f"results {results}, A's event query {a_event_pending} (600 = not ready)"
        assert 1 not in results, results_note  # first in line: reported only when its copy really ended
        assert all(results[10 + k][0] for k in range(10)), results_note
        assert max(results[10 + k][1] for k in range(10)) < 1.0, results_note  # B was not held up by A
        assert results[2][0] is False and results[3][0] is False, results_note
        assert 1.0 <= results[2][1] < 3.0, results_note
        s = ex.stats()
        assert s["instances_failed"] == 1 and s["instances"] == 1
        assert finished.empty(), "A's first transfer reported while its copy could still be running"
        released = time.monotonic()
        pipes[0][0].send_bytes(b"release")
        tid, ok, at = finished.get(timeout=60)  # A's copy ends once its gate opens
        assert tid == 1 and ok is False and at >= released
        for slot in (2, 3, 4):  # the neutralized stores never wrote their slots
            assert pool.read(slot, slot_bytes) == bytes([0x5C]) * slot_bytes
        assert ex.stats()["in_flight"] == 0
    finally:
        if ex is not None:
            ex.close()
        if pool is not None:
            pool.close()
        for (parent, _), p in zip(pipes, procs):
            try:
                parent.send_bytes(b"bye")
            except OSError:
                pass
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
