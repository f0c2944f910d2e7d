"""``mpcache-sim explore``: every interleaving of a small world, over the very core_sm machines.

Contract:

* **Actors** are the production machines (or a legacy profile's subclasses of them): one
  ``LookupServer`` per server, one ``LookupClient`` per engine. A new actor (the client transport
  machine, a planner) is one more entry of ``XState.actors``-style lists plus its ``_deliver``
  branch; the search, fingerprints and coverage do not change.
* **Network**: a bag (multiset) of frames in flight, ``Frame(kind, engine, server, corr, body)``.
  A request frame delivered to server s becomes the request with ``reply_to=(engine, corr,
  incarnation)`` and ``peer=f"sched{engine}"``; the server's ``Reply`` / ``ErrorReply`` become
  reply frames, delivered to the engine's client as ``ReplyReceived`` / ``RequestFailed``.
* **Actions** of a state, in a fixed order (so the search is deterministic): deliver any frame;
  drop or duplicate one (while ``faults`` lasts); advance the clock to the earliest deadline of
  any machine and fire what is due; the next step of each request's script (submit, wait until
  ``check`` answers, cleanup, end); crash + restart a server (while ``restarts`` lasts: a fresh
  machine, frames to the old incarnation are lost, each client is fed ``ServerEpoch``).
* **Fingerprints**: ``canonical(state)`` walks the machines' own attributes (counters, traces,
  dispatchers and configuration left out: they never decide a transition) into nested tuples;
  time is kept absolute, which is sound (no two different states merge) and finite here because
  the clock only moves to deadlines. **Symmetry**: engines whose requests are interchangeable are
  relabelled in the sorted order of their label-free signature before the fingerprint is taken.
* **Oracles** (checked on every transition): core_sm's own ``check_invariants`` and
  ``table_violations`` / ``internal_errors`` counters of every machine; F11 (a request answered
  twice, or a non-deferred request left unanswered by its handler) with the same
  ``DEFERRED_REPLIES`` the simulated world uses; **deadlock** (no enabled action while a request
  script is unfinished); **bounded liveness** (a lookup resolved by the client's timeout on a
  path with no fault and no restart: nothing answered it in time).
* **Coverage**: every row of every table of the explored machines, reached or not.

BFS gives shortest counterexamples; ``--dfs`` explores depth first. The search is deterministic.
"""
from __future__ import annotations

import copy
import enum
import hashlib
import sys
import time
import tracemalloc
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from mpcache.core_sm.chunks import ChunkChain
from mpcache.core_sm.effects import ErrorReply, Reply, SendRequest
from mpcache.core_sm.lookup_client import TABLES as CLIENT_TABLES
from mpcache.core_sm.lookup_client import LookupClient, LookupClientConfig
from mpcache.core_sm.messages import (
    Cleanup,
    EndRequest,
    ReplyReceived,
    RequestFailed,
    ServerEpoch,
    SubmitLookup,
    TimerFired,
)
from mpcache.core_sm.server import TABLES as SERVER_TABLES
from mpcache.core_sm.server import LookupServer, ServerConfig, ServerState
from mpcache.core_sm.table import Dispatcher
from mpcache.sim.oracles import Violation

CHUNK = 16
# The world's DEFERRED_REPLIES: the same list, not a copy (the import is local to keep the
# explorer from loading the trio world unless it is asked to).
SCRIPT = ("submit", "check", "cleanup", "end")


@attrs.frozen
class XWorld:
    """A small world: what is explored, and the bounds."""

    name: str = "custom"
    engines: int = 1
    servers: int = 1
    requests: int = 1  # per engine
    faults: int = 0  # drops + duplicates in total
    restarts: int = 0  # server crash + restart, in total
    max_depth: int = 60
    max_states: int = 200_000
    symmetry: bool = True


WORLDS: dict[str, list[XWorld]] = {
    "ci": [XWorld("ci-2e1s", engines=2, servers=1, requests=1, faults=1, restarts=1),
           XWorld("ci-1e2s", engines=1, servers=2, requests=1, faults=1, restarts=0)],
    "tiny": [XWorld("tiny", engines=1, servers=1, requests=1)],
    "medium": [XWorld("medium", engines=2, servers=1, requests=2, faults=1, restarts=1)],
}


@attrs.frozen(order=True)
class Frame:
    kind: str  # "req" | "rep"
    engine: int
    server: int
    corr: int
    incarnation: int
    body: Any = attrs.field(order=False, eq=False)
    key: tuple[Any, ...] = attrs.field(order=False, eq=True)  # canonical body, for the bag


@attrs.define
class XState:
    now: float
    servers: list[LookupServer]
    clients: list[LookupClient]
    frames: list[Frame]
    scripts: list[list[int]]  # [engine][request] -> index into SCRIPT (len: done)
    incarnation: list[int]
    awaiting: list[set[Any]]  # per server: reply_tos handled, not yet answered (deferred)
    faults: int
    restarts: int
    clean: bool = True  # no fault and no restart on the path so far


class Explorer:
    def __init__(self, world: XWorld, profile: Any = None) -> None:
        self.world = world
        self.server_class: type[LookupServer] = getattr(profile, "server_class", LookupServer)
        self.client_class: type[LookupClient] = getattr(profile, "lookup_client_class", LookupClient)
        from mpcache.sim.world import DEFERRED_REPLIES
        self.deferred = frozenset(DEFERRED_REPLIES)
        self.reached: set[tuple[str, str, str]] = set()
        self.states = 0
        self.transitions = 0
        self.depth = 0
        self.complete = False
        self.violation: tuple[Violation, list[str]] | None = None
        self.seconds = 0.0
        self.bytes_per_state = 0.0
        self._shared_memo: dict[int, Any] | None = None
        self.server_config = ServerConfig(chunk_size=CHUNK, num_slots=8, slot_bytes=4096, lease_ttl=2.0,
                                          tombstone_ttl=1.0, abandoned_job_ttl=1.0, instance_ttl=None,
                                          ack_first=True)
        self.client_config = LookupClientConfig(num_servers=world.servers, model_name="x", chunk_size=CHUNK,
                                                poll_interval=0.01, lookup_timeout=0.1, result_ttl=1.0)

    # ------------------------------------------------------------------ machines
    def new_server(self) -> LookupServer:
        server = self.server_class(self.server_config)
        for d in (server.jobs.dispatch, server.transfers.dispatch, server.l2.dispatch, server.instances.dispatch):
            d.trace = []
        return server

    def new_client(self) -> LookupClient:
        client = self.client_class(self.client_config)
        for d in self._client_dispatchers(client):
            d.trace = []
        return client

    @staticmethod
    def _client_dispatchers(client: LookupClient) -> list[Dispatcher[Any]]:
        return [d for d in vars(client).values() if isinstance(d, Dispatcher)]

    def initial(self) -> XState:
        w = self.world
        return XState(0.0, [self.new_server() for _ in range(w.servers)], [self.new_client() for _ in range(w.engines)],
                      [], [[0] * w.requests for _ in range(w.engines)], [0] * w.servers,
                      [set() for _ in range(w.servers)], w.faults, w.restarts)

    # ------------------------------------------------------------------ actions
    def actions(self, st: XState) -> Iterator[tuple[str, Any]]:
        seen: set[Any] = set()
        for i, f in enumerate(st.frames):
            if f in seen:
                continue  # identical frames of the bag: one action
            seen.add(f)
            yield ("deliver", i)
            if st.faults > 0:
                yield ("drop", i)
                yield ("dup", i)
        machines: list[Any] = [*st.servers, *st.clients]
        deadlines = [d for m in machines if (d := m.next_deadline()) is not None]
        # The network is fast beside every timeout: the clock moves only once nothing is in
        # flight, unless the fault budget pays for a slow frame (a deadline passing under it).
        if deadlines and (not st.frames or st.faults > 0):
            yield ("tick", min(deadlines))
        for e, script in enumerate(st.scripts):
            for r, step in enumerate(script):
                if step >= len(SCRIPT):
                    continue
                if SCRIPT[step] == "check" and st.clients[e].check(rid(e, r)) is None:
                    continue
                yield ("step", (e, r))
        if st.restarts > 0:
            for s in range(len(st.servers)):
                yield ("restart", s)

    def describe(self, st: XState, action: tuple[str, Any]) -> str:
        kind, arg = action
        if kind in ("deliver", "drop", "dup"):
            f = st.frames[arg]
            who = f"sched{f.engine} -> server{f.server}" if f.kind == "req" else f"server{f.server} -> sched{f.engine}"
            return f"{kind} {who} #{f.corr} {short(f.body)}"
        if kind == "tick":
            return f"clock -> {arg:.3f}" + (f" ({len(st.frames)} frame(s) still in flight: slow)" if st.frames else "")
        if kind == "step":
            e, r = arg
            return f"sched{e} {SCRIPT[st.scripts[e][r]]} {rid(e, r)}"
        return f"restart server{arg}"

    def apply(self, st: XState, action: tuple[str, Any]) -> Violation | None:
        """Run ``action`` on ``st`` in place; the first oracle violation it causes, or None."""
        kind, arg = action
        if kind == "drop":
            st.frames.pop(arg)
            st.faults -= 1
            st.clean = False
            return None
        if kind == "dup":
            st.frames.append(st.frames[arg])
            st.faults -= 1
            st.clean = False
            return None
        if kind == "deliver":
            f = st.frames.pop(arg)
            return self._deliver(st, f)
        if kind == "tick":
            if st.frames:
                st.faults -= 1
                st.clean = False
            st.now = max(st.now, arg)
            for s in range(len(st.servers)):
                d = st.servers[s].next_deadline()
                if d is not None and d <= st.now:
                    v = self._server_event(st, s, TimerFired(), None)
                    if v:
                        return v
            for e, client in enumerate(st.clients):
                d = client.next_deadline()
                if d is not None and d <= st.now:
                    v = self._client_event(st, e, TimerFired())
                    if v:
                        return v
            return None
        if kind == "step":
            e, r = arg
            step = SCRIPT[st.scripts[e][r]]
            st.scripts[e][r] += 1
            if step == "submit":
                return self._client_event(st, e, SubmitLookup(rid(e, r), tuple(range(2 * CHUNK))))
            if step == "check":
                return None  # check() answered (actions() only offers it then)
            return self._client_event(st, e, Cleanup(rid(e, r)) if step == "cleanup" else EndRequest(rid(e, r)))
        # restart
        s = arg
        st.servers[s] = self.new_server()
        st.incarnation[s] += 1
        st.awaiting[s] = set()
        st.frames = [f for f in st.frames if not (f.server == s and f.incarnation != st.incarnation[s])]
        st.restarts -= 1
        st.clean = False
        for e in range(len(st.clients)):
            v = self._client_event(st, e, ServerEpoch(s, st.incarnation[s]))
            if v:
                return v
        return None

    def _deliver(self, st: XState, f: Frame) -> Violation | None:
        if f.kind == "req":
            if f.incarnation != st.incarnation[f.server]:
                return None  # the connection to that incarnation is gone
            event = attrs.evolve(f.body, reply_to=(f.engine, f.corr, f.incarnation), peer=f"sched{f.engine}")
            return self._server_event(st, f.server, event, event.reply_to)
        body = f.body
        if isinstance(body, ErrorReply):
            return self._client_event(st, f.engine, RequestFailed(f.server, f.corr, body.error))
        return self._client_event(st, f.engine, ReplyReceived(f.server, f.corr, body.result))

    def _server_event(self, st: XState, s: int, event: Any, via: Any) -> Violation | None:
        server = st.servers[s]
        before = (server._counters["table_violations"], server._counters["internal_errors"])
        effects = server.handle(event, st.now)
        effects += server.run_deferred()
        self.reached.add((SERVER_TABLES_NAME, ServerState.SERVING.name, type(event).__name__))
        awaiting = st.awaiting[s]
        if via is not None:
            awaiting.add(via)
        for eff in effects:
            if type(eff) is Reply or type(eff) is ErrorReply:
                if eff.reply_to not in awaiting:
                    return Violation("F11", st.now, f"server{s}", f"second reply to one request: {short(eff)}")
                awaiting.discard(eff.reply_to)
                reply_to: tuple[int, int, int] = eff.reply_to  # type: ignore[assignment]
                engine, corr, inc = reply_to
                st.frames.append(frame("rep", engine, s, corr, inc, eff))
        if via is not None and via in awaiting and type(event).__name__ not in self.deferred:
            return Violation("F11", st.now, f"server{s}", f"{short(event)} handled without a reply")
        try:
            server.check_invariants()
        except AssertionError as exc:
            return Violation("SAFETY", st.now, f"server{s}", f"core_sm invariant: {exc}")
        after = (server._counters["table_violations"], server._counters["internal_errors"])
        if after != before:
            return Violation("SAFETY", st.now, f"server{s}", f"table violation or internal error on {short(event)}")
        return None

    def _client_event(self, st: XState, e: int, event: Any) -> Violation | None:
        client = st.clients[e]
        counters = client._counters
        before = (counters["internal_errors"], counters.get("table_violations", 0), counters["timeouts"])
        effects = client.handle(event, st.now)
        for eff in effects:
            if isinstance(eff, SendRequest):
                s = eff.server
                st.frames.append(frame("req", e, s, eff.correlation, st.incarnation[s], eff.request))
        try:
            client.check_invariants()
        except AssertionError as exc:
            return Violation("SAFETY", st.now, f"sched{e}", f"core_sm invariant: {exc}")
        after = (counters["internal_errors"], counters.get("table_violations", 0), counters["timeouts"])
        if after[:2] != before[:2]:
            return Violation("SAFETY", st.now, f"sched{e}", f"table violation or internal error on {short(event)}")
        if after[2] != before[2] and st.clean:
            return Violation("LIVENESS", st.now, f"sched{e}", "a lookup resolved by the client's timeout with no "
                             "fault or restart on the path: no server answer reached it in time")
        return None

    def _drain_traces(self, st: XState) -> None:
        for server in st.servers:
            for d in (server.jobs.dispatch, server.transfers.dispatch, server.l2.dispatch, server.instances.dispatch):
                self._drain(d)
        for client in st.clients:
            for d in self._client_dispatchers(client):
                self._drain(d)

    def _drain(self, d: Dispatcher[Any]) -> None:
        if d.trace:
            name = d.table.name
            for state, ev, _after in d.trace:
                self.reached.add((name, state.name, ev.__name__))
            d.trace.clear()

    def _shared(self, st: XState) -> dict[int, Any]:
        """What every copy of a state shares instead of copying: the tables (module constants),
        the machines' configurations (frozen) and the config-free parts a state never changes."""
        if self._shared_memo is None:
            memo: dict[int, Any] = {}
            for table in (*SERVER_TABLES.values(), *CLIENT_TABLES.values()):
                memo[id(table)] = table
            for m in machines_of(st):
                config: Any = m.config
                memo[id(config)] = config
            memo[id(self.server_config)] = self.server_config
            self._shared_memo = memo
        return self._shared_memo

    # ------------------------------------------------------------------ fingerprints
    def fingerprint(self, st: XState) -> bytes:
        order = list(range(len(st.clients)))
        if self.world.symmetry and len(order) > 1:
            # Sort-based canonical form: each engine's signature names only itself as "E".
            sigs = [repr(self._canon(st, {f"sched{e}": "E", **{rid(e, r): f"R{r}" for r in range(self.world.requests)}},
                                     only=e)) for e in order]
            order.sort(key=lambda e: sigs[e])
        ren: dict[Any, Any] = {}
        for new, old in enumerate(order):
            ren[f"sched{old}"] = f"sched{new}"
            for r in range(self.world.requests):
                ren[rid(old, r)] = rid(new, r)
        canon = self._canon(st, ren, perm={old: new for new, old in enumerate(order)})
        return hashlib.blake2b(repr(canon).encode(), digest_size=16).digest()

    def _canon(self, st: XState, ren: dict[Any, Any], only: int | None = None,
               perm: dict[int, int] | None = None) -> Any:
        p = perm or {}
        if only is not None:
            frames = sorted(repr(snapshot((f.kind, f.server, f.corr, f.incarnation, f.key), ren))
                            for f in st.frames if f.engine == only)
            return (snapshot(st.clients[only], ren), tuple(st.scripts[only]), tuple(frames),
                    tuple(snapshot(s.jobs, ren) for s in st.servers))
        clients: list[Any] = [None] * len(st.clients)
        for e, c in enumerate(st.clients):
            clients[p.get(e, e)] = (snapshot(c, ren), tuple(st.scripts[e]))
        frames = sorted(repr(snapshot((f.kind, p.get(f.engine, f.engine), f.server, f.corr, f.incarnation, f.key), ren))
                        for f in st.frames)
        return (st.now, tuple(clients), tuple(snapshot(s, ren) for s in st.servers), tuple(frames),
                tuple(st.incarnation), tuple(sorted(repr(snapshot(a, ren)) for a in st.awaiting)), st.faults,
                st.restarts, st.clean)

    # ------------------------------------------------------------------ search
    def run(self, dfs: bool = False, progress: Callable[[str], None] | None = None) -> Explorer:
        t0 = time.perf_counter()
        tracemalloc.start()
        mem0 = tracemalloc.get_traced_memory()[0]
        root = self.initial()
        seen: set[bytes] = {self.fingerprint(root)}
        # each entry: (state, depth, path of action descriptions)
        frontier: deque[tuple[XState, int, tuple[str, ...]]] = deque([(root, 0, ())])
        pop = frontier.pop if dfs else frontier.popleft
        truncated = False
        while frontier:
            st, depth, path = pop()
            self.depth = max(self.depth, depth)
            acts = list(self.actions(st))
            if not acts and any(step < len(SCRIPT) for script in st.scripts for step in script):
                pending = [rid(e, r) for e, s in enumerate(st.scripts) for r, k in enumerate(s) if k < len(SCRIPT)]
                self.violation = (Violation("DEADLOCK", st.now, "world", f"no action enabled; unfinished: {pending}"),
                                  list(path))
                break
            if depth >= self.world.max_depth:
                truncated = truncated or bool(acts)
                continue
            for act in acts:
                nxt = copy.deepcopy(st, dict(self._shared(st)))
                text = self.describe(nxt, act)
                v = self.apply(nxt, act)
                self._drain_traces(nxt)
                self.transitions += 1
                if v is not None:
                    self.violation = (v, [*path, text])
                    break
                fp = self.fingerprint(nxt)
                if fp in seen:
                    continue
                seen.add(fp)
                if len(seen) >= self.world.max_states:
                    truncated = True
                    frontier.clear()
                    break
                frontier.append((nxt, depth + 1, (*path, text)))
            if self.violation is not None:
                break
            if progress is not None and len(seen) % 5000 < len(acts):
                progress(f"  {len(seen)} states, frontier {len(frontier)}, depth {depth}")
        self.states = len(seen)
        mem = tracemalloc.get_traced_memory()[0] - mem0
        tracemalloc.stop()
        self.bytes_per_state = mem / max(1, self.states + len(frontier))
        self.complete = self.violation is None and not truncated
        self.seconds = time.perf_counter() - t0
        return self

    # ------------------------------------------------------------------ coverage
    def all_rows(self) -> list[tuple[str, str, str]]:
        rows: list[tuple[str, str, str]] = []
        for tables in (SERVER_TABLES, CLIENT_TABLES):
            for table in tables.values():
                for (state, ev) in table.rows:
                    rows.append((table.name, state.name, ev.__name__))
        return rows

    def unreached(self) -> list[tuple[str, str, str]]:
        return [r for r in self.all_rows() if r not in self.reached]


SERVER_TABLES_NAME = next(iter(SERVER_TABLES))  # the routing table's name


def machines_of(st: XState) -> list[Any]:
    return [*st.servers, *st.clients]


def rid(engine: int, request: int) -> str:
    return f"req{engine}.{request}"


def frame(kind: str, engine: int, server: int, corr: int, inc: int, body: Any) -> Frame:
    return Frame(kind, engine, server, corr, inc, body, (repr(snapshot(body, {})),))


def short(obj: Any, limit: int = 90) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_SKIP = frozenset({"_counters", "counters", "trace", "config", "ctx_config", "dispatch", "_rows", "_routes",
                   "_timer_machine", "_lookups", "_servers"})
_ATOMS = (int, float, bool, type(None), bytes)


def snapshot(obj: Any, ren: dict[Any, Any], _memo: dict[int, int] | None = None) -> Any:
    """A canonical nested-tuple picture of ``obj``'s state: strings renamed by ``ren`` (symmetry),
    enums by value, callables, counters and configuration left out; a shared object is written
    once and referred to by its order of appearance after that (the machines share some)."""
    memo: dict[int, int] = {} if _memo is None else _memo
    t = type(obj)
    if t in _ATOMS:
        return obj
    if t is str:
        return ren.get(obj, obj)
    if isinstance(obj, enum.Enum):
        return obj._value_
    if t is ChunkChain:
        return obj.fingerprint
    if callable(obj) and not hasattr(obj, "__dict__") or isinstance(obj, (Dispatcher, type)) or t.__name__ in (
            "function", "method", "builtin_function_or_method"):
        return None
    if t is tuple or t is list:
        return tuple(snapshot(x, ren, memo) for x in obj)
    key = id(obj)
    if key in memo:
        return ("@", memo[key])
    memo[key] = len(memo)
    if isinstance(obj, dict):
        return ("d", tuple((snapshot(k, ren, memo), snapshot(v, ren, memo)) for k, v in obj.items()))
    if isinstance(obj, (set, frozenset)):
        return ("s", tuple(sorted((snapshot(x, ren, memo) for x in obj), key=repr)))
    if isinstance(obj, deque):
        return ("q", tuple(snapshot(x, ren, memo) for x in obj))
    if attrs.has(t):
        return (t.__name__, tuple(snapshot(getattr(obj, a.name), ren, memo) for a in attrs.fields(t)
                                  if a.name not in _SKIP))
    fields = getattr(obj, "__dict__", None)
    if fields is None:
        names = [n for c in t.__mro__ for n in getattr(c, "__slots__", ())]
        fields = {n: getattr(obj, n) for n in names if hasattr(obj, n)}
    return (t.__name__, tuple((k, snapshot(v, ren, memo)) for k, v in fields.items() if k not in _SKIP))


def report(ex: Explorer, out: Any = sys.stdout) -> None:
    w = ex.world
    rate = ex.states / ex.seconds if ex.seconds else 0.0
    print(f"world {w.name}: {w.engines} engine(s) x {w.servers} server(s) x {w.requests} request(s), "
          f"faults {w.faults}, restarts {w.restarts}, symmetry {'on' if w.symmetry else 'off'}", file=out)
    print(f"  {'complete' if ex.complete else 'NOT complete'}: {ex.states} states, {ex.transitions} transitions, "
          f"depth {ex.depth}, {ex.seconds:.1f} s, {rate:.0f} states/s, {ex.bytes_per_state:.0f} B/state", file=out)
    if ex.violation is not None:
        v, path = ex.violation
        print(f"  VIOLATION {v.reason()} (counterexample: {len(path)} actions)", file=out)
        for i, text in enumerate(path):
            print(f"    {i + 1:3d}  {text}", file=out)


def report_coverage(ex: Explorer, out: Any = sys.stdout) -> None:
    rows = ex.all_rows()
    missing = ex.unreached()
    print(f"  coverage: {len(rows) - len(missing)} of {len(rows)} table rows reached; never reached:", file=out)
    for table, state, ev in missing:
        print(f"    {table}: {state} x {ev}", file=out)
