"""The sweep's plot (matplotlib; the format is the file's suffix) and its argument errors. The
sweep of a live server's trace is tests/runtime_zmq/test_sweep_live.py."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mpcache.sim.cli import main as sim_main
from mpcache.sim.plot import save
from mpcache.sim.sweep import SweepRow, figure, parse_sizes


def rows() -> tuple[list[SweepRow], SweepRow]:
    sweep = [SweepRow(gb, int(gb * 1024), lookups=10, chunks_asked=100, chunks_hit=hit, tokens_asked=800,
                      tokens_hit=7 * hit) for gb, hit in ((0.5, 10), (1, 30), (2, 50), (4, 70), (8, 80))]
    return sweep, SweepRow(2, 2048, lookups=10, chunks_asked=100, chunks_hit=48, tokens_asked=800, tokens_hit=336)


def test_plot_is_written_in_the_suffix_format_with_axes_and_title(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    sweep, recorded = rows()
    png, svg = tmp_path / "sweep.png", tmp_path / "sweep.svg"
    save(figure(sweep, recorded, "live.trace"), str(png))
    save(figure(sweep, recorded, "live.trace"), str(svg))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    for label in ("L1 size (GB)", "hit rate (%)", "mpcache-sim sweep: hit rate vs L1 size", "live.trace",
                  "token hit rate", "recorded: the live server at 2 GB"):
        assert label in text, label
    with pytest.raises(ValueError, match="not .gif"):
        save(figure(sweep, recorded), str(tmp_path / "sweep.gif"))
    assert not (tmp_path / "sweep.gif").exists()


def test_plot_refuses_a_suffix_before_reading_the_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        sim_main(["sweep", str(tmp_path / "none.trace"), "--l1-size-gb", "1", "--plot", str(tmp_path / "x.gif")])
    assert exit_.value.code == 2
    assert "one of .png, .svg, .pdf, not .gif" in capsys.readouterr().err


def test_plot_without_matplotlib_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert sim_main(["sweep", str(tmp_path / "none.trace"), "--l1-size-gb", "1", "--png", str(tmp_path / "x.png")]) == 2
    out = capsys.readouterr().out.strip()
    assert out == f"mpcache-sim sweep: drawing {tmp_path / 'x.png'} needs matplotlib, which is not installed: " \
                  "pip install 'mpcache[plot]'"


def test_bad_sizes_and_files_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_sizes("4,1,2,2") == [1.0, 2.0, 4.0]
    for bad in ("", "1,x", "0,1", "-1"):
        with pytest.raises(ValueError):
            parse_sizes(bad)
    assert sim_main(["sweep", str(tmp_path / "none.trace"), "--l1-size-gb", "1"]) == 2
    not_trace = tmp_path / "x.trace"
    not_trace.write_text('{"hello": 1}\n')
    assert sim_main(["sweep", str(not_trace), "--l1-size-gb", "1"]) == 2
    out = capsys.readouterr().out
    assert "not an mpcache trace" in out and "Traceback" not in out
