"""How the GPU transfer engine turns a StartTransfer into kernel rows (no GPU needed)."""
from __future__ import annotations

import numpy as np
import pytest

from mpcache.core_sm.effects import StartTransfer
from mpcache.core_sm.messages import TransferKind
from mpcache.runtime_zmq.gpu_transfer import plan_rows

C, BS, SLOT = 8, 2, 1000  # 4 blocks per chunk


def _st(kind: TransferKind, start: int, end: int, placements: list[tuple[int, int]], skip: int = 0) -> StartTransfer:
    n_blocks = (end - start) // BS
    return StartTransfer(7, kind, 1, "r", None, start, end, tuple(placements), tuple(range(100, 100 + n_blocks)), skip)


def test_store_rows_follow_absolute_chunk_indexes() -> None:
    # range starts at chunk 2; chunk 3 was already cached, so only chunks 2 and 4 travel
    rows = plan_rows(_st(TransferKind.STORE, 2 * C, 5 * C, [(4, 9), (2, 5)]), C, BS, SLOT)
    np.testing.assert_array_equal(rows.block_ids, [[100, 101, 102, 103], [108, 109, 110, 111]])
    np.testing.assert_array_equal(rows.slot_offsets, [5 * SLOT, 9 * SLOT])
    assert rows.skip_blocks == 0


def test_store_ignores_skip() -> None:
    rows = plan_rows(_st(TransferKind.STORE, 0, 2 * C, [(0, 1), (1, 2)], skip=C), C, BS, SLOT)
    assert rows.block_ids.shape == (2, 4) and rows.skip_blocks == 0


@pytest.mark.parametrize("skip,chunks,skip_blocks", [(0, 3, 0), (3, 3, 1), (C, 2, 0), (C + 5, 2, 2), (3 * C, 0, 0)])
def test_retrieve_skip_prefix(skip: int, chunks: int, skip_blocks: int) -> None:
    rows = plan_rows(_st(TransferKind.RETRIEVE, 0, 3 * C, [(0, 3), (1, 4), (2, 5)], skip), C, BS, SLOT)
    assert rows.block_ids.shape == (chunks, 4)
    assert rows.skip_blocks == skip_blocks
    if chunks:
        assert rows.slot_offsets[-1] == 5 * SLOT
        assert rows.block_ids[-1, -1] == 100 + 3 * 4 - 1


def test_placement_outside_the_blocks_is_rejected() -> None:
    with pytest.raises(ValueError):
        plan_rows(_st(TransferKind.STORE, 0, C, [(1, 0)]), C, BS, SLOT)
    with pytest.raises(ValueError):
        plan_rows(_st(TransferKind.STORE, 2 * C, 3 * C, [(1, 0)]), C, BS, SLOT)
