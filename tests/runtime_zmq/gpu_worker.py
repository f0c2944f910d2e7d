"""The engine side of the GPU regression test, run in a child process: owns the KV tensors,
exports them and an interprocess event over a pipe as msgpack (bytes and plain values)."""
from __future__ import annotations

from typing import Any

STALE, FRESH, POISON = 0x1111, 0x2222, -23131  # int16 patterns


def run_worker(conn: Any, geo: dict[str, int], fresh_blocks: list[int], poison_blocks: list[int], sleep_cycles: int) -> None:
    import msgpack
    import torch

    from runtime_zmq.gpu_ipc import device_uuid, export_event, export_kv_tensors

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
    conn.recv_bytes()  # registered
    # The "forward pass": a long kernel, then the blocks to store get their final contents, then
    # the event. A server that did not wait on the event would copy STALE.
    event = torch.cuda.Event(interprocess=True)
    torch.cuda._sleep(sleep_cycles)
    for t in layers:
        t.view(torch.int16)[:, fresh_blocks] = FRESH
    event.record()
    conn.send_bytes(export_event(event))
    conn.recv_bytes()  # the server side is done with our memory
    torch.cuda.synchronize()
