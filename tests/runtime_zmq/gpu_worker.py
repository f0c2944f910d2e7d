"""The engine side of the GPU regression test, run in a child process: owns the KV tensors,
exports them and an interprocess event over a pipe as msgpack (bytes and plain values)."""
from __future__ import annotations

from typing import Any

STALE, FRESH, POISON = 0x1111, 0x2222, -23131  # int16 patterns


class Gate:
    """GPU work enqueued after ``Gate(torch)`` on the current stream waits until ``open()``: the
    stream waits (``cuStreamWaitValue32``) on a pinned host word that ``open()`` sets. A test that
    holds an engine's event pending by a gate knows it is pending, where a long kernel is only
    likely to be (its length is a guess about the GPU's clocks)."""

    def __init__(self, torch: Any) -> None:
        from mpcache.runtime_zmq.gpu_ipc import check, driver

        drv = driver()
        self._word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        addr = check(drv.cuMemHostGetDevicePointer(self._word.data_ptr(), 0), "cuMemHostGetDevicePointer")
        stream = drv.CUstream(torch.cuda.current_stream().cuda_stream)
        check(drv.cuStreamWaitValue32(stream, addr, 1, drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
              "cuStreamWaitValue32")

    def open(self) -> None:
        self._word[0] = 1


def run_worker(conn: Any, geo: dict[str, int], fresh_blocks: list[int], poison_blocks: list[int], gated: bool) -> None:
    """Exports its KV tensors, then (after b"registered") an interprocess event recorded after the
    blocks to store got their final contents. ``gated``: that work waits on a Gate, so the event
    stays pending until the parent sends b"release" (or b"bye"); else it is recorded at once."""
    import faulthandler

    import msgpack
    import torch

    from mpcache.runtime_zmq.gpu_ipc import device_uuid, export_event, export_kv_tensors

    # a worker still alive after the test's own limit prints where it is, then ends
    faulthandler.dump_traceback_later(200, exit=True)
    torch.cuda.init()
    shape = (2, geo["num_blocks"], geo["block_size"], geo["num_heads"], geo["head_size"])
    gen = torch.Generator(device="cuda").manual_seed(5)
    layers = []
    for _ in range(geo["num_layers"]):
        t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        t.view(torch.int16).random_(-32768, 32767, generator=gen)
        t.view(torch.int16)[:, fresh_blocks] = STALE
        t.view(torch.int16)[:, poison_blocks] = POISON
        layers.append(t)
    torch.cuda.synchronize()
    layout = {
        "kv_layout": "nhd", "num_blocks": geo["num_blocks"], "block_size": geo["block_size"],
        "num_heads": geo["num_heads"], "head_size": geo["head_size"], "itemsize": 2,
        "device_uuid": device_uuid(torch.cuda.current_device()), "tensors": export_kv_tensors(layers),
    }
    conn.send_bytes(msgpack.packb(layout))
    fresh = torch.tensor(fresh_blocks, device="cuda")  # on the device now: no host sync below
    torch.cuda.synchronize()
    conn.recv_bytes()  # registered
    # The "forward pass": (held by the gate, if any), then the blocks to store get their final
    # contents, then the event, all enqueued without waiting. A server that did not wait on the
    # event would copy STALE.
    event = torch.cuda.Event(interprocess=True)
    gate = Gate(torch) if gated else None
    for t in layers:
        t.view(torch.int16).index_fill_(1, fresh, FRESH)
    event.record()
    assert gate is None or not event.query(), "the gated event completed before the gate opened"
    conn.send_bytes(export_event(event))
    message = conn.recv_bytes()
    if gate is not None:
        gate.open()
        if message == b"release":
            message = conn.recv_bytes()
    torch.cuda.synchronize()  # the server side is done with our memory once b"bye" came


def run_engine_client(conn: Any, url: str, geo: dict[str, int], chunk: int, src: list[int], dst: list[int], skip_tokens: int,
                      attacker: bool = False) -> None:
    """A GPU engine worker talking to a real mpcache-server over ZMQ: register by IPC handles,
    STORE from ``src`` blocks, RETRIEVE into ``dst`` blocks, then check its own cache.
    ``attacker``: after the registration, another connection (another peer) registers the same
    instance id with KV memory of its own, then unregisters it; both must be refused, and the
    worker's copies must still go through its own memory (the other's left untouched)."""
    import msgpack
    import torch

    from mpcache.runtime_zmq.client import MPCacheClient
    from mpcache.runtime_zmq.gpu_ipc import device_uuid, export_event, export_kv_tensors

    torch.cuda.init()
    shape = (2, geo["num_blocks"], geo["block_size"], geo["num_heads"], geo["head_size"])
    gen = torch.Generator(device="cuda").manual_seed(9)
    layers = []
    for _ in range(geo["num_layers"]):
        t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        t.view(torch.int16).random_(-32768, 32767, generator=gen)
        layers.append(t)
    before = [t.clone() for t in layers]
    object_bytes = 2 * geo["num_layers"] * chunk * geo["num_heads"] * geo["head_size"] * 2

    def layout_of(kv: list[Any]) -> dict[str, Any]:
        return {
            "model_name": "gpu/test", "world_size": 1, "object_bytes": object_bytes, "engine_driven": False,
            "kv_layout": "nhd", "num_blocks": geo["num_blocks"], "block_size": geo["block_size"],
            "num_heads": geo["num_heads"], "head_size": geo["head_size"], "itemsize": 2,
            "device_uuid": device_uuid(torch.cuda.current_device()), "tensors": export_kv_tensors(kv),
        }

    out: dict[str, Any] = {}
    client = MPCacheClient(url)
    other: list[Any] = []
    try:
        client.register_instance(1, layout_of(layers)).result(120)
        if attacker:
            from mpcache.runtime_zmq.client import RemoteError

            other = [torch.full(shape, 7, dtype=torch.bfloat16, device="cuda") for _ in range(geo["num_layers"])]
            foreign = MPCacheClient(url)
            refused = []
            try:
                for call in (lambda: foreign.register_instance(1, layout_of(other)), lambda: foreign.unregister_instance(1)):
                    try:
                        call().result(60)
                        refused.append("accepted")
                    except RemoteError as e:
                        refused.append(e.kind)
            finally:
                foreign.close()
            out["foreign"] = refused
        event = torch.cuda.Event(interprocess=True)
        event.record()
        handle = export_event(event)
        tokens = list(range(5000, 5000 + len(src) * geo["block_size"]))

        def key(rid: str) -> dict[str, Any]:
            return {"model_name": "gpu/test", "world_size": 1, "worker_id": 0, "token_ids": tokens, "start": 0,
                    "end": len(tokens), "request_id": rid, "cache_salt": "", "request_configs": None, "num_kv_readers": 1}

        out["store"] = list(client.store(key("s"), 1, src, handle).result(60))
        out["retrieve"] = list(client.retrieve(key("r"), 1, dst, handle, skip_tokens).result(60))
        skip_blocks = skip_tokens // geo["block_size"]
        ok = True
        for t, b in zip(layers, before):
            ok &= bool(torch.equal(t.view(torch.int16)[:, dst[skip_blocks:]], b.view(torch.int16)[:, src[skip_blocks:]]))
            ok &= bool(torch.equal(t.view(torch.int16)[:, dst[:skip_blocks]], b.view(torch.int16)[:, dst[:skip_blocks]]))
            ok &= bool(torch.equal(t.view(torch.int16)[:, src], b.view(torch.int16)[:, src]))
        out["data_ok"] = ok
        if attacker:
            torch.cuda.synchronize()
            out["other_untouched"] = all(bool((t == 7).all()) for t in other)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        client.close()
    for k in ("store", "retrieve"):
        if k in out:
            out[k] = [v if not isinstance(v, bytes) else len(v) for v in out[k]]
    conn.send_bytes(msgpack.packb(out))
