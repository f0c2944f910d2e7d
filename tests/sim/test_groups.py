"""KV-cache groups in the simulator (sim/groups.py): worlds draw several groups, each group's chunks
are stored and go missing on their own, the honest client resumes where every group is whole
(core_sm.kv_groups.resume_point), and F24 catches a hit reported while a group lacks a chunk."""
from __future__ import annotations

import attrs
import pytest

import mpcache.sim.scenario as scenario_module

from mpcache.core_sm.kv_groups import GroupKind, KVGroup
from mpcache.sim.groups import group_resume_point, partial_restore
from mpcache.sim.oracles import FAILURES
from mpcache.sim.profiles import PROFILES
from mpcache.sim.runner import run_scenario, run_seed
from mpcache.sim.scenario import draw_scenario

C = 8
FULL = KVGroup(GroupKind.FULL, 4)
SWA = KVGroup(GroupKind.SLIDING_WINDOW, 4, window=C)
MAMBA = KVGroup(GroupKind.RECURRENT, 4)


def test_f24_fires_on_a_hand_built_partial_hit() -> None:
    groups = (FULL, SWA, MAMBA)
    whole = [frozenset(range(4)), frozenset(range(4))]
    assert partial_restore("r", groups, whole, 0, 4 * C, C) is None
    # the window's chunk before the resume point is gone: vLLM must not be told 4 chunks
    finding = partial_restore("r", groups, [frozenset({0, 1, 2}), frozenset(range(4))], 0, 4 * C, C)
    assert finding is not None and finding[0] == "F24" and "group 1" in finding[1] and "[3]" in finding[1]
    # ... but an older chunk outside the window is not needed, nor one vLLM's own cache holds
    assert partial_restore("r", groups, [frozenset({3}), frozenset({3})], 0, 4 * C, C) is None
    assert partial_restore("r", (FULL, KVGroup(GroupKind.FULL, 4)), [frozenset({2, 3})], 2 * C, 4 * C, C) is None
    # the recurrent state of the resume point's chunk is missing
    finding = partial_restore("r", groups, [frozenset(range(4)), frozenset({0, 1, 2})], 0, 4 * C, C)
    assert finding is not None and "group 2" in finding[1]
    # a recurrent state exists only at a chunk's end: resuming inside a chunk is a partial restore
    finding = partial_restore("r", groups, whole, 0, 4 * C - 1, C)
    assert finding is not None and "inside a chunk" in finding[1]
    assert finding[0] in FAILURES and PROFILES["hma-partial-group"].failure == "F24"


def test_the_honest_resume_point_is_where_every_group_is_whole() -> None:
    groups = (FULL, SWA, MAMBA)
    # the full group hits 4 chunks; the window lacks chunk 3, the state chunk 1: resume at 2 chunks
    others = [frozenset({0, 1, 2}), frozenset({0, 1, 3})]
    assert group_resume_point(groups, 4 * C, others, 4 * C, C) == 2 * C
    assert partial_restore("r", groups, others, 0, 2 * C, C) is None
    # never past the first group's hit, nor the limit (vLLM computes the last prompt token)
    assert group_resume_point(groups, C, [frozenset(range(4))] * 2, 4 * C, C) == C
    assert group_resume_point(groups, 4 * C, [frozenset(range(4))] * 2, 4 * C - 1, C) == 3 * C


def test_groups_appear_in_the_default_sweeps_worlds() -> None:
    configs = [draw_scenario(s).config for s in range(100)]
    kinds = [tuple(g.kind for g in c.kv_groups) for c in configs]
    assert () in kinds  # one full-attention group, the plain path
    assert (GroupKind.FULL, GroupKind.SLIDING_WINDOW) in kinds
    assert any(GroupKind.RECURRENT in k for k in kinds)
    assert all(not k or k[0] is GroupKind.FULL for k in kinds)
    assert len({g.window for c in configs for g in c.kv_groups if g.kind is GroupKind.SLIDING_WINDOW}) > 3
    assert {c.group_fault_p for c in configs if c.kv_groups} >= {0.0, 0.2, 0.5}


def test_the_groups_are_drawn_from_their_own_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    grouped = [s for s in range(10) if draw_scenario(s).config.kv_groups]
    drawn = {s: draw_scenario(s) for s in grouped}
    monkeypatch.setattr(scenario_module, "GROUPED_SHARE", 0.0)
    for s in grouped:  # without the groups the world is the one it was: the other draws did not move
        plain = draw_scenario(s)
        assert not plain.config.kv_groups
        assert plain == attrs.evolve(drawn[s], config=attrs.evolve(drawn[s].config, kv_groups=(), group_fault_p=0.0))


def test_group_objects_are_stored_lost_and_the_hit_capped_across_seeds() -> None:
    seen: dict[str, int] = {}
    for seed in range(40):
        scenario = draw_scenario(seed)
        if not scenario.config.kv_groups:
            continue
        result, world = run_scenario(scenario)
        assert result.ok, result.violation
        for key, n in world.coverage().items():
            if key.startswith("group_"):
                seen[key] = seen.get(key, 0) + n
    for key in ("group_stores", "group_partial_stores", "group_evictions", "group_capped_hits"):
        assert seen.get(key, 0) > 0, (key, seen)


def test_the_honest_client_passes_where_the_first_groups_hit_is_caught() -> None:
    caught = []
    for seed in range(200):
        r = run_seed(seed, "hma-partial-group")
        if r.violation is not None:
            assert r.violation.code == "F24", r.violation.reason()
            caught.append(seed)
            again = run_seed(seed)  # the same world, the honest client
            assert again.ok, again.violation
            if len(caught) == 2:
                break
    assert len(caught) == 2
