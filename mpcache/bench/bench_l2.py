"""`mpcache-bench l2 [--mib N] [--repeat R] [--objects K] [--redis URL | --no-redis]`: L2 throughput.

Two tables. **Sealing**: per MAC algorithm (keyed BLAKE2b from the standard library, keyed BLAKE3
when the `blake3` package is installed), the best-of-R time to seal and to check one N-MiB object
(the default 32 MiB is the default L1 slot). Sealing copies the object once (header + payload);
checking is a MAC over the payload, no copy.

**Tiers**: GB/s per tier and operation for K objects of N MiB (default 16 x 32 MiB), best of R:

* `redis` (a local `redis-server` started on a free loopback port with no persistence, or
  `--redis URL`): `write_many` / `read_many` / `read_each` of the tier (batches of at most 64
  MiB, from 4 threads; the L2 worker reads with `read_each`, each value handed over in a reused
  receive buffer), and -- the way the tier did it before, for comparison -- one MGET / one SET
  pipeline on one connection through redis-py, per batch;
* `disk -> L1 slot`: the same through the disk tier (a temporary directory; its files are in the
  page cache, so this is the tier's own cost, not the device's);
* `redis -> L1 slot`: the whole read path a lookup waits for: the L2 worker's ``ReadL2`` of the K
  objects (tier read, MAC check and copy into the L1 slot of each value as it arrives, on the
  thread that read it).
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


@contextmanager
def local_redis() -> Iterator[str | None]:
    """A throwaway ``redis-server`` on a free loopback port (None: the binary is not installed)."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="mpcache-bench-redis-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir, "--protected-mode", "yes"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
        yield f"redis://127.0.0.1:{port}/0"
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


def tier_rows(url: str, objects: int, size: int, repeat: int) -> list[tuple[str, str, float]]:
    """(tier, operation, GB/s) of the Redis tier and of redis-py's plain MGET / pipeline."""
    import redis

    from mpcache.runtime_zmq.l2 import RedisTier

    payload = os.urandom(size)
    keys = [b"bench-%d" % i for i in range(objects)]
    batches = _batches(keys, size)
    total = objects * size
    tier = RedisTier(url)
    plain = redis.Redis.from_url(url)
    rows: list[tuple[str, str, float]] = []
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

        def new_read(batch: list[bytes]) -> None:
            values = tier.read_many(batch)
            assert all(v is not None and len(v) == size for v in values)

        def each_read(batch: list[bytes]) -> None:
            sizes: list[int] = []
            tier.read_each(batch, lambda i, v: sizes.append(-1 if v is None else len(v)))
            assert sizes == [size] * len(batch)

        for name, call in (("write: SET pipeline, one connection (before)", old_write),
                           ("write: write_many (spread)", new_write),
                           ("read: MGET via redis-py (before)", old_read),
                           ("read: read_many (spread, recv_into)", new_read),
                           ("read: read_each (spread, reused buffers)", each_read)):
            seconds = _best(lambda: _in_threads(batches, call), repeat)
            rows.append(("redis", name, total / seconds / 1e9))
    finally:
        tier.close()
        plain.close()
    return rows


def worker_row(url: str, objects: int, size: int, repeat: int) -> tuple[str, str, float] | None:
    """The L2 worker's ReadL2 of ``objects`` sealed objects from Redis (``url``; a ``disk:PATH``
    URL: the disk tier) into L1 slots."""
    from mpcache.core_sm.chunks import ObjectKey
    from mpcache.core_sm.effects import ReadL2, WriteL2
    from mpcache.core_sm.messages import L2ReadFinished, L2WriteFinished
    from mpcache.runtime_zmq.l1_pool import SharedMemoryPool
    from mpcache.runtime_zmq.l2 import RedisTier, open_tier
    from mpcache.runtime_zmq.l2_worker import L2Worker

    try:
        pool = SharedMemoryPool(objects * size, size)
    except Exception as e:  # no room in /dev/shm: say so, keep the other rows
        print(f"(no L1 pool for the worker row: {e})")
        return None
    if pool.num_slots < objects:
        pool.close()
        return None
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

    tier = open_tier(url) if url.startswith("disk:") else RedisTier(url)
    worker = L2Worker([tier], pool, post, sealer=Sealer(os.urandom(32)))
    try:
        keys = [ObjectKey(i.to_bytes(16, "little"), 0) for i in range(objects)]
        payload = os.urandom(size)
        for slot in range(objects):
            pool.write(slot, payload)
        worker.write(WriteL2(1, tuple(zip(keys, range(objects))), size))
        written = wait(1)
        assert isinstance(written, L2WriteFinished) and written.ok, written
        ident = [100]

        def read() -> None:
            ident[0] += 1
            # one ReadL2 per chunk of a lookup's prefix (a lookup reads its missing objects in one)
            worker.read(ReadL2(ident[0], tuple(zip(keys, range(objects))), size))
            got = wait(ident[0])
            assert isinstance(got, L2ReadFinished) and all(got.loaded), got

        seconds = _best(read, repeat)
        name = "disk -> L1 slot" if url.startswith("disk:") else "redis -> L1 slot"
        what = "ReadL2 (file read into a reused buffer + MAC check + copy into the slot; page cache warm)" \
            if url.startswith("disk:") else "ReadL2 (tier read + MAC check + copy into the slot)"
        return (name, what, objects * size / seconds / 1e9)
    finally:
        worker.close()
        pool.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mpcache-bench l2", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=32.0, help="object size in MiB (default 32)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; the best is shown (default 3)")
    ap.add_argument("--objects", type=int, default=16, help="objects per tier measurement (default 16)")
    ap.add_argument("--redis", default=None, metavar="URL", help="an existing Redis/Valkey (its data under mpcache:bench-*)")
    ap.add_argument("--no-redis", action="store_true", help="the sealing table only")
    args = ap.parse_args(argv)
    size = int(args.mib * (1 << 20))
    load = os.getloadavg()
    print(f"# mpcache-bench l2: load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs")
    seal_table(size, args.mib, args.repeat)
    rows: list[tuple[str, str, float]] = []
    with tempfile.TemporaryDirectory(prefix="mpcache-bench-l2-") as d:
        row = worker_row(f"disk:{d}/tier", args.objects, size, args.repeat)
        if row is not None:
            rows.append(row)
    if args.no_redis:
        _print_rows(rows, args.objects, args.mib)
        return 0
    with (local_redis() if args.redis is None else _given(args.redis)) as url:
        if url is None:
            print("(no redis-server on PATH and no --redis URL: tier rows skipped)")
            return 0
        rows = tier_rows(url, args.objects, size, args.repeat) + rows
        row = worker_row(url, args.objects, size, args.repeat)
        if row is not None:
            rows.append(row)
    _print_rows(rows, args.objects, args.mib)
    return 0


def _print_rows(rows: list[tuple[str, str, float]], objects: int, mib: float) -> None:
    print()
    print(f"| tier | operation ({objects} x {mib:g} MiB) | GB/s |")
    print("|---|---|---:|")
    for tier, op, gbps in rows:
        print(f"| {tier} | {op} | {gbps:.2f} |")


@contextmanager
def _given(url: str) -> Iterator[str | None]:
    yield url
