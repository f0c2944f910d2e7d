"""mpcache-sim: exit codes, summary table, replay commands, charts."""
from __future__ import annotations

from pathlib import Path

import pytest

from mpcache.sim.cli import main
from mpcache.sim.profiles import PROFILES


def test_run_passes_and_prints_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--seeds", "4"]) == 0
    out = capsys.readouterr().out
    for row in ("seeds", "passed / failed", "events handled", "virtual time", "wall time", "virtual : real"):
        assert row in out


def test_run_fails_with_reason_and_replay_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--seeds", "5", "--profile", "no-ack-wait"]) == 1
    out = capsys.readouterr().out
    assert "violations by kind:" in out and "F5" in out
    assert "replay: mpcache-sim replay 0 --profile no-ack-wait" in out


def test_profiles_catch_table(capsys: pytest.CaptureFixture[str]) -> None:
    # seeds 0..3 under no-ack-wait: F5 on most of them (a table row, the first seed 0)
    assert main(["profiles", "--seeds", "4", "--profile", "no-ack-wait"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("no-ack-wait"))
    assert row.split()[1:5:3] == ["F5", "0"] and "/4" in row
    # a share no profile reaches fails the command, naming the profile
    assert main(["profiles", "--seeds", "2", "--profile", "no-reaper", "--min-share", "1.01"]) == 1
    assert "fewer than 101% of seeds: no-reaper" in capsys.readouterr().out


def test_list_profiles(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list-profiles"]) == 0
    out = capsys.readouterr().out
    for name, profile in PROFILES.items():
        assert name in out and (profile.failure in out)


def test_replay_prints_trace_and_draws_chart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chart = tmp_path / "seed0.svg"
    assert main(["replay", "0", "--profile", "no-ack-wait", "--chart", str(chart)]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION F5" in out and "trace hash" in out
    lines = [line for line in out.splitlines() if not line.startswith("#")]
    assert len(lines) > 10 and all(line[:12].strip().replace(".", "").isdigit() or line.startswith(("VIOLATION", "no "))
                                   for line in lines[:10])
    svg = chart.read_text()
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert ">sched" in svg and ">server" in svg and "QueryPrefetchStatus" in svg and "VIOLATION" in svg
    assert svg.count("<line") > 5


def test_unknown_profile_is_refused() -> None:
    with pytest.raises(SystemExit):
        main(["run", "--seeds", "1", "--profile", "nope"])
