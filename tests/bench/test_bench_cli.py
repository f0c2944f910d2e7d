"""mpcache-bench's own command line (the benchmarks are commands, not tests: none is run here)."""
from __future__ import annotations

import pytest

from mpcache.bench.bench_cli import available, main


def test_all_help_describes_all_and_runs_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["all", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mpcache-bench all")
    assert "== mpcache-bench" not in out  # no benchmark started
    assert all(name in out for name in available())


def test_loop_bench_times_one_bound(capsys: pytest.CaptureFixture[str]) -> None:
    """`mpcache-bench loop` drives core_sm in-process: one cheap bound runs and prints its row."""
    assert "loop" in available()
    main(["loop", "--repeat", "1", "--only", "L1 miss"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| lookup, L1 miss")]
    assert len(rows) == 1 and "524,288 tokens x 32 ranks" in rows[0]
