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
