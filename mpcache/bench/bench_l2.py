"""`mpcache-bench l2 [--mib N] [--repeat R] [--objects K] [--redis URL | --no-redis]`: L2 throughput.

Two tables. **Sealing**: per MAC algorithm (keyed BLAKE2b from the standard library, keyed BLAKE3
when the `blake3` package is installed), the best-of-R time to seal and to check one N-MiB object
(the default 32 MiB is the default L1 slot). Sealing copies the object once (header + payload);
checking is a MAC over the payload, no copy.

**Tiers**: GB/s per tier and operation for K objects of N MiB (default 16 x 32 MiB), best of R,
with the CPU seconds each GB cost this process (`client s/GB`) and the local redis-server
(`redis s/GB`, from /proc; `-` for `--redis URL`), and the throughput those two would allow if
they had the box's cores to themselves (`CPU bound GB/s` = cores / (client + redis s/GB)): on a
small or loaded box that column, not the measured GB/s, says what the code costs.

* `redis` (a local `redis-server` started on a free loopback port with no persistence and, unless
  `--redis-plain`, with transparent huge pages for its values -- see `REDIS_THP` -- or
  `--redis URL`): `write_many` / `write_parts` / `read_many` / `read_each` / `read_into` of the
  tier (batches of at most 64 MiB, from 4 threads; the L2 worker writes with `write_parts`, each
  value sent from where it lies, and reads with `read_into`, each value read where the caller
  puts it), and -- the way the tier did it first, for comparison -- one MGET / one SET pipeline
  on one connection through redis-py, per batch;
* `disk -> L1 slot`: the whole read path through the disk tier (a temporary directory; its files
  are in the page cache, so this is the tier's own cost, not the device's);
* `L1 slot -> redis` / `redis -> L1 slot`: the whole paths a store and a lookup wait for: the L2
  worker's ``WriteL2`` of the K objects (MAC over each slot, sent from the slot) and ``ReadL2``
  (each value read off its socket straight into its L1 slot, its MAC checked piece by piece).
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from mpcache.runtime_zmq.l2_seal import MacAlgorithm, Sealer

WORKER_THREADS = 4  # L2Worker's default
BATCH_BYTES = 64 << 20  # l2_worker.BATCH_BYTES: what one tier call moves at most


def _best(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


Row = tuple[str, str, float, float, "float | None"]  # tier, operation, GB/s, client s/GB, redis s/GB


def _measure(tier: str, op: str, fn: Callable[[], object], repeat: int, nbytes: int, server_pid: int | None) -> Row:
    """Best-of-``repeat`` GB/s of ``fn`` (moving ``nbytes``), with the CPU it cost this process
    and ``server_pid`` per GB over all the runs."""
    t0 = os.times()
    s0 = _proc_cpu_s(server_pid) if server_pid is not None else 0.0
    seconds = _best(fn, repeat)
    t1 = os.times()
    gb = repeat * nbytes / 1e9
    client = (t1.user + t1.system - t0.user - t0.system) / gb
    server = (_proc_cpu_s(server_pid) - s0) / gb if server_pid is not None else None
    return (tier, op, nbytes / seconds / 1e9, client, server)


def seal_table(size: int, mib: float, repeat: int) -> None:
    payload = os.urandom(size)
    key = b"{00112233445566778899aabbccddeeff}-0"
    print(f"| algorithm ({mib:g} MiB object) | seal ms | check ms | check GiB/s |")
    print("|---|---:|---:|---:|")
    for alg in MacAlgorithm:
        try:
            sealer = Sealer(os.urandom(32), alg)
        except ValueError as e:
            print(f"| {alg.name} | - | - | ({e}) |")
            continue
        blob = sealer.seal(key, payload)
        seal_s = _best(lambda: sealer.seal(key, payload), repeat)
        check_s = _best(lambda: sealer.open(key, blob), repeat)
        print(f"| {alg.name} keyed | {seal_s * 1e3:.1f} | {check_s * 1e3:.1f} | {size / check_s / (1 << 30):.2f} |")


# How to run a redis-server that holds an mpcache L2 of large objects (what this benchmark starts,
# and what the Redis tier's documentation, runtime_zmq/l2.py, advises): jemalloc backs its values
# with transparent huge pages (``thp:always``; ``MALLOC_CONF`` for a redis-server linked with the
# system's libjemalloc, as Debian's and Ubuntu's packages are, ``JE_MALLOC_CONF`` for one built
# with Redis's own copy), and Redis does not turn them off for itself (``--disable-thp no``; it
# does by default when the kernel's THP mode is ``always``, for the sake of fork latency under
# persistence, which a cache without ``save`` / AOF never forks for). Without them redis-server
# takes a page fault on every 4 KiB of each 32 MiB value it receives or sends (its reply and
# query buffers are fresh allocations): about half of its CPU per GB moved.
REDIS_THP_ENV = {"MALLOC_CONF": "thp:always", "JE_MALLOC_CONF": "thp:always"}
REDIS_THP_ARGS = ["--disable-thp", "no"]


class LocalRedis:
    """A ``redis-server`` this benchmark started: its URL and process id."""

    def __init__(self, url: str, pid: int | None) -> None:
        self.url = url
        self.pid = pid


@contextmanager
def local_redis(huge_pages: bool = True) -> Iterator[LocalRedis | None]:
    """A throwaway ``redis-server`` on a free loopback port (None: the binary is not installed),
    with what a cache needs and nothing else: no persistence (``--save ""``, no AOF) and, with
    ``huge_pages``, its values on transparent huge pages (``REDIS_THP_ENV``, ``REDIS_THP_ARGS``)."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="mpcache-bench-redis-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir, "--protected-mode", "yes"] + (REDIS_THP_ARGS if huge_pages else []),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **REDIS_THP_ENV} if huge_pages else None)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        yield LocalRedis(f"redis://127.0.0.1:{port}/0", proc.pid)
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def _batches(keys: Sequence[bytes], size: int) -> list[list[bytes]]:
    per = max(1, BATCH_BYTES // max(1, size))
    return [list(keys[i:i + per]) for i in range(0, len(keys), per)]


def _in_threads(batches: list[Any], call: Callable[[Any], object]) -> None:
    with ThreadPoolExecutor(WORKER_THREADS) as ex:
        for f in [ex.submit(call, b) for b in batches]:
            f.result()


def tier_rows(url: str, objects: int, size: int, repeat: int, server_pid: int | None = None) -> list[Row]:
    """Rows of the Redis tier's calls and of redis-py's plain MGET / pipeline."""
    import redis

    from mpcache.runtime_zmq.l2 import RedisTier, ValueStream

    payload = os.urandom(size)
    keys = [b"bench-%d" % i for i in range(objects)]
    batches = _batches(keys, size)
    total = objects * size
    tier = RedisTier(url)
    plain = redis.Redis.from_url(url)
    targets = threading.local()  # read_into: one reused target per thread, as a slot would be
    rows: list[Row] = []
    try:
        def old_write(batch: list[bytes]) -> None:
            pipe = plain.pipeline(transaction=False)
            for k in batch:
                pipe.set(b"mpcache:" + k, payload)
            pipe.execute()

        def old_read(batch: list[bytes]) -> None:
            values = plain.mget([b"mpcache:" + k for k in batch])
            assert all(v is not None and len(v) == size for v in values)

        def new_write(batch: list[bytes]) -> None:
            tier.write_many([(k, payload) for k in batch])

        def parts_write(batch: list[bytes]) -> None:
            tier.write_parts([(k, lambda: (payload,)) for k in batch])

        def new_read(batch: list[bytes]) -> None:
            values = tier.read_many(batch)
            assert all(v is not None and len(v) == size for v in values)

        def each_read(batch: list[bytes]) -> None:
            sizes: list[int] = []
            tier.read_each(batch, lambda i, v: sizes.append(-1 if v is None else len(v)))
            assert sizes == [size] * len(batch)

        def into_read(batch: list[bytes]) -> None:
            sizes: list[int] = []

            def on_value(i: int, stream: ValueStream | None) -> None:
                if stream is None:
                    sizes.append(-1)
                    return
                target = getattr(targets, "buf", None)
                if target is None:
                    target = targets.buf = bytearray(size)
                stream.read_exact(memoryview(target)[:stream.size])
                sizes.append(stream.size)

            tier.read_into(batch, on_value)
            assert sizes == [size] * len(batch)

        for name, call in (("write: SET pipeline, one connection (first)", old_write),
                           ("write: write_many (spread)", new_write),
                           ("write: write_parts (spread, sent where it lies)", parts_write),
                           ("read: MGET via redis-py (first)", old_read),
                           ("read: read_many (spread, recv_into)", new_read),
                           ("read: read_each (spread, reused buffers)", each_read),
                           ("read: read_into (spread, into the caller's buffer)", into_read)):
            rows.append(_measure("redis", name, lambda: _in_threads(batches, call), repeat, total, server_pid))
    finally:
        tier.close()
        plain.close()
    return rows


def worker_rows(url: str, objects: int, size: int, repeat: int, server_pid: int | None = None) -> list[Row]:
    """The L2 worker's WriteL2 and ReadL2 of ``objects`` sealed objects between L1 slots and
    Redis (``url``; a ``disk:PATH`` URL: the disk tier, its read only)."""
    from mpcache.core_sm.chunks import ObjectKey
    from mpcache.core_sm.effects import ReadL2, WriteL2
    from mpcache.core_sm.messages import L2ReadFinished, L2WriteFinished
    from mpcache.runtime_zmq.l1_pool import SharedMemoryPool
    from mpcache.runtime_zmq.l2 import RedisTier, open_tier
    from mpcache.runtime_zmq.l2_worker import L2Worker

    try:
        pool = SharedMemoryPool(objects * size, size)
    except Exception as e:  # no room in /dev/shm: say so, keep the other rows
        print(f"(no L1 pool for the worker rows: {e})")
        return []
    if pool.num_slots < objects:
        pool.close()
        return []
    done: dict[int, object] = {}
    cond = threading.Condition()

    def post(event: object) -> None:
        with cond:
            ident = event.read_id if isinstance(event, L2ReadFinished) else getattr(event, "write_id", -1)
            done[ident] = event
            cond.notify_all()

    def wait(ident: int) -> object:
        with cond:
            cond.wait_for(lambda: ident in done, timeout=120)
            return done.pop(ident)

    disk = url.startswith("disk:")
    tier = open_tier(url) if disk else RedisTier(url)
    worker = L2Worker([tier], pool, post, sealer=Sealer(os.urandom(32)))
    rows: list[Row] = []
    try:
        keys = [ObjectKey(i.to_bytes(16, "little"), 0) for i in range(objects)]
        payload = os.urandom(size)
        for slot in range(objects):
            pool.write(slot, payload)
        ident = [100]

        def write() -> None:
            ident[0] += 1
            worker.write(WriteL2(ident[0], tuple(zip(keys, range(objects))), size))
            written = wait(ident[0])
            assert isinstance(written, L2WriteFinished) and written.ok, written

        def read() -> None:
            ident[0] += 1
            # one ReadL2 per chunk of a lookup's prefix (a lookup reads its missing objects in one)
            worker.read(ReadL2(ident[0], tuple(zip(keys, range(objects))), size))
            got = wait(ident[0])
            assert isinstance(got, L2ReadFinished) and all(got.loaded), got

        if disk:
            write()
            rows.append(_measure("disk -> L1 slot", "ReadL2 (file read into a reused buffer + MAC check + copy "
                                 "into the slot; page cache warm)", read, repeat, objects * size, None))
        else:
            rows.append(_measure("L1 slot -> redis", "WriteL2 (MAC over the slot + SET sent from the slot)",
                                 write, repeat, objects * size, server_pid))
            rows.append(_measure("redis -> L1 slot", "ReadL2 (GET read into the slot + MAC check piece by piece)",
                                 read, repeat, objects * size, server_pid))
        return rows
    finally:
        worker.close()
        pool.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mpcache-bench l2", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=32.0, help="object size in MiB (default 32)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; the best is shown (default 3)")
    ap.add_argument("--objects", type=int, default=16, help="objects per tier measurement (default 16)")
    ap.add_argument("--redis", default=None, metavar="URL", help="an existing Redis/Valkey (its data under mpcache:bench-*)")
    ap.add_argument("--no-redis", action="store_true", help="the sealing table and the disk rows only")
    ap.add_argument("--redis-plain", action="store_true",
                    help="start the local redis-server without transparent huge pages (see REDIS_THP_ENV)")
    args = ap.parse_args(argv)
    size = int(args.mib * (1 << 20))
    load = os.getloadavg()
    print(f"# mpcache-bench l2: load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs")
    seal_table(size, args.mib, args.repeat)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="mpcache-bench-l2-") as d:
        rows += worker_rows(f"disk:{d}/tier", args.objects, size, args.repeat)
    if args.no_redis:
        _print_rows(rows, args.objects, args.mib)
        return 0
    with (local_redis(not args.redis_plain) if args.redis is None else _given(args.redis)) as server:
        if server is None:
            print("(no redis-server on PATH and no --redis URL: tier rows skipped)")
            _print_rows(rows, args.objects, args.mib)
            return 0
        print("# redis: " + (args.redis and "given URL" or ("local redis-server, " + ("plain" if args.redis_plain else "values on transparent huge pages"))))
        rows = tier_rows(server.url, args.objects, size, args.repeat, server.pid) + rows
        rows += worker_rows(server.url, args.objects, size, args.repeat, server.pid)
    _print_rows(rows, args.objects, args.mib)
    return 0


def _print_rows(rows: list[Row], objects: int, mib: float) -> None:
    cores = os.cpu_count() or 1
    print()
    print(f"| tier | operation ({objects} x {mib:g} MiB) | GB/s | client s/GB | redis s/GB | CPU bound GB/s ({cores} cores) |")
    print("|---|---|---:|---:|---:|---:|")
    for tier, op, gbps, client, server in rows:
        cost = client + (server or 0.0)
        bound = f"{cores / cost:.2f}" if cost > 0 else "-"
        print(f"| {tier} | {op} | {gbps:.2f} | {client:.3f} | {'-' if server is None else f'{server:.3f}'} | {bound} |")


@contextmanager
def _given(url: str) -> Iterator[LocalRedis | None]:
    yield LocalRedis(url, None)
