"""`mpcache-bench reconnect`: how soon a client is healthy again after its server restarted.

Each of `--restarts N` (default 20) rounds SIGKILLs the server, waits until the client declared
it unhealthy and its probes backed off to `heartbeat_backoff_max`, then a further random part of
one probe period (a restart falls anywhere in the probe cycle, as in production; the phases come
from `--seed`, so two checkouts see the same ones), starts a new server on the same port, and
times from the moment the new server answers a fresh connection's first `health` request to the
moment the client's `healthy` turns True (`wait_healthy`). It prints p50 / p90 / max ms.

Client settings are the production defaults but a shorter heartbeat (`--heartbeat-interval` 0.5,
`--heartbeat-timeout` 1.5, `--reconnect-ivl-max` 1.0; the backoff cap is the client's default,
the larger of the interval and the reconnect interval).

`--repo DIR` (repeatable): measure the client of other checkouts too, each in its own process
with `PYTHONPATH=DIR` (this file runs there as a script: it imports only the client and the
server-process helper), for a before/after in one run.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import msgpack  # type: ignore[import-untyped]
import zmq

from mpcache.bench.bench_rpc import free_port

HERE_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _first_health_answer(url: str, timeout: float = 30.0) -> float:
    """``time.monotonic()`` when a fresh DEALER's ``health`` request is first answered."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    try:
        sock.send_multipart([msgpack.packb(1), msgpack.packb("health")])
        if not sock.poll(int(timeout * 1000)):
            raise RuntimeError(f"{url}: no answer to health within {timeout} s")
        sock.recv_multipart()
        return time.monotonic()
    finally:
        sock.close(0)


def _backoff_ramp(interval: float, timeout: float, backoff_max: float) -> float:
    """Seconds from the last reply until the client's probe period reached ``backoff_max``
    (the client's probe period starts at min(0.1, interval) and doubles per probe once silent
    for ``timeout``), plus one probe period of slack."""
    period, t = min(0.1, interval), timeout
    while period < backoff_max:
        period = min(period * 2, backoff_max)
        t += period
    return t + 0.2


def measure(args: argparse.Namespace, repo: str) -> list[float]:
    """Recovery times (s), one per restart, of the client importable here."""
    from mpcache.runtime_zmq.client import MPCacheClient
    from mpcache.bench.server_process import ServerProcess

    logging.getLogger("mpcache.client").setLevel(logging.ERROR)  # its restart warnings are expected here

    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    flags = ["--port", str(port), "--l1-size-gb", "0.25", "--slot-mb", "1", "--no-metrics"]
    backoff_max = max(args.heartbeat_interval, args.reconnect_ivl_max)
    ramp = _backoff_ramp(args.heartbeat_interval, args.heartbeat_timeout, backoff_max)
    rng = random.Random(args.seed)
    server = ServerProcess(flags, repo=repo)
    client = MPCacheClient(url, heartbeat_interval=args.heartbeat_interval, heartbeat_timeout=args.heartbeat_timeout,
                           reconnect_ivl_max=args.reconnect_ivl_max, connect_timeout=30.0)
    times: list[float] = []
    try:
        for _ in range(args.restarts):
            killed = time.monotonic()
            server.proc.kill()
            server.proc.wait(10)
            server.stop()
            end = killed + 3 * args.heartbeat_timeout
            while client.healthy and time.monotonic() < end:
                time.sleep(0.01)
            if client.healthy:
                raise RuntimeError("the client never noticed the server was gone")
            time.sleep(max(0.0, killed + ramp + rng.uniform(0.0, backoff_max) - time.monotonic()))
            server = ServerProcess(flags, repo=repo)
            answered = _first_health_answer(url)
            if not client.wait_healthy(30.0):
                raise RuntimeError("the client did not recover within 30 s")
            times.append(time.monotonic() - answered)
    finally:
        client.close()
        server.stop()
    return times


def _row(label: str, times: Sequence[float]) -> str:
    ms = sorted(t * 1000 for t in times)
    p90 = ms[min(len(ms) - 1, int(round(0.9 * (len(ms) - 1))))]
    return f"| {label} | {len(ms)} | {statistics.median(ms):.0f} | {p90:.0f} | {ms[-1]:.0f} |"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mpcache-bench reconnect", description=__doc__.split("\n")[0])
    ap.add_argument("--restarts", type=int, default=20)
    ap.add_argument("--heartbeat-interval", type=float, default=0.5)
    ap.add_argument("--heartbeat-timeout", type=float, default=1.5)
    ap.add_argument("--reconnect-ivl-max", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repo", action="append", default=[], help="another checkout whose client to measure too")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one checkout's times, for --repo
    args = ap.parse_args(argv)
    if args.json:
        print(json.dumps(measure(args, os.environ.get("MPCACHE_BENCH_REPO", HERE_REPO))))
        return 0
    rows: list[tuple[str, list[float]]] = []
    for repo in args.repo:
        env = dict(os.environ, PYTHONPATH=os.path.realpath(repo), MPCACHE_BENCH_REPO=os.path.realpath(repo),
                   PYTHONDONTWRITEBYTECODE="1")
        child_args = list(argv if argv is not None else sys.argv[1:])
        child_args = [a for i, a in enumerate(child_args)
                      if a != "--repo" and (i == 0 or child_args[i - 1] != "--repo")]
        out = subprocess.run([sys.executable, os.path.realpath(__file__), *child_args, "--json"], env=env,
                             capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(out.stdout + out.stderr, file=sys.stderr)
            return 1
        rows.append((repo, json.loads(out.stdout.strip().splitlines()[-1])))
    rows.append(("this checkout", measure(args, HERE_REPO)))
    print(f"restart recovery: server answering -> client healthy (heartbeat {args.heartbeat_interval:g} s, timeout "
          f"{args.heartbeat_timeout:g} s, reconnect max {args.reconnect_ivl_max:g} s, probes backed off to "
          f"{max(args.heartbeat_interval, args.reconnect_ivl_max):g} s)")
    print("| client | restarts | p50 ms | p90 ms | max ms |")
    print("|---|---|---|---|---|")
    for label, times in rows:
        print(_row(label, times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
