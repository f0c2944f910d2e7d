"""Shrunk failing worlds, saved by `mpcache-sim shrink --save`, replayed on every CI run."""
from __future__ import annotations

from pathlib import Path

import pytest

from mpcache.sim.corpus import entries, from_json
from mpcache.sim.runner import run_scenario

CORPUS = entries()


def test_corpus_is_not_empty() -> None:
    assert len(CORPUS) >= 4


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_corpus_entry_still_caught_and_default_immune(path: Path) -> None:
    scenario, profile, code = from_json(path.read_text())
    legacy, _ = run_scenario(scenario, profile)
    assert legacy.violation is not None and legacy.violation.code == code, legacy.violation
    fixed, _ = run_scenario(scenario, "default")
    assert fixed.violation is None, fixed.violation.reason()
