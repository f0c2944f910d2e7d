"""One scheduler adapter and one worker adapter on a live server, driven by hand (no vLLM): the
calls the model-specific adapter tests (test_adapters_hma.py, test_adapters_mla.py) share. A
subclass connects the two adapters and registers its KV caches."""
from __future__ import annotations

import time
from typing import Any

from mpcache.core_sm.planner import ScheduledRequest
from mpcache.runtime_zmq.adapters import SchedulerAdapter, WorkerAdapter


class OneWorkerEngine:
    scheduler: SchedulerAdapter
    worker: WorkerAdapter

    def __init__(self) -> None:
        self._next_block = 1

    def blocks(self, n: int) -> list[int]:
        out = list(range(self._next_block, self._next_block + n))
        self._next_block += n
        return out

    def match(self, rid: str, prompt: list[int]) -> tuple[int, bool]:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            tokens, load_async = self.scheduler.get_num_new_matched_tokens(rid, prompt, len(prompt), 0)
            if tokens is not None:
                return tokens, load_async
            time.sleep(0.01)
        raise AssertionError("the lookup never answered")

    def run_step(self, scheduled: list[ScheduledRequest]) -> Any:
        plan = self.scheduler.build_plan(scheduled)
        self.worker.submit_retrieves(plan.retrieves)
        self.worker.submit_stores(plan.stores)
        return plan

    def finish(self, rid: str) -> None:
        assert self.scheduler.request_finished(rid)
        deadline = time.monotonic() + 5
        ids = {rid}
        while time.monotonic() < deadline:
            sending, _ = self.worker.finished(ids)
            ids = set()
            if rid in sending:
                return
            time.sleep(0.01)
        raise AssertionError(f"{rid} never reported finished")

    def wait_loaded(self, rid: str) -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            _, recving = self.worker.finished(())
            if rid in recving:
                return
            time.sleep(0.01)
        raise AssertionError(f"{rid}'s load never finished")

    def close(self) -> None:
        self.worker.close()
        self.scheduler.close()
