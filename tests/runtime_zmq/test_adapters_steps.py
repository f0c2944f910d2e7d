"""The steps a hit waits, with the adapters in vLLM's call order against a real server: a short
wait for the lookup's answer inside ``get_num_new_matched_tokens`` and a synchronous load
(``load_async=False``, finished in ``start_load_kv`` before the forward) serve a hit in the step
that first sees it; without them it waits a step for the lookup and one for the load."""
from __future__ import annotations

from typing import Any

import pytest
from adapter_driver import BLOCK, CHUNK, Engine

from mpcache.core_sm.planner import SYNC_LOAD_ALL
from mpcache.runtime_zmq.adapters import ConnectorConfig, SchedulerAdapter
from test_adapters import assert_clean, engine_factory, start, stats, tokens  # noqa: F401  (fixtures)

# Generous: the box running the tests may be loaded; an L1 answer takes well under 1 ms.
WAIT_MS = 500.0


def _steps_to_prefill(engine: Engine, request_id: str, prompt: list[int]) -> int:
    req = engine.add(request_id, prompt)
    before = engine.steps
    engine.run_until(lambda: req.computed >= req.num_prompt)
    return engine.steps - before


# The short wait, or only the idle engine's (lookup_wait_ms 0): either lets the first step see the hit.
@pytest.mark.parametrize("wait", ["lookup_wait_ms", "lookup_wait_idle_ms"])
def test_a_hit_is_served_in_the_step_that_first_sees_it(start: Any, engine_factory: Any, wait: str) -> None:
    server = start()
    engine = engine_factory(server.url, sync_load_max_tokens=1 << 30, **{wait: WAIT_MS})
    prompt = tokens(4 * CHUNK + 10, 31)
    first = engine.add("a", prompt)
    engine.run_all()
    assert first.external == 0 and engine.sync_loads == 0
    assert _steps_to_prefill(engine, "b", prompt) == 1
    engine.run_all()
    second = engine.requests["b"]
    assert second.external == 4 * CHUNK
    assert second.checked  # loaded before the forward, and the KV is the prompt's
    assert engine.sync_loads == 1
    assert stats(server.url)["hit_chunks"] == 4
    assert_clean(engine, server.url)


def test_without_the_wait_and_the_sync_load_a_hit_waits_two_steps_more(start: Any, engine_factory: Any) -> None:
    server = start()
    engine = engine_factory(server.url)  # lookup_wait_ms=0, every load asynchronous
    prompt = tokens(4 * CHUNK + 10, 32)
    engine.add("a", prompt)
    engine.run_all()
    assert _steps_to_prefill(engine, "b", prompt) >= 3  # "not yet", the load, then the compute
    engine.run_all()
    assert engine.requests["b"].checked and engine.sync_loads == 0
    assert_clean(engine, server.url)


def test_a_load_over_the_sync_limit_stays_asynchronous(start: Any, engine_factory: Any) -> None:
    server = start()
    engine = engine_factory(server.url, lookup_wait_ms=WAIT_MS, sync_load_max_tokens=2 * CHUNK)
    small, large = tokens(2 * CHUNK + 3, 33), tokens(4 * CHUNK + 3, 34)
    engine.add("a", small)
    engine.add("b", large)
    engine.run_all()
    assert _steps_to_prefill(engine, "small", small) == 1
    assert _steps_to_prefill(engine, "large", large) >= 2  # loaded in one step, computed in a later one
    engine.run_all()
    assert engine.sync_loads == 1
    assert engine.requests["small"].external == 2 * CHUNK and engine.requests["small"].checked
    assert engine.requests["large"].external == 4 * CHUNK and engine.requests["large"].checked
    assert_clean(engine, server.url)


def test_tensor_parallel_sync_load_fills_every_ranks_blocks_before_the_forward(start: Any, engine_factory: Any) -> None:
    server = start()
    engine = engine_factory(server.url, world_size=2, lookup_wait_ms=WAIT_MS, sync_load_max_tokens=1 << 30)
    prompt = tokens(3 * CHUNK + 5, 35)
    engine.add("a", prompt)
    engine.run_all()
    assert _steps_to_prefill(engine, "b", prompt) == 1
    engine.run_all()
    assert engine.requests["b"].external == 3 * CHUNK and engine.requests["b"].checked
    assert_clean(engine, server.url)


def test_aborting_after_a_sync_load_leaves_nothing_behind(start: Any, engine_factory: Any) -> None:
    server = start()
    engine = engine_factory(server.url, lookup_wait_ms=WAIT_MS, sync_load_max_tokens=1 << 30)
    prompt = tokens(3 * CHUNK + 5, 36)
    engine.add("a", prompt)
    engine.run_all()
    req = engine.add("b", prompt, max_decode=8)
    engine.run_until(lambda: req.computed >= req.num_prompt)
    engine.abort("b")
    engine.run_all()
    assert req.checked
    assert_clean(engine, server.url)


@pytest.mark.parametrize(("cpu_engine", "setting", "expected"),
                         [(True, None, SYNC_LOAD_ALL), (False, None, 0), (True, 0, 0), (False, 4 * CHUNK, 4 * CHUNK)])
def test_the_connector_passes_the_device_and_its_setting_to_the_planner(
        start: Any, cpu_engine: bool, setting: int | None, expected: int) -> None:
    server = start()
    config = ConnectorConfig(server_urls=server.url, sync_load_max_tokens=setting)
    adapter = SchedulerAdapter.connect(config, model_name="m", world_size=1, block_size=BLOCK, cpu_engine=cpu_engine)
    try:
        assert adapter.planner.config.sync_load_max_tokens == expected
    finally:
        adapter.close()


def test_a_busy_engine_does_not_take_the_idle_wait(start: Any, engine_factory: Any) -> None:
    server = start()
    engine = engine_factory(server.url, lookup_wait_idle_ms=WAIT_MS, sync_load_max_tokens=1 << 30)
    prompt = tokens(4 * CHUNK + 10, 38)
    engine.add("a", prompt)
    engine.run_all()
    busy = engine.add("busy", tokens(CHUNK + 1, 39), max_decode=50)
    engine.run_until(lambda: busy.computed >= busy.num_prompt)
    assert not engine.planner.planner.engine_idle()
    assert _steps_to_prefill(engine, "b", prompt) >= 2  # "not yet" at once: the decoding request runs on
    engine.run_all()
    assert engine.requests["b"].checked
    assert_clean(engine, server.url)


@pytest.mark.parametrize("status_wait", [True, False])
def test_the_lookup_status_is_waited_for_or_polled_as_configured(start: Any, status_wait: bool) -> None:
    server = start()
    config = ConnectorConfig(server_urls=server.url, lookup_status_wait=status_wait)
    adapter = SchedulerAdapter.connect(config, model_name="m", world_size=1, block_size=BLOCK)
    try:
        assert adapter.planner.lookups.config.use_wait is status_wait
        assert adapter.planner.lookups.config.wait_timeout < config.request_timeout_s
    finally:
        adapter.close()
    with pytest.raises(ValueError):
        ConnectorConfig(server_urls=server.url, lookup_status_wait="yes")


@pytest.mark.parametrize("in_ack", [True, False])
def test_answer_in_ack_serves_the_hit_without_a_status_query(start: Any, engine_factory: Any, in_ack: bool) -> None:
    """``mpcache.lookup_answer_in_ack`` (default on): every lookup of an L1-only server is answered
    in its ack (the miss's 0 and the hit's count), so the server sees no status query at all;
    off, each lookup is followed by its status query, as before."""
    server = start()
    engine = engine_factory(server.url, lookup_answer_in_ack=in_ack, lookup_wait_ms=WAIT_MS,
                            sync_load_max_tokens=1 << 30)
    assert engine.planner.planner.lookups.config.answer_in_ack is in_ack
    assert ConnectorConfig().lookup_answer_in_ack  # the default
    prompt = tokens(4 * CHUNK + 10, 33)
    engine.add("a", prompt)
    engine.run_all()
    assert _steps_to_prefill(engine, "b", prompt) == 1
    engine.run_all()
    assert engine.requests["b"].external == 4 * CHUNK and engine.requests["b"].checked
    s = stats(server.url)
    if in_ack:
        assert s["lookups_answered_in_ack"] == s["lookups"] == 2 and s["status_queries"] == 0
    else:
        assert s["lookups_answered_in_ack"] == 0 and s["status_queries"] == s["lookups"] == 2
    assert_clean(engine, server.url)
    with pytest.raises(ValueError):
        ConnectorConfig(server_urls=server.url, lookup_answer_in_ack="yes")
