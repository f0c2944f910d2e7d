"""The connector's shells hand their machine the events the links queued *before* a caller's
event: a worker whose link saw the server come back (or go down) before vLLM submitted a step's
loads must decide those loads on that view. Fed later, a synchronous load after a server restart
failed at once (the machine still thought the server down) and vLLM recomputed the blocks; the
recording tool's restart stretch (tools/record_production.py, ``f``) found it."""
from __future__ import annotations

from typing import Any

from mpcache.core_sm.messages import ServerEpoch, ServerHealth
from mpcache.runtime_zmq.adapters import _MachineShell


class _Links:
    def __init__(self, queued: list[object]) -> None:
        self.queued = queued

    def drain(self, wait: float = 0.0) -> list[object]:
        out, self.queued = self.queued, []
        return out


class _Machine:
    def __init__(self) -> None:
        self.seen: list[object] = []

    def handle(self, event: object, now: float) -> list[Any]:
        self.seen.append(event)
        return []

    def next_deadline(self) -> float | None:
        return None


def test_queued_link_events_reach_the_machine_before_the_callers_event() -> None:
    machine = _Machine()
    back = [ServerEpoch(0, 7), ServerHealth(0, True)]
    shell = _MachineShell(_Links(list(back)), machine, clock=lambda: 1.0)  # type: ignore[arg-type]
    submit = object()  # a caller's event (SubmitRetrieve, MatchRequest, ...)
    shell._handle(submit)
    assert machine.seen == [*back, submit]
    shell._handle(submit)  # nothing queued: the event alone
    assert machine.seen == [*back, submit, submit]
