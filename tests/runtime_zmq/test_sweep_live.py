"""Capacity planning on a live trace: a server with 8 slots serves a skewed (Pareto) workload
under ``--trace``; ``mpcache-sim sweep`` re-runs it at 1..16 slots. The hit rate never drops as
L1 grows, the recorded size reproduces the live server's hit rate, the biggest size reaches it or
more, and no size breaks an oracle."""
from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from adapter_driver import CHUNK, Engine
from mpcache.sim.cli import main as sim_main
from mpcache.sim.sweep import read_trace, recorded_hit_rate, sweep

SLOT_GB = 1 / 1024  # --slot-mb 1


def test_sweep_of_a_live_skewed_trace_is_monotone(start_server: Callable[..., Any], tmp_path: Any,
                                                  capsys: Any) -> None:
    path = str(tmp_path / "skewed.trace")
    server = start_server("--chunk-size", str(CHUNK), "--l1-size-gb", str(8 * SLOT_GB), "--slot-mb", "1",
                          "--trace", path)
    engine = Engine([server.url])
    rng = random.Random(7)
    prompts = [[rng.randrange(50_000) for _ in range(4 * CHUNK + 2)] for _ in range(10)]
    try:
        for i in range(32):
            engine.add(f"r{i}", prompts[min(int(rng.paretovariate(1.0)) - 1, len(prompts) - 1)])
            engine.run_all()
    finally:
        engine.close()
    assert server.terminate() == 0

    head, records = read_trace(path)
    live = recorded_hit_rate(head, records)
    assert live.lookups == 32 and 0 < live.chunk_hit_rate < 1
    rows = sweep(head, records, [n * SLOT_GB for n in (1, 2, 4, 8, 16)])
    assert [r.num_slots for r in rows] == [1, 2, 4, 8, 16]
    assert all(not r.violations for r in rows), [r.violations for r in rows]
    rates = [r.token_hit_rate for r in rows]
    assert rates == sorted(rates), rates
    assert rows[-1].token_hit_rate >= live.token_hit_rate
    assert rows[3].chunks_hit == live.chunks_hit  # the recorded size answers as the live server did
    assert rows[0].evictions > 0

    png = tmp_path / "sweep.png"
    assert sim_main(["sweep", path, "--l1-size-gb", f"{SLOT_GB},{4 * SLOT_GB},{16 * SLOT_GB}",
                     "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "token hit" in out and "recorded" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
