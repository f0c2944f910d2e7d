"""CUDA gather / scatter between an engine's paged KV cache and L1 chunk slots (numba.cuda).

One launch moves a batch of chunks for every layer and K/V. The semantics are those of
``kernels/cpu.py`` (same parameter vector, same unit order); the tests run these kernels under
``NUMBA_ENABLE_CUDASIM=1`` against the same numpy reference.

Addressing. The kernels take two flat lane arrays:

* ``paged``: one device array that spans every layer tensor of the engine (built once at
  registration from their pointers, see ``span_device_buffers``), plus each layer's offset in
  it, so all layers go in one launch with no pointer table and no per-call slicing;
* ``slots``: the L1 pool as seen by the device (the pinned, mapped segment: zero-copy mode), or
  a device staging buffer (staging mode).

Per call, the request (chunk count, skip, slot offsets, block ids) is written into one of a ring
of small mapped (pinned, device-visible) descriptors; each CTA reads it once into shared memory.
So a call is: validate, fill a few numpy slices, one kernel launch — no device allocation, no
host→device copy, no slicing of device arrays.

Modes:

* ``zerocopy``: the kernel reads (RETRIEVE) or writes (STORE) the pinned L1 slots directly.
* ``staging``: STORE = gather kernel into a device staging buffer, then one DMA per run of
  adjacent slots; RETRIEVE = DMA into staging, then the scatter kernel. The batch is cut into up
  to ``pipeline_pieces`` pieces and the DMAs run on a second stream, so the copy engine moves
  piece p while the SMs gather (or scatter) its neighbour.

``max_ctas`` caps the grid (each CTA loops over units of one (chunk block, layer, kv)), so a copy
leaves the rest of the SMs to the model.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

# numba-cuda 0.30.4 registers an overload for np.row_stack, which numpy 2.5 removed: the first
# kernel compile fails without this alias. Must run before the first compile.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack  # type: ignore[attr-defined]

import numba  # noqa: E402
from numba import cuda  # noqa: E402

from mpcache.kernels.cpu import check_request, validate_call  # noqa: E402
from mpcache.kernels.layouts import (  # noqa: E402
    P_BPC,
    P_BS,
    P_C,
    P_COUNT,
    P_HL,
    P_KV,
    P_LAYERS,
    P_NH,
    P_SBLK,
    P_SHEAD,
    P_SKV,
    P_STOK,
    KVGeometry,
)

RELEASE_EVENTS = 64  # per stream: more than the calls that fit the staging ring at once
DESC_MAX = 4096  # int64 words of one request descriptor (32 KiB of shared memory per CTA)
D_NCHUNKS, D_SKIP, D_SLOTS = 0, 1, 2  # descriptor: [n_chunks, skip, slot_base * n, block_ids * n*bpc]
UNROLL = 4  # independent loads in flight per thread (PCIe latency hiding in zero-copy mode)
CUDA_SUCCESS, CUDA_ERROR_NOT_READY = 0, 600
PIECE_GROWTH = 4  # staging pieces grow 1, 4, 16, ... chunks (see CudaKVTransfer._pieces)
STAGING_CTAS = 64  # grid of the kernels between the engine's blocks and device staging


class FastDriver:
    """The driver calls of the enqueue path (launch, event record, stream wait, event query,
    async copies), called straight into libcuda through ctypes on plain integer handles.

    cuda-bindings' wrappers build and check Python objects for every handle and argument on each
    call (several microseconds; a batch copy of n runs builds 3n objects); here a call costs one
    C call. ``ctypes.PyDLL`` keeps the GIL across the call: each of these only enqueues work
    (microseconds), and dropping the GIL would let another thread take it and make the server's
    loop wait for its turn. The handles are those cuda-bindings / numba created (``as_handle``);
    the same libcuda serves both. Real GPU only."""

    def __init__(self) -> None:
        import ctypes

        lib = ctypes.PyDLL("libcuda.so.1")
        vp, u, c_int, size = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_size_t

        def fn(name: str, *argtypes: Any) -> Any:
            f = getattr(lib, name)
            f.argtypes = list(argtypes)
            f.restype = c_int
            return f

        self.launch = fn("cuLaunchKernel", vp, u, u, u, u, u, u, u, vp, vp, vp)
        self.record = fn("cuEventRecord", vp, vp)
        self.wait = fn("cuStreamWaitEvent", vp, vp, u)
        self.query = fn("cuEventQuery", vp)
        self.memcpy = fn("cuMemcpyAsync", ctypes.c_uint64, ctypes.c_uint64, size, vp)
        # CUDA 13's cuMemcpyBatchAsync (the 12.8 one had a failIdx argument more): only by its
        # versioned name, so an older driver simply has no batch path
        try:
            self.batch: Any = fn("cuMemcpyBatchAsync_v2", vp, vp, vp, size, vp, vp, size, vp)
        except AttributeError:
            self.batch = None

        class _Loc(ctypes.Structure):
            _fields_ = [("type", c_int), ("id", c_int)]

        class _Attrs(ctypes.Structure):  # CUmemcpyAttributes
            _fields_ = [("srcAccessOrder", c_int), ("srcLocHint", _Loc), ("dstLocHint", _Loc), ("flags", u)]

        self._attrs = _Attrs(1)  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        self._attr_idx = (size * 1)(0)
        self.batch_attrs = ctypes.addressof(self._attrs)
        self.batch_attr_idx = ctypes.addressof(self._attr_idx)

    def check(self, err: int, what: str) -> None:
        if err != CUDA_SUCCESS:
            raise RuntimeError(f"{what} failed: CUDA error {err}")


_FAST: FastDriver | None = None


def fast_driver() -> FastDriver:
    """The process's one ``FastDriver`` (libcuda is loaded once)."""
    global _FAST
    if _FAST is None:
        _FAST = FastDriver()
    return _FAST


def as_handle(h: Any) -> int:
    """A driver handle (cuda-bindings CUstream / CUevent / CUfunction, a ctypes pointer, or an
    int) as the integer ``FastDriver`` takes."""
    if isinstance(h, int):
        return h
    v = getattr(h, "value", None)
    if v is not None or type(h).__module__.startswith("ctypes"):
        return int(v or 0)
    return int(h)


@numba.njit(cache=True, nogil=True)
def _dma_runs(pool_bases, first, end, staging_base, slot_lanes, dst_base, src_base, scale, to_pool, out):  # type: ignore[no-untyped-def]
    """The staging DMAs of chunks [first, end): one per run of chunks whose pool slots are
    adjacent; chunk i sits at staging lane (staging_base + i) * slot_lanes. Writes
    (dst, src, size) = (base + lanes * scale) into out[0..2, k]; returns the number of runs."""
    k = 0
    i = first
    while i < end:
        j = i + 1
        while j < end and pool_bases[j] == pool_bases[j - 1] + slot_lanes:
            j += 1
        staged = (staging_base + i) * slot_lanes
        if to_pool:
            out[0, k] = dst_base + pool_bases[i] * scale
            out[1, k] = src_base + staged * scale
        else:
            out[0, k] = dst_base + staged * scale
            out[1, k] = src_base + pool_bases[i] * scale
        out[2, k] = (j - i) * slot_lanes * scale
        k += 1
        i = j
    return k


def _make_kernel(gather: bool) -> Any:
    """Build the gather (paged → slots) or scatter (slots → paged) kernel; ``gather`` is a
    compile-time constant, so each kernel has one straight copy loop."""

    @cuda.jit
    def kernel(paged, slots, params, desc):  # type: ignore[no-untyped-def]
        sh = cuda.shared.array(DESC_MAX, numba.int64)
        tid = cuda.threadIdx.x
        nthr = cuda.blockDim.x
        # One thread reads the header, so every thread of the CTA sees the same chunk count
        # even if the host rewrites it (``neutralize``) while the launch starts.
        if tid == 0:
            sh[D_NCHUNKS] = desc[D_NCHUNKS]
            sh[D_SKIP] = desc[D_SKIP]
        cuda.syncthreads()
        n_chunks = sh[D_NCHUNKS]
        bpc = params[P_BPC]
        n_desc = D_SLOTS + n_chunks + n_chunks * bpc
        i = D_SLOTS + tid
        while i < n_desc:
            sh[i] = desc[i]
            i += nthr
        cuda.syncthreads()

        n_layers = params[P_LAYERS]
        kv_size = params[P_KV]
        bs = params[P_BS]
        nh = params[P_NH]
        hl = params[P_HL]
        s_kv = params[P_SKV]
        s_blk = params[P_SBLK]
        s_tok = params[P_STOK]
        s_head = params[P_SHEAD]
        c_tok = params[P_C]
        skip = sh[D_SKIP]
        row = nh * hl
        unit = bs * row
        # NHD / FlashInfer / MLA: a block of one (layer, kv) is one contiguous run on both sides
        contiguous = s_tok == row and (s_head == hl or nh == 1)
        per_block = n_layers * kv_size
        ids0 = D_SLOTS + n_chunks
        n_units = n_chunks * bpc * per_block
        u = cuda.blockIdx.x
        while u < n_units:
            f = u // per_block
            if f >= skip:
                r = u - f * per_block
                layer = r // kv_size
                kv = r - layer * kv_size
                chunk = f // bpc
                j = f - chunk * bpc
                pb = params[P_COUNT + layer] + kv * s_kv + sh[ids0 + f] * s_blk
                sb = sh[D_SLOTS + chunk] + ((kv * n_layers + layer) * c_tok + j * bs) * row
                q0 = tid
                while q0 < unit:
                    q1 = q0 + nthr
                    q2 = q1 + nthr
                    q3 = q2 + nthr
                    if contiguous:
                        a0 = pb + q0
                        a1 = pb + q1
                        a2 = pb + q2
                        a3 = pb + q3
                    else:
                        a0 = pb + _paged_offset(q0, row, hl, s_tok, s_head)
                        a1 = pb + _paged_offset(q1, row, hl, s_tok, s_head)
                        a2 = pb + _paged_offset(q2, row, hl, s_tok, s_head)
                        a3 = pb + _paged_offset(q3, row, hl, s_tok, s_head)
                    if q3 < unit:
                        # four loads issued before any store: latency hiding over PCIe
                        if gather:
                            v0 = paged[a0]
                            v1 = paged[a1]
                            v2 = paged[a2]
                            v3 = paged[a3]
                            slots[sb + q0] = v0
                            slots[sb + q1] = v1
                            slots[sb + q2] = v2
                            slots[sb + q3] = v3
                        else:
                            v0 = slots[sb + q0]
                            v1 = slots[sb + q1]
                            v2 = slots[sb + q2]
                            v3 = slots[sb + q3]
                            paged[a0] = v0
                            paged[a1] = v1
                            paged[a2] = v2
                            paged[a3] = v3
                    else:
                        if gather:
                            slots[sb + q0] = paged[a0]
                            if q1 < unit:
                                slots[sb + q1] = paged[a1]
                            if q2 < unit:
                                slots[sb + q2] = paged[a2]
                        else:
                            paged[a0] = slots[sb + q0]
                            if q1 < unit:
                                paged[a1] = slots[sb + q1]
                            if q2 < unit:
                                paged[a2] = slots[sb + q2]
                    q0 += UNROLL * nthr
            u += cuda.gridDim.x

    return kernel


@cuda.jit(device=True)
def _paged_offset(q, row, hl, s_tok, s_head):  # type: ignore[no-untyped-def]
    t = q // row
    rr = q - t * row
    h = rr // hl
    return t * s_tok + h * s_head + (rr - h * hl)


gather_kernel = _make_kernel(True)
scatter_kernel = _make_kernel(False)


def warm_kernels(lane_dtypes: Sequence[Any] = (np.uint64,)) -> None:
    """Compile (or load) both kernels for these lane types now, by running each on an empty
    request. A server calls this at start-up so that registering an engine costs no JIT
    (about 0.6 s per kernel and lane type on an H200)."""
    # the request validation is numba njit too: compile (or load) it now, not on a first request
    from mpcache.kernels.layouts import PagedLayout

    g = KVGeometry(PagedLayout.NHD, num_layers=1, num_blocks=4, block_size=1, num_heads=1, head_size=4, itemsize=2,
                   chunk_tokens=2)
    check_request(g, 64, np.zeros((1, 2), np.int64), np.zeros(1, np.int64), 0)
    _dma_runs(np.zeros(1, np.int64), 0, 1, 0, 1, 0, 0, 1, True, np.zeros((3, 1), np.int64))
    if not numba.config.ENABLE_CUDASIM:
        # the compiled enqueue (about 2.4 s on an H200, not cacheable: it holds driver pointers), with
        # the argument types a transfer passes; if it cannot be built, transfers say why
        # (``enqueue_error``) and use the Python path
        try:
            z1, z2 = np.zeros(1, np.int64), np.zeros((1, 2), np.int64)
            fast_enqueue()(OP_DRY, z1, z1, 0, z2, np.zeros(S_COUNT, np.int64), np.zeros((7, 1), np.int64),
                           np.zeros((4, 1), np.int64), np.zeros((1, 64), np.int64), np.zeros((3, 1), np.int64), z1)
        except Exception:
            pass
    desc = cuda.mapped_array(DESC_MAX, dtype=np.int64)
    _host_view(desc)[D_NCHUNKS] = 0
    params = cuda.to_device(np.zeros(P_COUNT + 1, dtype=np.int64))
    for dt in lane_dtypes:
        paged = cuda.device_array(8, dtype=dt)
        slots = cuda.device_array(8, dtype=dt)
        gather_kernel[1, 32](paged, slots, params, desc)
        scatter_kernel[1, 32](paged, slots, params, desc)
    cuda.synchronize()


def kernel_params(geometry: KVGeometry, layer_offsets: Sequence[int]) -> np.ndarray:
    """The kernels' int64 parameter vector: ``geometry.lane_params()`` then each layer's base
    offset (in lanes) inside the ``paged`` span."""
    if len(layer_offsets) != geometry.num_layers:
        raise ValueError(f"expected {geometry.num_layers} layer offsets, got {len(layer_offsets)}")
    return np.concatenate([geometry.lane_params(), np.asarray(layer_offsets, dtype=np.int64)])


def span_device_buffers(pointers: Sequence[int], nbytes: int, lane_dtype: np.dtype) -> tuple[Any, list[int]]:
    """One flat lane device array covering every buffer (e.g. the engine's per-layer KV
    tensors, opened from IPC handles), and each buffer's offset in lanes within it.

    Only the listed buffers are ever indexed; the span between them is never touched. Raises
    ``ValueError`` if a buffer is not lane-aligned. Real GPU only (the simulator has no raw
    device pointers): tests build their ``paged`` array directly.
    """
    lane = np.dtype(lane_dtype).itemsize
    base = min(pointers)
    end = max(pointers) + nbytes
    if base % lane or any((p - base) % lane for p in pointers):
        raise ValueError(f"KV buffers are not aligned to {lane}-byte lanes")
    desc = {
        "shape": ((end - base) // lane,),
        "typestr": np.dtype(lane_dtype).str,
        "data": (base, False),
        "version": 3,
        "strides": None,
    }
    span = cuda.from_cuda_array_interface(desc, owner=None, sync=False)
    return span, [(p - base) // lane for p in pointers]


def raw_stream(stream: Any) -> Any:
    """A numba stream's driver handle as cuda.bindings wants it (real GPU only)."""
    from cuda.bindings import driver

    h = stream.handle
    if isinstance(h, driver.CUstream):
        return h
    return driver.CUstream(int(getattr(h, "value", h) or 0))


def device_pointer(array: Any) -> int:
    """Device address of a numba device / mapped array (real GPU only)."""
    return int(array.__cuda_array_interface__["data"][0])


class CudaKVTransfer:
    """Gather / scatter for one registered engine KV cache on one stream.

    ``paged``: lane device array spanning the engine's layer tensors; ``layer_offsets``: each
    layer's base in lanes within it. ``pool``: device-visible lane array of the L1 pool (mapped /
    registered pinned host memory). ``mode``: ``"zerocopy"``, ``"staging"``, or ``"auto"``
    (zero-copy below ``staging_min_chunks`` chunks per call, staging from there). ``max_ctas``:
    grid cap. ``max_chunks``: the most chunks one call may carry (bounds the descriptor and the
    staging buffer). Calls only enqueue work on ``stream``; the caller observes completion
    with an event recorded after the call. Not thread-safe: one thread makes the calls (the
    engine's copy lane, see ``make_copy_lane``, or the server's loop while that lane is idle).
    """

    def __init__(
        self,
        geometry: KVGeometry,
        paged: Any,
        layer_offsets: Sequence[int],
        pool: Any,
        *,
        mode: str = "zerocopy",
        max_ctas: int = 16,
        threads: int = 512,
        stream: Any = None,
        max_chunks: int = 32,
        ring: int = 256,
        raw_launch: bool = True,
        pipeline_pieces: int = 8,
        staging_min_chunks: int = 4,
        piece_growth: int = PIECE_GROWTH,
        staging_ctas: int = STAGING_CTAS,
        compiled_enqueue: bool = True,
    ) -> None:
        if mode not in ("zerocopy", "staging", "auto"):
            raise ValueError(f"mode must be 'zerocopy', 'staging' or 'auto', not {mode!r}")
        if D_SLOTS + max_chunks * (1 + geometry.blocks_per_chunk) > DESC_MAX:
            raise ValueError(f"max_chunks {max_chunks} does not fit the {DESC_MAX}-word descriptor")
        if max_ctas < 1 or not 1 <= threads <= 1024:
            raise ValueError("max_ctas >= 1 and 1 <= threads <= 1024")
        self.geometry = geometry
        self.mode = mode
        self.max_chunks = max_chunks
        self.pipeline_pieces = max(1, pipeline_pieces)
        self.piece_growth = max(2, piece_growth)
        # (the simulator runs every CTA as Python threads: keep its grids small)
        self.staging_ctas = max_ctas if numba.config.ENABLE_CUDASIM else max(1, staging_ctas)
        self._bpc = geometry.blocks_per_chunk
        self._piece_cache: dict[tuple[int, bool], list[tuple[int, int]]] = {}
        self.staging_min_chunks = staging_min_chunks
        self.stream = stream if stream is not None else cuda.stream()
        self._lane = geometry.lane_bytes
        self._slot_lanes = geometry.slot_bytes // self._lane
        self._pool = pool
        self._pool_lanes = int(pool.shape[0])
        self._params = cuda.to_device(kernel_params(geometry, layer_offsets), stream=self.stream)
        self._paged = paged
        self._layer_offsets = list(layer_offsets)
        self._sim = bool(numba.config.ENABLE_CUDASIM)
        self._gather = gather_kernel[max_ctas, threads, self.stream]
        self._scatter = scatter_kernel[max_ctas, threads, self.stream]
        # Into / out of device staging the kernels are bound by HBM, not PCIe, and short: a
        # wider grid ends them sooner for the same SM time, and the first piece's gather is on
        # a lone STORE's critical path (its DMA waits for it).
        self._gather_st = gather_kernel[self.staging_ctas, threads, self.stream]
        self._scatter_st = scatter_kernel[self.staging_ctas, threads, self.stream]
        # each descriptor holds one call's request; the kernel copies only its n_desc words
        words = -(-(D_SLOTS + max_chunks * (1 + geometry.blocks_per_chunk)) // 64) * 64
        if self._sim:
            self._desc = [cuda.mapped_array(words, dtype=np.int64) for _ in range(ring)]
            self._desc_host = [_host_view(d) for d in self._desc]
        else:  # one mapped block (the compiled enqueue writes it as a 2-D array), a view per entry
            self._desc_all = cuda.mapped_array((ring, words), dtype=np.int64)
            self._desc_2d = _host_view(self._desc_all)
            self._desc_host = [self._desc_2d[r] for r in range(ring)]
            dev0 = device_pointer(self._desc_all)
            self._desc = [cuda.from_cuda_array_interface(
                {"shape": (words,), "typestr": "<i8", "data": (dev0 + r * words * 8, False), "version": 3, "strides": None},
                owner=self._desc_all, sync=False) for r in range(ring)]
        self._events = [cuda.event() if self._sim else cuda.event(timing=False) for _ in range(ring)]
        self._used = [False] * ring
        self._cover = list(range(ring))  # entry -> the entry whose event follows its kernel
        self._next = 0
        if not self._sim:
            self._fd = fast_driver()
            self._event_h = [as_handle(e.handle) for e in self._events]
            self._sid = {id(self.stream): as_handle(raw_stream(self.stream))}
        if mode != "zerocopy":
            self._staging = cuda.device_array(max_chunks * self._slot_lanes, dtype=geometry.lane_dtype, stream=self.stream)
            self._staging_bases = np.arange(max_chunks, dtype=np.int64) * self._slot_lanes
            self._copy_stream = cuda.stream()
            self._memcpy = _Memcpy(self._copy_stream, self._sim, max_chunks, self._lane)
            # The staging buffer is a ring of chunk slots: a call takes the next free run, so
            # its kernels may fill staging while the DMAs of the calls before still drain it
            # (with join=False). A run is reused only after the work that last read it: the
            # DMAs of a STORE (copy stream) or the scatters of a RETRIEVE (compute stream),
            # each marked by a release event (one of RELEASE_EVENTS per stream, in turn).
            self._ring_cursor = 0
            self._released = {"copy": [-1] * max_chunks, "compute": [-1] * max_chunks}
            self._release_count = {"copy": 0, "compute": 0}
            if not self._sim:
                self._order_event_objs = [cuda.event(timing=False) for _ in range(2)]  # owners
                self._order_events = [as_handle(e.handle) for e in self._order_event_objs]
                self._raw_streams = {id(self.stream): raw_stream(self.stream), id(self._copy_stream): raw_stream(self._copy_stream)}
                self._sid[id(self._copy_stream)] = as_handle(self._raw_streams[id(self._copy_stream)])
                self._release_event_objs = {k: [cuda.event(timing=False) for _ in range(RELEASE_EVENTS)] for k in self._released}
                self._release_events = {k: [as_handle(e.handle) for e in v] for k, v in self._release_event_objs.items()}
        self._touched: set[str] = set()  # streams with work since the last completion_stream()
        if not self._sim:
            self._raw_compute = raw_stream(self.stream)
        self._raw: dict[tuple[int, int], _RawLaunch] = {}
        self.launch_path = "numba"
        self.launch_error = ""
        # Compile (or load) both kernels now, at registration, not on the first request: an
        # empty request (0 chunks) runs each once.
        check_request(geometry, self._pool_lanes, np.zeros((0, geometry.blocks_per_chunk), np.int64), np.zeros(0, np.int64), 0)
        self._desc_host[0][D_NCHUNKS] = 0
        for configured in (self._gather, self._scatter):
            configured(self._paged, self._pool, self._params, self._desc[0])
        self.stream.synchronize()
        self._enq: Any = None
        self.enqueue_path = "python"
        self.enqueue_error = ""
        if not self._sim and raw_launch:
            self._build_raw_launchers(max_ctas, threads)
            if self.launch_path == "raw" and compiled_enqueue and (mode == "zerocopy" or self._memcpy.path == "batch"):
                try:
                    self._setup_compiled_enqueue(ring, max_ctas, threads)
                except Exception as e:  # pragma: no cover - depends on the numba / driver build
                    self._enq = None
                    self.enqueue_error = f"{type(e).__name__}: {e}"

    # ---- public API ---------------------------------------------------------------------
    def uses_staging(self, n_chunks: int, busy: bool = False) -> bool:
        """Whether a call of ``n_chunks`` chunks goes through the device staging buffer (its
        pool side is then a DMA, which ``neutralize`` cannot cancel). ``auto``: from
        ``staging_min_chunks`` chunks, or for any call while earlier ones are still queued
        (``busy``): its kernel then overlaps their DMAs."""
        return self.mode == "staging" or (self.mode == "auto" and (busy or n_chunks >= self.staging_min_chunks))

    def gather(self, block_ids: np.ndarray, slot_offsets: Sequence[int] | np.ndarray, *, join: bool = True,
               busy: bool = False) -> list[int]:
        """Enqueue STORE: blocks ``[n_chunks, blocks_per_chunk]`` → the slots at byte offsets
        ``slot_offsets`` in the pool. Raises ``ValueError`` (before enqueuing anything) on a
        bad id or offset. Returns the descriptor entries the call's kernels read (for
        ``neutralize``).

        ``join=True``: everything the call enqueues is done when ``self.stream`` reaches this
        point (its DMAs are joined back). ``join=False``: they are not, so the next call's
        kernels can overlap them; record completion on ``completion_stream()`` instead."""
        ids, bases = check_request(self.geometry, self._pool_lanes, block_ids, slot_offsets, 0)
        n = bases.shape[0]
        self._check_size(n)
        if self._enq is not None:
            return self._compiled_call(False, self.uses_staging(n, busy), ids, bases, 0, join)
        staging = self.uses_staging(n, busy)
        self._touched.add("copy" if ends_on_copy_stream(False, staging, join) else "compute")
        if not staging:
            self._check_ring(1)
            return self._mark([self._launch(self._gather, self._pool, ids, bases, 0)])
        # Pipelined: the DMA of piece p (copy stream) overlaps the gather of piece p+1.
        bpc = self._bpc
        self._check_ring(len(self._pieces(n)))
        r0 = self._take_run(n)
        self._wait_released(r0, n, "copy", self.stream)
        used: list[int] = []
        for a, b in self._pieces(n):
            used.append(self._launch(self._gather_st, self._staging, ids[a * bpc : b * bpc], self._staging_bases[r0 + a : r0 + b], 0))
            self._order(self.stream, self._copy_stream, 0)
            self._copy_runs(bases, a, b, r0, to_pool=True)
        self._mark(used)
        self._release(r0, n, "copy", self._copy_stream)
        if join:
            self._order(self._copy_stream, self.stream, 1)
        return used

    def scatter(self, slot_offsets: Sequence[int] | np.ndarray, block_ids: np.ndarray, skip_blocks: int = 0, *,
                join: bool = True, busy: bool = False) -> list[int]:
        """Enqueue RETRIEVE: the slots → blocks, leaving the first ``skip_blocks`` blocks of the
        flattened block list untouched. Returns the descriptor entries used (``neutralize``).
        ``join=True``: the DMAs into staging come after everything enqueued on ``self.stream``
        before (as if on it); ``join=False``: only after what last read their staging run."""
        ids, bases = check_request(self.geometry, self._pool_lanes, block_ids, slot_offsets, skip_blocks)
        n = bases.shape[0]
        self._check_size(n)
        if self._enq is not None:
            return self._compiled_call(True, self.uses_staging(n, busy), ids, bases, skip_blocks, join)
        staging = self.uses_staging(n, busy)
        self._touched.add("copy" if ends_on_copy_stream(True, staging, join) else "compute")
        if not staging:
            self._check_ring(1)
            return self._mark([self._launch(self._scatter, self._pool, ids, bases, skip_blocks)])
        bpc = self.geometry.blocks_per_chunk
        used: list[int] = []
        first = skip_blocks // bpc  # chunks whose every block is skipped need not travel
        m = n - first
        if m == 0:
            return used
        self._check_ring(len(self._pieces(m, shrinking=True)))
        r0 = self._take_run(m)  # request chunk first + i <-> staging run slot r0 + i
        self._wait_released(r0, m, "compute", self._copy_stream)
        if join:
            self._order(self.stream, self._copy_stream, 0)
        # the scatter of piece p overlaps the DMA of piece p+1; pieces shrink, so the last
        # scatter, which nothing hides, is small
        for a, b in self._pieces(m, shrinking=True):
            self._copy_runs(bases, first + a, first + b, r0 - first, to_pool=False)
            self._order(self._copy_stream, self.stream, 1)
            skip = min(max(skip_blocks - (first + a) * bpc, 0), (b - a) * bpc)
            used.append(self._launch(self._scatter_st, self._staging, ids[(first + a) * bpc : (first + b) * bpc],
                                     self._staging_bases[r0 + a : r0 + b], skip))
        self._mark(used)
        self._release(r0, m, "compute", self.stream)
        return used

    def raw_streams(self) -> list[Any]:
        """The raw handles of the streams this transfer enqueues on: compute first, then the
        copy stream if it has one. Real GPU only."""
        if self.mode == "zerocopy":
            return [self._raw_compute]
        return [self._raw_compute, self._raw_streams[id(self._copy_stream)]]

    def completion_stream(self) -> Any:
        """The raw stream on which an event recorded now follows everything enqueued since the
        last call of this method (joins the copy stream into the compute stream if both have
        work). Real GPU only."""
        touched, self._touched = self._touched, set()
        if touched == {"copy"}:
            return self._raw_streams[id(self._copy_stream)]
        if "copy" in touched:
            self._order(self._copy_stream, self.stream, 1)
        return self._raw_compute

    def wait_event(self, event: Any) -> None:
        """Kernels enqueued from now on wait on the device for ``event`` (a driver CUevent, e.g.
        an engine's interprocess event); never blocks here. Only the compute stream waits: the
        kernels are what touch the engine's blocks (staging DMAs touch only L1 and staging).
        Real GPU only."""
        err = self._fd.wait(self._sid[id(self.stream)], as_handle(event), 0)
        if err != CUDA_SUCCESS:
            raise RuntimeError(f"cuStreamWaitEvent failed: CUDA error {err}")

    def record_completion(self, event: Any) -> None:
        """Record ``event`` (a driver CUevent) after everything enqueued since the last
        ``completion_stream`` / ``record_completion``. Real GPU only."""
        stream = self.completion_stream()
        err = self._fd.record(as_handle(event), self._sid_of_raw(stream))
        if err != CUDA_SUCCESS:
            raise RuntimeError(f"cuEventRecord failed: CUDA error {err}")

    def _sid_of_raw(self, raw: Any) -> int:
        return self._sid[id(self._copy_stream)] if raw is not self._raw_compute else self._sid[id(self.stream)]

    def neutralize(self, entries: Sequence[int]) -> None:
        """Turn the kernels that will read these descriptor entries into no-ops (chunk count
        0), for work that is enqueued but has not started (e.g. waiting on an engine's event
        that never fires). A kernel that already read its descriptor is not affected."""
        for r in entries:
            self._desc_host[r][D_NCHUNKS] = 0

    # ---- internals ----------------------------------------------------------------------
    def _setup_compiled_enqueue(self, ring: int, max_ctas: int, threads: int) -> None:
        """The state the compiled enqueue works on (see ``_make_enqueue``), from what the
        Python path set up: handles, packed launch arguments, release events, DMA arrays."""
        fd = self._fd
        st = np.zeros(S_COUNT, dtype=np.int64)
        st[S_RING] = ring
        st[S_COMPUTE] = self._sid[id(self.stream)]
        st[S_CTAS] = max_ctas
        st[S_ST_CTAS] = self.staging_ctas
        st[S_THREADS] = threads
        st[S_BPC] = self._bpc
        st[S_SLOT_LANES] = self._slot_lanes
        st[S_MAX_CHUNKS] = self.max_chunks
        table = np.zeros((7, ring), dtype=np.int64)
        table[R_COVER] = np.arange(ring)
        table[R_EVENT] = self._event_h
        rows = [(R_P_G, self._gather, self._pool, S_F_G), (R_P_S, self._scatter, self._pool, S_F_S)]
        rel = np.full((4, max(self.max_chunks, RELEASE_EVENTS)), -1, dtype=np.int64)
        if self.mode != "zerocopy":
            rows += [(R_P_GST, self._gather_st, self._staging, S_F_GST), (R_P_SST, self._scatter_st, self._staging, S_F_SST)]
            st[S_COPY] = self._sid[id(self._copy_stream)]
            st[S_ORD0], st[S_ORD1] = self._order_events
            m = self._memcpy
            st[S_POOL] = m.base(self._pool)
            st[S_STAGING] = m.base(self._staging)
            st[S_SCALE] = m.scale
            st[S_RUNS0], st[S_RUNS1], st[S_RUNS2] = m._rows
            st[S_ATTRS] = fd.batch_attrs
            st[S_ATTR_IDX] = fd.batch_attr_idx
            rel[2, :RELEASE_EVENTS] = self._release_events["copy"]
            rel[3, :RELEASE_EVENTS] = self._release_events["compute"]
            self._runs = m.runs
        else:
            self._runs = np.zeros((3, 1), dtype=np.int64)
        for row, configured, slots, func in rows:
            raw = self._raw[(id(configured), id(slots))]
            table[row] = raw._params
            st[func] = raw._func
        self._st, self._ring_table, self._rel = st, table, rel
        self._used_out = np.zeros(self.pipeline_pieces + 1, dtype=np.int64)
        self._one_piece = np.zeros((1, 2), dtype=np.int64)
        self._piece_arrays: dict[tuple[int, bool], np.ndarray] = {}
        enq = fast_enqueue()
        enq(OP_DRY, self._one_piece[0], self._one_piece[0], 0, self._one_piece, st, table, rel, self._desc_2d, self._runs,
            self._used_out)  # compiled now (once per process), not on a first request
        self._enq = enq
        self.enqueue_path = "compiled"

    def lane_state(self) -> dict[str, Any] | None:
        """What a copy lane (``make_copy_lane``) needs to make this transfer's calls itself: the
        compiled enqueue's state arrays, the staging pieces of every call size, the mode. None
        when calls do not go through the compiled enqueue (then the caller makes them). From the
        moment a lane runs, only the lane makes calls, except while it is idle."""
        if self._enq is None:
            return None
        mc, pp = self.max_chunks, self.pipeline_pieces
        pieces = np.zeros((2, mc + 1, pp, 2), dtype=np.int64)
        npieces = np.zeros((2, mc + 1), dtype=np.int64)
        for scatter in (0, 1):
            for m in range(1, mc + 1):
                ps = self._pieces(m, bool(scatter))
                npieces[scatter, m] = len(ps)
                pieces[scatter, m, : len(ps)] = ps
        cfg = np.zeros(G_COUNT, dtype=np.int64)
        cfg[G_BPC] = self._bpc
        cfg[G_MAX_CHUNKS] = mc
        cfg[G_USED] = pp + 1
        return {"st": self._st, "ring": self._ring_table, "rel": self._rel, "desc": self._desc_2d, "runs": self._runs,
                "used": np.zeros(pp + 1, dtype=np.int64), "pieces": pieces, "npieces": npieces,
                "one_piece": self._one_piece, "cfg": cfg, "pool_lanes": self._pool_lanes}

    def _compiled_call(self, scatter: bool, staging: bool, ids: np.ndarray, bases: np.ndarray, skip: int,
                       join: bool) -> list[int]:
        op = (OP_SCATTER if scatter else 0) | (OP_STAGING if staging else 0) | (OP_JOIN if join else 0)
        if staging:
            m = bases.shape[0] - (skip // self._bpc if scatter else 0)
            if m == 0:
                return []
            key = (m, scatter)
            pieces = self._piece_arrays.get(key)
            if pieces is None:
                pieces = self._piece_arrays[key] = np.asarray(self._pieces(m, scatter), dtype=np.int64).reshape(-1, 2)
        else:
            pieces = self._one_piece
        st = self._st
        cnt = self._enq(op, ids, bases, skip, pieces, st, self._ring_table, self._rel, self._desc_2d, self._runs,
                        self._used_out)
        self._touched.add("copy" if ends_on_copy_stream(scatter, staging, join) else "compute")
        err = int(st[S_ERR])
        if err:
            st[S_ERR] = 0
            if err == ERR_RING_FULL:
                # the kernel that read an entry 'ring' launches ago has not run yet: never wait
                # here (the server's loop thread or a copy lane); the caller fails this request
                raise RuntimeError(f"descriptor ring full: {len(self._desc)} launches of this engine still queued")
            where = {W_LAUNCH: "cuLaunchKernel", W_RECORD: "cuEventRecord", W_WAIT: "cuStreamWaitEvent",
                     W_COPY: "staging DMA"}.get(int(st[S_WHERE]), "driver call")
            raise RuntimeError(f"{where} failed: CUDA error {err - 1000}")
        return self._used_out[:cnt].tolist()

    def _check_size(self, n: int) -> None:
        if n > self.max_chunks:
            raise ValueError(f"{n} chunks in one call; this transfer was built for at most {self.max_chunks}")

    def _take_run(self, n: int) -> int:
        if self._ring_cursor + n > self.max_chunks:
            self._ring_cursor = 0
        r0 = self._ring_cursor
        self._ring_cursor += n
        return r0

    def _wait_released(self, r0: int, n: int, which: str, stream: Any) -> None:
        """``stream`` waits for the last work of kind ``which`` that read staging slots
        [r0, r0 + n). (A release event recorded again since only waits for later work of the
        same stream, which was enqueued before this call: never a deadlock.)"""
        last = max(self._released[which][r0 : r0 + n])
        if last < 0 or self._sim:
            return
        err = self._fd.wait(self._sid[id(stream)], self._release_events[which][last % RELEASE_EVENTS], 0)
        if err != CUDA_SUCCESS:
            raise RuntimeError(f"staging wait failed: CUDA error {err}")

    def _release(self, r0: int, n: int, which: str, stream: Any) -> None:
        k = self._release_count[which]
        self._release_count[which] = k + 1
        self._released[which][r0 : r0 + n] = [k] * n
        if self._sim:
            return
        err = self._fd.record(self._release_events[which][k % RELEASE_EVENTS], self._sid[id(stream)])
        if err != CUDA_SUCCESS:
            raise RuntimeError(f"staging release record failed: CUDA error {err}")

    def _check_ring(self, k: int) -> None:
        """Before a call enqueues anything: its next ``k`` descriptor entries must be free."""
        if self._sim:
            return
        for i in range(k):
            r = (self._next + i) % len(self._desc)
            if self._used[r] and self._fd.query(self._event_h[self._cover[r]]) == CUDA_ERROR_NOT_READY:
                # the kernel that read this entry 'ring' launches ago has not run yet: never wait
                # here (the server's loop thread or a copy lane); the caller fails this request
                raise RuntimeError(f"descriptor ring full: {len(self._desc)} launches of this engine still queued")

    def _launch(self, configured: Any, slots: Any, ids: np.ndarray, bases: np.ndarray, skip: int) -> int:
        r = self._next
        self._next = (r + 1) % len(self._desc)
        h = self._desc_host[r]
        n = bases.shape[0]
        h[D_NCHUNKS] = n
        h[D_SKIP] = skip
        h[D_SLOTS : D_SLOTS + n] = bases
        h[D_SLOTS + n : D_SLOTS + n + ids.shape[0]] = ids
        raw = self._raw.get((id(configured), id(slots))) if self._raw else None
        if raw is not None:
            raw.launch(r)
        else:
            configured(self._paged, slots, self._params, self._desc[r])
        self._used[r] = True
        return r

    def _mark(self, used: list[int]) -> list[int]:
        """One event after the kernels of a call (all on ``self.stream``): the last entry's,
        which every entry of the call then points to. Entry r is reused only once that event
        has fired (``_launch``); an entry of a later call takes r's place only after r
        itself, so the event is not re-recorded before then."""
        if used:
            last = used[-1]
            for r in used:
                self._cover[r] = last
            if self._sim:
                self._events[last].record(self.stream)
            else:
                err = self._fd.record(self._event_h[last], self._sid[id(self.stream)])
                if err != CUDA_SUCCESS:
                    raise RuntimeError(f"cuEventRecord failed: CUDA error {err}")
        return used

    def _build_raw_launchers(self, max_ctas: int, threads: int) -> None:
        """Pre-pack each (kernel, slots array, descriptor) launch so a call is one
        cuLaunchKernel. numba's own launch re-derives the types and re-packs every argument on
        each call (tens of microseconds of host time); here that happens once. If this numba
        build lays kernels out differently, keep numba's launch (``launch_path`` says which)."""
        self._raw = {}
        self.launch_path = "numba"
        try:
            for dispatcher, configured, slots, grid in (
                    (gather_kernel, self._gather, self._pool, max_ctas), (scatter_kernel, self._scatter, self._pool, max_ctas),
                    *(((gather_kernel, self._gather_st, self._staging, self.staging_ctas),
                       (scatter_kernel, self._scatter_st, self._staging, self.staging_ctas)) if self.mode != "zerocopy" else ())):
                self._raw[(id(configured), id(slots))] = _RawLaunch(
                    dispatcher, (self._paged, slots, self._params), self._desc, grid, threads, self.stream)
            self.launch_path = "raw"
        except Exception as e:  # pragma: no cover - depends on the numba-cuda build
            self._raw = {}
            self.launch_error = f"{type(e).__name__}: {e}"

    def _copy_runs(self, pool_bases: np.ndarray, first: int, end: int, staging_base: int, *, to_pool: bool) -> None:
        """On the copy stream: one DMA per run of chunks in [first, end) whose slots are adjacent
        in the pool (all in one batch call where the driver has it); chunk i uses staging chunk
        ``staging_base + i``."""
        m = self._memcpy
        dst, src = (self._pool, self._staging) if to_pool else (self._staging, self._pool)
        count = _dma_runs(pool_bases, first, end, staging_base, self._slot_lanes, m.base(dst), m.base(src), m.scale,
                          to_pool, m.runs)
        m.submit(dst, src, count)

    @property
    def memcpy_path(self) -> str:
        """How staging DMAs are issued: ``batch`` (one cuMemcpyBatchAsync per piece), ``each``
        (one cuMemcpyAsync per run of adjacent slots) or ``none`` (zero-copy only)."""
        return self._memcpy.path if self.mode != "zerocopy" else "none"

    @property
    def memcpy_error(self) -> str:
        """Why staging DMAs are not batched (the batch call's error), or ``""``."""
        return self._memcpy.batch_error if self.mode != "zerocopy" else ""

    def _pieces(self, n: int, shrinking: bool = False) -> list[tuple[int, int]]:
        """Pieces of 1, g, g*g, ... chunks (g = ``piece_growth``; at most ``pipeline_pieces``;
        the last takes the rest): for a STORE the first DMA starts after one chunk's kernel, and
        each kernel (HBM-bound, on ``staging_ctas`` CTAs) hides behind the DMA of the piece
        before. Each piece costs a launch, an ordering and a DMA call of host time, so g = 4
        (measured on an H200: 1 + 7 pieces for 8 chunks end 5.02 ms after the call, against
        4.99 ms for 1 + 2 + 5, at 79 instead of 101 us of host time). ``shrinking`` (RETRIEVE,
        kernel after DMA): the same sizes in reverse, so the last kernel is small."""
        cached = self._piece_cache.get((n, shrinking))
        if cached is not None:
            return cached
        sizes: list[int] = []
        left, size = n, 1
        while left > 0:
            if len(sizes) == self.pipeline_pieces - 1 or (sizes and left - size < self.piece_growth * size):
                take = left  # the rest (a first piece is one chunk: the first DMA starts soonest)
            else:
                take = min(size, left)
            sizes.append(take)
            left -= take
            size *= self.piece_growth
        if shrinking:
            sizes.reverse()
        out, a = [], 0
        for k in sizes:
            out.append((a, a + k))
            a += k
        self._piece_cache[(n, shrinking)] = out
        return out

    def _order(self, before: Any, after: Any, which: int) -> None:
        """Work enqueued on ``after`` from now on runs after everything enqueued on ``before``
        so far. An event may be re-recorded once the wait is enqueued (the wait captured it)."""
        if self._sim:
            return  # simulator streams are synchronous
        fd = self._fd
        ev = self._order_events[which]
        err = fd.record(ev, self._sid[id(before)])
        if err == CUDA_SUCCESS:
            err = fd.wait(self._sid[id(after)], ev, 0)
        if err != CUDA_SUCCESS:
            raise RuntimeError(f"stream ordering failed: CUDA error {err}")


# ---- the enqueue path in one compiled call (real GPU) ----------------------------------------
# Scalars of a transfer's compiled enqueue state (``st``, int64; handles as their bit patterns).
(S_ERR, S_WHERE, S_NEXT, S_RING, S_COMPUTE, S_COPY, S_ORD0, S_ORD1, S_CTAS, S_ST_CTAS, S_THREADS, S_F_G, S_F_S,
 S_POOL, S_STAGING, S_SCALE, S_SLOT_LANES, S_BPC, S_ATTRS, S_ATTR_IDX, S_RUNS0, S_RUNS1, S_RUNS2, S_RELC_COPY,
 S_RELC_COMPUTE, S_CURSOR, S_MAX_CHUNKS, S_F_GST, S_F_SST, S_COUNT) = range(30)
# Rows of the descriptor ring table (``ring``): in use, covering entry, event, packed launch
# arguments of gather / scatter with the pool, and with staging.
R_USED, R_COVER, R_EVENT, R_P_G, R_P_S, R_P_GST, R_P_SST = range(7)
ERR_RING_FULL = 1  # st[S_ERR]; a failed driver call: 1000 + its CUDA error, st[S_WHERE] says which call
OP_SCATTER, OP_STAGING, OP_JOIN, OP_DRY = 1, 2, 4, 8
W_LAUNCH, W_RECORD, W_WAIT, W_COPY = 1, 2, 3, 4

_ENQUEUE: Any = None


def fast_enqueue() -> Any:
    """The process's compiled enqueue (``_make_enqueue``), built on first use."""
    global _ENQUEUE
    if _ENQUEUE is None:
        _ENQUEUE = _make_enqueue()
    return _ENQUEUE


def _make_enqueue(lib: Any = None) -> Any:
    """One njit function that makes a whole gather / scatter call's driver calls: the ring
    check, descriptor fills, launches, stream orderings, the staging DMA runs and batch copy,
    the release and completion records, with the same steps in the same order as
    ``CudaKVTransfer``'s Python path (which the simulator runs). The driver functions are
    ctypes pointers into libcuda that numba calls directly: a call costs one dispatch plus the
    driver's own time, instead of tens of Python statements per piece. ``lib``: where the
    driver functions come from (``lib[name]``; default libcuda; tests pass ctypes callbacks)."""
    import ctypes

    if lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32

    def fn(name: str, *argtypes: Any) -> Any:
        f = lib[name]  # (item access: a new function object, not the one FastDriver configured)
        f.argtypes = list(argtypes)
        f.restype = ctypes.c_int
        return f

    cu_launch = fn("cuLaunchKernel", u64, u32, u32, u32, u32, u32, u32, u32, u64, u64, u64)
    cu_record = fn("cuEventRecord", u64, u64)
    cu_wait = fn("cuStreamWaitEvent", u64, u64, u32)
    cu_query = fn("cuEventQuery", u64)
    cu_copy = fn("cuMemcpyAsync", u64, u64, u64, u64)
    cu_batch = fn("cuMemcpyBatchAsync_v2", u64, u64, u64, u64, u64, u64, u64, u64)

    @numba.njit(nogil=False)
    def record(st, ev, stream):  # type: ignore[no-untyped-def]
        err = cu_record(np.uint64(ev), np.uint64(stream))
        if err != 0 and st[S_ERR] == 0:
            st[S_ERR] = 1000 + err
            st[S_WHERE] = W_RECORD
        return err == 0

    @numba.njit(nogil=False)
    def wait(st, stream, ev):  # type: ignore[no-untyped-def]
        err = cu_wait(np.uint64(stream), np.uint64(ev), np.uint32(0))
        if err != 0 and st[S_ERR] == 0:
            st[S_ERR] = 1000 + err
            st[S_WHERE] = W_WAIT
        return err == 0

    @numba.njit(nogil=False)
    def order(st, before, after, ev):  # type: ignore[no-untyped-def]
        return record(st, ev, before) and wait(st, after, ev)

    @numba.njit(nogil=False)
    def take_entry(st, desc, n, skip):  # type: ignore[no-untyped-def]
        """The next descriptor ring entry, its header written (chunk count, skip)."""
        r = st[S_NEXT]
        st[S_NEXT] = (r + 1) % st[S_RING]
        desc[r, D_NCHUNKS] = n
        desc[r, D_SKIP] = skip
        return r

    @numba.njit(nogil=False)
    def fire(st, ring, row, r, func, grid):  # type: ignore[no-untyped-def]
        """Launch the kernel ``func`` on entry r's descriptor (launch arguments: ``ring[row, r]``)."""
        err = cu_launch(np.uint64(func), np.uint32(grid), np.uint32(1), np.uint32(1), np.uint32(st[S_THREADS]),
                        np.uint32(1), np.uint32(1), np.uint32(0), np.uint64(st[S_COMPUTE]), np.uint64(ring[row, r]),
                        np.uint64(0))
        ring[R_USED, r] = 1
        if err != 0 and st[S_ERR] == 0:
            st[S_ERR] = 1000 + err
            st[S_WHERE] = W_LAUNCH
        return r

    @numba.njit(nogil=False)
    def launch(st, ring, desc, row, grid, ids, i0, i1, base0, skip):  # type: ignore[no-untyped-def]
        """Staging kernel for chunks [i0, i1) of the call into the next ring entry; chunk
        i0 + k at staging lane base0 + k * slot lanes."""
        n = i1 - i0
        bpc = st[S_BPC]
        r = take_entry(st, desc, n, skip)
        for k in range(n):
            desc[r, D_SLOTS + k] = base0 + k * st[S_SLOT_LANES]
        for k in range(n * bpc):
            desc[r, D_SLOTS + n + k] = ids[i0 * bpc + k]
        return fire(st, ring, row, r, st[S_F_GST] if row == R_P_GST else st[S_F_SST], grid)

    @numba.njit(nogil=False)
    def launch_direct(st, ring, desc, row, ids, bases, skip):  # type: ignore[no-untyped-def]
        """Zero-copy kernel for the whole call (its own pool slot bases) into the next entry."""
        n = bases.shape[0]
        r = take_entry(st, desc, n, skip)
        for k in range(n):
            desc[r, D_SLOTS + k] = bases[k]
        for k in range(ids.shape[0]):
            desc[r, D_SLOTS + n + k] = ids[k]
        return fire(st, ring, row, r, st[S_F_G] if row == R_P_G else st[S_F_S], st[S_CTAS])

    @numba.njit(nogil=False)
    def copy_runs(st, runs, bases, first, end, staging_base, to_pool):  # type: ignore[no-untyped-def]
        if to_pool:
            count = _dma_runs(bases, first, end, staging_base, st[S_SLOT_LANES], st[S_POOL], st[S_STAGING], st[S_SCALE],
                              True, runs)
        else:
            count = _dma_runs(bases, first, end, staging_base, st[S_SLOT_LANES], st[S_STAGING], st[S_POOL], st[S_SCALE],
                              False, runs)
        if count > 1:
            err = cu_batch(np.uint64(st[S_RUNS0]), np.uint64(st[S_RUNS1]), np.uint64(st[S_RUNS2]), np.uint64(count),
                           np.uint64(st[S_ATTRS]), np.uint64(st[S_ATTR_IDX]), np.uint64(1), np.uint64(st[S_COPY]))
        else:
            err = cu_copy(np.uint64(runs[0, 0]), np.uint64(runs[1, 0]), np.uint64(runs[2, 0]), np.uint64(st[S_COPY]))
        if err != 0 and st[S_ERR] == 0:
            st[S_ERR] = 1000 + err
            st[S_WHERE] = W_COPY

    @numba.njit(nogil=False)
    def take_run(st, rel, which, n, stream):  # type: ignore[no-untyped-def]
        """The next run of n staging slots; ``stream`` waits for the last work of kind
        ``which`` (0: a STORE's DMAs, 1: a RETRIEVE's scatters) that read any of them."""
        if st[S_CURSOR] + n > st[S_MAX_CHUNKS]:
            st[S_CURSOR] = 0
        r0 = st[S_CURSOR]
        st[S_CURSOR] = r0 + n
        last = -1
        for i in range(r0, r0 + n):
            last = max(last, rel[which, i])
        if last >= 0:
            wait(st, stream, rel[2 + which, last % RELEASE_EVENTS])
        return r0

    @numba.njit(nogil=False)
    def release(st, rel, which, r0, n, stream):  # type: ignore[no-untyped-def]
        """Staging slots [r0, r0 + n) were last read by what ``stream`` holds now."""
        counter = S_RELC_COPY if which == 0 else S_RELC_COMPUTE
        k = st[counter]
        st[counter] = k + 1
        for i in range(r0, r0 + n):
            rel[which, i] = k
        record(st, rel[2 + which, k % RELEASE_EVENTS], stream)

    @numba.njit(nogil=False)
    def enqueue(op, ids, bases, skip, pieces, st, ring, rel, desc, runs, used):  # type: ignore[no-untyped-def]
        """One call. Returns the number of ring entries used (written to ``used``); on error
        st[S_ERR] is set (a full ring is found before anything is enqueued)."""
        if op & OP_DRY:
            return 0
        scatter = (op & OP_SCATTER) != 0
        staging = (op & OP_STAGING) != 0
        join = (op & OP_JOIN) != 0
        n_launch = pieces.shape[0] if staging else 1
        ring_n = st[S_RING]
        for k in range(n_launch):  # the ring entries this call will take must all be free
            r = (st[S_NEXT] + k) % ring_n
            if ring[R_USED, r] != 0 and cu_query(np.uint64(ring[R_EVENT, ring[R_COVER, r]])) == CUDA_ERROR_NOT_READY:
                st[S_ERR] = ERR_RING_FULL
                return 0
        cnt = 0
        n = bases.shape[0]
        bpc = st[S_BPC]
        if not staging:
            used[0] = launch_direct(st, ring, desc, R_P_S if scatter else R_P_G, ids, bases, skip)
            cnt = 1
        elif not scatter:
            # STORE: gather piece p into staging, its DMA on the copy stream overlaps piece p+1
            r0 = take_run(st, rel, 0, n, st[S_COMPUTE])
            for p in range(pieces.shape[0]):
                if st[S_ERR] != 0:
                    break
                a = pieces[p, 0]
                b = pieces[p, 1]
                used[cnt] = launch(st, ring, desc, R_P_GST, st[S_ST_CTAS], ids, a, b, (r0 + a) * st[S_SLOT_LANES], 0)
                cnt += 1
                if st[S_ERR] == 0 and order(st, st[S_COMPUTE], st[S_COPY], st[S_ORD0]):
                    copy_runs(st, runs, bases, a, b, r0, True)
            release(st, rel, 0, r0, n, st[S_COPY])
            if join and st[S_ERR] == 0:
                order(st, st[S_COPY], st[S_COMPUTE], st[S_ORD1])
        else:
            # RETRIEVE: DMA piece p into staging, scatter it while piece p+1's DMA runs
            first = skip // bpc
            m = n - first
            if m == 0:
                return 0
            r0 = take_run(st, rel, 1, m, st[S_COPY])
            if join:
                order(st, st[S_COMPUTE], st[S_COPY], st[S_ORD0])
            for p in range(pieces.shape[0]):
                if st[S_ERR] != 0:
                    break
                a = pieces[p, 0]
                b = pieces[p, 1]
                copy_runs(st, runs, bases, first + a, first + b, r0 - first, False)
                if st[S_ERR] != 0 or not order(st, st[S_COPY], st[S_COMPUTE], st[S_ORD1]):
                    break
                sk = min(max(skip - (first + a) * bpc, 0), (b - a) * bpc)
                used[cnt] = launch(st, ring, desc, R_P_SST, st[S_ST_CTAS], ids, first + a, first + b,
                                   (r0 + a) * st[S_SLOT_LANES], sk)
                cnt += 1
            release(st, rel, 1, r0, m, st[S_COMPUTE])
        # one event after the call's kernels, which every entry of the call points to (also
        # after a failed driver call: the entries launched so far must not be reused early)
        if cnt == 0:
            return 0
        lastr = used[cnt - 1]
        for i in range(cnt):
            ring[R_COVER, used[i]] = lastr
        record(st, ring[R_EVENT, lastr], st[S_COMPUTE])
        return cnt

    @numba.njit(nogil=False)
    def query(ev):  # type: ignore[no-untyped-def]
        return cu_query(np.uint64(ev))

    enqueue.record_fn = record  # type: ignore[attr-defined]  # for the copy lane (make_copy_lane)
    enqueue.wait_fn = wait  # type: ignore[attr-defined]
    enqueue.query_fn = query  # type: ignore[attr-defined]
    return enqueue


# ---- the copy lane: a thread that enqueues an engine's copies with no Python -----------------
# Control words of a lane (``ctl``, int64): rows written by the loop, rows the lane has done, stop,
# the instance failed (rows after it are skipped, untouched); and when the lane also watches its
# rows' completion events: rows seen complete, watch (1: the lane looks; the waiter sets 0 to take
# over), and the lane's answer that it no longer looks (1; C_SEEN then moves no more).
C_WRITTEN, C_DONE, C_STOP, C_FAILED, C_SEEN, C_WATCH, C_WATCH_OFF, C_COUNT = 0, 1, 2, 3, 4, 5, 6, 8
# A lane row (int64): the loop writes the request, the lane the outcome. ``H_IDS``: the flat block
# ids (n * blocks per chunk), then ``max_chunks * bpc`` words on, the n slot bases (lanes); the
# descriptor entries the call used follow at ``lane_row_width``'s last words. ``H_T_DUE``: when the
# loop's link model expects the copy done (CLOCK_MONOTONIC ns); a watching lane writes what it saw
# there: the event's query result, when, after how many looks, the pause before the last, and
# whether its first look was at the due time (not later).
(H_KIND, H_N, H_SKIP, H_STAGING, H_WEV, H_CEV, H_ERR, H_WHERE, H_NUSED, H_RECORDED, H_T_HAND, H_T_PICK, H_T_DONE,
 H_T_DUE, H_Q, H_T_SEEN, H_POLLS, H_PAUSE, H_AIMED, H_IDS) = range(20)
K_STORE, K_RETRIEVE, K_WATCH = 0, 1, 2  # H_KIND; K_WATCH: the loop enqueued it, the lane only watches its event
LANE_SKIPPED = -1  # H_ERR of a row the lane did not enqueue (its instance had failed)
# How a watching lane paces its looks (``watch``, int64): the loop's wake-up descriptor (-1: none),
# then the waiter's schedule in ns: the first look this long before the due time; pauses from
# FINE doubling to FINE_MAX for FINE_SPAN after the due time, then MID until MID_SPAN, then SLOW.
(WATCH_WAKE_FD, WATCH_AIM_EARLY, WATCH_FINE, WATCH_FINE_MAX, WATCH_FINE_SPAN, WATCH_MID, WATCH_MID_SPAN, WATCH_SLOW,
 WATCH_COUNT) = range(9)
# Lane parameters (``cfg``, int64): blocks per chunk, max chunks, used-entry words per row. (Whether a
# call goes through staging is the loop's decision, ``CudaKVTransfer.uses_staging``, in its row.)
G_BPC, G_MAX_CHUNKS, G_USED, G_COUNT = range(4)


def ends_on_copy_stream(scatter: bool, staging: bool, join: bool) -> bool:
    """Whether the last work of a call that enqueued something is on the copy stream, where its
    completion must then be recorded: a STORE through staging whose DMAs into L1 are not joined
    back into the compute stream. Every other call ends on the compute stream. The one rule for
    ``CudaKVTransfer`` (``completion_stream``) and the copy lane (compiled from this very function)."""
    return staging and not scatter and not join


_ends_on_copy_stream = numba.njit(nogil=True)(ends_on_copy_stream)


@numba.njit(cache=True)  # holds the GIL: a sub-microsecond call that released it would let other threads in
def fill_lane_row(row, ids, offs, scatter, skip, staging, wev, cev, t_hand, num_blocks, lane_bytes, slot_lanes,  # type: ignore[no-untyped-def]
                  pool_lanes, bases_at):
    """Write one call into a copy lane's ``row`` in one compiled call: ``kernels.cpu.validate_call``
    checks the block ids (``ids``: C-contiguous ``[n_chunks, bpc]``) and slot offsets and writes
    the slot bases straight into the row (at ``bases_at``), then the flat ids and the header
    (``H_*``: kind, count, skip, staging, the worker's and completion events, ``t_hand``). 0, or
    ``validate_call``'s error: the row is then not to be handed over (the loop has not counted
    it written, so the lane never reads it)."""
    n = offs.shape[0]
    flat = ids.reshape(ids.size)
    err = validate_call(flat, offs, num_blocks, lane_bytes, slot_lanes, pool_lanes, row[bases_at : bases_at + n])
    if err != 0:
        return err
    for i in range(flat.size):
        row[H_IDS + i] = flat[i]
    row[H_KIND] = 1 if scatter else 0
    row[H_N] = n
    row[H_SKIP] = skip
    row[H_STAGING] = 1 if staging else 0
    row[H_WEV] = wev
    row[H_CEV] = cev
    row[H_T_HAND] = t_hand
    return 0


def lane_row_width(max_chunks: int, bpc: int, used: int) -> int:
    return H_IDS + max_chunks * bpc + max_chunks + used


_LANE: Any = None


def fast_copy_lane() -> Any:
    """The process's compiled copy lane (``make_copy_lane`` on the process's enqueue)."""
    global _LANE
    if _LANE is None:
        _LANE = make_copy_lane(fast_enqueue())
    return _LANE


def warm_copy_lane(lane: Any, max_chunks: int = 4, bpc: int = 2, used: int = 2) -> None:
    """Compile ``lane`` for the argument types a copy lane runs with (seconds, once per process:
    at server start, not on a first registration): a call told to stop at once, which touches no
    driver; and ``fill_lane_row``, which the loop calls."""
    z2 = np.zeros((1, 1), np.int64)
    ctl = np.zeros(C_COUNT, np.int64)
    ctl[C_STOP] = 1
    rows = np.zeros((1, lane_row_width(max_chunks, bpc, used)), np.int64)
    lane(ctl, rows, -1, np.zeros(4, np.int64), np.zeros(2, np.int64), np.zeros(S_COUNT, np.int64),
         np.zeros((7, 1), np.int64), z2, z2, np.zeros((3, 1), np.int64), np.zeros(used, np.int64),
         np.zeros((2, max_chunks + 1, 1, 2), np.int64), np.zeros((2, max_chunks + 1), np.int64),
         np.zeros((1, 2), np.int64), np.zeros(G_COUNT, np.int64), np.full(WATCH_COUNT, -1, np.int64))
    # and the loop's row writer, with the argument types the loop passes (a checked empty call)
    fill_lane_row(rows[0], np.zeros((0, bpc), np.int64), np.zeros(0, np.int64), False, 0, False, 0, 0, 0, 1, 1, 1, 1,
                  H_IDS)


def lane_pause_ns(late_ns: int, last_ns: int, watch: Any) -> int:
    """How long a watching copy lane waits before its next look at a pending event, ``late_ns``
    after the look's due time, its last pause ``last_ns`` (0: none yet): the waiter's schedule
    (``watch``'s ``P_*``), the same steps as ``GpuTransferExecutor._wait``'s."""
    if late_ns < watch[WATCH_FINE_SPAN]:
        return watch[WATCH_FINE] if last_ns == 0 else min(2 * last_ns, watch[WATCH_FINE_MAX])
    if late_ns < watch[WATCH_MID_SPAN]:
        return watch[WATCH_MID]
    return watch[WATCH_SLOW]


_lane_pause_ns = numba.njit(nogil=True)(lane_pause_ns)


def make_copy_lane(enqueue: Any, libc: Any = None) -> Any:
    """One engine's copy lane: ``lane(ctl, rows, efd, buf, ts, st, ring, rel, desc, runs, used,
    pieces, npieces, one_piece, cfg, watch)``, a compiled function a thread enters once and leaves
    only at ``ctl[C_STOP]``. It holds no GIL: the server's loop writes a planned transfer into the
    next row of ``rows`` (``H_*``), bumps ``ctl[C_WRITTEN]`` and writes the eventfd ``efd``; the
    lane, blocked on it, takes the rows in order and makes each one's driver calls: the wait on
    the engine's event, ``enqueue`` (the same compiled call sequence the loop makes with
    ``CudaKVTransfer.gather`` / ``scatter`` and ``join=False``), then the record of the
    transfer's completion event on the stream its copies end on; it writes the outcome (error,
    entries used, whether the event was recorded, its clock) and then bumps ``ctl[C_DONE]``.
    (Plain stores, in order: x86's memory order makes the row visible before the count.) Once
    ``ctl[C_FAILED]`` is set a row is marked ``LANE_SKIPPED`` and nothing is enqueued for it. A
    ``K_WATCH`` row (a transfer the loop enqueued itself) makes no calls.

    While ``ctl[C_WATCH]`` is set the lane also sees its rows complete, in order, with no Python
    thread between: between rows it queries the first unseen row's completion event, no earlier
    than ``watch[WATCH_AIM_EARLY]`` before the row's ``H_T_DUE`` and then at ``lane_pause_ns``'s
    pauses (waiting on ``efd`` meanwhile, so a new row is taken at once); right after one row is
    seen end the next is looked at once at once (the waiter's ride-along); a row found ended gets
    ``H_Q`` (the query's result), ``H_T_SEEN``, ``H_POLLS``, ``H_PAUSE``, ``H_AIMED``, then
    ``ctl[C_SEEN]`` is bumped and one byte is written to ``watch[WATCH_WAKE_FD]`` (the loop's wake-up).
    A row whose event was not recorded, or ``ctl[C_WATCH]`` cleared, ends the watching: the lane
    sets ``ctl[C_WATCH_OFF]`` and ``C_SEEN`` moves no more (the Python waiter goes on from there).

    ``pieces[scatter, m, :npieces[scatter, m]]``: the staging pieces of an m-chunk call
    (``CudaKVTransfer._pieces``); ``ts``: int64[2] scratch for the clock; ``buf``: int64[4]
    scratch (the eventfd read, a pollfd, a timespec)."""
    import ctypes

    if libc is None:
        libc = ctypes.CDLL(None)
    u64, c_int = ctypes.c_uint64, ctypes.c_int
    read_fn = libc["read"]
    read_fn.argtypes = [c_int, u64, u64]
    read_fn.restype = ctypes.c_ssize_t
    write_fn = libc["write"]
    write_fn.argtypes = [c_int, u64, u64]
    write_fn.restype = ctypes.c_ssize_t
    ppoll_fn = libc["ppoll"]
    ppoll_fn.argtypes = [u64, u64, u64, u64]
    ppoll_fn.restype = c_int
    now_fn = libc["clock_gettime"]
    now_fn.argtypes = [c_int, u64]
    now_fn.restype = c_int
    record = enqueue.record_fn
    wait = enqueue.wait_fn
    query = enqueue.query_fn

    @numba.njit(nogil=False)
    def clock_ns(ts):  # type: ignore[no-untyped-def]
        now_fn(np.int32(CLOCK_MONOTONIC), np.uint64(ts.ctypes.data))
        return ts[0] * 1_000_000_000 + ts[1]

    @numba.njit(nogil=False)
    def wait_rows(efd, buf, timeout_ns):  # type: ignore[no-untyped-def]
        """Until the loop writes ``efd`` (a row, a stop, a watch change), or ``timeout_ns`` passes
        (< 0: no timeout)."""
        if timeout_ns >= 0:
            buf[1] = efd | (POLLIN << 32)  # struct pollfd {int fd; short events; short revents}
            buf[2] = timeout_ns // 1_000_000_000
            buf[3] = timeout_ns % 1_000_000_000
            if ppoll_fn(np.uint64(buf.ctypes.data + 8), np.uint64(1), np.uint64(buf.ctypes.data + 16), np.uint64(0)) <= 0:
                return
        read_fn(np.int32(efd), np.uint64(buf.ctypes.data), np.uint64(8))

    @numba.njit(nogil=False)
    def one_row(row, st, ring, rel, desc, runs, used, pieces, npieces, one_piece, cfg, failed, ts):  # type: ignore[no-untyped-def]
        row[H_T_PICK] = clock_ns(ts)
        row[H_ERR] = 0
        row[H_WHERE] = 0
        row[H_NUSED] = 0
        row[H_RECORDED] = 0
        if row[H_KIND] == K_WATCH:  # enqueued by the loop: its event was recorded if it has one
            row[H_RECORDED] = 1 if row[H_CEV] != 0 else 0
            row[H_T_DONE] = row[H_T_PICK]
            return
        if failed:
            row[H_ERR] = LANE_SKIPPED
            row[H_T_DONE] = row[H_T_PICK]
            return
        bpc = cfg[G_BPC]
        n = row[H_N]
        scatter = row[H_KIND] == K_RETRIEVE
        skip = row[H_SKIP]
        staging = row[H_STAGING] != 0
        ids = row[H_IDS : H_IDS + n * bpc]
        b0 = H_IDS + cfg[G_MAX_CHUNKS] * bpc
        bases = row[b0 : b0 + n]
        st[S_ERR] = 0
        ok = True
        if row[H_WEV] != 0:
            ok = wait(st, st[S_COMPUTE], row[H_WEV])
        cnt = 0
        copy_only = False
        if ok:
            op = 0
            if scatter:
                op |= OP_SCATTER
            m = n
            if staging:
                op |= OP_STAGING
                if scatter:
                    m = n - skip // bpc
            if m > 0:
                copy_only = _ends_on_copy_stream(scatter, staging, False)  # the lane never joins
                if staging:
                    cnt = enqueue(op, ids, bases, skip, pieces[1 if scatter else 0, m, : npieces[1 if scatter else 0, m]],
                                  st, ring, rel, desc, runs, used)
                else:
                    cnt = enqueue(op, ids, bases, skip, one_piece, st, ring, rel, desc, runs, used)
        row[H_ERR] = st[S_ERR]
        row[H_WHERE] = st[S_WHERE]
        st[S_ERR] = 0
        row[H_NUSED] = cnt
        u0 = row.shape[0] - cfg[G_USED]
        for i in range(cnt):
            row[u0 + i] = used[i]
        # after every copy of the transfer (CudaKVTransfer.record_completion); nothing enqueued:
        # the compute stream
        stream = st[S_COPY] if copy_only else st[S_COMPUTE]
        if record(st, row[H_CEV], stream):
            row[H_RECORDED] = 1
        elif row[H_ERR] == 0:
            row[H_ERR] = st[S_ERR]
            row[H_WHERE] = st[S_WHERE]
        st[S_ERR] = 0
        row[H_T_DONE] = clock_ns(ts)

    @numba.njit(nogil=True)
    def lane(ctl, rows, efd, buf, ts, st, ring, rel, desc, runs, used, pieces, npieces, one_piece, cfg, watch):  # type: ignore[no-untyped-def]
        nrows = rows.shape[0]
        polls = 0  # looks at the first unseen row's event so far
        pause = 0  # the last pause between them (ns)
        aimed = 0  # the first look waited for the row's due time
        riding = 0  # a row was just seen end: the next is looked at at once (it may have ended too)
        while True:
            while ctl[C_DONE] < ctl[C_WRITTEN]:
                k = ctl[C_DONE]
                one_row(rows[k % nrows], st, ring, rel, desc, runs, used, pieces, npieces, one_piece, cfg,
                        ctl[C_FAILED] != 0, ts)
                ctl[C_DONE] = k + 1
            if ctl[C_STOP] != 0:
                return ctl[C_DONE]
            timeout = -1
            if ctl[C_WATCH] == 0:
                ctl[C_WATCH_OFF] = 1
            elif ctl[C_SEEN] < ctl[C_DONE]:
                s = ctl[C_SEEN]
                row = rows[s % nrows]
                if row[H_RECORDED] == 0:  # no event to look at: the waiter goes on from here
                    ctl[C_WATCH] = 0
                    ctl[C_WATCH_OFF] = 1
                    continue
                now = clock_ns(ts)
                due = row[H_T_DUE] - watch[WATCH_AIM_EARLY]
                err = CUDA_ERROR_NOT_READY
                looked = False
                if riding != 0:  # (before its due time, a look that finds it running counts for nothing)
                    riding = 0
                    err = query(row[H_CEV])
                    looked = True
                    if err != CUDA_ERROR_NOT_READY or now >= due:
                        polls = 1
                if polls == 0 and now < due:
                    aimed = 1
                    timeout = due - now
                else:
                    if not looked:
                        err = query(row[H_CEV])
                        polls += 1
                    if err != CUDA_ERROR_NOT_READY:
                        row[H_Q] = err
                        row[H_T_SEEN] = clock_ns(ts)
                        row[H_POLLS] = polls
                        row[H_PAUSE] = pause
                        row[H_AIMED] = aimed
                        ctl[C_SEEN] = s + 1
                        write_fn(np.int32(watch[WATCH_WAKE_FD]), np.uint64(buf.ctypes.data), np.uint64(1))
                        polls = 0
                        pause = 0
                        aimed = 0
                        riding = 1
                        continue
                    pause = _lane_pause_ns(now - due, pause, watch)
                    timeout = pause
            wait_rows(efd, buf, timeout)

    return lane


_POLLER: Any = None
CLOCK_MONOTONIC, TIMER_ABSTIME = 1, 1
POLLIN = 1
PR_SET_TIMERSLACK = 29


def fast_poller() -> Any:
    """The process's compiled completion poller (``make_event_poller``), built on first use."""
    global _POLLER
    if _POLLER is None:
        _POLLER = make_event_poller()
    return _POLLER


def fine_timer_slack(ns: int = 1000) -> bool:
    """Let the calling thread's sleeps end within ``ns`` of when they ask (Linux adds up to
    50 us to a normal thread's sleep by default: a 10 us poll would take 60). True if set."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        return int(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def make_event_poller(lib: Any = None, libc: Any = None) -> Any:
    """A completion poller that runs without the GIL: ``poll(events, n, status, wake_ns, end_ns,
    poll_ns, most_ns, ts) -> (k, queries)``.

    ``events[:n]``: driver CUevent handles of one instance's transfers, in stream order. It
    sleeps (``clock_nanosleep`` on CLOCK_MONOTONIC, absolute) until ``wake_ns``, then queries
    the events in order, first ``poll_ns`` apart, each pause twice the last up to ``most_ns``,
    until the first is no longer pending or ``end_ns`` passes. Returns ``k``, how many leading events are no longer pending (their
    ``cuEventQuery`` results in ``status[:k]``: 0, or the error that ended them), 0 at
    ``end_ns``; and how many polls it made. ``ts``: int64[2] scratch for the clock calls.

    Compiled with ``nogil=True``: the waiter thread that calls it holds no GIL while it sleeps
    and queries, so the server's loop never waits for a poll, and a poll costs a driver query
    and a wake-up instead of Python statements. ``lib``: where ``cuEventQuery`` comes from
    (default libcuda; tests pass ctypes callbacks); ``libc``: where the clock calls do."""
    import ctypes

    if lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
    if libc is None:
        libc = ctypes.CDLL(None)
    u64, c_int = ctypes.c_uint64, ctypes.c_int

    cu_query = lib["cuEventQuery"]
    cu_query.argtypes = [u64]
    cu_query.restype = c_int
    now_fn = libc["clock_gettime"]
    now_fn.argtypes = [c_int, u64]
    now_fn.restype = c_int
    sleep_fn = libc["clock_nanosleep"]
    sleep_fn.argtypes = [c_int, c_int, u64, u64]
    sleep_fn.restype = c_int

    @numba.njit(nogil=False)
    def clock_ns(ts):  # type: ignore[no-untyped-def]
        now_fn(np.int32(CLOCK_MONOTONIC), np.uint64(ts.ctypes.data))
        return ts[0] * 1_000_000_000 + ts[1]

    @numba.njit(nogil=False)
    def sleep_until(ts, t_ns):  # type: ignore[no-untyped-def]
        ts[0] = t_ns // 1_000_000_000
        ts[1] = t_ns % 1_000_000_000
        sleep_fn(np.int32(CLOCK_MONOTONIC), np.int32(TIMER_ABSTIME), np.uint64(ts.ctypes.data), np.uint64(0))

    @numba.njit(nogil=True)
    def poll(events, n, status, wake_ns, end_ns, poll_ns, most_ns, ts):  # type: ignore[no-untyped-def]
        polls = 0
        pause = poll_ns
        now = clock_ns(ts)
        if now < wake_ns:
            sleep_until(ts, min(wake_ns, end_ns))
        while True:
            k = 0
            while k < n:
                err = cu_query(np.uint64(events[k]))
                if err == CUDA_ERROR_NOT_READY:
                    break
                status[k] = err
                k += 1
            polls += 1
            if k > 0:
                return k, polls
            now = clock_ns(ts)
            if now >= end_ns:
                return 0, polls
            sleep_until(ts, min(now + pause, end_ns))
            pause = min(2 * pause, most_ns)

    return poll


def _host_view(mapped: Any) -> np.ndarray:
    """The host side of a mapped array (a numpy view sharing its memory)."""
    ary = getattr(mapped, "_ary", None)  # the simulator's fake array wraps a numpy array
    return ary if isinstance(ary, np.ndarray) else np.asarray(mapped)


class _Memcpy:
    """Asynchronous copies on one stream, described in ``runs`` ([3, n] int64: destination,
    source, size) by ``_dma_runs``: on a GPU, byte addresses (UVA) and one cuMemcpyBatchAsync
    per ``submit`` where the driver has it (CUDA 13), else one cuMemcpyAsync per run, all
    through ``FastDriver``; under the simulator lane offsets and a plain copy (its streams are
    synchronous anyway)."""

    def __init__(self, stream: Any, sim: bool, max_runs: int, lane_bytes: int) -> None:
        self._sim = sim
        self.runs = np.zeros((3, max_runs), dtype=np.int64)
        self.path = "each"
        self.batch_error = ""
        self.scale = 1 if sim else lane_bytes
        self._ptr_cache: dict[int, int] = {}
        if not sim:
            self._fd = fast_driver()
            self._stream = as_handle(raw_stream(stream))
            self._rows = [int(self.runs[k].ctypes.data) for k in range(3)]
            if self._fd.batch is not None:
                self.path = "batch"

    def base(self, array: Any) -> int:
        """Where lane 0 of ``array`` is, as ``runs`` counts (0 under the simulator)."""
        if self._sim:
            return 0
        key = id(array)
        p = self._ptr_cache.get(key)
        if p is None:
            p = self._ptr_cache[key] = device_pointer(array)
        return p

    def submit(self, dst: Any, src: Any, count: int) -> None:
        """Enqueue the first ``count`` runs of ``runs`` (from ``src`` to ``dst``)."""
        runs = self.runs
        if self._sim:
            for k in range(count):
                d, s, n = int(runs[0, k]), int(runs[1, k]), int(runs[2, k])
                dst._ary[d : d + n] = src._ary[s : s + n]
            return
        fd = self._fd
        if count > 1 and self.path == "batch":
            rows = self._rows
            err = fd.batch(rows[0], rows[1], rows[2], count, fd.batch_attrs, fd.batch_attr_idx, 1, self._stream)
            if err == CUDA_SUCCESS:
                return
            # nothing was enqueued by a failed call; never try it again
            self.batch_error = f"cuMemcpyBatchAsync: CUDA error {err}"
            self.path = "each"
        for k in range(count):
            err = fd.memcpy(int(runs[0, k]), int(runs[1, k]), int(runs[2, k]), self._stream)
            if err != CUDA_SUCCESS:
                raise RuntimeError(f"cuMemcpyAsync failed: CUDA error {err}")


class _RawLaunch:
    """cuLaunchKernel with arguments packed once, one packed set per descriptor ring entry."""

    def __init__(self, dispatcher: Any, fixed: tuple[Any, ...], descs: list[Any], grid: int, threads: int,
                 stream: Any) -> None:
        import ctypes

        from cuda.bindings import driver

        sig = tuple(numba.typeof(a) for a in (*fixed, descs[0]))
        kernel = dispatcher.overloads.get(sig)
        if kernel is None:
            kernel = dispatcher.compile(sig)
        cufunc = kernel._codelibrary.get_cufunc()
        handle = getattr(cufunc, "handle", cufunc)
        if isinstance(handle, driver.CUkernel):
            # numba-cuda loads modules as libraries: take the context's function of the kernel
            err, handle = driver.cuKernelGetFunction(handle)
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuKernelGetFunction failed: {err}")
        if not isinstance(handle, driver.CUfunction):
            raise TypeError(f"unexpected kernel handle type {type(handle).__name__}")
        self._fd = fast_driver()
        self._func_obj = handle  # keeps the CUfunction wrapper alive
        self._func = as_handle(handle)
        self._grid = grid
        self._threads = threads
        self._stream = as_handle(raw_stream(stream))
        self._keep: list[Any] = []
        self._params: list[int] = []
        for d in descs:
            values: list[Any] = []
            for a in (*fixed, d):
                values += _array_arg(a, ctypes)
            ptrs = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
            self._keep.append((values, ptrs))
            self._params.append(ctypes.addressof(ptrs))

    def launch(self, r: int) -> None:
        err = self._fd.launch(self._func, self._grid, 1, 1, self._threads, 1, 1, 0, self._stream, self._params[r], None)
        if err != CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernel failed: CUDA error {err}")


def _array_arg(a: Any, ctypes: Any) -> list[Any]:
    """numba's kernel ABI for one array: meminfo, parent, nitems, itemsize, data, shape, strides."""
    intp = ctypes.c_ssize_t
    return [ctypes.c_void_p(0), ctypes.c_void_p(0), intp(a.size), intp(a.dtype.itemsize), ctypes.c_void_p(device_pointer(a))] + \
        [intp(x) for x in a.shape] + [intp(x) for x in a.strides]
