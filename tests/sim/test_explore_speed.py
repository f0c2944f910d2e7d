"""What makes the explorer's states cheap, and that it changes no search: a machine's step
remembered per machine object (``Explorer._step``), dispatchers bound at their first use
(``core_sm.table.LazyDispatcher``), and the bytes a state is said to hold."""
from __future__ import annotations

from typing import Any

import attrs

from mpcache.sim.explore import PROFILE_WORLDS, WORLDS, Explorer, XWorld
from mpcache.core_sm.table import LazyDispatcher
from mpcache.sim.explore_state import clone, deep_size, dispatchers, snapshot
from mpcache.sim.profiles import get_profile


def outcome(world: XWorld, profile: str = "default", remember: bool = True, values: bool = True) -> tuple[Any, ...]:
    ex = Explorer(world, get_profile(profile), keep_values=values)
    ex.remember_steps = remember
    ex.run()
    v = None if ex.violation is None else (ex.violation[0].code, ex.violation[0].message, ex.violation[1])
    return ex.states, ex.transitions, ex.depth, ex.complete, sorted(ex.reached), v, ex.step_hits


def test_remembered_steps_change_no_search() -> None:
    """With and without the step memo: the same states, transitions, depth, rows reached, and
    the same counterexample of a legacy profile; with it, steps are taken from the memo."""
    for world, profile in ((WORLDS["ci"][0], "default"), (WORLDS["ci"][1], "default"),
                           (PROFILE_WORLDS["resend-status"], "resend-status"),
                           (PROFILE_WORLDS["release-all"], "release-all")):
        on, off = outcome(world, profile), outcome(world, profile, remember=False)
        assert on[:-1] == off[:-1], world.name
        assert off[-1] == 0
    assert outcome(WORLDS["ci"][0])[-1] > 100


def test_machines_kept_as_values_change_no_search() -> None:
    """States keeping the server, the lookup clients and the links as their values (restored in
    place) or as copies: the same states, transitions, depth, rows reached and counterexample;
    and the stored states hold values."""
    from mpcache.sim.explore_state import Held

    for world, profile in ((WORLDS["ci"][0], "default"), (WORLDS["ci"][1], "default"),
                           (WORLDS["ci"][6], "default"), (WORLDS["ci"][8], "default"),
                           (PROFILE_WORLDS["release-all"], "release-all"),
                           (PROFILE_WORLDS["no-reregister"], "no-reregister")):
        assert outcome(world, profile)[:-1] == outcome(world, profile, values=False)[:-1], world.name
    ex = Explorer(WORLDS["ci"][0])
    st = ex.initial()
    assert all(type(m) is Held for m in (*st.servers, *st.clients, *st.links))
    assert not any(type(m) is Held for m in (*Explorer(WORLDS["ci"][0], keep_values=False).initial().servers,))


def test_a_step_from_the_same_machine_gives_the_same_machine() -> None:
    """Two successors of one state that deliver the same frame to the server: the second takes
    the server the first made (no copy), with the same effects; the parent's is untouched."""
    ex = Explorer(attrs.evolve(WORLDS["ci"][0]))
    st = ex.initial()
    for e in (0, 1):  # both engines submit their lookups
        nxt = st.child()
        assert ex.apply(nxt, ("step", (e, 0))) is None
        nxt.owned = set()
        st = nxt
    lookup = next(i for i, f in enumerate(st.frames) if f.kind == "req")
    before = snapshot(st.servers[0], {})
    a, b = st.child(), st.child()
    assert ex.apply(a, ("deliver", lookup)) is None and ex.apply(b, ("deliver", lookup)) is None
    assert a.servers[0] is b.servers[0] is not st.servers[0] and ex.step_hits >= 1
    assert a.frames == b.frames and len(a.frames) > len(st.frames) - 1
    assert snapshot(st.servers[0], {}) == before != snapshot(a.servers[0], {})


def test_a_copys_dispatchers_bind_at_first_use() -> None:
    """A copied server's dispatchers hold their template until one runs; the one that runs is
    bound to the copy's machines, the others stay unbound, and the original is unchanged."""
    ex = Explorer(WORLDS["ci"][0])
    server = ex.new_server()  # a machine (a state keeps a server as values: explore_state.Held)
    copy = clone(server, dict(ex._static))
    lazy = dispatchers(copy)
    assert len(lazy) == 4 and all(type(d) is LazyDispatcher and "_fast" not in vars(d) for d in lazy)
    st = ex.initial()
    st.servers[0] = copy
    st.owned.add(("s", 0))
    nxt = st.child()
    assert ex.apply(nxt, ("step", (0, 0))) is None  # a lookup submitted: no server event yet
    frame = next(i for i, f in enumerate(nxt.frames) if f.kind == "req")
    nxt.owned = {("s", 0)}
    nxt.servers[0] = copy
    assert ex.apply(nxt, ("deliver", frame)) is None
    bound = [d for d in dispatchers(copy) if "_fast" in vars(d)]
    assert 1 <= len(bound) < 4
    for d in bound:
        for handler, _nexts, _assigned in d._fast.values():
            owner = handler.__self__
            assert any(owner is getattr(copy, n, None) for n in ("instances", "l2", "jobs", "transfers"))
    assert snapshot(server, {}) != snapshot(copy, {})
    assert all(type(d) is not LazyDispatcher for d in dispatchers(server))


def test_bytes_a_state_holds_leave_out_what_every_copy_shares() -> None:
    """B/state counts a copy's own objects: not the tables' next-state sets and rows every copy
    of a machine shares (most of a server's graph counted the old way)."""
    ex = Explorer(WORLDS["ci"][0])
    copy = clone(ex.new_server(), dict(ex._static))
    lazy = deep_size(copy, ex._static)
    for d in dispatchers(copy):
        assert d._fast  # bound: its rows' next-state sets and row keys are the tables'
    own, everything = deep_size(copy, ex._static), deep_size(copy)
    assert 0 < lazy < own < everything / 2, (lazy, own, everything)


def test_equal_values_share_a_snapshot_and_a_step() -> None:
    """Two stored servers with equal values (one machine reached by two paths): the second's
    snapshot and step are the first's, taken by the values, with no restore and no run."""
    from mpcache.core_sm.messages import TimerFired
    from mpcache.sim.explore_state import Held

    ex = Explorer(WORLDS["ci"][0])
    st = ex.initial()
    a = st.servers[0]
    b = Held(ex.server(st, 0), ex.world.horizon)
    assert a is not b and a.values == b.values
    assert ex._snap(a, {}, "k", ("s", 0)) is ex._snap(b, {}, "k", ("s", 0))
    first, second = [a], [b]
    ex._step_held(first, ("s", 0), a, (TimerFired(),), 5.0)
    hits = ex.step_hits
    ex._step_held(second, ("s", 0), b, (TimerFired(),), 5.0)
    assert ex.step_hits == hits + 1 and second[0] is first[0] is not a
