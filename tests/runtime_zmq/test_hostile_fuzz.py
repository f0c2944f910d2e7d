"""A seeded stream of malformed and adversarial messages against a live server: well-formed
requests of every op with hostile values, then mutated (bytes flipped, truncated, frames dropped,
duplicated or swapped, msgpack headers declaring huge lengths, deep nesting, container bombs,
oversized frames, unreadable uids). The oracles: the server never crashes; every message whose
uid is readable gets exactly one reply and no other gets any; an honest client's hits and bytes
are the same afterwards. 10,000 frames by default, 100,000 under ``-m slow``
(``MPCACHE_FUZZ_SEED`` picks another stream)."""

from __future__ import annotations

import os
import random
import struct
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from live_server import RawDealer, ServerProcess
from mpcache.runtime_zmq.client import MPCacheClient
from mpcache.runtime_zmq.l1_pool import MappedSegment
from test_server_ops import OBJ_BYTES, key, pattern, register, store_chunks, tokens

P = msgpack.packb
HONEST_INSTANCE = 1

OPS = ["noop", "ping", "get_chunk_size", "lookup", "query_prefetch_status", "wait_prefetch_status",
       "free_lookup_locks", "end_session", "clear", "report_block_allocation", "store", "retrieve", "health",
       "stats", "l1_info", "register_instance", "unregister_instance", "prepare_store", "prepare_retrieve",
       "commit_store", "commit_retrieve", "bogus", ""]
LEGACY_IDS = [1, 2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16, 19, 20, 21, 22, 23, 24, 32, 99, -1, 2**31]


class Hostile:
    """Draws one adversarial message at a time from a seeded generator."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)
        self.uid = 10**9

    def scalar(self) -> Any:
        r = self.r
        return r.choice([
            None, True, False, 0, -1, 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 1e15, -0.0, float("nan"),
            float("inf"), "", "x" * r.randint(1, 300), b"", os.urandom(r.randint(1, 80)), r.randint(-9, 9),
        ])

    def value(self, depth: int = 0) -> Any:
        r = self.r
        roll = r.random()
        if depth > 3 or roll < 0.6:
            return self.scalar()
        if roll < 0.8:
            return [self.value(depth + 1) for _ in range(r.randint(0, 5))]
        return {str(self.scalar())[:8]: self.value(depth + 1) for _ in range(r.randint(0, 5))}

    def instance_id(self) -> Any:
        # never the honest client's instance (ownership of instances is core_sm's, not this test's)
        return self.r.choice([2, 3, 77, 2**40, -1, None, "1", 1.0, self.value()])

    def fuzz_key(self) -> Any:
        r = self.r
        n = r.choice([0, 1, 255, 256, 512, 1000])
        toks: Any = r.choice([
            list(range(n)), struct.pack(f"<{n}I", *range(n)), [r.randint(-(2**40), 2**40) for _ in range(4)],
            b"\x00" * 7, self.value(), list(range(20_000)),
        ])
        k: dict[str, Any] = {
            "model_name": r.choice(["m", "m", "other", "m" * 300, self.value()]),
            "world_size": r.choice([1, 1, 2, 0, -1, 4096, 4097, 2**40, self.value()]),
            "worker_id": r.choice([None, 0, 1, -1, 2**40, self.value()]),
            "token_ids": toks,
            "start": r.choice([0, 256, -256, 2**40, self.value()]),
            "end": r.choice([0, 256, 512, 2**40, -1, self.value()]),
            "request_id": r.choice([f"fuzz-{r.randint(0, 50)}", "", "r" * 300, self.value()]),
            "cache_salt": r.choice(["", "s", "s" * 2000, self.value()]),
            "num_kv_readers": r.choice([0, 1, 8, 2**40, -1, self.value()]),
        }
        if r.random() < 0.2:
            k["key_identity"] = r.choice(["lora:x", "i" * 2000, self.value()])
            k["chunk_extras"] = r.choice([[b"\x01" * 16], [b"\x01" * 100], [self.value()], list(range(5000)), self.value()])
        if r.random() < 0.2:
            for name in r.sample(sorted(k), r.randint(1, 3)):
                del k[name]
        return k

    def payload(self, op: str) -> list[Any]:
        r = self.r
        if op in ("lookup", "free_lookup_locks"):
            return [self.fuzz_key(), r.choice([1, 2, 2**40, None, self.value()])]
        if op in ("query_prefetch_status", "end_session"):
            return [r.choice([f"fuzz-{r.randint(0, 50)}", "r" * 300, self.value()])]
        if op == "wait_prefetch_status":
            return [f"fuzz-{r.randint(0, 50)}", r.choice([0.0, 0.01, -1.0, 1e300, float("nan"), self.value()])]
        if op == "clear":
            return [r.choice([True, False, self.value()]), r.choice(["guess-the-token", self.value()])][: r.randint(0, 2)]
        if op in ("store", "retrieve"):
            blocks = r.choice([[1, 2], list(range(200_000)), [-1], [2**40], [self.value()], self.value()])
            out = [self.fuzz_key(), self.instance_id(), blocks, r.choice([b"\x01" * 64, b"", self.value()])]
            if op == "retrieve":
                out.append(r.choice([0, 16, -1, 2**40]))
            if r.random() < 0.5:
                out.append(r.choice([None, 1e15, -1.0, float("nan"), self.value()]))
            return out
        if op == "register_instance":
            layout = {"model_name": "m", "world_size": 1, "object_bytes": r.choice([-1, 0, 2**40, "x", None]),
                      "engine_driven": r.choice([True, False, self.value()])}
            return [self.instance_id(), r.choice([layout, self.value()])]
        if op == "unregister_instance":
            return [self.instance_id()]
        if op in ("prepare_store", "prepare_retrieve"):
            return [self.fuzz_key(), self.instance_id(), self.value()][: r.randint(1, 3)]
        if op in ("commit_store", "commit_retrieve"):
            return [r.choice([0, 1, 2, 2**63 - 1, -1, self.value()]), r.choice([True, False, self.value()])]
        if op == "report_block_allocation":
            return [self.value() for _ in range(r.randint(0, 3))]
        return [self.value() for _ in range(r.randint(0, 2))]

    def mutate(self, frames: list[bytes]) -> list[bytes]:
        r = self.r
        f = list(frames)
        kind = r.randint(0, 11)
        i = r.randrange(1, len(f)) if len(f) > 1 else 0
        if kind == 0 and f[i]:  # flip bytes
            b = bytearray(f[i])
            for _ in range(r.randint(1, 4)):
                b[r.randrange(len(b))] ^= 1 << r.randrange(8)
            f[i] = bytes(b)
        elif kind == 1:  # truncate
            f[i] = f[i][: r.randrange(len(f[i]) + 1)]
        elif kind == 2:  # drop a frame
            del f[i]
        elif kind == 3:  # duplicate a frame
            f.insert(i, f[i])
        elif kind == 4 and len(f) > 2:  # swap two payload/op frames
            j = r.randrange(1, len(f))
            f[i], f[j] = f[j], f[i]
        elif kind == 5:  # a header that declares far more than follows
            f[i] = r.choice([b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff\x00",
                             b"\xdb\x7f\xff\xff\xff", b"\xd9\xff"])
        elif kind == 6:  # deep nesting
            f[i] = b"\x91" * r.choice([100, 10_000, 100_000]) + b"\xc0"
        elif kind == 7:  # a container bomb: many empty maps or arrays
            n = r.choice([1000, 100_000, 1 << 20])
            f[i] = b"\xdd" + struct.pack(">I", n) + r.choice([b"\x80", b"\x90"]) * n
        elif kind == 8:  # an ext type, a pickled-looking value
            f[i] = r.choice([msgpack.packb(msgpack.ExtType(1, b"x")), b"\x80\x04\x95", b"\xc1"])
        elif kind == 9:  # trailing bytes after a valid value
            f[i] = f[i] + os.urandom(r.randint(1, 8))
        elif kind == 10:  # many small frames
            f = f + [b"\xc0"] * r.choice([5, 17, 40])
        else:  # pure noise
            f[i] = os.urandom(r.randint(0, 64))
        return f

    def message(self) -> tuple[list[bytes], bool]:
        """(frames, attributable)."""
        r = self.r
        self.uid += 1
        uid_frame = P(self.uid)
        roll = r.random()
        if roll < 0.03:
            uid_frame = r.choice([b"", P("x"), P(None), P(1.5), os.urandom(5), b"\xcf" + b"\x00" * 20])
        op: Any = r.choice(OPS) if r.random() < 0.8 else r.choice(LEGACY_IDS)
        frames = [uid_frame, P(op)] + [P(a, use_bin_type=True) for a in self.payload(op if isinstance(op, str) else "noop")]
        if r.random() < 0.5:
            frames = self.mutate(frames)
        if r.random() < 0.002:
            frames = frames[:2] + [b"\x00" * (20 << 20)]  # over the frame limit: too_large
        if not frames:
            frames = [b""]
        uid_ok = False
        if len(frames[0]) <= 16:
            try:
                uid_ok = type(msgpack.unpackb(frames[0])) is int
            except Exception:
                uid_ok = False
        return frames, uid_ok


def honest_view(c: MPCacheClient, toks: list[int]) -> tuple[int, list[bytes]]:
    """The honest client's hits and the bytes it retrieves."""
    rid = f"honest-{time.monotonic_ns()}"
    assert c.lookup(key(toks, rid)).result(10) is None
    hits = int(c.query_prefetch_status(rid).result(10))
    c.end_session(rid).result(10)
    plan = c.prepare_retrieve(key(toks, rid, worker_id=0), HONEST_INSTANCE).result(10)
    data: list[bytes] = []
    if plan["ok"]:
        seg = MappedSegment(plan["segment"], plan["slot_bytes"], 1 << 30)
        try:
            data = [bytes(seg.view(slot, OBJ_BYTES)) for _c, slot, _o in plan["placements"]]
        finally:
            seg.close()
        assert c.commit_retrieve(plan["transfer_id"], True).result(10)["ok"]
    return hits, data


@pytest.fixture(scope="module")
def target() -> Iterator[tuple[ServerProcess, MPCacheClient, list[int]]]:
    sp = ServerProcess(["--port", "0", "--l1-size-gb", "0.25", "--slot-mb", "1", "--metrics-port", "0"]).start()
    c = MPCacheClient(sp.url, request_timeout=10.0)
    register(c, HONEST_INSTANCE)
    toks = tokens(4, seed=11)
    assert store_chunks(c, toks, "honest", HONEST_INSTANCE, seed=5)["ok"]
    yield sp, c, toks
    c.close()
    sp.kill()


def run_fuzz(target: tuple[ServerProcess, MPCacheClient, list[int]], frames_wanted: int, seed: int) -> dict[str, int]:
    sp, c, toks = target
    before = honest_view(c, toks)
    assert before[0] == 4 and before[1] == [pattern(i, 5) for i in range(4)]
    gen = Hostile(seed)
    raw = RawDealer(sp.url)
    sent_frames = messages = answered = 0
    try:
        while sent_frames < frames_wanted:
            expected: set[bytes] = set()
            for _ in range(64):
                frames, attributable = gen.message()
                raw.send(frames)
                sent_frames += len(frames)
                messages += 1
                if attributable:
                    assert frames[0] not in expected
                    expected.add(frames[0])
            sentinel = P(gen.uid + 10**12)
            raw.send([sentinel, P("noop")])
            got: set[bytes] = set()
            while True:
                reply = raw.recv(20.0)
                assert reply is not None, f"server stopped answering after {messages} messages (seed {seed})"
                if reply[0] == sentinel:
                    assert reply == [sentinel, P("noop"), P("OK")]
                    if got == expected:
                        break
                    continue
                assert reply[0] in expected, f"a reply to a message that had no readable uid: {reply[:2]!r}"
                assert reply[0] not in got, f"two replies to one message: {reply[:2]!r}"
                got.add(reply[0])
                answered += 1
            assert sp.alive, "the server died"
    finally:
        raw.close()
    assert sp.alive
    after = honest_view(c, toks)
    assert after == before, "the honest client's hits or bytes changed"
    stats = c.stats()
    print(f"fuzz seed {seed}: {messages} messages, {sent_frames} frames, {answered} answered; "
          f"loop max {stats['loop_max_message_cpu_ms']:.2f} ms cpu / {stats['loop_max_message_ms']:.2f} ms wall")
    return {"messages": messages, "frames": sent_frames, "answered": answered}


def test_fuzz_10k_frames(target: tuple[ServerProcess, MPCacheClient, list[int]]) -> None:
    out = run_fuzz(target, 10_000, int(os.environ.get("MPCACHE_FUZZ_SEED", "1")))
    assert out["frames"] >= 10_000 and out["answered"] > out["messages"] // 2


@pytest.mark.slow
def test_fuzz_100k_frames(target: tuple[ServerProcess, MPCacheClient, list[int]]) -> None:
    out = run_fuzz(target, 100_000, int(os.environ.get("MPCACHE_FUZZ_SEED", "2")))
    assert out["frames"] >= 100_000
