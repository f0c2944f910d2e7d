"""`mpcache-bench rpc`: control-plane RPC latency and throughput of mpcache, against a raw pyzmq
DEALER/ROUTER echo server measured in the same run (and, with `--lmcache-venv`, LMCache 0.5.6's
own MP server).

What it measures, on tcp loopback and on ipc:

* latency, one client, one request in flight, p50/p99/p99.9 over `--calls` calls after
  `--warmup` calls:
  - `echo` / `noop`: the raw echo server vs mpcache's `noop`;
  - `pair`: `lookup` (8k tokens, 32 chunks, all in L1) then `query_prefetch_status`, timed
    together, with the token ids as LMCache's client sends them (a list of ints); `pair_packed`:
    the same with the token ids as one bin of little-endian uint32, as mpcache's own client
    sends them. The raw baselines send the very same frames to the echo server;
  - `one_trip`: `lookup` of the same packed key asking for its hit count in the ack
    (`answer_in_ack`, mpcache's connector with `mpcache.lookup_answer_in_ack`): the whole hit in
    one round trip (the raw baseline echoes that one frame, so its ratio compares one trip with
    one; the pair rows' raw baselines are two trips);
  - `status`: `query_prefetch_status` alone (of a finished lookup);
  each pair is followed by an untimed `end_session`, as the vLLM connector does, so nothing piles
  up in the server;
* throughput: `--clients` client processes, each with `--window` requests in flight, for
  `--duration` seconds: `noop`/echo, `status`, `lookup` (list) and `lookup_packed`. The clients
  are C (`mpcache/bench/rpc_client.c`, compiled with `cc` against the libzmq pyzmq ships; `--client
  python` or no compiler: the Python clients), so they cost the box a fraction of what the
  server does and the row measures the server: each request is a real round trip with pre-encoded
  frames, a fresh uid and, for lookups, a fresh request id ended by an `end_session`; a reply
  that is an error, or a status that is not the expected hit count, fails the row. Per row the
  server's CPU per request and the clients' (their whole run over the counted requests) are
  printed;
* start to first reply: from spawning the server process to the first `noop` answered;
* with `--profile DIR` (needs `py-spy` on PATH or next to the interpreter): the mpcache server is
  sampled by `py-spy record` during each throughput row; the collapsed stacks go to DIR and a
  breakdown (share of samples per function, inclusive and self) is printed per row.

The servers of one transport run side by side and their latency rows are measured in
alternating blocks of calls, so each row sees the same background load (this box is shared).
All clients speak the wire format directly (a DEALER socket, msgpack frames), so the numbers are
the servers', not a client library's. The echo server answers `[uid, op]` to anything, which is
what a server whose handler returns `None` would send.
"""
from __future__ import annotations

import argparse
import array
import datetime
import multiprocessing as mp
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

MODEL = "bench/model"
CHUNK = 256
TOKENS = 8192  # 32 chunks
INSTANCE_ID = 7001
# One chunk of one rank in L1. Small on purpose: the benchmark is about the control plane.
OBJECT_BYTES = 4096
REQUEST_IDS = 64  # distinct request ids cycled by the latency loops
REPLY_TIMEOUT_MS = 10_000
END_UID_BASE = 1 << 40  # uids of the throughput workers' end_session requests

TARGETS = {
    "pair_p50_vs_raw": 1.5,
    "pair_p99_vs_raw": 3.0,
    "noop_p50_vs_raw": 1.3,
    "status_tput": 12_000.0,
    "lookup_tput": 5_000.0,
    "start_s": 1.0,
}


class BenchError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------
# Frames


def prompt_tokens(seed: int = 1234) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 128_000) for _ in range(TOKENS)]


def lookup_key(tokens: Sequence[int], request_id: str, worker_id: int | None = None,
               packed: bool = False) -> dict[str, Any]:
    """LMCache's key map. `packed`: token ids as one msgpack bin of little-endian uint32, the form
    mpcache's own client sends (LMCache's client sends a list of ints)."""
    return {
        "model_name": MODEL,
        "world_size": 1,
        "worker_id": worker_id,
        "token_ids": array.array("I", tokens).tobytes() if packed else list(tokens),
        "start": 0,
        "end": len(tokens),
        "request_id": request_id,
        "cache_salt": "",
        "request_configs": None,
        "num_kv_readers": 1,
    }


@dataclass
class Frames:
    """Pre-encoded payload frames, so the client loop costs the same for every server."""

    noop: bytes = field(default_factory=lambda: msgpack.packb("noop"))
    lookup_op: bytes = field(default_factory=lambda: msgpack.packb("lookup"))
    status_op: bytes = field(default_factory=lambda: msgpack.packb("query_prefetch_status"))
    end_op: bytes = field(default_factory=lambda: msgpack.packb("end_session"))
    tp_size: bytes = field(default_factory=lambda: msgpack.packb(1))
    lookup_keys: list[bytes] = field(default_factory=list)
    lookup_keys_packed: list[bytes] = field(default_factory=list)
    lookup_keys_in_ack: list[bytes] = field(default_factory=list)  # packed, answer_in_ack
    request_ids: list[bytes] = field(default_factory=list)

    @classmethod
    def build(cls, tag: str) -> Frames:
        f = cls()
        toks = prompt_tokens()
        for i in range(REQUEST_IDS):
            rid = f"{tag}-{i}"
            f.lookup_keys.append(msgpack.packb(lookup_key(toks, rid)))
            f.lookup_keys_packed.append(msgpack.packb(lookup_key(toks, rid, packed=True)))
            f.lookup_keys_in_ack.append(msgpack.packb({**lookup_key(toks, rid, packed=True), "answer_in_ack": True}))
            f.request_ids.append(msgpack.packb(rid))
        return f


# ---------------------------------------------------------------------------------------------
# The raw echo server


def echo_server(url: str) -> None:
    """ROUTER that answers `[uid, op]` to every request: the transport baseline."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(url)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    recv = sock.recv_multipart
    send = sock.send_multipart
    while True:
        frames = recv(copy=True)
        send(frames[:3], copy=True)


# ---------------------------------------------------------------------------------------------
# Servers under test


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    kind: str  # "raw", "mpcache", "lmcache"
    transport: str
    url: str
    proc: subprocess.Popen[bytes]
    start_s: float
    log_path: str
    notes: list[str] = field(default_factory=list)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def dealer(ctx: zmq.Context[Any], url: str) -> zmq.Socket[Any]:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RECONNECT_IVL, 10)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    s.connect(url)
    return s


def _recv(sock: zmq.Socket[Any], timeout_ms: int = REPLY_TIMEOUT_MS) -> list[bytes]:
    if not sock.poll(timeout_ms):
        raise BenchError(f"no reply within {timeout_ms} ms")
    frames: list[bytes] = sock.recv_multipart()
    return frames


def start_server(kind: str, transport: str, argv: list[str], url: str, workdir: str,
           env: dict[str, str] | None = None, start_timeout_s: float = 120.0) -> Server:
    """Spawns the server and times spawn -> first `noop` reply."""
    log_path = os.path.join(workdir, f"{kind}-{transport}.log")
    log = open(log_path, "wb")
    ctx = zmq.Context.instance()
    sock = dealer(ctx, url)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, start_new_session=True)
    log.close()
    server = Server(kind, transport, url, proc, 0.0, log_path)
    try:
        uid = 0
        deadline = t0 + start_timeout_s
        # A DEALER queues the request until the connection is up; resend now and then in case
        # the first one went to a socket that was not bound yet (ipc) or was dropped.
        while True:
            sock.send_multipart([msgpack.packb(uid), msgpack.packb("noop")])
            if sock.poll(200):
                frames = sock.recv_multipart()
                if frames[1] != msgpack.packb("noop"):
                    raise BenchError(f"{kind} server answered noop with {frames!r}")
                server.start_s = time.perf_counter() - t0
                # Later replies to the resent noops are drained by closing this socket.
                break
            if proc.poll() is not None:
                raise BenchError(f"{kind} server exited with {proc.returncode}; see {log_path}:\n"
                                 + _tail(log_path))
            if time.perf_counter() > deadline:
                raise BenchError(f"{kind} server did not answer within {start_timeout_s} s; "
                                 f"see {log_path}:\n" + _tail(log_path))
            uid += 1
    except BaseException:
        server.stop()
        raise
    finally:
        sock.close()
    return server


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")
    except OSError:
        return ""


def server_url(transport: str, workdir: str, name: str) -> str:
    if transport == "tcp":
        return f"tcp://127.0.0.1:{free_port()}"
    return f"ipc://{os.path.join(workdir, name + '.sock')}"


def start_raw(transport: str, workdir: str) -> Server:
    url = server_url(transport, workdir, "raw")
    argv = [sys.executable, "-m", "mpcache.bench.bench_rpc", "--echo-server", url]
    return start_server("raw", transport, argv, url, workdir, env=env_with_repo())


def start_mpcache(transport: str, workdir: str, l1_gb: float) -> Server:
    url = server_url(transport, workdir, "mpcache")
    argv = [sys.executable, "-m", "mpcache.runtime_zmq.cli", "--l1-size-gb", str(l1_gb), "--slot-mb", "1",
            "--log-level", "WARNING", "--no-metrics"]
    if transport == "tcp":
        port = url.rsplit(":", 1)[1]
        argv += ["--host", "127.0.0.1", "--port", port]
    else:
        argv += ["--ipc", url[len("ipc://"):]]
    server = start_server("mpcache", transport, argv, url, workdir, env=env_with_repo())
    try:
        prestore_mpcache(server.url)
    except BaseException:
        server.stop()
        raise
    return server


def start_lmcache(transport: str, workdir: str, venv: str) -> Server:
    if transport != "tcp":
        raise BenchError("LMCache's MP server listens on tcp only")
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    argv = [os.path.join(venv, "bin", "python"), "-m", "lmcache.v1.multiprocess.server",
            "--host", "127.0.0.1", "--port", str(port),
            "--l1-size-gb", "1", "--eviction-policy", "LRU"]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["CUDA_VISIBLE_DEVICES"] = ""
    return start_server("lmcache", transport, argv, url, workdir, env=env)


def env_with_repo() -> dict[str, str]:
    env = dict(os.environ)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def rpc_call(sock: zmq.Socket[Any], uid: int, op: str, *args: Any) -> Any:
    sock.send_multipart([msgpack.packb(uid), msgpack.packb(op)] + [msgpack.packb(a) for a in args])
    frames = _recv(sock)
    if msgpack.unpackb(frames[0]) != uid:
        raise BenchError(f"{op}: reply for another request")
    op_back = msgpack.unpackb(frames[1])
    result = msgpack.unpackb(frames[2]) if len(frames) > 2 else None
    if op_back != op:
        raise BenchError(f"{op} failed: {result!r}")
    return result


def prestore_mpcache(url: str) -> None:
    """Puts the benchmark prompt's 32 chunks in L1 through the engine-driven store path
    (register an engine-driven instance, prepare_store, fill the slots, commit_store)."""
    ctx = zmq.Context.instance()
    sock = dealer(ctx, url)
    try:
        # time the compiled paths, not the first second on their Python fallbacks: the token
        # scanner and the native chunk chain load on threads after the server answers
        end = time.monotonic() + 60.0
        uid = 100
        while time.monotonic() < end:
            uid += 1
            st = rpc_call(sock, uid, "stats")
            if st.get("token_scanner_ready", True) and st.get("native_chunk_hash_ready", True):
                break
            time.sleep(0.05)
        toks = prompt_tokens()
        rpc_call(sock, 1, "register_instance", INSTANCE_ID, {
            "model_name": MODEL, "world_size": 1, "object_bytes": OBJECT_BYTES,
            "engine_driven": True,
        })
        plan = rpc_call(sock, 2, "prepare_store", lookup_key(toks, "bench-prestore", worker_id=0),
                     INSTANCE_ID)
        transfer_id = plan["transfer_id"] if isinstance(plan, dict) else plan[0]
        # The bytes in the slots do not matter to the control plane; committing marks them ready.
        rpc_call(sock, 3, "commit_store", transfer_id, True)
        rpc_call(sock, 4, "end_session", "bench-prestore")
        # Check that a lookup of the prompt really hits all 32 chunks.
        rpc_call(sock, 5, "lookup", lookup_key(toks, "bench-check"), 1)
        deadline = time.monotonic() + 10
        uid = 6
        while True:
            hit = rpc_call(sock, uid, "query_prefetch_status", "bench-check")
            uid += 1
            if hit is not None or time.monotonic() > deadline:
                break
            time.sleep(0.001)
        rpc_call(sock, uid, "end_session", "bench-check")
        if hit != TOKENS // CHUNK:
            raise BenchError(f"pre-stored prompt: lookup found {hit!r} chunks, expected "
                             f"{TOKENS // CHUNK}")
    finally:
        sock.close()


# ---------------------------------------------------------------------------------------------
# Latency (one client, one request in flight)


def _percentiles(samples_ns: list[int]) -> tuple[float, float, float]:
    s = sorted(samples_ns)
    n = len(s)

    def pct(q: float) -> float:
        return s[min(n - 1, int(q * n))] / 1000.0

    return pct(0.50), pct(0.99), pct(0.999)


class LatencyProbe:
    """One client (a DEALER, one request in flight) of one server, for the latency rows.

    Probes of several servers are run in alternating blocks (`interleaved`), so every server's
    samples see the same background load: on a shared box, a row measured a minute after
    another can see a very different tail."""

    def __init__(self, url: str, tag: str, expect_status: int | None) -> None:
        self.frames = Frames.build(tag)
        self.sock = dealer(zmq.Context.instance(), url)
        self.uid = 0
        # every status reply must be this hit count (so a row labelled "L1 hit" cannot silently
        # measure misses); None: not checked (the echo server sends no result)
        self.expected = None if expect_status is None else msgpack.packb(expect_status)
        self.expect_status = expect_status
        self.samples: dict[str, list[int]] = {}
        self._in_ack_key = b""  # the one_trip lookup frame in flight: its ack is the hit count

    def _rt(self, parts: list[bytes]) -> None:
        self.uid += 1
        self.sock.send_multipart([msgpack.packb(self.uid)] + parts, copy=True)
        if not self.sock.poll(REPLY_TIMEOUT_MS):
            raise BenchError(f"no reply within {REPLY_TIMEOUT_MS} ms")
        reply = self.sock.recv_multipart()
        if reply[1] != parts[0]:
            raise BenchError(f"error reply {msgpack.unpackb(reply[-1])!r}")
        if self.expected is not None and (parts[0] == self.frames.status_op or parts[1:2] == [self._in_ack_key])\
                and reply[2:] != [self.expected]:
            got = msgpack.unpackb(reply[2]) if len(reply) > 2 else None
            raise BenchError(f"status {got!r}, expected {self.expect_status}")

    def prepare(self, what: str) -> None:
        if what == "status":
            # Finished lookups to query: the first status answers from the job, the rest from
            # its tombstone: the idempotent path a re-polling scheduler takes.
            f = self.frames
            for i in range(REQUEST_IDS):
                self._rt([f.lookup_op, f.lookup_keys[i], f.tp_size])
                self._rt([f.status_op, f.request_ids[i]])

    def finish(self, what: str) -> None:
        if what == "status":
            for i in range(REQUEST_IDS):
                self._rt([self.frames.end_op, self.frames.request_ids[i]])

    def run(self, what: str, start: int, n: int, record: bool) -> None:
        """`n` calls of `what` (noop | pair | pair_packed | one_trip | status); each pair is followed by an untimed
        end_session, as the vLLM connector does, so nothing piles up in the server."""
        f = self.frames
        rt = self._rt
        clock = time.perf_counter_ns
        out = self.samples.setdefault(what, [])
        for k in range(start, start + n):
            i = k % REQUEST_IDS
            if what == "noop":
                t0 = clock()
                rt([f.noop])
                t1 = clock()
            elif what == "pair" or what == "pair_packed":
                keys = f.lookup_keys if what == "pair" else f.lookup_keys_packed
                t0 = clock()
                rt([f.lookup_op, keys[i], f.tp_size])
                rt([f.status_op, f.request_ids[i]])
                t1 = clock()
                rt([f.end_op, f.request_ids[i]])
            elif what == "one_trip":
                self._in_ack_key = f.lookup_keys_in_ack[i]
                t0 = clock()
                rt([f.lookup_op, f.lookup_keys_in_ack[i], f.tp_size])
                t1 = clock()
                rt([f.end_op, f.request_ids[i]])
            elif what == "status":
                t0 = clock()
                rt([f.status_op, f.request_ids[i]])
                t1 = clock()
            else:
                raise ValueError(what)
            if record:
                out.append(t1 - t0)

    def close(self) -> None:
        self.sock.close()


def interleaved(probes: Sequence[LatencyProbe], what: str, calls: int, warmup: int,
                block: int = 500) -> list[tuple[float, float, float]]:
    """Runs `warmup` then `calls` calls of `what` on every probe, alternating blocks of `block`
    calls between them. Returns (p50, p99, p99.9) in microseconds per probe."""
    for p in probes:
        p.prepare(what)
        p.run(what, 0, warmup, record=False)
    done = 0
    while done < calls:
        n = min(block, calls - done)
        for p in probes:
            p.run(what, warmup + done, n, record=True)
        done += n
    for p in probes:
        p.finish(what)
    return [_percentiles(p.samples[what]) for p in probes]


# ---------------------------------------------------------------------------------------------
# Throughput (several client processes, pipelined)


def _key_template(prefix: str, packed: bool) -> tuple[bytes, bytes]:
    """The benchmark prompt's key frame around its request id, for ids ``prefix`` + 10 digits:
    ``head + msgpack(id) + tail`` is the frame (encoded once, patched per request)."""
    placeholder = "#" * len(f"{prefix}{0:010d}")
    key_frame = msgpack.packb(lookup_key(prompt_tokens(), placeholder, packed=packed))
    marker = msgpack.packb(placeholder)
    at = key_frame.find(marker)
    return key_frame[:at], key_frame[at + len(marker):]


def _server_cpu_over(server_pid: int | None, start_at: float, end_at: float, cpu_out: list[float] | None) -> None:
    """Waits out [start_at, end_at] and appends the server's CPU seconds over it to ``cpu_out``."""
    if server_pid is None or cpu_out is None:
        return
    time.sleep(max(0.0, start_at - time.time()))
    cpu0 = _cpu_seconds(server_pid)
    time.sleep(max(0.0, end_at - time.time()))
    cpu_out.append(_cpu_seconds(server_pid) - cpu0)


def _tput_worker(url: str, what: str, window: int, start_at: float, end_at: float, tag: str,
                 out: Any) -> None:
    try:
        frames = Frames.build(tag)
        ctx = zmq.Context()
        sock = dealer(ctx, url)
        uid = 0
        inflight = 0
        done = 0
        ids = len(frames.request_ids)
        if what == "status":
            for i in range(ids):
                rpc_call(sock, 10**9 + i, "lookup", msgpack.unpackb(frames.lookup_keys[i]), 1)
                rpc_call(sock, 2 * 10**9 + i, "query_prefetch_status", msgpack.unpackb(frames.request_ids[i]))

        # Lookups: every one under a request id never used before (as vLLM's are), each ended by
        # an end_session sent when its ack arrives (not counted, but served), so the server does
        # a lookup's full work every time and its tables stay bounded. The key frame is encoded
        # once with a fixed-width placeholder id that is patched per request.
        head, tail = _key_template(f"{tag}-", what == "lookup_packed")

        def request(n: int) -> list[bytes]:
            i = n % ids
            if what == "noop":
                return [msgpack.packb(n), frames.noop]
            if what == "status":
                return [msgpack.packb(n), frames.status_op, frames.request_ids[i]]
            rid = msgpack.packb(f"{tag}-{n:010d}")
            return [msgpack.packb(n), frames.lookup_op, head + rid + tail, frames.tp_size]

        expected_op = {"noop": frames.noop, "status": frames.status_op, "lookup": frames.lookup_op,
                       "lookup_packed": frames.lookup_op}[what]
        warm_until = start_at
        while time.time() < start_at - 1.0:
            time.sleep(0.01)
        counting = False
        errors = 0
        ends_sent = 0
        ends_answered = 0

        def on_reply(reply: list[bytes]) -> bool:
            """Handles one reply; True when it answered a counted request."""
            nonlocal inflight, errors, ends_sent, ends_answered
            if reply[1] == frames.end_op:
                ends_answered += 1
                return False
            inflight -= 1
            if reply[1] != expected_op:
                errors += 1
            elif what in ("lookup", "lookup_packed"):
                n = msgpack.unpackb(reply[0])
                sock.send_multipart([msgpack.packb(END_UID_BASE + n), frames.end_op,
                                     msgpack.packb(f"{tag}-{n:010d}")])
                ends_sent += 1
            return True

        while True:
            now = time.time()
            if not counting and now >= warm_until:
                counting = True
                done = 0
            if now >= end_at:
                break
            while inflight < window:
                sock.send_multipart(request(uid))
                uid += 1
                inflight += 1
            if sock.poll(1000):
                while True:
                    try:
                        reply = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if on_reply(reply):
                        done += 1
        # Drain: answers to what is still in flight, and the end_sessions they trigger.
        deadline = time.time() + 10
        while (inflight or ends_answered < ends_sent) and time.time() < deadline:
            if sock.poll(100):
                on_reply(sock.recv_multipart())
        if what == "status":
            for i in range(ids):
                rpc_call(sock, 3 * 10**9 + i, "end_session", msgpack.unpackb(frames.request_ids[i]))
        sock.close()
        ctx.term()
        out.put((done, errors, None))
    except BaseException as e:  # reported to the parent
        out.put((0, 0, f"{type(e).__name__}: {e}"))


def _cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------
# The C throughput client (mpcache/bench/rpc_client.c)

_C_CLIENT_SRC = os.path.join(os.path.dirname(os.path.realpath(__file__)), "rpc_client.c")


def _libzmq() -> str | None:
    """The libzmq this pyzmq runs on (the wheel ships one), else the system's."""
    import ctypes.util
    import glob

    site = os.path.dirname(os.path.dirname(os.path.abspath(zmq.__file__)))
    for pattern in ("pyzmq.libs/libzmq*.so*", "zmq/.libs/libzmq*.so*"):
        found = sorted(glob.glob(os.path.join(site, pattern)))
        if found:
            return found[0]
    name = ctypes.util.find_library("zmq")
    return name


def build_c_client(workdir: str) -> tuple[str | None, str]:
    """Compiles mpcache/bench/rpc_client.c into ``workdir``; returns (path, "") or (None, why not)."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc)"
    lib = _libzmq()
    if lib is None:
        return None, "no libzmq found"
    out = os.path.join(workdir, "rpc_client")
    if os.path.isabs(lib):
        link = [f"-L{os.path.dirname(lib)}", f"-l:{os.path.basename(lib)}", f"-Wl,-rpath,{os.path.dirname(lib)}"]
    else:
        link = [f"-l:{lib}"]
    argv = [cc, "-O2", "-o", out, _C_CLIENT_SRC] + link
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        return None, f"cc failed: {done.stderr.strip()[:300]}"
    return out, ""


def _c_spec(what: str, tag: str, expect_status: int | None) -> bytes:
    """The spec file of one C client (the layout is in mpcache/bench/rpc_client.c)."""
    frames = Frames.build(tag)
    lookup = what in ("lookup", "lookup_packed")
    prefix = f"{tag}-"
    head = tail = b""
    if lookup:
        head, tail = _key_template(prefix, what == "lookup_packed")
    op = {"noop": frames.noop, "status": frames.status_op, "lookup": frames.lookup_op,
          "lookup_packed": frames.lookup_op}[what]
    expect = msgpack.packb(expect_status) if what == "status" and expect_status is not None else b""
    args: list[bytes] = []
    prep: list[list[bytes]] = []
    post: list[list[bytes]] = []
    if what == "status":
        # finished lookups to query (named on the client's own connection: a request id belongs
        # to the peer that named it), so every status answers their hit count; ended afterwards
        args = frames.request_ids
        for i, rid in enumerate(frames.request_ids):
            prep.append([frames.lookup_op, frames.lookup_keys[i], frames.tp_size])
            prep.append([frames.status_op, rid])
            post.append([frames.end_op, rid])
    blobs = [b"lookup" if lookup else b"fixed", op, expect, frames.end_op if lookup else b"",
             prefix.encode(), head, tail, frames.tp_size, op,
             f"{len(args)} {len(prep)} {len(post)}".encode()]
    blobs += args
    for msg in prep + post:
        blobs.append(b"".join(len(f).to_bytes(4, "little") + f for f in msg))
    out = [len(blobs).to_bytes(4, "little")]
    for b in blobs:
        out += [len(b).to_bytes(4, "little"), b]
    return b"".join(out)


def measure_throughput_c(client: str, url: str, what: str, clients: int, window: int, duration: float,
                         tag: str, expect_status: int | None, server_pid: int | None = None,
                         cpu_out: list[float] | None = None, client_cpu_out: list[float] | None = None) -> float:
    """``measure_throughput`` with the C client processes (``client``: the built binary);
    ``client_cpu_out`` gets the clients' CPU seconds (their whole run, warm-up and drain too)."""
    import resource

    workdir = tempfile.mkdtemp(prefix="mpcache-bench-c-")
    tags = [f"{tag}-c{c}" for c in range(clients)]
    try:
        specs = []
        for t in tags:
            path = os.path.join(workdir, f"{t}.spec")
            with open(path, "wb") as f:
                f.write(_c_spec(what, t, expect_status))
            specs.append(path)
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        procs = [subprocess.Popen([client, url, spec, str(window)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for spec in specs]
        try:
            # every client connected and set up before the clock starts (a loaded box can take
            # seconds to start four processes); then half a second of warm-up, uncounted
            for p in procs:
                assert p.stdout is not None
                line = p.stdout.readline()
                if line.strip() != "ready":
                    p.wait(timeout=10)
                    raise BenchError(f"throughput {what}: C client exited {p.returncode} before it was ready: "
                                     f"{p.stderr.read().strip()[:300] if p.stderr else ''}")
            start_at = time.time() + 0.5
            end_at = start_at + duration
            for p in procs:
                assert p.stdin is not None
                p.stdin.write(f"{start_at!r} {end_at!r}\n")
                p.stdin.flush()
        except BaseException:
            for p in procs:
                p.kill()
                p.wait(timeout=10)
            raise
        _server_cpu_over(server_pid, start_at, end_at, cpu_out)
        outs = [p.communicate(timeout=duration + 60) for p in procs]
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if client_cpu_out is not None:
            client_cpu_out.append((ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime))
        done = errors = 0
        for p, (stdout, stderr) in zip(procs, outs):
            if p.returncode != 0:
                raise BenchError(f"throughput {what}: C client exited {p.returncode}: {stderr.strip()[:300]}")
            d, e, ends_sent, ends_answered = (int(x) for x in stdout.split())
            if ends_answered < ends_sent:
                raise BenchError(f"throughput {what}: {ends_sent - ends_answered} end_session replies missing")
            done += d
            errors += e
        if errors:
            first = next((e.strip() for _, e in outs if e.strip()), "")
            raise BenchError(f"throughput {what}: {errors} error replies; {first[:400]}")
        return done / duration
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def measure_throughput(url: str, what: str, clients: int, window: int, duration: float,
                       tag: str, server_pid: int | None = None,
                       cpu_out: list[float] | None = None) -> float:
    """Requests per second over ``duration``; with ``server_pid``, appends to ``cpu_out`` the
    server's CPU seconds over the same window (so CPU per request = cpu / (rate * duration))."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    # Children import this module; give them time to start before the clock starts.
    start_at = time.time() + 2.5
    end_at = start_at + duration
    procs = [ctx.Process(target=_tput_worker,
                         args=(url, what, window, start_at, end_at, f"{tag}-c{c}", out))
             for c in range(clients)]
    for p in procs:
        p.start()
    _server_cpu_over(server_pid, start_at, end_at, cpu_out)
    results = [out.get(timeout=duration + 60) for _ in procs]
    for p in procs:
        p.join(timeout=10)
    failures = [r[2] for r in results if r[2]]
    if failures:
        raise BenchError(f"throughput {what}: {failures[0]}")
    errors = sum(r[1] for r in results)
    if errors:
        raise BenchError(f"throughput {what}: {errors} error replies")
    return sum(r[0] for r in results) / duration


# ---------------------------------------------------------------------------------------------
# Profiling (py-spy on the mpcache server during a throughput row)


def _py_spy() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    found = here if os.path.exists(here) else shutil.which("py-spy")
    if not found:
        raise BenchError("--profile needs py-spy (pip install py-spy)")
    return found


def start_profile(pid: int, out_path: str, duration: float) -> subprocess.Popen[bytes]:
    """py-spy record of ``pid`` for ``duration`` s into ``out_path`` (collapsed stacks, one
    "frame;frame;... count" line per distinct stack; idle samples included)."""
    argv = [_py_spy(), "record", "-p", str(pid), "-o", out_path, "--format", "raw", "--idle",
            "-r", "200", "-d", str(max(1, int(round(duration)))), "--nonblocking"]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _frame_name(frame: str) -> str:
    """py-spy's raw frame "function (path/to/file.py:123)" as "function (file.py)": the lines of
    one function count together."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rpartition(":")[0] or where.rstrip(")")
    return f"{name} ({os.path.basename(path)})"


def profile_breakdown(path: str, top: int = 14) -> list[str]:
    """Lines of the breakdown: per function (all lines of one function together), the share of
    samples whose stack holds it (inclusive) and whose innermost frame is it (self)."""
    incl: dict[str, int] = {}
    self_: dict[str, int] = {}
    total = 0
    try:
        with open(path) as f:
            for raw in f:
                stack, _, count = raw.rstrip("\n").rpartition(" ")
                if not count.isdigit():
                    continue
                n = int(count)
                frames = [_frame_name(fr) for fr in stack.split(";")
                          if fr and not fr.startswith(("process ", "thread "))]
                # the loop thread only (the L2 and metrics threads wait on their queues)
                if not any(fr.startswith("Server.serve_forever ") for fr in frames):
                    continue
                total += n
                for name in set(frames):
                    incl[name] = incl.get(name, 0) + n
                self_[frames[-1]] = self_.get(frames[-1], 0) + n
    except OSError:
        return [f"(no profile at {path})"]
    if not total:
        return ["(no samples)"]
    lines = [f"{total} samples of the loop thread at 200 Hz (idle included); inclusive % / self % per function:"]
    for name, n in sorted(incl.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {100 * n / total:5.1f}% {100 * self_.get(name, 0) / total:5.1f}%  {name}")
    lines.append("  top self:")
    for name, n in sorted(self_.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {'':5} {100 * n / total:5.1f}%  {name}")
    return lines


# ---------------------------------------------------------------------------------------------
# The run


def _row_label(kind: str, what: str) -> str:
    if what == "noop":
        return "echo" if kind == "raw" else "noop"
    if what == "status":
        return "status"
    if what == "pair_packed":
        return {"raw": "echo pair (packed frames)", "mpcache": "lookup+status packed (L1 32/32)"}[kind]
    if what == "one_trip":
        return {"raw": "echo lookup (packed frame)", "mpcache": "lookup, count in ack (L1 32/32)"}[kind]
    return {"raw": "echo pair (list frames)", "mpcache": "lookup+status list (L1 32/32)",
            "lmcache": "lookup+status list (no KV: 0)"}[kind]


@dataclass
class Row:
    transport: str
    server: str
    what: str  # noop | pair | pair_packed | one_trip | status
    op: str
    p50: float
    p99: float
    p999: float


def _fmt_row(r: Row, raw: Row | None) -> str:
    ratio = f"{r.p50 / raw.p50:5.2f}x {r.p99 / raw.p99:5.2f}x" if raw else f"{'':>6} {'':>6}"
    return (f"| {r.transport:<4} | {r.server:<8} | {r.op:<31} | {r.p50:8.1f} | {r.p99:8.1f} | "
            f"{r.p999:9.1f} | {ratio} |")


def run(args: argparse.Namespace) -> int:
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    only = [w.strip() for w in (args.only or "noop,status,lookup,lookup_packed").split(",") if w.strip()]
    latency_ops = [w.strip() for w in args.latency_ops.split(",") if w.strip()]
    unknown = set(latency_ops) - {"noop", "pair", "pair_packed", "one_trip", "status"}
    if unknown:
        print(f"mpcache-bench rpc: unknown latency rows {sorted(unknown)}", file=sys.stderr)
        return 2
    load = os.getloadavg()
    print(f"# mpcache-bench rpc  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  "
          f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, "
          f"pyzmq {zmq.__version__} / libzmq {zmq.zmq_version()}")
    print(f"# latency: {args.calls} calls after {args.warmup} warm-up, one in flight; throughput: "
          f"{args.clients} client processes x {args.window} in flight x {args.duration:g} s; "
          f"prompt {TOKENS} tokens = {TOKENS // CHUNK} chunks; load average before: "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    workdir = tempfile.mkdtemp(prefix="mpcache-bench-rpc-")
    os.chmod(workdir, 0o700)
    rows: list[Row] = []
    tput: list[tuple[str, str, str, float]] = []
    cpu_of: dict[tuple[str, str, str], tuple[float, float, float]] = {}
    c_client: str | None = None
    if args.client == "c" and not args.no_throughput:
        c_client, why = build_c_client(workdir)
        if c_client is None:
            print(f"# the C throughput client could not be built ({why}): Python clients instead")
    print(f"# throughput clients: {'C (mpcache/bench/rpc_client.c)' if c_client else 'Python'}")
    starts: list[tuple[str, str, float]] = []
    rc = 0
    try:
        for transport in transports:
            # Every server of this transport runs at once, so their latency rows can be measured
            # in alternating blocks under the same background load.
            kinds = ["raw"] + ([] if args.no_mpcache else ["mpcache"])
            if args.lmcache_venv and transport == "tcp":
                kinds.append("lmcache")
            servers: list[Server] = []
            probes: list[LatencyProbe] = []
            try:
                for kind in kinds:
                    if kind == "raw":
                        server = start_raw(transport, workdir)
                    elif kind == "mpcache":
                        server = start_mpcache(transport, workdir, args.l1_size_gb)
                    else:
                        server = start_lmcache(transport, workdir, args.lmcache_venv)
                    servers.append(server)
                    starts.append((kind, transport, server.start_s))
                    expect = {"raw": None, "mpcache": TOKENS // CHUNK, "lmcache": 0}[kind]
                    probes.append(LatencyProbe(server.url, f"{kind}-{transport}", expect))
                for what in () if args.no_latency else latency_ops:
                    # the echo server's answer to a status frame is the noop row, in effect;
                    # LMCache's keys carry token ids as a list only
                    sel = [i for i, k in enumerate(kinds)
                           if not (k == "raw" and what == "status")
                           and not (k == "lmcache" and what in ("pair_packed", "one_trip"))]
                    try:
                        results = interleaved([probes[i] for i in sel], what, args.calls, args.warmup)
                    except BenchError as e:
                        raise BenchError(f"{transport} {what}: {e}") from None
                    for i, p in zip(sel, results):
                        rows.append(Row(transport, kinds[i], what, _row_label(kinds[i], what), *p))
                        print(_fmt_row(rows[-1], None), flush=True)
                for p in probes:
                    p.close()
                probes = []
                if not args.no_throughput:
                    for kind, server in zip(kinds, servers):
                        for what in only:
                            if kind == "raw" and what != "noop":
                                continue
                            if kind == "lmcache" and what == "lookup_packed":
                                continue
                            prof = None
                            if args.profile and kind == "mpcache":
                                os.makedirs(args.profile, exist_ok=True)
                                prof_path = os.path.join(args.profile, f"{transport}-{what}.txt")
                                # the clients take about 2.5 s to start (measure_throughput)
                                prof = (start_profile(server.proc.pid, prof_path, args.duration + 2.5), prof_path)
                            cpu: list[float] = []
                            client_cpu: list[float] = []
                            row_tag = f"{kind}-{transport}-t{what}"
                            if c_client is not None:
                                expect = {"raw": None, "mpcache": TOKENS // CHUNK, "lmcache": 0}[kind]
                                rate = measure_throughput_c(c_client, server.url, what, args.clients, args.window,
                                                            args.duration, row_tag, expect, server.proc.pid, cpu,
                                                            client_cpu)
                            else:
                                rate = measure_throughput(server.url, what, args.clients, args.window,
                                                          args.duration, row_tag, server.proc.pid, cpu)
                            if cpu and rate:
                                # clients: CPU of their whole run over the requests counted (an upper bound)
                                cl = client_cpu[0] * 1e6 / (rate * args.duration) if client_cpu else float("nan")
                                cpu_of[(transport, kind, what)] = (cpu[0] / args.duration * 100,
                                                                   cpu[0] * 1e6 / (rate * args.duration), cl)
                                print(f"# server CPU during {transport} {kind} {what}: "
                                      f"{cpu[0] / args.duration * 100:.0f}% of a core, "
                                      f"{cpu[0] * 1e6 / (rate * args.duration):.1f} us per request; "
                                      f"clients {cl:.1f} us per request", flush=True)
                            if prof is not None:
                                prof[0].wait(timeout=60)
                                print(f"# profile of mpcache, {transport} {what} ({prof[1]}):")
                                for line in profile_breakdown(prof[1]):
                                    print(f"#   {line}")
                            tput.append((transport, kind, "echo" if kind == "raw" else what, rate))
                            print(f"# throughput {transport} {kind} {what}: {rate:,.0f} req/s",
                                  flush=True)
            finally:
                for p in probes:
                    p.close()
                for server in servers:
                    server.stop()
    except BenchError as e:
        print(f"mpcache-bench rpc: {e}", file=sys.stderr)
        rc = 1
    finally:
        if not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"# server logs kept in {workdir}")

    print()
    print("| transport | server | op | p50 µs | p99 µs | p99.9 µs | vs raw p50, p99 |")
    print("|---|---|---|---:|---:|---:|---|")
    raw_for = {(r.transport, r.what): r for r in rows if r.server == "raw"}
    for r in rows:
        # status rows compare with the echo of one small request, like noop
        raw_what = "noop" if r.what == "status" else r.what
        raw = raw_for.get((r.transport, raw_what)) if r.server != "raw" else None
        print(_fmt_row(r, raw))
    if tput:
        print()
        print(f"| transport | server | op | req/s ({args.clients} clients) | server CPU, % of a core | "
              f"server CPU µs/req | clients' CPU µs/req |")
        print("|---|---|---|---:|---:|---:|---:|")
        nan = float("nan")
        for transport, kind, what, rate in tput:
            pct, us, cl = cpu_of.get((transport, kind, "noop" if what == "echo" else what), (nan, nan, nan))
            cl_s = f"{cl:.1f}" if cl == cl else "-"  # not measured for the Python clients
            print(f"| {transport} | {kind} | {what} | {rate:,.0f} | {pct:.0f} | {us:.1f} | {cl_s} |")
    if starts:
        print()
        print("| server | transport | start to first reply, s |")
        print("|---|---|---:|")
        for kind, transport, s in starts:
            print(f"| {kind} | {transport} | {s:.3f} |")
    verdicts = _targets(rows, tput, starts, raw_for)
    if verdicts:
        print()
        print("| target | measured | verdict |")
        print("|---|---|---|")
        for line in verdicts:
            print(line)
    return rc


def _targets(rows: list[Row], tput: list[tuple[str, str, str, float]],
             starts: list[tuple[str, str, float]], raw_for: dict[tuple[str, str], Row]) -> list[str]:
    out: list[str] = []

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    for r in rows:
        if r.server != "mpcache":
            continue
        if r.what in ("pair", "pair_packed"):
            raw = raw_for.get((r.transport, r.what))
            form = "list" if r.what == "pair" else "packed"
            if raw:
                x50, x99 = r.p50 / raw.p50, r.p99 / raw.p99
                out.append(f"| {r.transport} pair ({form}) p50 ≤ {TARGETS['pair_p50_vs_raw']}x raw pair | "
                           f"{x50:.2f}x | {verdict(x50 <= TARGETS['pair_p50_vs_raw'])} |")
                out.append(f"| {r.transport} pair ({form}) p99 ≤ {TARGETS['pair_p99_vs_raw']}x raw pair | "
                           f"{x99:.2f}x | {verdict(x99 <= TARGETS['pair_p99_vs_raw'])} |")
        if r.what == "noop":
            raw = raw_for.get((r.transport, "noop"))
            if raw:
                x = r.p50 / raw.p50
                out.append(f"| {r.transport} noop p50 ≤ {TARGETS['noop_p50_vs_raw']}x raw echo | "
                           f"{x:.2f}x | {verdict(x <= TARGETS['noop_p50_vs_raw'])} |")
    for transport, kind, what, rate in tput:
        if kind != "mpcache":
            continue
        if what == "status":
            out.append(f"| {transport} status ≥ {TARGETS['status_tput']:,.0f}/s | {rate:,.0f}/s | "
                       f"{verdict(rate >= TARGETS['status_tput'])} |")
        if what in ("lookup", "lookup_packed"):
            form = "list" if what == "lookup" else "packed"
            out.append(f"| {transport} lookup ({form}) ≥ {TARGETS['lookup_tput']:,.0f}/s | {rate:,.0f}/s | "
                       f"{verdict(rate >= TARGETS['lookup_tput'])} |")
    for kind, transport, s in starts:
        if kind == "mpcache":
            out.append(f"| {transport} start to first reply ≤ {TARGETS['start_s']} s | {s:.3f} s | "
                       f"{verdict(s <= TARGETS['start_s'])} |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpcache-bench rpc", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000, help="timed calls per latency row")
    parser.add_argument("--warmup", type=int, default=2_000, help="untimed calls before them")
    parser.add_argument("--transports", default="tcp,ipc", help="comma-separated: tcp, ipc")
    parser.add_argument("--clients", type=int, default=4, help="client processes for throughput")
    parser.add_argument("--window", type=int, default=8, help="requests in flight per client")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per throughput row")
    parser.add_argument("--no-throughput", action="store_true", help="latency rows only")
    parser.add_argument("--client", choices=("c", "python"), default="c",
                        help="throughput client processes: c (mpcache/bench/rpc_client.c, built with cc; "
                             "Python if it cannot be built) or python")
    parser.add_argument("--profile", metavar="DIR", help="py-spy the mpcache server during the throughput rows")
    parser.add_argument("--only", metavar="OPS", help="throughput rows to run (comma-separated: noop,status,lookup,lookup_packed)")
    parser.add_argument("--no-latency", action="store_true", help="throughput rows only")
    parser.add_argument("--latency-ops", metavar="OPS", default="noop,pair,pair_packed,one_trip,status",
                        help="latency rows to run (comma-separated: noop,pair,pair_packed,one_trip,status); "
                             "'--latency-ops pair,pair_packed --no-throughput' is the pair-latency-only run")
    parser.add_argument("--no-mpcache", action="store_true", help="skip mpcache (baselines only)")
    parser.add_argument("--l1-size-gb", type=float, default=1.0)
    parser.add_argument("--lmcache-venv", metavar="PATH",
                        help="also measure LMCache 0.5.6's server from this venv "
                             "(create it with tools/lmcache_venv.sh)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the servers' logs")
    parser.add_argument("--echo-server", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.echo_server:
        echo_server(args.echo_server)
        return 0
    if args.calls < 1 or args.warmup < 0 or args.clients < 1 or args.window < 1:
        parser.error("--calls, --clients and --window must be positive")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
