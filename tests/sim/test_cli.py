"""mpcache-sim: exit codes, summary table, replay commands, charts."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

from mpcache.sim.cli import build_parser, display_lines, main
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
    pytest.importorskip("matplotlib")
    chart = tmp_path / "seed0.svg"
    assert main(["replay", "0", "--profile", "no-ack-wait", "--chart", str(chart)]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION F5" in out and "trace hash" in out
    # event lines (a long one continues on lines of its effects, "   -> Effect(...)")
    lines = [line for line in out.splitlines() if not line.startswith("#") and not line.lstrip().startswith("->")]
    assert len(lines) > 10 and all(line[:12].strip().replace(".", "").isdigit() or line.startswith(("VIOLATION", "no "))
                                   for line in lines[:10])
    # the violation names the request and the server; the chart draws that request's messages
    m = re.search(r"status query for (r\d+) handled before its LOOKUP, which was still on its way to (server\d+)", out)
    assert m, out[-2000:]
    rid, server = m.groups()
    sched = next(line.split()[1] for line in lines if f"request_id='{rid}'" in line and line.split()[1].startswith("sched"))
    svg = chart.read_text()
    assert svg.lstrip().startswith("<?xml") and svg.rstrip().endswith("</svg>")
    for text in (f">{sched}<", f">{server}<", ">node<", ">virtual time (s)<", f"PrefetchStatus {rid}",  # Query- or WaitPrefetchStatus
                 "VIOLATION F5", f"mpcache-sim replay 0 --profile no-ack-wait: requests {rid}<"):
        assert text in svg, text


@pytest.mark.parametrize("suffix", [".png", ".pdf"])
def test_replay_chart_format_is_the_suffix(suffix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    chart = tmp_path / f"seed0{suffix}"
    assert main(["replay", "0", "--profile", "no-ack-wait", "--quiet", "--chart", str(chart)]) == 1
    assert chart.read_bytes()[:8] == {".png": b"\x89PNG\r\n\x1a\n", ".pdf": b"%PDF-1.4\n"}[suffix][:8]


def test_replay_chart_refuses_a_format_it_does_not_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["replay", "0", "--chart", str(tmp_path / "seed0.gif")])
    assert exit_.value.code == 2
    assert "one of .png, .svg, .pdf, not .gif" in capsys.readouterr().err
    assert not (tmp_path / "seed0.gif").exists()


def test_replay_chart_without_matplotlib_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an install without the plot extra
    assert main(["replay", "0", "--chart", str(tmp_path / "seed0.png")]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "pip install 'mpcache[plot]'" in err and "Traceback" not in err
    assert captured.out == ""  # refused before the replay ran


def test_unknown_profile_is_refused() -> None:
    with pytest.raises(SystemExit):
        main(["run", "--seeds", "1", "--profile", "nope"])


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["run", "fleet"])
def test_every_flag_says_what_it_does_and_its_default(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = _subparser(command)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{command} {action.option_strings[0]} has no help"
            if action.default not in (None, False):
                assert "default" in action.help, f"{command} {action.option_strings[0]} hides its default"
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert "(default: 100)" in capsys.readouterr().out  # --seeds


def test_help_lists_no_hidden_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "SUPPRESS" not in out and "hashes" not in out
    assert "run" in out and "replay" in out and "sweep" in out


@pytest.mark.parametrize("argv", [["run", "--seeds", "-3"], ["run", "--seeds", "0"], ["fleet", "--seeds", "-1"],
                                  ["run", "--jobs", "0"], ["fleet", "--servers", "0"]])
def test_non_positive_counts_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "must be at least 1" in capsys.readouterr().err


def test_replay_cuts_long_lines_and_says_the_violation_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "0", "--profile", "no-ack-wait", "--width", "120"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in out if not line.startswith("VIOLATION")) <= 120
    assert any(line.lstrip().startswith("-> SendRequest(") for line in out)  # one effect per line
    assert sum("status query overtook its lookup" in line for line in out) == 1
    assert out[-1].startswith("VIOLATION F5") and re.search(r"\(at [0-9.]+ s on server[0-9]+\)$", out[-1])
    assert main(["replay", "0", "--profile", "no-ack-wait", "--width", "0", "--quiet"]) == 1
    assert sum("VIOLATION" in line for line in capsys.readouterr().out.splitlines()) == 1


def test_replay_request_shows_only_that_request(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "0", "--profile", "no-ack-wait", "--request", "r7", "--width", "0"]) == 1
    out = capsys.readouterr().out.splitlines()
    events = [line for line in out if not line.startswith(("#", "VIOLATION"))]
    assert events and all("'r7'" in line or " r7 " in line for line in events)
    counted = re.search(r"# (\d+) of (\d+) trace lines mention r7", "\n".join(out))
    assert counted is not None and 0 < int(counted.group(1)) < int(counted.group(2)), out[:3]


def test_display_lines_splits_effects_even_when_an_item_was_shortened() -> None:
    line = "    0.080000 sched1      lookup: E(x=1) -> [A(b=C(d='r7', e..., A(b=2), F()]"
    assert display_lines(line, 60)[1:] == [" " * 25 + "-> A(b=C(d='r7', e...", " " * 25 + "-> A(b=2)",
                                           " " * 25 + "-> F()"]
    assert display_lines(line, 0) == [line]


def test_progress_without_tqdm_shows_rate_and_eta(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # a server-only install: import tqdm fails
    assert main(["run", "--seeds", "3", "--progress"]) == 0
    err = capsys.readouterr().err
    assert "3/3 seeds" in err and "seeds/s" in err and "ETA 00:00" in err
