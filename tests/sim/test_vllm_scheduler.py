"""mpcache.sim.vllm_scheduler.SchedulerModel, the one model of vLLM's scheduler (the simulator's engine
and the adapter tests' engine both schedule through it), against a connector that records
vLLM's calls."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import pytest

from mpcache.core_sm.keys import NO_EXTRAS, KeyExtras
from mpcache.core_sm.planner import ScheduledRequest, StepPlan
from mpcache.sim.vllm_scheduler import Admission, QueuedRequest, SchedulerModel, Status

BS = 4


class Recorder:
    def __init__(self, answer: tuple[int | None, bool] = (0, False)) -> None:
        self.answer = answer
        self.calls: list[tuple[Any, ...]] = []

    def get_num_new_matched_tokens(
        self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, num_computed_tokens: int,
        cache_salt: str = "", extras: KeyExtras = NO_EXTRAS, *, max_load_tokens: int | None = None,
        max_offload_tokens: int | None = None,
    ) -> tuple[int | None, bool]:
        self.calls.append(("match", request_id, num_computed_tokens))
        return self.answer

    def update_state_after_alloc(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        self.calls.append(("alloc", request_id, tuple(block_ids), num_external_tokens))

    def build_plan(self, scheduled: Iterable[ScheduledRequest], preempted: Iterable[str] = ()) -> StepPlan:
        self.calls.append(("plan", tuple(scheduled), tuple(preempted)))
        return StepPlan()

    def request_finished(self, request_id: str) -> bool:
        self.calls.append(("finished", request_id))
        return True


def model(answer: tuple[int | None, bool] = (0, False), blocks: int = 16, max_running: int | None = None
          ) -> tuple[SchedulerModel, Recorder]:
    connector = Recorder(answer)
    return SchedulerModel(connector, BS, blocks, max_running), connector


def test_the_prefix_cache_hit_is_whole_blocks_and_never_the_last_token() -> None:
    m, c = model()
    whole = m.add(QueuedRequest("a", list(range(9)), apc_blocks=5))
    assert m.engine_prefix_hit(whole) == 8
    exact = m.add(QueuedRequest("b", list(range(8)), apc_blocks=2))
    assert m.engine_prefix_hit(exact) == 4  # 8 tokens: the last block holds the last token


def test_pending_answer_keeps_waiting_and_a_full_scheduler_does_not_ask() -> None:
    m, c = model((None, True), max_running=1)
    req = m.add(QueuedRequest("a", list(range(10))))
    assert m.admit(req) is Admission.PENDING and req.status is Status.WAITING
    c.answer = (0, False)
    assert m.admit(req) is Admission.RUNNING
    other = m.add(QueuedRequest("b", list(range(10))))
    asked = len(c.calls)
    assert m.admit(other) is Admission.FULL and len(c.calls) == asked  # not reached: no call


def test_an_async_load_names_its_loaded_blocks_then_all_of_them() -> None:
    m, c = model((4, True))
    req = m.add(QueuedRequest("a", list(range(14)), apc_blocks=1))  # engine holds 4, loads 4
    assert m.admit(req) is Admission.LOADING and req.computed == 8
    (_, _, first, external) = c.calls[-1]
    assert len(first) == 2 and external == 4 and len(req.blocks) == 4
    m.load_landed(req)
    assert c.calls[-1] == ("alloc", "a", tuple(req.blocks), 0) and req.status is Status.RUNNING
    assert m.schedule_prefill(req) == 6
    m.end_step()
    assert c.calls[-1] == ("plan", (ScheduledRequest("a", 8, 6, tuple(req.blocks), True),), ())


def test_a_synchronous_load_gets_every_block_at_once_and_runs_this_step() -> None:
    m, c = model((8, False))
    req = m.add(QueuedRequest("a", list(range(14))))
    assert m.admit(req) is Admission.SYNC_LOAD and req.status is Status.RUNNING
    assert c.calls[-1] == ("alloc", "a", tuple(req.blocks), 8) and len(req.blocks) == 4
    assert m.schedule_prefill(req) == 6


def test_a_short_pool_keeps_the_request_waiting() -> None:
    m, _ = model(blocks=2)
    req = m.add(QueuedRequest("a", list(range(12))))
    assert m.admit(req) is Admission.NO_BLOCKS and req.blocks == [] and m.blocks_in_use() == 0


def test_a_pool_the_caller_says_is_short_asks_again_each_step_and_allocates_nothing() -> None:
    """``short``: blocks other work holds (a scripted world's hold). The connector is asked at
    every step, as vLLM asks a waiting request again; once the pool has room, it is allocated."""
    m, c = model((4, True))
    req = m.add(QueuedRequest("a", list(range(10))))
    assert m.admit(req, short=True) is Admission.NO_BLOCKS
    assert m.admit(req, short=True) is Admission.NO_BLOCKS
    assert req.status is Status.WAITING and req.blocks == [] and m.blocks_in_use() == 0
    assert c.calls == [("match", "a", 0), ("match", "a", 0)]
    assert m.admit(req) is Admission.LOADING and c.calls[-1] == ("alloc", "a", (req.blocks[0],), 4)


def test_preemption_frees_at_once_and_is_reported_in_the_step() -> None:
    m, c = model()
    req = m.add(QueuedRequest("a", list(range(10))))
    m.admit(req)
    m.preempt(req)
    assert req.status is Status.WAITING and req.blocks == [] and m.blocks_in_use() == 0 and req.computed == 0
    m.end_step()
    assert c.calls[-1] == ("plan", (), ("a",))


def test_load_errors_recompute_from_the_first_bad_block() -> None:
    m, _ = model((8, True))
    req = m.add(QueuedRequest("a", list(range(14))))
    m.admit(req)
    assert m.recompute_from(req, {req.blocks[1], 999}) == BS
    assert m.recompute_from(req, {999}) == BS


def test_finished_blocks_wait_for_every_workers_sending() -> None:
    m, c = model()
    req = m.add(QueuedRequest("a", list(range(10))))
    m.admit(req)
    assert m.finish(req, {0, 1}) is True and c.calls[-1] == ("finished", "a")
    assert not m.sent(req, 0) and m.blocks_in_use() == 3
    assert m.sent(req, 1) and req.freed and m.blocks_in_use() == 0 and req.status is Status.FINISHED
    assert not m.sent(req, 1)  # a late report frees nothing twice
    never = m.add(QueuedRequest("b", list(range(10))))
    assert m.finish(never, {0}) is False and never.freed  # held no blocks


def test_a_connector_answer_that_leaves_nothing_to_compute_is_refused() -> None:
    m, _ = model((12, True))
    with pytest.raises(AssertionError):
        m.admit(m.add(QueuedRequest("a", list(range(12)))))
