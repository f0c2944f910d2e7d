"""Races the simulator found in production core_sm, kept as reduced worlds (tests/sim/findings/).

While the race is present the test is reported as xfail (with the race explained); once core_sm
is fixed the same world must run clean, so the test becomes its regression test. Any other
violation on these worlds fails the test.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from sim.corpus import from_json
from sim.runner import run_scenario

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
    if result.violation is not None and result.violation.code == code:
        pytest.xfail(f"core_sm race still present ({code}): {WHY[name]}")
    assert result.violation is None, result.violation.reason()
