"""``mpcache-sim sweep`` of a trace recorded on a server whose L1 slots follow the objects
registered (no ``--slot-mb``): each swept size is cut for the same objects, not for the
recorded L1's bytes."""

from __future__ import annotations

from mpcache.core_sm.messages import RegisterInstance
from mpcache.core_sm.server_core import ServerConfig
from mpcache.core_sm.trace import TraceCodec, header
from mpcache.sim.sweep import run_size

MiB = 1 << 20


def test_each_size_is_cut_for_the_registered_objects() -> None:
    recorded = ServerConfig(num_slots=8, slot_bytes=32 * MiB, l1_bytes=256 * MiB)
    head = header(recorded, False)
    records = [(0.0, TraceCodec().encode(RegisterInstance(1, "m", 1, 3 * MiB, True, reply_to=("c", 1))), [])]
    row = run_size(head, records, 1.0)
    assert row.num_slots == (1 << 30) // (3 * MiB) and not row.violations
