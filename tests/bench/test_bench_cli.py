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


def test_sim_where_charges_every_part_of_a_seed(capsys: pytest.CaptureFixture[str]) -> None:
    """`mpcache-bench sim --where 1`: one seed profiled, its CPU split by part; the shares add up
    and the production machines and trio's scheduler are among the parts charged."""
    assert main(["sim", "--where", "1"]) == 0
    out = capsys.readouterr().out
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| ")]
    rows = {c[0]: c[2] for c in cells if len(c) == 3 and c[2].endswith("%")}
    assert float(rows.pop("total").rstrip("%")) == 100
    assert abs(sum(float(v.rstrip("%")) for v in rows.values()) - 100) < 0.5
    assert rows["production machines (core_sm)"] != "0.0%" and rows["trio's scheduler and cancel scopes"] != "0.0%"
