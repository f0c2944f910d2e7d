"""The compiled completion poller (mpcache.kernels.gpu.make_event_poller) against a fake driver:
a ctypes callback in place of libcuda's cuEventQuery and the real clock, so CI checks what it
returns, when it queries and that it lets other threads run while it waits, without a GPU."""
from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

import numpy as np
import pytest

import mpcache.kernels.gpu as kg

NOT_READY = kg.CUDA_ERROR_NOT_READY


class FakeQuery:
    """``cuEventQuery``: each event's result is decided by ``ready_at`` (monotonic time it ends)
    and ``error`` (a result other than success once ended); every query is logged."""

    def __init__(self) -> None:
        self.ready_at: dict[int, float] = {}
        self.error: dict[int, int] = {}
        self.log: list[tuple[int, float]] = []
        self._cb = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64)(self._query)

    def _query(self, ev: int) -> int:
        now = time.monotonic()
        self.log.append((ev, now))
        if now < self.ready_at.get(ev, 0.0):
            return NOT_READY
        return self.error.get(ev, 0)

    def __getitem__(self, name: str) -> Any:
        assert name == "cuEventQuery"
        return self._cb


@pytest.fixture(scope="module")
def poller() -> tuple[FakeQuery, Any]:
    fake = FakeQuery()
    return fake, kg.make_event_poller(fake)  # compiled once for the module


def run(poll: Any, events: list[int], wake: float, end: float, every: float, most: float = 0.0) -> tuple[int, int, list[int]]:
    ev = np.array(events + [0] * 4, dtype=np.uint64)
    status = np.full(len(ev), -1, dtype=np.int64)
    k, n = poll(ev, len(events), status, int(wake * 1e9), int(end * 1e9), int(every * 1e9), int(max(most, every) * 1e9),
                np.zeros(2, np.int64))
    return int(k), int(n), [int(x) for x in status[: int(k)]]


def test_the_ready_prefix_and_its_results(poller: tuple[FakeQuery, Any]) -> None:
    fake, poll = poller
    now = time.monotonic()
    fake.ready_at.update({1: 0.0, 2: 0.0, 3: now + 60.0, 4: 0.0})
    fake.error[2] = 719  # a failed copy: no longer pending, reported with its error
    assert run(poll, [1, 2, 3, 4], now, now + 1.0, 1e-3) == (2, 1, [0, 719])
    # stream order: the first pending event ends the prefix even if later ones are done
    assert run(poll, [3, 4], now, now + 0.02, 1e-3)[0] == 0


def test_sleeps_until_wake_then_polls_until_the_first_ends(poller: tuple[FakeQuery, Any]) -> None:
    fake, poll = poller
    fake.log.clear()
    t0 = time.monotonic()
    fake.ready_at[10] = t0 + 0.06
    k, polls, status = run(poll, [10], t0 + 0.03, t0 + 5.0, 2e-3)
    t1 = time.monotonic()
    assert (k, status) == (1, [0])
    assert fake.log[0][1] >= t0 + 0.03  # no query before the wake time
    assert fake.log[-1][1] >= t0 + 0.06 and t1 - t0 < 1.0
    assert 2 <= polls <= 20 and polls == len(fake.log)  # ~15 polls of 2 ms in 30 ms, not a spin


def test_pauses_double_up_to_the_most(poller: tuple[FakeQuery, Any]) -> None:
    fake, poll = poller
    fake.log.clear()
    t0 = time.monotonic()
    fake.ready_at[15] = t0 + 60.0
    k, polls, _ = run(poll, [15], t0, t0 + 0.1, 1e-3, 8e-3)
    assert k == 0
    # pauses 1, 2, 4, 8, 8, ... ms: 15 ms in four pauses, then 8 ms each: ~15 looks in 100 ms
    gaps = [b[1] - a[1] for a, b in zip(fake.log, fake.log[1:])]
    assert 10 <= polls <= 17 and gaps[0] < 0.004 and gaps[3] >= 0.0075 and max(gaps[4:]) < 0.02


def test_gives_up_at_the_end_time(poller: tuple[FakeQuery, Any]) -> None:
    fake, poll = poller
    t0 = time.monotonic()
    fake.ready_at[20] = t0 + 60.0
    k, polls, _ = run(poll, [20], t0, t0 + 0.05, 5e-3)
    assert k == 0 and 2 <= polls <= 15
    assert 0.05 <= time.monotonic() - t0 < 1.0


def test_other_threads_run_while_it_waits(poller: tuple[FakeQuery, Any]) -> None:
    """The waiter holds no GIL while it sleeps: a Python thread keeps running meanwhile (with
    the GIL held, it could not take a single step during the compiled sleep)."""
    fake, poll = poller
    fake.ready_at[30] = 0.0
    seen: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            seen.append(time.monotonic())
            time.sleep(0.001)

    th = threading.Thread(target=spin)
    th.start()
    try:
        time.sleep(0.01)
        t0 = time.monotonic()
        run(poll, [30], t0 + 0.3, t0 + 5.0, 1e-3)  # sleeps 0.3 s in compiled code
    finally:
        stop.set()
        th.join()
    assert sum(1 for t in seen if t0 + 0.1 <= t <= t0 + 0.2) >= 10


def test_fine_timer_slack_is_per_thread() -> None:
    out: list[bool] = []
    th = threading.Thread(target=lambda: out.append(kg.fine_timer_slack()))
    th.start()
    th.join()
    assert out == [True]
