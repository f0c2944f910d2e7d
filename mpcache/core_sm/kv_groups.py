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
fine). They copy one block table of one KV layout: one full-attention or one sliding-window
group. For any other set of groups every request is a miss, said once at start with the reason.

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


def unrestorable(groups: Sequence[KVGroup]) -> str | None:
    """Why this version cannot restore (or store) requests of an engine with these groups, or
    None when it can: exactly one full-attention or sliding-window group (or none given)."""
    if not groups or (len(groups) == 1 and groups[0].kind in (GroupKind.FULL, GroupKind.SLIDING_WINDOW)):
        return None
    kinds = ", ".join(_describe(g) for g in groups)
    if any(g.kind is GroupKind.RECURRENT for g in groups):
        why = "recurrent state (Mamba / linear attention) is not stored"
    elif len(groups) > 1:
        why = "the workers copy one KV-cache group's blocks, not several"
    else:
        why = "only full-attention and sliding-window groups are restored"
    return f"KV-cache groups [{kinds}]: {why}"


def _describe(group: KVGroup) -> str:
    label = group.kind.value + (f" {group.window}" if group.kind is GroupKind.SLIDING_WINDOW else "")
    return f"{group.name}: {label}" if group.name else label
