"""CPU gather / scatter against the numpy reference: every layout, several dtypes (as raw
bits), random block tables, skip prefixes, poisoned outputs, untouched blocks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mpcache.kernels.cpu import CpuKVTransfer, gather_cpu, scatter_cpu
from mpcache.kernels.layouts import KVGeometry, PagedLayout
from tests.kernels.conftest import random_block_table, random_layers, small_geometry
from tests.kernels.reference import gather_ref, scatter_ref

POISON = 0xA5

LAYOUTS = list(PagedLayout)
# (numpy dtype standing for the element's bits, itemsize, head_size): lanes of 8, 4, 2 and 1 bytes
DTYPES = [(np.uint16, 2, 8), (np.uint8, 1, 8), (np.uint32, 4, 8), (np.uint8, 1, 6), (np.uint16, 2, 3)]


def _pool(g: KVGeometry, n_slots: int) -> np.ndarray:
    return np.full(n_slots * g.slot_bytes, POISON, dtype=np.uint8)


def _slot(g: KVGeometry, pool: np.ndarray, dtype: type, slot: int) -> np.ndarray:
    return pool[slot * g.slot_bytes : (slot + 1) * g.slot_bytes].view(dtype).reshape(g.slot_shape())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype,itemsize,hs", DTYPES)
def test_gather_matches_reference(layout: PagedLayout, dtype: type, itemsize: int, hs: int) -> None:
    rng = np.random.default_rng(hash((layout.value, itemsize, hs)) % 2**32)
    g = small_geometry(layout, itemsize=itemsize, head_size=hs)
    layers = random_layers(g, rng, dtype)
    before = [a.copy() for a in layers]
    ids = random_block_table(g, rng, 3)
    pool = _pool(g, 5)
    slots = [4, 0, 2]  # out of order, and slots 1 and 3 stay untouched
    CpuKVTransfer(g, layers, pool).gather(ids, [s * g.slot_bytes for s in slots])
    want = gather_ref(g, before, ids)
    for i, s in enumerate(slots):
        np.testing.assert_array_equal(_slot(g, pool, dtype, s), want[i])
    for s in (1, 3):
        assert (pool[s * g.slot_bytes : (s + 1) * g.slot_bytes] == POISON).all()
    for a, b in zip(layers, before):
        np.testing.assert_array_equal(a, b)  # a store never writes the engine's cache


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype,itemsize,hs", DTYPES[:3])
@pytest.mark.parametrize("skip", [0, 1, 4, 9])
def test_scatter_matches_reference(layout: PagedLayout, dtype: type, itemsize: int, hs: int, skip: int) -> None:
    rng = np.random.default_rng(hash((layout.value, itemsize, skip)) % 2**32)
    g = small_geometry(layout, itemsize=itemsize, head_size=hs)
    layers = random_layers(g, rng, dtype)
    want_layers = [a.copy() for a in layers]
    ids = random_block_table(g, rng, 3)
    pool_bits = rng.integers(0, 256, size=4 * g.slot_bytes, dtype=np.uint8)
    pool = pool_bits.copy()
    slots = [3, 1, 0]
    CpuKVTransfer(g, layers, pool).scatter([s * g.slot_bytes for s in slots], ids, skip_blocks=skip)
    chunks = np.stack([_slot(g, pool_bits, dtype, s) for s in slots])
    scatter_ref(g, want_layers, chunks, ids, skip)
    for a, b in zip(layers, want_layers):
        np.testing.assert_array_equal(a, b)  # written blocks match; skipped and unlisted blocks kept
    np.testing.assert_array_equal(pool, pool_bits)  # a retrieve never writes the pool


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_into_other_blocks_writes_every_element(layout: PagedLayout) -> None:
    rng = np.random.default_rng(7)
    g = small_geometry(layout)
    src = random_layers(g, rng, np.uint16)
    dst = [np.full_like(a, 0xA5A5) for a in src]
    ids = random_block_table(g, rng, 2)
    out_ids = np.roll(ids.reshape(-1), 3).reshape(ids.shape)[::-1].copy()
    pool = _pool(g, 2)
    CpuKVTransfer(g, src, pool).gather(ids, [0, g.slot_bytes])
    assert not (pool == POISON).all()
    CpuKVTransfer(g, dst, pool).scatter([0, g.slot_bytes], out_ids)
    for a, b in zip(src, dst):
        ca, cb = (a.reshape(g.layer_shape()), b.reshape(g.layer_shape()))
        from tests.kernels.reference import canonical

        np.testing.assert_array_equal(canonical(g, cb)[:, out_ids.reshape(-1)], canonical(g, ca)[:, ids.reshape(-1)])
        untouched = np.setdiff1d(np.arange(g.num_blocks), out_ids)
        assert (canonical(g, cb)[:, untouched] == 0xA5A5).all()


def test_torch_bf16_and_fp8_tensors_are_copied_byte_exactly() -> None:
    for dt in (torch.bfloat16, torch.float8_e4m3fn, torch.float16, torch.float32):
        g = KVGeometry(PagedLayout.NHD, 2, 10, 4, 2, 8, torch.tensor([], dtype=dt).element_size(), 8)
        gen = torch.Generator().manual_seed(1)
        bits = torch.randint(0, 256, (2, g.layer_elements() * g.itemsize), dtype=torch.uint8, generator=gen)
        layers = [bits[i].view(dt).reshape(g.layer_shape()) for i in range(2)]
        ids = np.array([[7, 2], [0, 9]])
        slots = [np.full(g.slot_bytes, POISON, np.uint8) for _ in range(2)]
        gather_cpu(g, layers, ids, slots)
        back = [torch.zeros_like(t) for t in layers]
        scatter_cpu(g, back, slots, ids[:, ::-1].copy(), skip_blocks=1)
        for t, b in zip(layers, back):
            tb, bb = t.view(torch.uint8), b.view(torch.uint8)  # compare bits: NaN patterns too
            assert torch.equal(bb[:, 7], tb[:, 2]) and torch.equal(bb[:, 9], tb[:, 0]) and torch.equal(bb[:, 0], tb[:, 9])
            assert not bb[:, 2].any()  # skipped (the first block of the list) stays as it was


def test_bad_requests_are_rejected_before_any_write() -> None:
    g = small_geometry(PagedLayout.NHD)
    rng = np.random.default_rng(0)
    layers = random_layers(g, rng, np.uint16)
    pool = _pool(g, 2)
    t = CpuKVTransfer(g, layers, pool)
    with pytest.raises(ValueError):
        t.gather(np.array([[0, 1, g.num_blocks]]), [0])
    with pytest.raises(ValueError):
        t.gather(np.array([[0, 1, -1]]), [0])
    with pytest.raises(ValueError):
        t.gather(np.array([[0, 1]]), [0])  # not a whole chunk
    with pytest.raises(ValueError):
        t.gather(np.array([[0, 1, 2]]), [g.slot_bytes + 2])  # past the pool's end
    with pytest.raises(ValueError):
        t.scatter([0], np.array([[0, 1, 2]]), skip_blocks=4)
    with pytest.raises(ValueError):
        CpuKVTransfer(g, layers[:2], pool)
    with pytest.raises(ValueError):
        KVGeometry(PagedLayout.NHD, 1, 4, 16, 1, 8, 2, 24)  # chunk is not whole blocks
    assert (pool == POISON).all()
