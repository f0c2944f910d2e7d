"""The CPU copy moves whole contiguous runs (a head, a token's heads, a block's tokens, as the
layout allows): every (block, layer, k/v, token, head) must still land where the slot layout
says, for the geometries where runs merge or must not (one head, one-token blocks), and at the
vLLM CPU geometry with a skip inside the first chunk. The source lanes carry their own
coordinates, so a wrong offset names itself; the chunk's expected contents are computed here
from the layout's logical view, not by the kernel's stride arithmetic."""
from __future__ import annotations

import numpy as np
import pytest

from mpcache.kernels.cpu import CpuKVTransfer, prefault
from mpcache.kernels.layouts import KVGeometry, PagedLayout
from tests.kernels.reference import canonical

POISON = np.uint32(0xDEADBEEF)

# (layout, block_size, num_heads, head_size, chunk_tokens): runs merge to a whole block (NHD, FLASHINFER,
# MLA), to a token (one-token blocks), or stay one head (HND, CPU); one head of a non-MLA layout.
GEOMETRIES = [
    (layout, bs, nh, hs, chunk)
    for layout in PagedLayout
    for bs, nh, hs, chunk in ((4, 3, 8, 8), (1, 3, 8, 4), (4, 1, 6, 8), (2, 2, 3, 4))
    if not (layout is PagedLayout.MLA and nh != 1)
]


def _tagged_layers(g: KVGeometry) -> list[np.ndarray]:
    """uint32 elements whose value encodes (layer, kv, block, token, head, element)."""
    out = []
    for layer in range(g.num_layers):
        a = np.zeros(g.layer_elements(), dtype=np.uint32)
        view = canonical(g, a)  # [kv, NB, BS, NH, HS]
        kv, nb, bs, nh, hs = np.indices(view.shape, dtype=np.uint32)
        view[...] = ((((layer * 2 + kv) * 512 + nb) * 64 + bs) * 16 + nh) * 64 + hs + 1
        out.append(a)
    return out


def _expected_chunk(g: KVGeometry, layers: list[np.ndarray], blocks: np.ndarray) -> np.ndarray:
    """[kv, L, C, NH*HS] from the logical view: token t of the chunk is token t % BS of block t // BS."""
    want = np.empty(g.slot_shape(), dtype=np.uint32)
    for layer in range(g.num_layers):
        view = canonical(g, layers[layer])
        for t in range(g.chunk_tokens):
            want[:, layer, t] = view[:, blocks[t // g.block_size], t % g.block_size].reshape(g.kv_size, g.hidden)
    return want


@pytest.mark.parametrize("layout,bs,nh,hs,chunk", GEOMETRIES)
def test_every_run_lands_where_the_layout_says(layout: PagedLayout, bs: int, nh: int, hs: int, chunk: int) -> None:
    g = KVGeometry(layout, num_layers=3, num_blocks=31, block_size=bs, num_heads=nh, head_size=hs, itemsize=4,
                   chunk_tokens=chunk)
    rng = np.random.default_rng(bs * 100 + nh * 10 + hs)
    src = _tagged_layers(g)
    ids = rng.permutation(g.num_blocks)[: 3 * g.blocks_per_chunk].reshape(3, -1).astype(np.int64)
    slots = [2, 0, 3]
    pool = np.full(4 * g.slot_bytes // 4, POISON, dtype=np.uint32)
    CpuKVTransfer(g, src, pool).gather(ids, [s * g.slot_bytes for s in slots])
    per_slot = pool.reshape(4, *g.slot_shape())
    for i, s in enumerate(slots):
        np.testing.assert_array_equal(per_slot[s], _expected_chunk(g, src, ids[i]))
    assert (per_slot[1] == POISON).all()  # the slot not named stays as it was

    # Back into other blocks, the first `skip` (inside the first chunk) left alone.
    dst = [np.full_like(a, POISON) for a in src]
    out_ids = rng.permutation(g.num_blocks)[: ids.size].reshape(ids.shape).astype(np.int64)
    skip = max(g.blocks_per_chunk - 1, 0)
    CpuKVTransfer(g, dst, pool).scatter([s * g.slot_bytes for s in slots], out_ids, skip_blocks=skip)
    flat_in, flat_out = ids.reshape(-1), out_ids.reshape(-1)
    for a, b in zip(src, dst):
        ca, cb = canonical(g, a), canonical(g, b)
        np.testing.assert_array_equal(cb[:, flat_out[skip:]], ca[:, flat_in[skip:]])
        untouched = np.setdiff1d(np.arange(g.num_blocks), flat_out[skip:])
        assert (cb[:, untouched] == POISON).all()  # skipped and unlisted blocks keep their bytes


def _placed(a: np.ndarray, misalign: int) -> np.ndarray:
    """A copy of ``a`` at an address 64-byte aligned plus ``misalign`` bytes."""
    raw = np.empty(a.nbytes + 128, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64 + misalign
    out = raw[start : start + a.nbytes].view(a.dtype)
    out[...] = a.reshape(-1)
    return out


@pytest.mark.parametrize("misalign", [0, 8, 16])
def test_vllm_cpu_geometry_with_a_skip_inside_the_first_chunk(misalign: int) -> None:
    """The vLLM CPU layout [NB, NH, BS, 2*HS] at a real head size (fp32, 256-byte runs, uint64
    lanes): K and V of one token sit side by side, and must go to the two halves of the slot.
    Aligned buffers take the streamed (non-temporal) copy, misaligned ones the lane loop."""
    g = KVGeometry(PagedLayout.CPU, num_layers=2, num_blocks=40, block_size=16, num_heads=4, head_size=64, itemsize=4,
                   chunk_tokens=64)
    assert g.lane_bytes == 8
    src = [_placed(a, misalign) for a in _tagged_layers(g)]
    ids = np.array([[5, 17, 2, 33], [8, 0, 39, 21]], dtype=np.int64)
    pool = _placed(np.full(3 * g.slot_bytes // 4, POISON, dtype=np.uint32), misalign)
    CpuKVTransfer(g, src, pool).gather(ids, [2 * g.slot_bytes, 0])
    per_slot = pool.reshape(3, *g.slot_shape())
    np.testing.assert_array_equal(per_slot[2], _expected_chunk(g, src, ids[0]))
    np.testing.assert_array_equal(per_slot[0], _expected_chunk(g, src, ids[1]))
    # K of layer 1, token 16 (block 17, token 0), head 2, element 5 -- spelled out once.
    k, layer, t, h, e = 0, 1, 16, 2, 5
    assert per_slot[2][k, layer, t, h * 64 + e] == canonical(g, src[layer])[k, 17, 0, h, e]
    assert per_slot[2][1, layer, t, h * 64 + e] == src[layer].reshape(40, 4, 16, 128)[17, h, 0, 64 + e]  # V: second half

    dst = [_placed(np.full_like(a, POISON), misalign) for a in src]
    CpuKVTransfer(g, dst, pool).scatter([2 * g.slot_bytes, 0], ids, skip_blocks=3)
    for a, b in zip(src, dst):
        written = ids.reshape(-1)[3:]
        ca, cb = canonical(g, a), canonical(g, b)
        np.testing.assert_array_equal(cb[:, written], ca[:, written])
        assert (cb[:, np.setdiff1d(np.arange(40), written)] == POISON).all()


def test_prefault_keeps_every_byte() -> None:
    buf = np.random.default_rng(3).integers(0, 256, size=(3 << 20) + 123, dtype=np.uint8)
    want = buf.copy()
    view = buf[77:]  # not page-aligned at either end
    assert prefault(view, step_bytes=1 << 20) in (True, False)
    np.testing.assert_array_equal(buf, want)
    calls: list[int] = []
    assert prefault(view, step_bytes=1 << 20, keep_going=lambda: not calls.append(1) and len(calls) < 2)
    assert len(calls) == 2  # asked before each step; stopped when it said no
    np.testing.assert_array_equal(buf, want)
