"""Seams for the blocking work the server loop hands to other threads.

* ``TransferExecutor``: runs core_sm's ``StartTransfer`` effects for server-driven (GPU)
  instances. The kernels' ``runtime_zmq/gpu_transfer.py`` implements it; the server calls it from
  its loop thread and the executor reports ``done(transfer_id, ok)`` from any thread once the copy
  has *really* completed (device event observed), which the server turns into core_sm's
  ``TransferFinished`` through its completion channel.
* ``NoDeviceExecutor``: the executor of a server with no GPU engine support: registration of a
  server-driven instance is refused and any transfer finishes ``ok=False``.
* ``L2Worker``: executes ``ProbeL2`` / ``ReadL2`` / ``WriteL2`` effects against the configured
  L2 tiers in a thread pool and reports ``L2ProbeFinished`` / ``L2ReadFinished`` /
  ``L2WriteFinished``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from core_sm.chunks import ObjectKey
from core_sm.effects import ProbeL2, ReadL2, StartTransfer, WriteL2
from core_sm.messages import L2ProbeFinished, L2ReadFinished, L2WriteFinished
from runtime_zmq.l1_pool import SharedMemoryPool

log = logging.getLogger("mpcache.transfer")

DoneFn = Callable[[int, bool], None]
PostFn = Callable[[object], None]


class TransferExecutor(Protocol):
    """Server-driven KV copies between an engine's paged cache and L1 slots."""

    def register_instance(self, instance_id: int, layout: Mapping[str, Any], pool: SharedMemoryPool) -> str | None:
        """Open the instance's KV memory (CUDA IPC handles in ``layout``). Returns None on
        success, or the reason it cannot (the server answers a VALIDATION error)."""
        ...

    def unregister_instance(self, instance_id: int) -> None: ...

    def start(self, transfer: StartTransfer, event_handle: bytes, done: DoneFn) -> None:
        """Begin ``transfer`` after the engine's interprocess event ``event_handle``; call
        ``done(transfer.transfer_id, ok)`` exactly once when it has completed. Must not block."""
        ...

    def close(self) -> None: ...


class NoDeviceExecutor:
    """No server-driven engines on this server (no GPU support loaded)."""

    def register_instance(self, instance_id: int, layout: Mapping[str, Any], pool: SharedMemoryPool) -> str | None:
        return "this server has no GPU transfer engine; register the instance as engine_driven"

    def unregister_instance(self, instance_id: int) -> None:
        pass

    def start(self, transfer: StartTransfer, event_handle: bytes, done: DoneFn) -> None:
        done(transfer.transfer_id, False)

    def close(self) -> None:
        pass


def storage_key(key: ObjectKey) -> bytes:
    """The L2 key of an object (stable across processes and servers)."""
    return key.wire_name().encode("ascii")


class L2Worker:
    """Runs L2 reads and writes in ``workers`` threads. Reads try the tiers in order; writes
    go to every tier. Each effect yields exactly one completion event via ``post``."""

    def __init__(self, tiers: Sequence[Any], pool: SharedMemoryPool, post: PostFn, workers: int = 4) -> None:
        self.tiers = list(tiers)
        self.pool = pool
        self.post = post
        self._exec = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="mpcache-l2")
        self._slot_nbytes: dict[int, int] = {}
        self._lock = threading.Lock()
        self.in_flight = 0
        self.reads = 0
        self.writes = 0
        self.read_hits = 0
        self.errors = 0

    def note_slot_size(self, slot: int, nbytes: int) -> None:
        """How many bytes of ``slot`` hold the object (what a write-behind must copy)."""
        self._slot_nbytes[slot] = nbytes

    def probe(self, effect: ProbeL2) -> None:
        self._submit(lambda: self._probe(effect), L2ProbeFinished(effect.probe_id, (False,) * len(effect.keys)))  # type: ignore[arg-type]

    def read(self, effect: ReadL2) -> None:
        self._submit(lambda: self._read(effect), L2ReadFinished(effect.read_id, (False,) * len(effect.items)))  # type: ignore[arg-type]

    def write(self, effect: WriteL2) -> None:
        # The bytes are read by the worker thread, later: the slots stay pinned until
        # L2WriteFinished, so no writer races it. Their sizes are the ones known now.
        sizes = [self._slot_nbytes.get(slot, self.pool.slot_bytes) for _, slot in effect.items]
        self._submit(lambda: self._write(effect, sizes), L2WriteFinished(effect.write_id, False))

    def _submit(self, work: Callable[[], object], failed: object) -> None:
        """Run ``work`` (which returns the completion event) on a worker thread; post exactly
        one completion whatever happens: ``failed`` if it raises, is cancelled at ``close`` or
        cannot be queued. core_sm keeps the effect's slots pinned until it sees it."""
        with self._lock:
            self.in_flight += 1

        def run() -> None:
            try:
                event = work()
            except Exception:
                log.exception("L2 work failed")
                self.errors += 1
                event = failed
            self._complete(event)

        def cancelled(fut: Future[None]) -> None:
            if fut.cancelled():
                self._complete(failed)

        try:
            fut = self._exec.submit(run)
        except Exception:  # shut down already
            log.exception("L2 work could not be queued")
            self._complete(failed)
            return
        fut.add_done_callback(cancelled)

    def _complete(self, event: object) -> None:
        with self._lock:
            self.in_flight -= 1
        self.post(event)

    def _probe(self, effect: ProbeL2) -> object:
        present: list[bool] = []
        for key in effect.keys:
            k = storage_key(key)
            found = False
            for tier in self.tiers:
                try:
                    found = bool(tier.contains(k))
                except Exception as e:
                    self.errors += 1
                    log.warning("L2 probe of %s on %r failed: %s", key.wire_name(), tier, e)
                if found:
                    break
            present.append(found)
        return L2ProbeFinished(effect.probe_id, tuple(present))  # type: ignore[arg-type]

    def _read(self, effect: ReadL2) -> object:
        loaded: list[bool] = []
        try:
            for key, slot in effect.items:
                data = None
                k = storage_key(key)
                for tier in self.tiers:
                    try:
                        data = tier.read(k)
                    except Exception as e:
                        self.errors += 1
                        log.warning("L2 read of %s from %r failed: %s", key.wire_name(), tier, e)
                        data = None
                    if data is not None:
                        break
                if data is None or len(data) > self.pool.slot_bytes:
                    loaded.append(False)
                    continue
                self.pool.write(slot, data)
                self._slot_nbytes[slot] = len(data)
                loaded.append(True)
        except Exception:
            log.exception("L2 read failed")
            loaded.extend([False] * (len(effect.items) - len(loaded)))
        self.reads += len(effect.items)
        self.read_hits += sum(loaded)
        return L2ReadFinished(effect.read_id, tuple(loaded))  # type: ignore[arg-type]  # attrs converter typing

    def _write(self, effect: WriteL2, sizes: list[int]) -> object:
        ok = True
        try:
            for (key, slot), n in zip(effect.items, sizes):
                data = self.pool.read(slot, n)
                k = storage_key(key)
                for tier in self.tiers:
                    try:
                        tier.write(k, data)
                    except Exception as e:
                        ok = False
                        self.errors += 1
                        log.warning("L2 write of %s to %r failed: %s", key.wire_name(), tier, e)
        except Exception:
            log.exception("L2 write failed")
            ok = False
        self.writes += len(effect.items)
        return L2WriteFinished(effect.write_id, ok)

    def close(self) -> None:
        # Close the tiers first: a read stuck in a tier then fails (and is reported) instead of
        # holding the shutdown.
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:
                log.exception("closing L2 tier %r", tier)
        self._exec.shutdown(wait=True, cancel_futures=True)
