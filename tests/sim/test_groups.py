"""KV-cache groups in the simulator: worlds draw several groups, the engine runs production's
planner with them (one object per chunk holding every group, each op carrying every group's
blocks), the scheduler model keeps a table per group, and F24 catches a load that leaves a block
vLLM reads in some group without that group's data, or a hit an unrestorable engine reports."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

import mpcache.core_sm.planner as planner_module
import mpcache.sim.scenario as scenario_module

from mpcache.core_sm.kv_groups import GroupKind, KVGroup, unrestorable
from mpcache.core_sm.planner import ScheduledRequest, StepPlan
from mpcache.sim.corpus import from_json
from mpcache.sim.groups import blocks_read, partial_restore, unrestorable_hit
from mpcache.sim.oracles import FAILURES, is_known_race
from mpcache.sim.profiles import PROFILES
from mpcache.sim.runner import run_scenario, run_seed
from mpcache.sim.scenario import draw_scenario
from mpcache.sim.vllm_scheduler import NULL_BLOCK, Admission, QueuedRequest, SchedulerModel
from mpcache.sim.world import SERVER

C = 8
FULL = KVGroup(GroupKind.FULL, 4)
SWA = KVGroup(GroupKind.SLIDING_WINDOW, 4, window=C)
MAMBA = KVGroup(GroupKind.RECURRENT, 4)
FINDING = Path(__file__).parent / "findings" / "hma-window-resume-mid-chunk.json"


def test_f24_judges_every_block_vllm_reads_in_the_groups_after_the_first() -> None:
    groups = (FULL, SWA)
    # 4 chunks of 2 blocks; the window (8 tokens) resuming at 32 reads tokens 25..31: blocks 6, 7
    tables = [list(range(10, 18)), [NULL_BLOCK] * 6 + [26, 27]]
    assert blocks_read(SWA, tables[1], 4 * C, C, 4, NULL_BLOCK) == [6, 7]
    assert blocks_read(FULL, tables[0], 4 * C, C, 4, NULL_BLOCK) == list(range(8))
    assert partial_restore("r", groups, tables, 4 * C, C, 4, NULL_BLOCK, lambda g, i: None) is None
    finding = partial_restore("r", groups, tables, 4 * C, C, 4, NULL_BLOCK, lambda g, i: "stale" if i == 7 else None)
    assert finding is not None and finding[0] == "F24" and "group 1" in finding[1] and "block 7" in finding[1]
    assert finding[0] in FAILURES and PROFILES["hma-partial-group"].failure == "F24"
    # the first group's blocks are F10's; a null block is never read
    assert partial_restore("r", groups, tables, 4 * C, C, 4, NULL_BLOCK,
                           lambda g, i: "stale" if g == 0 or i < 6 else None) is None


def test_f24_catches_a_hit_of_an_engine_whose_groups_cannot_be_restored() -> None:
    assert unrestorable_hit("r", (FULL, SWA), True, 8) is None
    assert unrestorable_hit("r", (FULL, SWA, MAMBA), True, 0) is None
    for groups, cpu in (((FULL, MAMBA), True), ((FULL, SWA), False)):
        finding = unrestorable_hit("r", groups, cpu, 8)
        assert finding is not None and finding[0] == "F24"


class Recorder:
    def __init__(self, answer: tuple[int | None, bool]) -> None:
        self.answer = answer
        self.allocs: list[tuple[Any, ...]] = []
        self.plans: list[tuple[ScheduledRequest, ...]] = []

    def get_num_new_matched_tokens(self, request_id: str, token_ids: Any, num_prompt_tokens: int,
                                   num_computed_tokens: int, *args: Any, **kwargs: Any) -> tuple[int | None, bool]:
        return self.answer

    def update_state_after_alloc(self, request_id: str, block_ids: Any, num_external_tokens: int,
                                 other_group_block_ids: Any = ()) -> None:
        self.allocs.append((tuple(block_ids), num_external_tokens, tuple(tuple(g) for g in other_group_block_ids)))

    def build_plan(self, scheduled: Any, preempted: Any = ()) -> StepPlan:
        self.plans.append(tuple(scheduled))
        return StepPlan()

    def request_finished(self, request_id: str) -> bool:
        return True


def test_the_scheduler_model_keeps_a_table_per_group_with_a_windows_dropped_blocks_null() -> None:
    connector = Recorder((12, True))  # an async load of 12 tokens past the engine's 4
    window = KVGroup(GroupKind.SLIDING_WINDOW, 4, window=5)
    m = SchedulerModel(connector, 4, 32, kv_groups=(FULL, window))
    req = m.add(QueuedRequest("a", list(range(1, 21)), apc_blocks=1))
    assert m.admit(req) is Admission.LOADING and req.computed == 16
    # the window of token 16 reads tokens 12..16: blocks 0..2 are dropped (vLLM's null block)
    assert req.group_blocks[0][:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in req.group_blocks[0][3:]
    assert NULL_BLOCK not in req.blocks and len(req.blocks) == len(req.group_blocks[0]) == 5
    assert m.blocks_in_use() == 5 + 2
    assert connector.allocs[-1] == (tuple(req.blocks[:4]), 12, (tuple(req.group_blocks[0][:4]),))
    m.load_landed(req)
    assert connector.allocs[-1] == (tuple(req.blocks), 0, (tuple(req.group_blocks[0]),))
    m.schedule_prefill(req)
    m.end_step()
    assert connector.plans[-1] == (ScheduledRequest("a", 16, 4, tuple(req.blocks), True,
                                                    (tuple(req.group_blocks[0]),)),)
    m.preempt(req)
    assert m.blocks_in_use() == 0 and req.group_blocks == []


def test_groups_appear_in_the_default_sweeps_worlds() -> None:
    configs = [draw_scenario(s).config for s in range(100)]
    kinds = [tuple(g.kind for g in c.kv_groups) for c in configs]
    assert () in kinds  # one full-attention group, the plain path
    assert (GroupKind.FULL, GroupKind.SLIDING_WINDOW) in kinds
    assert (GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.SLIDING_WINDOW) in kinds
    assert any(GroupKind.RECURRENT in k for k in kinds)
    assert all(not k or k[0] is GroupKind.FULL for k in kinds)
    assert len({g.window for c in configs for g in c.kv_groups if g.kind is GroupKind.SLIDING_WINDOW}) > 3
    assert {c.cpu_engine for c in configs if c.kv_groups} == {True, False}


def test_the_groups_are_drawn_from_their_own_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    grouped = [s for s in range(10) if draw_scenario(s).config.kv_groups]
    drawn = {s: draw_scenario(s) for s in grouped}
    monkeypatch.setattr(scenario_module, "GROUPED_SHARE", 0.0)
    for s in grouped:  # without the groups the world is the one it was: the other draws did not move
        plain = draw_scenario(s)
        assert not plain.config.kv_groups
        assert plain == attrs.evolve(drawn[s], config=attrs.evolve(drawn[s].config, kv_groups=(), cpu_engine=False))


def _planner_stats(world: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for engine in world.engines:
        if engine.sched is not None:
            for k, v in engine.planner().stats().items():
                total[k] = total.get(k, 0) + v
    return total


def test_grouped_worlds_run_productions_planner_with_the_groups_joined() -> None:
    """Restorable grouped worlds look up, load and store with every group's blocks in one
    object (each object's content holds every group's part: the world's ``expected_chunk``);
    unrestorable ones never look up nor store."""
    loads = restorable = unrestorable_worlds = 0
    for seed in range(60):
        scenario = draw_scenario(seed)
        groups = scenario.config.kv_groups
        if not groups:
            continue
        result, world = run_scenario(scenario)
        assert result.ok or is_known_race(result.violation), result.violation
        stats = _planner_stats(world)
        if unrestorable(groups, scenario.config.cpu_engine) is None:
            restorable += 1
            loads += stats.get("loads_planned", 0)
            for host in world.servers:
                if host.up and host.node is not None:
                    index = host.node.machines[SERVER].index
                    for key in index.objects():
                        data = host.slots.get(index.slot_of(key))
                        assert data is None or len(data) == len(groups) * scenario.config.chunk_size // scenario.config.block_size
        else:
            unrestorable_worlds += 1
            assert stats.get("lookups_submitted", 0) == 0 and stats.get("stores_planned", 0) == 0
    assert restorable > 3 and unrestorable_worlds > 0 and loads > 10


def test_a_planner_that_restores_recurrent_state_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """F24's other half: the simulated engine never takes a hit from an engine whose groups
    production cannot restore (here the planner is made to look them up anyway)."""
    monkeypatch.setattr(planner_module, "unrestorable", lambda groups, cpu_engine=True: None)
    caught = []
    for seed in range(200):
        scenario = draw_scenario(seed)
        if unrestorable(scenario.config.kv_groups, scenario.config.cpu_engine) is None:
            continue
        result, _ = run_scenario(scenario)
        if result.violation is not None and result.violation.code == "F24":
            caught.append(seed)
            break
    assert caught


def test_the_honest_worker_passes_where_one_writing_the_first_group_only_is_caught() -> None:
    caught = []
    for seed in range(200):
        r = run_seed(seed, "hma-partial-group")
        if r.violation is not None and not is_known_race(r.violation):
            assert r.violation.code == "F24", r.violation.reason()
            caught.append(seed)
            again = run_seed(seed)  # the same world, production's worker
            assert again.ok, again.violation
            if len(caught) == 2:
                break
    assert len(caught) == 2


def test_a_whole_prompt_hit_restores_the_windows_first_live_block() -> None:
    """The regression case of the F24 finding: a whole-prompt hit with a window of 5 tokens and
    blocks of 4 resumed one token short of the retrieve's end, where the window keeps one block
    more than the worker wrote (kv_groups.load_end now ends that load a chunk earlier)."""
    scenario, profile, code = from_json(FINDING.read_text())
    result, _ = run_scenario(scenario, profile)
    assert result.violation is None, result.violation.reason()
