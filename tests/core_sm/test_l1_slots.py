"""core_sm decides L1's slot size (mpcache.core_sm.l1_slots); the index is cut only empty."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.effects import CarveL1, ErrorReply, Reply
from mpcache.core_sm.errors import ErrorKind
from mpcache.core_sm.l1_index import L1Index, ReleaseReason
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


# ------------------------------------------------------------------ the pure plan of a registration's cut

_OBJECT_STATES = st.lists(st.sampled_from(["absent", "writing", "ready", "leased", "quarantined"]), max_size=4)


@settings(max_examples=300, deadline=None)
@given(_OBJECT_STATES, st.booleans(), st.booleans(), st.integers(-1, 12), st.integers(0, 2))
def test_can_recarve_says_what_clear_then_recarve_does(objects: list[str], pin_free_slot: bool, drop_ready: bool,
                                                       num_slots: int, slot_bytes: int) -> None:
    """``L1Index.can_recarve`` (which a registration's guard reads before anything changes)
    answers what ``clear(False)`` (when ``drop_ready``) then ``recarve`` do, over objects ready,
    being written, leased, dropped while their slot is pinned (quarantined), and a pinned free
    slot."""
    index = L1Index(6, 64)
    for n, state in enumerate(objects):
        key = ObjectKey(bytes([n]) * 32, 0)
        slot = index.reserve_write(key, "w", 64, 0.0)
        assert slot is not None
        if state == "quarantined":  # dropped while an effect still reads its slot
            index.pin_slot(slot)
            index.abort_write(key, "w", 0.0)
        elif state == "absent":
            index.abort_write(key, "w", 0.0)
        elif state != "writing":
            index.finish_write(key, "w", 0.0)
            if state == "leased":
                index.lease_read(key, ("reader", n), 1, 0.0)
    if pin_free_slot:
        index.pin_slot(5)
    said = index.can_recarve(num_slots, slot_bytes * 64, drop_ready=drop_ready)
    acted = copy.deepcopy(index)
    if drop_ready:
        acted.clear(False)
    assert said == acted.recarve(num_slots, slot_bytes * 64)
    assert index.num_slots == 6  # it changed nothing


def test_a_registration_refused_too_large_still_drops_what_its_cut_would_drop() -> None:
    """The plan and the act of a registration's cut: an object larger than the slots drops the
    ready, unleased objects first (``SlotFit.plan.drop_ready``); when something leased stays, L1
    is not cut and the registration is refused TOO_LARGE -- with the ready objects dropped."""
    server = LookupServer(ServerConfig(num_slots=8, slot_bytes=MiB, l1_bytes=8 * MiB, slot_align=4096))
    index = server.ctx.index
    ready, leased = ObjectKey(b"r" * 32, 0), ObjectKey(b"l" * 32, 0)
    for key in (ready, leased):
        index.reserve_write(key, "w", MiB, 0.0)
        index.finish_write(key, "w", 0.0)
    index.lease_read(leased, "reader", 1, 0.0)
    fit = server.instances._slot_fit(RegisterInstance(1, "m", 1, 2 * MiB, True))
    assert fit is not None and fit.plan.drop_ready and not fit.cuts and fit.slot_bytes == MiB
    assert index.is_readable(ready)  # the plan changed nothing
    out = server.handle(RegisterInstance(1, "m", 1, 2 * MiB, True, reply_to=("c", 1)), 0.0)
    assert [type(e) for e in out] == [ErrorReply] and out[0].error.kind is ErrorKind.TOO_LARGE
    assert not index.is_readable(ready) and index.is_readable(leased) and index.slot_bytes == MiB
    index.release_owner("reader", ReleaseReason.FREE, 0.0)
    out = server.handle(RegisterInstance(1, "m", 1, 2 * MiB, True, reply_to=("c", 2)), 0.0)
    assert [type(e) for e in out] == [CarveL1, Reply] and index.slot_bytes == 2 * MiB
