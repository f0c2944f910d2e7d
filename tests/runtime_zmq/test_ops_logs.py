"""Logs: repeats folded into one line per window, JSON lines, a line per registration and
refusal with its reason, the periodic summary while busy."""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Callable

from live_server import ServerProcess, wait_for
from mpcache.runtime_zmq import logs
from mpcache.runtime_zmq.client import MPCacheClient, RemoteError
from test_server_ops import OBJ_BYTES, key, register, store_chunks, tokens


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def capture(fmt: str = "text") -> tuple[logging.Logger, io.StringIO, logs.RepeatFilter, FakeClock]:
    stream = io.StringIO()
    clock = FakeClock()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter() if fmt == "json" else logging.Formatter("%(levelname)s %(message)s"))
    fold = logs.RepeatFilter(30.0, clock=clock)
    handler.addFilter(fold)
    logger = logging.getLogger(f"mpcache.test.{id(stream)}")
    logger.propagate = False
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return logger, stream, fold, clock


def test_repeats_are_folded_into_one_line_per_window() -> None:
    logger, stream, fold, clock = capture()
    # a root handler is needed for the summary: RepeatFilter emits through the handlers it is on
    logging.getLogger().addHandler(logger.handlers[0])
    try:
        for i in range(313):
            logger.warning("L2 read of %s from %r failed: %s", f"obj{i}", "redis://x", "connection refused")
        logger.warning("a different message")
        assert stream.getvalue().count("\n") == 2
        clock.now += 31
        fold.flush()
        lines = stream.getvalue().splitlines()
        assert lines[-1] == "WARNING ... and 312 more in the last 30 s: L2 read of obj312 from 'redis://x' failed: connection refused"
        logger.warning("L2 read of %s from %r failed: %s", "again", "redis://x", "refused")
        assert stream.getvalue().splitlines()[-1].startswith("WARNING L2 read of again")
        logger.info("x", extra={"no_fold": True})
        logger.info("x", extra={"no_fold": True})
        assert stream.getvalue().count("INFO x") == 2
    finally:
        logging.getLogger().removeHandler(logger.handlers[0])


def test_json_lines() -> None:
    logger, stream, _fold, _clock = capture("json")
    logger.info("instance %s registration accepted", 7, extra={"instance": 7})
    obj = json.loads(stream.getvalue().splitlines()[0])
    assert obj["msg"] == "instance 7 registration accepted" and obj["level"] == "INFO" and obj["instance"] == 7
    assert obj["ts"].endswith("Z")


def test_registration_lines_and_summary(start_server: Callable[..., ServerProcess]) -> None:
    sp = start_server("--summary-interval", "1", "--log-format", "json")
    with MPCacheClient(sp.url) as c:
        register(c, 3)
        with_gpu = c.register_instance(4, {"model_name": "m", "world_size": 1, "object_bytes": OBJ_BYTES})
        try:
            with_gpu.result(5)
        except RemoteError:
            pass
        toks = tokens(2, seed=5)
        store_chunks(c, toks, "s1", iid=3)
        c.lookup(key(toks, "r1")).result(5)
        assert c.wait_prefetch_status("r1", 1.0).result(5) == 2
        c.unregister_instance(3).result(5)

        def lines() -> list[dict[str, object]]:
            return [json.loads(x) for x in sp.log if x.startswith("{")]

        assert wait_for(lambda: any("last " in str(x["msg"]) for x in lines()), timeout=10.0)
    msgs = [str(x["msg"]) for x in lines()]
    assert any(m.startswith("instance 3 registration accepted") and f"{OBJ_BYTES} bytes per object" in m for m in msgs), msgs
    refusal = [m for m in msgs if m.startswith("instance 4 registration refused")]
    assert refusal and "validation:" in refusal[0], msgs
    assert any(m.startswith("instance 3 unregistration accepted") for m in msgs), msgs
    summary = next(m for m in msgs if m.startswith("last "))
    assert "1 lookups" in summary and "hit tokens 100.0% (512 of 512)" in summary and "L2 none" in summary, summary


def test_idle_server_logs_no_summary(start_server: Callable[..., ServerProcess]) -> None:
    sp = start_server("--summary-interval", "1")
    with MPCacheClient(sp.url) as c:  # an idle engine's heartbeats do not make the server busy
        for _ in range(5):
            c.ping()
            c.health()
            time.sleep(0.5)
    assert not any(": last " in line for line in sp.log), sp.log
