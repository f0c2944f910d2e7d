"""``mpcache-server``: run the mpcache KV-cache offload server.

Every flag has an environment variable (``MPCACHE_<FLAG>``, e.g. ``MPCACHE_PORT``); a flag on the
command line wins. Defaults: loopback only (``tcp://127.0.0.1:5555``), L1 only, L1 segment
allocated lazily, metrics off.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from runtime_zmq import wire

GiB = 1 << 30
MiB = 1 << 20


def _env(name: str, default: Any) -> Any:
    return os.environ.get(f"MPCACHE_{name}", default)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpcache-server",
        description="mpcache KV-cache offload server (LMCache MP-protocol compatible control plane).",
        epilog="Each flag can also be set by the environment variable MPCACHE_<FLAG> "
        "(upper case, dashes as underscores), e.g. MPCACHE_PORT=5556.",
    )
    where = p.add_argument_group("listening address")
    where.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="TCP bind address (default 127.0.0.1, loopback only)")
    where.add_argument("--port", type=int, default=int(_env("PORT", 5555)), help="TCP port (default 5555; 0 picks a free one)")
    where.add_argument("--ipc", default=_env("IPC", None), metavar="PATH", help="listen on a unix socket at PATH instead of TCP (its directory is created 0700)")
    cache = p.add_argument_group("cache")
    cache.add_argument("--chunk-size", type=int, default=int(_env("CHUNK_SIZE", 256)), help="tokens per chunk (default 256)")
    cache.add_argument("--l1-size-gb", type=float, default=float(_env("L1_SIZE_GB", 4.0)), help="L1 shared-memory size in GiB (default 4; committed lazily)")
    cache.add_argument("--slot-mb", type=float, default=float(_env("SLOT_MB", 32.0)), help="L1 slot size in MiB: the largest object (one chunk of one KV rank) (default 32)")
    cache.add_argument(
        "--l2", action="append", default=None, metavar="URL",
        help="L2 tier, repeatable: disk:PATH, redis://HOST:PORT or redis+cluster://H:P,H:P "
        "(env MPCACHE_L2, comma- or space-separated; put a Redis password in ?password_file=, never on the command line)",
    )
    cache.add_argument("--lease-ttl", type=float, default=float(_env("LEASE_TTL", 300.0)), help="seconds a read/write lease lives without use (default 300)")
    cache.add_argument("--job-ttl", type=float, default=float(_env("JOB_TTL", 60.0)), help="seconds a lookup nobody queries lives before its leases are reaped (default 60)")
    cache.add_argument("--tombstone-ttl", type=float, default=float(_env("TOMBSTONE_TTL", 60.0)), help="seconds a delivered status is repeated for (default 60)")
    cache.add_argument("--l2-read-timeout", type=float, default=float(_env("L2_READ_TIMEOUT", 30.0)), help="seconds before a lookup stops waiting for an L2 read and resolves with its L1 prefix (default 30)")
    cache.add_argument(
        "--l2-probe", action=argparse.BooleanOptionalAction, default=_env("L2_PROBE", "1") not in ("0", "false", "no"),
        help="ask L2 which objects it holds before reading (reads only the contiguous prefix; default on)",
    )
    add_l2_flags(cache)
    lim = p.add_argument_group("limits")
    lim.add_argument("--max-frame-mb", type=float, default=float(_env("MAX_FRAME_MB", 64.0)), help="largest payload frame in MiB (default 64)")
    lim.add_argument("--max-tokens", type=int, default=int(_env("MAX_TOKENS", 1 << 20)), help="most tokens in one key (default 1048576)")
    ops = p.add_argument_group("operations")
    ops.add_argument("--metrics-port", type=int, default=int(_env("METRICS_PORT", 0)) or None, help="serve Prometheus metrics on 127.0.0.1:PORT (default off)")
    ops.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"), choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default INFO")
    ops.add_argument(
        "--gpu", choices=["auto", "on", "off"], default=_env("GPU", "auto"),
        help="server-driven GPU transfers (runtime_zmq.gpu_transfer): auto = when an NVIDIA device is present (default auto)",
    )
    ops.add_argument("--shm-dir", default=_env("SHM_DIR", "/dev/shm"), help=argparse.SUPPRESS)
    ops.add_argument("--shutdown-grace", type=float, default=float(_env("SHUTDOWN_GRACE", 5.0)), help="seconds to finish in-flight work on SIGTERM (default 5)")
    return p


def config_from_args(args: argparse.Namespace) -> Any:
    from runtime_zmq.server import ServerConfig

    if args.ipc:
        url = "ipc://" + os.path.abspath(args.ipc)
    else:
        url = f"tcp://{args.host}:{args.port}"
    l2 = args.l2
    if l2 is None:
        from runtime_zmq.l2 import split_l2_urls

        l2 = split_l2_urls(os.environ.get("MPCACHE_L2", ""))
    return ServerConfig(
        url=url,
        chunk_size=args.chunk_size,
        l1_size_bytes=int(args.l1_size_gb * GiB),
        slot_bytes=int(args.slot_mb * MiB),
        l2_urls=tuple(l2),
        lease_ttl=args.lease_ttl,
        job_ttl=args.job_ttl,
        tombstone_ttl=args.tombstone_ttl,
        l2_read_timeout=args.l2_read_timeout,
        l2_probe=args.l2_probe,
        limits=wire.Limits(max_frame_bytes=int(args.max_frame_mb * MiB), max_tokens=args.max_tokens),
        metrics_port=args.metrics_port,
        shutdown_grace=args.shutdown_grace,
        shm_dir=args.shm_dir,
        l2_options=l2_options_from_args(args),
    )


def add_l2_flags(group: Any) -> None:
    """The L2 worker's flags (integrity secret, outages, bounds); see runtime_zmq/l2_worker.py."""
    group.add_argument("--l2-secret-file", default=_env("L2_SECRET_FILE", None), metavar="PATH",
                       help="the key L2 objects are sealed with (made 0600 at first start; servers sharing "
                       "a Redis must share it; default PATH/.secret of the first disk tier, else "
                       "~/.local/state/mpcache/l2.secret)")
    group.add_argument("--l2-require", action=argparse.BooleanOptionalAction,
                       default=_env("L2_REQUIRE", "0") not in ("0", "false", "no"),
                       help="refuse to start when an L2 tier does not answer (default: start L1-only and reconnect with backoff)")
    group.add_argument("--l2-deadline", type=float, default=float(_env("L2_DEADLINE", 5.0)),
                       help="seconds an L2 effect may take (plus its bytes at 200 MB/s) before it is failed and its L1 slots freed (default 5)")
    group.add_argument("--l2-queue", type=int, default=int(_env("L2_QUEUE", 256)),
                       help="L2 effects waiting at most; when full, write-behind is dropped first (default 256)")


def l2_options_from_args(args: argparse.Namespace) -> Any:
    from runtime_zmq.l2_worker import L2Options

    return L2Options(secret_file=args.l2_secret_file, require=args.l2_require,
                     deadline_s=args.l2_deadline, queue_max=args.l2_queue)


def _nvidia_device_present() -> bool:
    # a file check, so CPU hosts never import numba/CUDA (start-up stays well under a second)
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


def make_gpu_executor(mode: str, chunk_size: int, log: logging.Logger) -> Any:
    """The GPU transfer engine, or None (server-driven instances are then refused)."""
    if mode == "off" or (mode == "auto" and not _nvidia_device_present()):
        return None
    try:
        from runtime_zmq.gpu_transfer import GpuTransferExecutor

        return GpuTransferExecutor(chunk_size)
    except Exception as e:
        if mode == "on":
            raise
        log.warning("GPU transfers disabled: %s", e)
        return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("mpcache.cli")
    from runtime_zmq.server import Server

    try:
        config = config_from_args(args)
        executor = make_gpu_executor(args.gpu, config.chunk_size, log)
        server = Server(config, transfer_executor=executor)
        if executor is not None:
            # CUDA context, kernel JIT, pinning L1: here, not inside the loop's first request
            try:
                executor.warm_up(server.pool)
            except Exception as e:
                if args.gpu == "on":
                    raise
                from runtime_zmq.transfer import NoDeviceExecutor

                log.warning("GPU transfers disabled (warm-up failed: %s)", e)
                executor.close()
                server.executor = NoDeviceExecutor()
    except Exception as e:
        log.error("cannot start: %s", e)
        return 1

    signals_seen = 0

    def on_signal(signum: int, _frame: Any) -> None:
        # First signal: graceful shutdown. Second: harmless (supervisors and `timeout` often send
        # two). Third: exit at once, in-flight work abandoned, the L1 segment's name removed.
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen == 1:
            log.info("signal %d: shutting down (up to %g s for in-flight work)", signum, config.shutdown_grace)
            server.stop()
        elif signals_seen == 2:
            log.warning("signal %d: already shutting down; a third signal exits at once", signum)
        else:
            log.warning("signal %d: exiting at once", signum)
            server.pool.unlink()
            os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def ready(url: str) -> None:
        # one machine-readable line for supervisors and tests
        print(f"mpcache-server ready {url}", flush=True)

    # Start-up objects (modules, config) never become garbage: move them out of the collector's
    # sight, and collect the young generation less often, so the loop's p99 does not carry full
    # collections over the whole heap. Done here, not in Server: the server may be embedded in a
    # process whose collector is not ours to tune.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 50)
    try:
        server.serve_forever(ready)
    finally:
        # Shut down: a late signal must not kill the exiting process (the interpreter restores
        # the default action of a signal with a Python handler when it finalizes, not of one
        # ignored).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
