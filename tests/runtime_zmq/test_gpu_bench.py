"""The GPU server benchmark's CPU-side parts (no GPU needed): the server-process helper it
starts servers with, and how rounds become a table row."""
from __future__ import annotations

import pytest

from mpcache.bench.bench_gpu_server import SLOT, _summarise
from mpcache.bench.server_process import ServerProcess


def test_server_process_starts_and_stops_cleanly() -> None:
    server = ServerProcess(["--gpu", "off", "--port", "0", "--no-metrics", "--l1-size-gb", "0.0625", "--slot-mb", "1"],
                           ready_timeout=60)
    try:
        assert server.url.startswith("tcp://127.0.0.1:") and server.ready_s > 0
    finally:
        code = server.stop(30)
    assert code == 0, "\n".join(server.log)
    assert server.stop_s < 30


def _round(start: float, wall_s: float, lat_ms: list[float], cpu_ns: int, started: int, start_ns: int,
           idle_ns: float = 0.0) -> dict[str, object]:
    part = {"start": start, "end": start + wall_s, "lat_ms": lat_ms, "ok": True, "submit_ms": [0.1] * len(lat_ms)}
    res = [{"store": part, "retrieve": part, "check": True}]
    return {"res": res, "cpu_ns": cpu_ns, "idle_ns": idle_ns, "s0": {"gpu_started": 0, "gpu_start_ns": 0},
            "s1": {"gpu_started": started, "gpu_start_ns": start_ns, "gpu_finished": started,
                   "gpu_flight_ns": started * 2_000_000, "served_store": 4, "served_ns_store": 4 * 3_000_000}}


def test_rounds_summarised_with_the_first_apart() -> None:
    n_req, n_chunks = 4, 2
    nbytes = n_req * n_chunks * SLOT
    rounds = [_round(0.0, 1.0, [900.0] * 4, 0, 0, 0)]  # a slow first round
    rounds += [_round(10.0 * k, nbytes / 50e9, [1.0, 2.0, 3.0, 4.0], 8_000_000, 8, 400_000) for k in range(1, 4)]
    row = _summarise(1, n_req, n_chunks, rounds, {"d2h": 50.0, "h2d": 100.0})
    assert row["store"]["gbps"] == pytest.approx(50.0) and row["store"]["pct"] == pytest.approx(100.0)
    assert row["retrieve"]["pct"] == pytest.approx(50.0)
    assert row["store"]["p50"] in (2.0, 3.0) and row["store"]["p99"] == 4.0
    assert row["store_first"]["p50"] == 900.0 and row["store_first"]["gbps"] == pytest.approx(nbytes / 1e9)
    assert row["cpu_us_per_req"] == pytest.approx(3 * 8_000 / (2 * n_req * 3))
    assert row["host_us_per_transfer"] == pytest.approx(50.0) and row["checked"]
    assert row["flight_ms_per_transfer"] == pytest.approx(2.0) and row["served_ms_store"] == pytest.approx(3.0)
    assert row["store"]["submit_p50"] == pytest.approx(0.1)
    # the server's idle CPU over each round's wall time is not the requests'
    idle = [rounds[0]] + [dict(r, idle_ns=2_000_000.0) for r in rounds[1:]]
    row = _summarise(1, n_req, n_chunks, idle, {"d2h": 50.0, "h2d": 100.0})
    assert row["cpu_us_per_req"] == pytest.approx(3 * 6_000 / (2 * n_req * 3))
    assert row["cpu_us_per_req_gross"] == pytest.approx(3 * 8_000 / (2 * n_req * 3))
