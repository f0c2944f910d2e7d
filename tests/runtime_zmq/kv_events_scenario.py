"""A live server's KV-event stream after a real store, an eviction and a clear (shared by
tests/runtime_zmq/test_kv_events.py and the vLLM-decoder test in tests/e2e).

``run_scenario(start_server)`` starts ``mpcache-server --kv-events ... --kv-events-replay ...``
with a 4-slot L1, subscribes, and drives the adapters in vLLM's call order (engine-driven CPU
path): prompt A (3 chunks) is stored, prompt B (2 chunks) evicts A's least recently used chunks,
then a forced clear. Returns the frames seen live, the replay from the first sequence number,
and A's and B's chunk hashes as the server computed them.
"""
from __future__ import annotations

import os
import random
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from mpcache.core_sm.chunks import ChunkChain
from mpcache.core_sm.keys import KeyExtras, keyed_root, request_identity
from mpcache.runtime_zmq.client import MPCacheClient
from adapter_driver import CHUNK, Engine

LORA = KeyExtras(request_identity(lora_name="tenant-lora", lora_path="/adapters/t"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_on_free_ports(start_server: Callable[..., Any], flags: Callable[..., Sequence[str]], n: int) -> tuple[Any, list[int]]:
    """``start_server(*flags(port, ...))`` with ``n`` ports that were free a moment ago: a port can
    be taken between the pick and the server's bind (its own ``--port 0`` may be given the same
    one), so a start refused with "Address already in use" picks new ones (five tries)."""
    for attempt in range(5):
        ports = [free_port() for _ in range(n)]
        try:
            return start_server(*flags(*ports)), ports
        except RuntimeError as e:
            if "Address already in use" not in str(e) or attempt == 4:
                raise
    raise AssertionError("unreachable")


def prompt(n_chunks: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n_chunks * CHUNK + 3)]


def hashes_of(tokens: list[int], extras: KeyExtras, chain_key: bytes, salt: str = "") -> tuple[bytes, ...]:
    chain = ChunkChain(chain_key)
    root = keyed_root(chain.root("tiny", 1, salt), extras.identity)
    return chain.hashes(tokens, CHUNK, root)


class Subscriber:
    """A SUB socket bound on loopback, as llm-d's central indexer binds one (the server's PUB
    connects to it), read continuously by its own thread -- as a real subscriber is: zmq hands
    a SUB's subscription to a new publisher only while the SUB's thread is using it."""

    def __init__(self, prefix: bytes = b"kv@") -> None:
        self.frames: list[list[bytes]] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.endpoint = ""
        self._thread = threading.Thread(target=self._run, args=(prefix,), daemon=True)
        self._thread.start()
        self._ready.wait(10.0)

    def _run(self, prefix: bytes) -> None:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, prefix)
        sub.bind("tcp://127.0.0.1:0")
        self.endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sub.poll(50):
                    self.frames.append(sub.recv_multipart())
        finally:
            sub.close(0)

    def wait_for(self, until: Callable[[list[list[bytes]]], bool], timeout: float) -> list[list[bytes]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not until(list(self.frames)):
            time.sleep(0.05)
        return list(self.frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)


def replay(url: str, start_seq: int, timeout: float = 10.0) -> list[list[bytes]]:
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(url)
    try:
        dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
        out = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not dealer.poll(100):
                continue
            frames = dealer.recv_multipart()
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                return out
            out.append(frames[1:])
        raise TimeoutError("no end of replay")
    finally:
        dealer.close(0)


def run_scenario(start_server: Callable[..., Any], topic: str = "kv@mpcache@tiny", tokens: bool = True) -> dict[str, Any]:
    """``tokens``: run the server with ``--kv-events-tokens`` (token ids, LoRA and salt in events)."""
    # As llm-d's central indexer: the subscriber binds, the server's PUB connects to it.
    sub = Subscriber()
    pub = sub.endpoint
    # clear is an admin operation (docs/security.md): the scenario's clear presents the token
    admin_token = secrets.token_hex(16)
    token_file = os.path.join(tempfile.mkdtemp(prefix="mpcache-kv-events-"), "admin.token")
    with open(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(admin_token)
    # the server's chunk keys are keyed (docs/security.md): give it a known key to compare with
    chain_key = secrets.token_bytes(32)
    key_file = os.path.join(os.path.dirname(token_file), "chunk.key")
    with open(os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(chain_key.hex())
    server, (rep_port,) = start_on_free_ports(start_server, lambda rep_port: (
        "--chunk-size", str(CHUNK), "--l1-size-gb", str(4 / 1024), "--slot-mb", "1",
        "--kv-events", pub, "--kv-events-replay", f"tcp://127.0.0.1:{rep_port}", "--kv-events-topic", topic,
        "--admin-token-file", token_file, "--chunk-key-file", key_file, *(["--kv-events-tokens"] if tokens else [])), 1)
    rep = f"tcp://127.0.0.1:{rep_port}"
    time.sleep(0.3)  # PUB/SUB joining: what was sent before is fetched by replay below
    engine = Engine([server.url])
    try:
        a, b = prompt(3, 1), prompt(2, 2)
        engine.add("a", a, extras=LORA, cache_salt="tenant-1")
        engine.run_all()
        engine.add("b", b)
        engine.run_all()
        with MPCacheClient(server.url, request_timeout=5.0) as client:
            client.clear(True, admin_token).result(5.0)
            stats = dict(client.stats())

        def saw_clear_after_store(frames: list[list[bytes]]) -> bool:
            return len(frames) >= 3 and b"AllBlocksCleared" in frames[-1][2]

        live = sub.wait_for(saw_clear_after_store, 10.0)
        first_seq = int.from_bytes(live[0][1], "big") if live else 0
        replayed = replay(rep, 0)
    finally:
        engine.close()
        sub.close()
    return {
        "live": live,
        "replay": replayed,
        "first_live_seq": first_seq,
        "a": hashes_of(a, LORA, chain_key, "tenant-1"),
        "b": hashes_of(b, KeyExtras(), chain_key),
        "a_tokens": a[: 3 * CHUNK],
        "b_tokens": b[: 2 * CHUNK],
        "stats": stats,
        "topic": topic.encode(),
        "server": server,
    }
