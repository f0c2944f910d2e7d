"""CUDA driver plumbing for the server-driven GPU data path: IPC memory and event handles as
plain bytes (never pickle), host registration of the L1 segment, device lookup by UUID.

Both sides use the driver API through ``cuda.bindings`` (which releases the GIL in every call).
The worker side (``export_kv_tensors``, ``export_event``) runs inside the engine's process; the
server side (``open_*``, ``register_host``) inside mpcache-server.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

HANDLE_BYTES = 64


def driver() -> Any:
    """The CUDA driver bindings (``cuda.bindings.driver``), imported on first use."""
    from cuda.bindings import driver as bindings

    return bindings


def check(result: Any, what: str) -> Any:
    """Unpack a cuda.bindings result tuple; raise ``RuntimeError`` naming the call on error."""
    drv = driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def _to_bytes(handle: Any) -> bytes:
    return ctypes.string_at(handle.getPtr(), HANDLE_BYTES)


def _from_bytes(cls: Any, data: bytes) -> Any:
    if len(data) != HANDLE_BYTES:
        raise ValueError(f"an IPC handle is {HANDLE_BYTES} bytes, got {len(data)}")
    h = cls()
    ctypes.memmove(h.getPtr(), data, HANDLE_BYTES)
    return h


def ensure_context(ordinal: int = 0) -> None:
    """Make the device's primary context current on this thread (driver calls need one)."""
    from numba import cuda

    cuda.select_device(ordinal)
    cuda.current_context()


def device_ordinal_for_uuid(uuid: bytes) -> int:
    """This process's ordinal of the device with ``uuid`` (16 bytes); ``CUDA_VISIBLE_DEVICES``
    may number devices differently in the worker and the server. Raises ``LookupError``."""
    drv = driver()
    check(drv.cuInit(0), "cuInit")
    for i in range(check(drv.cuDeviceGetCount(), "cuDeviceGetCount")):
        dev = check(drv.cuDeviceGet(i), "cuDeviceGet")
        if _uuid_of(dev) == uuid:
            return i
    raise LookupError(f"no visible CUDA device has UUID {uuid.hex()}")


def device_uuid(ordinal: int) -> bytes:
    drv = driver()
    check(drv.cuInit(0), "cuInit")
    return _uuid_of(check(drv.cuDeviceGet(ordinal), "cuDeviceGet"))


def _uuid_of(dev: Any) -> bytes:
    drv = driver()
    fn = getattr(drv, "cuDeviceGetUuid_v2", None) or drv.cuDeviceGetUuid
    raw = check(fn(dev), "cuDeviceGetUuid").bytes
    return bytes(raw) if not isinstance(raw, str) else raw.encode("latin-1")


# ---- worker side ------------------------------------------------------------------------------


def export_kv_tensors(tensors: Sequence[Any]) -> list[dict[str, Any]]:
    """Describe each (contiguous, CUDA) torch tensor for the server: IPC handle of its
    allocation, the tensor's byte offset in it, shape, element strides, dtype name and size."""
    drv = driver()
    out = []
    for t in tensors:
        if not t.is_cuda or not t.is_contiguous():
            raise ValueError("KV tensors must be contiguous CUDA tensors (permute views to their physical layout first)")
        base, _size = check(drv.cuMemGetAddressRange(t.data_ptr()), "cuMemGetAddressRange")
        handle = check(drv.cuIpcGetMemHandle(base), "cuIpcGetMemHandle")
        out.append({
            "handle": _to_bytes(handle),
            "offset": int(t.data_ptr()) - int(base),
            "nbytes": t.numel() * t.element_size(),
            "shape": list(t.shape),
            "strides": list(t.stride()),
            "dtype": str(t.dtype).removeprefix("torch."),
            "itemsize": t.element_size(),
        })
    return out


def export_event(event: Any) -> bytes:
    """The 64-byte IPC handle of a ``torch.cuda.Event(interprocess=True)``."""
    data = bytes(event.ipc_handle())
    if len(data) != HANDLE_BYTES:
        raise ValueError(f"unexpected event handle size {len(data)}")
    return data


# ---- server side ------------------------------------------------------------------------------


def open_memory(handle: bytes) -> int:
    """Map a peer's allocation; returns its device address here. Close with ``close_memory``."""
    drv = driver()
    h = _from_bytes(drv.CUipcMemHandle, handle)
    flags = 0x1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    return int(check(drv.cuIpcOpenMemHandle(h, flags), "cuIpcOpenMemHandle"))


def close_memory(address: int) -> None:
    check(driver().cuIpcCloseMemHandle(address), "cuIpcCloseMemHandle")


def open_event(handle: bytes) -> Any:
    """A peer's interprocess event, usable with ``cuStreamWaitEvent`` here."""
    drv = driver()
    return check(drv.cuIpcOpenEventHandle(_from_bytes(drv.CUipcEventHandle, handle)), "cuIpcOpenEventHandle")


def destroy_event(event: Any) -> None:
    check(driver().cuEventDestroy(event), "cuEventDestroy")


def create_completion_event() -> Any:
    """An event the completion waiters query (``cuEventQuery``), without timing."""
    drv = driver()
    flags = 0x2  # CU_EVENT_DISABLE_TIMING
    return check(drv.cuEventCreate(flags), "cuEventCreate")


def allocation_range(address: int) -> tuple[int, int]:
    """(base, size) of the device allocation that contains ``address`` (``cuMemGetAddressRange``:
    for an opened IPC handle, the peer's whole allocation as mapped here)."""
    base, size = check(driver().cuMemGetAddressRange(address), "cuMemGetAddressRange")
    return int(base), int(size)


def register_host(address: int, size: int) -> int:
    """Pin and map host memory (the L1 segment) for the device; returns its device address."""
    drv = driver()
    flags = 0x01 | 0x02  # CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP
    check(drv.cuMemHostRegister(address, size, flags), "cuMemHostRegister")
    return int(check(drv.cuMemHostGetDevicePointer(address, 0), "cuMemHostGetDevicePointer"))


def unregister_host(address: int) -> None:
    check(driver().cuMemHostUnregister(address), "cuMemHostUnregister")
