"""``mpcache-cli``: talk to a running mpcache-server (like ``redis-cli``).

    mpcache-cli [--url URL] ping                 round trip time of a ping
    mpcache-cli health                           the server's health answer (epoch, status, ...)
    mpcache-cli stats [--json]                   lookups, hit tokens, L1 use, errors
    mpcache-cli clear [--force]                  drop every unleased object (admin)
    mpcache-cli bench [--lookups N]              lookup + status round trips against this server

``--url`` (env ``MPCACHE_URL``) is the server's ZMQ address, default ``tcp://127.0.0.1:5555``;
``HOST:PORT`` gets ``tcp://`` as in the connector's ``mpcache.server_urls``. ``--timeout`` bounds
reaching the server and each answer.
Exit status: 0 on success, 1 when the server answered an error or is unhealthy, 2 on a usage
error, 3 when it could not be reached within ``--timeout``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import secrets
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from mpcache.runtime_zmq import config as cfg

UNREACHABLE = 3


def _subparsers(p: argparse.ArgumentParser) -> Any:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return a
    raise LookupError("no subcommands")


class _CliParser(cfg.OptionParser):
    failure = "error"


class _SubcommandParser(_CliParser):
    from_environment = False  # a subcommand's options are flags only


def zmq_address(text: str) -> str:
    """``--url``: the server's ZMQ address, normalized as the connector normalizes its
    ``mpcache.server_urls`` (``client.server_url``: ``HOST:PORT`` gets ``tcp://``)."""
    from mpcache.runtime_zmq.client import server_url

    text = str(text).strip()
    if re.match(r"(?i)https?://", text):
        raise argparse.ArgumentTypeError(
            "this is the ZMQ address (tcp://HOST:PORT, default tcp://127.0.0.1:5555), not the HTTP port "
            "of /metrics and /healthz")
    if not text or "," in text or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError("one address: tcp://HOST:PORT, HOST:PORT or ipc://PATH")
    return server_url(text)


def build_parser() -> argparse.ArgumentParser:
    p = _CliParser(
        prog="mpcache-cli",
        description="Operator commands against a running mpcache-server.",
        epilog="Exit status: 0 ok, 1 error answer or unhealthy, 2 usage, 3 unreachable.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {cfg.version()}")
    conn = cfg.group(p, "connection")
    conn.add_argument("--url", type=zmq_address, default="tcp://127.0.0.1:5555",
                      help="the server's ZMQ address (tcp://HOST:PORT, HOST:PORT or ipc://PATH), not its HTTP port")
    conn.add_argument("--timeout", type=cfg.positive_float, default=5.0,
                      help="seconds to wait for the server to answer at all, then for each answer")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_SubcommandParser)
    sub.required = True
    sub.add_parser("ping", help="round trip of a ping", description="Send ping and noop; print the round-trip times.")
    health = sub.add_parser("health", help="the server's health answer", description="Print the health answer (status, epoch, version, uptime, L2 tiers); exit 1 unless status is ok.")
    health.add_argument("--json", action="store_true", help="print the raw health answer as JSON")
    stats = sub.add_parser("stats", help="lookups, hit tokens, L1 use, errors", description="Print the server's counters: lookups, hit tokens, stores, L1 use, errors.")
    stats.add_argument("--json", action="store_true", help="print the raw stats answer as JSON")
    clear = sub.add_parser("clear", help="drop every unleased object (admin)", description="Ask the server to clear L1 (objects under a lease stay until released).")
    clear.add_argument("--force", action="store_true", help="also drop objects that are leased (their readers get misses)")
    clear.add_argument("--admin-token-file", metavar="PATH", default=None,
                       help="the server's admin token (its --admin-token-file); without it the server refuses clear")
    bench = sub.add_parser("bench", help="lookup + status round trips against this server", description="Lookups of random prompts (misses: nothing is stored) and their status queries, from one client; prints a table.")
    bench.add_argument("--url", type=zmq_address, default=argparse.SUPPRESS, help="the server's ZMQ address (as the global --url)")
    bench.add_argument("--lookups", type=cfg.positive_int, default=2000, help="how many lookup + status pairs")
    bench.add_argument("--chunks", type=cfg.positive_int, default=4, help="chunks per prompt")
    bench.add_argument("--in-flight", type=cfg.positive_int, default=16, help="lookups sent before waiting for answers")
    return p


def subcommands() -> dict[str, argparse.ArgumentParser]:
    return dict(_subparsers(build_parser()).choices)


def _client(args: argparse.Namespace) -> Any:
    from mpcache.runtime_zmq.client import MPCacheClient

    # not waiting in the constructor: main's wait_healthy is the one wait of --timeout
    return MPCacheClient(args.url, request_timeout=args.timeout, connect_timeout=args.timeout, wait_connected=False)


def _call(fut_or_value: Any, timeout: float) -> Any:
    return fut_or_value.result(timeout) if hasattr(fut_or_value, "result") else fut_or_value


_REPR = re.compile(r"<[A-Za-z_][A-Za-z0-9_]* (.*)>", re.S)
_BREAKER = {"closed": "up", "open": "down (circuit open)", "half_open": "probing"}


def human(value: Any) -> str:
    """A wire value as a person reads it: no Python reprs (``True``, ``'OK'``, ``<DiskTier ...>``)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, str):
        m = _REPR.fullmatch(value)
        return m.group(1) if m else value
    if isinstance(value, (list, tuple)):
        return ", ".join(human(v) for v in value) or "none"
    if isinstance(value, dict):
        return ", ".join(f"{k} {human(v)}" for k, v in value.items()) or "none"
    return str(value)


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f} s"
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    return (f"{d} d " if d else "") + f"{h}:{s // 60:02d}:{s % 60:02d}"


def _rows(rows: Sequence[tuple[str, Any]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def cmd_ping(c: Any, args: argparse.Namespace) -> int:
    for op in ("ping", "noop"):
        t0 = time.perf_counter()
        answer = c.call(op, timeout=args.timeout)
        ms = (time.perf_counter() - t0) * 1e3
        print(f"{op}: {'ok' if answer in (True, 'OK') else human(answer)} in {ms:.3f} ms")
    return 0


def cmd_health(c: Any, args: argparse.Namespace) -> int:
    h = c.health()
    ok = isinstance(h, dict) and h.get("status") == "ok"
    if args.json or not isinstance(h, dict):
        print(json.dumps(h, indent=1, default=str))
        return 0 if ok else 1
    h = dict(h)
    rows: list[tuple[str, Any]] = [("status", human(h.pop("status", None)))]
    for key, label in (("version", "version"), ("epoch", "epoch"), ("pid", "pid"), ("url", "url")):
        if key in h:
            rows.append((label, human(h.pop(key))))
    if "uptime_s" in h:
        rows.append(("uptime", _duration(float(h.pop("uptime_s")))))
    if "chunk_size" in h:
        rows.append(("chunk size", f"{h.pop('chunk_size')} tokens"))
    names = h.pop("l2", None)
    tiers = h.pop("l2_tiers", None)
    if isinstance(tiers, list) and all(isinstance(t, dict) for t in tiers):
        for t in tiers or [{}]:
            rows.append(("L2 tier", f"{human(t.get('tier'))}: {_BREAKER.get(str(t.get('state')), human(t.get('state')))}"
                         if t else "none"))
    elif names is not None:
        rows.append(("L2 tiers", human(names)))
    rows += [(k.replace("_", " "), human(v)) for k, v in h.items()]
    _rows(rows)
    return 0 if ok else 1


def cmd_stats(c: Any, args: argparse.Namespace) -> int:
    s = dict(c.stats())
    if args.json:
        print(json.dumps(s, indent=1, sort_keys=True, default=str))
        return 0
    chunk = int(c.get_chunk_size())
    asked, hit = s.get("lookup_chunks", 0) * chunk, s.get("hit_chunks", 0) * chunk
    slots, free, slot = s.get("l1_num_slots", 0), s.get("free_slots", 0), s.get("l1_slot_bytes", 0)
    rows = [
        ("lookups", s.get("lookups", 0)),
        ("hit tokens", f"{hit} of {asked} ({100.0 * hit / asked:.1f}%)" if asked else "0 of 0"),
        ("status queries", s.get("status_queries", 0)),
        ("transfers started", s.get("transfers_started", 0)),
        ("L1 objects", s.get("objects", 0)),
        ("L1 used", f"{(slots - free) * slot / (1 << 30):.3f} of {slots * slot / (1 << 30):.3f} GiB ({slots - free}/{slots} slots of {_size(slot)})"),
        ("L1 evictions", s.get("evictions", 0)),
        ("leases held", s.get("leases_held", 0)),
        ("L2 reads / hits / writes / errors", f"{s.get('l2_reads', 0)} / {s.get('l2_read_hits', 0)} / {s.get('l2_writes', 0)} / {s.get('l2_errors', 0)}"),
        ("registered instances", s.get("instances", 0)),
        ("error replies", s.get("wire_errors", 0)),
    ]
    _rows(rows)
    return 0


def cmd_clear(c: Any, args: argparse.Namespace) -> int:
    token = None
    if args.admin_token_file:
        from mpcache.runtime_zmq.auth import read_admin_token

        token = read_admin_token(args.admin_token_file).decode("utf-8", "surrogateescape")
    answer = _call(c.clear(args.force, token), args.timeout)
    print(f"clear: {'done' if answer in (None, True) else human(answer)}")
    return 0


def cmd_bench(c: Any, args: argparse.Namespace) -> int:
    chunk = int(c.get_chunk_size())
    n, window = args.lookups, args.in_flight
    rng = random.Random(0)  # the same prompts every run
    # request ids of this run only: ids another connection used are that connection's (forbidden)
    run = f"bench-{secrets.token_hex(4)}"
    lat: list[float] = []
    t_start = time.perf_counter()
    for base in range(0, n, window):
        batch = []
        for i in range(base, min(n, base + window)):
            toks = [rng.randrange(50_000) for _ in range(chunk * args.chunks)]
            key = {"model_name": "mpcache-cli-bench", "world_size": 1, "worker_id": None, "token_ids": toks,
                   "start": 0, "end": len(toks), "request_id": f"{run}-{i}", "cache_salt": "",
                   "request_configs": None, "num_kv_readers": 0}
            batch.append((time.perf_counter(), key["request_id"], c.lookup(key)))
        for t0, rid, fut in batch:
            fut.result(args.timeout)
            status = c.wait_prefetch_status(rid, 1.0).result(args.timeout)
            if not isinstance(status, int):
                print(f"mpcache-cli bench: status of {rid} was {status!r}", file=sys.stderr)
                return 1
            lat.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t_start
    lat.sort()
    q = statistics.quantiles(lat, n=100) if len(lat) >= 2 else [lat[0]] * 99
    print(f"{'lookups':>8} {'tokens each':>11} {'in flight':>9} {'pairs/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    print(f"{n:>8} {chunk * args.chunks:>11} {window:>9} {n / wall:>9.0f} {q[49] * 1e3:>8.3f} {q[98] * 1e3:>8.3f}")
    return 0


COMMANDS = {"ping": cmd_ping, "health": cmd_health, "stats": cmd_stats, "clear": cmd_clear, "bench": cmd_bench}


def main(argv: Sequence[str] | None = None) -> int:
    args, _sources = cfg.parse(build_parser(), argv)
    from mpcache.runtime_zmq.client import ClientClosed, RemoteError

    import zmq

    try:
        c = _client(args)
    except zmq.ZMQError as e:  # zmq refused the address itself (tcp://HOST without a port, ...)
        print(f"mpcache-cli: error: --url {args.url}: not an address zmq can connect to ({zmq.strerror(e.errno or 0) if e.errno else e}); "
              "use tcp://HOST:PORT or ipc://PATH", file=sys.stderr)
        return 2
    except Exception as e:
        print(f"mpcache-cli: cannot connect to {args.url}: {e}", file=sys.stderr)
        return UNREACHABLE
    try:
        if not c.wait_healthy(args.timeout):  # the one wait for the server: --timeout, not twice it
            print(f"mpcache-cli: no answer from {args.url} within {args.timeout:g} s", file=sys.stderr)
            return UNREACHABLE
        return COMMANDS[args.command](c, args)
    except RemoteError as e:
        print(f"mpcache-cli: {args.command}: the server answered {e}", file=sys.stderr)
        return 1
    except (TimeoutError, ClientClosed) as e:
        print(f"mpcache-cli: {args.command}: no answer from {args.url}: {e or 'timed out'}", file=sys.stderr)
        return UNREACHABLE
    finally:
        c.close()


def _size(nbytes: int) -> str:
    """A slot's size for people: MiB from 1 MiB up, else KiB (slots follow the objects registered,
    which may be a few KiB)."""
    return f"{nbytes / (1 << 20):g} MiB" if nbytes >= 1 << 20 else f"{nbytes / 1024:g} KiB"


if __name__ == "__main__":
    sys.exit(main())
