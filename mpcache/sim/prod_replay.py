"""Replay a production recording through the machines the simulator builds.

A recording (``MPCACHE_RECORD``, ``mpcache.runtime_zmq.recorder``) holds, for every client
machine a production process built -- the scheduler's ``StepPlanner`` (its ``LookupClient``
inside), each worker rank's ``TransferClient``, each connection's ``ServerLink`` (its
``HealthMonitor`` inside) -- the configs it was built with and every event the shell handed it,
with the time and the effects it returned. ``replay`` builds each machine as the simulator's
world builds it (``Profile.make_planner``, ``make_transfer_client``, ``make_link`` over
``sim.transport.sim_link_config``: the builders ``sim/engine.py`` and ``sim/transport.py`` run) from a ``WorldConfig`` whose
settings are the recorded run's (``world_of``), feeds it the recorded events in order at the
recorded times, and compares each returned effect list with the recorded one. The answer is the
first step that differs (``Mismatch``), or none.

Configs: the simulator's builder and production's must agree on every field except the few a
simulated world does not model, each named in ``DEPLOYMENT_FACTS`` with why; those are taken
from the recording. Any other difference is a mismatch at the machine's build (step -1) before
a single event is fed.

Not replayed: what the shells ask a machine outside ``handle`` (``TransferClient.finished()``,
``load_errors()``; the planner's ``tracker``) -- queries whose answers are not effects.

``mpcache-sim replay-recording FILE [--profile NAME]`` (or ``python -m mpcache.sim.prod_replay``)
prints the machines, their events and the first mismatch (exit 1 on one).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from mpcache.core_sm.lookup_ops import LookupClientConfig
from mpcache.core_sm.planner_ops import PlannerConfig
from mpcache.core_sm.server_link import ServerLinkConfig
from mpcache.core_sm.trace import TraceCodec
from mpcache.core_sm.transfer_client import TransferClientConfig
from mpcache.sim.transport import sim_link_config
from mpcache.sim.profiles import PROFILES, Profile
from mpcache.sim.scenario import WorldConfig

FORMAT = 1

# Config fields a simulated world does not model (a deployment's facts or the simulator's own
# time scale), per recorded config; replayed as recorded. Every other field must be the builder's.
DEPLOYMENT_FACTS: dict[str, dict[str, str]] = {
    "planner": {},
    "lookup_client": {
        "model_name": "the engine's model: the simulator names one model for every world",
        "result_ttl": "the simulator keeps finished lookups a minute, as long as a world lasts",
    },
    "transfer_client": {
        "model_name": "the engine's model: the simulator names one model for every world",
        "object_bytes": "the engine's KV geometry: simulated copies move no bytes",
    },
    "link": {
        "health.initially_healthy": "a simulated engine starts with its servers up; the connector learns it",
        "health.backoff_max": "the simulator backs probes off to 4 heartbeats; the connector to its reconnect interval",
    },
}


@attrs.frozen
class Mismatch:
    """The first recorded step whose replayed effects differ: ``line`` in the file (1-based),
    the machine's name, its ``step`` (0-based; -1: its build, the configs differ), the event."""

    line: int
    machine: str
    step: int
    event: str
    recorded: Any
    replayed: Any

    def describe(self) -> str:
        """The step, then the first effect that differs (by its index in the effect list)."""
        where = "build" if self.step < 0 else f"step {self.step}"
        head = f"line {self.line}: {self.machine} {where} ({self.event}) differs"
        recorded, replayed = self.recorded, self.replayed
        if isinstance(recorded, list) and isinstance(replayed, list):
            index = next((i for i, (a, b) in enumerate(zip(recorded, replayed)) if a != b),
                         min(len(recorded), len(replayed)))
            head += f" at effect {index} ({len(recorded)} recorded, {len(replayed)} replayed)"
            recorded = recorded[index] if index < len(recorded) else None
            replayed = replayed[index] if index < len(replayed) else None
        return f"{head}\n  recorded: {json.dumps(recorded)[:1500]}\n  replayed: {json.dumps(replayed)[:1500]}"


@attrs.frozen
class ReplayResult:
    """``steps``: events replayed per machine; ``events``: per machine kind, event type -> count;
    ``taken``: the config fields taken from the recording (``DEPLOYMENT_FACTS``) that differed;
    ``machines``: the replayed machines by name, as the last step left them."""

    steps: dict[str, int]
    events: dict[str, dict[str, int]]
    taken: tuple[str, ...]
    mismatch: Mismatch | None
    machines: dict[str, Any] = attrs.field(factory=dict, eq=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.mismatch is None


def load(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _configs(lines: Iterable[Mapping[str, Any]], codec: TraceCodec) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    for line in lines:
        if "build" in line:
            for key, value in line["configs"].items():
                found.setdefault(key, []).append(codec.decode(value))
    return found


def world_of(lines: Sequence[Mapping[str, Any]]) -> WorldConfig:
    """The simulated world whose settings are the recorded run's: the planner's (chunk and block
    size, lease TTL, lookup waits, sync loads, CPU engine, KV groups), the lookup client's
    (servers, ranks, the answer in the ack, the request timeout it is bounded by), the links'
    (heartbeats) and the workers' (engine-driven copies). A setting the recording does not hold
    keeps the world's default."""
    configs = _configs(lines, TraceCodec(keep_tokens=True))
    fields: dict[str, Any] = {}
    for planner in configs.get("planner", [])[:1]:
        assert isinstance(planner, PlannerConfig)
        fields.update(chunk_size=planner.chunk_size, block_size=planner.block_size, lease_ttl=planner.lease_ttl,
                      lookup_wait=planner.lookup_wait, lookup_wait_idle=planner.lookup_wait_idle,
                      sync_load_max_tokens=planner.sync_load_max_tokens, cpu_engine=planner.cpu_engine,
                      kv_groups=planner.kv_groups)
    for lookups in configs.get("lookup_client", [])[:1]:
        assert isinstance(lookups, LookupClientConfig)
        fields.update(num_servers=lookups.num_servers, tp=lookups.world_size,
                      lookup_answer_in_ack=lookups.answer_in_ack, request_timeout=lookups.lookup_timeout / 2)
    for link in configs.get("link", [])[:1]:
        assert isinstance(link, ServerLinkConfig)
        fields.update(request_timeout=link.request_timeout, heartbeat_interval=link.health.interval,
                      heartbeat_timeout=link.health.timeout)
    for transfer in configs.get("transfer_client", [])[:1]:
        assert isinstance(transfer, TransferClientConfig)
        fields.update(engine_driven=transfer.engine_driven, chunk_size=transfer.chunk_size, tp=transfer.world_size)
    return WorldConfig(**fields)


def _differences(built: Any, recorded: Any, prefix: str = "") -> list[str]:
    """The dotted names of the fields where two configs of one class differ."""
    if type(built) is not type(recorded) or not attrs.has(type(built)):
        return [] if built == recorded else [prefix.rstrip(".") or "(the config itself)"]
    out: list[str] = []
    for field in attrs.fields(type(built)):
        a, b = getattr(built, field.name), getattr(recorded, field.name)
        if a != b:
            out += _differences(a, b, f"{prefix}{field.name}.") if attrs.has(type(a)) else [prefix + field.name]
    return out


class _Build:
    """A machine built by the simulator's builder: the class it chose, and the config it would
    run, checked against the recorded one."""

    def __init__(self, kind: str, built_config: Any, recorded_config: Any) -> None:
        differ = _differences(built_config, recorded_config)
        self.unnamed = [name for name in differ if name not in DEPLOYMENT_FACTS[kind]]
        self.taken = [f"{kind}.{name}" for name in differ if name in DEPLOYMENT_FACTS[kind]]


def _build(kind: str, line: Mapping[str, Any], world: WorldConfig, profile: Profile, codec: TraceCodec,
           ) -> tuple[Any, list[str], list[str]]:
    """(machine, config fields that differ unnamed, deployment facts taken from the recording)."""
    configs = {key: codec.decode(value) for key, value in line["configs"].items()}
    if kind == "planner":
        planner = profile.make_planner(world)
        plan = _Build("planner", planner.config, configs["planner"])
        look = _Build("lookup_client", planner.lookups.config, configs["lookup_client"])
        machine = type(planner)(configs["planner"], type(planner.lookups)(configs["lookup_client"]))
        return machine, plan.unnamed + [f"lookup_client.{n}" for n in look.unnamed], plan.taken + look.taken
    if kind == "transfer_client":
        recorded = configs["transfer_client"]
        client = profile.make_transfer_client(world, recorded.worker_id, recorded.instance_id, recorded.server)
        check = _Build("transfer_client", client.config, recorded)
        return type(client)(recorded), check.unnamed, check.taken
    if kind == "link":
        recorded = configs["link"]
        check = _Build("link", sim_link_config(world), recorded)
        return profile.make_link(recorded, float(line["t"])), check.unnamed, check.taken
    raise ValueError(f"a recorded machine of unknown kind {kind!r}")


def replay(lines: Sequence[Mapping[str, Any]], profile: str | Profile = "default") -> ReplayResult:
    """Replay a recording (``load``'s lines) through ``profile``'s machines (module doc)."""
    chosen = PROFILES[profile] if isinstance(profile, str) else profile
    world = world_of(lines)
    codec = TraceCodec(keep_tokens=True)
    machines: dict[str, Any] = {}
    steps: dict[str, int] = {}
    events: dict[str, dict[str, int]] = {}
    taken: list[str] = []
    for number, line in enumerate(lines, 1):
        if "build" in line:
            if line.get("mpcache_record") != FORMAT:
                raise ValueError(f"line {number}: not a recording of format {FORMAT}")
            name, kind = str(line["build"]), str(line["kind"])
            machine, unnamed, facts = _build(kind, line, world, chosen, codec)
            taken += [fact for fact in facts if fact not in taken]
            if unnamed:
                return ReplayResult(steps, events, tuple(taken), Mismatch(
                    number, name, -1, "build", {"recorded": line["configs"]},
                    {"fields the simulator's builder sets otherwise": unnamed}), machines)
            machines[name] = machine
            steps[name] = 0
            continue
        name = str(line["i"])
        machine = machines[name]
        event = codec.decode(line["event"])
        got = codec.encode(machine.handle(event, float(line["t"])))
        kind_events = events.setdefault(name.rsplit("-", 2)[0], {})
        kind_events[type(event).__name__] = kind_events.get(type(event).__name__, 0) + 1
        if got != line["effects"]:
            return ReplayResult(steps, events, tuple(taken), Mismatch(
                number, name, steps[name], type(event).__name__, line["effects"], got), machines)
        steps[name] += 1
    return ReplayResult(steps, events, tuple(taken), None, machines)


def report(path: str, profile: str = "default") -> int:
    """Replay the recording at ``path`` and print what ran and the first mismatch; 1 on one."""
    result = replay(load(path), profile)
    for name, count in result.steps.items():
        print(f"{name}: {count} steps")
    for kind, counts in result.events.items():
        print(f"{kind}: " + ", ".join(f"{event} {n}" for event, n in sorted(counts.items())))
    print("taken from the recording (deployment facts): " + (", ".join(result.taken) or "none"))
    if result.mismatch is not None:
        print(result.mismatch.describe())
        return 1
    print(f"every effect as recorded ({sum(result.steps.values())} steps)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpcache.sim.prod_replay",
                                     description="replay a production recording (MPCACHE_RECORD) through the "
                                                 "simulator's machines")
    parser.add_argument("recording")
    parser.add_argument("--profile", default="default", choices=sorted(PROFILES))
    args = parser.parse_args(argv)
    return report(args.recording, args.profile)


if __name__ == "__main__":
    sys.exit(main())
