"""``InstanceFailed``: the runtime's GPU engine gave up on an instance (its event never fired);
core_sm releases it as a reap does, counts it, and leaves every other instance alone."""
from __future__ import annotations

from mpcache.core_sm.effects import InstanceReaped, StartTransfer
from mpcache.core_sm.errors import ErrorKind
from mpcache.core_sm.messages import (InstanceFailed, PrepareStore, Retrieve, RetrieveResult, Store, StoreResult,
                              TransferPlan)
from sm_helpers import ServerHarness, key, tokens


def test_a_failed_instance_is_released_like_a_reap_and_others_are_untouched() -> None:
    h = ServerHarness(num_slots=16)
    h.register(1)  # server-driven (GPU)
    h.register(2, engine_driven=True)
    assert h.store(tokens(2, seed=1)) == StoreResult(True, 2, 0)  # instance 1's objects
    # instance 1: a retrieve and a store in flight on the device; instance 2: an open plan
    retrieve = h.send(Retrieve(key("r", tokens(2, seed=1), worker_id=0), 1))
    store = h.send(Store(key("s", tokens(2, seed=2), worker_id=0), 1))
    plan = h.call(PrepareStore(key("p", tokens(1, seed=3), worker_id=0), 2))
    assert isinstance(plan, TransferPlan) and len(h.transfers) == 2
    effects = h.feed(InstanceFailed(1, "event never fired"))
    assert not any(isinstance(e, InstanceReaped) for e in effects)  # the runtime dropped it already
    s = h.server.stats()
    assert s["instances_failed"] == 1 and s["instances"] == 1
    # its requests are refused from now on; it must register again
    assert h.error_kind(h.send(Store(key("s2", tokens(1, seed=4), worker_id=0), 1))) is ErrorKind.NOT_REGISTERED
    # its running copies end as always: by their TransferFinished (the engine reports each)
    assert h.reply(retrieve) is None and h.reply(store) is None
    h.finish_all_transfers(ok=False)
    assert h.result(store) == StoreResult(False, 0, 2)
    assert h.result(retrieve) == RetrieveResult(False, 2)
    assert h.server.stats()["pinned_slots"] == 1  # instance 2's plan only
    # instance 2 (engine-driven, another tenant) goes on as if nothing happened
    assert h.server.transfers.transfers and h.server.instances.state(2).value == "registered"
    # instance 1's stored objects stay readable, charged to no tenant now
    idx = h.server.index
    assert idx.quota.charged(1) == 0 and idx.quota.charged(None) == 2


def test_a_failed_engine_driven_instance_loses_its_open_plans() -> None:
    h = ServerHarness()
    h.register(3, engine_driven=True)
    plan = h.call(PrepareStore(key("p", tokens(2), worker_id=0), 3))
    assert isinstance(plan, TransferPlan)
    h.feed(InstanceFailed(3))
    s = h.server.stats()
    assert s["transfers"] == 0 and s["plans_of_reaped_instances"] == 1 and s["instances_failed"] == 1


def test_an_instance_failed_twice_or_never_registered_is_a_stale_event() -> None:
    h = ServerHarness()
    h.register(1)
    h.feed(InstanceFailed(1))
    before = h.server.stats()["stale_events"]
    assert h.feed(InstanceFailed(1)) == [] and h.feed(InstanceFailed(77)) == []
    s = h.server.stats()
    assert s["stale_events"] == before + 2 and s["instances_failed"] == 1
    h.register(1)  # registering again is allowed, as after a reap
    assert h.store(tokens(1)) == StoreResult(True, 1, 0)
    assert not h.transfers and any(isinstance(e, StartTransfer) for e in h.log)
