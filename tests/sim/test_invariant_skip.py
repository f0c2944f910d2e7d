"""The per-event invariant check skips quiet events (``check_invariants_after_event``) and stays
sound: state corrupted after an event is reported at that event's check, or -- corrupted behind
the machine's back after a quiet event -- within ``FULL_CHECK_EVERY`` events."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from mpcache.core_sm import server as server_mod
from mpcache.core_sm.server_core import TransferOwner
from mpcache.core_sm.messages import Ping, TimerFired
from mpcache.core_sm.server import FULL_CHECK_EVERY, LookupServer
from mpcache.sim.runner import run_seed


def _leak_lease(s: LookupServer) -> bool:
    for obj in s.index._objects.values():
        for owner, (count, expiry) in obj.readers.items():
            obj.readers[owner] = (count + 1, expiry)  # a count nobody took
            return True
    return False


def _job_wrong_state(s: LookupServer) -> bool:
    for job in s.jobs.jobs.values():
        if job.hits is not None:
            job.hits = None  # back to pending, with no L2 step
            return True
    return False


def _transfer_counted_twice(s: LookupServer) -> bool:
    for t in s.transfers.transfers.values():
        s.transfers.per_instance[t.instance_id] += 1
        return True
    return False


def _pin_unknown_to_index(s: LookupServer) -> bool:
    if not s.ctx.pins:
        return False
    owner = next(iter(s.ctx.pins))
    used = {o.slot for o in s.index._objects.values()} | set(s.index._pinned)
    free = next((n for n in range(s.index.num_slots) if n not in used), None)
    if free is None or not isinstance(owner, TransferOwner):
        return False
    s.ctx.pins[owner] = (*s.ctx.pins[owner], free)  # a slot pinned that the index does not know
    return True


CORRUPTIONS: dict[str, Callable[[LookupServer], bool]] = {
    "leaked-lease": _leak_lease,
    "job-wrong-state": _job_wrong_state,
    "transfer-counted-twice": _transfer_counted_twice,
    "pin-unknown-to-index": _pin_unknown_to_index,
}
QUIET = (Ping, TimerFired)


def _run_injected(monkeypatch: pytest.MonkeyPatch, corrupt: Callable[[LookupServer], bool],
                  after_quiet: bool, seeds: range = range(6)) -> tuple[Any, list[bool]] | None:
    """Run seeds until ``corrupt`` applies after a (quiet or not) event; returns the result and,
    per check after it, whether that check ran in full."""
    handle = LookupServer.handle
    check = LookupServer.check_invariants_after_event
    state: dict[str, Any] = {"done": False, "checks": []}

    def patched_handle(self: LookupServer, event: Any, now: float) -> list[Any]:
        out = handle(self, event, now)
        if not state["done"] and isinstance(event, QUIET) == after_quiet and corrupt(self):
            state["done"] = True
        return out

    def patched_check(self: LookupServer, full_every: int = FULL_CHECK_EVERY) -> bool:
        if not state["done"]:
            return check(self, full_every)
        skipped = self._clean and self._skipped < full_every
        state["checks"].append(not skipped)
        return check(self, full_every)

    monkeypatch.setattr(LookupServer, "handle", patched_handle)
    monkeypatch.setattr(LookupServer, "check_invariants_after_event", patched_check)
    for seed in seeds:
        state["done"], state["checks"] = False, []
        result = run_seed(seed)
        if state["done"]:
            return result, state["checks"]
    return None


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corruption_after_an_event_is_reported_at_that_event(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    found = _run_injected(monkeypatch, CORRUPTIONS[kind], after_quiet=False)
    assert found is not None, f"no seed gave {kind} a chance"
    result, checks = found
    assert result.violation is not None and result.violation.code == "SAFETY"
    assert "invariant" in result.violation.message
    assert checks[:1] == [True], "the event's own check ran in full and failed"
    assert len(checks) == 1, "reported at the first check after the corruption"


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corruption_behind_a_quiet_event_is_reported_within_the_bound(
        monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    found = _run_injected(monkeypatch, CORRUPTIONS[kind], after_quiet=True)
    assert found is not None, f"no seed gave {kind} a chance"
    result, checks = found
    assert result.violation is not None and result.violation.code == "SAFETY"
    assert "invariant" in result.violation.message
    assert checks[-1] is True and 1 <= len(checks) <= FULL_CHECK_EVERY + 1


def test_quiet_only_when_nothing_moves() -> None:
    """A heartbeat or timer tick is quiet only with nothing due; anything else is checked."""
    s = LookupServer()
    s.check_invariants()
    assert s._clean
    s.handle(TimerFired(), 0.0)
    assert s._clean and not s.check_invariants_after_event()
    for _ in range(FULL_CHECK_EVERY - 1):
        s.handle(Ping(None, reply_to=1), 0.0)
        assert not s.check_invariants_after_event()
    assert s.check_invariants_after_event(), "a full check after FULL_CHECK_EVERY skipped"
    s.run_deferred()
    assert s.check_invariants_after_event(), "run_deferred may have changed the state"
    assert server_mod.FULL_CHECK_EVERY >= 1
