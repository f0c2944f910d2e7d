"""`mpcache-bench server --url URL [--lookups N] [--chunks C] [--in-flight W]`: lookup + status
round trips against a running mpcache-server, from one client, as `mpcache-cli bench` does (the
same code). Prompts are random, so every lookup misses: the row measures the control plane
(decode, hash, job, status) as a deployment sees it, not L1 copies.

Without `--url` it starts a server of its own (L1 only, free ports) for the run and stops it.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpcache-bench server", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--in-flight", type=int, default=16)
    args = parser.parse_args(argv)
    from mpcache.runtime_zmq import admin_cli

    bench = ["bench", "--lookups", str(args.lookups), "--chunks", str(args.chunks), "--in-flight", str(args.in_flight)]
    if args.url is not None:
        return admin_cli.main(["--url", args.url, *bench])
    server = subprocess.Popen(
        [sys.executable, "-m", "mpcache.runtime_zmq.cli", "--port", "0", "--no-metrics", "--l1-size-gb", "0.25", "--slot-mb", "1",
         "--log-level", "warning"],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ),
    )
    try:
        assert server.stdout is not None
        url = ""
        for line in server.stdout:
            if line.startswith("mpcache-server ready "):
                url = line.split()[2]
                break
        if not url:
            print("mpcache-bench server: the server did not start", file=sys.stderr)
            return 1
        return admin_cli.main(["--url", url, *bench])
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    sys.exit(main())
