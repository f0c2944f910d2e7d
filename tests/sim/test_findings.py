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
    "late-store-after-abandon": (
        "TransferClient fails a server-driven STORE when the server turns unhealthy and reports the "
        "request in `sending`, so vLLM frees its blocks; the delayed STORE still reaches the server "
        "later, which copies the reused blocks into L1 (and L2) under the old keys"),
    "duplicate-store-early-reply": (
        "a duplicated STORE finds every chunk being written by the original one and is answered at "
        "once; the client takes that reply as completion and frees the blocks while the original "
        "copy still reads them"),
    "late-l2-read-into-reused-slot": (
        "an L2 read outlives its slot reservation (write-lease expiry; a forced CLEAR does the same "
        "to in-flight L2 writes and copies): the server gives the slot to another object and the "
        "late read lands in it"),
}


@pytest.mark.parametrize("name", sorted(WHY))
def test_known_core_sm_race(name: str) -> None:
    scenario, profile, code = from_json((FINDINGS / f"{name}.json").read_text())
    result, _ = run_scenario(scenario, profile)
    if result.violation is not None and result.violation.code == code:
        pytest.xfail(f"core_sm race still present ({code}): {WHY[name]}")
    assert result.violation is None, result.violation.reason()
