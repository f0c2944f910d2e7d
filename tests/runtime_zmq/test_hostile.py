"""Hostile clients at the wire and runtime level (issue "Hostile and mixed clients"): each finding
is replayed against a real server process and must be refused with one typed reply, quickly,
without growing the server, and without changing what an honest client sees."""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from live_server import REPO, RawDealer, ServerProcess, wait_for
from mpcache.runtime_zmq import auth
from mpcache.runtime_zmq.client import MPCacheClient, RemoteError
from test_server_ops import key, register, store_chunks, tokens

P = msgpack.packb
MiB = 1 << 20


def U(b: bytes) -> Any:
    return msgpack.unpackb(b, raw=False)


def proc_mib(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    raise KeyError(field)


def error_kind(reply: list[bytes] | None) -> str:
    assert reply is not None, "no reply"
    assert reply[1] == P("error"), reply[:2]
    return str(U(reply[2])["kind"])


def honest_hits(c: MPCacheClient, toks: list[int], rid: str) -> int:
    assert c.lookup(key(toks, rid)).result(5) is None
    hits = c.query_prefetch_status(rid).result(5)
    c.end_session(rid).result(5)
    return int(hits)


def cpu_ms(c: MPCacheClient) -> float:
    return float(c.stats()["loop_max_message_cpu_ms"])


@pytest.fixture
def victim(start_server: Callable[..., ServerProcess]) -> tuple[ServerProcess, MPCacheClient, RawDealer, list[int]]:
    sp = start_server()
    c = MPCacheClient(sp.url, request_timeout=10.0)
    register(c, 1)
    toks = tokens(4, seed=3)
    assert store_chunks(c, toks, "victim")["ok"]
    assert honest_hits(c, toks, "before") == 4
    # numba's import (the list-form token scanner, loaded in the background) is ~100 MiB of RSS:
    # measure growth from after it
    assert wait_for(lambda: c.stats()["token_scanner_ready"], timeout=60)
    raw = RawDealer(sp.url)
    yield sp, c, raw, toks
    raw.close()
    c.close()


# ---------------------------------------------------------------------------------------------
# Bounds before any work


def test_world_size_bomb_is_refused_at_once(victim: Any) -> None:
    # 1 KB free_lookup_locks with world_size 2**40 held the old loop 23 s and grew it 2.4 GB
    sp, c, raw, toks = victim
    rss0 = proc_mib(sp.proc.pid, "VmRSS")
    for uid, op in ((1, "free_lookup_locks"), (2, "lookup")):
        bomb = key(list(range(256)), "bomb", world_size=2**40)
        t0 = time.monotonic()
        assert error_kind(raw.request([P(uid), P(op), P(bomb), P(1)])) == "validation"
        assert time.monotonic() - t0 < 2.0
    # in bounds but chunks x ranks too many: 1M tokens x 4096 ranks
    big = key(list(range(1 << 20)), "bomb", world_size=4096)
    assert error_kind(raw.request([P(3), P("lookup"), msgpack.packb(big), P(1)])) == "too_large"
    assert c.noop() == "OK"
    assert proc_mib(sp.proc.pid, "VmRSS") - rss0 < 64
    assert honest_hits(c, toks, "after") == 4


def test_a_frame_of_empty_maps_stops_after_a_few(victim: Any) -> None:
    # an 8 MiB frame of empty maps peaked the old server at +595 MiB
    sp, c, raw, toks = victim
    n = 8 * MiB
    frame = b"\xdd" + struct.pack(">I", n) + b"\x80" * n  # array32 of n fixmaps
    hwm0 = proc_mib(sp.proc.pid, "VmHWM")
    for uid, op in ((1, "lookup"), (2, "report_block_allocation"), (3, "register_instance")):
        payloads = [frame, P(1)] if op == "lookup" else ([frame] if op != "register_instance" else [P(9), frame])
        kind = error_kind(raw.request([P(uid), P(op), *payloads], timeout=10))
        assert kind in ("too_large", "undecodable"), (op, kind)
    # the same bomb hidden inside a key's token list
    k = key([], "maps")
    packed = msgpack.packb(k)
    inner = b"\xdd" + struct.pack(">I", 1 << 20) + b"\x80" * (1 << 20)
    bomb = packed.replace(msgpack.packb("token_ids") + b"\x90", msgpack.packb("token_ids") + inner)
    assert error_kind(raw.request([P(4), P("lookup"), bomb, P(1)])) == "too_large"
    # the frames themselves (8 MiB each, in zmq and in one Python bytes) are all it costs
    assert proc_mib(sp.proc.pid, "VmHWM") - hwm0 < 80
    assert cpu_ms(c) < 10.0
    assert honest_hits(c, toks, "after") == 4


def test_an_oversized_multipart_message_is_answered_without_being_joined(victim: Any) -> None:
    # 20 frames x 4 MiB (80 MiB, over --max-message-mb): the old loop buffered the whole message
    # (twice) before bad_arity; it is answered too_large, the loop adding no copy
    sp, c, raw, toks = victim
    hwm0 = proc_mib(sp.proc.pid, "VmHWM")
    chunk = b"\x00" * (4 * MiB)
    reply = raw.request([P(1), P("noop"), *([chunk] * 20)], timeout=30)
    assert error_kind(reply) == "too_large"
    grown = proc_mib(sp.proc.pid, "VmHWM") - hwm0
    # zmq delivers a message whole (its frames sit in zmq until the last one arrived); the loop
    # adds no copy of them: at most the message plus one frame
    assert grown < 80 + 64, grown
    assert cpu_ms(c) < 10.0
    assert c.stats()["oversized_messages"] == 1
    # 80 frames x 4 MiB: more than zmq may hold for one connection (4 x --max-message-mb): the
    # connection is cut before the message is whole (hostile finding 6: 320 MiB were buffered)
    hwm0 = proc_mib(sp.proc.pid, "VmHWM")
    raw.send([P(2), P("noop"), *([chunk] * 80)])
    assert raw.recv(3) is None
    assert wait_for(lambda: c.stats()["connections_cut"] == 1, timeout=5)
    assert proc_mib(sp.proc.pid, "VmHWM") - hwm0 < 128 + 160
    # a frame over twice the frame limit is cut off by zmq itself: that peer is disconnected
    assert c.noop() == "OK" and honest_hits(c, toks, "after") == 4


def test_long_model_names_and_request_ids_are_refused(victim: Any) -> None:
    sp, c, raw, toks = victim
    rss0 = proc_mib(sp.proc.pid, "VmRSS")
    huge = key(list(range(256)), "r")
    huge["model_name"] = "m" * (16 * MiB - 64)  # 16 MiB model names were accepted and kept
    assert error_kind(raw.request([P(1), P("lookup"), P(huge), P(1)], timeout=10)) == "too_large"
    long_name = key(list(range(256)), "r")
    long_name["model_name"] = "m" * 257
    assert error_kind(raw.request([P(2), P("lookup"), P(long_name), P(1)])) == "too_large"
    assert error_kind(raw.request([P(3), P("lookup"), P(key(list(range(256)), "r" * 300)), P(1)])) == "too_large"
    assert error_kind(raw.request([P(4), P("end_session"), P("r" * 300)])) == "too_large"
    layout = {"model_name": "m" * 300, "world_size": 1, "object_bytes": 4096, "engine_driven": True}
    assert error_kind(raw.request([P(5), P("register_instance"), P(2), P(layout)])) == "undecodable"
    assert proc_mib(sp.proc.pid, "VmRSS") - rss0 < 48
    assert honest_hits(c, toks, "after") == 4


def test_stores_for_an_unregistered_instance_retain_nothing(victim: Any) -> None:
    # 30 stores (200k block ids, not_after=1e15) for an unregistered instance retained 234 MiB
    sp, c, raw, toks = victim
    rss0 = proc_mib(sp.proc.pid, "VmRSS")
    k = key(tokens(1), "ghost", worker_id=0)
    blocks = list(range(1_000_000, 1_200_000))
    for i in range(30):
        reply = raw.request([P(i), P("store"), P(k), P(77), P(blocks), P(b"\x01" * 64), P(1e15)])
        assert error_kind(reply) == "too_large"
    # within the block-id limit but more block ids than the key has tokens
    for i in range(30, 40):
        reply = raw.request([P(i), P("store"), P(k), P(77), P(blocks[:1000]), P(b"\x01" * 64), P(1e15)])
        assert error_kind(reply) == "undecodable"
    assert proc_mib(sp.proc.pid, "VmRSS") - rss0 < 48
    assert honest_hits(c, toks, "after") == 4


def test_far_future_deadlines_are_clamped() -> None:
    from mpcache.runtime_zmq import wire

    frames = [b"peer", P(1), P("prepare_store"), P(key(tokens(1), "r", worker_id=0)), P(1), P(1e15)]
    req = wire.decode_request(frames, wire.Limits())
    assert isinstance(req, wire.Request)
    ev = wire.to_event(req, "rt", now=100.0, limits=wire.Limits())
    assert ev.not_after == 160.0
    # a deadline already near is kept as sent
    assert wire.to_event(req, "rt", now=1e15, limits=wire.Limits()).not_after == 1e15


def test_admin_clear(start_server: Callable[..., ServerProcess], tmp_path: Any) -> None:
    # a second connection's clear(force) wiped another client's cache
    token = secrets.token_hex(16)
    path = tmp_path / "admin"
    path.write_text(token + "\n")
    os.chmod(path, 0o600)
    sp = start_server("--admin-token-file", str(path))
    with MPCacheClient(sp.url) as c:
        register(c, 1)
        toks = tokens(2)
        assert store_chunks(c, toks, "v")["ok"]
        for bad in (None, "wrong-token-wrong-token"):
            with pytest.raises(RemoteError, match="forbidden"):
                c.clear(True, bad).result(5)
        assert honest_hits(c, toks, "kept") == 2
        assert c.clear(True, token).result(5) is None
        assert honest_hits(c, toks, "gone") == 0
    # a token file others can read is refused at start
    os.chmod(path, 0o644)
    with pytest.raises(RuntimeError, match="mode 600"):
        start_server("--admin-token-file", str(path))


# ---------------------------------------------------------------------------------------------
# The loop never blocks on one message


def test_loop_block_time_under_the_bombs(victim: Any) -> None:
    """The issue's three bombs in a row while an honest client keeps asking: the loop's longest
    message (its thread's CPU time) stays under 10 ms and the honest client's answers keep coming."""
    sp, c, raw, toks = victim
    n = 8 * MiB
    maps = b"\xdd" + struct.pack(">I", n) + b"\x80" * n
    bombs = [
        [P(1), P("free_lookup_locks"), P(key(list(range(256)), "b", world_size=2**40)), P(1)],
        [P(2), P("lookup"), maps, P(1)],
        [P(3), P("noop"), *([b"\x00" * (4 * MiB)] * 20)],
    ]
    for frames in bombs:
        raw.send(frames)
    worst = 0.0
    for _ in range(20):
        t0 = time.monotonic()
        assert c.noop() == "OK"
        worst = max(worst, time.monotonic() - t0)
    kinds = sorted(error_kind(raw.recv(30)) for _ in bombs)
    assert kinds == ["too_large", "too_large", "validation"]
    s = c.stats()
    print(f"loop max message: {s['loop_max_message_ms']:.2f} ms wall, {s['loop_max_message_cpu_ms']:.2f} ms cpu; "
          f"VmHWM {proc_mib(sp.proc.pid, 'VmHWM'):.0f} MiB, VmRSS {proc_mib(sp.proc.pid, 'VmRSS'):.0f} MiB; "
          f"honest noop worst {worst * 1000:.1f} ms")
    assert s["loop_max_message_cpu_ms"] < 10.0
    assert honest_hits(c, toks, "after") == 4


# ---------------------------------------------------------------------------------------------
# IPC directory and socket path


def _start_fails(args: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, "-m", "mpcache.runtime_zmq.cli", *args, "--l1-size-gb", "0.01", "--slot-mb", "1", "--no-metrics"],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert p.returncode != 0, p.stdout + p.stderr
    return p.stdout + p.stderr


def test_a_world_writable_ipc_directory_is_refused(tmp_path: Any) -> None:
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    out = _start_fails(["--ipc", str(d / "mpcache.sock")])
    assert "writable by group or others" in out
    assert not (d / "mpcache.sock").exists()


def test_a_symlinked_ipc_directory_is_refused(tmp_path: Any) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    assert "not a directory" in _start_fails(["--ipc", str(tmp_path / "link" / "mpcache.sock")])


def test_a_file_at_the_socket_path_is_never_deleted(tmp_path: Any) -> None:
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    victim_file = d / "mpcache.sock"
    victim_file.write_text("precious")
    assert "not a socket" in _start_fails(["--ipc", str(victim_file)])
    assert victim_file.read_text() == "precious"


def test_a_live_socket_is_taken_over_for_a_restart(start_server: Callable[..., ServerProcess], tmp_path: Any) -> None:
    # a supervisor starts the new server while the old one still runs: the path moves to the new
    path = tmp_path / "run" / "mpcache.sock"
    old = start_server("--ipc", str(path))
    new = start_server("--ipc", str(path))
    assert any("taking over" in line for line in new.log)
    with MPCacheClient(new.url) as c:
        assert c.health()["pid"] == new.proc.pid
    assert old.alive


def test_a_stale_socket_is_replaced_and_the_directory_tightened(start_server: Callable[..., ServerProcess], tmp_path: Any) -> None:
    d = tmp_path / "run"
    d.mkdir()
    os.chmod(d, 0o755)
    path = str(d / "mpcache.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()  # bound, nobody listening: what a killed server leaves
    sp = start_server("--ipc", path)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with MPCacheClient(sp.url) as c:
        assert c.noop() == "OK"


# ---------------------------------------------------------------------------------------------
# CURVE


def test_curve_admits_only_authorized_keys(start_server: Callable[..., ServerProcess], tmp_path: Any) -> None:
    import zmq

    keys = str(tmp_path / "keys")
    auth.keygen(keys, "engine")
    other = str(tmp_path / "other")
    auth.keygen(other, "intruder")
    sp = start_server("--curve-dir", keys)
    ctx = zmq.Context()
    try:
        def ask(configure: Callable[[Any], None] | None) -> list[bytes] | None:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # a refused handshake can drop the connection before the send: without a timeout
            # the DEALER would wait for a peer forever
            sock.setsockopt(zmq.SNDTIMEO, 1500)
            if configure is not None:
                configure(sock)
            sock.connect(sp.url)
            try:
                sock.send_multipart([P(1), P("noop")])
                return sock.recv_multipart() if sock.poll(1500) else None
            except zmq.Again:
                return None
            finally:
                sock.close(0)

        assert ask(None) is None  # plain peer: the handshake fails, the server sees nothing
        assert ask(lambda s: auth.client_curve(s, other, "intruder")) is None  # unknown key

        def wrong_server_key(s: Any) -> None:
            auth.client_curve(s, keys, "engine")
            s.curve_serverkey = zmq.auth.load_certificate(os.path.join(other, "server.key"))[0]

        assert ask(wrong_server_key) is None
        assert ask(lambda s: auth.client_curve(s, keys, "engine")) == [P(1), P("noop"), P("OK")]
        with MPCacheClient(sp.url, curve_dir=keys, curve_client="engine") as c:
            assert c.noop() == "OK"
            s = c.stats()
            assert s["malformed"] == 0 and s["wire_errors"] == 0  # the refused peers never reached the loop
    finally:
        ctx.term()


def test_keygen_command_writes_private_keys(tmp_path: Any) -> None:
    d = tmp_path / "k"
    env = dict(os.environ, PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, "-m", "mpcache.runtime_zmq.cli", "keygen", str(d)], capture_output=True, text=True,
                       cwd=REPO, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    for name in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE(os.stat(d / name).st_mode) == 0o600
    assert (d / "authorized" / "client.key").exists() and (d / "server.key").exists()
    again = subprocess.run([sys.executable, "-m", "mpcache.runtime_zmq.cli", "keygen", str(d)], capture_output=True,
                           text=True, cwd=REPO, env=env, timeout=60)
    assert again.returncode == 1 and "exists" in again.stdout


# ---------------------------------------------------------------------------------------------
# /dev/shm hygiene


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_orphan_segments_are_removed_at_start(start_server: Callable[..., ServerProcess], tmp_path: Any) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    dead = _dead_pid()
    orphans = [shm / f"mpcache-{dead}-{secrets.token_hex(4)}" for _ in range(3)]
    for o in orphans:
        o.write_bytes(b"\x00" * 4096)
    alive = shm / f"mpcache-{os.getpid()}-{secrets.token_hex(4)}"  # a live process's
    alive.write_bytes(b"x")
    held = shm / f"mpcache-{_dead_pid()}-{secrets.token_hex(4)}"  # locked: someone still owns it
    held.write_bytes(b"x")
    fd = os.open(held, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    other = shm / f"other-{dead}-{secrets.token_hex(4)}"
    other.write_bytes(b"x")
    try:
        sp = start_server("--shm-dir", str(shm))
        left = sorted(p.name for p in shm.iterdir())
        assert not any(o.exists() for o in orphans), left
        assert alive.exists() and held.exists() and other.exists()
        ours = [n for n in left if n.startswith(f"mpcache-{sp.proc.pid}-")]
        assert len(ours) == 1  # the new server's own segment, reserved at start
        assert "removed 3 segment(s)" in "\n".join(sp.log)
    finally:
        os.close(fd)


def test_a_killed_servers_segment_is_removed_by_the_next(start_server: Callable[..., ServerProcess], tmp_path: Any) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    first = start_server("--shm-dir", str(shm))
    seg = [p for p in shm.iterdir()]
    assert len(seg) == 1
    first.kill()  # SIGKILL: no cleanup
    assert seg[0].exists()
    start_server("--shm-dir", str(shm))
    assert not seg[0].exists()


def test_no_room_for_l1_is_a_clear_start_up_error(monkeypatch: Any, tmp_path: Any) -> None:
    from mpcache.runtime_zmq import l1_pool

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    pool = l1_pool.SharedMemoryPool(8 * MiB, MiB, directory=str(tmp_path))
    with pytest.raises(l1_pool.ReservationError, match="lower --l1-size-gb"):
        pool.ensure()
    assert list(tmp_path.iterdir()) == []  # nothing left behind
    reserved = l1_pool.SharedMemoryPool(8 * MiB, MiB, directory=tempfile.mkdtemp(dir=tmp_path))
    monkeypatch.undo()
    reserved.ensure()
    assert os.stat(reserved.path).st_blocks * 512 >= 8 * MiB  # pages allocated, not sparse
    reserved.close()


# ---------------------------------------------------------------------------------------------
# Ownership: the runtime names the peer of every request (core_sm refuses foreign ones)


def test_another_connection_cannot_touch_a_clients_request_or_transfer(victim: Any) -> None:
    # Any client could end_session / free_lookup_locks another's request id, and commit another
    # client's plan before the victim wrote anything. A request id names a request of the sender's
    # own: another connection naming it ends, frees and queries nothing of the victim's.
    sp, c, raw, toks = victim
    assert c.lookup(key(toks, "mine")).result(5) is None
    assert c.query_prefetch_status("mine").result(5) == 4
    assert c.lookup(key(toks, "mine2")).result(5) is None  # answered later: the job stays DONE
    leases = c.stats()["leases_held"]
    assert raw.request([P(1), P("end_session"), P("mine2")]) == [P(1), P("end_session")]
    assert raw.request([P(2), P("free_lookup_locks"), P(key(toks, "mine2")), P(1)]) == [P(2), P("free_lookup_locks")]
    assert raw.request([P(3), P("query_prefetch_status"), P("mine2")]) == [P(3), P("query_prefetch_status"), P(0)]
    assert c.stats()["leases_held"] == leases
    assert c.query_prefetch_status("mine2").result(5) == 4
    c.end_session("mine2").result(5)
    other = tokens(2, seed=99)
    plan = c.prepare_store(key(other, "w", worker_id=0), 1).result(5)
    assert plan["ok"]
    assert error_kind(raw.request([P(4), P("commit_store"), P(plan["transfer_id"]), P(True)])) in ("forbidden", "unknown_transfer")
    assert error_kind(raw.request([P(5), P("unregister_instance"), P(1)])) == "forbidden"
    assert c.commit_store(plan["transfer_id"], False).result(5)["ok"] is False  # still the victim's to end
    assert c.query_prefetch_status("mine").result(5) == 4  # the job is untouched
    c.end_session("mine").result(5)
    assert honest_hits(c, toks, "after") == 4



def test_million_token_lookups_do_not_retain_their_tokens(victim: Any) -> None:
    # 40 one-million-token lookups retained +180 MiB (each job kept its 4 MiB key). A million
    # tokens is now past the default --max-tokens (512k: the keyed chunk hashing of one lookup
    # must keep the loop under 10 ms): refused before any work; 40 lookups at the limit retain
    # nothing of their 2 MiB keys.
    sp, c, raw, toks = victim
    rss0 = proc_mib(sp.proc.pid, "VmRSS")
    million = key([], "million")
    million["token_ids"], million["end"] = struct.pack(f"<{1 << 20}I", *range(1 << 20)), 1 << 20
    assert error_kind(raw.request([P(99), P("lookup"), P(million, use_bin_type=True), P(1)], timeout=10)) == "too_large"
    n = 1 << 19
    for i in range(40):
        packed = struct.pack(f"<{n}I", *range(i, i + n))
        big = key([], f"max-{i}")
        big["token_ids"], big["end"] = packed, n
        assert raw.request([P(i), P("lookup"), P(big, use_bin_type=True), P(1)], timeout=10) == [P(i), P("lookup")]
    assert c.stats()["jobs"] >= 40  # the jobs are alive; their tokens are not
    grown = proc_mib(sp.proc.pid, "VmRSS") - rss0
    assert grown < 40, grown
    assert cpu_ms(c) < 10.0
    assert honest_hits(c, toks, "after") == 4


def test_a_squatter_that_looks_up_the_victims_next_id_first_denies_it_nothing(victim: Any) -> None:
    # Request ids are often counters: a peer that looked up the id an honest engine would use next
    # (over junk tokens or over the victim's own) owned it, and the victim's lookup, status and
    # free were refused forbidden. Now the squatter's lookups make a request of its own.
    sp, c, raw, toks = victim
    assert c.stats()["leases_held"] == 0
    for i in range(10):
        squat = key(toks if i % 2 == 0 else tokens(1, seed=50), "cmpl-1")
        assert raw.request([P(100 + i), P("lookup"), P(squat), P(1)]) == [P(100 + i), P("lookup")]
    assert c.stats()["leases_held"] == 4  # the squatter's first lookup leased the prefix
    assert c.lookup(key(toks, "cmpl-1")).result(5) is None
    assert c.query_prefetch_status("cmpl-1").result(5) == 4  # a normal hit
    assert c.stats()["leases_held"] == 8
    assert c.free_lookup_locks(key(toks, "cmpl-1", start=0, end=256)).result(5) is None
    assert c.stats()["leases_held"] == 7
    c.end_session("cmpl-1").result(5)
    assert c.stats()["leases_held"] == 4  # the victim's own leases went, the squatter's stay
    assert honest_hits(c, toks, "cmpl-2") == 4
    # the squatter's request is its own: its status, then its end
    assert raw.request([P(200), P("query_prefetch_status"), P("cmpl-1")]) == [P(200), P("query_prefetch_status"), P(4)]
    assert raw.request([P(201), P("end_session"), P("cmpl-1")]) == [P(201), P("end_session")]
    assert c.stats()["leases_held"] == 0
