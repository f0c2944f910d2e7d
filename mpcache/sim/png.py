"""A line plot as a PNG, with the standard library alone (zlib + struct).

``line_plot(xs, ys)`` draws axes, tick marks (x at every point, y every 10 % of 0..1), the
polyline through the points and a square marker on each, on a white RGB raster, and returns the
PNG bytes. x is spaced by position (the sweep's sizes are usually doubling), y is 0..1. No text
is drawn: the command that writes it prints the table beside it.
"""
from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

WHITE = (255, 255, 255)
BLACK = (0, 0, 0)
GREY = (220, 220, 220)
BLUE = (31, 119, 180)
MARGIN = 40


class Raster:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.rows = [bytearray(bytes(WHITE) * width) for _ in range(height)]

    def set(self, x: int, y: int, color: tuple[int, int, int]) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            self.rows[y][3 * x:3 * x + 3] = bytes(color)

    def get(self, x: int, y: int) -> tuple[int, int, int]:
        r, g, b = self.rows[y][3 * x:3 * x + 3]
        return r, g, b

    def line(self, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int], width: int = 1) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(steps + 1):
            x = x0 + (x1 - x0) * i // steps
            y = y0 + (y1 - y0) * i // steps
            for d in range(-(width // 2), width - width // 2):
                self.set(x, y + d, color) if abs(x1 - x0) >= abs(y1 - y0) else self.set(x + d, y, color)

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(row) for row in self.rows)

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        ihdr = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9))
                + chunk(b"IEND", b""))


def points(n: int, ys: Sequence[float], width: int, height: int) -> list[tuple[int, int]]:
    """Pixel positions of the points (x by index, y in 0..1), as line_plot draws them."""
    inner_w, inner_h = width - 2 * MARGIN, height - 2 * MARGIN
    out = []
    for i, y in enumerate(ys):
        px = MARGIN + (inner_w * i // (n - 1) if n > 1 else inner_w // 2)
        py = height - MARGIN - round(inner_h * min(max(y, 0.0), 1.0))
        out.append((px, py))
    return out


def line_plot(ys: Sequence[float], width: int = 480, height: int = 320) -> bytes:
    if not ys:
        raise ValueError("nothing to plot")
    r = Raster(width, height)
    left, bottom, top, right = MARGIN, height - MARGIN, MARGIN, width - MARGIN
    for k in range(11):  # y grid and ticks every 10 %
        y = bottom - round((bottom - top) * k / 10)
        if k:
            r.line(left + 1, y, right, y, GREY)
        r.line(left - 6, y, left - 1, y, BLACK)
    pts = points(len(ys), ys, width, height)
    for px, _ in pts:  # x ticks at every size
        r.line(px, bottom + 1, px, bottom + 6, BLACK)
    r.line(left, top, left, bottom, BLACK)  # axes
    r.line(left, bottom, right, bottom, BLACK)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        r.line(x0, y0, x1, y1, BLUE, width=2)
    for px, py in pts:
        for dx in range(-3, 4):
            for dy in range(-3, 4):
                r.set(px + dx, py + dy, BLUE)
    return r.png()
