"""KV-cache groups in the simulated world (vLLM's hybrid KV-cache manager): the F24 oracle.

Some worlds draw an engine with several KV-cache groups (``WorldConfig.kv_groups``; none: one
full-attention group, the plain path). Such an engine runs what production runs: core_sm's
planner with ``PlannerConfig.kv_groups`` and ``cpu_engine`` set, so it looks each request up
once, keys it by the groups' layout and plans every store and retrieve with each group's blocks
joined (``kv_groups.join_group_blocks``); the scheduler model (``sim/vllm_scheduler.py``) keeps a
block table per group, a window's dropped blocks being vLLM's null block; the simulated worker
(``engine.SimWorker.copy``) copies each group's blocks into or out of the chunk's one object,
group after group, as production's worker does. Groups this version cannot restore (recurrent
state, several groups on a GPU engine: ``kv_groups.unrestorable``) make every request a miss.

F24 judges what vLLM would read, not what mpcache says it did:

* ``unrestorable_hit``: an engine whose groups cannot be restored reported a hit;
* ``partial_restore``: after a load, a block vLLM reads for the resumed prefix in a group after
  the first (every non-null block of ``kv_groups.needed_chunks(group, resume)`` below the resume
  point) does not hold that chunk's data for that group: wrong KV in that group's layers
  (LMCache #2863). The first group's blocks are F10's (``SimEngine._verify_load``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from mpcache.core_sm.blocks import ChunkCopy, chunk_copies
from mpcache.core_sm.messages import TransferKind
from mpcache.core_sm.kv_groups import KVGroup, group_retrieve_skip, needed_chunks, several, split_group_blocks, unrestorable

Finding = tuple[str, str]

__all__ = ["blocks_read", "group_copies", "partial_restore", "unrestorable_hit"]


def group_copies(groups: Sequence[KVGroup], kind: TransferKind, start: int, end: int,
                 placements: Sequence[tuple[int, int]], block_ids: Sequence[int], skip: int, chunk: int,
                 block_size: int, first_group_only: bool = False) -> list[tuple[ChunkCopy, ...]]:
    """One op's copies, one list per KV-cache group, as production's worker splits it: the op's
    blocks group after group (``kv_groups.split_group_blocks``), each part's chunks chosen by
    core_sm's ``chunk_copies``, a window's blocks of a retrieve written from its first live one
    (``kv_groups.group_retrieve_skip``). ``first_group_only``: a retrieve copies the first group's
    part alone (profile ``hma-partial-group``). Raises ``ValueError`` when the plan does not
    match its blocks."""
    parts = split_group_blocks(block_ids, len(groups)) if several(groups) else (tuple(block_ids),)
    out = []
    for g, blocks in enumerate(parts):
        part_skip = skip
        if several(groups) and kind is TransferKind.RETRIEVE:
            # a window's blocks before its first live one are vLLM's null block
            part_skip = group_retrieve_skip(groups[g], start, end, skip)
        out.append(chunk_copies(kind, start, end, tuple(placements), blocks, part_skip, chunk, block_size))
    if kind is TransferKind.RETRIEVE and first_group_only:
        out = out[:1]
    return out


def unrestorable_hit(rid: str, groups: Sequence[KVGroup], cpu_engine: bool, tokens: int | None) -> Finding | None:
    """F24: ``tokens`` external tokens reported for ``rid`` by an engine whose groups this
    version cannot restore: any hit restores some groups' KV and not the others'."""
    why = unrestorable(groups, cpu_engine)
    if why is None or not tokens:
        return None
    return "F24", f"{rid}: {tokens} external tokens reported, but {why}: a partial restore"


def blocks_read(group: KVGroup, table: Sequence[int], resume: int, chunk: int, block_size: int,
                null_block: int) -> list[int]:
    """The positions in ``group``'s block ``table`` whose KV vLLM reads to go on from token
    ``resume``: those of the chunks ``needed_chunks(group, resume)`` before ``resume``, less the
    null block (a window's dropped blocks)."""
    need = needed_chunks(group, resume // chunk * chunk, chunk)
    first = need.start * chunk // block_size
    last = min(resume // block_size, len(table))
    return [i for i in range(first, last) if table[i] != null_block]


def partial_restore(rid: str, groups: Sequence[KVGroup], tables: Sequence[Sequence[int]], resume: int, chunk: int,
                    block_size: int, null_block: int, wrong: Callable[[int, int], str | None]) -> Finding | None:
    """F24 after ``rid``'s load landed: vLLM goes on from token ``resume`` (its prefix-cache hit
    plus the external tokens). For every group after the first and every position
    ``blocks_read`` gives, ``wrong(group, position)`` says what the block holds instead of that
    chunk's data for that group (None: the right data)."""
    for g in range(1, len(groups)):
        read = blocks_read(groups[g], tables[g], resume, chunk, block_size, null_block)
        for i in read:
            got = wrong(g, i)
            if got is not None:
                group = groups[g]
                where = ""
                if resume % chunk and i == read[0] and i > 0 and tables[g][i - 1] == null_block:
                    where = f" (its first live block, resuming mid-chunk {resume // chunk})"
                return "F24", (f"{rid}: resumes at token {resume}, but group {g} ({group.kind.value}"
                               f"{' ' + str(group.window) if group.window else ''}) block {i} (id {tables[g][i]})"
                               f"{where} holds {got}: a partial restore, wrong KV in that group's layers")
    return None
