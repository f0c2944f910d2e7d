"""The planner and vLLM's KV-cache groups (core_sm.kv_groups): one full-attention group is the
plain path; groups this version cannot restore make every request a miss that is neither looked
up (no lease) nor stored: never a partial restore."""

from __future__ import annotations

import pytest

from mpcache.core_sm.kv_groups import GroupKind, KVGroup, group_retrieve_skip
from mpcache.core_sm.messages import SubmitLookup, SubmitStore
from mpcache.core_sm.planner import BlocksAllocated, MatchAnswer, ScheduledRequest
from test_planner import BS, C, frees, match, planner, step

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


@pytest.mark.parametrize("groups", [(FULL, MAMBA), (FULL, SWA), (MAMBA,)], ids=["mamba-hybrid", "full-and-window-on-gpu", "mamba"])
def test_groups_it_cannot_restore_are_a_miss_with_no_lease_and_no_store(groups: tuple[KVGroup, ...]) -> None:
    p, lookups = planner(2 * C, kv_groups=groups)  # a GPU engine; the server would answer a hit
    assert p.unrestorable is not None
    tokens = list(range(3 * C))
    assert match(p, tokens) == MatchAnswer("r", 0, False)
    assert not [e for e in lookups.calls if isinstance(e, SubmitLookup)]  # no lookup: no lease to leak
    p.handle(BlocksAllocated("r", range(12), 0), 0.0)
    plan = step(p, ScheduledRequest("r", 0, 3 * C, tuple(range(12)), True))
    assert plan.retrieves == () and plan.stores == ()


def test_one_sliding_window_group_loads_only_the_window_before_the_resume_point() -> None:
    p, lookups = planner(3 * C, kv_groups=(SWA,))  # window: 2 chunks
    tokens = list(range(4 * C))
    assert match(p, tokens) == MatchAnswer("r", 3 * C, True)
    p.handle(BlocksAllocated("r", range(16), 3 * C), 0.0)
    (retrieve,) = step(p).retrieves
    assert (retrieve.start, retrieve.end, tuple(retrieve.block_ids)) == (C, 3 * C, tuple(range(4, 12)))
    assert frees(lookups) == [(0, C)]  # the chunk before the window is not read: its lease goes


def test_a_window_store_never_reads_blocks_that_left_the_window() -> None:
    """Chunked prefill of 1 chunk + 1 block per step with a window of 2 chunks: a chunk is stored
    only while its first block is still allocated when the step starts."""
    p, _ = planner(0, kv_groups=(KVGroup(GroupKind.SLIDING_WINDOW, BS, window=C),))
    tokens = list(range(4 * C))
    match(p, tokens)
    blocks = tuple(range(16))
    p.handle(BlocksAllocated("r", blocks, 0), 0.0)
    step(p)
    stored = step(p, ScheduledRequest("r", 0, C - BS, blocks, True)).stores
    assert stored == ()  # no chunk complete yet
    # step 2 computes [C - BS, 2C + BS): chunk 0 starts at 0, still live (C - BS - C + 1 < 0)
    (first,) = step(p, ScheduledRequest("r", C - BS, C + 2 * BS, None)).stores
    assert (first.start, first.end) == (0, 2 * C)
    # step 3 starts at 2C + BS: chunk 2 is live (first live token C + BS... < 2C): stored
    (second,) = step(p, ScheduledRequest("r", 2 * C + BS, C, None)).stores
    assert (second.start, second.end) == (2 * C, 3 * C)


def test_a_window_store_stops_once_a_chunk_left_the_window_unstored() -> None:
    p, _ = planner(0, kv_groups=(KVGroup(GroupKind.SLIDING_WINDOW, BS, window=BS),))  # a window of one block
    tokens = list(range(3 * C))
    match(p, tokens)
    blocks = tuple(range(12))
    p.handle(BlocksAllocated("r", blocks, 0), 0.0)
    step(p)
    assert step(p, ScheduledRequest("r", 0, C - BS, blocks, True)).stores == ()
    # this step starts at C - BS: chunk 0's first blocks were freed already
    assert step(p, ScheduledRequest("r", C - BS, 2 * C, None)).stores == ()
    assert step(p, ScheduledRequest("r", 3 * C - BS, BS, None)).stores == ()  # nor any later one


# Full attention and a window of one chunk, on a CPU engine (where several groups are restored).
MIXED = (FULL, KVGroup(GroupKind.SLIDING_WINDOW, BS, window=C))


def test_full_and_window_load_every_group_asynchronously() -> None:
    p, lookups = planner(2 * C, kv_groups=MIXED, cpu_engine=True)
    tokens = list(range(3 * C))
    # a CPU engine loads synchronously, but not several groups: vLLM takes their failure by request id
    assert match(p, tokens) == MatchAnswer("r", 2 * C, True)
    full, window = tuple(range(12)), tuple(range(100, 112))
    p.handle(BlocksAllocated("r", full, 2 * C, (window,)), 0.0)
    plan = step(p)
    (retrieve,) = plan.retrieves
    assert plan.sync_loads == ()
    # the whole hit (the full group needs every chunk), each group's blocks, group after group
    assert (retrieve.start, retrieve.end) == (0, 2 * C)
    assert tuple(retrieve.block_ids) == full[:8] + window[:8]
    assert frees(lookups) == []


def test_full_and_window_store_every_group_and_extend_each_group() -> None:
    p, _ = planner(0, kv_groups=MIXED, cpu_engine=True)
    tokens = list(range(3 * C))
    match(p, tokens)
    p.handle(BlocksAllocated("r", range(4), 0, (range(100, 104),)), 0.0)
    step(p)
    (first,) = step(p, ScheduledRequest("r", 0, C, range(4), True, (range(100, 104),))).stores
    assert tuple(first.block_ids) == (0, 1, 2, 3, 100, 101, 102, 103)
    (second,) = step(p, ScheduledRequest("r", C, C, range(4, 8), False, (range(104, 108),))).stores
    assert (second.start, second.end, tuple(second.block_ids)) == (C, 2 * C, (4, 5, 6, 7, 104, 105, 106, 107))


def test_full_and_window_store_stops_at_a_block_the_window_freed() -> None:
    """A step that starts past the window of a chunk not stored yet: the window group's block
    may be another request's now, so nothing of that chunk (or after) is stored, for any group."""
    p, _ = planner(0, kv_groups=(FULL, KVGroup(GroupKind.SLIDING_WINDOW, BS, window=BS)), cpu_engine=True)
    tokens = list(range(3 * C))
    match(p, tokens)
    p.handle(BlocksAllocated("r", range(12), 0, (range(100, 112),)), 0.0)
    step(p)
    assert step(p, ScheduledRequest("r", 0, C - BS, range(12), True, (range(100, 112),))).stores == ()
    assert step(p, ScheduledRequest("r", C - BS, 2 * C, None)).stores == ()
    assert step(p, ScheduledRequest("r", 3 * C - BS, BS, None)).stores == ()


def vllm_first_live_block(window: int, computed: int) -> int:
    """vLLM's first block of a window group kept once ``computed`` tokens are computed
    (``SlidingWindowManager.get_num_skipped_tokens``: the tokens before
    ``computed - window + 1``); the blocks before it are its null block."""
    return max(0, computed - window + 1) // BS


def whole_prompt_load(window: int, prompt_tokens: int) -> tuple[MatchAnswer, int, int, int]:
    """A hit of every chunk of a prompt of ``prompt_tokens`` tokens on full attention + a window
    of ``window`` tokens: the match, the retrieve's range and the window group's first block the
    worker writes (``kv_groups.group_retrieve_skip``, as production's worker and the simulator's
    take it)."""
    groups = (FULL, KVGroup(GroupKind.SLIDING_WINDOW, BS, window=window))
    hit = prompt_tokens // C * C
    p, _ = planner(hit, kv_groups=groups, cpu_engine=True)
    answer = match(p, list(range(prompt_tokens)))
    blocks = -(-prompt_tokens // BS)
    p.handle(BlocksAllocated("r", range(blocks), answer.tokens or 0, (range(100, 100 + blocks),)), 0.0)
    (retrieve,) = step(p).retrieves
    skip = group_retrieve_skip(groups[1], retrieve.start, retrieve.end, retrieve.skip_first_n_tokens)
    return answer, retrieve.start, retrieve.end, (retrieve.start + skip) // BS


@pytest.mark.parametrize("window", [5, 4, 6, 13, 14, 1, 2 * C + 1])
def test_a_whole_prompt_hit_writes_the_window_from_the_block_vllm_keeps(window: int) -> None:
    """A hit of the whole prompt: vLLM resumes one token short of the retrieve's end (it
    computes the last prompt token), so a window keeps one block more than at the end when
    ``end - window + 1`` is a multiple of the block size (odd windows here: 3C - window + 1
    even). The worker writes the window from its first live block at the end; there the load
    ends a chunk earlier, where both agree. Beside it (even windows) the whole hit is loaded."""
    prompt = 3 * C
    answer, start, end, written_from = whole_prompt_load(window, prompt)
    resume = answer.tokens or 0  # vLLM's num_computed_tokens after the load
    assert start < end and resume <= end
    assert written_from == max(start // BS, vllm_first_live_block(window, resume))  # no live block left unwritten
    boundary = (prompt - window + 1) % BS == 0 and prompt - window + 1 > 0
    assert (resume, end) == ((2 * C, 2 * C) if boundary else (prompt - 1, prompt))


@pytest.mark.parametrize("window", range(1, 3 * C + 3))
def test_every_window_loads_from_the_block_vllm_keeps(window: int) -> None:
    for prompt in (3 * C, 3 * C + 1, 3 * C + BS + 1):  # the whole prompt a hit, or its tail computed
        answer, start, end, written_from = whole_prompt_load(window, prompt)
        resume = answer.tokens or 0
        assert resume <= end and written_from == max(start // BS, vllm_first_live_block(window, resume)), prompt
        if prompt > 3 * C:  # vLLM resumes at the end: nothing to give up
            assert resume == end == 3 * C
