"""The engine side of the GPU regression test, run in a child process: owns the KV tensors,
exports them and an interprocess event over a pipe as msgpack (bytes and plain values)."""
from __future__ import annotations

from typing import Any

STALE, FRESH, POISON = 0x1111, 0x2222, -23131  # int16 patterns


def stall(torch: Any, seconds: float) -> None:
    """Keep this process's current stream busy for about ``seconds`` (GPU work only; returns
    at once): a chain of large bf16 matrix products, sized by timing a few first."""
    if seconds <= 0:
        return
    import time

    a = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    torch.matmul(a, a, out=c)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        torch.matmul(a, a, out=c)
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / 3
    for _ in range(int(seconds / per) + 1):
        torch.matmul(a, a, out=c)


def run_worker(conn: Any, geo: dict[str, int], fresh_blocks: list[int], poison_blocks: list[int], stall_s: float) -> None:
    import msgpack
    import torch

    from mpcache.runtime_zmq.gpu_ipc import device_uuid, export_event, export_kv_tensors

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
    # The "forward pass": long GPU work, then the blocks to store get their final contents,
    # then the event, all enqueued without waiting (a pageable copy here would block the host
    # until the GPU work is done, and the event would be complete by the time it is sent).
    # A server that did not wait on the event would copy STALE.
    event = torch.cuda.Event(interprocess=True)
    stall(torch, stall_s)
    for t in layers:
        t.view(torch.int16).index_fill_(1, fresh, FRESH)
    event.record()
    assert stall_s <= 0 or not event.query(), "the event completed before it was sent"
    conn.send_bytes(export_event(event))
    conn.recv_bytes()  # the server side is done with our memory
    torch.cuda.synchronize()


def run_engine_client(conn: Any, url: str, geo: dict[str, int], chunk: int, src: list[int], dst: list[int], skip_tokens: int) -> None:
    """A GPU engine worker talking to a real mpcache-server over ZMQ: register by IPC handles,
    STORE from ``src`` blocks, RETRIEVE into ``dst`` blocks, then check its own cache."""
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
    layout = {
        "model_name": "gpu/test", "world_size": 1, "object_bytes": object_bytes, "engine_driven": False,
        "kv_layout": "nhd", "num_blocks": geo["num_blocks"], "block_size": geo["block_size"],
        "num_heads": geo["num_heads"], "head_size": geo["head_size"], "itemsize": 2,
        "device_uuid": device_uuid(torch.cuda.current_device()), "tensors": export_kv_tensors(layers),
    }
    out: dict[str, Any] = {}
    client = MPCacheClient(url)
    try:
        client.register_instance(1, layout).result(120)
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
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        client.close()
    for k in ("store", "retrieve"):
        if k in out:
            out[k] = [v if not isinstance(v, bytes) else len(v) for v in out[k]]
    conn.send_bytes(msgpack.packb(out))
