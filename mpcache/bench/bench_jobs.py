"""`mpcache-bench jobs`: what an abandoned lookup job costs the server, and that it is given back.

An abandoned lookup is one whose client never queries it or ends its session (the engine died,
the request was dropped): the server keeps its job until the job TTL, then reaps it. For each
prompt length (`--lengths`, default 1,024 and 8,192 tokens):

* **server process**: a real `mpcache-server` (L1 only, `--job-ttl`), warmed with a round of
  lookups that are answered and ended; then `--jobs` lookups (all misses, so no leases: the job
  alone) under fresh request ids that are never ended. RSS (`/proc/PID/status` VmRSS) before,
  once every lookup is acknowledged, after the reaper ran (`stats` says no job is left), after
  glibc's `malloc_trim(0)`, and with a second flood of abandoned lookups live (is the memory
  reused?). At each point the server also reports its allocators' state after a full
  collection (pymalloc arenas and free blocks, glibc's system and in-use bytes): "held per 10k"
  is what the allocators hand out for the jobs, whatever free space the heap had before;
* **core_sm alone**: the same lookups fed to `core_sm`'s `LookupServer` in this process,
  measured with `tracemalloc` (bytes per job, exact), then reaped by advancing its clock;
* `--breakdown`: one more server run per length under `tracemalloc`, and the source lines that
  hold the bytes with the jobs live and after the reaper.

Targets: an abandoned job costs <= 200 B beyond its leases (core_sm), the server's RSS grows
<= 2 MiB per 10k of them, and the memory comes back after the reaper.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import tracemalloc
from array import array
from typing import Any

import msgpack  # type: ignore[import-untyped]
import zmq

from mpcache.bench.bench_rpc import BenchError, rpc_call, dealer, start_server, env_with_repo, server_url, lookup_key

TARGET_BYTES_PER_JOB = 200
TARGET_RSS_MIB_PER_10K = 2.0


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise BenchError("no VmRSS")


# ---------------------------------------------------------------- the server's allocators

_SNAP_SIGNAL = signal.SIGUSR1
_TRIM_SIGNAL = signal.SIGUSR2  # the same probe after glibc's malloc_trim(0)


def _malloc_stats() -> str:
    """pymalloc's arena and pool counts (``sys._debugmallocstats``) and glibc's (``malloc_stats``),
    as the text they write to the C stderr."""
    sys.stderr.flush()
    fd, path = tempfile.mkstemp(prefix="mpcache-mallocstats-")
    saved = os.dup(2)
    try:
        os.dup2(fd, 2)
        sys._debugmallocstats()
        try:
            ctypes.CDLL(None).malloc_stats()
        except (OSError, AttributeError):
            pass  # not glibc
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)
    with open(path) as f:
        text = f.read()
    os.unlink(path)
    return text


def parse_malloc_stats(text: str) -> dict[str, int]:
    """The totals of ``_malloc_stats``' text: pymalloc arenas (current, 1 MiB each), bytes in its
    allocated and free blocks and unused pools; glibc's system and in-use bytes (all arenas and
    mmap)."""
    out: dict[str, int] = {}
    patterns = {
        "arenas": r"# arenas allocated current\s*=\s*([\d,]+)",
        "arenas_reclaimed": r"# arenas reclaimed\s*=\s*([\d,]+)",
        "allocated": r"# bytes in allocated blocks\s*=\s*([\d,]+)",
        "available": r"# bytes in available blocks\s*=\s*([\d,]+)",
        "unused_pools": r"unused pools \* \d+ bytes\s*=\s*([\d,]+)",
    }
    for name, pat in patterns.items():
        found = re.search(pat, text)
        out[name] = int(found.group(1).replace(",", "")) if found else 0
    total = text.split("Total (incl. mmap):")[-1] if "Total (incl. mmap):" in text else ""
    for name, pat in (("glibc_system", r"system bytes\s*=\s*(\d+)"), ("glibc_in_use", r"in use bytes\s*=\s*(\d+)")):
        found = re.search(pat, total)
        out[name] = int(found.group(1)) if found else 0
    return out


def traced_server_main(argv: list[str] | None = None) -> int:
    """Run ``mpcache-server`` with a probe: ``SIGUSR1`` writes ``DIR/malloc-N.txt`` (the
    allocators' state after a full collection) and, with ``--tracemalloc``, ``DIR/snap-N``
    (a ``tracemalloc`` snapshot), then ``DIR/done-N``; ``SIGUSR2`` does the same after glibc's
    ``malloc_trim(0)`` (what glibc holds free goes back). Arguments: ``DIR [--tracemalloc] --
    SERVER-ARGS``."""
    args = list(sys.argv[1:] if argv is None else argv)
    outdir = args.pop(0)
    traced = args[:1] == ["--tracemalloc"]
    if traced:
        args.pop(0)
        tracemalloc.start(1)
    if args[:1] == ["--"]:
        args.pop(0)
    probes = [0]

    def probe(signum: int, _frame: Any) -> None:
        gc.collect()
        if signum == _TRIM_SIGNAL:
            try:
                ctypes.CDLL(None).malloc_trim(0)
            except (OSError, AttributeError):
                pass  # not glibc
        probes[0] += 1
        n = probes[0]
        if traced:
            tracemalloc.take_snapshot().dump(os.path.join(outdir, f"snap-{n}"))
        with open(os.path.join(outdir, f"malloc-{n}.txt"), "w") as f:
            f.write(_malloc_stats())
        open(os.path.join(outdir, f"done-{n}"), "w").close()

    signal.signal(_SNAP_SIGNAL, probe)
    signal.signal(_TRIM_SIGNAL, probe)
    from mpcache.runtime_zmq.cli import main as server_main

    return server_main(args)


class _Probe:
    """The bench's side of ``traced_server_main``: ``take()`` signals and waits for the files."""

    def __init__(self, pid: int, outdir: str) -> None:
        self.pid, self.outdir, self.n = pid, outdir, 0

    def take(self, trim: bool = False) -> tuple[dict[str, int], str | None]:
        self.n += 1
        os.kill(self.pid, _TRIM_SIGNAL if trim else _SNAP_SIGNAL)
        done = os.path.join(self.outdir, f"done-{self.n}")
        deadline = time.monotonic() + 120.0
        while not os.path.exists(done):
            if time.monotonic() > deadline:
                raise BenchError("the server's memory probe did not answer within 120 s")
            time.sleep(0.05)
        with open(os.path.join(self.outdir, f"malloc-{self.n}.txt")) as f:
            stats = parse_malloc_stats(f.read())
        snap = os.path.join(self.outdir, f"snap-{self.n}")
        return stats, snap if os.path.exists(snap) else None


def prompt_tokens(n: int, seed: int) -> list[int]:
    return [(i * 2654435761 + seed * 7919) % 128_000 for i in range(n)]


def _flood(sock: zmq.Socket[Any], n: int, num_tokens: int, tag: str, end: bool, window: int = 64) -> None:
    """``n`` lookups of distinct prompts under fresh ids, ``window`` in flight; if ``end``, each
    is answered (``query_prefetch_status``) and ended (``end_session``) as a client does."""
    lookup_op, status_op = msgpack.packb("lookup"), msgpack.packb("query_prefetch_status")
    end_op, one = msgpack.packb("end_session"), msgpack.packb(1)
    sent = done = ends = 0
    inflight = 0
    while done < n or ends < (2 * n if end else 0):
        while inflight < window and sent < n:
            rid = f"{tag}-{sent}"
            key = msgpack.packb(lookup_key(prompt_tokens(num_tokens, sent), rid, packed=True), use_bin_type=True)
            sock.send_multipart([msgpack.packb(sent), lookup_op, key, one])
            if end:
                sock.send_multipart([msgpack.packb(-1), status_op, msgpack.packb(rid)])
                sock.send_multipart([msgpack.packb(-1), end_op, msgpack.packb(rid)])
            sent += 1
            inflight += 1
        if not sock.poll(10_000):
            raise BenchError("no reply within 10 s")
        reply = sock.recv_multipart()
        if reply[1] == end_op or reply[1] == status_op:
            ends += 1
            continue
        if reply[1] != lookup_op:
            raise BenchError(f"lookup failed: {reply!r}")
        inflight -= 1
        done += 1


class ServerRow:
    """One server run: RSS and the allocators' state before the flood, with the jobs live and
    after the reaper, and (traced) the tracemalloc snapshots' paths."""

    def __init__(self) -> None:
        self.rss: list[int] = []
        self.malloc: list[dict[str, int]] = []
        self.snaps: list[str | None] = []
        self.left = -1
        self.workdir = ""

    def sample(self, pid: int, probe: _Probe, trim: bool = False) -> None:
        stats, snap = probe.take(trim)
        self.rss.append(_rss_bytes(pid))  # after the probe's collection
        self.malloc.append(stats)
        self.snaps.append(snap)


def server_row(num_tokens: int, jobs: int, job_ttl: float, traced: bool = False) -> ServerRow:
    """A real server: warmed up, then ``jobs`` abandoned lookups, then the reaper. The caller
    removes ``row.workdir`` (it holds the snapshots)."""
    row = ServerRow()
    workdir = row.workdir = tempfile.mkdtemp(prefix="mpcache-bench-jobs-")
    url = server_url("tcp", workdir, "jobs")
    port = url.rsplit(":", 1)[1]
    argv = [sys.executable, "-c", "import sys; from mpcache.bench.bench_jobs import traced_server_main; "
            "sys.exit(traced_server_main())", workdir] + (["--tracemalloc"] if traced else []) + [
            "--", "--l1-size-gb", "0.25", "--slot-mb", "1",
            "--log-level", "WARNING", "--no-metrics", "--host", "127.0.0.1", "--port", port,
            "--job-ttl", str(job_ttl), "--tombstone-ttl", "1"]
    server = start_server("mpcache", "tcp", argv, url, workdir, env=env_with_repo())
    probe = _Probe(server.proc.pid, workdir)
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = dealer(ctx, url)
    try:
        # the list-form scanner compiles (or loads) on a thread after start: let it finish first,
        # its allocations are not the jobs'
        ready_by = time.monotonic() + 180.0
        while not rpc_call(sock, 0, "stats").get("token_scanner_ready", True):
            if time.monotonic() > ready_by:
                raise BenchError("the token scanner was not ready within 180 s")
            time.sleep(0.2)
        # warm-up: the allocator's pools, every code path once
        _flood(sock, jobs, num_tokens, "warm", end=True)
        time.sleep(1.5)
        rpc_call(sock, 1, "noop")
        row.sample(server.proc.pid, probe)
        _flood(sock, jobs, num_tokens, "abandoned", end=False)
        row.sample(server.proc.pid, probe)
        held = int(rpc_call(sock, 2, "stats")["jobs"])
        if held < jobs:
            raise BenchError(f"only {held} of {jobs} jobs still live when measured: raise --job-ttl")
        deadline = time.monotonic() + job_ttl + 30
        while time.monotonic() < deadline:
            time.sleep(0.5)
            stats = rpc_call(sock, 3, "stats")
            row.left = int(stats["jobs"])
            if row.left == 0:
                break
        # the hit-token metric forgets a lookup within 1.125 job TTLs (runtime_zmq.metrics)
        time.sleep(1.0 + 0.15 * job_ttl)
        rpc_call(sock, 4, "noop")
        row.sample(server.proc.pid, probe)
        row.sample(server.proc.pid, probe, trim=True)
        # a second flood after the reaper: the memory held free is reused, not added to
        _flood(sock, jobs, num_tokens, "again", end=False)
        row.sample(server.proc.pid, probe)
        return row
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    finally:
        sock.close()
        server.stop()


def _in_use(st: dict[str, int]) -> int:
    """Bytes the allocators hand out: pymalloc's allocated blocks and glibc's in-use bytes (the
    jobs' own bytes, whatever free space the heap held before)."""
    return st["allocated"] + st["glibc_in_use"]


POINTS = ("before", "jobs live", "after reaper", "after malloc_trim", "2nd flood live")


def breakdown(row: ServerRow, jobs: int, top: int = 14) -> list[str]:
    """Where the bytes of a traced run are: its RSS at each point, then the
    tracemalloc lines that grew from before the flood to with the jobs live, and to after the
    reaper (bytes per job)."""
    # under tracemalloc pymalloc reports no arenas (the hooks wrap it) and RSS includes the traces:
    # only the RSS trend is shown; the allocators' table is the untraced run's
    lines = ["| point | RSS MiB (traced) |", "|---|---:|"]
    for name, rss in zip(POINTS, row.rss):
        lines.append(f"| {name} | {rss / 2**20:.1f} |")
    if None in row.snaps:
        return lines
    snaps = [tracemalloc.Snapshot.load(p) for p in row.snaps[:3] if p is not None]
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__)]
    snaps = [s.filter_traces(ignore) for s in snaps]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
    for title, later in (("jobs live - before", snaps[1]), ("after reaper - before", snaps[2])):
        diff = later.compare_to(snaps[0], "lineno")
        total = sum(d.size_diff for d in diff)
        lines.append("")
        lines.append(f"tracemalloc, {title}: {total / jobs:+,.0f} B per job in all")
        lines.append("| B/job | blocks/job | line |")
        lines.append("|---:|---:|---|")
        for d in sorted(diff, key=lambda d: -abs(d.size_diff))[:top]:
            frame = d.traceback[0]
            where = frame.filename.replace(repo, "")
            if "site-packages" in where:
                where = where.split("site-packages" + os.sep)[-1]
            lines.append(f"| {d.size_diff / jobs:+,.1f} | {d.count_diff / jobs:+.2f} | {where}:{frame.lineno} |")
    return lines


def core_sm_row(num_tokens: int, jobs: int) -> tuple[float, float]:
    """(bytes per abandoned job while live, bytes per job left after the reaper) in core_sm."""
    from mpcache.core_sm import messages as m
    from mpcache.core_sm.server import LookupServer, ServerConfig

    sm = LookupServer(ServerConfig(chunk_size=256, num_slots=64, slot_bytes=1 << 20))
    now = 0.0
    # The events are built while tracing and dropped once handled: what is still allocated then
    # is what the server kept (the request id strings included; the tokens are not kept).
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(jobs):
        packed = array("I", prompt_tokens(num_tokens, i)).tobytes()
        key = m.CacheKey("bench/model", 1, None, packed, 0, num_tokens, f"abandoned-{i:08d}")
        sm.handle(m.Lookup(key, 1, reply_to=("bench", i)), now)
    del key, packed
    gc.collect()
    live = tracemalloc.get_traced_memory()[0]
    sm.handle(m.TimerFired(), now + 10_000.0)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (live - base) / jobs, (after - base) / jobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpcache-bench jobs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,8192", help="prompt lengths in tokens")
    parser.add_argument("--jobs", type=int, default=10_000, help="abandoned lookups per length")
    parser.add_argument("--job-ttl", type=float, default=40.0, help="the server's --job-ttl, s")
    parser.add_argument("--no-server", action="store_true", help="core_sm rows only")
    parser.add_argument("--breakdown", action="store_true",
                        help="then one more server run per length under tracemalloc: where the bytes are")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    load = os.getloadavg()
    print(f"# mpcache-bench jobs: {args.jobs} abandoned lookups (misses: no leases) per length; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("| tokens | core_sm B/job live | core_sm B/job after reap | server RSS before MiB | "
          "with jobs MiB | growth per 10k MiB | B/job | held per 10k MiB (allocators) | after reaper MiB | "
          "kept per 10k MiB | after malloc_trim MiB | 2nd flood live MiB | jobs left |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rc = 0
    rows: dict[int, ServerRow] = {}
    for n in lengths:
        live_b, after_b = core_sm_row(n, args.jobs)
        cells = [f"{n:,}", f"{live_b:,.0f}", f"{after_b:,.0f}"]
        if live_b > TARGET_BYTES_PER_JOB:
            rc = 1
        if not args.no_server:
            row = rows[n] = server_row(n, args.jobs, args.job_ttl)
            shutil.rmtree(row.workdir, ignore_errors=True)
            before, live, after, trimmed, again = row.rss
            growth = live - before
            per10k = 10_000 / args.jobs / 2**20
            held = _in_use(row.malloc[1]) - _in_use(row.malloc[0])
            cells += [f"{before / 2**20:.1f}", f"{live / 2**20:.1f}", f"{growth * per10k:.2f}",
                      f"{growth / args.jobs:,.0f}", f"{held * per10k:.2f}", f"{after / 2**20:.1f}", f"{(after - before) * per10k:.2f}",
                      f"{trimmed / 2**20:.1f}", f"{again / 2**20:.1f}", str(row.left)]
            if growth * per10k > TARGET_RSS_MIB_PER_10K:
                rc = 1
        else:
            cells += ["-"] * 10
        print("| " + " | ".join(cells) + " |", flush=True)
    print(f"target: <= {TARGET_BYTES_PER_JOB} B per abandoned job beyond its leases (core_sm column)"
          + ("" if args.no_server else f", server RSS <= {TARGET_RSS_MIB_PER_10K} MiB per 10k")
          + f" -> {'met' if rc == 0 else 'MISSED'}")
    if not args.no_server:
        print("allocators, same runs (after a full collection):")
        print("| tokens | point | pymalloc arenas | allocated blocks MiB | free blocks MiB | unused pools MiB | "
              "glibc system MiB | glibc in use MiB |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|")
        for n, row in rows.items():
            for name, st in zip(POINTS, row.malloc):
                print(f"| {n:,} | {name} | {st['arenas']} | {st['allocated'] / 2**20:.2f} | {st['available'] / 2**20:.2f} | "
                      f"{st['unused_pools'] / 2**20:.2f} | {st['glibc_system'] / 2**20:.1f} | {st['glibc_in_use'] / 2**20:.1f} |")
    if args.breakdown:
        for n in lengths:
            row = server_row(n, args.jobs, args.job_ttl, traced=True)
            try:
                print(f"\n## breakdown, {n:,} tokens (a separate run under tracemalloc: its RSS includes the traces)")
                print("\n".join(breakdown(row, args.jobs)), flush=True)
            finally:
                shutil.rmtree(row.workdir, ignore_errors=True)
    return rc
