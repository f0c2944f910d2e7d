"""`mpcache-bench startup`: how long `mpcache-server` takes from spawn to its first reply, and
where the start-up time goes.

* `--runs N` starts (default 5), each a fresh process with the given server flags (default: the
  server's defaults on a free loopback port, metrics on a free port): time from `Popen` to the first answered `health` request (a DEALER that resends every
  50 ms until the socket is up), and to the `mpcache-server ready` line. min / median / max.
* `--repo DIR` (repeatable): time the server of other checkouts too, their starts interleaved
  with this one's, for a before/after in one run.
* `--importtime`: one more start per checkout under `python -X importtime`, stopped after its first reply; the
  modules whose import took longest (cumulative, with what they import) are printed, so a
  change to the start-up path can be judged by where the time went, not only by the total.

Flags after `--` go to the server, e.g. `mpcache-bench startup -- --no-metrics --l2 disk:/tmp/x`.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

from mpcache.bench.bench_rpc import free_port

RESEND_S = 0.05
_IMPORT_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)$")


def _checkout(repo: str | None) -> str:
    return os.path.realpath(repo) if repo else os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(repo: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class StartError(RuntimeError):
    pass


def start_once(server_args: Sequence[str], *, repo: str | None = None, importtime: bool = False,
               timeout_s: float = 60.0) -> dict[str, Any]:
    """Spawn one server (of the checkout ``repo``; default this one), time it to its first `health` reply and its ready line, stop it by pid.
    Returns ``{"reply_s", "ready_s", "stderr"}`` (stderr holds the import times when asked)."""
    port = free_port()
    argv = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "mpcache.runtime_zmq.cli",
            "--host", "127.0.0.1", "--port", str(port), *server_args]
    if "--metrics-port" not in server_args and "--no-metrics" not in server_args:
        argv += ["--metrics-port", "0"]
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 10)
    sock.connect(f"tcp://127.0.0.1:{port}")
    ready_at: list[float] = []
    err_lines: list[str] = []
    t0 = time.perf_counter()
    # cwd: `python -m` puts it first on sys.path, ahead of PYTHONPATH
    checkout = _checkout(repo)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env=_env(checkout), cwd=checkout, start_new_session=True, text=True)

    def read_stdout() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("mpcache-server ready") and not ready_at:
                ready_at.append(time.perf_counter())

    def read_stderr() -> None:
        assert proc.stderr is not None
        err_lines.extend(proc.stderr)

    readers = [threading.Thread(target=read_stdout, daemon=True), threading.Thread(target=read_stderr, daemon=True)]
    for r in readers:
        r.start()
    try:
        uid = 0
        while True:
            sock.send_multipart([msgpack.packb(uid), msgpack.packb("health")])
            if sock.poll(int(RESEND_S * 1000)):
                frames = sock.recv_multipart()
                reply_s = time.perf_counter() - t0
                if frames[1] != msgpack.packb("health"):
                    raise StartError(f"health answered with {frames!r}")
                break
            if proc.poll() is not None:
                raise StartError(f"server exited with {proc.returncode}:\n" + "".join(err_lines[-20:]))
            if time.perf_counter() - t0 > timeout_s:
                raise StartError(f"no reply within {timeout_s} s")
            uid += 1
        deadline = time.perf_counter() + 10.0
        while not ready_at and time.perf_counter() < deadline and proc.poll() is None:
            time.sleep(0.005)
    finally:
        sock.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for r in readers:
            r.join(timeout=10)
    ready_s = ready_at[0] - t0 if ready_at else float("nan")
    return {"reply_s": reply_s, "ready_s": ready_s, "stderr": "".join(err_lines)}


def slowest_imports(stderr: str, top: int) -> list[tuple[str, int, int]]:
    """``(module, cumulative µs, nesting depth)`` of the ``top`` slowest imports in
    ``-X importtime`` output (a parent's time includes its children's)."""
    rows: list[tuple[str, int, int]] = []
    for line in stderr.splitlines():
        match = _IMPORT_LINE.match(line)
        if match:
            rows.append((match.group(4), int(match.group(2)), len(match.group(3)) // 2))
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    server_args: list[str] = []
    if "--" in args_in:
        cut = args_in.index("--")
        args_in, server_args = args_in[:cut], args_in[cut + 1:]
    p = argparse.ArgumentParser(prog="mpcache-bench startup", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="server starts to time (default 5)")
    p.add_argument("--importtime", action=argparse.BooleanOptionalAction, default=True,
                   help="one more start under -X importtime, slowest imports printed (default on)")
    p.add_argument("--top", type=int, default=15, help="import rows to print")
    p.add_argument("--repo", action="append", default=None, metavar="DIR",
                   help="time the server of this checkout (repeat to compare checkouts in one run, their starts "
                   "interleaved); default: this one")
    args = p.parse_args(args_in)
    repos: list[str | None] = list(args.repo) if args.repo else [None]
    runs: dict[str | None, list[dict[str, Any]]] = {r: [] for r in repos}
    for _ in range(args.runs):
        for repo in repos:  # interleaved: every checkout sees the same background load
            runs[repo].append(start_once(server_args, repo=repo))
    load = os.getloadavg()
    print(f"server flags: {' '.join(server_args) or '(defaults)'}; {args.runs} starts each; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print()
    print("| checkout | measure | min s | median s | max s |")
    print("|---|---|---:|---:|---:|")
    for repo in repos:
        for name, field in (("spawn to first health reply", "reply_s"), ("spawn to ready line", "ready_s")):
            values = [r[field] for r in runs[repo]]
            print(f"| {repo or 'this'} | {name} | {min(values):.3f} | {statistics.median(values):.3f} | {max(values):.3f} |")
    if args.importtime:
        for repo in repos:
            traced = start_once(server_args, repo=repo, importtime=True)
            print()
            print(f"{repo or 'this'}: -X importtime start (reply after {traced['reply_s']:.3f} s, import tracing included):")
            print()
            print("| module | cumulative ms | depth |")
            print("|---|---:|---:|")
            for module, us, depth in slowest_imports(traced["stderr"], args.top):
                print(f"| {module} | {us / 1000:.1f} | {depth} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
