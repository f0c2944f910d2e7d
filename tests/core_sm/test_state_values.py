"""``state_values()`` / ``restore(values)``: a machine's changing state as immutable values, and
a machine of the same configuration made that one in place (what the explorer keeps a state as).

For each machine that has the pair: every attribute is either state (carried) or wiring (left
out); a machine restored from another's values at any point of a random drive then behaves as
that one for the rest of the drive (the same effects, answers and values); and the comparison
catches a forgotten field (each state field set back to its fresh value is told apart).
"""
from __future__ import annotations

import random
from typing import Any

import attrs
import pytest

from mpcache.core_sm.effects import SendRequest
from mpcache.core_sm.errors import ErrorKind, ProtocolError
from mpcache.core_sm.health import Connected, HealthConfig, HealthMonitor
from mpcache.core_sm.lookup_client import LookupClient, LookupClientConfig, PendingLookup, ServerLeg
from mpcache.core_sm.messages import (
    Cleanup,
    EndRequest,
    ReplyReceived,
    RequestFailed,
    ServerEpoch,
    ServerHealth,
    SubmitLookup,
    TimerFired,
)
from mpcache.core_sm.server import LookupServer, ServerConfig
from mpcache.core_sm.server_link import Close, Reply, Role, SendFailed, ServerLink, ServerLinkConfig, Submit, Transmit

CHUNK = 16
CONFIGS = [LookupClientConfig(num_servers=2, world_size=2, chunk_size=CHUNK, poll_interval=0.01, result_ttl=0.5,
                              lookup_timeout=0.2),
           LookupClientConfig(num_servers=1, world_size=1, chunk_size=CHUNK, poll_interval=0.01, result_ttl=0.5,
                              lookup_timeout=0.2, answer_in_ack=True)]


class ClientDrive:
    """Random events for a lookup client, drawn from what it sent (replies to its correlations)
    and vLLM's calls on a few request ids; the same seed gives the same events."""

    def __init__(self, config: LookupClientConfig, seed: int) -> None:
        self.config = config
        self.rng = random.Random(seed)
        self.now = 0.0
        self.sent: list[tuple[int, int]] = []  # (server, correlation) of requests not answered yet
        self.epoch = 0

    def next(self) -> tuple[str, Any]:
        """("check", request id) or ("event", event), at ``self.now`` (moved forward at times)."""
        rng = self.rng
        self.now += rng.choice((0.0, 0.0, 0.004, 0.011, 0.06))
        rid = f"r{rng.randrange(3)}"
        roll = rng.random()
        if self.sent and roll < 0.45:
            server, corr = self.sent.pop(rng.randrange(len(self.sent)))
            if rng.random() < 0.1:
                return "event", RequestFailed(server, corr, ProtocolError(ErrorKind.INTERNAL, "boom"))
            return "event", ReplyReceived(server, corr, rng.choice((None, 0, CHUNK, 2 * CHUNK)))
        if roll < 0.6:
            return "event", SubmitLookup(rid, tuple(range(rng.choice((2, 3)) * CHUNK)))
        if roll < 0.7:
            return "check", rid
        if roll < 0.76:
            return "event", Cleanup(rid)
        if roll < 0.8:
            return "event", EndRequest(rid)
        if roll < 0.84:
            return "event", ServerHealth(rng.randrange(self.config.num_servers), rng.random() < 0.7)
        if roll < 0.87:
            self.epoch += rng.randrange(2)
            return "event", ServerEpoch(rng.randrange(self.config.num_servers), self.epoch)
        return "event", TimerFired()

    def feed(self, client: LookupClient, step: tuple[str, Any], now: float) -> list[Any]:
        kind, arg = step
        if kind == "check":
            return [("check", client.check(arg))]
        effects = client.handle(arg, now)
        return effects


def _drive(config: LookupClientConfig, seed: int, split: int, total: int,
           forget: str | None = None) -> tuple[LookupClient, LookupClient, list[Any], list[Any]]:
    """Drive a client ``total`` steps; after ``split`` of them a fresh client is restored from
    its values (with ``forget``: that state field then set back to the fresh client's) and both
    take the rest. Returns both and what each answered after the split."""
    drive = ClientDrive(config, seed)
    a = LookupClient(config)
    for _ in range(split):
        step = drive.next()
        for eff in drive.feed(a, step, drive.now):
            if isinstance(eff, SendRequest):
                drive.sent.append((eff.server, eff.correlation))
    b = LookupClient(config)
    fresh = getattr(b, forget) if forget is not None else None
    b.restore(a.state_values())
    if forget is not None:
        if forget == "_counters":
            b._counters.update(dict.fromkeys(b._counters, 0))
        elif forget == "_timers":
            b._timers.restore(LookupClient(config)._timers.state_values())
        else:
            setattr(b, forget, fresh)
    out_a: list[Any] = []
    out_b: list[Any] = []
    for _ in range(total - split):
        step = drive.next()
        ea = drive.feed(a, step, drive.now)
        eb = drive.feed(b, step, drive.now)
        out_a.append(ea)
        out_b.append(eb)
        for eff in ea:
            if isinstance(eff, SendRequest):
                drive.sent.append((eff.server, eff.correlation))
    return a, b, out_a, out_b


def _same(a: LookupClient, b: LookupClient, out_a: list[Any], out_b: list[Any]) -> bool:
    return out_a == out_b and a.state_values() == b.state_values() and a.stats() == b.stats()


def test_every_attribute_is_state_or_wiring() -> None:
    client = LookupClient(CONFIGS[0])
    fields = set(LookupClient.STATE_FIELDS)
    assert not fields & set(LookupClient.WIRING_FIELDS)
    assert set(vars(client)) == fields | set(LookupClient.WIRING_FIELDS)


def test_records_are_carried_whole() -> None:
    """The lookup records' fields, in order, as state_values writes them: a field added to one
    must be added there too."""
    assert [f.name for f in attrs.fields(ServerLeg)] == [
        "server", "lookup_correlation", "acked", "query_correlation", "query_sent_at", "next_query_at", "chunks"]
    assert [f.name for f in attrs.fields(PendingLookup)] == [
        "request_id", "key", "legs", "deadline", "result_tokens", "expires_at", "serial", "state"]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("seed", range(12))
def test_restored_client_behaves_as_the_original(config: LookupClientConfig, seed: int) -> None:
    rng = random.Random(seed)
    split = rng.randrange(5, 60)
    a, b, out_a, out_b = _drive(config, seed, split, split + 80)
    assert out_a == out_b
    assert a.state_values() == b.state_values()
    assert a.stats() == b.stats()
    a.check_invariants()
    b.check_invariants()


def test_values_are_immutable_and_restore_round_trips() -> None:
    a, _b, _oa, _ob = _drive(CONFIGS[0], 3, 40, 40)
    values = a.state_values()
    hash(values)  # immutable all the way down
    b = LookupClient(CONFIGS[0])
    b.restore(values)
    assert b.state_values() == values
    # the restored machine owns its records: changing it leaves the values and the original alone
    b.handle(TimerFired(), 100.0)
    assert a.state_values() == values


@pytest.mark.parametrize("field", [f for f in LookupClient.STATE_FIELDS if f != "_legs_lost"])
def test_a_forgotten_field_is_told_apart(field: str) -> None:
    """Restore every field but ``field`` (left as a fresh client has it): some drive tells the
    two apart. (``_legs_lost`` is empty between events: there is nothing to forget.)"""
    for config in CONFIGS:
        for seed in range(30):
            for more in (1, 10, 80):
                if not _same(*_drive(config, seed, 40, 40 + more, forget=field)):
                    return
    raise AssertionError(f"forgetting {field} was never noticed")


# ---------------------------------------------------------------------------------- ServerLink

LINK_CONFIGS = [ServerLinkConfig(HealthConfig(1, 0.05, 0.15, backoff_max=0.2, probe_interval=0.02, fail_pending=True,
                                              initially_healthy=True), request_timeout=0.08),
                ServerLinkConfig(HealthConfig(1, 0.05, 0.15, backoff_max=0.2, probe_interval=0.02), request_timeout=0.08)]


class LinkDrive:
    """Random events for a server link: callers' requests (plain, an instance's, its
    registration and unregistration), answers to the frames it transmitted (ok, refused
    not_registered or otherwise), failed sends, reconnections, the clock; the same seed gives
    the same events."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = 0.0
        self.sent: list[int] = []  # uids transmitted and not answered yet
        self.tokens = 0

    def next(self) -> Any:
        rng = self.rng
        self.now += rng.choice((0.0, 0.0, 0.01, 0.03, 0.07))
        roll = rng.random()
        if self.sent and roll < 0.45:
            uid = self.sent.pop(rng.randrange(len(self.sent)))
            if rng.random() < 0.15:
                return SendFailed(uid)
            if rng.random() < 0.2:
                kind = rng.choice(("not_registered", "internal"))
                return Reply(uid, False, ProtocolError(ErrorKind(kind), "refused"), kind)
            return Reply(uid, True, rng.choice((None, 1, {"epoch": rng.randrange(2)})))
        if roll < 0.7:
            self.tokens += 1
            role = rng.choice((Role.REQUEST, Role.REQUEST, Role.REGISTRATION, Role.UNREGISTRATION))
            instance = rng.choice((None, 1, 2)) if role is Role.REQUEST else rng.choice((1, 2))
            return Submit(self.tokens, ("req", self.tokens), rng.choice((None, 0.05)), role, instance)
        if roll < 0.75:
            return Connected(0)
        if roll < 0.77:
            return Close()
        return TimerFired()


def _link_drive(config: ServerLinkConfig, seed: int, split: int, total: int,
                forget: str | None = None) -> tuple[ServerLink, ServerLink, list[Any], list[Any]]:
    """As ``_drive``, for a link (``forget``: a link's field, or ``monitor.<field>``)."""
    drive = LinkDrive(seed)
    a = ServerLink(config, 0.0)

    def note(effects: list[Any]) -> None:
        drive.sent.extend(e.uid for e in effects if isinstance(e, Transmit))

    for _ in range(split):
        note(a.handle(drive.next(), drive.now))
    b = ServerLink(config, 0.0)
    b.restore(a.state_values())
    if forget is not None:
        fresh = ServerLink(config, 0.0)
        owner, fresh_owner, name = b, fresh, forget
        if forget.startswith("monitor."):
            owner, fresh_owner, name = b.monitor, fresh.monitor, forget[len("monitor."):]
        if name == "_counters":
            owner._counters.update(dict.fromkeys(owner._counters, 0))
        elif name == "_deadlines":
            b._deadlines.restore(fresh._deadlines.state_values())
        elif name == "monitor":
            b.monitor.restore(fresh.monitor.state_values())
        else:
            setattr(owner, name, getattr(fresh_owner, name))
    out_a: list[Any] = []
    out_b: list[Any] = []
    for _ in range(total - split):
        event = drive.next()
        ea = a.handle(event, drive.now)
        out_a.append(ea)
        out_b.append(b.handle(event, drive.now))
        note(ea)
    return a, b, out_a, out_b


def _same_link(a: ServerLink, b: ServerLink, out_a: list[Any], out_b: list[Any]) -> bool:
    return (out_a == out_b and a.state_values() == b.state_values() and a.stats() == b.stats()
            and a.monitor.stats() == b.monitor.stats())


def test_every_link_attribute_is_state_or_wiring() -> None:
    a, _b, _oa, _ob = _link_drive(LINK_CONFIGS[0], 1, 60, 60)
    for machine in (a, a.monitor, ServerLink(LINK_CONFIGS[1], 0.0)):
        cls = type(machine)
        assert not set(cls.STATE_FIELDS) & set(cls.WIRING_FIELDS)
        assert set(vars(machine)) == set(cls.STATE_FIELDS) | set(cls.WIRING_FIELDS)


def test_link_records_are_carried_whole() -> None:
    from mpcache.core_sm.health import _Server
    from mpcache.core_sm.server_link import _Pending
    assert [f.name for f in attrs.fields(_Pending)] == [
        "token", "request", "deadline", "role", "instance", "retried", "refusal"]
    assert [f.name for f in attrs.fields(_Server)] == [
        "healthy", "last_reply", "next_ping", "period", "epoch", "instances", "registering", "known", "retry_at",
        "retry_delay", "waiting"]


@pytest.mark.parametrize("config", LINK_CONFIGS)
@pytest.mark.parametrize("seed", range(12))
def test_restored_link_behaves_as_the_original(config: ServerLinkConfig, seed: int) -> None:
    split = random.Random(seed).randrange(5, 60)
    a, b, out_a, out_b = _link_drive(config, seed, split, split + 80)
    assert out_a == out_b
    assert a.state_values() == b.state_values()
    assert a.stats() == b.stats() and a.monitor.stats() == b.monitor.stats()
    assert sum(len(x) for x in out_a) > 0  # the drive made the link do something


def test_link_values_are_immutable() -> None:
    a, _b, _oa, _ob = _link_drive(LINK_CONFIGS[0], 5, 50, 50)
    values = a.state_values()
    hash(values)
    b = ServerLink(LINK_CONFIGS[0], 0.0)
    b.restore(values)
    assert b.state_values() == values
    b.handle(TimerFired(), 100.0)
    assert a.state_values() == values


@pytest.mark.parametrize("field", [f for f in ServerLink.STATE_FIELDS if f != "monitor"]
                         + [f"monitor.{f}" for f in HealthMonitor.STATE_FIELDS] + ["monitor"])
def test_a_forgotten_link_field_is_told_apart(field: str) -> None:
    for config in LINK_CONFIGS:
        for seed in range(30):
            for more in (1, 10, 80):  # a field the drive overwrites (the last heartbeat) shows early
                if not _same_link(*_link_drive(config, seed, 40, 40 + more, forget=field)):
                    return
    raise AssertionError(f"forgetting {field} was never noticed")


# ---------------------------------------------------------------------------------- LookupServer

SERVER_SEEDS = (0, 8, 21, 23)  # simulator seeds with lookups, stores, retrieves, L2 reads, commits
# State fields no history of these seeds moves from a fresh server's value, by part index
# (``LookupServer.state_parts``): kv_events and store admission off, no L2 probe, no recarve, no
# eviction or orphaned tenant, no heap big enough to compact, no sliced lookup or release, no
# store waiting for another's writes. The structural test above still holds them to STATE_FIELDS.
UNMOVED = {"1.admission", "1.held", "2._compact_at", "2.compactions", "3._quarantined", "3._releasing",
           "3._write_expirations", "3.dropped", "3.num_slots", "3.slot_bytes", "4._evictions",
           "4._evictions_for_others", "4._orphans_compact_at", "5._compact_at", "5.compactions", "6.reserved",
           "7.probes", "7.write_chunks", "8.accepted", "8.continuing", "8.working", "10._compact_at",
           "10.compactions", "11.beginning", "11.begins", "11.quarantined_plans", "11.reserving", "11.store_waits",
           "11.waits_on"}
# the reap queue's head: the entries before it are None placeholders, skipped as the head skips them
EQUIVALENT = {"10._head"}


@pytest.fixture(scope="module")
def server_histories() -> list[tuple[ServerConfig, list[tuple[str, Any, Any]]]]:
    """What the simulator's servers were fed in a few seeds, per server: its configuration and
    every call that changes it (``handle``, ``run_deferred``, the per-event invariant check)."""
    from mpcache.sim.runner import run_seed

    calls: dict[int, tuple[ServerConfig, list[tuple[str, Any, Any]]]] = {}
    original = {n: getattr(LookupServer, n) for n in ("handle", "run_deferred", "check_invariants_after_event")}

    def handle(self: LookupServer, event: Any, now: float) -> Any:
        calls.setdefault(id(self), (self.config, []))[1].append(("handle", event, now))
        return original["handle"](self, event, now)

    def run_deferred(self: LookupServer) -> Any:
        calls.setdefault(id(self), (self.config, []))[1].append(("run_deferred", None, None))
        return original["run_deferred"](self)

    def check_after(self: LookupServer, full_every: int = 32) -> Any:
        calls.setdefault(id(self), (self.config, []))[1].append(("check", full_every, None))
        return original["check_invariants_after_event"](self, full_every)

    keep = []
    try:
        LookupServer.handle = handle  # type: ignore[method-assign]
        LookupServer.run_deferred = run_deferred  # type: ignore[method-assign]
        LookupServer.check_invariants_after_event = check_after  # type: ignore[method-assign]
        for seed in SERVER_SEEDS:
            calls.clear()
            assert run_seed(seed).violation is None
            keep += [h for h in calls.values() if len(h[1]) >= 40]
    finally:
        for name, func in original.items():
            setattr(LookupServer, name, func)
    assert len(keep) >= 4
    return keep


def _feed(server: LookupServer, calls: list[tuple[str, Any, Any]]) -> list[Any]:
    out: list[Any] = []
    for kind, arg, now in calls:
        if kind == "handle":
            out.append(server.handle(arg, now))
        elif kind == "run_deferred":
            out.append(server.run_deferred())
        else:
            try:
                out.append(server.check_invariants_after_event(arg))
            except AssertionError as exc:  # a server restored wrong may break its invariants
                out.append(("broken", str(exc)))
    return out


def _picture(server: LookupServer) -> tuple[Any, ...]:
    """Everything the server shows: its canonical snapshot (the explorer's: every field but
    counters and wiring), its stats, its values."""
    from mpcache.sim.explore_state import snapshot

    return repr(snapshot(server, {})), server.stats(), server.state_values()


def _server_split(config: ServerConfig, calls: list[tuple[str, Any, Any]], split: int,
                  forget: tuple[int, str] | None = None, upto: int | None = None) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The original fed every call, and a server restored from its values after ``split`` of
    them (with ``forget``: that part's field then set back to a fresh server's) fed the rest:
    what each answered after the split, and its picture at the end."""
    import copy

    a = LookupServer(config)
    _feed(a, calls[:split])
    b = LookupServer(config)
    b.restore(a.state_values())
    if forget is not None:
        part, name = forget
        fresh = LookupServer(config).state_parts()[part]
        setattr(b.state_parts()[part], name, copy.deepcopy(getattr(fresh, name)))
    out_a = _feed(a, calls[split:upto])
    try:
        out_b = _feed(b, calls[split:upto])
        return (out_a, _picture(a)), (out_b, _picture(b))
    except Exception as exc:  # a field forgotten may leave the server inconsistent enough to raise
        return (out_a, _picture(a)), (repr(exc), None)


def test_the_recorded_calls_are_all_that_changes_a_server(server_histories: list[Any]) -> None:
    """Precondition of the tests below: replaying what a simulated server was fed gives the same
    server again (nothing else changed it)."""
    for config, calls in server_histories:
        a, b = LookupServer(config), LookupServer(config)
        assert _feed(a, calls) == _feed(b, calls)
        assert _picture(a) == _picture(b)


def test_every_server_attribute_is_state_or_wiring(server_histories: list[Any]) -> None:
    for config, calls in server_histories:
        server = LookupServer(config)
        _feed(server, calls)
        for part in server.state_parts():
            cls = type(part)
            assert not set(cls.STATE_FIELDS) & set(cls.WIRING_FIELDS), cls
            assert set(vars(part)) == set(cls.STATE_FIELDS) | set(cls.WIRING_FIELDS), cls


def test_restored_server_behaves_as_the_original(server_histories: list[Any]) -> None:
    rng = random.Random(7)
    for config, calls in server_histories:
        for split in sorted({0, len(calls) // 2, len(calls) - 1, *(rng.randrange(len(calls)) for _ in range(4))}):
            original, restored = _server_split(config, calls, split)
            assert original == restored, split


def test_server_values_are_immutable(server_histories: list[Any]) -> None:
    config, calls = server_histories[0]
    a = LookupServer(config)
    _feed(a, calls[: len(calls) // 2])
    values = a.state_values()
    hash(values)  # nothing mutable inside
    b = LookupServer(config)
    b.restore(values)
    _feed(b, calls[len(calls) // 2:])
    assert a.state_values() == values  # the restored server shares nothing with the original


def _state_fields() -> list[tuple[int, str]]:
    parts = LookupServer(ServerConfig(num_slots=4, slot_bytes=1024)).state_parts()
    return [(i, name) for i, p in enumerate(parts) for name in type(p).STATE_FIELDS]


@pytest.mark.parametrize("forget", _state_fields(), ids=lambda f: f"{f[0]}.{f[1]}")
def test_a_forgotten_server_field_is_told_apart(forget: tuple[int, str], server_histories: list[Any]) -> None:
    """A state field left as a fresh server has it, at a point where the original's differs: the
    rest of the history tells the two apart. A field no recorded history ever moves from its
    fresh value cannot be told apart by them (kv_events and store admission are off in these
    seeds, no tenant quota): named in UNMOVED, and held to it."""
    from mpcache.core_sm.values import encode

    part, name = forget
    if f"{part}.{name}" in EQUIVALENT:
        pytest.skip("forgetting it changes nothing the server does or shows")
    moved = False
    for config, calls in server_histories:
        fresh = encode(getattr(LookupServer(config).state_parts()[part], name), {})
        a = LookupServer(config)
        step = max(1, len(calls) // 12)
        for split in range(0, len(calls), step):
            _feed(a, calls[split - step:split] if split else [])
            if encode(getattr(a.state_parts()[part], name), {}) == fresh:
                continue
            moved = True
            for upto in (split + 1, split + 10, len(calls)):  # a field the history overwrites shows early
                original, restored = _server_split(config, calls, split, forget, upto)
                if original != restored:
                    return
    if not moved:
        assert f"{part}.{name}" in UNMOVED
        return
    raise AssertionError(f"forgetting part {part}'s {name} was never noticed")
