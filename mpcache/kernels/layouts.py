"""Layout descriptors: where one token's K (or V) of one head lives in an engine's paged KV
cache, and where it lives in an L1 chunk slot.

Every supported paged layout is, per layer, a contiguous tensor in which the ``HS`` elements of
one (kv, block, token, head) are contiguous. So one layout is fully described by four element
strides — kv, block, token, head — and the kernels never need to know the layout's name.

Chunk slot layout (one L1 object, one chunk of ``C`` tokens, one KV rank):
``[kv_size, L, C, NH*HS]`` — K of every layer, then V of every layer (MLA: ``[1, L, C, D]``).
Element ``(kv, layer, t, d)`` sits at ``((kv*L + layer)*C + t)*NH*HS + d``.

The kernels move *lanes*: unsigned integers of the widest width (8, 4, 2 or 1 bytes) that
divides one head's run of bytes, so bf16 / fp16 / fp8 / fp32 are all copied byte-exactly and no
float ever passes through a register.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


class PagedLayout(enum.Enum):
    """Physical per-layer shape of an engine's paged KV tensor (C order)."""

    NHD = "nhd"  # vLLM flash-attn: [2, NB, BS, NH, HS]
    HND = "hnd"  # vLLM HND:        [2, NB, NH, BS, HS]
    FLASHINFER = "flashinfer"  # [NB, 2, BS, NH, HS]
    FLASHINFER_HND = "flashinfer_hnd"  # [NB, 2, NH, BS, HS]
    MLA = "mla"  # [NB, BS, D]  (one latent vector per token: kv_size 1, NH 1, HS = D)
    CPU = "cpu"  # vLLM CPU backend: [NB, NH, BS, 2*HS], K and V side by side in the last dim


_LANE_DTYPES = {8: np.dtype(np.uint64), 4: np.dtype(np.uint32), 2: np.dtype(np.uint16), 1: np.dtype(np.uint8)}


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one engine's KV cache and of the chunk slots it is copied to.

    ``num_heads`` and ``head_size`` for MLA: pass ``num_heads=1`` and ``head_size=D``.
    ``itemsize`` is the element size in bytes (bf16/fp16 2, fp8 1, fp32 4).
    Raises ``ValueError`` if the chunk is not a whole number of blocks or a size is not positive.
    """

    layout: PagedLayout
    num_layers: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int
    itemsize: int
    chunk_tokens: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_heads", "head_size", "itemsize", "chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.chunk_tokens % self.block_size:
            raise ValueError(f"chunk_tokens {self.chunk_tokens} is not a multiple of block_size {self.block_size}")
        if self.layout is PagedLayout.MLA and self.num_heads != 1:
            raise ValueError("MLA geometry has num_heads=1 and head_size=D")

    # ---- shapes -------------------------------------------------------------------------
    @property
    def kv_size(self) -> int:
        return 1 if self.layout is PagedLayout.MLA else 2

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    @property
    def hidden(self) -> int:
        """Elements per token per kv in a chunk slot (NH*HS, or D for MLA)."""
        return self.num_heads * self.head_size

    def layer_shape(self) -> tuple[int, ...]:
        nb, bs, nh, hs = self.num_blocks, self.block_size, self.num_heads, self.head_size
        return {
            PagedLayout.NHD: (2, nb, bs, nh, hs),
            PagedLayout.HND: (2, nb, nh, bs, hs),
            PagedLayout.FLASHINFER: (nb, 2, bs, nh, hs),
            PagedLayout.FLASHINFER_HND: (nb, 2, nh, bs, hs),
            PagedLayout.MLA: (nb, bs, hs),
            PagedLayout.CPU: (nb, nh, bs, 2 * hs),
        }[self.layout]

    def layer_elements(self) -> int:
        return int(np.prod(self.layer_shape()))

    def slot_shape(self) -> tuple[int, int, int, int]:
        return (self.kv_size, self.num_layers, self.chunk_tokens, self.hidden)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one chunk slot (one L1 object)."""
        return self.kv_size * self.num_layers * self.chunk_tokens * self.hidden * self.itemsize

    # ---- strides ------------------------------------------------------------------------
    def element_strides(self) -> tuple[int, int, int, int]:
        """(kv, block, token, head) strides in elements inside one layer tensor."""
        nb, bs, nh, hs = self.num_blocks, self.block_size, self.num_heads, self.head_size
        blk = bs * nh * hs
        return {
            PagedLayout.NHD: (nb * blk, blk, nh * hs, hs),
            PagedLayout.HND: (nb * blk, blk, hs, bs * hs),
            PagedLayout.FLASHINFER: (blk, 2 * blk, nh * hs, hs),
            PagedLayout.FLASHINFER_HND: (blk, 2 * blk, hs, bs * hs),
            PagedLayout.MLA: (0, blk, hs, 0),
            PagedLayout.CPU: (hs, 2 * blk, 2 * hs, 2 * bs * hs),
        }[self.layout]

    @property
    def lane_bytes(self) -> int:
        """Widest lane (8/4/2/1 bytes) dividing one head's run; every stride is a multiple of
        that run, so every lane is naturally aligned if the tensors are."""
        run = self.head_size * self.itemsize
        for w in (8, 4, 2, 1):
            if run % w == 0:
                return w
        raise AssertionError("unreachable")

    @property
    def lane_dtype(self) -> np.dtype:
        return _LANE_DTYPES[self.lane_bytes]

    def lane_params(self) -> np.ndarray:
        """The kernels' geometry vector (int64), in lanes; see ``P_*`` for the index of each."""
        s_kv, s_blk, s_tok, s_head = (int(s * self.itemsize) // self.lane_bytes for s in self.element_strides())
        head_lanes = self.head_size * self.itemsize // self.lane_bytes
        p = np.zeros(P_COUNT, dtype=np.int64)
        p[P_LAYERS] = self.num_layers
        p[P_KV] = self.kv_size
        p[P_BPC] = self.blocks_per_chunk
        p[P_BS] = self.block_size
        p[P_NH] = self.num_heads
        p[P_HL] = head_lanes
        p[P_SKV] = s_kv
        p[P_SBLK] = s_blk
        p[P_STOK] = s_tok
        p[P_SHEAD] = s_head
        p[P_C] = self.chunk_tokens
        p[P_NB] = self.num_blocks
        p[P_LAYER_LANES] = self.layer_elements() * self.itemsize // self.lane_bytes
        p[P_SLOT_LANES] = self.slot_bytes // self.lane_bytes
        return p


# Indexes into KVGeometry.lane_params(); the CUDA kernel appends per-layer base offsets after.
P_LAYERS, P_KV, P_BPC, P_BS, P_NH, P_HL, P_SKV, P_SBLK, P_STOK, P_SHEAD, P_C, P_NB, P_LAYER_LANES, P_SLOT_LANES = range(14)
P_COUNT = 14


def as_lanes(array: object, lane_dtype: np.dtype) -> np.ndarray:
    """A flat lane view of a C-contiguous host array or torch CPU tensor (no copy).

    Raises ``ValueError`` if the memory is not contiguous or not a whole number of lanes.
    """
    arr = _as_numpy(array)
    if not arr.flags.c_contiguous:
        raise ValueError("KV tensors and slot buffers must be C-contiguous")
    flat = arr.reshape(-1).view(np.uint8)
    if flat.nbytes % lane_dtype.itemsize or flat.ctypes.data % lane_dtype.itemsize:
        raise ValueError(f"buffer of {flat.nbytes} bytes is not aligned to {lane_dtype.itemsize}-byte lanes")
    return flat.view(lane_dtype)


def _as_numpy(array: object) -> np.ndarray:
    if isinstance(array, np.ndarray):
        return array
    if hasattr(array, "__array_interface__") or isinstance(array, (memoryview, bytearray)):
        return np.asarray(array)
    try:  # torch tensor (bf16 has no numpy dtype: reinterpret as bytes first)
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        raise TypeError(f"cannot view {type(array).__name__} as a host array") from None
    if isinstance(array, torch.Tensor):
        if array.device.type != "cpu":
            raise ValueError("expected a CPU tensor")
        if not array.is_contiguous():
            raise ValueError("KV tensors must be contiguous")
        return array.reshape(-1).view(torch.uint8).numpy()
    raise TypeError(f"cannot view {type(array).__name__} as a host array")
