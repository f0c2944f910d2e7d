"""Plain-numpy statement of gather / scatter, written from the logical shapes (transposes and
fancy indexing), independent of the stride arithmetic the kernels use."""
from __future__ import annotations

import numpy as np

from mpcache.kernels.layouts import KVGeometry, PagedLayout


def canonical(g: KVGeometry, layer: np.ndarray) -> np.ndarray:
    """A writable view of one layer as [kv, NB, BS, NH, HS]."""
    a = layer.reshape(g.layer_shape())
    if g.layout is PagedLayout.NHD:
        return a
    if g.layout is PagedLayout.HND:
        return a.transpose(0, 1, 3, 2, 4)
    if g.layout is PagedLayout.FLASHINFER:
        return a.transpose(1, 0, 2, 3, 4)
    if g.layout is PagedLayout.FLASHINFER_HND:
        return a.transpose(1, 0, 3, 2, 4)
    if g.layout is PagedLayout.MLA:
        return a[None, :, :, None, :]
    if g.layout is PagedLayout.CPU:
        nb, nh, bs, _ = a.shape
        return a.reshape(nb, nh, bs, 2, g.head_size).transpose(3, 0, 2, 1, 4)
    raise AssertionError(g.layout)


def gather_ref(g: KVGeometry, layers: list[np.ndarray], block_ids: np.ndarray) -> np.ndarray:
    """[n_chunks, kv, L, C, NH*HS] chunk contents."""
    n = block_ids.shape[0]
    out = np.empty((n, g.kv_size, g.num_layers, g.chunk_tokens, g.hidden), dtype=layers[0].dtype)
    for i in range(n):
        for layer in range(g.num_layers):
            blocks = canonical(g, layers[layer])[:, block_ids[i]]  # [kv, bpc, BS, NH, HS]
            out[i, :, layer] = blocks.reshape(g.kv_size, g.chunk_tokens, g.hidden)
    return out


def scatter_ref(g: KVGeometry, layers: list[np.ndarray], chunks: np.ndarray, block_ids: np.ndarray, skip_blocks: int) -> None:
    """Write chunk contents [n, kv, L, C, NH*HS] into the layers, skipping the first blocks."""
    bpc = g.blocks_per_chunk
    for i in range(block_ids.shape[0]):
        for j in range(bpc):
            if i * bpc + j < skip_blocks:
                continue
            tok = chunks[i, :, :, j * g.block_size : (j + 1) * g.block_size]  # [kv, L, BS, D]
            for layer in range(g.num_layers):
                canonical(g, layers[layer])[:, block_ids[i, j]] = tok[:, layer].reshape(
                    g.kv_size, g.block_size, g.num_heads, g.head_size
                )
