"""mpcache.core_sm.blocks: the one answer to "which blocks does a chunk touch, which stay unwritten"."""
from __future__ import annotations

import pytest

from mpcache.core_sm.blocks import ChunkCopy, chunk_copies
from mpcache.core_sm.messages import TransferKind

C, BS = 8, 2  # 4 blocks per chunk
BLOCKS = tuple(range(100, 112))  # three chunks' worth


def test_placements_name_chunks_of_the_whole_sequence() -> None:
    copies = chunk_copies(TransferKind.STORE, 2 * C, 5 * C, [(4, 9), (2, 5)], BLOCKS, 0, C, BS)
    assert copies == (ChunkCopy(2, 5, (100, 101, 102, 103)), ChunkCopy(4, 9, (108, 109, 110, 111)))


def test_store_reads_every_block_whatever_the_skip() -> None:
    copies = chunk_copies(TransferKind.STORE, 0, 3 * C, [(0, 1), (1, 2)], BLOCKS, C + 4, C, BS)
    assert [c.skip_blocks for c in copies] == [0, 0]


@pytest.mark.parametrize("skip,chunks,first_skip", [(0, 3, 0), (2, 3, 1), (3, 3, 1), (C, 2, 0), (C + 6, 2, 3),
                                                    (3 * C, 0, 0)])
def test_retrieve_leaves_the_skipped_prefix_unwritten(skip: int, chunks: int, first_skip: int) -> None:
    copies = chunk_copies(TransferKind.RETRIEVE, 0, 3 * C, [(0, 3), (1, 4), (2, 5)], BLOCKS, skip, C, BS)
    assert len(copies) == chunks
    if copies:
        assert copies[0].skip_blocks == first_skip
        assert all(c.skip_blocks == 0 for c in copies[1:])
        # writing starts at the block holding the first token the engine does not hold
        assert copies[0].chunk * C + copies[0].skip_blocks * BS == skip // BS * BS


@pytest.mark.parametrize("start,end,placements", [(0, C, [(1, 0)]), (2 * C, 3 * C, [(1, 0)]), (0, 3 * C, [(3, 0)])])
def test_placement_outside_the_range_is_refused(start: int, end: int, placements: list[tuple[int, int]]) -> None:
    with pytest.raises(ValueError):
        chunk_copies(TransferKind.STORE, start, end, placements, BLOCKS[: (end - start) // BS], 0, C, BS)


def test_chunk_not_a_whole_number_of_blocks_is_refused() -> None:
    with pytest.raises(ValueError):
        chunk_copies(TransferKind.STORE, 0, C, [(0, 0)], BLOCKS, 0, C, 3)


def test_block_ids_of_any_sequence_come_out_as_plain_int_tuples() -> None:
    class Int(int):
        pass

    as_list = [Int(100 + i) for i in range(2 * C // BS)]
    for ids in (as_list, tuple(range(100, 100 + 2 * C // BS))):
        copies = chunk_copies(TransferKind.STORE, 0, 2 * C, [(1, 7), (0, 3)], ids, 0, C, BS)
        assert [c.block_ids for c in copies] == [tuple(range(100, 100 + C // BS)), tuple(range(100 + C // BS, 100 + 2 * C // BS))]
        assert all(type(b) is int for c in copies for b in c.block_ids) or type(ids) is tuple
        assert all(type(c.block_ids) is tuple for c in copies)
