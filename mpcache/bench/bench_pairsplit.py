"""`mpcache-bench pairsplit`: where one lookup+status pair's time goes, stage by stage, against a
raw pyzmq echo pair measured in the same run.

The client is `mpcache-bench rpc`'s (a DEALER sending LMCache's frames: `lookup` of the 8k-token
prompt whose 32 chunks are in L1, then `query_prefetch_status`, then an untimed `end_session`).
The mpcache server is the real one (`mpcache.runtime_zmq.cli`), started in a process that stamps
the loop's steps with the monotonic clock the client reads too (`time.perf_counter_ns`, one clock
for every process on Linux): a message's receive starting, its decode done, its handling done, a
reply handed to zmq, a lookup's deferred work done. Matching the stamps to the client's (pair
start, ack received, status reply received) splits each pair into the legs below; the table
prints each leg's median over the pairs (medians of legs do not add up to the median pair).

A "sent" stamp is taken when zmq's send returns: the loop thread is often preempted inside it by
zmq's I/O thread, which it has just woken to write the reply, so a leg ending at "sent" includes
that thread's turn and the leg after it is that much shorter.
"""
from __future__ import annotations

import argparse
import array
import bisect
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import msgpack  # type: ignore[import-untyped]
import zmq

# stamp kinds
_RECV, _SENT, _DEFERRED, _DECODED, _HANDLED = 2, 3, 4, 5, 6


def _stamped_server(out: str, argv: list[str]) -> int:
    """Run mpcache's CLI server with the loop's steps stamped; the stamps go to ``out`` at exit."""
    from mpcache.runtime_zmq import effect_interpreter, server, wire

    stamps = array.array("q")
    clock = time.perf_counter_ns

    def wrap(owner: Any, name: str, kind: int, after: bool = True) -> None:
        fn = getattr(owner, name)

        def stamped(*a: Any) -> Any:
            if not after:
                stamps.append(kind)
                stamps.append(clock())
            r = fn(*a)
            if after:
                stamps.append(kind)
                stamps.append(clock())
            return r

        setattr(owner, name, stamped)

    wrap(server.Server, "_receive", _RECV, after=False)
    wrap(server.Server, "_send_now", _SENT)
    wrap(effect_interpreter.EffectInterpreter, "handle", _HANDLED)
    wrap(wire, "decode_request", _DECODED)
    loop = server.Server._loop

    def stamped_loop(self: Any) -> None:
        wrap(self.machine, "run_deferred", _DEFERRED)
        try:
            loop(self)
        finally:
            with open(out, "wb") as f:
                stamps.tofile(f)

    server.Server._loop = stamped_loop  # type: ignore[method-assign]
    from mpcache.runtime_zmq import cli

    return int(cli.main(argv) or 0)


def _pairs(sock: zmq.Socket[Any], frames: Any, n: int, packed: bool, out: array.array[int] | None) -> None:
    keys = frames.lookup_keys_packed if packed else frames.lookup_keys
    clock = time.perf_counter_ns
    for j in range(n):
        i = j % len(keys)
        t0 = clock()
        sock.send_multipart([msgpack.packb(2 * j), frames.lookup_op, keys[i], frames.tp_size])
        sock.recv_multipart()
        t1 = clock()
        sock.send_multipart([msgpack.packb(2 * j + 1), frames.status_op, frames.request_ids[i]])
        reply = sock.recv_multipart()
        t2 = clock()
        if reply[1] != frames.status_op:
            raise RuntimeError(f"status failed: {reply!r}")
        sock.send_multipart([msgpack.packb(1 << 30 | j), frames.end_op, frames.request_ids[i]])
        sock.recv_multipart()
        if out is not None:
            out.extend((t0, t1, t2))


LEGS = (
    "client -> server: lookup, to its receive",
    "lookup decode",
    "decode done -> ack sent (core_sm, encode, send)",
    "ack sent -> client has it",
    "client -> server: status, to its receive",
    "status receive -> decode done",
    "status decode done -> handled (core_sm, reply held)",
    "status handled -> reply sent",
    "reply sent -> client has it",
    "pair",
    "deferred work after the ack (beside the path)",
)


def split(client: array.array[int], stamps: array.array[int]) -> dict[str, list[int]]:
    """Each pair's legs (ns), from the client's (t0, ack, status reply) and the server's stamps."""
    ev = [(stamps[i + 1], stamps[i]) for i in range(0, len(stamps), 2)]
    ev.sort()
    times = [t for t, _ in ev]
    legs: dict[str, list[int]] = {k: [] for k in LEGS}
    n = len(client) // 3
    for p in range(n):
        t0, t1, t2 = client[3 * p], client[3 * p + 1], client[3 * p + 2]
        end = client[3 * p + 3] if p + 1 < n else t2 + 10**8
        j = bisect.bisect_left(times, t0)
        seq = []
        while j < len(ev) and ev[j][0] < end:
            seq.append(ev[j])
            j += 1

        def first(kind: int, after: int | None) -> int | None:
            if after is None:
                return None
            for t, k in seq:
                if k == kind and t >= after:
                    return t
            return None

        a = first(_RECV, t0)
        a_dec = first(_DECODED, a)
        ack = first(_SENT, a)
        work = first(_DEFERRED, a)
        d = first(_RECV, max(t1, work) if work is not None else t1)
        d_dec = first(_DECODED, d)
        d_hand = first(_HANDLED, d_dec)
        e = first(_SENT, d_hand)
        if a is None or a_dec is None or ack is None or work is None or d is None or d_dec is None \
                or d_hand is None or e is None:
            continue
        for k, v in zip(LEGS, (a - t0, a_dec - a, ack - a_dec, t1 - ack, d - t1, d_dec - d, d_hand - d_dec,
                                e - d_hand, t2 - e, t2 - t0, work - ack)):
            legs[k].append(v)
    return legs


def main(argv: list[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["--stamped-server"]:
        return _stamped_server(args_in[1], args_in[2:])
    parser = argparse.ArgumentParser(prog="mpcache-bench pairsplit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3000, help="timed pairs per server (after 1,000 untimed)")
    parser.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    parser.add_argument("--form", choices=("list", "packed"), default="list",
                        help="token ids as LMCache's client sends them (list) or as mpcache's does (packed)")
    parser.add_argument("--l1-size-gb", type=float, default=0.25)
    parser.add_argument("--warmup", type=int, default=1000)
    args = parser.parse_args(args_in)

    from mpcache.bench import bench_rpc as b

    workdir = tempfile.mkdtemp(prefix="mpcache-bench-pairsplit-")
    stamps_path = os.path.join(workdir, "stamps")
    url = b.server_url(args.transport, workdir, "mpcache")
    server_argv = [sys.executable, "-m", "mpcache.bench.bench_pairsplit", "--stamped-server", stamps_path,
                   "--l1-size-gb", str(args.l1_size_gb), "--slot-mb", "1", "--log-level", "WARNING", "--no-metrics"]
    if args.transport == "tcp":
        server_argv += ["--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1]]
    else:
        server_argv += ["--ipc", url[len("ipc://"):]]
    load = os.getloadavg()
    server = b.start_server("mpcache", args.transport, server_argv, url, workdir, env=b.env_with_repo())
    raw = None
    try:
        b.prestore_mpcache(url)
        raw = b.start_raw(args.transport, workdir)
        frames = b.Frames.build("split")
        ctx: zmq.Context[Any] = zmq.Context.instance()
        ms, rs = b.dealer(ctx, url), b.dealer(ctx, raw.url)
        packed = args.form == "packed"
        _pairs(ms, frames, args.warmup, packed, None)
        _pairs(rs, frames, args.warmup, packed, None)
        client: array.array[int] = array.array("q")
        raw_client: array.array[int] = array.array("q")
        done = 0
        while done < args.pairs:  # alternating blocks: both see the same background load
            k = min(500, args.pairs - done)
            _pairs(rs, frames, k, packed, raw_client)
            _pairs(ms, frames, k, packed, client)
            done += k
        ms.close()
        rs.close()
    finally:
        server.stop()
        if raw is not None:
            raw.stop()
    stamps: array.array[int] = array.array("q")
    with open(stamps_path, "rb") as f:
        stamps.frombytes(f.read())
    legs = split(client, stamps)
    med = statistics.median
    raw_one = med(raw_client[i + 1] - raw_client[i] for i in range(0, len(raw_client), 3)) / 1e3
    raw_pair = med(raw_client[i + 2] - raw_client[i] for i in range(0, len(raw_client), 3)) / 1e3
    print(f"# mpcache-bench pairsplit: {args.transport}, {args.form} ids, {args.pairs} pairs after {args.warmup}, "
          f"{len(legs['pair'])} matched; {os.cpu_count()} cores, load average before "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("| leg | median µs |")
    print("|---|---:|")
    print(f"| raw pyzmq echo: one round trip | {raw_one:.1f} |")
    print(f"| raw pyzmq echo: the pair (two round trips) | {raw_pair:.1f} |")
    for k in LEGS:
        if legs[k]:
            print(f"| {k} | {med(legs[k]) / 1e3:.1f} |")
    if legs["pair"]:
        print(f"| pair / raw pair | {med(legs['pair']) / 1e3 / raw_pair:.2f}x |")
    return 0 if legs["pair"] else 1


if __name__ == "__main__":
    sys.exit(main())
