"""End to end on a GPU host: a real mpcache Server (ZMQ loop, core_sm, L1 segment) with the
GpuTransferExecutor, and a worker process that registers its KV cache by CUDA IPC handles and
STOREs / RETRIEVEs through MPCacheClient — the same core_sm paths CPU engines use.

``make test-gpu``
"""
from __future__ import annotations

import multiprocessing as mp
import tempfile
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GEO = {"num_layers": 4, "num_blocks": 128, "block_size": 16, "num_heads": 2, "head_size": 64}
CHUNK = 64


@pytest.mark.timeout(240)
def test_store_and_retrieve_through_the_server() -> None:
    import msgpack

    from mpcache.runtime_zmq.gpu_transfer import GpuTransferExecutor
    from mpcache.runtime_zmq.server import Server, ServerConfig
    from tests.runtime_zmq.gpu_worker import run_engine_client

    bpc = CHUNK // GEO["block_size"]
    perm = [int(b) for b in np.random.default_rng(3).permutation(GEO["num_blocks"])]
    src, dst = perm[: 3 * bpc], perm[3 * bpc : 6 * bpc]
    slot = 2 * GEO["num_layers"] * CHUNK * GEO["num_heads"] * GEO["head_size"] * 2
    with tempfile.TemporaryDirectory() as d:
        config = ServerConfig(url=f"ipc://{d}/mpcache.sock", chunk_size=CHUNK, l1_size_bytes=16 * slot, slot_bytes=slot)
        executor = GpuTransferExecutor(CHUNK, max_ctas=8)
        server = Server(config, transfer_executor=executor)
        executor.warm_up(server.pool)  # as the server's start-up does: no JIT in the loop later
        loop = threading.Thread(target=server.serve_forever, name="server-loop")
        loop.start()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=run_engine_client, args=(child, server.bound_url, GEO, CHUNK, src, dst, GEO["block_size"] + 5))
        proc.start()
        try:
            assert parent.poll(200), "worker did not finish"
            out = msgpack.unpackb(parent.recv_bytes())
        finally:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
            server.stop()
            loop.join(timeout=30)
    assert "error" not in out, out
    assert out["store"][-1] is True and out["retrieve"][-1] is True, out
    assert out["data_ok"], out
    assert not loop.is_alive()
