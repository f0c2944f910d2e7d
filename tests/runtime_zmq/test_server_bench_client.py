"""The C throughput client of ``mpcache-bench rpc`` (mpcache/bench/rpc_client.c) against a real server:
it counts only replies that are what was asked (op frame and, for status, the hit count), ends
every lookup it sent, and reports an error reply as an error, never as throughput."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator

import pytest
import zmq

from live_server import ServerProcess
from mpcache.bench import bench_rpc

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="needs a C compiler")


@pytest.fixture(scope="module")
def c_client() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="mpcache-cclient-")
    path, why = bench_rpc.build_c_client(d)
    if path is None:
        pytest.skip(f"the C client cannot be built: {why}")
    yield path
    shutil.rmtree(d, ignore_errors=True)


def test_c_client_counts_real_round_trips(start_server: Callable[..., ServerProcess], c_client: str) -> None:
    sp = start_server()
    assert sp.proc is not None
    bench_rpc.prestore_mpcache(sp.url)
    hits = bench_rpc.TOKENS // bench_rpc.CHUNK
    for what in ("noop", "status", "lookup", "lookup_packed"):
        cpu: list[float] = []
        client_cpu: list[float] = []
        rate = bench_rpc.measure_throughput_c(c_client, sp.url, what, 2, 4, 0.3, f"t-{what}", hits,
                                              sp.proc.pid, cpu, client_cpu)
        assert rate > 0, what
        # measured (clock-tick resolution: a short row on a loaded box may read 0)
        assert len(cpu) == 1 and len(client_cpu) == 1 and cpu[0] >= 0 and client_cpu[0] >= 0
    sock = bench_rpc.dealer(zmq.Context.instance(), sp.url)
    try:
        stats = bench_rpc.rpc_call(sock, 1, "stats")
    finally:
        sock.close()
    # every lookup was ended (the client waits for each end_session's reply): no job is left
    assert stats["jobs"] == 0, stats


def test_c_client_reports_a_wrong_answer_as_an_error(start_server: Callable[..., ServerProcess], c_client: str) -> None:
    sp = start_server()
    bench_rpc.prestore_mpcache(sp.url)
    # the prompt is a 32-chunk hit: expecting 31 makes every status reply an error
    with pytest.raises(bench_rpc.BenchError, match="error replies"):
        bench_rpc.measure_throughput_c(c_client, sp.url, "status", 1, 2, 0.2, "t-wrong", 31)
