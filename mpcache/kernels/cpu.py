"""CPU gather / scatter between paged KV tensors and L1 chunk slots (numba njit).

Same semantics as the CUDA kernels (``kernels/cuda.py``), lane for lane: the CPU vLLM worker
uses it to copy between its KV tensors and the L1 shared-memory slots, and CI uses it as the
executable statement of what the GPU kernels must do.

Usage: build a ``CpuKVTransfer`` once when the engine registers its KV cache (it makes the lane
views and the parameter vector), then call ``gather`` / ``scatter`` per STORE / RETRIEVE.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable, Sequence

import llvmlite.ir as ir
import numba
import numpy as np
from numba.core import cgutils, types
from numba.extending import intrinsic

from mpcache.kernels.layouts import (
    P_BPC,
    P_BS,
    P_C,
    P_HL,
    P_KV,
    P_LAYERS,
    P_NH,
    P_SBLK,
    P_SHEAD,
    P_SKV,
    P_STOK,
    KVGeometry,
    as_lanes,
)


@intrinsic
def _stream_copy(typingctx, dst, dst_byte, src, src_byte, n32):  # type: ignore[no-untyped-def]
    """Copy ``n32`` x 32 bytes from ``src`` (byte offset ``src_byte``) to ``dst`` with
    non-temporal stores: the destination's lines are written without being read first (a
    plain store reads each line before writing it: a third of the memory traffic of a copy
    larger than the cache, which is why libc's memcpy streams too). The destination address
    must be 32-byte aligned (the caller checks); loads may be unaligned. Weakly ordered: the
    caller ends the copy with ``_store_fence``."""
    sig = types.void(dst, types.uint64, src, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        d, d_off, s, s_off, count = args
        d_arr = context.make_array(signature.args[0])(context, builder, d)
        s_arr = context.make_array(signature.args[2])(context, builder, s)
        byte = ir.IntType(8).as_pointer()
        vec = ir.VectorType(ir.IntType(64), 4).as_pointer()
        d_ptr = builder.bitcast(builder.gep(builder.bitcast(d_arr.data, byte), [d_off]), vec)
        s_ptr = builder.bitcast(builder.gep(builder.bitcast(s_arr.data, byte), [s_off]), vec)
        nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        with cgutils.for_range(builder, count) as loop:
            value = builder.load(builder.gep(s_ptr, [loop.index]), align=1)
            store = builder.store(value, builder.gep(d_ptr, [loop.index]), align=32)
            store.set_metadata("nontemporal", nontemporal)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _store_fence(typingctx):  # type: ignore[no-untyped-def]
    """Order the streamed stores before anything after the copy (an mfence on x86)."""
    sig = types.void()

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(cache=True, nogil=True)
def _copy_run(dst, d_off, src, s_off, span, lane):  # type: ignore[no-untyped-def]
    """One run of ``span`` lanes: streamed when the destination is 32-byte aligned and the run
    a multiple of 32 bytes (always so for vLLM's tensors and the L1 slots at head sizes of 64+
    bf16/fp32), else lane by lane."""
    nbytes = span * lane
    at = d_off * lane
    if (nbytes & np.uint64(31)) == 0 and ((np.uint64(dst.ctypes.data) + at) & np.uint64(31)) == 0:
        _stream_copy(dst, at, src, s_off * lane, nbytes >> np.uint64(5))
    else:
        for e in range(span):
            dst[d_off + e] = src[s_off + e]


@numba.njit(cache=True, nogil=True)
def _copy_lanes(layers, pool, params, block_ids, slot_base, skip, to_pool):  # type: ignore[no-untyped-def]
    """Every (block, layer, kv) of the request, one after another: ``to_pool`` gathers paged
    blocks into the chunk slots (STORE), otherwise scatters the slots into the blocks
    (RETRIEVE). The first ``skip`` blocks of the list are left alone. Both directions share the
    address arithmetic, so they cannot disagree on where a lane lives.

    Runs that are contiguous on both sides are copied as one run: a head's lanes always; all the
    heads of a token when the layout keeps them together (``s_head == hl``), a whole block's
    tokens when, in addition, ``s_tok == nh * hl`` (NHD, FLASHINFER, MLA). Offsets are unsigned,
    so the compiler knows no index wraps around (signed indexes cost about 4x here: the
    negative-index check in every lane's load and store)."""
    n_layers = params[P_LAYERS]
    kv_size = params[P_KV]
    bpc = params[P_BPC]
    bs = params[P_BS]
    nh = params[P_NH]
    hl = params[P_HL]
    s_kv = params[P_SKV]
    s_blk = params[P_SBLK]
    s_tok = params[P_STOK]
    s_head = params[P_SHEAD]
    c_tok = params[P_C]
    d = nh * hl
    # Merge runs: (tokens per run, heads per run) -> the loop counts and the run length.
    n_tok, n_head, run = bs, nh, hl
    if s_head == hl or nh == 1:
        n_head, run = 1, d
        if s_tok == d or bs == 1:
            n_tok, run = 1, bs * d
    span = np.uint64(run)
    lane = np.uint64(pool.itemsize)
    if to_pool:
        n_a, n_b, n_c = n_tok, n_head, kv_size
    else:
        n_a, n_b, n_c = kv_size, n_tok, n_head
    for f in range(skip, block_ids.size):
        chunk = f // bpc
        j = f - chunk * bpc
        blk = block_ids[f] * s_blk
        for layer in range(n_layers):
            paged = layers[layer]
            sb = slot_base[chunk] + (layer * c_tok + j * bs) * d  # kv 0's run of this block
            sb_kv = n_layers * c_tok * d  # kv 1's is this far on
            # Read the source in address order. A store's source is the block: in the CPU layout
            # a token's K and V runs are neighbours, so kv is the inner loop (a quarter faster than
            # kv outermost here). A load's source is the slot: each kv's runs are one stretch.
            for a in range(n_a):
                for b in range(n_b):
                    for c in range(n_c):
                        if to_pool:
                            t, h, kv = a, b, c
                        else:
                            kv, t, h = a, b, c
                        po = np.uint64(kv * s_kv + blk + t * s_tok + h * s_head)
                        so = np.uint64(sb + kv * sb_kv + (t * nh + h) * hl)
                        if to_pool:
                            _copy_run(pool, so, paged, po, span, lane)
                        else:
                            _copy_run(paged, po, pool, so, span, lane)
    _store_fence()


class CpuKVTransfer:
    """Copies chunks between one engine's host KV tensors and an L1 pool, all layers per call.

    ``layers``: one C-contiguous array (or torch CPU tensor) per layer, in ``geometry.layout``'s
    physical shape. ``pool``: the L1 buffer (e.g. the mapped shared-memory segment), any
    C-contiguous array; chunk slots are addressed by byte offset into it.
    Raises ``ValueError`` on a shape, size or alignment mismatch.
    """

    def __init__(self, geometry: KVGeometry, layers: Sequence[object], pool: object) -> None:
        if len(layers) != geometry.num_layers:
            raise ValueError(f"expected {geometry.num_layers} layer tensors, got {len(layers)}")
        self.geometry = geometry
        lane = geometry.lane_dtype
        layer_lanes = geometry.layer_elements() * geometry.itemsize // lane.itemsize
        views = []
        for i, layer in enumerate(layers):
            v = as_lanes(layer, lane)
            if v.size != layer_lanes:
                raise ValueError(f"layer {i}: {v.nbytes} bytes, expected {layer_lanes * lane.itemsize} for {geometry.layer_shape()}")
            views.append(v)
        self._layers = tuple(views)
        self._pool = as_lanes(pool, lane)
        self._params = geometry.lane_params()
        self._lane_bytes = lane.itemsize
        self._slot_lanes = geometry.slot_bytes // lane.itemsize

    def gather(self, block_ids: np.ndarray, slot_offsets: Sequence[int] | np.ndarray) -> None:
        """STORE: engine blocks → chunk slots. ``block_ids``: ``[n_chunks, blocks_per_chunk]``;
        ``slot_offsets``: byte offset of each chunk's slot in the pool."""
        ids, base = self._check(block_ids, slot_offsets, 0)
        _copy_lanes(self._layers, self._pool, self._params, ids, base, 0, True)

    def scatter(self, slot_offsets: Sequence[int] | np.ndarray, block_ids: np.ndarray, skip_blocks: int = 0) -> None:
        """RETRIEVE: chunk slots → engine blocks, leaving the first ``skip_blocks`` blocks of
        the flattened block list untouched (the engine already holds them)."""
        ids, base = self._check(block_ids, slot_offsets, skip_blocks)
        _copy_lanes(self._layers, self._pool, self._params, ids, base, skip_blocks, False)

    def _check(self, block_ids: np.ndarray, slot_offsets: Sequence[int] | np.ndarray, skip: int) -> tuple[np.ndarray, np.ndarray]:
        return check_request(self.geometry, self._pool.size, block_ids, slot_offsets, skip)


def check_request(
    geometry: KVGeometry, pool_lanes: int, block_ids: np.ndarray, slot_offsets: Sequence[int] | np.ndarray, skip: int
) -> tuple[np.ndarray, np.ndarray]:
    """Validate one call; return (flat int64 block ids, slot bases in lanes). Raises ValueError:
    a bad id or offset would otherwise write outside the engine's cache or the pool."""
    ids, offs = check_shapes(geometry, block_ids, slot_offsets, skip)
    flat = ids.reshape(-1)
    bases = np.empty(offs.shape[0], dtype=np.int64)
    err = validate_call(flat, offs, geometry.num_blocks, geometry.lane_bytes, geometry.slot_bytes // geometry.lane_bytes,
                        pool_lanes, bases)
    if err:
        raise call_error(geometry, err)
    return flat, bases


def check_shapes(
    geometry: KVGeometry, block_ids: np.ndarray, slot_offsets: Sequence[int] | np.ndarray, skip: int
) -> tuple[np.ndarray, np.ndarray]:
    """The shape half of ``check_request``: (C-contiguous int64 block ids ``[n_chunks,
    blocks_per_chunk]``, int64 slot byte offsets ``[n_chunks]``). Raises ValueError; the ids and
    offsets themselves are ``validate_call``'s to check."""
    ids = block_ids if isinstance(block_ids, np.ndarray) and block_ids.dtype == np.int64 else np.asarray(block_ids, dtype=np.int64)
    if ids.ndim != 2 or ids.shape[1] != geometry.blocks_per_chunk:
        raise ValueError(f"block_ids must be [n_chunks, {geometry.blocks_per_chunk}], got {ids.shape}")
    if not ids.flags.c_contiguous:
        ids = np.ascontiguousarray(ids)
    offs = slot_offsets if isinstance(slot_offsets, np.ndarray) and slot_offsets.dtype == np.int64 else np.asarray(slot_offsets, dtype=np.int64)
    if offs.shape != (ids.shape[0],):
        raise ValueError(f"need one slot offset per chunk: {offs.shape} for {ids.shape[0]} chunks")
    if not 0 <= skip <= ids.size:
        raise ValueError(f"skip_blocks {skip} outside [0, {ids.size}]")
    return ids, offs


def call_error(geometry: KVGeometry, err: int) -> ValueError:
    """The ValueError of ``validate_call``'s answer ``err`` (1 or 2)."""
    if err == 1:
        return ValueError(f"block id out of range [0, {geometry.num_blocks})")
    return ValueError("slot offset outside the pool or not lane-aligned")


@numba.njit(cache=True)  # holds the GIL: microseconds, and the loop's; releasing it would let other threads in
def validate_call(ids, offs, num_blocks, lane, slot_lanes, pool_lanes, bases):  # type: ignore[no-untyped-def]
    """One pass over a call: 0 when every flat block id is in ``[0, num_blocks)`` and every slot
    offset is lane-aligned with its slot inside the pool, writing each slot's base in lanes into
    ``bases``; 1 for a bad block id, 2 for a bad offset (``call_error`` says which). One pass
    (numpy's min/max/mod would be several passes and calls); compiled code may call it too."""
    for i in range(ids.size):
        if ids[i] < 0 or ids[i] >= num_blocks:
            return 1
    for i in range(offs.size):
        o = offs[i]
        if o < 0 or o % lane != 0 or o // lane + slot_lanes > pool_lanes:
            return 2
        bases[i] = o // lane
    return 0


def gather_cpu(geometry: KVGeometry, layers: Sequence[object], block_ids: np.ndarray, slots: Sequence[object]) -> None:
    """One-off STORE into separate slot buffers (one per chunk). For repeated calls, build a
    ``CpuKVTransfer`` once instead."""
    ids = np.asarray(block_ids, dtype=np.int64)
    for i, slot in enumerate(slots):
        CpuKVTransfer(geometry, layers, slot).gather(ids[i : i + 1], [0])


def scatter_cpu(geometry: KVGeometry, layers: Sequence[object], slots: Sequence[object], block_ids: np.ndarray, skip_blocks: int = 0) -> None:
    """One-off RETRIEVE from separate slot buffers (one per chunk)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    bpc = geometry.blocks_per_chunk
    for i, slot in enumerate(slots):
        skip = min(max(skip_blocks - i * bpc, 0), bpc)
        CpuKVTransfer(geometry, layers, slot).scatter([0], ids[i : i + 1], skip)


_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault the range in writable, as a write to each page would
_libc: ctypes.CDLL | None = None


def prefault(buffer: np.ndarray, step_bytes: int = 64 << 20, keep_going: Callable[[], bool] | None = None) -> bool:
    """Map every page of ``buffer`` (a mapped shared-memory segment) into this process's page
    tables now, writable, without changing a byte: the first copy into or out of a fresh mapping
    otherwise takes a page fault per 4 KiB (about three times the copy's own time for a store).
    Works in ``step_bytes`` steps with the GIL released (ctypes), so it can run on a background
    thread; ``keep_going``, a callable, is asked before each step and stops it when false.
    Returns False where the kernel has no ``MADV_POPULATE_WRITE`` (the copies then fault as
    before; nothing else changes)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    page = 4096
    base = buffer.ctypes.data
    start = base - base % page
    end = base + buffer.nbytes
    at = start
    while at < end:
        if keep_going is not None and not keep_going():
            return True
        n = min(step_bytes, end - at)
        if _libc.madvise(at, n, _MADV_POPULATE_WRITE) != 0:
            return False
        at += n
    return True
