"""After a burst of abandoned jobs is reaped, the server hands glibc's free heap pages back
(runtime_zmq.memory.TrimAfterReap); steady traffic never trims."""
from __future__ import annotations

from mpcache.runtime_zmq import memory


def _policy(min_jobs: int = 1000) -> tuple[memory.TrimAfterReap, list[int]]:
    calls: list[int] = []

    def trim(pad: int) -> int:
        calls.append(pad)
        return 1

    return memory.TrimAfterReap(min_jobs=min_jobs, trim=trim), calls


def test_a_reaped_burst_trims_once() -> None:
    policy, calls = _policy()
    for jobs in (0, 500, 4000, 10_000, 10_000):
        assert not policy.update(jobs)
    assert not policy.update(6000)  # more than half still live
    assert policy.update(0)  # the reaper dropped the burst
    assert calls == [0]
    for jobs in (0, 0, 300, 0):  # and not again until another burst
        assert not policy.update(jobs)
    assert calls == [0] and policy.trims == 1


def test_steady_traffic_and_small_drops_never_trim() -> None:
    policy, calls = _policy()
    for i in range(1000):
        policy.update(800 + (i % 7) * 100)  # live jobs moving between 800 and 1,400
    assert calls == []


def test_the_high_water_restarts_after_a_trim() -> None:
    policy, calls = _policy()
    policy.update(5000)
    assert policy.update(1000)
    policy.update(1500)  # the mark restarts from 1,000: a fall to 600 is not a burst
    assert not policy.update(600)
    policy.update(3000)
    assert policy.update(100)
    assert calls == [0, 0]


def test_glibc_trim_is_found_and_callable() -> None:
    trim = memory._glibc_malloc_trim()
    if trim is not None:  # glibc: the real call returns 0 or 1
        assert trim(0) in (0, 1)
