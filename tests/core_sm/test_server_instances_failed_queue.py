"""``InstanceFailed`` reaches core_sm through the runtime's completion queue, so the engine may
register the same instance id again before it is handled. That new registration is not the one
the runtime failed: it must stay (the event is stale for it)."""
from __future__ import annotations

from mpcache.core_sm.errors import ErrorKind
from mpcache.core_sm.messages import InstanceFailed, Store, StoreResult
from sm_helpers import ServerHarness, key, tokens


def test_a_registration_made_while_the_failure_was_queued_is_kept() -> None:
    h = ServerHarness(num_slots=16)
    h.now = 10.0
    h.register(1)
    h.now = 11.0
    failed = InstanceFailed(1, "event never fired", failed_at=h.now)  # posted; not handled yet
    h.now = 11.5
    h.register(1)  # the engine registers again before the loop drains the queue
    h.now = 12.0
    h.feed(failed)
    s = h.server.stats()
    assert s["instances"] == 1 and s["instances_failed"] == 0 and s["stale_events"] >= 1
    assert h.server.instances.state(1).value == "registered"
    assert h.store(tokens(2, seed=1)) == StoreResult(True, 2, 0)  # the new registration serves


def test_a_failure_after_the_registration_still_releases_it() -> None:
    h = ServerHarness(num_slots=16)
    h.now = 10.0
    h.register(1)
    h.now = 11.0
    h.feed(InstanceFailed(1, "event never fired", failed_at=10.5))
    assert h.server.stats()["instances_failed"] == 1
    assert h.error_kind(h.send(Store(key("s", tokens(1, seed=4), worker_id=0), 1))) is ErrorKind.NOT_REGISTERED


def test_a_failure_with_no_time_fails_whichever_registration_holds_the_id() -> None:
    h = ServerHarness(num_slots=16)
    h.register(1)
    h.now = 5.0
    h.register(1)
    h.feed(InstanceFailed(1))
    assert h.server.stats()["instances_failed"] == 1 and h.server.instances.state(1).value == "absent"
