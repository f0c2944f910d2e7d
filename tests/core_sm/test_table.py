"""mpcache.core_sm.table: the table is what handle runs -- rows dispatch, illegal pairs are typed
errors (requests) or counted (internal events), next states are enforced, overrides win."""
from __future__ import annotations

import enum
from collections.abc import Hashable

import attrs
import pytest

from mpcache.core_sm.effects import Effect, ErrorReply, Reply
from mpcache.core_sm.errors import ErrorKind, ProtocolError
from mpcache.core_sm.table import Table, run_due_timers
from mpcache.core_sm.timers import Timer, TimerHeap


class DoorState(enum.Enum):
    ABSENT = "absent"
    OPEN = "open"


@attrs.frozen
class Open:
    door: str
    reply_to: Hashable = attrs.field(default=None, kw_only=True)


@attrs.frozen
class Close:
    door: str
    reply_to: Hashable = attrs.field(default=None, kw_only=True)


@attrs.frozen
class Slam(Timer):
    door: str


class Doors:
    def __init__(self) -> None:
        self.open: set[str] = set()
        self.counters: dict[str, int] = {"errors": 0}
        self.dispatch = TABLE.bind(self, lambda ev: ev.door, self.state, self.counters, self.refuse)

    def state(self, door: Hashable) -> DoorState:
        return DoorState.OPEN if door in self.open else DoorState.ABSENT

    def refuse(self, out: list[Effect], reply_to: Hashable, error: ProtocolError) -> None:
        self.counters["errors"] += 1
        out.append(ErrorReply(reply_to, error))

    def handle(self, event: object, now: float) -> list[Effect]:
        out: list[Effect] = []
        self.dispatch.run(event, now, out)
        return out

    def _on_open(self, ev: Open, now: float, out: list[Effect]) -> None:
        self.open.add(ev.door)
        out.append(Reply(ev.reply_to, True))

    def _on_close(self, ev: Close | Slam, now: float, out: list[Effect]) -> None:
        self.open.discard(ev.door)
        if isinstance(ev, Close):
            out.append(Reply(ev.reply_to, True))

    def _on_open_twice(self, ev: Open, now: float, out: list[Effect]) -> None:
        out.append(ErrorReply(ev.reply_to, ProtocolError(ErrorKind.VALIDATION, "already open")))


D = DoorState
TABLE: Table[DoorState] = Table("doors", DoorState, D.ABSENT, {
    (D.ABSENT, Open): (Doors._on_open, {D.OPEN}),
    (D.OPEN, Open): (Doors._on_open_twice, {D.OPEN}),
    (D.OPEN, Close): (Doors._on_close, {D.ABSENT}),
    (D.OPEN, Slam): (Doors._on_close, {D.ABSENT}),
})


def test_rows_dispatch_and_illegal_pairs_are_typed_errors_or_counted() -> None:
    d = Doors()
    assert d.handle(Open("a", reply_to=1), 0.0) == [Reply(1, True)]
    assert d.handle(Close("a", reply_to=2), 0.0) == [Reply(2, True)]
    (err,) = d.handle(Close("a", reply_to=3), 0.0)
    assert isinstance(err, ErrorReply) and err.reply_to == 3
    assert err.error.kind is ErrorKind.ILLEGAL_STATE and "Close" in err.error.message
    assert d.handle(Slam("a"), 0.0) == [] and d.counters["stale_events"] == 1
    assert d.counters["table_violations"] == 0
    assert TABLE.events() == (Open, Close, Slam)
    assert TABLE.allowed(D.ABSENT, Close) is None


def test_a_refusal_may_leave_the_state_and_anything_else_outside_the_row_is_a_violation() -> None:
    d = Doors()
    d.handle(Open("a", reply_to=1), 0.0)
    (err,) = d.handle(Open("a", reply_to=2), 0.0)  # refused: OPEN stays OPEN, which the row allows
    assert isinstance(err, ErrorReply) and d.counters["table_violations"] == 0

    class Broken(Doors):
        def _on_close(self, ev: Close | Slam, now: float, out: list[Effect]) -> None:
            out.append(Reply(ev.reply_to, True))  # forgets to close: OPEN is not a next state

    b = Broken()
    b.handle(Open("a", reply_to=1), 0.0)
    assert b.handle(Close("a", reply_to=2), 0.0) == [Reply(2, True)]  # the override ran
    assert b.counters["table_violations"] == 1


def test_timer_heap_skips_dead_entries_fires_in_order_and_stays_bounded() -> None:
    alive = {"a", "b"}
    heap = TimerHeap(lambda t: isinstance(t, Slam) and t.door in alive, slack=4)
    heap.push(2.0, Slam("b"))
    heap.push(1.0, Slam("a"))
    heap.push(1.0, Slam("c"))  # dead at once
    assert heap.next_deadline() == 1.0
    assert heap.pop_due(1.5) == Slam("a") and heap.pop_due(1.5) is None
    alive.clear()
    for i in range(1000):
        heap.push(float(i), Slam("x"))  # never live
    assert len(heap) <= 2 * 0 + 4 + 1 and heap.compactions > 0
    assert heap.next_deadline() is None


def test_run_due_timers_runs_each_live_due_timer_through_its_table_in_order() -> None:
    d = Doors()
    for door in ("a", "b", "c"):
        d.handle(Open(door, reply_to=door), 0.0)
    heap = TimerHeap(lambda t: isinstance(t, Slam) and t.door in d.open)
    heap.push(2.0, Slam("b"))
    heap.push(1.0, Slam("a"))
    heap.push(1.5, Slam("z"))  # no such door: dead, skipped
    heap.push(9.0, Slam("c"))  # not due
    d.dispatch.trace = []
    out: list[Effect] = []
    run_due_timers(heap, lambda _timer: d.dispatch, 5.0, out)
    assert [(s, e) for s, e, _after in d.dispatch.trace] == [(D.OPEN, Slam), (D.OPEN, Slam)]
    assert d.open == {"c"} and d.counters["stale_events"] == 0 and heap.next_deadline() == 9.0


# ------------------------------------------------------------------ the assigning form


@attrs.frozen
class Knock:
    door: str
    hard: bool = False


@attrs.frozen
class KnockHard(Knock):
    """A guard's specific event: a knock hard enough to open the door."""


class AssignedDoors:
    """Doors whose state is a field the dispatcher assigns; handlers only emit effects."""

    def __init__(self) -> None:
        self.states: dict[str, DoorState] = {}
        self.counters: dict[str, int] = {}
        self.dispatch = ASSIGNING.bind(self, lambda ev: ev.door, self.state, self.counters, self.refuse,
                                       self.set_state)

    def state(self, door: Hashable) -> DoorState:
        return self.states.get(str(door), DoorState.ABSENT)

    def set_state(self, door: Hashable, state: DoorState) -> None:
        if state is DoorState.ABSENT:
            self.states.pop(str(door), None)
        else:
            self.states[str(door)] = state

    def refuse(self, out: list[Effect], reply_to: Hashable, error: ProtocolError) -> None:
        out.append(ErrorReply(reply_to, error))

    def classify(self, ev: Knock, state: DoorState, now: float) -> Knock:
        return KnockHard(ev.door, ev.hard) if ev.hard else ev

    def on_knock(self, ev: Knock, now: float, out: list[Effect]) -> None:
        out.append(Reply(ev.door, "knock"))

    def on_slam(self, ev: Slam, now: float, out: list[Effect]) -> None:
        out.append(Reply(ev.door, "slam"))


ASSIGNING: Table[DoorState] = Table("assigned doors", DoorState, D.ABSENT, {
    (D.ABSENT, Knock): (AssignedDoors.on_knock, D.ABSENT),
    (D.ABSENT, KnockHard): (AssignedDoors.on_knock, D.OPEN),
    (D.OPEN, Slam): (AssignedDoors.on_slam, D.ABSENT),
}, assigns=True, guards={Knock: AssignedDoors.classify})


def test_an_assigning_table_makes_the_entity_its_rows_one_next_state() -> None:
    d = AssignedDoors()
    d.dispatch.trace = []
    out: list[Effect] = []
    assert d.dispatch.run(Knock("a"), 0.0, out) and d.state("a") is D.ABSENT  # the guard kept it a Knock
    assert d.dispatch.run(Knock("a", hard=True), 0.0, out) and d.state("a") is D.OPEN
    assert not d.dispatch.run(Knock("a", hard=True), 0.0, out)  # (OPEN, KnockHard): not listed
    assert d.counters["stale_events"] == 1 and d.state("a") is D.OPEN
    assert d.dispatch.run(Slam("a"), 0.0, out) and d.state("a") is D.ABSENT and d.states == {}
    assert out == [Reply("a", "knock"), Reply("a", "knock"), Reply("a", "slam")]
    # the trace names the specific event the guard chose, and the state assigned
    assert d.dispatch.trace == [(D.ABSENT, Knock, D.ABSENT), (D.ABSENT, KnockHard, D.OPEN),
                                (D.OPEN, Slam, D.ABSENT)]
    assert ASSIGNING.rows[(D.ABSENT, KnockHard)].next_state is D.OPEN


def test_an_assigning_table_takes_one_next_state_per_row_and_a_set_state() -> None:
    with pytest.raises(TypeError, match="one DoorState"):
        Table("bad", DoorState, D.ABSENT, {(D.OPEN, Slam): (AssignedDoors.on_slam, {D.ABSENT, D.OPEN})},
              assigns=True)
    with pytest.raises(TypeError, match="set_state"):
        ASSIGNING.bind(object(), lambda ev: ev.door, lambda door: D.ABSENT, {}, lambda *a: None)
    with pytest.raises(TypeError, match="set_state"):
        TABLE.bind(object(), lambda ev: ev.door, lambda door: D.ABSENT, {}, lambda *a: None,
                   lambda door, state: None)


def _handlers(doors: Doors) -> dict[tuple[DoorState, type], object]:
    return {key: handler for key, (handler, _nexts) in doors.dispatch.rows()}


def test_bind_resolves_names_once_per_class_and_still_sees_what_getattr_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bind`` resolves the rows' names once per machine class; what each instance gets is
    still ``getattr(machine, name)``: bound to that instance, a subclass's override, a handler
    replaced on the class after an earlier bind, an instance's own attribute, an edited row."""
    a, b = Doors(), Doors()
    for d in (a, b):
        for (state, event_type), handler in _handlers(d).items():
            assert handler == getattr(d, TABLE.rows[(state, event_type)].handler.__name__)
            assert handler.__self__ is d  # type: ignore[attr-defined]

    class Loud(Doors):
        def _on_open(self, ev: Open, now: float, out: list[Effect]) -> None:
            out.append(Reply(ev.reply_to, "loud"))

    assert Loud().handle(Open("x", reply_to="r"), 0.0) == [Reply("r", "loud")]
    assert Doors().handle(Open("x", reply_to="r"), 0.0) == [Reply("r", True)]

    def quiet(self: Doors, ev: Open, now: float, out: list[Effect]) -> None:
        out.append(Reply(ev.reply_to, "quiet"))

    with monkeypatch.context() as m:  # replaced on the class after Doors was planned
        m.setattr(Doors, "_on_open", quiet)
        assert Doors().handle(Open("x", reply_to="r"), 0.0) == [Reply("r", "quiet")]
    assert Doors().handle(Open("x", reply_to="r"), 0.0) == [Reply("r", True)]

    class Own(Doors):  # an instance attribute shadows the class's method
        def __init__(self) -> None:
            self._on_open = lambda ev, now, out: out.append(Reply(ev.reply_to, "own"))  # type: ignore[method-assign]
            super().__init__()

    assert Own().handle(Open("x", reply_to="r"), 0.0) == [Reply("r", "own")]

    row = (D.ABSENT, Open)
    with monkeypatch.context() as m:  # a row edited after Doors was planned
        m.setitem(TABLE.rows, row, type(TABLE.rows[row])(Doors._on_open_twice, frozenset({D.OPEN})))
        d = Doors()
        d.handle(Open("x", reply_to="r"), 0.0)
        assert d.state("x") is D.ABSENT  # _on_open_twice ran, not _on_open
    d = Doors()
    d.handle(Open("x", reply_to="r"), 0.0)
    assert d.state("x") is D.OPEN
