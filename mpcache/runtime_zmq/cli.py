"""``mpcache-server``: run the mpcache KV-cache offload server.

Every option is a flag, an environment variable ``MPCACHE_<FLAG>`` (e.g. ``MPCACHE_PORT``) and a
key of the TOML file named by ``--config``; flag > environment > file > default (see
``mpcache.runtime_zmq.config`` and docs/configuration.md, generated from the definitions below). Every
value is range-checked before anything starts; a bad one is one ``cannot start:`` line.

Defaults: loopback only (``tcp://127.0.0.1:5555``), L1 only, L1 memory reserved at start, no
CURVE, ``clear`` refused (no admin token; docs/security.md), metrics, health and status over HTTP
on ``127.0.0.1:9555``.

Adding an option: put it in one of the groups below (``config.group(parser, TITLE)``) with a
validating ``type`` from ``mpcache.runtime_zmq.config``; its env var, file key and docs follow.
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

from mpcache.runtime_zmq import config as cfg
from mpcache.runtime_zmq import wire

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_METRICS_PORT = 9555

# argument groups, in --help order; other modules add their options to these by title
LISTEN = "listening address"
CACHE = "cache"
L2 = "L2 tiers"
LIMITS = "limits"
KV_EVENTS = "KV events (for KV-aware routers)"
TRACE = "trace capture"
SECURITY = "security (docs/security.md)"
HTTP = "metrics, health and status (HTTP)"
LOGGING = "logging"
OPERATIONS = "operations"


def _env(name: str, default: Any) -> Any:
    """Kept for options that read their environment variable themselves; ``config.parse`` now
    reads ``MPCACHE_<DEST>`` for every option."""
    return os.environ.get(f"MPCACHE_{name}", default)


def build_parser() -> argparse.ArgumentParser:
    p = cfg.OptionParser(
        prog="mpcache-server",
        description="mpcache KV-cache offload server (LMCache MP-protocol compatible control plane).",
        epilog="Each flag can also be set by the environment variable MPCACHE_<FLAG> "
        "(upper case, dashes as underscores, e.g. MPCACHE_PORT=5556) or as a key of the TOML file "
        "given by --config; flag > environment > file. Reference: docs/configuration.md.\n\n"
        "L2 URLs (--l2, repeatable; tiers are searched in the order given):\n\n"
        + "\n".join(line.replace("`", "") for line in cfg.l2_grammar()),
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {cfg.version()}")
    p.add_argument("--config", metavar="FILE", default=None, help="TOML file with option values (keys named like the flags); env MPCACHE_CONFIG")
    where = cfg.group(p, LISTEN)
    where.add_argument("--host", type=cfg.host, default="127.0.0.1", help="TCP bind address (loopback only by default)")
    where.add_argument("--port", type=cfg.port, default=5555, help="TCP port; 0 picks a free one")
    where.add_argument("--ipc", default=None, metavar="PATH", help="listen on a unix socket at PATH instead of TCP (its directory is created 0700)")
    cache = cfg.group(p, CACHE)
    cache.add_argument("--chunk-size", type=cfg.chunk_size, default=256, help="tokens per chunk; a multiple of vLLM's block size")
    cache.add_argument("--l1-size-gb", type=cfg.positive_float, default=4.0, help="L1 shared-memory size in GiB (reserved at start unless --no-l1-reserve); more than /dev/shm's free space, the host's MemAvailable or the memory cgroup's limit (less a margin) refuses to start")
    cache.add_argument("--l1-clamp", action=argparse.BooleanOptionalAction, default=False,
                       help="an --l1-size-gb larger than the host can give is clamped to what it can, with a warning, instead of refused")
    cache.add_argument(
        "--l1-reserve", action=argparse.BooleanOptionalAction, default=True,
        help="reserve L1's memory at start: a clear error if /dev/shm has no room, never a later SIGBUS; "
        "--no-l1-reserve commits it page by page on first use (a fast start for a huge L1)",
    )
    cache.add_argument("--slot-mb", type=cfg.positive_float, default=None, help="L1 slot size in MiB, fixed: the largest object (one chunk of one KV rank; see docs/troubleshooting.md for the formula). Unset: the slots follow the objects registered (the first registration sets their size)")
    cache.add_argument("--lease-ttl", type=cfg.positive_float, default=300.0, help="seconds a read/write lease lives without use")
    cache.add_argument("--job-ttl", type=cfg.positive_float, default=60.0, help="seconds a lookup nobody queries lives before its leases are reaped")
    cache.add_argument("--instance-ttl", type=cfg.non_negative_float, default=60.0, help="seconds a registered engine instance may go without a heartbeat before it is reaped (registration, plans, leases, GPU mappings released; 0: never). Reaping starts at an instance's first heartbeat")
    cache.add_argument("--tombstone-ttl", type=cfg.positive_float, default=60.0, help="seconds a delivered status is repeated for")
    cache.add_argument("--store-threshold", type=cfg.non_negative_int, default=0, help="store a chunk only once lookups asked for its prefix this many times (0 or 1: store everything; 2 keeps one-off prompts from evicting reused ones)")
    tiers = cfg.group(p, L2)
    l2_urls = tiers.add_argument(
        "--l2", action="append", default=None, metavar="URL",
        help="L2 tier, repeatable: disk:/ABSOLUTE/PATH, redis://HOST:PORT or redis+cluster://H:P,H:P "
        "(grammar below; env MPCACHE_L2 comma- or space-separated; put a Redis password in ?password_file=, never on the command line)",
    )
    setattr(l2_urls, "env_split", _split_l2_urls)  # a cluster URL has commas
    tiers.add_argument("--l2-read-timeout", type=cfg.positive_float, default=30.0, help="seconds before a lookup stops waiting for an L2 read and resolves with its L1 prefix")
    tiers.add_argument(
        "--l2-probe", action=argparse.BooleanOptionalAction, default=True,
        help="ask L2 which objects it holds before reading (reads only the contiguous prefix)",
    )
    add_l2_flags(tiers)
    lim = cfg.group(p, LIMITS)
    lim.add_argument("--max-frame-mb", type=cfg.positive_float, default=16.0, help="largest payload frame in MiB (zmq disconnects a peer sending one over twice this)")
    lim.add_argument("--max-message-mb", type=cfg.positive_float, default=32.0, help="largest request, all its frames, in MiB (counted as frames are read)")
    lim.add_argument("--max-tokens", type=cfg.positive_int, default=1 << 19,
                     help="most tokens in one key (each million costs the loop about 9 ms per lookup)")
    events = cfg.group(p, KV_EVENTS)
    events.add_argument("--kv-events", default=None, metavar="URL", help="publish what this server holds as vLLM KV events on a ZMQ PUB socket: a wildcard URL (tcp://*:5557) or bind:URL (bind:tcp://127.0.0.1:5557: loopback only) is bound, another (tcp://indexer:5557) connected to; default off (docs/fleet.md)")
    events.add_argument("--kv-events-replay", default=None, metavar="URL", help="serve replays of the last 10,000 KV-event batches on a ZMQ ROUTER bound at URL; default off")
    events.add_argument("--kv-events-tokens", action=argparse.BooleanOptionalAction, default=False, help="put token ids, the LoRA name and cache salts (tenant secrets) in BlockStored, as llm-d's indexer needs; default: chunk hashes only")
    events.add_argument("--kv-events-topic", default="", metavar="TOPIC", help="topic frame of every KV-event message, e.g. kv@POD_IP@MODEL for llm-d's indexer")
    trace = cfg.group(p, TRACE)
    trace.add_argument("--trace", default=None, metavar="FILE", help="record the core_sm event stream to FILE (JSON lines; replay it with mpcache-sim replay-trace FILE); default off")
    trace.add_argument("--trace-tokens", action=argparse.BooleanOptionalAction, default=False, help="keep token ids in the trace (default: chunk hashes only, no prompt text)")
    trace.add_argument("--trace-max-mb", type=cfg.positive_float, default=256.0, help="rotate the trace to FILE.1 past this size in MiB")
    sec = cfg.group(p, SECURITY)
    sec.add_argument("--curve-dir", default=None, metavar="DIR", help="TCP: require ZMQ CURVE with the keys `mpcache-server keygen DIR` made (default off)")
    sec.add_argument("--ipc-group", default=None, metavar="GROUP", help="--ipc: let GROUP connect too (directory 0750, socket 0660; default: this uid only)")
    sec.add_argument("--admin-token-file", default=None, metavar="PATH", help="clear needs the token in PATH (mode 600); default: clear is refused")
    sec.add_argument("--chunk-key-file", default=None, metavar="PATH", help="the secret chunk keys are hashed with (made 0600 at first start; servers sharing an L2 must share it); default: derived from the L2 secret, else random per start")
    http = cfg.group(p, HTTP)
    http.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True, help="serve /metrics, /healthz, /readyz and /status over HTTP")
    http.add_argument("--metrics-port", type=cfg.port, default=DEFAULT_METRICS_PORT, help="HTTP port for metrics and probes; 0 picks a free one")
    http.add_argument("--metrics-host", type=cfg.host, default="127.0.0.1", help="HTTP bind address; 0.0.0.0 lets Prometheus scrape a pod")
    logs = cfg.group(p, LOGGING)
    logs.add_argument("--log-level", type=cfg.log_level, default="INFO", help="DEBUG, INFO, WARNING or ERROR (any case)")
    logs.add_argument("--log-format", type=cfg.one_of("text", "json"), default="text", help="text, or json: one JSON object per line")
    logs.add_argument("--summary-interval", type=cfg.non_negative_float, default=30.0, help="seconds between summary lines while the server is busy; 0: none")
    ops = cfg.group(p, OPERATIONS)
    ops.add_argument(
        "--gpu", type=cfg.one_of("auto", "on", "off"), default="auto",
        help="server-driven GPU transfers (mpcache.runtime_zmq.gpu_transfer): auto = when an NVIDIA device is present",
    )
    ops.add_argument(
        "--gpu-copy-lanes", type=cfg.one_of("on", "off"), default="on",
        help="on: each engine's GPU copies are enqueued by its own lane thread, which holds no GIL; off: by the server loop",
    )
    ops.add_argument(
        "--gpu-completions", type=cfg.one_of("waiter", "lane"), default="waiter",
        help="who sees a GPU copy end: waiter = a Python thread per engine polls its events; lane = the engine's copy "
             "lane polls them with no GIL and the loop reports them (needs --gpu-copy-lanes on)",
    )
    ops.add_argument("--shm-dir", default="/dev/shm", help=argparse.SUPPRESS)
    ops.add_argument("--shutdown-grace", type=cfg.non_negative_float, default=5.0, help="seconds to finish in-flight work on SIGTERM")
    return p


def _split_l2_urls(text: str) -> list[str]:
    from mpcache.runtime_zmq.l2 import split_l2_urls

    return split_l2_urls(text)


def add_l2_flags(group: Any) -> None:
    """The L2 worker's flags (integrity secret, outages, bounds); see runtime_zmq/l2_worker.py."""
    group.add_argument("--l2-secret-file", default=None, metavar="PATH",
                       help="the key L2 objects are sealed with (made 0600 at first start; servers sharing "
                       "a Redis must share it; default PATH/.secret of the first disk tier, else "
                       "~/.local/state/mpcache/l2.secret)")
    group.add_argument("--l2-require", action=argparse.BooleanOptionalAction, default=False,
                       help="refuse to start when an L2 tier does not answer, and answer /readyz 503 while one "
                       "is down (default: start L1-only and reconnect with backoff)")
    group.add_argument("--l2-deadline", type=cfg.positive_float, default=5.0,
                       help="seconds an L2 effect may take (plus its bytes at 200 MB/s) before it is failed and its L1 slots freed")
    group.add_argument("--l2-queue", type=cfg.positive_int, default=256,
                       help="L2 effects waiting at most; when full, write-behind is dropped first")


def l2_options_from_args(args: argparse.Namespace) -> Any:
    from mpcache.runtime_zmq.l2_worker import L2Options

    return L2Options(secret_file=args.l2_secret_file, require=args.l2_require,
                     deadline_s=args.l2_deadline, queue_max=args.l2_queue)


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, dict[str, str]]:
    """Flags over environment over ``--config`` file, validated (exits 2 with one line)."""
    parser = build_parser()
    args, sources = cfg.parse(parser, argv)
    problem = check(args)
    if problem is not None:
        parser.exit(2, f"{parser.prog}: cannot start: {problem}\n")
    return args, sources


def check(args: argparse.Namespace) -> str | None:
    """Constraints between options (each option alone was checked by its type)."""
    slot = int(args.slot_mb * MiB) if args.slot_mb is not None else 0
    l1 = int(args.l1_size_gb * GiB)
    if slot > l1:
        return f"--slot-mb {args.slot_mb:g} is larger than --l1-size-gb {args.l1_size_gb:g}: L1 would hold no object"
    if args.store_threshold > 255:
        return f"--store-threshold {args.store_threshold} is above 255 (the admission sketch counts to 255)"
    if args.ipc is not None and not args.ipc.strip():
        return "--ipc needs a path"
    for url in args.l2 or ():
        if not url.strip():
            return "--l2 needs a URL (disk:PATH or redis://HOST:PORT)"
        path, query, rest = url.strip()[len("disk:"):].partition("?") if url.strip().startswith("disk:") else ("/", "", "")
        if path and not os.path.isabs(path):
            # the tier would land wherever the server happens to start (a unit's / or a pod's
            # workdir): say which directory was meant instead of guessing
            return (f"--l2 {url}: a relative disk path depends on the directory the server starts in; "
                    f"give an absolute one, e.g. disk:{os.path.abspath(os.path.expanduser(path))}{query}{rest}")
    return None


def config_from_args(args: argparse.Namespace) -> Any:
    from mpcache.runtime_zmq.server import ServerConfig

    if args.ipc:
        url = "ipc://" + os.path.abspath(args.ipc)
    else:
        url = f"tcp://{args.host}:{args.port}"
    return ServerConfig(
        url=url,
        chunk_size=args.chunk_size,
        l1_size_bytes=int(args.l1_size_gb * GiB),
        # unset: 32 MiB slots (at most L1) until the first registration cuts them to its objects
        slot_bytes=int(args.slot_mb * MiB) if args.slot_mb is not None else min(32 * MiB, max(1, int(args.l1_size_gb * GiB))),
        slots_follow_objects=args.slot_mb is None,
        l2_urls=tuple(args.l2 or ()),
        lease_ttl=args.lease_ttl,
        job_ttl=args.job_ttl,
        tombstone_ttl=args.tombstone_ttl,
        instance_ttl=args.instance_ttl or None,
        l2_read_timeout=args.l2_read_timeout,
        l2_probe=args.l2_probe,
        limits=wire.Limits(max_frame_bytes=int(args.max_frame_mb * MiB), max_tokens=args.max_tokens,
                           max_message_bytes=int(args.max_message_mb * MiB)),
        metrics_port=None,  # the CLI serves HTTP itself (runtime_zmq.http)
        shutdown_grace=args.shutdown_grace,
        shm_dir=args.shm_dir,
        l2_options=l2_options_from_args(args),
        store_threshold=args.store_threshold,
        trace=args.trace,
        trace_tokens=args.trace_tokens,
        trace_max_bytes=int(args.trace_max_mb * MiB),
        kv_events=args.kv_events,
        kv_events_replay=args.kv_events_replay,
        kv_events_topic=args.kv_events_topic,
        kv_events_tokens=args.kv_events_tokens,
        curve_dir=args.curve_dir,
        ipc_group=args.ipc_group,
        admin_token_file=args.admin_token_file,
        chunk_key_file=args.chunk_key_file,
        l1_reserve=args.l1_reserve,
        l1_clamp=args.l1_clamp,
    )


def _say(line: str) -> None:
    """A machine-readable line on stdout in one write: ``print`` writes the text and its newline
    separately, and a log record from another thread (stderr, often the same pipe) between the
    two would end the line with the record's words."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _nvidia_device_present() -> bool:
    # a file check, so CPU hosts never import numba/CUDA (start-up stays well under a second)
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


def make_gpu_executor(mode: str, chunk_size: int, log: logging.Logger, copy_lanes: bool = True,
                      lane_completions: bool = False) -> Any:
    """The GPU transfer engine, or None (server-driven instances are then refused)."""
    if mode == "off" or (mode == "auto" and not _nvidia_device_present()):
        return None
    try:
        from mpcache.runtime_zmq.gpu_transfer import GpuTransferExecutor

        return GpuTransferExecutor(chunk_size, copy_lanes=copy_lanes, lane_completions=lane_completions)
    except Exception as e:
        if mode == "on":
            raise
        log.warning("GPU transfers disabled: %s", e)
        return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["keygen"]:
        from mpcache.runtime_zmq.auth import keygen_main

        return keygen_main(argv[1:])
    args, sources = parse_args(argv)
    from mpcache.runtime_zmq import logs

    repeats = logs.setup(args.log_level, args.log_format)
    log = logging.getLogger("mpcache.cli")
    log.info("mpcache-server %s (python %s, pid %d)", cfg.version(), sys.version.split()[0], os.getpid())
    log.info("config: %s", cfg.effective_line(args, sources))
    from mpcache.runtime_zmq.server import Server

    http_server = None
    try:
        config = config_from_args(args)
        executor = make_gpu_executor(args.gpu, config.chunk_size, log, args.gpu_copy_lanes == "on",
                                     args.gpu_completions == "lane")
        server = Server(config, transfer_executor=executor)
        if executor is not None:
            # CUDA context, kernel JIT, pinning L1: here, not inside the loop's first request
            try:
                executor.warm_up(server.pool)
            except Exception as e:
                if args.gpu == "on":
                    raise
                from mpcache.runtime_zmq.transfer import NoDeviceExecutor

                log.warning("GPU transfers disabled (warm-up failed: %s)", e)
                executor.close()
                server.executor = NoDeviceExecutor()
        server.metrics.attach(server, cfg.effective(args, sources), repeats, args.summary_interval, args.l2_require)
        if args.metrics:
            from mpcache.runtime_zmq.http import OpsHttpServer

            http_server = OpsHttpServer(server, args.metrics_host, args.metrics_port)
            log.info("metrics and probes on %s (/metrics /healthz /readyz /status)", http_server.url)
            _say(f"mpcache-server http {http_server.url}")
    except Exception as e:
        log.error("cannot start: %s", e)
        if http_server is not None:
            http_server.close()
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
        _say(f"mpcache-server ready {url}")

    # Start-up objects (modules, config) never become garbage: move them out of the collector's
    # sight, and collect the young generation less often, so the loop's p99 does not carry full
    # collections over the whole heap. Done here, not in Server: the server may be embedded in a
    # process whose collector is not ours to tune.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 50)
    try:
        server.serve_forever(ready)
    except Exception as e:
        if e is not server.start_error:
            raise
        return 1  # logged as "cannot start: ..." (no room for L1, found after the socket was bound)
    finally:
        # Shut down: a late signal must not kill the exiting process (the interpreter restores
        # the default action of a signal with a Python handler when it finalizes, not of one
        # ignored).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if http_server is not None:
            http_server.close()
    if server.loaders_running:
        # a compiler thread still inside LLVM: exit without the interpreter's finalization, which
        # would tear that thread down under it (everything else is closed; logs are flushed)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
