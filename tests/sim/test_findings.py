"""Races the simulator found in production core_sm, kept as reduced worlds (tests/sim/findings/).

Each race is fixed in core_sm (docs/core_sm.md, "Copy races"), so each world must run clean:
these are their regression tests. Any violation on these worlds fails the test.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from mpcache.sim.corpus import from_json
from mpcache.sim.runner import run_scenario

FINDINGS = Path(__file__).parent / "findings"

WHY = {
    "late-store-after-error": (
        "a STORE is answered with an error (instance not registered yet), the client settles the op "
        "and vLLM frees the blocks; a duplicate of the same STORE arrives after registration and "
        "the server copies from the freed blocks (no idempotency key / fence on transfers)"),
    "late-retrieve-after-abandon": (
        "a RETRIEVE is delivered (again) after the client settled it and the request finished; the "
        "server starts a copy that writes into blocks vLLM has already freed"),
}


@pytest.mark.parametrize("name", sorted(WHY))
def test_known_core_sm_race(name: str) -> None:
    scenario, profile, code = from_json((FINDINGS / f"{name}.json").read_text())
    result, _ = run_scenario(scenario, profile)
    # Fixed in core_sm (docs/core_sm.md, "Copy races"): the world must run clean.
    assert result.violation is None, f"{WHY[name]}: {result.violation.reason()}"
