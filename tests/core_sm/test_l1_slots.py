"""core_sm decides L1's slot size (mpcache.core_sm.l1_slots); the index is cut only empty."""

from __future__ import annotations

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.effects import CarveL1, Reply
from mpcache.core_sm.l1_index import L1Index
from mpcache.core_sm.l1_slots import SlotPlan, slot_plan
from mpcache.core_sm.messages import RegisterInstance
from mpcache.core_sm.server import LookupServer
from mpcache.core_sm.server_core import ServerConfig

MiB = 1 << 20


def test_slot_plan_rule() -> None:
    kw = dict(l1_bytes=256 * MiB, align=4096, slot_bytes=32 * MiB)
    assert slot_plan(3 * MiB, others_registered=False, **kw) == SlotPlan(3 * MiB, 85, drop_ready=False)
    assert slot_plan(3 * MiB + 1, others_registered=False, **kw) == SlotPlan(3 * MiB + 4096, 85, drop_ready=False)
    assert slot_plan(40 * MiB, others_registered=False, **kw) == SlotPlan(40 * MiB, 6, drop_ready=True)
    assert slot_plan(3 * MiB, others_registered=True, **kw) is None  # their transfers use the slots
    assert slot_plan(32 * MiB, others_registered=False, **kw) is None  # already so
    assert slot_plan(0, others_registered=False, **kw) is None  # size unknown
    assert slot_plan(512 * MiB, others_registered=False, **kw) is None  # not one slot in L1
    assert slot_plan(3 * MiB, others_registered=False, l1_bytes=0, align=4096, slot_bytes=32 * MiB) is None  # fixed


def test_index_is_cut_only_when_it_holds_nothing() -> None:
    index = L1Index(8, 32 * MiB)
    key = ObjectKey(b"h" * 32, 0)
    assert index.reserve_write(key, "w", MiB, 0.0) is not None
    assert not index.recarve(85, 3 * MiB)
    index.abort_write(key, "w", 0.0)
    index.pin_slot(0)
    assert not index.recarve(85, 3 * MiB)
    index.unpin_slot(0)
    assert index.recarve(85, 3 * MiB)
    assert (index.num_slots, index.slot_bytes, index.stats()["free_slots"]) == (85, 3 * MiB, 85)
    index.check_invariants()


def test_first_registration_carves_l1_before_its_reply() -> None:
    server = LookupServer(ServerConfig(num_slots=8, slot_bytes=32 * MiB, l1_bytes=256 * MiB))
    out = server.handle(RegisterInstance(1, "m", 1, 3 * MiB, True, reply_to=("c", 1)), 0.0)
    assert [type(e) for e in out] == [CarveL1, Reply]
    assert out[0] == CarveL1(3 * MiB, 85)
    assert server.ctx.index.num_slots == 85
    # a second instance of the same size changes nothing; fixed slots (l1_bytes 0) never change
    assert [type(e) for e in server.handle(RegisterInstance(2, "m", 1, 3 * MiB, True, reply_to=("c", 2)), 0.0)] == [Reply]
    fixed = LookupServer(ServerConfig(num_slots=8, slot_bytes=32 * MiB))
    assert [type(e) for e in fixed.handle(RegisterInstance(1, "m", 1, 3 * MiB, True, reply_to=("c", 1)), 0.0)] == [Reply]
