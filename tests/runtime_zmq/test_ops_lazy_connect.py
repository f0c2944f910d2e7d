"""vLLM starts before its mpcache server: the connector's lookups miss while the server is down,
the worker registers when it appears, and from then on prompts are stored and hit. With
``mpcache.connect_strict`` the connector refuses to start instead (today's behaviour)."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest

import adapter_driver
from adapter_driver import CHUNK, Engine
from live_server import ServerProcess
from mpcache.runtime_zmq import adapters
from mpcache.runtime_zmq.adapters import ConnectorConfig, SchedulerAdapter, ServerUnreachable
from mpcache.runtime_zmq.client import MPCacheClient


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def test_strict_mode_refuses_to_start_without_a_server() -> None:
    port = free_port()
    config = ConnectorConfig.from_extra_config({"mpcache.server_urls": f"127.0.0.1:{port}", "mpcache.connect_timeout_s": 0.5,
                                                "mpcache.connect_strict": True})
    with pytest.raises(ServerUnreachable, match=f"tcp://127.0.0.1:{port}"):
        SchedulerAdapter.connect(config, model_name="m", world_size=1, block_size=16)


def test_engine_started_before_the_server_misses_then_hits(monkeypatch: pytest.MonkeyPatch,
                                                           start_server: Callable[..., ServerProcess]) -> None:
    monkeypatch.setattr(adapters, "DEFAULT_CHUNK_SIZE", CHUNK)  # the test servers' --chunk-size
    monkeypatch.setattr(adapter_driver, "ConnectorConfig",
                        lambda **kw: ConnectorConfig(**{**kw, "connect_timeout_s": 0.5}))
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    t0 = time.monotonic()
    engine = Engine([url])
    try:
        assert time.monotonic() - t0 < 10
        prompt = tokens(4 * CHUNK + 10, 1)
        early = engine.add("early", prompt)
        engine.run_all()
        assert early.external == 0  # no server: a miss, the request computed
        server = start_server("--port", str(port), "--chunk-size", str(CHUNK), "--l1-size-gb", "0.0625", "--slot-mb", "1")

        def seen() -> Any:
            with MPCacheClient(server.url, request_timeout=5.0) as c:
                st = c.stats()
            return st["instances"] >= 1 and st["lookups"] >= 1

        deadline = time.monotonic() + 30
        n = 0
        # once each side's heartbeat answers: the worker registers, the scheduler looks up again
        while not seen():
            assert time.monotonic() < deadline, "the worker never registered"
            engine.add(f"poll{n}", tokens(CHUNK + 10, 100 + n), max_decode=1)
            engine.run_all()
            n += 1
            time.sleep(0.2)
        first = engine.add("first", prompt)
        engine.run_all()
        second = engine.add("second", prompt)
        engine.run_all()
        assert first.external == 0 and second.external == 4 * CHUNK
        assert second.checked  # the KV loaded is what the forward computed
    finally:
        engine.close()
