"""The CUDA gather / scatter kernels against the numpy reference, on the CUDA simulator in CI
(``MPCACHE_CUDASIM=1``, set by ``make test``; tiny geometry: a launch is a few hundred simulated
threads) or on a real GPU (``make test-gpu``). Both modes, every layout, full and partial unroll groups, skip prefixes,
several lane widths, poisoned slots and untouched blocks."""
from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from mpcache.kernels.gpu import CudaKVTransfer
from mpcache.kernels.layouts import KVGeometry, PagedLayout
from tests.kernels.conftest import random_block_table, random_layers, small_geometry
from tests.kernels.reference import gather_ref, scatter_ref

pytestmark = pytest.mark.cuda  # tests/conftest.py: the simulator or a device, else skipped

POISON = 0xA5
GAP = 5  # lanes between layers in the span: the kernels must never touch them


class Engine:
    """Layers laid out with gaps inside one device 'span' array, as span_device_buffers makes."""

    def __init__(self, g: KVGeometry, layers: list[np.ndarray]) -> None:
        self.g = g
        lane = g.lane_dtype
        self.layer_lanes = layers[0].nbytes // lane.itemsize
        host = np.full((GAP + g.num_layers * (self.layer_lanes + GAP)) * lane.itemsize, 0x5A, dtype=np.uint8).view(lane)
        self.offsets = [GAP + i * (self.layer_lanes + GAP) for i in range(g.num_layers)]
        for off, a in zip(self.offsets, layers):
            host[off : off + self.layer_lanes] = a.reshape(-1).view(lane)
        self.initial = host.copy()
        self.span = cuda.to_device(host)

    def layers(self, dtype: type) -> tuple[list[np.ndarray], np.ndarray]:
        host = self.span.copy_to_host()
        out = [host[o : o + self.layer_lanes].view(dtype).reshape(self.g.layer_shape()) for o in self.offsets]
        gaps = np.concatenate([host[: self.offsets[0]]] + [host[o + self.layer_lanes : o + self.layer_lanes + GAP] for o in self.offsets])
        return out, gaps


def _assert_fast_launch(xfer: CudaKVTransfer) -> None:
    """On a real GPU the pre-packed driver launch must be in use, not the slow fallback."""
    import numba

    if not numba.config.ENABLE_CUDASIM:
        assert xfer.launch_path == "raw", xfer.launch_error
        assert xfer.enqueue_path == "compiled", xfer.enqueue_error


def _pool(g: KVGeometry, n_slots: int, fill: np.ndarray | None = None):  # type: ignore[no-untyped-def]
    pool = cuda.mapped_array(n_slots * g.slot_bytes // g.lane_bytes, dtype=g.lane_dtype)
    host = np.asarray(pool._ary if hasattr(pool, "_ary") else pool).view(np.uint8)
    host[:] = POISON if fill is None else fill
    return pool, host


def _slot(g: KVGeometry, host: np.ndarray, dtype: type, s: int) -> np.ndarray:
    return host[s * g.slot_bytes : (s + 1) * g.slot_bytes].view(dtype).reshape(g.slot_shape())


CASES = [
    # layout, itemsize, head_size, numpy dtype for the bits, threads
    (PagedLayout.NHD, 2, 12, np.uint16, 4),  # 8-byte lanes, unit 24: full group + tail
    (PagedLayout.HND, 2, 12, np.uint16, 4),
    (PagedLayout.FLASHINFER, 1, 8, np.uint8, 3),  # fp8, odd thread count
    (PagedLayout.FLASHINFER_HND, 4, 3, np.uint32, 4),  # 4-byte lanes
    (PagedLayout.MLA, 2, 6, np.uint16, 2),
    (PagedLayout.CPU, 2, 3, np.uint16, 5),  # 2-byte lanes, strided heads and K/V halves
]


@pytest.mark.parametrize("mode", ["zerocopy", "staging", "auto"])
@pytest.mark.parametrize("layout,itemsize,hs,dtype,threads", CASES)
def test_gather_then_scatter_match_reference(mode: str, layout: PagedLayout, itemsize: int, hs: int, dtype: type, threads: int) -> None:
    rng = np.random.default_rng(hash((layout.value, mode)) % 2**32)
    g = small_geometry(layout, itemsize=itemsize, head_size=hs, num_layers=2)
    src = random_layers(g, rng, dtype)
    eng = Engine(g, src)
    pool, host = _pool(g, 4)
    xfer = CudaKVTransfer(g, eng.span, eng.offsets, pool, mode=mode, max_ctas=2, threads=threads, max_chunks=2, ring=2)
    _assert_fast_launch(xfer)

    ids = random_block_table(g, rng, 2)
    slots = [3, 1]
    xfer.gather(ids, [s * g.slot_bytes for s in slots])
    xfer.stream.synchronize()
    want = gather_ref(g, src, ids)
    for i, s in enumerate(slots):
        np.testing.assert_array_equal(_slot(g, host, dtype, s), want[i])
    for s in (0, 2):
        assert (host[s * g.slot_bytes : (s + 1) * g.slot_bytes] == POISON).all()
    after, gaps = eng.layers(dtype)
    for a, b in zip(after, src):
        np.testing.assert_array_equal(a, b)

    # scatter those chunks into other blocks, skipping the first 4 blocks of the list
    out_ids = random_block_table(g, rng, 2)
    skip = 4
    xfer.scatter([s * g.slot_bytes for s in slots], out_ids, skip_blocks=skip)
    xfer.stream.synchronize()
    expect = [a.copy() for a in src]
    scatter_ref(g, expect, want, out_ids, skip)
    after, gaps = eng.layers(dtype)
    for a, b in zip(after, expect):
        np.testing.assert_array_equal(a, b)
    assert (gaps.view(np.uint8) == 0x5A).all()  # nothing written between layers


def test_ring_reuse_and_many_calls_stay_correct() -> None:
    g = small_geometry(PagedLayout.NHD, head_size=4, num_layers=1)
    rng = np.random.default_rng(3)
    src = random_layers(g, rng, np.uint16)
    eng = Engine(g, src)
    pool, host = _pool(g, 3)
    xfer = CudaKVTransfer(g, eng.span, eng.offsets, pool, max_ctas=1, threads=8, max_chunks=1, ring=2)
    for k in range(5):  # more calls than ring entries: descriptors are reused
        ids = random_block_table(g, rng, 1)
        xfer.gather(ids, [(k % 3) * g.slot_bytes])
        xfer.stream.synchronize()
        np.testing.assert_array_equal(_slot(g, host, np.uint16, k % 3), gather_ref(g, src, ids)[0])


def test_calls_are_validated_before_launch() -> None:
    g = small_geometry(PagedLayout.NHD, head_size=4, num_layers=1)
    rng = np.random.default_rng(4)
    eng = Engine(g, random_layers(g, rng, np.uint16))
    pool, host = _pool(g, 2)
    xfer = CudaKVTransfer(g, eng.span, eng.offsets, pool, max_ctas=1, threads=8, max_chunks=1, ring=2)
    with pytest.raises(ValueError):
        xfer.gather(np.array([[0, 1, 2], [3, 4, 5]]), [0, g.slot_bytes])  # more than max_chunks
    with pytest.raises(ValueError):
        xfer.gather(np.array([[0, 1, 99]]), [0])
    with pytest.raises(ValueError):
        xfer.scatter([2 * g.slot_bytes], np.array([[0, 1, 2]]))
    with pytest.raises(ValueError):
        CudaKVTransfer(g, eng.span, eng.offsets, pool, mode="bogus")
    assert (host == POISON).all()


@pytest.mark.parametrize("pieces", [1, 2, 3])
def test_staging_pipeline_pieces_and_partial_skip(pieces: int) -> None:
    rng = np.random.default_rng(40 + pieces)
    g = small_geometry(PagedLayout.HND, head_size=4, num_layers=1)  # 3 blocks per chunk
    src = random_layers(g, rng, np.uint16)
    eng = Engine(g, src)
    pool, host = _pool(g, 5)
    xfer = CudaKVTransfer(g, eng.span, eng.offsets, pool, mode="staging", max_ctas=2, threads=4, max_chunks=3,
                          ring=4, pipeline_pieces=pieces, piece_growth=2)
    ids = random_block_table(g, rng, 3)
    slots = [2, 3, 0]  # 2 and 3 adjacent: one DMA for both
    xfer.gather(ids, [s * g.slot_bytes for s in slots])
    xfer.stream.synchronize()
    want = gather_ref(g, src, ids)
    for i, s in enumerate(slots):
        np.testing.assert_array_equal(_slot(g, host, np.uint16, s), want[i])
    out_ids = random_block_table(g, rng, 3)
    xfer.scatter([s * g.slot_bytes for s in slots], out_ids, skip_blocks=5)  # chunk 0 and 2 blocks of chunk 1 held
    xfer.stream.synchronize()
    expect = [a.copy() for a in src]
    scatter_ref(g, expect, want, out_ids, 5)
    after, _ = eng.layers(np.uint16)
    np.testing.assert_array_equal(after[0], expect[0])


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("mode", ["staging", "auto"])
def test_unjoined_calls_overlap_through_the_staging_ring(mode: str, compiled: bool) -> None:
    """join=False, as the server's executor calls: each call's kernels may run while the DMAs
    of the calls before still drain the staging ring; runs wrap around the ring and are reused
    only after what last read them. Every slot and block must still be exactly right. On a GPU,
    through the compiled enqueue and through the Python path (the simulator runs the latter)."""
    rng = np.random.default_rng(77)
    g = small_geometry(PagedLayout.NHD, head_size=4, num_layers=2)  # 3 blocks per chunk
    src = random_layers(g, rng, np.uint16)
    eng = Engine(g, src)
    pool, host = _pool(g, 24)
    xfer = CudaKVTransfer(g, eng.span, eng.offsets, pool, mode=mode, max_ctas=2, threads=8, max_chunks=3, ring=64,
                          pipeline_pieces=3, piece_growth=2, compiled_enqueue=compiled)
    if compiled:
        _assert_fast_launch(xfer)
    calls = []
    slot = 0
    for k in range(10):
        n = 1 + k % 3
        ids = random_block_table(g, rng, n)
        slots = list(range(slot, slot + n))[:: -1 if k % 2 else 1]
        slot += n
        xfer.gather(ids, [s * g.slot_bytes for s in slots], join=False, busy=True)
        calls.append((ids, slots))
    cuda.synchronize()
    for ids, slots in calls:
        want = gather_ref(g, src, ids)
        for i, s in enumerate(slots):
            np.testing.assert_array_equal(_slot(g, host, np.uint16, s), want[i])
    expect = [a.copy() for a in src]
    for k, (_, slots) in enumerate(calls):
        out_ids = random_block_table(g, rng, len(slots))
        skip = k % 4
        xfer.scatter([s * g.slot_bytes for s in slots], out_ids, skip_blocks=skip, join=False, busy=True)
        scatter_ref(g, expect, np.stack([_slot(g, host, np.uint16, s) for s in slots]), out_ids, skip)
    cuda.synchronize()
    after, gaps = eng.layers(np.uint16)
    for a, b in zip(after, expect):
        np.testing.assert_array_equal(a, b)
    assert (gaps.view(np.uint8) == 0x5A).all()


def test_dma_runs_merge_adjacent_slots_both_ways() -> None:
    """The staging DMA plan: one copy per run of adjacent pool slots, with the staging chunk of
    each request chunk; addresses are base + lanes * scale."""
    from mpcache.kernels.gpu import _dma_runs

    out = np.zeros((3, 8), np.int64)
    pool = np.array([30, 40, 50, 10, 60, 70], np.int64)  # slots of 10 lanes: 30-40-50 and 60-70 adjacent
    n = _dma_runs(pool, 0, 6, 2, 10, 1000, 5000, 8, True, out)  # STORE: staging -> pool
    assert n == 3
    assert out[:, :n].tolist() == [[1000 + 30 * 8, 1000 + 10 * 8, 1000 + 60 * 8],
                                   [5000 + 20 * 8, 5000 + 50 * 8, 5000 + 60 * 8],
                                   [30 * 8, 10 * 8, 20 * 8]]
    n = _dma_runs(pool, 2, 5, -2, 10, 7000, 0, 1, False, out)  # RETRIEVE chunks 2..4: pool -> staging 0..2
    assert n == 3
    assert out[:, :n].tolist() == [[7000, 7010, 7020], [50, 10, 60], [10, 10, 10]]


@pytest.mark.parametrize(("growth", "n", "want"), [
    (2, 8, [1, 2, 5]), (2, 32, [1, 2, 4, 8, 17]), (2, 2, [1, 1]), (4, 1, [1]), (4, 4, [1, 3]), (4, 8, [1, 7]),
    (4, 32, [1, 4, 27]), (1, 8, [8]),  # growth 1 here: pipeline_pieces=1, one piece
])
def test_staging_pieces(growth: int, n: int, want: list[int]) -> None:
    g = small_geometry(PagedLayout.NHD, head_size=4, num_layers=1)
    eng = Engine(g, random_layers(g, np.random.default_rng(5), np.uint16))
    pool, _ = _pool(g, 2)
    xfer = CudaKVTransfer(g, eng.span, eng.offsets, pool, mode="staging", max_ctas=1, threads=4, max_chunks=32,
                          piece_growth=max(growth, 2), pipeline_pieces=1 if growth == 1 else 8)
    for shrinking in (False, True):
        pieces = xfer._pieces(n, shrinking)
        assert [b - a for a, b in pieces] == (want[::-1] if shrinking else want)
        assert pieces[0][0] == 0 and pieces[-1][1] == n and all(p[1] == q[0] for p, q in zip(pieces, pieces[1:]))
