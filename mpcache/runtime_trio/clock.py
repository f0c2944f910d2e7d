"""Virtual time for trio, with deadlock detection.

`VirtualClock` is a `trio.abc.Clock` whose time only moves when trio has nothing to run: at
that moment trio asks the clock how long to sleep until the next deadline, and the clock jumps
straight to that deadline and answers "0". So a run is a sequence of instants; no real time
passes between them, and equal inputs give equal schedules.

If trio is idle and there is *no* deadline, nothing can ever happen again: that is a deadlock.
The clock then reports it through `trio.lowlevel.TrioToken.run_sync_soon` (it may not touch
tasks from inside the run loop), and `VirtualTimeDriver` cancels the world and raises
`DeadlockError` listing every blocked task and where it waits. A plain
`MockClock(autojump_threshold=0)` would instead sleep forever.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import trio


class DeadlockError(RuntimeError):
    """Every task is blocked and no deadline is pending."""

    def __init__(self, now: float, blocked: list[str]) -> None:
        self.now = now
        self.blocked = blocked
        super().__init__(
            f"deadlock at t={now:.6f}: idle with no deadline; blocked tasks:\n  " + "\n  ".join(blocked)
        )


class VirtualClock(trio.abc.Clock):
    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._token: trio.lowlevel.TrioToken | None = None
        self._on_deadlock: Any = None
        self._reported = False
        self.jumps = 0

    def start_clock(self) -> None:
        pass

    def current_time(self) -> float:
        return self._now

    def deadline_to_sleep_time(self, deadline: float) -> float:
        # trio calls this only when no task is runnable.
        if deadline == math.inf:
            if self._token is not None and self._on_deadlock is not None and not self._reported:
                self._reported = True
                self._token.run_sync_soon(self._on_deadlock)
                return 0.0
            # No driver attached: behave like a clock that never reaches the deadline.
            return 86400.0
        if deadline > self._now:
            self._now = deadline
            self.jumps += 1
        return 0.0

    def reset(self, start: float = 0.0) -> None:
        """Move the clock to `start`. Only before a run or at its very start (no deadline set
        yet): pytest-trio reuses one clock fixture for every Hypothesis example, and an example
        must replay at the same instants to be reproducible."""
        self._now = start

    def attach(self, token: trio.lowlevel.TrioToken, on_deadlock: Any) -> None:
        self._token = token
        self._on_deadlock = on_deadlock
        self._reported = False


def blocked_tasks() -> list[str]:
    """One line per live task: its name and the innermost frames it is awaiting in."""
    root = trio.lowlevel.current_root_task()
    lines: list[str] = []
    if root is None:
        return lines

    def walk(task: trio.lowlevel.Task, depth: int) -> Iterator[str]:
        frames = [f"{f.f_code.co_name}:{lineno}" for f, lineno in task.iter_await_frames()]
        yield "  " * depth + f"{task.name} @ {' > '.join(frames[-3:]) or '-'}"
        for nursery in task.child_nurseries:
            for child in sorted(nursery.child_tasks, key=lambda t: t.name):
                yield from walk(child, depth + 1)

    lines.extend(walk(root, 0))
    return lines


class VirtualTimeDriver:
    """Run `async_fn` under a VirtualClock; deadlock -> DeadlockError with the task tree."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.deadlock: DeadlockError | None = None

    def run(self, async_fn: Any, *args: Any) -> Any:
        return trio.run(self._main, async_fn, args, clock=self.clock)

    async def _main(self, async_fn: Any, args: tuple[Any, ...]) -> Any:
        result: list[Any] = []
        with trio.CancelScope() as scope:

            def on_deadlock() -> None:
                self.deadlock = DeadlockError(self.clock.current_time(), blocked_tasks())
                scope.cancel()

            self.clock.attach(trio.lowlevel.current_trio_token(), on_deadlock)
            result.append(await async_fn(*args))
        if self.deadlock is not None:
            raise self.deadlock
        return result[0]


def run_virtual(async_fn: Any, *args: Any, start: float = 0.0) -> Any:
    """Run `async_fn(*args)` in virtual time; raise DeadlockError if it gets stuck."""
    return VirtualTimeDriver(VirtualClock(start)).run(async_fn, *args)
