"""The one timer mechanism of core_sm (``mpcache.core_sm.timers``): what ``TimerHeap`` offers a
machine beyond push / pop_due / next_deadline, and that no machine keeps a deadline heap of its own."""
from __future__ import annotations

import ast
from pathlib import Path

import attrs

import mpcache.core_sm
from mpcache.core_sm.timers import Timer, TimerHeap


@attrs.frozen
class Tick(Timer):
    n: int


def test_first_deadline_names_the_top_entry_even_a_stale_one_and_drops_nothing() -> None:
    alive = {1, 2}
    heap = TimerHeap(lambda t: isinstance(t, Tick) and t.n in alive)
    heap.push(1.0, Tick(1))
    heap.push(2.0, Tick(2))
    alive.discard(1)
    assert heap.first_deadline() == 1.0 and len(heap) == 2  # stale, still named, still there
    assert heap.next_deadline() == 2.0 and len(heap) == 1  # next_deadline drops it
    assert heap.first_deadline() == 2.0
    assert heap.pop_due(5.0) == Tick(2) and heap.first_deadline() is None


def test_clear_drops_every_entry_and_the_heap_works_on() -> None:
    heap = TimerHeap(lambda t: True, slack=4)
    for i in range(3):
        heap.push(float(i), Tick(i))
    heap.clear()
    assert len(heap) == 0 and heap.first_deadline() is None and heap.pop_due(10.0) is None
    heap.push(7.0, Tick(7))
    assert heap.next_deadline() == 7.0 and heap.pop_due(7.0) == Tick(7)


def test_live_count_bounds_the_heap_by_the_live_entries_now() -> None:
    """With ``live_count`` the heap is rebuilt as soon as it holds more than twice the live
    entries now plus ``slack``, whatever the last rebuild kept; the rebuild keeps exactly the
    live entries and changes no firing order."""
    alive: set[int] = set()
    heap = TimerHeap(lambda t: isinstance(t, Tick) and t.n in alive, slack=8, live_count=alive.__len__)
    for i in range(100):  # 100 live, then all but 3 end
        alive.add(i)
        heap.push(1000.0 - i, Tick(i))
    assert heap.compactions == 0
    alive.intersection_update({5, 50, 95})
    for i in range(100, 2000):  # each ends as soon as it is armed
        alive.add(i)
        heap.push(float(i), Tick(i))
        alive.discard(i)
        assert len(heap) <= 2 * (len(alive) + 1) + 8 + 1
    assert heap.compactions > 0
    assert [heap.pop_due(2000.0) for _ in range(4)] == [Tick(95), Tick(50), Tick(5), None]


def test_pop_due_entry_hands_over_stale_entries_too_in_firing_order() -> None:
    """``pop_due_entry`` is for a machine whose expiry step judges each entry itself: every due
    entry comes out with its deadline, live or stale, in ``(deadline, seq)`` order; nothing
    that is not due."""
    alive = {1, 3}
    heap = TimerHeap(lambda t: isinstance(t, Tick) and t.n in alive)
    for n, deadline in ((1, 2.0), (2, 1.0), (3, 2.0), (4, 9.0)):
        heap.push(deadline, Tick(n))
    assert [heap.pop_due_entry(5.0) for _ in range(4)] == [(1.0, Tick(2)), (2.0, Tick(1)), (2.0, Tick(3)), None]
    assert len(heap) == 1 and heap.pop_due_entry(8.9) is None and heap.pop_due_entry(9.0) == (9.0, Tick(4))


def test_seq_names_the_last_entry_pushed_whatever_was_popped_or_rebuilt() -> None:
    """``seq``: what the next push's entry is numbered after (a machine's batch ids): it counts
    pushes only, so pops, rebuilds and ``clear`` leave it."""
    alive: set[int] = set()
    heap = TimerHeap(lambda t: isinstance(t, Tick) and t.n in alive, slack=2)
    assert heap.seq == 0
    for i in range(10):
        heap.push(float(i), Tick(i))
    assert heap.compactions > 0 and heap.seq == 10
    heap.pop_due_entry(100.0)
    heap.clear()
    heap.push(1.0, Tick(99))
    assert heap.seq == 11


def test_floor_holds_off_rebuilds_until_the_heap_passes_it() -> None:
    """With ``floor`` the heap is rebuilt once it holds more than ``max(floor, 2 * live + slack)``
    entries (live: those the last rebuild kept): ``slack=0, floor=F`` is "twice the live entries,
    never below F" (the L1 index's rule); the default floor is ``slack`` (the rule without it)."""
    alive: set[int] = set()
    heap = TimerHeap(lambda t: isinstance(t, Tick) and t.n in alive, slack=0, floor=6)
    for i in range(6):  # six stale entries: at the floor, not past it
        heap.push(float(i), Tick(i))
    assert heap.compactions == 0 and len(heap) == 6
    alive.update({100, 101, 102, 103})
    heap.push(100.0, Tick(100))  # past the floor: rebuilt to its one live entry
    assert heap.compactions == 1 and len(heap) == 1
    for n in (101, 102, 103):  # the next rebuild waits for the floor again, not 2 * 1
        heap.push(float(n), Tick(n))
    assert heap.compactions == 1
    for i in range(200, 203):
        heap.push(float(i), Tick(i))
    assert heap.compactions == 2 and len(heap) == 4  # 7 > 6: the four live ones kept
    for i in range(203, 207):
        heap.push(float(i), Tick(i))
    assert heap.compactions == 2 and len(heap) == 8  # 8 = 2 * 4 live: not past it
    heap.push(207.0, Tick(207))
    assert heap.compactions == 3 and len(heap) == 4
    assert [heap.pop_due(1000.0) for _ in range(5)] == [Tick(100), Tick(101), Tick(102), Tick(103), None]


def test_every_heapq_user_in_core_sm_is_named_and_the_link_planner_and_l1_expiries_are_not() -> None:
    """Deadlines go on ``TimerHeap`` / ``ReapQueue``: a module that imports ``heapq`` is named
    here with what its heaps order, so a new hand-made deadline heap cannot slip in unnoticed.
    The two left order no time: the L1 index's free slots are slot numbers (the lowest handed out
    first), and the quota's orphan runs are keyed by recency (the index's use sequence), re-keyed
    in place when a run's head leaves -- nothing comes due at a time. The L1 index's lease and
    write-reservation expiries are on the index's ``TimerHeap`` (``_expiries``)."""
    from mpcache.core_sm.l1_index import L1Index

    orders_not_time = {
        "timers.py": "the timer mechanism itself",
        "l1_index.py": "free slots, lowest slot number first (a min-heap of ints, not a timer)",
        "l1_quota.py": "a forgotten tenant's orphan runs, by last use (a recency order, not a timer)",
    }
    assert isinstance(L1Index(1, 1)._expiries, TimerHeap)
    root = Path(mpcache.core_sm.__file__).parent
    importers = set()
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "heapq" or n.startswith("heapq.") for n in names):
                importers.add(path.name)
    assert "server_link.py" not in importers and "planner.py" not in importers
    assert importers <= set(orders_not_time), importers - set(orders_not_time)
