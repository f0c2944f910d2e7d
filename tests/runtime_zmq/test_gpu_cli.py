"""On a GPU host: ``mpcache-server --gpu on`` as users start it (a separate process: CLI, GPU
transfer engine built and warmed up before the ready line), driven by a GPU engine worker that
registers its KV cache by CUDA IPC handles and stores / retrieves through it; then SIGTERM.

``make test-gpu`` (or ``python -m pytest -m gpu tests/runtime_zmq/test_gpu_cli.py``)
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GEO = {"num_layers": 4, "num_blocks": 128, "block_size": 16, "num_heads": 2, "head_size": 64}
CHUNK = 64
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("attacker", [False, True], ids=["alone", "foreign-register"])
def test_cli_gpu_server_store_and_retrieve(attacker: bool) -> None:
    """With ``foreign-register``, another peer registers (and unregisters) the worker's instance id
    with KV memory of its own between the worker's registration and its copies: refused, and the
    real GPU engine still copies through the owner's memory only (decide, then act)."""
    import msgpack

    from tests.runtime_zmq.gpu_worker import run_engine_client

    slot = 2 * GEO["num_layers"] * CHUNK * GEO["num_heads"] * GEO["head_size"] * 2
    bpc = CHUNK // GEO["block_size"]
    perm = [int(b) for b in np.random.default_rng(5).permutation(GEO["num_blocks"])]
    src, dst = perm[: 3 * bpc], perm[3 * bpc : 6 * bpc]
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "mpcache.runtime_zmq.cli", "--gpu", "on", "--ipc", f"{d}/run/mpcache.sock",
             "--chunk-size", str(CHUNK), "--slot-mb", str(slot / (1 << 20)), "--l1-size-gb", str(64 * slot / (1 << 30)), "--no-metrics"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
        )
        try:
            assert proc.stdout is not None
            url = ""
            lines: list[str] = []
            for line in proc.stdout:
                lines.append(line.rstrip())
                if line.startswith("mpcache-server ready "):
                    url = line.split()[2]
                    break
            assert url, "server did not start:\n" + "\n".join(lines)
            # keep reading its output: a full pipe would stall the server's logging
            pump = threading.Thread(target=lambda: lines.extend(x.rstrip() for x in proc.stdout), daemon=True)  # type: ignore[union-attr]
            pump.start()
            ready_s = time.monotonic() - t0
            ctx = mp.get_context("spawn")
            parent, child = ctx.Pipe()
            worker = ctx.Process(target=run_engine_client, args=(child, url, GEO, CHUNK, src, dst, GEO["block_size"] + 3,
                                                                  attacker))
            worker.start()
            try:
                assert parent.poll(200), "worker did not finish"
                out = msgpack.unpackb(parent.recv_bytes())
            finally:
                worker.join(timeout=30)
                if worker.is_alive():
                    worker.kill()
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(30)
            except subprocess.TimeoutExpired:
                code = None
            assert code == 0, f"exit code {code} after SIGTERM; server output:\n" + "\n".join(lines[-60:])
        finally:
            if proc.poll() is None:
                proc.kill()
    print(f"ready after {ready_s:.2f} s (GPU warm-up included)")
    assert "error" not in out, out
    assert out["store"][-1] is True and out["retrieve"][-1] is True, out
    assert out["data_ok"], out
    if attacker:
        assert out["foreign"] == ["forbidden", "forbidden"] and out["other_untouched"], out
