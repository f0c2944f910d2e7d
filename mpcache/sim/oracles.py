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
    "F13": "missed restart (a live engine never registered again with a restarted server)",
    "F19": "live instance reaped (its heartbeats reached the server, or it was never registered again)",
    "F16": "double completion, or a copy into blocks already freed",
    "F20": "load on expired leases (a hit's read leases lapsed while its request waited in the queue)",
    "F21": "load on spent leases (a request's one lookup planned for a second load)",
    "F22": "tenant harmed (another peer's request changed an honest tenant's state)",
    "F23": "copy through another peer's registration (the transfer engine acted before core_sm decided)",
    "F24": "partial restore (a hit reported while a KV-cache group lacks a chunk it needs)",
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


# Races in production core_sm the simulator has found and that are not fixed yet, as (code,
# message fragment). `mpcache-sim run` marks seeds that hit them; the CI seed test and the
# Hypothesis properties list them as known instead of failing, and fail on anything else. Add an
# entry only together with its reduced world in tests/sim/findings/; remove it when core_sm is
# fixed (docs/simulator.md, "Findings so far").
KNOWN_CORE_SM_RACES: tuple[tuple[str, str], ...] = ()


def is_known_race(violation: Violation | None) -> bool:
    return violation is not None and any(
        violation.code == code and text in violation.message for code, text in KNOWN_CORE_SM_RACES)
