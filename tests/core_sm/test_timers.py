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


def test_every_heapq_user_in_core_sm_is_named_and_the_link_and_planner_are_not() -> None:
    """Deadlines go on ``TimerHeap`` / ``ReapQueue``: a module that imports ``heapq`` is named
    here with what its heaps order, so a new hand-made deadline heap cannot slip in unnoticed;
    the deadline heaps still outside the mechanism are named as such."""
    orders_not_time = {
        "timers.py": "the timer mechanism itself",
        "l1_index.py": "free slots, lowest first; lease expiries (a deadline heap, not yet on TimerHeap)",
        "l1_quota.py": "a forgotten tenant's orphan runs, by last use",
    }
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
