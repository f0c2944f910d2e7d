"""core_sm.kv_groups: what each KV-cache group needs to resume a prefix; a hit only when every
group has it (never a partial restore)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from mpcache.core_sm.kv_groups import (
    GroupKind,
    KVGroup,
    first_live_token,
    group_retrieve_skip,
    join_group_blocks,
    layout_identity,
    load_end,
    needed_chunks,
    resume_point,
    split_group_blocks,
    store_floor,
    sync_load_allowed,
    unrestorable,
)

C = 256
FULL = KVGroup(GroupKind.FULL, 16)
SWA = KVGroup(GroupKind.SLIDING_WINDOW, 16, window=512)
MAMBA = KVGroup(GroupKind.RECURRENT, 16)


def test_needed_chunks_per_kind() -> None:
    assert needed_chunks(FULL, 4 * C, C) == range(0, 4)
    assert needed_chunks(SWA, 4 * C, C) == range(2, 4)  # only the 512-token window before t
    assert needed_chunks(KVGroup(GroupKind.SLIDING_WINDOW, 16, window=300), 4 * C, C) == range(2, 4)
    assert needed_chunks(SWA, 1 * C, C) == range(0, 1)
    assert needed_chunks(MAMBA, 4 * C, C) == range(3, 4)  # the state at t alone


def test_a_hit_needs_every_group() -> None:
    everything = frozenset(range(8))
    assert resume_point([FULL, SWA], [everything, frozenset({2, 3})], 4 * C, C) == 4 * C
    # the window's group lacks chunk 2: resuming at 4 chunks is impossible; at 3 it needs {1, 2}
    assert resume_point([FULL, SWA], [everything, frozenset({3})], 4 * C, C) == 0
    assert resume_point([FULL, SWA], [everything, frozenset({0, 1, 3})], 4 * C, C) == 2 * C
    # a full group short of its first chunk: no prefix at all, whatever the others hold
    assert resume_point([FULL, MAMBA], [frozenset({1, 2, 3}), everything], 4 * C, C) == 0
    assert resume_point([FULL, MAMBA], [everything, frozenset()], 4 * C, C) == 0  # no state: a miss
    with pytest.raises(ValueError):
        resume_point([FULL, SWA], [everything], 4 * C, C)


@given(st.lists(st.sampled_from([FULL, SWA, MAMBA]), min_size=1, max_size=3).flatmap(
    lambda groups: st.tuples(st.just(groups), st.lists(st.frozensets(st.integers(0, 7)), min_size=len(groups),
                                                       max_size=len(groups)), st.integers(0, 8 * C))))
def test_resume_point_is_the_longest_fully_restorable_prefix(case: tuple[list[KVGroup], list[frozenset[int]], int]) -> None:
    groups, present, limit = case
    t = resume_point(groups, present, limit, C)
    assert t % C == 0 and 0 <= t <= limit
    if t:  # every group holds what it needs there
        assert all(set(needed_chunks(g, t, C)) <= have for g, have in zip(groups, present))
    for longer in range(t + C, limit // C * C + 1, C):  # and no longer prefix would do
        assert not all(set(needed_chunks(g, longer, C)) <= have for g, have in zip(groups, present))


def test_full_attention_only_is_the_plain_prefix() -> None:
    assert resume_point([FULL], [frozenset(range(5))], 8 * C, C) == 5 * C


def test_what_this_version_restores() -> None:
    assert unrestorable(()) is None and unrestorable([FULL]) is None
    assert "recurrent" in (unrestorable([FULL, MAMBA]) or "")
    assert unrestorable([FULL, SWA]) is None  # mixed full attention and a window: restored on CPU
    assert "GPU" in (unrestorable([FULL, SWA], cpu_engine=False) or "")  # the server's copy: one block table
    assert unrestorable([FULL], cpu_engine=False) is None and unrestorable([SWA], cpu_engine=False) is None
    assert "block sizes" in (unrestorable([FULL, KVGroup(GroupKind.SLIDING_WINDOW, 32, window=512)]) or "")
    assert unrestorable([SWA]) is None  # one sliding-window group: restored
    assert unrestorable([MAMBA]) is not None
    with pytest.raises(ValueError):
        KVGroup(GroupKind.SLIDING_WINDOW, 16)


def test_first_live_token_of_a_window() -> None:
    assert first_live_token(SWA, 0) == 0 and first_live_token(SWA, 512) == 0
    assert first_live_token(SWA, 513) == 0 and first_live_token(SWA, 528) == 16  # 528 - 512 + 1 = 17 -> block 16
    assert first_live_token(FULL, 10_000) == 0


def test_several_groups_key_apart_from_one_group() -> None:
    assert layout_identity([FULL]) == "" and layout_identity([SWA]) == "" and layout_identity(()) == ""
    assert layout_identity([FULL, SWA]) == "full_attention,sliding_window 512"
    assert layout_identity([SWA, FULL]) != layout_identity([FULL, SWA])


def test_group_blocks_join_and_split() -> None:
    joined = join_group_blocks([[1, 2, 3, 4], [9, 8, 7, 6]], 1, 3)
    assert joined == (2, 3, 8, 7)
    assert split_group_blocks(joined, 2) == ((2, 3), (8, 7))
    with pytest.raises(ValueError):
        split_group_blocks((1, 2, 3), 2)
    with pytest.raises(ValueError):
        join_group_blocks([[1, 2, 3, 4], [9]], 0, 2)  # a group shorter than the range


def test_a_retrieve_writes_a_window_only_from_its_first_live_block() -> None:
    window = KVGroup(GroupKind.SLIDING_WINDOW, 16, window=128)
    # resume at 512: vLLM keeps the window's blocks from token (512 - 128 + 1) // 16 * 16 = 384
    assert group_retrieve_skip(window, 0, 512, 0) == 384
    assert group_retrieve_skip(window, 256, 512, 0) == 128
    assert group_retrieve_skip(window, 256, 512, 200) == 200  # the engine's own blocks stay
    assert group_retrieve_skip(FULL, 0, 512, 32) == 32
    assert group_retrieve_skip(KVGroup(GroupKind.SLIDING_WINDOW, 16, window=16), 0, 32, 0) == 16


def test_a_whole_prompt_load_ends_where_vllms_resume_keeps_the_same_window_blocks() -> None:
    # 1024 - 497 + 1 = 528, a multiple of 16: at 1023 vLLM keeps the window from 512, one block
    # before the end's 528; the load ends a chunk earlier (768: both keep from 272)
    odd = KVGroup(GroupKind.SLIDING_WINDOW, 16, window=497)
    assert first_live_token(odd, 1023) == 512 and first_live_token(odd, 1024) == 528
    assert load_end([FULL, odd], 1024, 1024, C) == 768
    assert load_end([FULL, odd], 1024, 1025, C) == 1024  # vLLM resumes at the end
    for beside in (496, 498, 512):  # elsewhere both agree: the whole hit loads
        assert load_end([FULL, KVGroup(GroupKind.SLIDING_WINDOW, 16, window=beside)], 1024, 1024, C) == 1024
    assert load_end([FULL, SWA, odd], 1024, 1024, C) == 768  # any window decides
    assert load_end([FULL], 1024, 1024, C) == 1024 and load_end([FULL, odd], 0, 1024, C) == 0


@given(window=st.integers(1, 4 * C), chunks=st.integers(0, 6), tail=st.integers(0, C), bs=st.sampled_from([1, 2, 16]))
def test_a_load_end_agrees_with_vllms_resume_point(window: int, chunks: int, tail: int, bs: int) -> None:
    group = KVGroup(GroupKind.SLIDING_WINDOW, bs, window=window)
    prompt = chunks * C + tail
    end = load_end([FULL, group], chunks * C, max(prompt, 1), C)
    assert end % C == 0 and 0 <= end <= chunks * C and chunks * C - end <= C
    if end:
        assert first_live_token(group, min(end, prompt - 1)) == first_live_token(group, end)


def test_a_store_starts_no_earlier_than_the_narrowest_window_keeps() -> None:
    narrow = KVGroup(GroupKind.SLIDING_WINDOW, 16, window=64)
    assert store_floor([FULL, SWA, narrow], 1000) == first_live_token(narrow, 1000) == 928
    assert store_floor([FULL], 1000) == 0 and store_floor((), 1000) == 0


def test_several_groups_load_asynchronously() -> None:
    assert sync_load_allowed(()) and sync_load_allowed([SWA]) and not sync_load_allowed([FULL, SWA])
