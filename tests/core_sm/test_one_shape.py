"""Every core_sm machine a shell drives has one shape: ``handle(event, now) -> list`` of effects,
``next_deadline() -> float | None`` (when to feed it a ``TimerFired``) and ``stats() -> dict``.
The server, the connector's shells, the simulator and the explorer drive them all the same way;
a machine that grew another entry point (a third argument, a separate timer call) fails here."""
from __future__ import annotations

import inspect
import typing

import pytest

from mpcache.core_sm.health import HealthMonitor
from mpcache.core_sm.lookup_client import LookupClient
from mpcache.core_sm.planner import StepPlanner
from mpcache.core_sm.server import LookupServer
from mpcache.core_sm.server_link import ServerLink
from mpcache.core_sm.transfer_client import TransferClient

MACHINES = [LookupServer, LookupClient, TransferClient, StepPlanner, HealthMonitor, ServerLink]


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.__name__)
def test_a_machine_is_driven_by_handle_event_now_and_its_next_deadline(machine: type) -> None:
    handle = inspect.signature(machine.handle)
    assert list(handle.parameters) == ["self", "event", "now"], handle
    hints = typing.get_type_hints(machine.handle)
    assert hints["now"] is float
    assert typing.get_origin(hints["return"]) is list, hints["return"]
    deadline = inspect.signature(machine.next_deadline)
    assert list(deadline.parameters) == ["self"]
    assert typing.get_type_hints(machine.next_deadline)["return"] == typing.Optional[float]
    stats = inspect.signature(machine.stats)
    assert list(stats.parameters) == ["self"]
    assert typing.get_origin(typing.get_type_hints(machine.stats)["return"]) is dict
    # no other public entry point that takes an event
    for name, member in inspect.getmembers(machine, inspect.isfunction):
        if name.startswith("_") or name == "handle":
            continue
        assert "event" not in inspect.signature(member).parameters, f"{machine.__name__}.{name} takes an event"
