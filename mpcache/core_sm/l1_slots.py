"""How big L1's slots are: they follow the objects registered.

L1 is a pool of fixed-size slots, one object per slot, so it holds at most ``num_slots``
objects whatever their size: 32 MiB slots for 3 MiB objects leave nine tenths of L1 unused.
Unless the operator fixed the size (``--slot-mb``: ``ServerConfig.l1_bytes == 0``), L1's slot
size follows the registrations; ``slot_plan`` is the whole rule:

* A registration whose object size is not L1's slot size, made while no *other* instance is
  registered, cuts L1 again into slots of its object size (rounded up to ``slot_align``): the
  first registration sets the size, and a server whose only engine comes back with another
  model follows it.
* Every slot id changes meaning when L1 is cut again, so it happens only while L1 holds
  nothing. Larger objects than the slots first drop the ready objects nobody leases (the
  previous model's: nobody runs it any more, and its objects could not be served anyway);
  smaller objects never drop a cache to gain room, they wait for an empty L1.
* While other instances are registered the size stays (their transfers address the slots);
  a registration whose objects do not fit is refused ``TOO_LARGE`` (engines of several sizes
  on one server: fix the size with ``--slot-mb`` for the largest).
"""
from __future__ import annotations

import attrs


@attrs.frozen
class SlotPlan:
    """Cut L1 into ``num_slots`` slots of ``slot_bytes``; ``drop_ready`` first drops the ready,
    unleased objects (L1 must hold nothing to be cut)."""

    slot_bytes: int
    num_slots: int
    drop_ready: bool


@attrs.frozen
class SlotFit:
    """What one registration does to L1's slots, known before anything changes: the cut its
    objects ask for (``plan``), whether it takes (``cuts``: L1 holds nothing by then, the ready
    unleased objects dropped first when ``plan.drop_ready``), and L1's slot size after
    (``slot_bytes``: the plan's when it cuts, else the current one)."""

    plan: SlotPlan
    cuts: bool
    slot_bytes: int


def slot_bytes_for(object_bytes: int, align: int) -> int:
    """The slot an object of ``object_bytes`` needs: rounded up to ``align`` (a page, so a slot
    never shares a page with its neighbour)."""
    align = max(1, align)
    return -(-object_bytes // align) * align


def slot_plan(object_bytes: int, *, l1_bytes: int, align: int, slot_bytes: int,
              others_registered: bool) -> SlotPlan | None:
    """What a registration of ``object_bytes`` objects does to L1's slots (currently
    ``slot_bytes``), or None when they stay as they are. ``l1_bytes`` 0: the size is fixed."""
    if l1_bytes <= 0 or object_bytes <= 0 or others_registered:
        return None
    wanted = slot_bytes_for(object_bytes, align)
    if wanted == slot_bytes or wanted > l1_bytes:
        return None
    return SlotPlan(wanted, l1_bytes // wanted, drop_ready=wanted > slot_bytes)
