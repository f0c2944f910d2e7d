"""The sweep's PNG (decoded back here: header, size, pixels that must be drawn) and its argument
errors. The sweep of a live server's trace is tests/runtime_zmq/test_sweep_live.py."""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from mpcache.sim.cli import main as sim_main
from mpcache.sim.png import BLACK, BLUE, MARGIN, WHITE, line_plot, points
from mpcache.sim.sweep import parse_sizes


def decode(png: bytes) -> tuple[int, int, list[bytes]]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, size = 8, b"", (0, 0)
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos:pos + 4])
        kind, data = png[pos + 4:pos + 8], png[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", png[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + data)
        if kind == b"IHDR":
            w, h, depth, color = struct.unpack(">IIBB", data[:10])
            assert (depth, color) == (8, 2)
            size = (w, h)
        elif kind == b"IDAT":
            idat += data
        pos += 12 + length
    raw = zlib.decompress(idat)
    w, h = size
    rows = [raw[y * (3 * w + 1):(y + 1) * (3 * w + 1)] for y in range(h)]
    assert all(r[0] == 0 for r in rows)  # filter 0: rows are the pixels as drawn
    return w, h, [r[1:] for r in rows]


def pixel(rows: list[bytes], x: int, y: int) -> tuple[int, ...]:
    return tuple(rows[y][3 * x:3 * x + 3])


def test_plot_draws_axes_ticks_and_every_point() -> None:
    ys = [0.1, 0.4, 0.4, 0.9]
    w, h, rows = decode(line_plot(ys, 400, 300))
    assert (w, h) == (400, 300)
    assert pixel(rows, MARGIN, MARGIN + 10) == BLACK  # y axis
    assert pixel(rows, w // 2, h - MARGIN) == BLACK  # x axis
    assert pixel(rows, MARGIN - 4, h - MARGIN - (h - 2 * MARGIN) // 2) == BLACK  # the 50 % tick
    for px, py in points(len(ys), ys, w, h):
        assert pixel(rows, px, py) == BLUE
        assert pixel(rows, px, h - MARGIN + 4) == BLACK  # its x tick
    (x0, y0), (x1, y1) = points(len(ys), ys, w, h)[:2]
    assert pixel(rows, (x0 + x1) // 2, (y0 + y1) // 2) == BLUE  # the line between them
    assert pixel(rows, w - 5, 5) == WHITE


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
