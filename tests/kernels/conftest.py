from __future__ import annotations

import numpy as np

from mpcache.kernels.layouts import KVGeometry, PagedLayout


def small_geometry(layout: PagedLayout, itemsize: int = 2, head_size: int = 8, num_layers: int = 3) -> KVGeometry:
    heads = 1 if layout is PagedLayout.MLA else 2
    return KVGeometry(layout, num_layers=num_layers, num_blocks=23, block_size=4, num_heads=heads,
                      head_size=head_size, itemsize=itemsize, chunk_tokens=12)


def random_layers(g: KVGeometry, rng: np.random.Generator, dtype: np.dtype) -> list[np.ndarray]:
    """Random bit patterns (never zeros) in the layout's physical shape."""
    out = []
    for _ in range(g.num_layers):
        raw = rng.integers(1, 255, size=g.layer_elements() * np.dtype(dtype).itemsize, dtype=np.uint8)
        out.append(raw.view(dtype).reshape(g.layer_shape()))
    return out


def random_block_table(g: KVGeometry, rng: np.random.Generator, n_chunks: int) -> np.ndarray:
    """Distinct block ids in random order, [n_chunks, blocks_per_chunk]."""
    return rng.permutation(g.num_blocks)[: n_chunks * g.blocks_per_chunk].reshape(n_chunks, g.blocks_per_chunk).astype(np.int64)
