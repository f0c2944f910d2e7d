"""The explorer over the production machines: the ``ci`` worlds are explored completely with no
violation; every legacy profile it models is caught with its own F-code, and the tape it saves
replays to the same violation; the CLI prints the counts and the rows never reached."""
import functools
from typing import Any
import json
from pathlib import Path

import attrs
import pytest

from mpcache.sim import checks, world
from mpcache.sim.cli import main
from mpcache.sim.explore import PROFILE_WORLDS, WORLDS, Explorer, XWorld, replay_tape
from mpcache.sim.profiles import PROFILES


@functools.cache
def explored(w: XWorld) -> Explorer:
    """One exploration per world for the whole module (the ci worlds are read by several tests)."""
    return Explorer(w).run()


def test_tiny_world_explored_completely() -> None:
    ex = Explorer(XWorld("tiny", engines=1, servers=1, requests=1)).run()
    assert ex.violation is None
    assert ex.complete
    assert ex.states > 5 and ex.depth > 5
    rows = set(ex.all_rows())
    assert ex.reached and ex.reached <= rows
    assert len(ex.unreached()) == len(rows) - len(ex.reached)


@pytest.mark.parametrize("w", WORLDS["ci"], ids=lambda w: w.name)
def test_ci_world_explored_completely(w: XWorld) -> None:
    ex = explored(w)
    assert ex.violation is None, ex.violation
    assert ex.complete  # the whole space, not a cut at max_states or max_depth
    assert ex.states < w.max_states
    assert ex.reached <= set(ex.all_rows())
    if w.heartbeat_interval < w.horizon:  # the links' monitors run: their rows are reached
        health = {(state, ev) for table, state, ev in ex.reached if table.startswith("HealthMonitor")}
        assert {("HEALTHY", "HeartbeatDue"), ("HEALTHY", "HeartbeatReply")} <= health, health


def test_faults_reach_more_rows() -> None:
    """The fault budget is not vacuous: drops, duplicates and slow frames take the machines
    through rows a fault-free world never reaches."""
    calm = Explorer(XWorld("calm")).run()
    faulty = Explorer(XWorld("faulty", faults=1)).run()
    assert calm.complete and faulty.complete
    assert faulty.states > 10 * calm.states
    assert len(faulty.reached - calm.reached) >= 5


def test_modelled_profiles() -> None:
    """The profiles the explorer catches (each in its own world): the transport's (wait-lost, by
    the ServerLink actor), the adversary's (trust-all) and the worker's registration
    (missed-epoch, idle-reap: the TransferClient actor) beside the lookup protocol's."""
    assert set(PROFILE_WORLDS) == {"unknown-none", "resend-status", "overwrite-dup", "no-ack-wait", "leak-on-abort",
                                   "release-all", "silent-errors", "no-reaper", "wait-lost", "trust-all", "missed-epoch",
                                   "idle-reap", "planner-tail-leak", "preempt-reuse", "lease-expiry-under-queue",
                                   "placement-mismatch", "no-reregister", "double-register", "hma-partial-group",
                                   "act-first"}
    assert set(PROFILE_WORLDS) == set(PROFILES) - {"default"}  # every legacy profile


@pytest.mark.parametrize("name", sorted(PROFILE_WORLDS))
def test_profile_caught_with_its_code_and_tape_replays(name: str) -> None:
    profile = PROFILES[name]
    ex = Explorer(PROFILE_WORLDS[name], profile).run()
    assert ex.violation is not None, f"{name} not caught in {ex.states} states"
    v, path = ex.violation
    assert v.code == profile.failure, v.reason()
    tape = json.loads(json.dumps(ex.tape()))  # what a file holds
    replayed, lines = replay_tape(tape, profile)
    assert replayed is not None and replayed.code == v.code and replayed.message == v.message
    assert len(path) == len(tape["actions"]) and lines[-1].endswith(v.reason())


def test_default_profile_clean_in_the_profile_worlds() -> None:
    """The worlds that catch the legacy profiles hold no violation for the production machines."""
    for name in ("leak-on-abort", "resend-status", "no-ack-wait", "wait-lost", "trust-all", "missed-epoch",
                 "idle-reap", "planner-tail-leak", "preempt-reuse", "lease-expiry-under-queue", "placement-mismatch",
                 "no-reregister", "hma-partial-group", "act-first"):
        ex = Explorer(PROFILE_WORLDS[name]).run()
        assert ex.violation is None and ex.complete, (name, ex.violation)


def test_oracles_shared_with_the_simulator() -> None:
    """One judgement: the random world raises what sim/checks/ finds (not a copy of it): its
    per-event server oracle calls the judgements the explorer imports."""
    from mpcache.sim.checks import server_event

    assert world.checks is checks
    assert server_event.reply_accounting is checks.reply_accounting
    assert "reply_accounting(" in Path(server_event.__file__).read_text()


def test_cli_explore_and_replay_tape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explore", "--world", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "complete: " in out and "states/s" in out and "B/state" in out and "never reached:" in out
    tape = tmp_path / "t.json"
    assert main(["explore", "--profile", "overwrite-dup", "--tape", str(tape)]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION F4" in out and "server0     server: Lookup" in out
    assert "in sim.World (" in out and "VIOLATION F4" in out.split("in sim.World (")[1]
    assert main(["replay", "--tape", str(tape)]) == 1  # in sim.World, the default
    out = capsys.readouterr().out
    assert "in sim.World" in out and "VIOLATION F4" in out and "the explorer's" in out
    assert "tape dup #" in out and "server0     server: Lookup" in out  # the world's timeline
    assert main(["replay", "--tape", str(tape), "--in-explorer"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION F4" in out and "the recorded one" in out


def test_engine_crash_leaves_work_the_reaper_must_take() -> None:
    """A crashed engine's job and leases stay on the server; the production reaper takes them
    (complete, clean), the no-reaper profile is caught F12 after the crash."""
    w = XWorld("crash", crashes=1)
    ex = Explorer(w).run()
    assert ex.complete and ex.violation is None
    bad = Explorer(w, PROFILES["no-reaper"]).run()
    assert bad.violation is not None and bad.violation[0].code == "F12"
    assert ("crash", 0) in bad.violation[1]


def test_symmetry_merges_mirrored_engines() -> None:
    """Two engines with one request each: a state and its mirror (the engines swapped) are one
    state, so the space shrinks; and a stored state's lazily cleaned timer heaps do not split
    equal states (they did: symmetry on explored more states than off)."""
    on = explored(WORLDS["ci"][0])
    off = Explorer(attrs.evolve(WORLDS["ci"][0], symmetry=False)).run()
    assert on.complete and off.complete
    assert on.states < 0.8 * off.states
    assert on.reached == off.reached


def test_planner_world_drives_the_connector_planner() -> None:
    """A planner world's scheduler is the connector's StepPlanner: its table's rows are counted,
    the script reaches allocation, preemption, the match after it and the lease renewal, and the
    production planner recomputes after preemption (no second load)."""
    w = next(x for x in WORLDS["ci"] if x.planner)
    ex = explored(w)
    assert ex.complete and ex.violation is None
    planner = {(state, ev) for table, state, ev in ex.reached if table == "StepPlanner"}
    assert {("ABSENT", "MatchRequest"), ("MATCHED", "BlocksAllocated"), ("RUNNING", "RequestPreempted"),
            ("PREEMPTED", "MatchRequest"), ("PREEMPTED", "BlocksAllocated"), ("MATCHED", "LeaseRenewalDue")} <= planner
    assert any(table == "StepPlanner" for table, _s, _e in ex.all_rows())
    assert not any(table == "StepPlanner" for table, _s, _e in Explorer(XWorld("tiny")).all_rows())


def test_worker_retrieve_refused_then_resent() -> None:
    """A worker's retrieve refused not_registered (it overtook the registration): production's
    link parks it, registers again and resends it once, the server runs the copy and the worker's
    op ends; the legacy links leave it parked (no-reregister) or orphan it (double-register)."""
    w = PROFILE_WORLDS["no-reregister"]
    ex = Explorer(w).run()
    assert ex.complete and ex.violation is None
    reached = {(table.split(" (")[0], state, ev) for table, state, ev in ex.reached}
    # refused first (it overtook the registration), then resent, admitted and its copy begun
    assert {("LookupServer transfers", "ABSENT", "RefusedTransfer"),
            ("LookupServer transfers", "ABSENT", "AdmittedRetrieve"),
            ("LookupServer transfers", "ABSENT", "CopyBegins")} <= reached, reached
    assert any(table == "HealthMonitor" and ev == "RequestRefused" for table, _s, ev in reached)
    for name in ("no-reregister", "double-register"):
        bad = Explorer(w, PROFILES[name]).run()
        assert bad.violation is not None and bad.violation[0].code == "LIVENESS", name
        assert ("op", 0) in bad.violation[1]


@pytest.mark.slow
def test_planner_retrieve_runs_on_the_worker() -> None:
    """On demand (a few seconds): the planner's planned retrieve goes to the worker's
    TransferClient, whose op the server runs; the production machines pass."""
    ex = Explorer(WORLDS["planner"][0]).run()
    assert ex.complete and ex.violation is None
    assert any(table.startswith("TransferClient") and ev == "SubmitRetrieve" for table, _s, ev in ex.reached)


@pytest.mark.parametrize("name,code", [("hma-partial-group", "F24"), ("act-first", "F23")])
def test_runtime_profiles_caught_and_replayed_by_the_cli(name: str, code: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The two bugs outside core_sm's machines, in what the explorer's runtime does with their
    effects: a worker's retrieve that writes the first KV-cache group's blocks only (F24, the
    random simulator's partial_restore judging the blocks vLLM reads to resume), and a server
    runtime that registers with its transfer engine on receipt, before core_sm refuses another
    tenant's registration of the worker's instance (F23). Each tape replays with the CLI."""
    tape = tmp_path / "t.json"
    assert main(["explore", "--profile", name, "--tape", str(tape)]) == 1
    out = capsys.readouterr().out
    assert f"VIOLATION {code}" in out
    recorded = json.loads(tape.read_text())
    assert recorded["profile"] == name and recorded["violation"]["code"] == code
    assert main(["replay", "--tape", str(tape), "--in-explorer"]) == 1
    out = capsys.readouterr().out
    assert f"VIOLATION {code}" in out and "the recorded one" in out
    if name == "hma-partial-group":
        assert "group 1 (sliding_window 16)" in recorded["violation"]["message"]
    else:
        assert "sends server0 register naming instance 1" in out


def test_group_copies_shared_with_the_simulator() -> None:
    """The explorer's copy of several KV-cache groups and F24 are the random simulator's: one
    ``group_copies`` (sim/groups.py) for both workers, one ``partial_restore`` judgement."""
    from mpcache.sim import engine, explore, groups

    assert checks.partial_restore is groups.partial_restore
    assert explore.group_copies is groups.group_copies and engine.group_copies is groups.group_copies


def test_one_trip_world_answers_in_the_ack() -> None:
    """The connector's lookup_answer_in_ack, a world of its own in ``ci``: explored completely
    with no violation, and the hit really comes in the LOOKUP's ack -- the client never queries
    a status, where the same world without the option (ci-1e1s-faults) does."""
    one_trip = next(w for w in WORLDS["ci"] if w.answer_in_ack)
    assert one_trip in WORLDS["one-trip"]
    twin = next(w for w in WORLDS["ci"] if w.name == "ci-1e1s-faults")
    assert attrs.evolve(one_trip, name=twin.name, answer_in_ack=False) == twin
    assert not any(w.answer_in_ack for w in WORLDS["ci"] if w is not one_trip)  # the others keep the status path
    ex, base = explored(one_trip), explored(twin)
    assert ex.complete and ex.violation is None
    querying = {r for r in base.reached if r[0].startswith("LookupClient") and r[1] == "QUERYING"}
    assert querying, base.reached
    assert not querying & ex.reached
    assert ex.states < base.states


def test_copied_machine_assigns_its_own_state() -> None:
    """The explorer's dispatcher copier binds an assigning table's set_state (and guards) to the
    copied machine: a transition run on the copy changes the copy, never the original."""
    import copy

    import mpcache.sim.explore_state  # noqa: F401  # registers the dispatcher copier
    from mpcache.core_sm.health import HealthConfig, HealthMonitor, HealthState, HeartbeatReply

    original = HealthMonitor(HealthConfig(num_servers=1))
    clone = copy.deepcopy(original)
    assert clone.dispatch._set_state.__self__ is clone  # type: ignore[union-attr]
    clone.handle(HeartbeatReply(0, epoch=1), 0.5)
    assert clone.state(0) is HealthState.HEALTHY
    assert original.state(0) is HealthState.PROBING

    from mpcache.core_sm.messages import RegisterInstance
    from mpcache.core_sm.server import InstanceState, LookupServer, ServerConfig

    server = LookupServer(ServerConfig(chunk_size=4, num_slots=8, slot_bytes=64))
    server_clone = copy.deepcopy(server)
    assert server_clone.l2.dispatch._set_state.__self__ is server_clone.l2  # type: ignore[union-attr]
    assert server_clone.instances.dispatch._set_state.__self__ is server_clone.instances  # type: ignore[union-attr]
    guard = server_clone.instances.dispatch._guards[RegisterInstance]
    assert guard.__self__ is server_clone.instances  # type: ignore[attr-defined]
    server_clone.handle(RegisterInstance(1, "m", 1, 64, True, reply_to=("c", 1)), 0.0)
    assert server_clone.instance_state(1) is InstanceState.REGISTERED
    assert server.instance_state(1) is InstanceState.ABSENT
    from mpcache.core_sm.messages import Store

    assert server_clone.transfers.dispatch._set_state.__self__ is server_clone.transfers  # type: ignore[union-attr]
    assert server_clone._rows[Store].__self__ is server_clone.transfers  # type: ignore[attr-defined]

    from mpcache.core_sm.lookup_client import LookupClient, LookupClientConfig
    from mpcache.core_sm.planner import MatchRequest, PlannerConfig, RequestState, StepPlanner

    planner = StepPlanner(PlannerConfig(4, 4), LookupClient(LookupClientConfig(chunk_size=4)))
    planner_clone = copy.deepcopy(planner)
    assert planner_clone._dispatch._set_state.__self__ is planner_clone  # type: ignore[union-attr]
    planner_clone.handle(MatchRequest("r", list(range(8)), 8, 0), 0.0)
    assert planner_clone.state("r") is RequestState.LOOKING_UP and planner.state("r") is RequestState.ABSENT

    from mpcache.core_sm.messages import ServerHealth
    from mpcache.core_sm.transfer_client import LinkState, TransferClient

    worker = TransferClient()
    worker_clone = copy.deepcopy(worker)
    for name in ("_link", "_request_d", "_op_d"):
        assert getattr(worker_clone, name)._set_state.__self__ is worker_clone
    worker_clone.handle(ServerHealth(0, False), 0.0)
    assert worker_clone.link_state() is LinkState.DOWN and worker.link_state() is LinkState.UP


def test_clone_builds_what_deepcopy_builds() -> None:
    """The explorer's copier (``explore_state.clone``) makes of every machine of the first 100
    states of a world with a planner, a worker and two KV-cache groups what ``copy.deepcopy``
    makes: the same snapshot, the same fields, every dispatcher's handlers bound to the copy;
    and a copy written to leaves its original as it was."""
    import copy

    from mpcache.core_sm.chunks import ObjectKey
    from mpcache.core_sm.server import LookupServer
    from mpcache.core_sm.server_link import ServerLink
    from mpcache.sim.explore_state import Held, clone, dispatchers, snapshot

    ex = Explorer(attrs.evolve(PROFILE_WORLDS["hma-partial-group"], max_states=100))  # its first 100 states
    fingerprint = ex.fingerprint
    checked = []

    def fp(st: Any) -> bytes:
        for x in (*st.servers, *st.clients, *st.links, *st.workers):
            if any(x is c for c in checked[-12:]):
                continue  # a machine the state shares with its parent: checked there
            m = x
            if type(x) is Held:  # kept as values: the machine they make, as a profile's is copied
                m = ex.new_link() if issubclass(x.cls, ServerLink) else ex.new_server() if issubclass(
                    x.cls, LookupServer) else ex.new_client()
                m.restore(x.values)
            a, b = clone(m, dict(ex._static)), copy.deepcopy(m, dict(ex._static))
            assert repr(snapshot(a, {})) == repr(snapshot(b, {})) == repr(snapshot(m, {}))
            assert vars(a).keys() == vars(b).keys() == vars(m).keys()
            for da, dm in zip(dispatchers(a), dispatchers(m), strict=True):
                assert da is not dm and da._bound.keys() == dm._bound.keys()
                owner = getattr(next(iter(dm._bound.values()))[0], "__self__")
                for h, _n in da._bound.values():
                    assert type(h.__self__) is type(owner) and h.__self__ is not owner
            checked.append(x)
        return fingerprint(st)

    ex.fingerprint = fp  # type: ignore[method-assign]
    ex.run()
    assert ex.violation is None and len(checked) > 150
    server = ex.new_server()
    before = repr(snapshot(server, {}))
    copied = clone(server, dict(ex._static))
    copied.index.reserve_write(ObjectKey(b"\x01" * 16, 0), "other", 1024, 0.0)  # a write of its own
    assert repr(snapshot(server, {})) == before != repr(snapshot(copied, {}))


def test_copies_of_seen_states_are_freed() -> None:
    """The snapshot cache holds no machine: once a search ends and its states go, every copy
    made for it (those of states already seen included) is freed."""
    import gc

    ex = explored(WORLDS["ci"][0])
    assert ex.complete and ex.transitions > ex.states
    gc.collect()
    assert len(ex._snaps) <= 8  # what the explorer keeps itself (its fresh machines) at most


def test_a_snapshot_tells_named_tuples_apart_by_their_values() -> None:
    """Which peer or request owns a job or a lease is a named tuple (``RequestKey``,
    ``ObjectKey``): two states that differ only there are two states, not one."""
    from mpcache.core_sm.chunks import ObjectKey
    from mpcache.core_sm.server_core import RequestKey
    from mpcache.sim.explore_state import snapshot

    assert snapshot({RequestKey("sched0", "r"): 1}, {}) != snapshot({RequestKey("sched1", "r"): 1}, {})
    assert snapshot([ObjectKey(b"\x01" * 16, 0)], {}) != snapshot([ObjectKey(b"\x02" * 16, 0)], {})
    assert snapshot([ObjectKey(b"\x01" * 16, 0)], {}) == snapshot([ObjectKey(b"\x01" * 16, 0)], {})


def test_clone_shares_the_classes_a_machine_holds() -> None:
    """A class held by a machine (an enum's among them) is itself in a copy, as deepcopy keeps it:
    the legacy no-cache lookup client behind the planner holds one, and its world explored."""
    import enum

    from mpcache.sim.explore_state import clone

    class Colour(enum.Enum):
        RED = 1

    class Holder:
        pass

    h = Holder()
    h.kind, h.cls, h.member = Colour, Holder, Colour.RED  # type: ignore[attr-defined]
    c = clone(h, {})
    assert c is not h and c.kind is Colour and c.cls is Holder and c.member is Colour.RED  # type: ignore[attr-defined]
    ex = Explorer(attrs.evolve(PROFILE_WORLDS["unknown-none"], name="unknown-none-planner", planner=True, checks=1,
                               max_states=300), PROFILES["unknown-none"]).run()
    assert ex.states >= 300
