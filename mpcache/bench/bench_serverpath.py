"""`mpcache-bench serverpath`: the server's own CPU per request, in this process, no sockets.

A real `mpcache.runtime_zmq.server.Server` is built (shared-memory L1, core_sm machine, metrics) and the
very frames `mpcache-bench rpc` sends are fed to its message handler (`EffectInterpreter.on_message`); its
socket is replaced by a stub that keeps the last reply, so what is timed is decode, core_sm,
encode and bookkeeping, not the transport. CPU time is this thread's (`time.thread_time`), so
other load on a shared box changes the figures much less than it changes wall-clock rates.

Rows: `noop`, `query_prefetch_status` of a finished lookup, and a lookup cycle (`lookup` of an
8,192-token prompt whose 32 chunks are in L1, its `query_prefetch_status`, its `end_session`)
with the token ids as LMCache's client sends them (list) and as mpcache's client does (packed).
Each row: median and best of `--rounds` rounds of `--calls` calls. Then the cycle's messages one by
one: `--calls` lookups in a row (list, then packed ids), then their statuses, then their
`end_session`s, each batch timed alone (the jobs of a batch are live together, as on a busy
server); then `lookup to its ack`: the CPU from a lookup's arrival to its reply's send (the
server acknowledges before the lookup's hashing and leases, which then run before the next
message: what one request in flight waits for). `--profile` adds a cProfile breakdown of the list-form cycle (self time per function).

Then the server-driven (GPU) transfer path, the CPU the server's loop spends per STORE and
RETRIEVE of `--transfer-chunks` chunks with no device: a second server whose transfer engine
plans each transfer's kernel rows as the GPU engine does (`gpu_transfer.plan_rows`) and reports
it done at once; each call is the request's decode, core_sm, the engine's plan, the completion's
handling and the reply (the copy and its enqueue, ~130 µs on an H200, are not in it).
`--profile` adds its cProfile too.

Then the live rows (`--live-pairs`, default 200; 0 leaves them out): lone server-driven STOREs
and RETRIEVEs through a live server loop (ipc socket, the engine in another process, one request
at a time), with a stand-in transfer engine whose copies take `--live-delay-ms` (5: an 8-chunk
copy on an H200). They print the loop thread's CPU per request split by stage: what a request
costs when it finds the loop idle and its caches cold, as a lone GPU transfer does, against the
hot rows above. `--live-inflight K` keeps K requests in flight instead (K STOREs, then the K
RETRIEVEs of the same prompts): the loop under load, as several engines' small requests keep it.
`--live-report-us U`: the stand-in engine's reporting thread runs U µs of Python (holding the GIL)
per completion, as the GPU executor's waiter does, to see what that costs the loop thread.

The implied ceiling: one core spends `1e6 / us` requests per second in the handler, before the
transport (recv/send, the zmq I/O thread) and the loop's poll.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgpack  # type: ignore[import-untyped]

from mpcache.bench.bench_rpc import CHUNK, INSTANCE_ID, MODEL, OBJECT_BYTES, TOKENS, prompt_tokens, lookup_key


class _StubSocket:
    """Stands in for the ROUTER socket: keeps the last reply sent (and, when ``stamp`` is set,
    the loop thread's CPU clock at its first send: ``sent_at``)."""

    def __init__(self) -> None:
        self.last: list[bytes] = []
        self.stamp = False
        self.sent_at = 0.0

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        self.last = frames
        if self.stamp:
            self.stamp = False
            self.sent_at = time.thread_time()


def _frames(uid: int, op: str, *args: Any) -> list[bytes]:
    return [b"peer", msgpack.packb(uid), msgpack.packb(op)] + [msgpack.packb(a, use_bin_type=True) for a in args]


def _result(sock: _StubSocket) -> Any:
    if msgpack.unpackb(sock.last[2]) == "error":
        raise RuntimeError(f"error reply: {msgpack.unpackb(sock.last[3])!r}")
    return msgpack.unpackb(sock.last[3]) if len(sock.last) > 3 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpcache-bench serverpath", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="cProfile the list-form lookup cycle")
    parser.add_argument("--transfer-chunks", type=int, default=8, help="chunks per server-driven STORE / RETRIEVE")
    parser.add_argument("--form", choices=("both", "list", "packed"), default="both",
                        help="token-id forms of the lookup rows (one form: a py-spy profile of the run is of that form)")
    parser.add_argument("--live-pairs", type=int, default=200,
                        help="lone STORE + RETRIEVE pairs through a live server loop (0: leave the live rows out)")
    parser.add_argument("--live-delay-ms", type=float, default=5.0,
                        help="how long the live rows' stand-in transfer engine takes per copy (an 8-chunk copy on an H200: 5)")
    parser.add_argument("--live-report-us", type=float, default=0.0,
                        help="Python CPU the live rows' stand-in engine spends (holding the GIL) on each completion it "
                             "reports, as the GPU executor's waiter does (0: none)")
    parser.add_argument("--live-inflight", type=int, default=1,
                        help="requests the live rows' engine keeps in flight (1: lone requests; 32: a loaded loop)")
    args = parser.parse_args(argv)

    from mpcache.runtime_zmq import sha256_chain, tokens
    from mpcache.runtime_zmq.server import Server, ServerConfig

    tokens.load()  # the server loads it in the background at start; here, before timing
    sha256_chain.load()  # the same for the native chunk chain
    d = tempfile.mkdtemp(prefix="mpcache-serverpath-")
    server = Server(ServerConfig(url=f"ipc://{d}/s.sock", l1_size_bytes=64 << 20, slot_bytes=1 << 20))
    real_sock = server.sock
    stub = _StubSocket()
    server.sock = stub  # type: ignore[assignment]
    handle = server.interpreter.on_message
    try:
        toks = prompt_tokens()
        handle(_frames(1, "register_instance", INSTANCE_ID, {
            "model_name": MODEL, "world_size": 1, "object_bytes": OBJECT_BYTES, "engine_driven": True}))
        _result(stub)
        handle(_frames(2, "prepare_store", lookup_key(toks, "pre", worker_id=0), INSTANCE_ID))
        plan = _result(stub)
        handle(_frames(3, "commit_store", plan["transfer_id"] if isinstance(plan, dict) else plan[0], True))
        handle(_frames(4, "end_session", "pre"))

        uid = [10]

        ops = [msgpack.packb(x) for x in ("lookup", "query_prefetch_status", "end_session")]
        one = msgpack.packb(1)

        def key_parts(packed: bool) -> tuple[bytes, bytes]:
            """The key frame around its request id: ``head + packb(rid) + tail``."""
            placeholder = msgpack.packb("#" * 16)
            key_frame = msgpack.packb(lookup_key(toks, "#" * 16, packed=packed), use_bin_type=True)
            at = key_frame.find(placeholder)
            return key_frame[:at], key_frame[at + len(placeholder):]

        list_parts, packed_parts = key_parts(False), key_parts(True)

        def cycle_fn(packed: bool) -> Callable[[], None]:
            head, tail = packed_parts if packed else list_parts
            lookup_op, status_op, end_op = ops

            def cycle() -> None:
                n = uid[0] = uid[0] + 1
                rid = msgpack.packb(f"r{n:015d}")
                handle([b"peer", msgpack.packb(n), lookup_op, head + rid + tail, one])
                handle([b"peer", msgpack.packb(n), status_op, rid])
                handle([b"peer", msgpack.packb(n), end_op, rid])
            return cycle

        list_cycle, packed_cycle = cycle_fn(False), cycle_fn(True)
        list_cycle()
        handle(_frames(5, "query_prefetch_status", f"r{uid[0]:015d}"))
        # check: the prompt is a full hit (the status of an ended job is None; check a live one)
        handle(_frames(6, "lookup", lookup_key(toks, "check"), 1))
        handle(_frames(7, "query_prefetch_status", "check"))
        hit = _result(stub)
        if hit != TOKENS // CHUNK:
            raise RuntimeError(f"pre-stored prompt: {hit!r} chunks found, expected {TOKENS // CHUNK}")
        noop = [b"peer", msgpack.packb(8), msgpack.packb("noop")]
        status = [b"peer", msgpack.packb(9), msgpack.packb("query_prefetch_status"), msgpack.packb("check")]
        rows: list[tuple[str, Callable[[], None]]] = [
            ("noop", lambda: handle(noop)),
            ("query_prefetch_status", lambda: handle(status)),
            ("lookup cycle, list ids (lookup+status+end)", list_cycle),
            ("lookup cycle, packed ids (lookup+status+end)", packed_cycle),
        ]
        forms = [f for f in ("list", "packed") if args.form in ("both", f)]
        rows = [(name, fn) for name, fn in rows if "ids" not in name or any(f"{f} ids" in name for f in forms)]
        print(f"# server handler CPU per call, {args.rounds} rounds x {args.calls} calls; "
              f"prompt {TOKENS} tokens = {TOKENS // CHUNK} chunks, all in L1")
        print(f"# chunk hashing: {sha256_chain.status()}")
        print("| request | median µs | best µs | handler ceiling, one core |")
        print("|---|---:|---:|---:|")
        for name, fn in rows:
            for _ in range(200):
                fn()
            per: list[float] = []
            for _ in range(args.rounds):
                t0 = time.thread_time()
                for _ in range(args.calls):
                    fn()
                per.append((time.thread_time() - t0) / args.calls * 1e6)
            med = statistics.median(per)
            print(f"| {name} | {med:.1f} | {min(per):.1f} | {1e6 / med:,.0f}/s |")
        for form, (head, tail) in ((f, list_parts if f == "list" else packed_parts) for f in forms):
            per_op: dict[str, list[float]] = {"lookup": [], "query_prefetch_status": [], "end_session": []}
            for rnd in range(args.rounds + 1):  # the first round warms up
                batch = []
                for _ in range(args.calls):
                    n = uid[0] = uid[0] + 1
                    rid, u = msgpack.packb(f"r{n:015d}"), msgpack.packb(n)
                    batch.append(([b"peer", u, ops[0], head + rid + tail, one], [b"peer", u, ops[1], rid],
                                  [b"peer", u, ops[2], rid]))
                for i, op in enumerate(per_op):
                    t0 = time.thread_time()
                    for msgs in batch:
                        handle(msgs[i])
                    if rnd:
                        per_op[op].append((time.thread_time() - t0) / args.calls * 1e6)
                _result(stub)
            for op, per in per_op.items():
                med = statistics.median(per)
                print(f"| {op} alone, {form} ids | {med:.1f} | {min(per):.1f} | {1e6 / med:,.0f}/s |")
            to_ack: list[float] = []
            for _rnd in range(args.rounds):
                total = 0.0
                rids = []
                for _ in range(args.calls):
                    n = uid[0] = uid[0] + 1
                    rid = msgpack.packb(f"r{n:015d}")
                    rids.append(rid)
                    msg = [b"peer", msgpack.packb(n), ops[0], head + rid + tail, one]
                    stub.stamp = True
                    t0 = time.thread_time()
                    handle(msg)
                    total += stub.sent_at - t0
                to_ack.append(total / args.calls * 1e6)
                for rid in rids:
                    handle([b"peer", one, ops[2], rid])
            med = statistics.median(to_ack)
            print(f"| lookup to its ack, {form} ids | {med:.1f} | {min(to_ack):.1f} | - |")
        if args.profile:
            def lookups() -> None:
                for _ in range(args.calls):
                    list_cycle()
            _print_profile(lookups, "list-form lookup cycle", 18)
    finally:
        _stop(server, real_sock)
    transfer_rows(args)
    if args.live_pairs > 0:
        live_rows(args)
    return 0


def _print_profile(work: Callable[[], None], what: str, rows: int) -> None:
    """cProfile ``work`` and print its top ``rows`` functions by self time, as comments."""
    prof = cProfile.Profile()
    prof.enable()
    work()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(rows)
    print(f"\n# cProfile, {what} (self time):")
    for line in out.getvalue().splitlines():
        if line.strip():
            print("#", line)


def _stop(server: Any, real_sock: Any) -> None:
    """Give the server its socket back and close it."""
    server.sock = real_sock
    server.close()


class _PlanOnlyExecutor:
    """A server-driven transfer engine without a device: plans each transfer's kernel rows as
    ``GpuTransferExecutor.start`` does, then reports it done (the server's completion channel)."""

    on_instance_failed: Callable[[int, str], None] | None = None

    def __init__(self, chunk_tokens: int, block_size: int) -> None:
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.slot_bytes = 0
        self.started = 0

    def register_instance(self, instance_id: int, layout: Any, pool: Any) -> str | None:
        self.slot_bytes = pool.slot_bytes
        return None

    def unregister_instance(self, instance_id: int) -> None:
        pass

    def start(self, transfer: Any, event_handle: bytes, done: Callable[[int, bool], None]) -> None:
        from mpcache.runtime_zmq.gpu_transfer import plan_rows

        plan_rows(transfer, self.chunk_tokens, self.block_size, self.slot_bytes)
        self.started += 1
        self._copied(transfer.transfer_id, done)

    def _copied(self, transfer_id: int, done: Callable[[int, bool], None]) -> None:
        done(transfer_id, True)

    def close(self) -> None:
        pass


def transfer_rows(args: argparse.Namespace) -> None:
    """Server CPU per server-driven STORE and RETRIEVE (see the module's doc)."""
    from mpcache.runtime_zmq.server import Server, ServerConfig

    block, chunks = 16, args.transfer_chunks
    executor = _PlanOnlyExecutor(CHUNK, block)
    d = tempfile.mkdtemp(prefix="mpcache-serverpath-")
    server = Server(ServerConfig(url=f"ipc://{d}/s.sock", l1_size_bytes=256 << 20, slot_bytes=OBJECT_BYTES),
                    transfer_executor=executor)
    real_sock = server.sock
    stub = _StubSocket()
    server.sock = stub  # type: ignore[assignment]
    handle = server.interpreter.on_message
    handle_event = bytes(64)
    blocks = list(range(chunks * CHUNK // block))
    try:
        handle(_frames(1, "register_instance", INSTANCE_ID, {
            "model_name": MODEL, "world_size": 1, "object_bytes": OBJECT_BYTES, "engine_driven": False}))
        _result(stub)
        n_prompts = args.calls
        rng = __import__("random").Random(7)
        prompts = [[rng.randrange(1, 128_000) for _ in range(chunks * CHUNK)] for _ in range(n_prompts)]
        keys = [msgpack.packb(lookup_key(p, f"t{i}", worker_id=0, packed=True), use_bin_type=True)
                for i, p in enumerate(prompts)]
        ids = msgpack.packb(blocks)
        inst, ev, store_op, retrieve_op = (msgpack.packb(x, use_bin_type=True) for x in
                                           (INSTANCE_ID, handle_event, "store", "retrieve"))
        zero = msgpack.packb(0)
        uid = [100]

        def call(op: bytes, key: bytes, *tail: bytes) -> None:
            n = uid[0] = uid[0] + 1
            handle([b"peer", msgpack.packb(n), op, key, inst, ids, ev, *tail])
            server.drain_completions()  # the engine's report: core_sm's TransferFinished, then the reply

        call(store_op, keys[0])
        if _result(stub) is None and executor.started != 1:
            raise RuntimeError("the store started no transfer")
        call(retrieve_op, keys[0], zero)
        _result(stub)
        if executor.started != 2:
            raise RuntimeError(f"the retrieve started no transfer ({executor.started} started)")
        print(f"\n# server-driven transfers, {chunks} chunks of {CHUNK} tokens each, {args.rounds} rounds x "
              f"{n_prompts} calls: decode, core_sm, plan_rows, completion, reply (no device)")
        print("| request | median µs | best µs | handler ceiling, one core |")
        print("|---|---:|---:|---:|")
        for name, op, tail in (("STORE (server-driven)", store_op, ()), ("RETRIEVE (server-driven)", retrieve_op, (zero,))):
            per: list[float] = []
            for rnd in range(args.rounds + 1):  # the first round warms up (and stores every prompt)
                started = executor.started
                t0 = time.thread_time()
                for key in keys:
                    call(op, key, *tail)
                if rnd:
                    per.append((time.thread_time() - t0) / n_prompts * 1e6)
                if op is retrieve_op and executor.started - started != n_prompts:
                    raise RuntimeError(f"{executor.started - started} of {n_prompts} retrieves started a transfer")
            med = statistics.median(per)
            print(f"| {name} | {med:.1f} | {min(per):.1f} | {1e6 / med:,.0f}/s |")
        if args.profile:
            def transfers() -> None:
                for key in keys:
                    call(store_op, key)
                    call(retrieve_op, key, zero)
            _print_profile(transfers, "a server-driven STORE + RETRIEVE", 22)
    finally:
        _stop(server, real_sock)


class _DelayedExecutor(_PlanOnlyExecutor):
    """``_PlanOnlyExecutor`` whose copies take ``delay`` s: a thread of its own reports each
    one done ``delay`` s after its start (as a GPU engine's waiter does, through the server's
    completion channel)."""

    def __init__(self, chunk_tokens: int, block_size: int, delay: float, report_cpu: float = 0.0) -> None:
        import threading

        super().__init__(chunk_tokens, block_size)
        self.delay = delay
        self.report_cpu = report_cpu  # Python CPU (holding the GIL) spent on each report, as a GPU waiter's
        self._due: list[tuple[float, int, Callable[[int, bool], None]]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._report, name="mpcache-bench-engine", daemon=True)
        self._thread.start()

    def _copied(self, transfer_id: int, done: Callable[[int, bool], None]) -> None:
        with self._cv:
            self._due.append((time.monotonic() + self.delay, transfer_id, done))
            self._cv.notify()

    def _report(self) -> None:
        while True:
            with self._cv:
                while not self._due and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                at, tid, done = self._due[0]
                wait = at - time.monotonic()
                if wait > 0:
                    self._cv.wait(wait)
                    continue
                self._due.pop(0)
            if self.report_cpu:
                _busy(self.report_cpu)
            done(tid, True)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()


def _busy(seconds: float) -> None:
    """Run Python (holding the GIL) for ``seconds`` of this thread's CPU."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        sum(range(50))


def _live_client(url: str, pairs: int, chunks: int, block: int, out: Any, inflight: int = 1) -> None:
    """The live rows' engine: registers, then ``pairs`` STORE + RETRIEVE pairs, ``inflight`` at
    a time (1: each waits for its reply; more: that many STOREs, then their RETRIEVEs), and sends
    back each call's latency in seconds (submitted to answered)."""
    from mpcache.runtime_zmq.client import MPCacheClient

    blocks = list(range(chunks * CHUNK // block))
    with MPCacheClient(url, request_timeout=30.0) as c:
        c.register_instance(INSTANCE_ID, {"model_name": MODEL, "world_size": 1, "object_bytes": OBJECT_BYTES,
                                          "engine_driven": False}).result(30)
        out.send("ready")
        out.recv()
        lat: list[float] = []
        for first in range(0, pairs, inflight):
            keys = [lookup_key(list(range(1_000 + i * 50_000, 1_000 + i * 50_000 + chunks * CHUNK)), f"live-{i}",
                               worker_id=0, packed=True) for i in range(first, min(first + inflight, pairs))]
            for op, tail in (("store", ()), ("retrieve", (0,))):
                t0 = time.perf_counter()
                calls = [c.submit(op, key, INSTANCE_ID, blocks, bytes(64), *tail) for key in keys]
                for call in calls:
                    call.result(30)
                    lat.append(time.perf_counter() - t0)
        out.send(lat)


def _thread_cpu_s(native_id: int) -> float:
    import os

    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def live_rows(args: argparse.Namespace) -> None:
    """Lone server-driven requests through a live server: its loop thread's CPU per request,
    split by stage (what the latency issue's "no Python between a request and its copy" must
    remove), with no device. The engine is another process (``MPCacheClient``) sending one
    request at a time over ipc; the stand-in transfer engine (``_DelayedExecutor``) reports
    each copy done ``--live-delay-ms`` later, so every request finds the loop idle and its
    caches cold, as a lone GPU transfer does. Stages are timed with ``time.thread_time`` around
    the loop's own calls (~1 us each on top)."""
    import multiprocessing as mp
    import threading

    from mpcache.runtime_zmq import wire
    from mpcache.runtime_zmq.server import Server, ServerConfig

    block, chunks = 16, args.transfer_chunks
    executor = _DelayedExecutor(CHUNK, block, args.live_delay_ms / 1e3, args.live_report_us / 1e6)
    d = tempfile.mkdtemp(prefix="mpcache-serverloop-")
    server = Server(ServerConfig(url=f"ipc://{d}/s.sock", l1_size_bytes=256 << 20, slot_bytes=OBJECT_BYTES),
                    transfer_executor=executor)
    spent: dict[str, int] = {}
    ident: list[int] = []

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            if threading.get_native_id() != ident[0]:
                return fn(*a, **k)
            t0 = time.thread_time_ns()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0) + time.thread_time_ns() - t0
        return call

    stages = [(server, "requests received and handled", "_receive_batch"),
              (server, "completions handled", "drain_completions"),
              (server.interpreter, "transfer engine start (plan_rows)", "_start_transfer"),
              (server, "replies sent (zmq)", "_send_now")]
    for owner, label, name in stages:
        setattr(owner, name, timed(label, getattr(owner, name)))
    server.machine.handle = timed("core_sm handle", server.machine.handle)
    decode = wire.decode_request
    wire.decode_request = timed("decode", decode)

    def serve() -> None:
        ident.append(threading.get_native_id())
        server.serve_forever()

    loop = threading.Thread(target=serve, name="mpcache-bench-loop", daemon=True)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_live_client, args=(server.bound_url, args.live_pairs, chunks, block, there,
                                                  args.live_inflight), daemon=True)
    try:
        loop.start()
        proc.start()
        if not here.poll(60) or here.recv() != "ready":
            raise RuntimeError("the live rows' engine did not register")
        spent.clear()
        c0 = _thread_cpu_s(ident[0])
        here.send("go")
        if not here.poll(30 + args.live_pairs * (0.2 + 2 * args.live_delay_ms / 1e3)):
            raise RuntimeError("the live rows' engine did not finish")
        lat = sorted(here.recv())
        total = _thread_cpu_s(ident[0]) - c0
    finally:
        wire.decode_request = decode
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        server.stop()
        loop.join(10)
        executor.close()
    n = len(lat)
    if n != 2 * args.live_pairs or executor.started < n:
        raise RuntimeError(f"{n} calls answered, {executor.started} transfers started, of {2 * args.live_pairs}")
    us = {k: v / n / 1e3 for k, v in spent.items()}
    alone = "lone" if args.live_inflight == 1 else f"{args.live_inflight} in flight,"
    print(f"\n# live: {args.live_pairs} {alone} STORE + RETRIEVE pairs of {chunks} chunks through the server loop, "
          f"each copy {args.live_delay_ms:g} ms (no device), the engine in another process"
          + (f", {args.live_report_us:g} µs of Python per reported completion" if args.live_report_us else ""))
    print("| loop thread, per request | CPU µs |")
    print("|---|---:|")
    print(f"| total (the thread's CPU clock) | {total / n * 1e6:.0f} |")
    for label in ("requests received and handled", "decode", "core_sm handle", "transfer engine start (plan_rows)",
                  "completions handled", "replies sent (zmq)"):
        print(f"| {label} | {us.get(label, 0.0):.0f} |")
    rest = total / n * 1e6 - us.get("requests received and handled", 0.0) - us.get("completions handled", 0.0)
    print(f"| the loop's own turns (poll, timers, checks) | {rest:.0f} |")
    p50 = lat[n // 2] * 1e3
    print(f"latency p50 {p50:.2f} ms, p99 {lat[min(n - 1, int(n * 0.99))] * 1e3:.2f} ms: "
          f"{p50 - args.live_delay_ms:.2f} ms over the copy (core_sm handle counts requests and completions; "
          "decode, core_sm and the engine's start are inside the first row)")

