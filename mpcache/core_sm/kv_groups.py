"""KV-cache groups (vLLM's hybrid KV-cache manager, "HMA"): what a resumed prefix needs.

A hybrid model keeps its KV in several groups, each with its own block table: full-attention
layers, sliding-window layers (each window size), recurrent state (Mamba, linear attention).
Which chunks of each group a request needs to resume at token ``t`` is decided here:

* ``FULL``: every chunk of the prefix, ``[0, t)``;
* ``SLIDING_WINDOW``: only the window before the resume point: the chunks that hold tokens
  ``[t - window, t)`` (the attention of token ``t`` and after reads nothing older);
* ``RECURRENT``: the state after token ``t`` alone, i.e. the snapshot taken at the end of the
  chunk that ends at ``t``.

``resume_point`` is the rule for a hit: the longest chunk-aligned prefix at which *every*
group has every chunk it needs; a group short of one makes that prefix a miss. There is no
partial restore: loading the full-attention KV of a prefix without its recurrent state (or its
window) and letting vLLM skip the prefix for every layer gives wrong output (LMCache #2863:
about 40% garbled answers on a Mamba hybrid).

``unrestorable`` says what this version's workers cannot store or load at all (``None``: all
fine): recurrent state and other kinds, groups of different block sizes, and several groups on a
GPU engine (the server's copy reads one block table). For those every request is a miss, said
once at start with the reason.

Several groups (full attention and sliding windows mixed, CPU engines): one object per chunk
still holds every layer of the model, group after group (``object_layout``), so a chunk is
present for every group or for none -- a partial restore cannot happen -- and the lookup, the
leases and the server are those of one group. The keys of such an engine differ from a
one-group engine's (``layout_identity``: the object layout differs). A store or retrieve op
carries every group's blocks for its range, group after group (``join_group_blocks`` /
``split_group_blocks``); a retrieve writes a window group's blocks only from
``group_retrieve_skip`` on (vLLM hands null blocks for the tokens before the window), taken at
the retrieve's end; ``load_end`` ends a load where vLLM's resume point gives the same first
block (a whole-prompt hit resumes one token short of the end). A load of
several groups is asynchronous (``sync_load_allowed``): vLLM can map a failed load back to its
request only by request id then, not by block id.

A sliding-window group's blocks are freed by vLLM once they fall out of the window of the
tokens computed (``first_live_token``): a store may read only blocks still live when its step
starts, or it would store another request's KV.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs


class GroupKind(enum.Enum):
    FULL = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    RECURRENT = "recurrent"
    OTHER = "other"  # chunked local attention, cross attention, ...: not modelled


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


@attrs.frozen
class KVGroup:
    """One KV-cache group: its kind, the engine's block size for it and, for a sliding window,
    the window in tokens. ``name`` says which (for the log line)."""

    kind: GroupKind
    block_size: int = attrs.field(validator=_positive)
    window: int = attrs.field(default=0)
    name: str = ""

    @window.validator
    def _check_window(self, attribute: object, value: int) -> None:
        if type(value) is not int or value < 0 or (self.kind is GroupKind.SLIDING_WINDOW and value < 1):
            raise ValueError(f"a sliding-window group needs window >= 1, got {value!r}")


FULL_ONLY: tuple[KVGroup, ...] = ()  # no groups given: one full-attention group (plain models)


def needed_chunks(group: KVGroup, resume: int, chunk: int) -> range:
    """Indices of the chunks of ``group`` a request needs to resume at token ``resume`` (a
    multiple of ``chunk``). ``OTHER``: every chunk (nothing less is known to suffice)."""
    end = resume // chunk
    if group.kind is GroupKind.SLIDING_WINDOW:
        return range(max(0, resume - group.window) // chunk, end)
    if group.kind is GroupKind.RECURRENT:
        return range(max(0, end - 1), end)
    return range(0, end)


def resume_point(groups: Sequence[KVGroup], present: Sequence[frozenset[int] | range], limit: int, chunk: int) -> int:
    """The longest prefix ``t`` (a multiple of ``chunk``, at most ``limit``) at which every group
    ``g`` holds every chunk ``needed_chunks(groups[g], t)`` (``present[g]``: the chunk indices
    the group holds); 0 when there is none: a miss, never a partial restore."""
    if len(present) != len(groups):
        raise ValueError("one set of present chunks per group")
    for t in range(limit // chunk, 0, -1):
        resume = t * chunk
        if all(all(c in have for c in needed_chunks(g, resume, chunk)) for g, have in zip(groups, present)):
            return resume
    return 0


def first_live_token(group: KVGroup, computed: int) -> int:
    """The first token whose block is still allocated once ``computed`` tokens are computed
    (vLLM frees a sliding window's blocks that hold only tokens before
    ``computed - window + 1``); 0 for the other kinds."""
    if group.kind is not GroupKind.SLIDING_WINDOW:
        return 0
    return max(0, computed - group.window + 1) // group.block_size * group.block_size


def unrestorable(groups: Sequence[KVGroup], cpu_engine: bool = True) -> str | None:
    """Why this version cannot restore (or store) requests of an engine with these groups, or
    None when it can: full-attention and sliding-window groups of one block size (or none given);
    several of them only on a CPU engine (``cpu_engine``: the workers copy the blocks)."""
    restorable = (GroupKind.FULL, GroupKind.SLIDING_WINDOW)
    if not groups or (len(groups) == 1 and groups[0].kind in restorable):
        return None
    kinds = ", ".join(_describe(g) for g in groups)
    if any(g.kind is GroupKind.RECURRENT for g in groups):
        why = "recurrent state (Mamba / linear attention) is not stored"
    elif any(g.kind not in restorable for g in groups):
        why = "only full-attention and sliding-window groups are restored"
    elif len({g.block_size for g in groups}) > 1:
        why = "the groups' block sizes differ"
    elif not cpu_engine:
        why = "several groups are restored only on CPU engines (the server's GPU copy reads one block table)"
    else:
        return None
    return f"KV-cache groups [{kinds}]: {why}"


def several(groups: Sequence[KVGroup]) -> bool:
    """Whether the engine keeps its KV in more than one group (the group-after-group layout)."""
    return len(groups) > 1


def layout_identity(groups: Sequence[KVGroup]) -> str:
    """What the chunk keys of an engine with these groups add to the request identity: ``""``
    for one group (the object layout of every plain engine), else the groups in order, so a
    one-group engine of the same model (vLLM's hybrid manager off) never reads these objects,
    whose layers are laid out group after group."""
    if not several(groups):
        return ""
    return ",".join(g.kind.value + (f" {g.window}" if g.kind is GroupKind.SLIDING_WINDOW else "") for g in groups)


def join_group_blocks(group_blocks: Sequence[Sequence[int]], start_block: int, end_block: int) -> tuple[int, ...]:
    """The blocks ``[start_block, end_block)`` of every group, group after group: an op's
    ``block_ids`` with several groups."""
    out: list[int] = []
    for blocks in group_blocks:
        part = blocks[start_block:end_block]
        if len(part) != end_block - start_block:
            raise ValueError(f"a group holds {len(blocks)} blocks, fewer than {end_block}")
        out.extend(int(b) for b in part)
    return tuple(out)


def split_group_blocks(block_ids: Sequence[int], num_groups: int) -> tuple[tuple[int, ...], ...]:
    """``join_group_blocks``'s inverse: one tuple per group. Raises ``ValueError`` when the ids
    do not split evenly (an op of another layout)."""
    if num_groups < 1 or len(block_ids) % num_groups:
        raise ValueError(f"{len(block_ids)} block ids do not split into {num_groups} groups")
    per = len(block_ids) // num_groups
    return tuple(tuple(block_ids[g * per:(g + 1) * per]) for g in range(num_groups))


def group_retrieve_skip(group: KVGroup, start: int, end: int, skip_first_n_tokens: int) -> int:
    """Tokens of a retrieve ``[start, end)`` not written into ``group``'s blocks: the engine's
    own (``skip_first_n_tokens``) and, for a sliding window, those before its first block vLLM
    keeps once ``end`` tokens are computed (it hands null blocks for them). vLLM may resume
    short of ``end`` (a whole-prompt hit: it computes the last prompt token); ``load_end`` keeps
    such a load where that first block is the same."""
    skip = max(skip_first_n_tokens, first_live_token(group, end) - start)
    return min(max(skip, 0), end - start)


def load_end(groups: Sequence[KVGroup], end: int, num_prompt_tokens: int, chunk: int) -> int:
    """Where a load of several groups reaching at most ``end`` (a multiple of ``chunk``) ends.

    vLLM resumes at ``min(end, num_prompt_tokens - 1)`` (a hit of the whole prompt leaves its
    last token to compute) and keeps a window's blocks from ``first_live_token`` of that point,
    while the worker, which sees only the retrieve, writes them from ``group_retrieve_skip``'s,
    taken at ``end``. One token short of ``end``, a window keeps one block more when
    ``end - window + 1`` is a multiple of the block size: that block would stay unwritten and
    be read. There the load ends a chunk earlier (vLLM resumes at that chunk's end, where both
    agree); elsewhere at ``end``."""
    while end > 0:
        resume = min(end, num_prompt_tokens - 1)
        if all(first_live_token(g, resume) == first_live_token(g, end) for g in groups):
            return end
        end -= chunk
    return 0


def store_floor(groups: Sequence[KVGroup], computed: int) -> int:
    """The first token every group still holds once ``computed`` tokens are computed: a store
    may start no earlier (``first_live_token`` of the narrowest window)."""
    return max((first_live_token(g, computed) for g in groups), default=0)


def sync_load_allowed(groups: Sequence[KVGroup]) -> bool:
    """Whether a load may finish within the step (vLLM's synchronous load): not with several
    groups, where vLLM cannot map a failed load's block ids back to a request (it then stops
    the engine) and takes the failure by request id, from an asynchronous load only."""
    return not several(groups)


def _describe(group: KVGroup) -> str:
    label = group.kind.value + (f" {group.window}" if group.kind is GroupKind.SLIDING_WINDOW else "")
    return f"{group.name}: {label}" if group.name else label
