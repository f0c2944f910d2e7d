"""Determinism self-check: same seed, same trace hash in a process with another PYTHONHASHSEED."""
from __future__ import annotations

from mpcache.sim.determinism import check


def test_twenty_seeds_identical_across_processes() -> None:
    assert check(list(range(20)), "default", hashseed="4242") == []


def test_a_legacy_profile_is_deterministic_too() -> None:
    assert check([1, 2, 3], "no-ack-wait", hashseed="17") == []
