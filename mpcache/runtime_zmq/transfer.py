"""Seams for the blocking work the server loop hands to other threads.

* ``TransferExecutor``: runs core_sm's ``StartTransfer`` effects for server-driven (GPU)
  instances. The kernels' ``runtime_zmq/gpu_transfer.py`` implements it; the server calls it from
  its loop thread and the executor reports ``done(transfer_id, ok)`` from any thread once the copy
  has *really* completed (device event observed), which the server turns into core_sm's
  ``TransferFinished`` through its completion channel.
* ``NoDeviceExecutor``: the executor of a server with no GPU engine support: registration of a
  server-driven instance is refused and any transfer finishes ``ok=False``.
* ``L2Worker`` (``runtime_zmq/l2_worker.py``, re-exported here): executes ``ProbeL2`` /
  ``ReadL2`` / ``WriteL2`` effects against the configured L2 tiers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from mpcache.core_sm.effects import StartTransfer
from mpcache.runtime_zmq.l1_pool import SharedMemoryPool

log = logging.getLogger("mpcache.transfer")

DoneFn = Callable[[int, bool], None]
PostFn = Callable[[object], None]
InstanceFailedFn = Callable[[int, str], None]


class TransferExecutor(Protocol):
    """Server-driven KV copies between an engine's paged cache and L1 slots.

    ``on_instance_failed``: set by the server; the executor calls it (from any thread) with the
    instance id and a reason when it gives up on an instance by itself (its engine's event never
    fired): the server then tells core_sm (``InstanceFailed``), which releases the instance's
    registration and plans. The executor still reports every started transfer via ``done``."""

    on_instance_failed: InstanceFailedFn | None

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

    on_instance_failed: InstanceFailedFn | None = None  # it never fails one

    def register_instance(self, instance_id: int, layout: Mapping[str, Any], pool: SharedMemoryPool) -> str | None:
        return "this server has no GPU transfer engine; register the instance as engine_driven"

    def unregister_instance(self, instance_id: int) -> None:
        pass

    def start(self, transfer: StartTransfer, event_handle: bytes, done: DoneFn) -> None:
        done(transfer.transfer_id, False)

    def close(self) -> None:
        pass


# The L2 worker lives with the tiers it drives; kept importable from here.
from mpcache.runtime_zmq.l2_worker import L2Worker, storage_key  # noqa: E402,F401
