"""A counterexample the explorer finds runs in the ordinary simulated world: its tape's
``sim_world`` actions, replayed in a scripted ``sim.World`` (its engines -- vLLM's scheduler
model over the connector's planner --, links, workers and oracles), show the same failure code.
"""
from __future__ import annotations

import json
from typing import Any

import pytest

from mpcache.sim.explore import (
    PROFILE_WORLDS,
    WORLD_TAPE_WAIT,
    Explorer,
    TapePlayer,
    XWorld,
    replay_world_tape,
    run_tape_world,
)
from mpcache.sim.profiles import PROFILES
from mpcache.sim.world import TapeError, packet_text


def explored_tape(name: str) -> dict[str, Any]:
    ex = Explorer(PROFILE_WORLDS[name], PROFILES[name]).run()
    assert ex.violation is not None, f"{name} not caught"
    tape: dict[str, Any] = json.loads(json.dumps(ex.tape()))  # what a file holds
    return tape


def assert_same_in_world(tape: dict[str, Any]) -> None:
    """The tape's world actions show the explorer's violation code in sim.World."""
    violation, world = replay_world_tape(tape, PROFILES[tape["profile"]])
    assert violation is not None, f"{tape['profile']}: no violation in sim.World: {world.trace.lines[-3:]}"
    assert violation.code == tape["violation"]["code"], violation.reason()
    assert tape["sim_world"]["violation"]["code"] == violation.code  # what the tape recorded


@pytest.mark.parametrize("name", sorted(PROFILE_WORLDS))
def test_explored_counterexample_shows_in_sim_world(name: str) -> None:
    tape = explored_tape(name)
    assert tape["violation"]["code"] == PROFILES[name].failure
    assert_same_in_world(tape)


def test_a_tape_that_does_not_violate_in_the_world_fails() -> None:
    """Without its duplicate (the fault that shows overwrite-dup), the world's tape shows
    nothing, and the check says so; a tape that drifted from its world stops, no violation."""
    tape = explored_tape("overwrite-dup")
    assert_same_in_world(tape)
    actions = tape["sim_world"]["actions"]
    assert any(a[0] == "dup" for a in actions)
    tape["sim_world"]["actions"] = [a for a in actions if a[0] != "dup"]
    with pytest.raises(AssertionError, match="no violation in sim.World"):
        assert_same_in_world(tape)
    tape["sim_world"]["actions"] = [["deliver", 999, "sched0->server0 Lookup req0.0"]]
    with pytest.raises(AssertionError, match="not in flight"):
        assert_same_in_world(tape)


@pytest.mark.parametrize("name", ["no-ack-wait", "no-reregister", "trust-all", "lease-expiry-under-queue", "release-all",
                                  "unknown-none"])
def test_the_default_profile_passes_a_profiles_world_tape(name: str) -> None:
    """The same world actions under the production machines show nothing: the code comes from
    the legacy machines, not from the tape."""
    tape = explored_tape(name)
    tape["profile"] = "default"
    with pytest.raises(AssertionError, match="no violation in sim.World"):
        assert_same_in_world(tape)


class ByText(TapePlayer):
    """A tape written as it plays: a message named by part of its text (the clock ticks until it
    is in flight), the other actions as they are."""

    def next_action(self, world: Any) -> list[Any] | None:
        if not self.actions:
            return None
        kind, what = self.actions[0]
        if kind in ("deliver", "drop", "dup"):
            packet = next((p for p in world.net.bag or () if what in packet_text(p)), None)
            if packet is None:
                if world.now() > WORLD_TAPE_WAIT:
                    raise TapeError(f"no {what} in flight by {world.now():.3f}")
                return ["tick"]
            self.actions.popleft()
            return [kind, packet.pid, packet_text(packet)]
        self.actions.popleft()
        return [kind, what]


@pytest.mark.parametrize("fault,counter", [("restart", "restarts"), ("crash", "engine_crashes")])
def test_a_scripted_crash_runs_the_worlds_fault_and_production_passes(fault: str, counter: str) -> None:
    """A server restart or an engine crash with the LOOKUP answered and its status query in
    flight: the world's own fault (what was in flight to or from it lost), and the production
    machines pass the rest of the run (liveness, quiescence)."""
    xworld = XWorld("scripted")
    plan = [("deliver", "Lookup req0.0"), ("deliver", "server0->sched0"), (fault, 0)]
    violation, world = run_tape_world(xworld, ByText(xworld, plan), PROFILES["default"])  # type: ignore[arg-type]
    assert violation is None, violation.reason()
    assert world.stats[counter] == 1
    assert any("tape " + fault in line for line in world.trace.lines)
    assert any(" lost #" in line for line in world.trace.lines)  # the status query in flight
    assert not any(line.split()[2:3] == ["TAPE"] for line in world.trace.lines)


@pytest.mark.parametrize("name", ["unknown-none", "default"])
def test_a_held_request_shows_unknown_nones_poll_forever_through_its_lease_renewal(name: str) -> None:
    """Another path to unknown-none's F1 than the explorer's: the request waits for blocks (hold)
    past its lease renewal; the legacy client's status query after its answer, sent when the
    planner took the hit and left in flight, reaches the server after the renewal's LOOKUP and
    takes its answer; the renewal's own queries find the job popped, no tombstone: None forever.
    The production client asks nothing after its answer: the renewal answers, the request runs."""
    xworld = PROFILE_WORLDS["unknown-none"]
    plan: list[tuple[str, str]] = [("deliver", "Lookup req0.0"), ("deliver", "server0->sched0"),
                                   ("deliver", "QueryPrefetchStatus"), ("deliver", "reply:1"), ("hold", "req0.0"),
                                   ("deliver", "Lookup req0.0")]  # the second: the renewal's, 1 s later
    if name == "unknown-none":
        plan.append(("deliver", "QueryPrefetchStatus"))  # the query after the answer, overtaking
    plan.append(("unhold", "req0.0"))
    violation, world = run_tape_world(xworld, ByText(xworld, plan), PROFILES[name])  # type: ignore[arg-type]
    assert not any(line.split()[2:3] == ["TAPE"] for line in world.trace.lines)  # the whole plan ran
    assert any(" tape unhold req0.0" in line for line in world.trace.lines)
    if name == "default":
        assert violation is None, violation.reason()
        assert [(r.state, r.outcome) for r in world.engines[0].order] == [("done", "finished")]
        return
    assert violation is not None and violation.code == "F1", violation
    assert "lookup unresolved" in violation.message
