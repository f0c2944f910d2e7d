"""Which CUDA interprocess-event records does another process see? (GPU host:
``python3 tools/gpu_ipc_event_probe.py``.)

The server orders its copies after an engine's work with ``cuStreamWaitEvent`` on the engine's
interprocess event, opened from its 64-byte handle. This probe runs an exporter process (torch,
as vLLM's worker) and queries the event from this process (cuda.bindings, as the server):

* ``record, then open``: the exporter records after ~2 s of GPU work, then sends the handle;
* ``open, then record``: the handle is sent and opened first; the exporter then records after
  ~2 s of GPU work;
* and, each time, whether a stream of ours waiting on the event is held back.

It prints one line per case: the query right after (600 = CUDA_ERROR_NOT_READY, i.e. pending).
"""
from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any


def stall(torch: Any, seconds: float) -> None:
    """Keep the current stream busy for about ``seconds`` (returns at once): the GPU spins for
    a cycle count calibrated from a short timed spin."""
    import time as _time

    torch.cuda.synchronize()
    t0 = _time.perf_counter()
    torch.cuda._sleep(10_000_000)
    torch.cuda.synchronize()
    per_cycle = (_time.perf_counter() - t0) / 10_000_000
    torch.cuda._sleep(int(seconds / per_cycle))


def _exporter(conn: Any) -> None:
    import torch

    from mpcache.runtime_zmq.gpu_ipc import export_event

    torch.cuda.init()
    # case 1: record after GPU work, then export
    ev1 = torch.cuda.Event(interprocess=True)
    stall(torch, 2.0)
    ev1.record()
    conn.send(("record-then-open", export_event(ev1), ev1.query()))
    conn.recv()
    torch.cuda.synchronize()
    # case 2: export (after one trivial record), the importer opens, then record after GPU work
    ev2 = torch.cuda.Event(interprocess=True)
    ev2.record()
    torch.cuda.synchronize()
    conn.send(("open-then-record", export_event(ev2), ev2.query()))
    conn.recv()  # opened
    stall(torch, 2.0)
    ev2.record()
    conn.send(("recorded", b"", ev2.query()))
    conn.recv()
    torch.cuda.synchronize()


def main() -> None:
    from numba import cuda

    from mpcache.runtime_zmq import gpu_ipc

    gpu_ipc.ensure_context(0)
    drv = gpu_ipc.driver()
    stream = cuda.stream()
    from mpcache.kernels.gpu import raw_stream

    raw = raw_stream(stream)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_exporter, args=(child,))
    p.start()

    def probe(ev: Any) -> tuple[int, int]:
        mine = gpu_ipc.create_completion_event()
        gpu_ipc.check(drv.cuStreamWaitEvent(raw, ev, 0), "cuStreamWaitEvent")
        gpu_ipc.check(drv.cuEventRecord(mine, raw), "cuEventRecord")
        time.sleep(0.05)
        return int(drv.cuEventQuery(ev)[0]), int(drv.cuEventQuery(mine)[0])

    name, handle, exporter_done = parent.recv()
    ev = gpu_ipc.open_event(handle)
    q, held = probe(ev)
    print(f"{name}: exporter's own query done={exporter_done}; imported event query {q}, our waiting stream {held}")
    parent.send("next")
    name, handle, exporter_done = parent.recv()
    ev2 = gpu_ipc.open_event(handle)
    parent.send("opened")
    _, _, exporter_done = parent.recv()
    q, held = probe(ev2)
    print(f"{name}: exporter's own query done={exporter_done}; imported event query {q}, our waiting stream {held}")
    parent.send("bye")
    p.join(60)


def _short_exporter(conn: Any) -> None:
    import torch

    from mpcache.runtime_zmq.gpu_ipc import export_event

    torch.cuda.init()
    ev = torch.cuda.Event(interprocess=True)
    stall(torch, 1.5)
    ev.record()
    conn.send(export_event(ev))
    conn.recv()
    torch.cuda.synchronize()


def sequential(destroy: bool) -> None:
    """Two exporter processes one after the other: does the second one's event, opened in
    the same importer, still show its pending record?"""
    from mpcache.runtime_zmq import gpu_ipc

    gpu_ipc.ensure_context(0)
    drv = gpu_ipc.driver()
    ctx = mp.get_context("spawn")
    handles = []
    for k in range(2):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_short_exporter, args=(child,))
        p.start()
        h = parent.recv()
        handles.append(h)
        ev = gpu_ipc.open_event(h)
        q = int(drv.cuEventQuery(ev)[0])
        print(f"sequential(destroy={destroy}) exporter {k}: imported query {q} (600 = pending); "
              f"handle equal to the first: {h == handles[0]}")
        time.sleep(2.0)
        if destroy:
            gpu_ipc.destroy_event(ev)
        parent.send("bye")
        p.join(60)


if __name__ == "__main__":
    import sys

    if "--sequential" in sys.argv:
        sequential(destroy="--destroy" in sys.argv)
    else:
        main()
