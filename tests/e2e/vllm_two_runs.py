"""Two fresh vLLM processes, one after the other, on one ``mpcache-server``: run 1 stores, run 2
has only mpcache to load from. Shared by the multimodal and MLA drivers (``vllm_*_driver.py``):
each runs ``python DRIVER phase --run store|load ...`` and reads its JSON report."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def transfer_config(url: str, chunk: int) -> dict[str, Any]:
    return {
        "kv_connector": "MPCacheConnector",
        "kv_connector_module_path": "mpcache.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"mpcache.server_urls": url, "mpcache.request_timeout_s": 5.0,
                                      "mpcache.chunk_size": chunk},
    }


def two_runs(driver: str, model: str, out: Path, port: int, chunk: int) -> dict[str, Any]:
    """The report: per run (``store``, ``load``) the phase's JSON, its wall seconds, its log and
    the server's object count after it."""
    from mpcache.runtime_zmq.client import MPCacheClient

    url = f"tcp://127.0.0.1:{port}"
    exe = Path(sys.executable).with_name("mpcache-server")
    log = open(out.with_suffix(".server.log"), "ab")
    # the server is a console script of this venv: it must import this checkout's mpcache too
    server = subprocess.Popen([str(exe), "--host", "127.0.0.1", "--port", str(port), "--chunk-size", str(chunk),
                               "--l1-size-gb", "0.0625", "--no-l1-reserve"], stdout=log, stderr=subprocess.STDOUT)
    report: dict[str, Any] = {"runs": {}}
    try:
        with MPCacheClient(url, request_timeout=2.0, wait_connected=False) as client:
            assert client.wait_healthy(30.0), "mpcache-server did not start"
        for run in ("store", "load"):
            path = out.with_suffix(f".{run}.json")
            run_log = out.with_suffix(f".{run}.log")
            t0 = time.perf_counter()
            with open(run_log, "wb") as sink:
                subprocess.run([sys.executable, driver, "phase", "--model", model, "--out", str(path), "--url", url,
                                "--chunk", str(chunk), "--run", run], stdout=sink, stderr=subprocess.STDOUT,
                               check=True, timeout=600)
            report["runs"][run] = json.loads(path.read_text())
            report["runs"][run]["seconds"] = round(time.perf_counter() - t0, 1)
            report["runs"][run]["log"] = run_log.read_text(errors="replace")
            with MPCacheClient(url, request_timeout=5.0) as client:
                report["runs"][run]["objects"] = dict(client.stats()).get("objects")
        return report
    finally:
        server.terminate()
        server.wait(10)
        log.close()
