"""A test-only L2 tier that stalls (``--l2 python:slow_tier:make?delay=SECONDS``): it holds
nothing; every read and probe blocks ``delay`` seconds (or until ``close``) and then misses."""

from __future__ import annotations

import threading
from collections.abc import Sequence


class SlowTier:
    def __init__(self, delay: float) -> None:
        self.delay = delay
        self._closed = threading.Event()
        self._data: dict[bytes, bytes] = {}

    def read(self, key: bytes) -> bytes | None:
        self._closed.wait(self.delay)
        return None

    def write(self, key: bytes, data: bytes) -> None:
        self._data[key] = data

    def contains(self, key: bytes) -> bool:
        self._closed.wait(self.delay)
        return False

    def read_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self.read(k) for k in keys]

    def write_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        for k, v in items:
            self.write(k, v)

    def close(self) -> None:
        self._closed.set()

    def __repr__(self) -> str:
        return f"SlowTier(delay={self.delay})"


def make(arg: str) -> SlowTier:
    params = dict(p.split("=", 1) for p in arg.split("&") if p)
    return SlowTier(float(params.get("delay", "30")))
