"""KV events: what a server holds, published in vLLM's KV-events wire format for KV-aware routers.

The facts come from core_sm (``ChunksStored`` / ``ChunksRemoved`` / ``AllChunksCleared``, see
``mpcache.core_sm.holdings``); this module only translates and sends them, as vLLM's own
``ZmqEventPublisher`` does:

* **PUB** on ``endpoint`` (bound when it is a wildcard such as ``tcp://*:5557``, ipc or
  inproc, or when written ``bind:URL`` -- ``bind:tcp://127.0.0.1:5557`` listens on loopback only;
  connected otherwise, to a subscriber that bound it -- vLLM's rule): multipart ``[topic, seq (8 bytes big-endian), payload]``, payload =
  msgpack of ``KVEventBatch`` (``[ts, [event, ...], nil]``; each event a map tagged
  ``"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"``, fields as vLLM's
  ``vllm.distributed.kv_events`` classes, defaults omitted). ``BlockStored``: a contiguous run of
  chunk hashes (32-byte bin), the parent hash, ``block_size`` = the chunk size, ``medium``
  ``CPU`` (L1) or ``STORAGE`` (L2), and an empty ``token_ids``.
* **Tenant data only when asked** (``private=True``, ``--kv-events-tokens``): the run's token ids
  (a prompt), ``lora_name`` and per-block ``extra_keys`` (LoRA name, the cache salt -- a tenant's
  isolation secret in vLLM -- on a request's first chunk, the hex digest of a chunk's multimodal
  / prompt-embedding keys). By default none of them leaves the process: the chunk hashes already
  differ per salt, adapter and image (they are keyed by all of them), so a consumer that tracks
  hashes (what a pod holds, per medium, and what it dropped) loses nothing; one that re-hashes
  token ids (llm-d's indexer) needs the option.
* **CURVE**: given the server's ``CurveServer``, both sockets are CURVE servers on its context,
  so its ZAP handler admits only the authorized client keys (a subscriber and a replay client
  present one, as an engine does); a peer without one gets nothing.
* **Replay** on ``replay_endpoint`` (ROUTER): a DEALER sends ``[b"", start_seq (8 bytes)]`` and
  gets every buffered batch with ``seq >= start_seq`` as ``[b"", topic, seq, payload]``, then
  ``[b"", b"", -1 (8 bytes, signed), b""]``. The buffer keeps the last ``buffer_batches``.
* **Restart marker**: sequence numbers start at the publisher's start time in microseconds, so
  they only grow across restarts, and the first batch of every start is ``AllBlocksCleared``.
  A subscriber that sees a gap asks for a replay; when what it missed is older than the buffer
  (a restart: the new server holds none of it), the replay starts at that ``AllBlocksCleared``
  and the subscriber resyncs from there.

Sending never blocks the server loop: ``publish`` appends to a bounded queue (when full, the
batch is dropped and counted, and the next batch starts with ``AllBlocksCleared`` so subscribers
resync instead of keeping a wrong view); one thread, owned and joined by ``close``, encodes,
sends and serves replays.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Iterable
from typing import Any

import msgpack  # type: ignore[import-untyped]
import zmq

from mpcache.core_sm import effects as fx
from mpcache.core_sm.keys import identity_fields

log = logging.getLogger("mpcache.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM = {fx.Medium.L1: "CPU", fx.Medium.L2: "STORAGE"}
_CLEARED: dict[str, Any] = {"type": "AllBlocksCleared"}


BIND_PREFIX = "bind:"


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard (``tcp://*:5557``), IPv6-any, ipc or inproc endpoint;
    connect to any other (a subscriber that bound it). ``bind:URL`` always binds URL (an
    interface of the operator's choice, e.g. ``bind:tcp://127.0.0.1:5557``)."""
    return (endpoint.startswith(BIND_PREFIX) or "*" in endpoint or "::" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


def _runs(chunks: Iterable[fx.StoredChunk]) -> list[list[fx.StoredChunk]]:
    """Split into contiguous chains of one key identity (one ``BlockStored`` each)."""
    runs: list[list[fx.StoredChunk]] = []
    for chunk in chunks:
        last = runs[-1][-1] if runs else None
        if (last is not None and chunk.parent_hash == last.chunk_hash
                and (chunk.cache_salt, chunk.identity) == (last.cache_salt, last.identity)):
            runs[-1].append(chunk)
        else:
            runs.append([chunk])
    return runs


def to_vllm_events(effect: object, chunk_size: int, private: bool = False) -> list[dict[str, Any]]:
    """vLLM KV events (as msgpack-ready maps) for one core_sm effect (``[]`` for others).
    ``private``: keep token ids, LoRA name and ``extra_keys`` (salt) in ``BlockStored``."""
    if isinstance(effect, fx.AllChunksCleared):
        return [dict(_CLEARED)]
    if isinstance(effect, fx.ChunksRemoved):
        return [{"type": "BlockRemoved", "block_hashes": list(effect.chunk_hashes), "medium": MEDIUM[effect.medium]}]
    if not isinstance(effect, fx.ChunksStored):
        return []
    out = []
    for run in _runs(effect.chunks):
        first = run[0]
        if not private:
            out.append({
                "type": "BlockStored",
                "block_hashes": [chunk.chunk_hash for chunk in run],
                "parent_block_hash": first.parent_hash,
                "token_ids": [],
                "block_size": chunk_size,
                "lora_id": None,
                "medium": MEDIUM[effect.medium],
                "lora_name": None,  # a field vLLM's decoder requires (0.32: no default), left empty
            })
            continue
        lora = identity_fields(first.identity).get("lora") or None
        tokens: list[int] = []
        extra_keys: list[tuple[Any, ...] | None] = []
        for chunk in run:
            tokens.extend(chunk.token_ids.tolist())
            keys: list[Any] = []
            if lora:
                keys.append(lora)
            if chunk.cache_salt and chunk.parent_hash is None:
                keys.append(chunk.cache_salt)
            if chunk.chunk_extra:
                keys.append(chunk.chunk_extra.hex())
            extra_keys.append(tuple(keys) if keys else None)
        event: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [chunk.chunk_hash for chunk in run],
            "parent_block_hash": first.parent_hash,
            "token_ids": tokens,
            "block_size": chunk_size,
            "lora_id": None,
            "medium": MEDIUM[effect.medium],
            "lora_name": lora,
        }
        if any(k is not None for k in extra_keys):
            event["extra_keys"] = extra_keys
        out.append(event)
    return out


class KvEventPublisher:
    """vLLM-format KV events on a ZMQ PUB socket, with a bounded replay ROUTER (module doc).

    ``publish(effects)`` is called from the server loop; everything else runs on the
    publisher's own thread. Raises ``zmq.ZMQError`` at construction if an endpoint cannot be
    bound."""

    def __init__(
        self,
        endpoint: str,
        *,
        chunk_size: int,
        replay_endpoint: str | None = None,
        topic: str = "",
        private: bool = False,
        curve: Any = None,
        buffer_batches: int = 10_000,
        max_queue: int = 10_000,
        hwm: int = 100_000,
        clock: Any = time.time,
    ) -> None:
        self.chunk_size = chunk_size
        self.private = private
        self._topic = topic.encode("utf-8")
        self._clock = clock
        # with CURVE, the server's context: its ZAP handler is the one that checks client keys
        self._ctx: zmq.Context[zmq.Socket[bytes]] = curve.ctx if curve is not None else zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket[bytes] | None = None
        if curve is not None:
            curve.apply(self._pub)
        self.curve = curve is not None
        try:
            if is_bind_endpoint(endpoint):
                self._pub.bind(endpoint.removeprefix(BIND_PREFIX))
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:  # a central subscriber (llm-d's indexer) bound it: connect, as vLLM does
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint: str | None = None
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                if curve is not None:
                    curve.apply(self._replay)
                self._replay.bind(replay_endpoint.removeprefix(BIND_PREFIX))
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._pub.close(0)
            if self._replay is not None:
                self._replay.close(0)
            raise
        self.first_seq = time.time_ns() // 1000
        self._next_seq = self.first_seq
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_batches)
        self._queue: queue.Queue[list[dict[str, Any]] | None] = queue.Queue(max_queue)
        self._resync = True  # the first batch (and the one after a drop) starts with a clear
        self.counts = {"batches": 0, "events": 0, "batches_dropped": 0, "replays": 0}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mpcache-kv-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ loop thread side

    def publish(self, effects: Iterable[object]) -> None:
        events: list[dict[str, Any]] = []
        for effect in effects:
            events.extend(to_vllm_events(effect, self.chunk_size, self.private))
        if not events:
            return
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.counts["batches_dropped"] += 1
            self._resync = True

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                self._queue.put(None, timeout=1.0)
                break
            except queue.Full:
                if not self._thread.is_alive():
                    break
        self._thread.join(5.0)

    # ------------------------------------------------------------------ publisher thread

    def _run(self) -> None:
        try:
            self._send([])  # the restart marker: the first batch of every start clears
            while True:
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    item = []
                stop = item is None
                events = [] if item is None else list(item)
                while not stop:  # one batch for everything queued meanwhile
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        stop = True
                    else:
                        events.extend(more)
                if events or self._resync:
                    self._send(events)
                self._serve_replays()
                if stop:
                    return
        except Exception:  # a bug here must not take the server down; subscribers see silence
            log.exception("KV-event publisher stopped")
        finally:
            self._pub.close(0)
            if self._replay is not None:
                self._replay.close(0)

    def _send(self, events: list[dict[str, Any]]) -> None:
        if self._resync:
            self._resync = False
            events = [dict(_CLEARED), *events]
        # [ts, events, data_parallel_rank]: msgspec writes the trailing nil too
        payload = msgpack.packb([self._clock(), events, None], use_bin_type=True)
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        self.counts["batches"] += 1
        self.counts["events"] += len(events)
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:  # no subscriber keeps up: it replays from its last seq
            pass

    def _serve_replays(self) -> None:
        sock = self._replay
        if sock is None:
            return
        for _ in range(64):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("invalid KV-event replay request (%d frames)", len(frames))
                continue
            client, _empty, start = frames
            start_seq = int.from_bytes(start, "big")
            self.counts["replays"] += 1
            for seq, payload in tuple(self._buffer):
                if seq >= start_seq:
                    sock.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            sock.send_multipart((client, b"", b"", END_SEQ, b""))
