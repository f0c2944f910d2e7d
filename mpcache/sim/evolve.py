"""``attrs.evolve`` with each class's init fields looked up once.

``attrs.evolve`` asks ``attrs.fields`` for the class on every call; the world evolves every
request it delivers (its ``reply_to`` and ``peer``), a few tens of thousands of times per hundred
seeds. This is the same copy -- the class's ``__init__`` called with every init field of the
instance, overridden by ``changes`` -- with the field list cached per class.
"""
from __future__ import annotations

from typing import Any, TypeVar

import attrs

T = TypeVar("T")

_INIT_FIELDS: dict[type, tuple[tuple[str, str], ...]] = {}


def evolve(inst: T, **changes: Any) -> T:
    """A copy of ``inst`` (an attrs instance) with ``changes`` applied, as ``attrs.evolve``."""
    cls = type(inst)
    fields = _INIT_FIELDS.get(cls)
    if fields is None:
        fields = _INIT_FIELDS[cls] = tuple((a.name, a.alias) for a in attrs.fields(cls) if a.init)  # type: ignore[arg-type]
    for name, alias in fields:
        if alias not in changes:
            changes[alias] = getattr(inst, name)
    return cls(**changes)
