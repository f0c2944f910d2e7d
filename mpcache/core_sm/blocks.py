"""Which engine blocks a transfer's chunks touch, and which skipped tokens stay unwritten.

One function, ``chunk_copies``, for every copier: the GPU executor (``mpcache.runtime_zmq.gpu_transfer``),
the CPU worker (``mpcache.runtime_zmq.adapters``) and the simulator's worker. A transfer covers tokens
``[start, end)`` of a request; ``block_ids`` are the request's engine blocks for exactly that
range, in order; ``placements`` name chunks by their index in the *whole* token sequence (chunk
``c`` starts at token ``c * chunk_size``) with the L1 slot each one goes to or comes from.

A RETRIEVE does not write its first ``skip_first_n_tokens`` tokens (the engine holds them, maybe
shared with other requests through its prefix cache: writing them would change another request's
KV, F16): a chunk wholly inside that prefix is not copied at all, a chunk partly inside it keeps
``skip // block_size`` of its leading blocks unwritten. vLLM's prefix cache shares whole blocks,
so the skip is block aligned in practice; a partial block is written (the rounding that never
leaves a token the engine does not hold unwritten). A STORE reads every block of its chunks.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from mpcache.core_sm.messages import TransferKind


class ChunkCopy(NamedTuple):
    """One chunk of a transfer: its index in the token sequence, its L1 slot, its
    ``blocks_per_chunk`` engine blocks in order, and how many leading ones are not written.

    A named tuple, not an attrs class: a transfer builds one per chunk on the copier's critical
    path (an 8-chunk plan took ~100 us with frozen attrs instances and a per-id ``int()``)."""

    chunk: int
    slot: int
    block_ids: tuple[int, ...]
    skip_blocks: int = 0


def chunk_copies(
    kind: TransferKind,
    start: int,
    end: int,
    placements: Iterable[tuple[int, int]],
    block_ids: Sequence[int],
    skip_first_n_tokens: int,
    chunk_size: int,
    block_size: int,
) -> tuple[ChunkCopy, ...]:
    """The chunk copies of one transfer, in chunk order. Raises ``ValueError`` when the chunk size
    is not a whole number of blocks, or a placement names a chunk outside ``[start, end)`` or
    beyond ``block_ids`` (a plan that does not match its request: copy nothing)."""
    if block_size <= 0 or chunk_size <= 0 or chunk_size % block_size:
        raise ValueError(f"chunk size {chunk_size} is not a whole number of {block_size}-token blocks")
    if start % chunk_size:
        raise ValueError(f"transfer start {start} is not chunk aligned ({chunk_size})")
    per_chunk = chunk_size // block_size
    first = start // chunk_size
    skip_tokens = skip_first_n_tokens if kind is TransferKind.RETRIEVE else 0
    # sliced per chunk below; a tuple is taken as it is (the effects' block ids are tuples of the
    # ints the wire decoder validated), anything else is made one of plain ints once
    ids = block_ids if type(block_ids) is tuple else tuple(map(int, block_ids))
    copies: list[ChunkCopy] = []
    for chunk, slot in sorted(placements):
        relative = chunk - first
        if relative < 0 or chunk * chunk_size >= end or (relative + 1) * per_chunk > len(ids):
            raise ValueError(f"chunk {chunk} outside the {len(ids)} block ids of [{start}, {end})")
        skipped = min(max(skip_tokens - relative * chunk_size, 0), chunk_size) // block_size
        if skipped == per_chunk:
            continue  # the engine holds all of it
        copies.append(ChunkCopy(chunk, slot, ids[relative * per_chunk : (relative + 1) * per_chunk], skipped))
    return tuple(copies)

