"""Run one seed (or one Scenario) to a `SeedResult`; run many seeds on several processes.

One seed fixes everything: the scenario (`draw_scenario(seed)`), the per-message randomness
(`scenario.net_seed`) and the order in which the world's tasks run (`sim/timeline.py`, seeded
from `net_seed` too). Same seed, same profile -> same trace, byte for byte, in any process.
"""
from __future__ import annotations

import gc
import os
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import attrs

from mpcache.runtime_trio import DeadlockError
from mpcache.sim.oracles import Violation, ViolationFound
from mpcache.sim.profiles import get_profile
from mpcache.sim.scenario import Scenario, draw_scenario


@attrs.frozen
class SeedResult:
    seed: int
    profile: str
    violation: Violation | None
    events: int
    virtual_time: float
    real_time: float
    trace_hash: str
    requests: int
    lines: tuple[str, ...] = ()
    cpu_time: float = 0.0
    coverage: tuple[tuple[str, int], ...] = ()

    @property
    def ok(self) -> bool:
        return self.violation is None


def run_world(world: Any) -> Violation | None:
    """Run a ``sim.World`` to its end: the violation that stopped it (a deadlock is one), or
    None. Anything else it raises is the caller's."""
    try:
        world.run()
    except ViolationFound as exc:
        return exc.violation
    except DeadlockError as exc:
        return Violation("DEADLOCK", exc.now, "-", str(exc))
    return None


def run_scenario(scenario: Scenario, profile_name: str = "default", *, keep_lines: bool = False,
                 chart: bool = False, hash_trace: bool = True) -> tuple[SeedResult, Any]:
    """Run one world; returns the result and the world (for charts and debugging).

    ``hash_trace=False`` (a sweep): the trace is formatted and hashed only if the seed fails
    (`trace_hash` is "" otherwise) -- formatting every line costs a tenth of a seed."""
    from mpcache.sim.world import World

    profile = get_profile(profile_name)
    world = World(scenario, profile, keep_lines=keep_lines, chart=chart)
    violation: Violation | None = None
    started = time.perf_counter()
    cpu_started = time.process_time()
    try:
        violation = run_world(world)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a reported violation
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:])
        violation = Violation("CRASH", world.now(), "-", f"{type(exc).__name__}: {exc}\n{tb}")
        world.trace.line(world.now(), "-", f"CRASH {violation.message}")
    if violation is not None and violation not in world.violations:
        world.trace.line(violation.t, violation.node, f"VIOLATION {violation.reason()}")
    trace_hash = world.trace.digest() if hash_trace or violation is not None else ""
    real = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    result = SeedResult(
        seed=scenario.seed, profile=profile_name, violation=violation, events=world.events,
        virtual_time=world.now(), real_time=real, trace_hash=trace_hash,
        requests=len(scenario.requests), lines=tuple(world.trace.lines) if keep_lines else (),
        cpu_time=cpu, coverage=tuple(sorted(world.coverage().items())),
    )
    return result, world


def run_seed(seed: int, profile_name: str = "default", keep_lines: bool = False, hash_trace: bool = True) -> SeedResult:
    result, _ = run_scenario(draw_scenario(seed), profile_name, keep_lines=keep_lines, hash_trace=hash_trace)
    return result


# A sweep collects a seed's garbage once, after the seed, instead of letting the cyclic collector
# run every 700 allocations inside it: a world is a web of cycles (nodes, machines, tasks and the
# world point at one another) that lives exactly one seed, so the collections inside a seed find
# almost nothing and scan the live world again and again (a tenth of a seed's CPU). The young
# threshold stays finite so that a runaway seed still collects; every _FULL_EVERY seeds a full
# collection frees what the per-seed ones promoted. Collection never changes a seed's trace.
_SEED_GC_THRESHOLD = 200_000
_FULL_EVERY = 64


def _swept(seed: int, profile_name: str, count: int) -> SeedResult:
    """One seed of a sweep, its garbage collected after it (see _SEED_GC_THRESHOLD)."""
    saved = gc.get_threshold()
    gc.set_threshold(_SEED_GC_THRESHOLD, 1_000_000, 1_000_000)
    try:
        return run_seed(seed, profile_name, hash_trace=False)
    finally:
        gc.set_threshold(*saved)
        gc.collect(2 if count % _FULL_EVERY == _FULL_EVERY - 1 else 1)


_jobs_done = 0  # seeds this worker process ran (when its full collections are due)


def _run_seed_job(args: tuple[int, str]) -> SeedResult:
    global _jobs_done
    _jobs_done += 1
    return _swept(args[0], args[1], _jobs_done - 1)


def run_many(seeds: Iterable[int], profile_name: str = "default", jobs: int = 1,
             on_result: Callable[[SeedResult], None] | None = None) -> list[SeedResult]:
    """Run seeds (in order of completion callbacks, results returned in seed order)."""
    seed_list = list(seeds)
    results: list[SeedResult] = []
    it: Iterator[SeedResult]
    if jobs <= 1 or len(seed_list) < 2:
        it = (_swept(s, profile_name, i) for i, s in enumerate(seed_list))
        for r in it:
            results.append(r)
            if on_result is not None:
                on_result(r)
    else:
        chunksize = max(1, min(16, len(seed_list) // (jobs * 8)))
        with ProcessPoolExecutor(max_workers=jobs, initializer=_worker_init) as pool:
            for r in pool.map(_run_seed_job, [(s, profile_name) for s in seed_list], chunksize=chunksize):
                results.append(r)
                if on_result is not None:
                    on_result(r)
    return results


def _worker_init() -> None:
    os.environ.setdefault("MPCACHE_SIM_WORKER", "1")
