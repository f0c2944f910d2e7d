"""Run one seed (or one Scenario) to a `SeedResult`; run many seeds on several processes.

One seed fixes everything: the scenario (`draw_scenario(seed)`), the per-message randomness
(`scenario.net_seed`) and trio's own scheduler randomness (`trio._core._run._r`, the hook trio
registers for Hypothesis). Same seed, same profile -> same trace, byte for byte, in any process.
"""
from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import attrs

from mpcache.runtime_trio import DeadlockError
from mpcache.runtime_trio.clock import VirtualClock, VirtualTimeDriver
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


def seed_trio_scheduler(seed: int) -> None:
    import trio._core._run as trio_run  # trio's scheduler randomness (batch order)

    # trio shuffles each batch of runnable tasks with `_r` only once Hypothesis is imported
    # (its plugin flips this flag); otherwise it reverses batches at random. Use one mode always,
    # so a trace does not depend on whether Hypothesis happens to be loaded in the process.
    trio_run._ALLOW_DETERMINISTIC_SCHEDULING = True  # type: ignore[misc]
    trio_run._r.seed(seed)


def _unwrap(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) >= 1:
        inner = [e for e in exc.exceptions if not isinstance(e, trio.Cancelled)] if _HAS_TRIO else list(exc.exceptions)
        if not inner:
            return exc
        exc = inner[0]
    return exc


try:
    import trio

    _HAS_TRIO = True
except ImportError:  # pragma: no cover
    _HAS_TRIO = False


def run_scenario(scenario: Scenario, profile_name: str = "default", *, keep_lines: bool = False,
                 chart: bool = False) -> tuple[SeedResult, Any]:
    """Run one world; returns the result and the world (for charts and debugging)."""
    from mpcache.sim.world import World

    profile = get_profile(profile_name)
    seed_trio_scheduler(scenario.net_seed)
    world = World(scenario, profile, keep_lines=keep_lines, chart=chart)
    clock = VirtualClock()
    driver = VirtualTimeDriver(clock)
    violation: Violation | None = None
    started = time.perf_counter()
    cpu_started = time.process_time()
    try:
        driver.run(world.main)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a reported violation
        inner = _unwrap(exc)
        if isinstance(inner, ViolationFound):
            violation = inner.violation
        elif isinstance(inner, DeadlockError):
            violation = Violation("DEADLOCK", inner.now, "-", str(inner))
        elif isinstance(inner, KeyboardInterrupt):
            raise
        else:
            tb = "".join(traceback.format_exception(type(inner), inner, inner.__traceback__)[-6:])
            violation = Violation("CRASH", clock.current_time(), "-", f"{type(inner).__name__}: {inner}\n{tb}")
            world.trace.line(clock.current_time(), "-", f"CRASH {violation.message}")
    if violation is not None and violation not in world.violations:
        world.trace.line(violation.t, violation.node, f"VIOLATION {violation.reason()}")
    real = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    result = SeedResult(
        seed=scenario.seed, profile=profile_name, violation=violation, events=world.events,
        virtual_time=clock.current_time(), real_time=real, trace_hash=world.trace.digest(),
        requests=len(scenario.requests), lines=tuple(world.trace.lines) if keep_lines else (),
        cpu_time=cpu, coverage=tuple(sorted(world.coverage().items())),
    )
    return result, world


def run_seed(seed: int, profile_name: str = "default", keep_lines: bool = False) -> SeedResult:
    result, _ = run_scenario(draw_scenario(seed), profile_name, keep_lines=keep_lines)
    return result


def _run_seed_job(args: tuple[int, str]) -> SeedResult:
    return run_seed(*args)


def run_many(seeds: Iterable[int], profile_name: str = "default", jobs: int = 1,
             on_result: Callable[[SeedResult], None] | None = None) -> list[SeedResult]:
    """Run seeds (in order of completion callbacks, results returned in seed order)."""
    seed_list = list(seeds)
    results: list[SeedResult] = []
    it: Iterator[SeedResult]
    if jobs <= 1 or len(seed_list) < 2:
        it = (run_seed(s, profile_name) for s in seed_list)
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
