"""The one dispatch mechanism of every core_sm machine: a transition table that ``handle`` runs.

In the style of hyper-h2's ``H2ConnectionStateMachine``: a machine declares one ``Table``,
``(state, event type) -> Transition(handler, next states)``, and its ``handle`` executes it --
the table is not a description checked after the fact, it is what decides which code runs.
A table comes in one of two forms: an *assigning* table (``assigns=True``: every row names
exactly one next state, and the dispatcher makes the entity that state) -- the form every
machine is converging on -- and a *checking* table (rows name the states a handler may leave
the entity in, and the dispatcher checks afterwards), which the machines not yet converted keep.

Contract:

* **Addressing.** Every event addresses one entity of the machine (a job of a request id, a
  transfer id, an op, an instance, ...). The machine says which (``address(event) -> entity``)
  and what state that entity is in (``state_of(entity) -> state``); an entity the machine does
  not hold is in the table's ``absent`` state.
* **Guards.** Where the next state depends on more than the event's type (an ack that is the
  last one owed, a status reply that carries the final count, a deadline already passed), the
  table names a guard for that raw type: ``guard(event, state, now) -> event``, a pure method
  of the machine (it reads, changes nothing, emits nothing) that turns the raw event into the
  specific event type whose row applies (or returns it unchanged). It runs after the state is
  read and before the row is looked up, so each ``(state, specific event)`` row names one next
  state. Guards are resolved on the machine by name, like handlers.
* **Execution.** ``Dispatcher.run(event, now, out)`` looks up ``(state_of(address(event)),
  type(event))`` (after the guard, if any). Found: the row's handler runs, ``handler(event,
  now, out)``, appending effects to ``out``. The handler is resolved on the machine *by the
  function given in the table* when the dispatcher is built (``Table.bind``), so a subclass that
  overrides that method (a legacy profile in the simulator) is what runs.
* **Assignment (assigning tables).** After the handler, the dispatcher calls the machine's
  ``set_state(entity, next_state)`` with the row's one next state: the row's next state is what
  the entity becomes. Handlers change the entity's data and append effects; they never set its
  state. ``set_state(entity, absent)`` forgets the entity. A handler does not refuse (a request
  that may be refused is told apart by a guard, into a row of its own).
* **Illegal pairs** never raise and are never silent: a request (an event with a ``reply_to``)
  gets exactly one ``ErrorReply(reply_to, ProtocolError(table.illegal_kind, ...))`` through the
  machine's ``refuse`` callback; an internal event (a completion, a typed timer) is counted in
  ``counters["stale_events"]``. Nothing changes.
* **Next states are enforced (checking tables).** After the handler, the entity's state must be
  one the row lists -- or, when the handler refused the request (an ``ErrorReply`` to its
  ``reply_to``), the state it was in. Anything else is counted in ``counters["table_violations"]``,
  never raised: the machine's walk tests assert 0 for the fixed machines. (Not an internal error:
  a legacy profile of the simulator changes transitions on purpose, and must be caught by its
  oracle, not this.) An assigning table's machine checks instead, in its ``check_invariants``,
  that its records agree with the state assigned.
* **Typed timers.** A machine's timers are small frozen classes (``mpcache.core_sm.timers.Timer``), one
  per kind, that are events of its table like any other (their rows say what a deadline does in
  each state) -- no string kinds, no if-chains.

``Table.rows`` is a plain mapping, so tests walk every ``state x event`` pair and docs are
rendered from it (``mpcache.core_sm.describe``); ``Dispatcher.trace`` (a list, when a test sets one)
records every row executed (the specific event type a guard chose), so a walk can show each
listed transition happening.
"""
from __future__ import annotations

import copy
import enum
from collections.abc import Callable, Hashable, Iterable, Mapping
from operator import attrgetter, is_
from types import FunctionType, MethodType
from typing import Any, Generic, TypeVar, cast

import attrs

from mpcache.core_sm.effects import Effect, ErrorReply
from mpcache.core_sm.errors import ErrorKind, ProtocolError
from mpcache.core_sm.timers import Timer, TimerHeap

S = TypeVar("S", bound=enum.Enum)
# A handler as written in the machine's class: ``def _on_x(self, event, now, out) -> None``.
Handler = Callable[[Any, Any, float, list[Effect]], None]
BoundHandler = Callable[[Any, float, list[Effect]], None]
# A guard as written in the machine's class: ``def _classify_x(self, event, state, now) -> event``.
Guard = Callable[[Any, Any, Any, float], Any]
BoundGuard = Callable[[Any, Any, float], Any]


@attrs.frozen
class Transition(Generic[S]):
    """One row: the method that handles the event in that state, and the states it may leave
    the entity in (a refused request leaves it where it was)."""

    handler: Handler
    next_states: frozenset[S]

    @property
    def next_state(self) -> S:
        """The one next state of an assigning table's row."""
        (state,) = self.next_states
        return state


class Table(Generic[S]):
    """``(state, event type) -> Transition``. Build it once per machine class (a module constant).

    ``absent`` is the state of an entity the machine does not hold; ``illegal_kind`` the
    ``ErrorKind`` a request gets for a pair the table does not list. ``assigns``: every row names
    exactly one next state (a bare state), which the dispatcher assigns; ``guards``: raw event
    type -> the machine's method that classifies it (see the module docstring)."""

    def __init__(self, name: str, states: type[S], absent: S,
                 rows: Mapping[tuple[S, type], tuple[Handler, S | Iterable[S]]],
                 illegal_kind: ErrorKind = ErrorKind.ILLEGAL_STATE, *, assigns: bool = False,
                 guards: Mapping[type, Guard] | None = None) -> None:
        self.name = name
        self.states = states
        self.absent = absent
        self.illegal_kind = illegal_kind
        self.assigns = assigns
        self.guards: dict[type, Guard] = dict(guards or {})
        self.rows: dict[tuple[S, type], Transition[S]] = {}
        for (state, event_type), (handler, nexts) in rows.items():
            if not isinstance(state, states):
                raise TypeError(f"{name}: {state!r} is not a {states.__name__}")
            if assigns and not isinstance(nexts, states):
                raise TypeError(f"{name}: row ({state.name}, {event_type.__name__}) of an assigning table "
                                f"names {nexts!r}, not one {states.__name__}")
            next_states = frozenset((nexts,)) if isinstance(nexts, states) else frozenset(
                cast(Iterable[S], nexts))
            self.rows[(state, event_type)] = Transition(handler, next_states)
        self._plans: dict[type, _BindPlan | None] = {}  # bind: per machine class

    def events(self) -> tuple[type, ...]:
        """Every event type some row names, in first-row order."""
        return tuple(dict.fromkeys(e for _s, e in self.rows))

    def allowed(self, state: S, event_type: type) -> frozenset[S] | None:
        """The next states of ``(state, event_type)``, None for an illegal pair."""
        row = self.rows.get((state, event_type))
        return None if row is None else row.next_states

    def bind(self, machine: object, address: Callable[[Any], Hashable],
             state_of: Callable[[Hashable], S], counters: dict[str, int],
             refuse: Callable[[list[Effect], Hashable, ProtocolError], None],
             set_state: Callable[[Hashable, S], None] | None = None) -> Dispatcher[S]:
        """A dispatcher for ``machine``: every row's handler and every guard resolved on it
        (overrides win). An assigning table needs ``set_state``; a checking one takes none.

        What resolving a name gives depends only on the machine's class (a plain function found
        on the class, and not shadowed in the instance's ``__dict__``), so the names are
        resolved once per class (``_BindPlan``) and each instance only binds that class's
        distinct functions to itself: the rows it gets are the ones ``getattr`` per row gives."""
        if self.assigns != (set_state is not None):
            raise TypeError(f"{self.name}: set_state is for assigning tables, and they need one")
        cls = type(machine)
        plan = self._plans.get(cls, _NO_PLAN)
        if plan is _NO_PLAN or (plan is not None and not plan.current(self, cls)):
            plan = self._plans[cls] = _BindPlan.of(self, cls)
        own = getattr(machine, "__dict__", None)
        if plan is None or (own and not own.keys().isdisjoint(plan.names)):
            bound: dict[tuple[S, type], tuple[BoundHandler, frozenset[S]]] = {}
            for key, row in self.rows.items():
                bound[key] = (getattr(machine, row.handler.__name__), row.next_states)
            guards: dict[type, BoundGuard] = {raw: getattr(machine, guard.__name__)
                                              for raw, guard in self.guards.items()}
            return Dispatcher(self, bound, address, state_of, counters, refuse, guards, set_state)
        methods = [MethodType(func, machine) for func in plan.funcs]
        return Dispatcher(self, {key: (methods[i], nexts) for key, i, nexts in plan.bound}, address, state_of,
                          counters, refuse, {raw: methods[i] for raw, i in plan.guards}, set_state,
                          fast={key: (methods[i], values, assigned) for key, i, values, assigned in plan.fast})


@attrs.frozen
class _BindPlan:
    """What binding a table on one machine class comes to, resolved once per class: the
    distinct functions its rows' and guards' names resolve to on the class, and each row (and
    the dispatcher's fast row) and guard with its function by index."""

    names: frozenset[str]
    funcs: tuple[Callable[..., Any], ...]
    bound: tuple[tuple[Any, int, frozenset[Any]], ...]
    fast: tuple[tuple[tuple[Any, type], int, frozenset[Any], Any], ...]
    guards: tuple[tuple[type, int], ...]
    # What the plan was made from, to tell when it no longer holds (a test edits a row or a
    # guard, or replaces a handler on the class): the rows' and guards' keys and values, by
    # identity, and the functions' names on the class.
    made_from: tuple[tuple[Any, ...], ...]
    resolve: Callable[[type], tuple[Any, ...]]

    def current(self, table: Table[Any], cls: type) -> bool:
        """Whether the table's rows and guards, and what the names resolve to on ``cls``, are
        still the ones the plan was made from (identity; checked in C, per ``bind``)."""
        rows, guards = table.rows, table.guards
        keys, transitions, guard_keys, guard_funcs = self.made_from
        return (len(rows) == len(keys) and len(guards) == len(guard_keys)
                and all(map(is_, rows, keys)) and all(map(is_, rows.values(), transitions))
                and all(map(is_, guards, guard_keys)) and all(map(is_, guards.values(), guard_funcs))
                and all(map(is_, self.resolve(cls), self.funcs)))

    @staticmethod
    def of(table: Table[Any], cls: type) -> _BindPlan | None:
        """The plan of ``table`` on ``cls``, or None where an instance's ``getattr`` may not be
        a plain function of the class bound to it (a class attribute lookup of its own, a name
        that is not a plain function): those machines are bound name by name."""
        if cls.__getattribute__ is not object.__getattribute__:  # type: ignore[comparison-overlap]
            return None
        names = [row.handler.__name__ for row in table.rows.values()] + [g.__name__ for g in table.guards.values()]
        index: dict[str, int] = {}
        funcs: list[Callable[..., Any]] = []
        for name in names:
            if name in index:
                continue
            found = next((vars(k)[name] for k in cls.__mro__ if name in vars(k)), None)
            if type(found) is not FunctionType:
                return None
            index[name] = len(funcs)
            funcs.append(found)
        assigns = table.assigns
        bound = tuple((key, index[row.handler.__name__], row.next_states) for key, row in table.rows.items())
        fast = tuple(((state._value_, event_type), index[row.handler.__name__],
                      frozenset(n._value_ for n in row.next_states),
                      next(iter(row.next_states)) if assigns else None)
                     for (state, event_type), row in table.rows.items())
        guards = tuple((raw, index[g.__name__]) for raw, g in table.guards.items())
        made_from = (tuple(table.rows), tuple(table.rows.values()), tuple(table.guards),
                     tuple(table.guards.values()))
        getter = attrgetter(*index) if len(index) > 1 else None
        if getter is not None:
            resolve: Callable[[type], tuple[Any, ...]] = getter
        elif index:
            (only,) = index
            resolve = lambda c: (getattr(c, only),)  # noqa: E731
        else:
            resolve = lambda c: ()  # noqa: E731
        return _BindPlan(frozenset(names), tuple(funcs), bound, fast, guards, made_from, resolve)


_NO_PLAN: Any = object()  # Table._plans: a class not planned yet


class Dispatcher(Generic[S]):
    """A table bound to one machine instance (see the module docstring for the contract)."""

    def __init__(self, table: Table[S], bound: dict[tuple[S, type], tuple[BoundHandler, frozenset[S]]],
                 address: Callable[[Any], Hashable], state_of: Callable[[Hashable], S],
                 counters: dict[str, int],
                 refuse: Callable[[list[Effect], Hashable, ProtocolError], None],
                  guards: dict[type, BoundGuard] | None = None,
                 set_state: Callable[[Hashable, S], None] | None = None, *,
                 fast: dict[tuple[Any, type], tuple[BoundHandler, frozenset[Any], Any]] | None = None) -> None:
        self.table = table
        self._bound = bound
        # The hot path keys rows by the state's value (a str, hashed in C) instead of the enum
        # member (Enum.__hash__ is a Python call): same rows, fewer calls per event. A row is
        # (handler, the next states' values, the one next state of an assigning row or None).
        # (``fast``: these rows, built already -- ``Table.bind`` from its plan of the machine's class.)
        self._fast: dict[tuple[Any, type], tuple[BoundHandler, frozenset[Any], Any]] = fast if fast is not None else {
            (state._value_, event_type): (handler, frozenset(n._value_ for n in nexts),
                                          next(iter(nexts)) if set_state is not None else None)
            for (state, event_type), (handler, nexts) in bound.items()}
        self._address = address
        self._state_of = state_of
        self._counters = counters
        self._refuse = refuse
        self._guards: dict[type, BoundGuard] = guards or {}
        self._set_state = set_state
        for name in ("stale_events", "table_violations"):
            counters.setdefault(name, 0)
        # Tests set a list here to record every executed row as (state, event type, state after).
        self.trace: list[tuple[S, type, S]] | None = None

    def rows(self) -> list[tuple[tuple[S, type], tuple[BoundHandler, frozenset[S]]]]:
        """The bound rows: ((state, event type), (handler on the machine, next states))."""
        return list(self._bound.items())

    def run(self, event: Any, now: float, out: list[Effect]) -> bool:
        """Execute the row of ``event``; True if one ran, False for an illegal pair."""
        entity = self._address(event)
        state = self._state_of(entity)
        if self._guards:
            guard = self._guards.get(type(event))
            if guard is not None:
                event = guard(event, state, now)
        row = self._fast.get((state._value_, type(event)))
        if row is None:
            reply_to = getattr(event, "reply_to", None)
            if reply_to is None:
                self._counters["stale_events"] += 1
            else:
                self._refuse(out, reply_to, ProtocolError(
                    self.table.illegal_kind,
                    f"{type(event).__name__} is not allowed in {type(state).__name__}.{state.name}"))
            return False
        handler, nexts, assigned = row
        if assigned is not None:
            handler(event, now, out)
            self._set_state(entity, assigned)  # type: ignore[misc]
            if self.trace is not None:
                self.trace.append((state, type(event), assigned))
            return True
        mark = len(out)
        handler(event, now, out)
        after = self._state_of(entity)
        if self.trace is not None:
            self.trace.append((state, type(event), after))
        if after._value_ not in nexts:
            reply_to = getattr(event, "reply_to", None)
            refused = reply_to is not None and after is state and any(
                isinstance(e, ErrorReply) and e.reply_to == reply_to for e in out[mark:])
            if not refused:
                self._counters["table_violations"] += 1
        return True

    def shared_parts(self) -> tuple[Any, ...]:
        """What every copy of this dispatcher shares with it: its table, its rows' keys and
        next-state sets (a model checker names them shared before it copies machines)."""
        return (self.table, *self._fast.keys(), *(n for _h, n, _a in self._fast.values()), *self._bound.keys(),
                *(n for _h, n in self._bound.values()))

    def copied(self, memo: dict[int, Any], dc: Callable[[Any, dict[int, Any]], Any] = copy.deepcopy) -> Dispatcher[Any]:
        """This dispatcher as part of a deep copy of its machine (``memo`` as ``copy.deepcopy``'s;
        ``dc`` the copier of everything else): the table and the rows' next-state sets shared,
        every handler (and guard, and the machine's ``set_state``) bound again to the copied
        machine -- lazily, at the copy's first use, where they are all bound on one machine."""
        return _copy_dispatcher(self, memo, dc)

    def __deepcopy__(self, memo: dict[int, Any]) -> Dispatcher[Any]:
        return _copy_dispatcher(self, memo, copy.deepcopy)


# ---- copies of a dispatcher (a model checker copies machines; ``Dispatcher.copied``) ----------
# A copy shares the table and the rows' next-state sets and binds every handler again, to the
# copied machine: where the handlers are all bound on one machine, lazily, at the copy's first
# use, from a template per table and machine class.


@attrs.frozen
class DispatcherTemplate:
    """What every copy of a dispatcher of one table bound on one machine class shares: the
    table's distinct handler and guard functions, and each row's key, function (by index) and
    next states, as the dispatcher holds them."""

    funcs: tuple[Any, ...]
    bound: tuple[tuple[Any, int, Any], ...]
    fast: tuple[tuple[Any, int, Any, Any], ...]
    guards: tuple[tuple[type, int], ...]


_TEMPLATES: dict[tuple[Table[Any], type], DispatcherTemplate | None] = {}  # by table and machine class
TEMPLATE_PARTS: set[int] = set()  # what the templates hold (row keys, next states): shared by every copy


def _owner(d: Dispatcher[Any]) -> Any:
    for h, _n in d._bound.values():
        return getattr(h, "__self__", None)
    return None


def _template(d: Dispatcher[Any], owner: Any) -> DispatcherTemplate | None:
    """The dispatcher's template, or None where its handlers are not all bound on one machine
    (then it is copied handler by handler)."""
    key = (d.table, type(owner))
    if key in _TEMPLATES:
        return _TEMPLATES[key]
    index: dict[Any, int] = {}
    methods: list[Any] = [h for h, _n in d._bound.values()] + [h for h, _n, _a in d._fast.values()] + list(
        d._guards.values())
    template = None
    if all(isinstance(h, MethodType) and h.__self__ is owner for h in methods):
        func = attrgetter("__func__")
        bound = tuple((k, index.setdefault(func(h), len(index)), n) for k, (h, n) in d._bound.items())
        fast = tuple((k, index.setdefault(func(h), len(index)), n, a) for k, (h, n, a) in d._fast.items())
        guards = tuple((t, index.setdefault(func(g), len(index))) for t, g in d._guards.items())
        template = DispatcherTemplate(tuple(index), bound, fast, guards)
        TEMPLATE_PARTS.update(id(x) for row in (*bound, *fast) for x in (row, *row))
    _TEMPLATES[key] = template
    return template


_WIRES = ("_address", "_state_of", "_refuse", "_set_state")  # a dispatcher's callables besides its rows
_LAZY = frozenset({"_bound", "_fast", "_guards", *_WIRES})  # what a lazy copy binds at its first use


class LazyDispatcher(Dispatcher[Any]):
    """A dispatcher's copy whose handlers are bound to the copied machine at its first use (any
    of ``_LAZY`` read), not when the machine is copied: an action runs one or two of a machine's
    dispatchers, a server has four (73 rows, each bound twice: ``_bound`` and ``_fast``). Until
    then it holds its template, the copied machine, and its other callables as (function, copied
    object) pairs or shared values; ``table``, ``trace`` and the counters are its own at once."""

    _plan: tuple[DispatcherTemplate, Any, tuple[tuple[str, Any, Any], ...]]

    def __getattr__(self, name: str) -> Any:
        if name not in _LAZY:
            raise AttributeError(name)
        self._bind()
        return vars(self)[name]

    def _bind(self) -> None:
        template, owner, wires = vars(self).pop("_plan")
        bound = [MethodType(f, owner) for f in template.funcs]
        ns = vars(self)
        ns["_bound"] = {k: (bound[i], n) for k, i, n in template.bound}
        ns["_fast"] = {k: (bound[i], n, a) for k, i, n, a in template.fast}
        ns["_guards"] = {t: bound[i] for t, i in template.guards}
        for name, func, obj in wires:
            ns[name] = obj if func is None else MethodType(func, obj)


def _wires(d: Dispatcher[Any], memo: dict[int, Any],
           dc: Callable[[Any, dict[int, Any]], Any]) -> tuple[tuple[str, Any, Any], ...]:
    """A dispatcher's callables besides its rows, for a lazy copy: a bound method as (its
    function, the copy of its object), anything else copied (a function: shared)."""
    plan = vars(d).get("_plan")
    if plan is not None:  # a lazy copy not bound yet
        return tuple((n, f, dc(o, memo)) for n, f, o in plan[2])
    out: list[tuple[str, Any, Any]] = []
    for name in _WIRES:
        h = vars(d)[name]
        if type(h) is MethodType:
            out.append((name, h.__func__, dc(h.__self__, memo)))
        else:
            out.append((name, None, dc(h, memo)))
    return tuple(out)


def _copy_dispatcher(d: Dispatcher[Any], memo: dict[int, Any],
                     dc: Callable[[Any, dict[int, Any]], Any] = copy.deepcopy) -> Dispatcher[Any]:
    """deepcopy of a Dispatcher: the table and the rows' next-state sets shared, every handler
    (and guard, and the machine's set_state) bound again to the copied machine. Where its
    handlers are all bound on one machine, the copy is a ``LazyDispatcher``: bound at its first
    use, once per distinct function, from the template of its table and machine class (copy's
    generic path rebuilds every row tuple and bound method through __reduce_ex__)."""
    ns = vars(d)
    plan = ns.get("_plan")
    if plan is not None:
        template, owner = plan[0], plan[1]
    else:
        owner = _owner(d)
        template = _template(d, owner)
    if template is not None:
        lazy: LazyDispatcher = LazyDispatcher.__new__(LazyDispatcher)
        memo[id(d)] = lazy
        lns = vars(lazy)
        for name, value in ns.items():
            if name not in _LAZY and name != "_plan":
                lns[name] = dc(value, memo)
        lns["_plan"] = (template, dc(owner, memo), _wires(d, memo, dc))
        return lazy
    new: Dispatcher[Any] = Dispatcher.__new__(Dispatcher)
    memo[id(d)] = new
    ns = dict(ns)

    def rebind(h: Any) -> Any:
        return MethodType(h.__func__, dc(h.__self__, memo))

    ns["_bound"] = {k: (rebind(h), n) for k, (h, n) in d._bound.items()}
    ns["_fast"] = {k: (rebind(h), n, a) for k, (h, n, a) in d._fast.items()}
    ns["_guards"] = {t: rebind(g) for t, g in d._guards.items()}
    for name in _WIRES + ("_counters", "trace"):
        ns[name] = dc(ns[name], memo)
    vars(new).update(ns)
    return new


def run_due_timers(timers: TimerHeap, dispatcher_of: Callable[[Timer], Dispatcher[Any]], now: float,
                   out: list[Effect]) -> None:
    """Run every live timer due at ``now`` through the dispatcher of its table, in firing order
    (a handler may arm more, even due ones: they run too)."""
    if not timers.due(now):
        return
    timer = timers.pop_due(now)
    while timer is not None:
        dispatcher_of(timer).run(timer, now, out)
        timer = timers.pop_due(now)
