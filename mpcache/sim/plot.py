"""Writing the simulator's pictures: matplotlib, an optional extra (`pip install 'mpcache[plot]'`).

The format is the file's suffix: `.png`, `.svg` or `.pdf`; any other suffix is refused before
anything runs (`output_path`, an argparse type). `pyplot()` imports matplotlib on its headless
backend, or raises `MatplotlibMissing` whose message is the one line to print. SVG keeps its
text as text (searchable, selectable), not as glyph outlines.
"""
from __future__ import annotations

import argparse
import importlib.util
import textwrap
from pathlib import Path
from typing import Any

FORMATS = (".png", ".svg", ".pdf")
INSTALL = "pip install 'mpcache[plot]'"


class MatplotlibMissing(RuntimeError):
    """matplotlib is not installed; str(self) says what to install, in one line."""


def check_format(path: str) -> str:
    """The format `path`'s suffix names (png, svg, pdf); ValueError for any other suffix."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"cannot write {path!r}: the format is the file's suffix, one of {', '.join(FORMATS)}"
                         + (f", not {suffix}" if suffix else ""))
    return suffix[1:]


def output_path(text: str) -> str:
    """argparse type for a picture's file: its suffix must be one we write."""
    try:
        check_format(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def require(path: str) -> None:
    """Raise MatplotlibMissing now, before a long run, when `path` cannot be drawn."""
    if importlib.util.find_spec("matplotlib") is None:
        raise MatplotlibMissing(f"drawing {path} needs matplotlib, which is not installed: {INSTALL}")


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    try:
        import matplotlib
    except ImportError:
        raise MatplotlibMissing(f"drawing a picture needs matplotlib, which is not installed: {INSTALL}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def wrap(text: str, width: int) -> str:
    """`text` broken into lines of at most `width` characters (a long word is broken too)."""
    return "\n".join(textwrap.wrap(text, width, break_on_hyphens=False)) or text


def save(fig: Any, path: str) -> None:
    """Write `fig` in the format `path`'s suffix names, then free it."""
    fmt = check_format(path)
    plt = pyplot()
    try:
        with plt.rc_context({"svg.fonttype": "none"}):
            fig.savefig(path, format=fmt, bbox_inches="tight", dpi=120)
    finally:
        plt.close(fig)
