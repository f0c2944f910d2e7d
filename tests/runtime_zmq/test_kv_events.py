"""KV events from a live server in vLLM's wire format (msgpack decoded here; the decode with
vLLM's own classes is tests/e2e/test_kv_events_vllm.py): stored after a real store, removed on
eviction, cleared on clear, a bounded replay, and the restart marker."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from mpcache.core_sm.chunks import TokenIds
from mpcache.core_sm.effects import AllChunksCleared, ChunksRemoved, ChunksStored, Medium, StoredChunk
from mpcache.runtime_zmq.kv_events import to_vllm_events
from kv_events_scenario import CHUNK, replay, run_scenario, start_on_free_ports


def events(frames: list[list[bytes]]) -> list[dict[str, Any]]:
    out = []
    for _topic, _seq, payload in frames:
        ts, batch = msgpack.unpackb(payload)[:2]
        assert isinstance(ts, float)
        out.extend(batch)
    return out


def test_stored_removed_cleared_replay_and_restart(start_server: Callable[..., Any]) -> None:
    s = run_scenario(start_server)
    replayed = events(s["replay"])
    # the restart marker: the first batch of a start is a clear
    assert replayed[0] == {"type": "AllBlocksCleared"}
    live = events(s["live"])
    assert live and live == replayed[len(replayed) - len(live):], "the replay repeats the live stream"
    seqs = [int.from_bytes(f[1], "big") for f in s["replay"]]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert all(f[0] == s["topic"] for f in s["replay"])
    stored = [e for e in replayed if e["type"] == "BlockStored"]
    a, b = s["a"], s["b"]
    first = stored[0]
    assert first["block_hashes"] == list(a) and first["parent_block_hash"] is None
    assert first["token_ids"] == s["a_tokens"] and first["block_size"] == CHUNK
    assert first["medium"] == "CPU" and first["lora_name"] == "tenant-lora"
    assert first["extra_keys"][0] == ["tenant-lora", "tenant-1"] and first["extra_keys"][1] == ["tenant-lora"]
    assert stored[1]["block_hashes"] == list(b) and stored[1]["lora_name"] is None and "extra_keys" not in stored[1]
    removed = [h for e in replayed if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert len(removed) >= 1 and set(removed) <= set(a)  # B's two chunks evicted A's oldest
    assert all(e["medium"] == "CPU" for e in replayed if e["type"] == "BlockRemoved")
    assert replayed[-1] == {"type": "AllBlocksCleared"}
    order = [e["type"] for e in replayed]
    assert order.index("BlockRemoved") < len(order) - 1

    # a bounded replay from a later sequence number; nothing from past the end
    rep_url = [a for a in s["server"].args if a.startswith("tcp://")][-1]
    tail = replay(rep_url, seqs[-2])
    assert [int.from_bytes(f[1], "big") for f in tail] == seqs[-2:]
    assert replay(rep_url, seqs[-1] + 100) == []

    # a restarted server's sequence numbers jump forward and it starts with a clear
    _, (rep2_port,) = start_on_free_ports(
        start_server, lambda p: ("--kv-events", "tcp://127.0.0.1:*", "--kv-events-replay", f"tcp://127.0.0.1:{p}"), 1)
    rep2 = f"tcp://127.0.0.1:{rep2_port}"
    again = replay(rep2, 0)
    assert int.from_bytes(again[0][1], "big") > seqs[-1]
    assert events(again) == [{"type": "AllBlocksCleared"}]


def test_translation_splits_runs_and_maps_media() -> None:
    c0 = StoredChunk(b"h0", None, TokenIds([1, 2]))
    c1 = StoredChunk(b"h1", b"h0", TokenIds([3, 4]))
    c3 = StoredChunk(b"h3", b"h2", TokenIds([7, 8]), chunk_extra=b"\x01")
    (run1, run2) = to_vllm_events(ChunksStored(Medium.L2, (c0, c1, c3)), 2, private=True)
    assert run1["block_hashes"] == [b"h0", b"h1"] and run1["token_ids"] == [1, 2, 3, 4] and run1["medium"] == "STORAGE"
    assert run2["parent_block_hash"] == b"h2" and run2["extra_keys"] == [("01",)]
    (bare1, bare2) = to_vllm_events(ChunksStored(Medium.L2, (c0, c1, c3)), 2)  # the default
    assert bare1["block_hashes"] == [b"h0", b"h1"] and bare1["token_ids"] == [] and bare1["medium"] == "STORAGE"
    assert bare2["parent_block_hash"] == b"h2" and "extra_keys" not in bare2
    assert to_vllm_events(ChunksRemoved(Medium.L1, (b"h0",)), 2) == [
        {"type": "BlockRemoved", "block_hashes": [b"h0"], "medium": "CPU"}]
    assert to_vllm_events(AllChunksCleared(), 2) == [{"type": "AllBlocksCleared"}]
    assert to_vllm_events(object(), 2) == []


# ---------------------------------------------------------------------------------------------
# Hostile finding 5: the events hand no prompt, salt or LoRA name to a subscriber by default, can
# listen on loopback alone, and run under the server's CURVE keys.


def test_default_events_carry_hashes_but_no_tokens_salt_or_lora(start_server: Callable[..., Any]) -> None:
    s = run_scenario(start_server, tokens=False)
    replayed = events(s["replay"])
    stored = [e for e in replayed if e["type"] == "BlockStored"]
    assert stored[0]["block_hashes"] == list(s["a"]) and stored[1]["block_hashes"] == list(s["b"])
    assert stored[0]["parent_block_hash"] is None and stored[0]["block_size"] == CHUNK
    for e in stored:
        assert e["token_ids"] == [] and "extra_keys" not in e and e["lora_name"] is None
    raw = b"".join(f[2] for f in s["replay"] + s["live"])
    assert b"tenant-1" not in raw and b"tenant-lora" not in raw
    # no run of the prompt's token ids either, in any width msgpack packs them
    assert msgpack.packb(s["a_tokens"][:8]) not in raw
    removed = [h for e in replayed if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert removed and set(removed) <= set(s["a"])  # hashes still say what left


def listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.rsplit(":", 1)
            if state == "0A" and int(hexport, 16) == port:
                found.add(addr)
    return found


def test_bind_form_listens_on_loopback_only(start_server: Callable[..., Any]) -> None:
    _, (port, rep) = start_on_free_ports(start_server, lambda port, rep: (
        "--kv-events", f"bind:tcp://127.0.0.1:{port}", "--kv-events-replay", f"tcp://127.0.0.1:{rep}"), 2)
    assert listening(port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0
    assert listening(rep) == {"0100007F"}
    assert events(replay(f"tcp://127.0.0.1:{rep}", 0)) == [{"type": "AllBlocksCleared"}]


def test_events_and_replay_need_an_authorized_curve_key(start_server: Callable[..., Any], tmp_path: Any) -> None:
    import threading
    import time

    import zmq

    from mpcache.runtime_zmq import auth
    from mpcache.runtime_zmq.client import MPCacheClient
    from test_server_ops import register, store_chunks, tokens

    keys = str(tmp_path / "keys")
    auth.keygen(keys, "router")
    sp, (port, rep) = start_on_free_ports(start_server, lambda port, rep: (
        "--curve-dir", keys, "--kv-events", f"bind:tcp://127.0.0.1:{port}", "--kv-events-replay", f"tcp://127.0.0.1:{rep}"), 2)
    ctx = zmq.Context()
    got: dict[str, list[list[bytes]]] = {"plain": [], "curve": []}
    stop = threading.Event()

    def subscribe(name: str, curve: bool) -> None:
        sub = ctx.socket(zmq.SUB)
        try:  # closed whatever happens: an open socket makes the context's end wait forever
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            if curve:
                auth.client_curve(sub, keys, "router")
            sub.connect(f"tcp://127.0.0.1:{port}")
            while not stop.is_set():
                if sub.poll(50):
                    got[name].append(sub.recv_multipart(zmq.NOBLOCK))
        finally:
            sub.close(0)

    subs = [threading.Thread(target=subscribe, args=(n, n == "curve"), daemon=True) for n in got]
    for t in subs:
        t.start()
    try:
        time.sleep(0.5)  # the subscriptions reach the publisher
        with MPCacheClient(sp.url, curve_dir=keys, curve_client="router") as c:
            register(c, 1)
            store_chunks(c, tokens(2, seed=5), "kv-curve")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(b"BlockStored" in f[2] for f in got["curve"]):
            time.sleep(0.05)
        assert any(b"BlockStored" in f[2] for f in got["curve"])
        assert got["plain"] == []  # no handshake, no events

        def ask(curve: bool) -> list[bytes] | None:
            d = ctx.socket(zmq.DEALER)
            try:
                d.setsockopt(zmq.LINGER, 0)
                # a refused handshake can drop the connection before the send: the DEALER then
                # has no peer, and a send without a timeout would wait for one forever
                d.setsockopt(zmq.SNDTIMEO, 1500)
                if curve:
                    auth.client_curve(d, keys, "router")
                d.connect(f"tcp://127.0.0.1:{rep}")
                try:
                    d.send_multipart((b"", (0).to_bytes(8, "big")))
                except zmq.Again:
                    return None
                return d.recv_multipart(zmq.NOBLOCK) if d.poll(1500) else None
            finally:
                d.close(0)

        assert ask(curve=False) is None  # the history is not for anyone who connects
        first = ask(curve=True)
        assert first is not None and b"AllBlocksCleared" in first[3]
    finally:
        stop.set()
        for t in subs:
            t.join(5)
        # term() waits for every socket of the context to close, in C, where the test's timeout
        # cannot interrupt it (a run under load once hung here): closing with linger 0 cannot wait
        ctx.destroy(linger=0)
