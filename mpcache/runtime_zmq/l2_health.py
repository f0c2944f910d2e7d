"""A circuit breaker per L2 tier (or per Redis Cluster node): after a run of failures the tier is
skipped (its objects are misses, its writes are dropped) instead of costing every effect a
timeout, and it is tried again after a backoff that doubles up to a cap.

Pure: the caller passes ``now``; thread safety is the caller's (one lock around each call).

    CLOSED --failure x threshold--> OPEN --now >= retry_at: allow() lets ONE trial through--> HALF_OPEN
    HALF_OPEN --success--> CLOSED (backoff reset)       HALF_OPEN --failure--> OPEN (backoff doubled)
"""
from __future__ import annotations

import enum

__all__ = ["Breaker", "BreakerState"]


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Breaker:
    def __init__(self, threshold: int = 3, backoff_s: float = 0.5, backoff_max_s: float = 30.0) -> None:
        if threshold < 1 or backoff_s <= 0 or backoff_max_s < backoff_s:
            raise ValueError("breaker: threshold >= 1 and 0 < backoff_s <= backoff_max_s")
        self.threshold = threshold
        self.backoff_min_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.state = BreakerState.CLOSED
        self.failures = 0  # consecutive
        self.backoff_s = backoff_s
        self.retry_at = 0.0
        self.trial_started = 0.0
        self.opened = 0  # how many times it opened (a counter for stats)

    def allow(self, now: float) -> bool:
        """Whether a call may go to the tier now. In OPEN past ``retry_at`` it lets exactly one
        trial call through (HALF_OPEN); a trial that never reports is given up after one more
        backoff, so a lost report cannot close the tier for good."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.HALF_OPEN:
            if now - self.trial_started < self.backoff_s:
                return False
        elif now < self.retry_at:
            return False
        self.state = BreakerState.HALF_OPEN
        self.trial_started = now
        return True

    def due(self, now: float) -> bool:
        """OPEN and past its retry time: the owner should send a trial (a ping)."""
        return self.state is BreakerState.OPEN and now >= self.retry_at

    def success(self) -> None:
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.backoff_s = self.backoff_min_s

    def failure(self, now: float) -> bool:
        """Records a failed call; returns True when this failure opened the breaker."""
        self.failures += 1
        if self.state is BreakerState.HALF_OPEN:
            self.backoff_s = min(self.backoff_s * 2, self.backoff_max_s)
        elif self.state is BreakerState.OPEN or self.failures < self.threshold:
            return False
        self.state = BreakerState.OPEN
        self.retry_at = now + self.backoff_s
        self.opened += 1
        return True

    def open_now(self, now: float) -> None:
        """Opens at once (a tier found unreachable at start)."""
        self.state = BreakerState.OPEN
        self.failures = max(self.failures, self.threshold)
        self.retry_at = now + self.backoff_s
        self.opened += 1
