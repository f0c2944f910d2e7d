"""The vLLM adapters driven in vLLM's call order (tests/runtime_zmq/adapter_driver.py, scheduling
with the simulator's model of vLLM, mpcache.sim.vllm_scheduler) against
real ``mpcache-server`` processes: hit, miss, partial hit, prefix-cache overlap, aborts at every
phase, preemption, server restart, two servers. No vLLM needed."""
from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mpcache.runtime_zmq.adapters import ConnectorConfig, SchedulerAdapter, ServerUnreachable
from mpcache.runtime_zmq.client import MPCacheClient
from adapter_driver import BLOCK, CHUNK, Engine
from mpcache.sim.vllm_scheduler import SchedulerModel

try:
    from redis_server import redis_server, redis_url  # noqa: F401  (fixtures)
except ImportError:  # pragma: no cover
    from .redis_server import redis_server, redis_url  # type: ignore[no-redef]  # noqa: F401

SERVER_FLAGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.0625", "--slot-mb", "1")


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def stats(url: str) -> dict[str, Any]:
    with MPCacheClient(url, request_timeout=5.0) as client:
        return dict(client.stats())


def assert_clean(engine: Engine, *urls: str) -> None:
    """Every block is back with the engine and no server holds a lease or a lookup job."""
    assert engine.blocks_in_use() == 0
    for url in urls:
        s = stats(url)
        assert s["leases_held"] == 0, s
        assert s["jobs"] == 0, s


@pytest.fixture
def start(start_server: Callable[..., Any]) -> Callable[..., Any]:
    def go(*flags: str) -> Any:
        return start_server(*SERVER_FLAGS, *flags)

    return go


@pytest.fixture
def engine_factory() -> Iterator[Callable[..., Engine]]:
    engines: list[Engine] = []

    def make(*urls: str, **kwargs: Any) -> Engine:
        engine = Engine(urls, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def test_miss_then_hit_loads_exact_kv(start: Any, engine_factory: Any) -> None:
    server = start()
    engine = engine_factory(server.url)
    # One model of vLLM: this engine schedules through the simulator's, over the real adapter.
    assert type(engine.scheduler) is SchedulerModel and engine.scheduler.connector is engine.planner
    prompt = tokens(4 * CHUNK + 10, 1)
    first = engine.add("a", prompt)
    engine.run_all()
    assert first.external == 0
    assert stats(server.url)["objects"] == 4
    second = engine.add("b", prompt)
    engine.run_all()
    assert second.external == 4 * CHUNK
    assert second.checked  # the loaded KV equals what the forward would have computed
    assert_clean(engine, server.url)
    assert stats(server.url)["hit_chunks"] == 4


def test_full_prompt_hit_leaves_the_last_token_to_compute(start: Any, engine_factory: Any) -> None:
    server = start()
    engine = engine_factory(server.url)
    prompt = tokens(2 * CHUNK, 2)
    engine.add("a", prompt)
    engine.run_all()
    again = engine.add("b", prompt)
    engine.run_all()
    assert again.external == 2 * CHUNK - 1
    assert again.checked
    assert_clean(engine, server.url)


def test_partial_hit_loads_the_common_prefix_and_stores_the_rest(start: Any, engine_factory: Any) -> None:
    server = start()
    engine = engine_factory(server.url)
    prompt = tokens(3 * CHUNK, 3)
    engine.add("a", prompt[: 2 * CHUNK + 5])
    engine.run_all()
    longer = engine.add("b", prompt)
    engine.run_all()
    assert longer.external == 2 * CHUNK
    assert longer.checked
    assert stats(server.url)["objects"] == 3  # the third chunk was stored by "b"
    diverged = engine.add("c", prompt[:CHUNK] + tokens(2 * CHUNK, 4))
    engine.run_all()
    assert diverged.external == CHUNK  # hashes are prefix-chained: only chunk 0 matches
    assert diverged.checked
    assert_clean(engine, server.url)


def test_prefix_cache_overlap_is_not_overwritten(start: Any, engine_factory: Any) -> None:
    server = start()
    engine = engine_factory(server.url)
    prompt = tokens(3 * CHUNK + 1, 5)
    engine.add("a", prompt)
    engine.run_all()
    # The engine holds 1.5 chunks itself: the load covers [CHUNK, 3*CHUNK) and skips the blocks
    # of [CHUNK, 1.5*CHUNK) (the driver marks engine-held blocks and checks they survive).
    held = CHUNK + CHUNK // 2
    overlap = engine.add("b", prompt, engine_hit=held)
    engine.run_all()
    assert overlap.external == 3 * CHUNK - held
    assert overlap.checked
    # An engine hit covering the whole mpcache hit loads nothing and frees every lease.
    covered = engine.add("c", prompt, engine_hit=3 * CHUNK)
    engine.run_all()
    assert covered.external == 0
    assert_clean(engine, server.url)


def test_abort_while_the_lookup_is_pending(start: Any, engine_factory: Any) -> None:
    server = start()
    engine = engine_factory(server.url)
    prompt = tokens(4 * CHUNK, 6)
    engine.add("a", prompt)
    engine.run_all()
    req = engine.add("b", prompt)
    # Submit the lookup (first get_num_new_matched_tokens) and abort before its answer is used.
    assert engine.planner.get_num_new_matched_tokens("b", prompt, len(prompt), 0) == (None, True)
    engine.abort("b")
    engine.run_all()
    assert req.external == 0
    _wait_leases_released(server.url)
    assert_clean(engine, server.url)


def test_abort_after_allocation_with_the_load_in_flight(start: Any, engine_factory: Any) -> None:
    server = start()
    engine = engine_factory(server.url)
    prompt = tokens(4 * CHUNK, 7)
    engine.add("a", prompt)
    engine.run_all()
    for attempt in range(5):
        req = engine.add(f"b{attempt}", prompt)
        engine.run_until(lambda: req.status == "loading")
        if req.recv_reported == 0:
            break
        # the load finished within the step that started it: not the case under test; again
        engine.run_all()
    assert req.recv_reported == 0, "every load finished before it could be aborted"
    engine.abort(req.request_id)  # vLLM keeps the blocks until the worker reports the request
    assert engine.blocks_in_use() > 0
    engine.run_all()
    assert req.freed and req.finished_reported == 1 and req.recv_reported == 0
    _wait_leases_released(server.url)
    assert_clean(engine, server.url)


def test_abort_after_the_load_finished_before_the_request_ran(start: Any, engine_factory: Any) -> None:
    server = start()
    engine = engine_factory(server.url)
    prompt = tokens(3 * CHUNK, 18)
    engine.add("a", prompt)
    engine.run_all()
    req = engine.add("b", prompt)
    engine.run_until(lambda: req.recv_reported == 1)
    assert req.status == "loading"  # reported loaded; vLLM would schedule it next step
    engine.abort("b")
    engine.run_all()
    assert req.freed and req.finished_reported == 1 and req.recv_reported == 1
    _wait_leases_released(server.url)
    assert_clean(engine, server.url)


def test_abort_while_running_and_after_finishing(start: Any, engine_factory: Any) -> None:
    server = start()
    engine = engine_factory(server.url)
    prompt = tokens(2 * CHUNK + 3, 8)
    running = engine.add("a", prompt)
    engine.run_until(lambda: running.status in ("running", "finished"))
    engine.abort("a")
    engine.abort("a")  # a second abort of a finished request is ignored, as in vLLM
    engine.run_all()
    assert running.finished_reported == 1
    assert_clean(engine, server.url)


def test_preempted_request_recomputes_and_its_stores_are_intact(start: Any, engine_factory: Any) -> None:
    server = start()
    engine = engine_factory(server.url, store_decode_tokens=False)
    prompt = tokens(3 * CHUNK, 9)
    req = engine.add("a", prompt, max_decode=3)
    # Run until the prompt is computed (and stored); preempt the request while it decodes.
    engine.run_until(lambda: req.status == "running")
    assert req.decoded == 0
    engine.preempt("a")
    # Another request takes the freed blocks at once and overwrites them.
    other = engine.add("x", tokens(3 * CHUNK, 10))
    engine.run_until(lambda: other.status == "finished")
    assert req.status == "finished" and req.external == 0  # resumed: recomputed, not reloaded
    engine.run_all()
    # The stored chunks are the preempted request's real KV, not the blocks' later contents.
    check = engine.add("b", prompt)
    engine.run_all()
    assert check.external == 3 * CHUNK - 1 and check.checked
    assert_clean(engine, server.url)


def test_server_restart_degrades_to_misses_then_recovers(start_server: Callable[..., Any], engine_factory: Any) -> None:
    port = _free_port()
    server = start_server(*SERVER_FLAGS, "--port", str(port))
    engine = engine_factory(server.url, request_timeout_s=1.0)
    prompt = tokens(3 * CHUNK, 11)
    engine.add("a", prompt)
    engine.run_all()
    server.kill()
    down = engine.add("b", prompt)
    engine.run_all(timeout=20)
    assert down.external == 0  # no server: a miss, never a wait
    # The client notices the server is gone (heartbeat), then finds the new one on the same port.
    _wait(lambda: not engine.workers[0]._links.healthy(0), 10)
    server = start_server(*SERVER_FLAGS, "--port", str(port))
    _wait(lambda: engine.workers[0]._links.healthy(0), 10)
    first = engine.add("c", prompt)
    engine.run_all(timeout=20)
    assert first.external == 0  # the new server is empty; this run stores again
    second = engine.add("d", prompt)
    engine.run_all(timeout=20)
    assert second.external == 3 * CHUNK - 1 and second.checked
    assert stats(server.url)["instances"] == 1  # the worker's link registered it again by itself
    assert_clean(engine, server.url)


def test_server_restarted_between_two_heartbeats_is_registered_again(start_server: Callable[..., Any], engine_factory: Any) -> None:
    # A supervisor restarts the server faster than the heartbeat can notice: the health never
    # drops, only the server's epoch changes. The new server binds the same ipc path while the
    # old one still runs; the old one is killed (-9) right after a heartbeat, and the clients
    # reconnect to the new one before the next.
    path = os.path.join(tempfile.mkdtemp(prefix="mpcache-restart-"), "mpcache.sock")
    old = start_server(*SERVER_FLAGS, "--ipc", path)
    engine = engine_factory(old.url, request_timeout_s=1.0)
    worker = engine.workers[0]
    client = worker._links.clients[0]
    health: list[bool] = []
    client.on_health(health.append)
    prompt = tokens(3 * CHUNK, 13)
    engine.add("a", prompt)
    engine.run_all()
    hit = engine.add("b", prompt)
    engine.run_all()
    assert hit.external == 3 * CHUNK - 1
    first_epoch = client.epoch
    new = start_server(*SERVER_FLAGS, "--ipc", path)
    beat = client.heartbeat_at
    _wait(lambda: client.heartbeat_at != beat, 5)
    old.kill()
    _wait(lambda: client.epoch not in (None, first_epoch), 5)
    assert health == [], "the heartbeat noticed the restart: this test needs it unnoticed"
    engine.run_until(lambda: worker.machine.stats()["server_restarts"] == 1)
    # the connection's link registers again on the new epoch (the worker's machine never does)
    _wait(lambda: client.link.monitor.stats()["registrations_on_epoch"] >= 1 and stats(new.url)["instances"] == 1, 5)
    # the scheduler's lookup client learned it too (its lookups on the old server resolve now)
    _wait(lambda: engine.lookups.poll() is None and engine.lookups.planner.lookups.stats()["server_restarts"] == 1, 5)
    first = engine.add("c", prompt)
    engine.run_all(timeout=20)
    assert first.external == 0  # the new server is empty; this run stores into it
    second = engine.add("d", prompt)
    engine.run_all(timeout=20)
    assert second.external == 3 * CHUNK - 1 and second.checked  # the stores went through
    assert worker.machine.stats()["not_registered"] == 0  # no op was refused NOT_REGISTERED
    assert worker.machine.stats()["registrations"] == 1  # its one registration, at start
    assert health == []
    assert_clean(engine, new.url)


def test_server_dies_with_a_load_in_flight(start_server: Callable[..., Any], engine_factory: Any) -> None:
    server = start_server(*SERVER_FLAGS)
    engine = engine_factory(server.url, request_timeout_s=1.0)
    prompt = tokens(3 * CHUNK, 12)
    engine.add("a", prompt)
    engine.run_all()
    req = engine.add("b", prompt)
    engine.run_until(lambda: req.status == "loading")
    server.kill()
    engine.run_all(timeout=20)
    # The load either finished before the kill or failed into load errors and was recomputed:
    # every position the request kept as computed holds the right KV, and it finished.
    assert req.status == "finished" and req.freed
    assert engine.blocks_in_use() == 0


def test_two_servers_one_rank_hits_where_it_stored(start: Any, engine_factory: Any) -> None:
    """The worker (rank 0 of 1) stores to and loads from the first server (core_sm's placement,
    client_config.server_for_rank); the second holds no rank, so the lookup does not ask it (it
    asked every server for every rank, and b's miss made every hit a miss)."""
    a, b = start(), start()
    engine = engine_factory(a.url, b.url)
    prompt = tokens(3 * CHUNK, 13)
    engine.add("a", prompt)
    engine.run_all()
    assert stats(a.url)["objects"] == 3 and stats(b.url)["objects"] == 0
    again = engine.add("b", prompt)
    engine.run_all()
    assert again.external == 3 * CHUNK - 1 and again.checked
    assert stats(b.url)["lookups"] == 0
    _wait_leases_released(a.url)
    assert_clean(engine, a.url, b.url)


def test_two_servers_two_ranks_each_server_holds_and_answers_its_rank(start: Any, engine_factory: Any) -> None:
    """Rank r of 2 stores to server r; each server's lookup should name only its rank, so the hit
    is every rank's."""
    a, b = start(), start()
    engine = engine_factory(a.url, b.url, world_size=2)
    prompt = tokens(3 * CHUNK, 16)
    engine.add("a", prompt)
    engine.run_all()
    assert stats(a.url)["objects"] == 3 and stats(b.url)["objects"] == 3
    again = engine.add("b", prompt)
    engine.run_all()
    assert again.external == 3 * CHUNK - 1 and again.checked
    assert stats(a.url)["hit_chunks"] == 3 and stats(b.url)["hit_chunks"] == 3
    _wait_leases_released(a.url)
    _wait_leases_released(b.url)
    assert_clean(engine, a.url, b.url)


def test_two_servers_sharing_redis_both_hit(start: Any, engine_factory: Any, redis_url: str) -> None:
    """Two nodes on one Redis L2: what an engine stored through server a reaches server b by
    write-behind; an engine on b looks it up, b prefetches it, and the load is exact. b's
    prefetch leases are released by the end of the request."""
    a, b = start("--l2", redis_url), start("--l2", redis_url)
    writer = engine_factory(a.url)
    prompt = tokens(3 * CHUNK, 14)
    writer.add("a", prompt)
    writer.run_all()
    _wait(lambda: stats(a.url)["l2_writes_in_flight"] == 0 and stats(a.url)["l2_writes"] >= 3, 10)
    reader = engine_factory(b.url)
    again = reader.add("b", prompt)
    reader.run_all()
    assert again.external == 3 * CHUNK - 1 and again.checked
    assert stats(b.url)["l2_reads"] >= 1
    _wait_leases_released(b.url)
    assert_clean(writer, a.url)
    assert_clean(reader, b.url)


def test_two_engines_of_one_process_share_a_server(start: Any, engine_factory: Any) -> None:
    # Same pid, same rank: still two instances (an id derived from the pid made the second
    # registration replace the first).
    server = start()
    first = engine_factory(server.url)
    second = engine_factory(server.url)
    assert first.workers[0].instance_id != second.workers[0].instance_id
    assert stats(server.url)["instances"] == 2
    prompt = tokens(3 * CHUNK, 14)
    first.add("a", prompt)
    first.run_all()
    hit = second.add("b", prompt)
    second.run_all()
    assert hit.external == 3 * CHUNK - 1 and hit.checked
    assert_clean(first, server.url)
    assert_clean(second, server.url)


def test_kv_roles_producer_stores_only_consumer_loads_only(start: Any, engine_factory: Any) -> None:
    server = start()
    prompt = tokens(2 * CHUNK + 1, 15)
    producer = engine_factory(server.url, load=False)
    producer.add("a", prompt)
    producer.run_all()
    producer.add("b", prompt)
    producer.run_all()
    s = stats(server.url)
    assert s["objects"] == 2 and s["lookups"] == 0
    consumer = engine_factory(server.url, store=False)
    hit = consumer.add("c", prompt)
    consumer.run_all()
    assert hit.external == 2 * CHUNK and hit.checked
    consumer.add("d", tokens(2 * CHUNK + 1, 16))
    consumer.run_all()
    assert stats(server.url)["objects"] == 2  # the consumer stored nothing
    assert_clean(consumer, server.url)


def test_decode_chunks_are_stored_when_asked(start: Any, engine_factory: Any) -> None:
    server = start()
    engine = engine_factory(server.url, store_decode_tokens=True)
    req = engine.add("a", tokens(CHUNK - 2, 17), max_decode=4)
    engine.run_all()
    assert stats(server.url)["objects"] == 1  # the chunk the decode tokens completed
    again = engine.add("b", req.tokens[:CHUNK] + [1, 2, 3])
    engine.run_all()
    assert again.external == CHUNK and again.checked
    assert_clean(engine, server.url)


def test_start_fails_clearly_when_no_server_answers() -> None:
    port = _free_port()
    config = ConnectorConfig(server_urls=f"127.0.0.1:{port}", connect_timeout_s=0.5, connect_strict=True)
    t0 = time.monotonic()
    with pytest.raises(ServerUnreachable, match=f"tcp://127.0.0.1:{port}"):
        SchedulerAdapter.connect(config, model_name="m", world_size=1, block_size=BLOCK)
    assert time.monotonic() - t0 < 5


def test_chunk_size_must_be_a_multiple_of_the_block_size(start: Any) -> None:
    server = start()
    config = ConnectorConfig(server_urls=server.url)
    with pytest.raises(ValueError, match="multiple of the engine block size 48"):
        SchedulerAdapter.connect(config, model_name="m", world_size=1, block_size=48)
    SchedulerAdapter.connect(config, model_name="m", world_size=1, block_size=BLOCK).close()


def test_config_keys() -> None:
    config = ConnectorConfig.from_extra_config(
        {"mpcache.server_urls": "a:1, ipc:///tmp/x", "mpcache.request_timeout_s": "2", "other.key": 1}
    )
    assert config.server_urls == ("tcp://a:1", "ipc:///tmp/x")
    assert config.request_timeout_s == 2.0
    assert config.server_for_rank(0, 4) == "tcp://a:1" and config.server_for_rank(3, 4) == "ipc:///tmp/x"
    with pytest.raises(ValueError, match="mpcache.server_url"):
        ConnectorConfig.from_extra_config({"mpcache.server_url": "x"})
    with pytest.raises(ValueError):
        ConnectorConfig.from_extra_config({"mpcache.request_timeout_s": 0})
    with pytest.raises(ValueError):
        ConnectorConfig.from_extra_config({"mpcache.store_decode_tokens": "yes"})


def test_connector_module_without_vllm_says_how_to_install() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is installed here")
    with pytest.raises(ImportError, match=r"mpcache\[vllm\]"):
        from mpcache import runtime_zmq
        import mpcache.runtime_zmq.vllm_connector  # noqa: F401


# ------------------------------------------------------------------ helpers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def _wait_leases_released(url: str, timeout: float = 5.0) -> None:
    # FREE_LOOKUP_LOCKS / END_SESSION are fire-and-forget: give them a moment to land.
    _wait(lambda: stats(url)["leases_held"] == 0 and stats(url)["jobs"] == 0, timeout)


def test_tensor_parallel_ranks_store_and_load_their_own_objects(start: Any, engine_factory: Any) -> None:
    """One scheduler, two worker ranks (TP=2): one plan for both; each rank stores its own KV
    (the KV differs per rank) and loads exactly its own back."""
    server = start()
    engine = engine_factory(server.url, world_size=2)
    prompt = tokens(3 * CHUNK + 5, 21)
    first = engine.add("a", prompt)
    engine.run_all()
    assert first.external == 0 and stats(server.url)["objects"] == 3 * 2
    second = engine.add("b", prompt)
    engine.run_all()
    assert second.external == 3 * CHUNK and second.checked  # every rank's blocks hold its own KV
    assert stats(server.url)["hit_chunks"] == 3
    assert_clean(engine, server.url)
