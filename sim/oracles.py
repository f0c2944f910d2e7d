"""Violations and the names of the failures they show.

Every oracle failure is a `Violation` whose `code` names the failure mode of
`reference/lmcache_mp.md` §F it is an instance of (F1 poll-forever, F2 silent miss, ...), or
`SAFETY`/`DEADLOCK`/`CRASH` for failures outside that list. The code is derived from the
*symptom* the oracle saw, never from the profile that was running.
"""
from __future__ import annotations

import attrs

# code -> short name, printed in summaries.
FAILURES: dict[str, str] = {
    "F1": "poll-forever (a lookup never resolves)",
    "F2": "silent miss (a hit the server answered was lost by the client)",
    "F4": "duplicate lookup leased twice",
    "F5": "status query overtook its lookup",
    "F8": "read lease leaked past its request",
    "F9": "over-release (another request's lease released)",
    "F10": "corrupt KV (data read back differs from data stored)",
    "F11": "missing or double reply",
    "F12": "unbounded bookkeeping (abandoned state never reclaimed)",
    "F16": "double completion, or a copy into blocks already freed",
    "HIT": "hit reported for data never stored",
    "LIVENESS": "request did not finish after heal",
    "DEADLOCK": "world idle with no deadline",
    "SAFETY": "core_sm invariant broken",
    "CRASH": "exception in the world",
}


@attrs.frozen
class Violation:
    code: str
    t: float
    node: str
    message: str

    def reason(self) -> str:
        return f"{self.code} {FAILURES.get(self.code, '')}: {self.message}"


class ViolationFound(Exception):
    """Raised inside the world to stop a run at the first violation."""

    def __init__(self, violation: Violation) -> None:
        super().__init__(violation.reason())
        self.violation = violation


# Races in production core_sm the simulator has found and reported (docs/simulator.md, "Findings
# so far"; reduced worlds in tests/sim/findings/). `mpcache-sim run` marks seeds that hit them;
# the CI seed test lists them as known instead of failing, and fails on anything else. Remove an
# entry once core_sm is fixed.
KNOWN_CORE_SM_RACES: tuple[tuple[str, str], ...] = (
    ("F10", "after vLLM freed it"),  # a STORE copy reads blocks its request no longer holds
    ("F16", "after vLLM freed it"),  # a RETRIEVE copy writes blocks its request no longer holds
    ("F10", "meanwhile given to"),  # an L2 read/write or copy outlived its slot reservation
    ("F10", "after a load reported good holds"),  # data-level consequence of the above
    ("F10", "carries data that was never stored"),  # same, seen at the L2 write
)


def is_known_race(violation: Violation | None) -> bool:
    return violation is not None and any(
        violation.code == code and text in violation.message for code, text in KNOWN_CORE_SM_RACES)
