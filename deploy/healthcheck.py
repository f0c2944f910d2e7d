"""The image's HEALTHCHECK: ``GET /healthz`` where the running mpcache-server serves it.

The server takes its HTTP port and address from a flag (``--metrics-port``), an environment
variable (``MPCACHE_METRICS_PORT``) or its ``--config`` file. This reads the same sources with the
server's own option parser: the server process's command line and environment (from /proc) and
its working directory (a relative --config), so ``docker run mpcache --metrics-port 9000`` and
``docker run -e MPCACHE_METRICS_PORT=9000 mpcache`` are both checked where the server listens.

Exit 0: /healthz answered 200, or the server runs with --no-metrics (nothing to ask);
1: no answer, not 200, or no mpcache-server process found.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Mapping, Sequence

SERVER_NAMES = ("mpcache-server",)
SERVER_MODULE = "mpcache.runtime_zmq.cli"


def server_args(cmdline: bytes) -> list[str] | None:
    """The server's own arguments in a /proc/PID/cmdline, or None if it is not mpcache-server."""
    argv = [a.decode(errors="surrogateescape") for a in cmdline.split(b"\0")]
    if argv and argv[-1] == "":
        argv.pop()  # the terminating NUL (an empty argument before it is kept)
    for i, arg in enumerate(argv[:3]):  # mpcache-server ARGS | python mpcache-server ARGS | python -m MODULE ARGS
        if os.path.basename(arg) in SERVER_NAMES:
            return argv[i + 1:]
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1] == SERVER_MODULE:
            return argv[i + 2:]
    return None


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [e.decode(errors="surrogateescape") for e in f.read().split(b"\0") if e]
    return dict(e.split("=", 1) for e in items if "=" in e)


def find_server(pid: int | None = None) -> tuple[int, list[str]] | None:
    """(pid, arguments) of the mpcache-server to check: ``pid``, else PID 1, else the first found."""
    pids = [pid] if pid is not None else [1] + sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and p != "1")
    for p in pids:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                args = server_args(f.read())
        except OSError:
            continue
        if args is not None:
            return p, args
    return None


def health_url(argv: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """The /healthz URL the server started with ``argv`` and ``environ`` serves (None: --no-metrics)."""
    from mpcache.runtime_zmq import cli
    from mpcache.runtime_zmq import config as cfg

    args, _sources = cfg.parse(cli.build_parser(), list(argv), environ)
    if not args.metrics:
        return None
    if args.metrics_port == 0:
        raise SystemExit("mpcache-healthcheck: metrics-port 0 (a free port) cannot be checked: set a port")
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(args.metrics_host, args.metrics_host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{args.metrics_port}/healthz"


def check(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    found = find_server(int(argv[0]) if argv else None)
    if found is None:
        print("mpcache-healthcheck: no mpcache-server process", file=sys.stderr)
        return 1
    pid, args = found
    try:
        environ = _environ(pid)
        os.chdir(f"/proc/{pid}/cwd")  # a relative --config is the server's
    except OSError:
        environ = dict(os.environ)
    url = health_url(args, environ)
    if url is None:
        return 0
    if check(url):
        return 0
    print(f"mpcache-healthcheck: {url} did not answer 200", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
