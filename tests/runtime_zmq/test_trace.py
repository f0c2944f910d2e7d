"""Trace capture -> deterministic replay: a live ``mpcache-server --trace FILE`` serves real
stores, hits, misses and a clear; ``mpcache-sim replay-trace FILE`` re-runs the server machine on
the trace with no divergence, a tampered trace is reported as one, and no token id is in it."""
from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from typing import Any

from mpcache.runtime_zmq.client import MPCacheClient
from mpcache.sim.cli import main as sim_main
from adapter_driver import CHUNK, Engine
from live_server import ADMIN_TOKEN, wait_for


def _traffic(start_server: Callable[..., Any], path: str, *flags: str) -> list[int]:
    server = start_server("--chunk-size", str(CHUNK), "--l1-size-gb", str(4 / 1024), "--slot-mb", "1",
                          "--trace", path, *flags)
    engine = Engine([server.url])
    rng = random.Random(5)
    prompt = [rng.randrange(50_000) for _ in range(3 * CHUNK + 2)]
    other = [rng.randrange(50_000) for _ in range(2 * CHUNK + 2)]
    try:
        for rid, tokens in (("a", prompt), ("b", prompt), ("c", other), ("d", prompt)):
            engine.add(rid, tokens)
            engine.run_all()
        with MPCacheClient(server.url, request_timeout=5.0) as client:
            client.clear(True, ADMIN_TOKEN).result(5.0)
    finally:
        engine.close()
    assert server.terminate() == 0
    return prompt


def test_a_live_trace_replays_without_divergence_and_holds_no_tokens(start_server: Callable[..., Any],
                                                                     tmp_path: Any, capsys: Any) -> None:
    path = str(tmp_path / "server.trace")
    prompt = _traffic(start_server, path, "--kv-events", "tcp://127.0.0.1:*")
    lines = open(path).read().splitlines()
    assert len(lines) > 20 and oct(os.stat(path).st_mode & 0o777) == "0o600"
    head = json.loads(lines[0])
    assert head["keep_tokens"] is False and head["part"] == 0
    assert '"PrepareStore"' in open(path).read() and '"ChunksStored"' in open(path).read()
    # no prompt text: the tokens are nowhere, not even packed
    from mpcache.core_sm.chunks import pack_tokens
    assert pack_tokens(prompt[:CHUNK]).hex() not in open(path).read()
    assert sim_main(["replay-trace", path]) == 0
    assert "no divergence" in capsys.readouterr().out

    # a tampered record (one reply's result changed) is a divergence
    records = [json.loads(line) for line in lines[1:]]
    for record in records:
        replies = [e for e in record[2] if e.get("$") == "Reply" and isinstance(e.get("result"), int)]
        if replies:
            replies[0]["result"] += 1
            break
    tampered = tmp_path / "tampered.trace"
    tampered.write_text("\n".join([lines[0], *(json.dumps(r) for r in records)]) + "\n")
    assert sim_main(["replay-trace", str(tampered)]) == 1
    assert "1 divergence" in capsys.readouterr().out


def test_a_trace_rotates_past_its_size(start_server: Callable[..., Any], tmp_path: Any, capsys: Any) -> None:
    path = str(tmp_path / "small.trace")
    _traffic(start_server, path, "--trace-max-mb", "0.01", "--trace-tokens")
    assert os.path.exists(path + ".1")
    assert os.path.getsize(path + ".1") < 64 * 1024
    assert json.loads(open(path).readline())["part"] >= 1
    assert json.loads(open(path + ".1").readline())["keep_tokens"] is True


# Hostile finding 9: a planted symlink is refused, and the id seed is not in a running server's trace.


def test_a_symlink_at_the_trace_path_is_refused_and_its_target_untouched(tmp_path: Any) -> None:
    import subprocess
    import sys

    from live_server import REPO

    target = tmp_path / "precious"
    target.write_text("keep me\n")
    target.chmod(0o644)
    link = tmp_path / "server.trace"
    link.symlink_to(target)
    env = dict(os.environ, PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, "-m", "mpcache.runtime_zmq.cli", "--trace", str(link), "--port", "0",
                        "--l1-size-gb", "0.0625", "--slot-mb", "1", "--no-metrics"],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "cannot start:" in out and "symlink" in out, out[-2000:]
    assert target.read_text() == "keep me\n" and oct(target.stat().st_mode & 0o777) == "0o644"


def test_the_id_seed_is_written_only_when_the_server_stops(start_server: Callable[..., Any], tmp_path: Any,
                                                            capsys: Any) -> None:
    path = str(tmp_path / "seed.trace")
    server = start_server("--chunk-size", str(CHUNK), "--l1-size-gb", str(4 / 1024), "--slot-mb", "1", "--trace", path)
    engine = Engine([server.url])
    try:
        for i in range(6):
            engine.add(f"r{i}", [7 + i] * (3 * CHUNK + 1))
            engine.run_all()  # registrations and transfers: ids the seed keys are in use
    finally:
        engine.close()
    assert wait_for(lambda: os.path.getsize(path) > 0)
    running = json.loads(open(path).readline())
    assert running["config"]["id_seed"] == 0  # a reader of a live trace cannot predict the ids
    assert server.terminate() == 0
    stopped = json.loads(open(path).readline())
    assert stopped["config"]["id_seed"] != 0
    assert sim_main(["replay-trace", path]) == 0  # and the stopped trace replays exactly
    assert "no divergence" in capsys.readouterr().out
