"""docs/benchmarks.md opens with an index: per benchmark, the section holding its latest table and
the earlier ones. The notebook below it is only ever appended to, so the index is what a reader
finds the current numbers by: every section must be listed in it and every link must land."""
from __future__ import annotations

import pathlib
import re

DOC = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
INDEX = "Current results, per benchmark"


def headings(text: str) -> list[tuple[int, str, str]]:
    """(level, title, GitHub anchor) of every heading outside code fences."""
    out, seen, fence = [], dict[str, int](), False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        m = re.match(r"(#{1,6}) (.*)", line)
        if m and not fence:
            anchor = re.sub(r"[^\w\- ]", "", m.group(2).strip().lower()).replace(" ", "-")
            n = seen.get(anchor, 0)
            seen[anchor] = n + 1
            out.append((len(m.group(1)), m.group(2), anchor if n == 0 else f"{anchor}-{n}"))
    return out


def index_rows() -> list[str]:
    body = DOC.split(f"## {INDEX}\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in body.splitlines() if line.startswith("| ") and not line.startswith("| benchmark |")]


def test_the_index_comes_first() -> None:
    sections = [title for level, title, _ in headings(DOC) if level == 2]
    assert sections[0] == INDEX


def test_every_section_is_in_the_index_and_every_link_lands() -> None:
    heads = headings(DOC)
    anchors = {anchor for _, _, anchor in heads}
    rows = index_rows()
    assert len(rows) >= 15
    linked = {target for row in rows for target in re.findall(r"\]\(#([^)]+)\)", row)}
    assert linked <= anchors, sorted(linked - anchors)
    missing = [title for level, title, anchor in heads if level == 2 and title != INDEX and anchor not in linked]
    assert missing == [], f"sections not in the index of docs/benchmarks.md: {missing}"
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 4 and re.search(r"\]\(#", cells[2]), row  # a latest table per benchmark
