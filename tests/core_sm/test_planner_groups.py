"""The planner and vLLM's KV-cache groups (core_sm.kv_groups): one full-attention group is the
plain path; groups this version cannot restore make every request a miss that is neither looked
up (no lease) nor stored: never a partial restore."""

from __future__ import annotations

import pytest

from mpcache.core_sm.kv_groups import GroupKind, KVGroup
from mpcache.core_sm.messages import SubmitLookup, SubmitStore
from mpcache.core_sm.planner import BlocksAllocated, MatchAnswer, ScheduledRequest
from test_planner import BS, C, match, planner, step

FULL = KVGroup(GroupKind.FULL, BS)
SWA = KVGroup(GroupKind.SLIDING_WINDOW, BS, window=2 * C)
MAMBA = KVGroup(GroupKind.RECURRENT, BS)


def test_one_full_attention_group_is_the_plain_path() -> None:
    p, lookups = planner(2 * C, kv_groups=(FULL,))
    tokens = list(range(3 * C))
    assert match(p, tokens) == MatchAnswer("r", 2 * C, True)
    p.handle(BlocksAllocated("r", range(12), 2 * C), 0.0)
    assert len(step(p).retrieves) == 1
    assert step(p, ScheduledRequest("r", 2 * C, C, tuple(range(12)), True)).stores == (
        SubmitStore("r", tokens, 2 * C, 3 * C, range(8, 12)),)


@pytest.mark.parametrize("groups", [(FULL, MAMBA), (FULL, SWA), (SWA,)], ids=["mamba", "swa", "swa-only"])
def test_groups_it_cannot_restore_are_a_miss_with_no_lease_and_no_store(groups: tuple[KVGroup, ...]) -> None:
    p, lookups = planner(2 * C, kv_groups=groups)  # the server would answer a hit
    assert p.unrestorable is not None
    tokens = list(range(3 * C))
    assert match(p, tokens) == MatchAnswer("r", 0, False)
    assert not [e for e in lookups.calls if isinstance(e, SubmitLookup)]  # no lookup: no lease to leak
    p.handle(BlocksAllocated("r", range(12), 0), 0.0)
    plan = step(p, ScheduledRequest("r", 0, 3 * C, tuple(range(12)), True))
    assert plan.retrieves == () and plan.stores == ()
