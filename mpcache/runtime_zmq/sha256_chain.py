"""The keyed chunk chain (core_sm.chunks, layout v3) in one native call per request.

core_sm's ``ChunkChain.hashes`` makes one hashlib copy, two updates and a digest per 1 KiB chunk:
about 1 us a chunk, half of it Python and EVP overhead around SHA-256 itself (docs/benchmarks.md,
"Keyed chunk chain in one native call"). Here a numba-compiled loop (``_sha256_chain``, no GIL)
hashes every chunk of a request through OpenSSL's low-level SHA-256, the same libcrypto that
Python's ``hashlib`` runs on, so the digests are hashlib's: the construction and every key are
unchanged, only the loop around SHA-256 moved out of Python.

Contract:

* ``chunk_chain(key)`` is ``ChunkChain(key)`` with the native batch injected
  (``ChunkChain(key, batch=batch_factory)``). Until the native path is ready, or if it cannot
  be (numba or libcrypto missing, a symbol absent, the self-test's digests differ from
  hashlib's), the batch declines and the chain hashes with hashlib, so a chain built before
  ``load()`` finished switches to native by itself, and the results are the same either way.
* ``load()`` finds libcrypto (the one this process's ``_hashlib`` mapped, else
  ``ctypes.util.find_library``), compiles or loads the loop from numba's cache (``cache=True``),
  and accepts it only if its digests equal hashlib's on a self-test (random key, root lengths 0
  and 16, 1 to 40 chunks of 16 and 256 tokens); else it logs the reason once and stays off.
  Thread-safe and idempotent. The server calls ``load_in_background()`` at start, so no request
  waits for numba (as the token scanner does, runtime_zmq.tokens).
* The loop holds no GIL: hashing a long prompt does not block the L2 threads or the HTTP thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import logging
import secrets
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from mpcache.core_sm.chunks import ChainBatch, ChunkChain

log = logging.getLogger("mpcache.sha256_chain")


class _Native(NamedTuple):
    base_state: Callable[[Any], Any]
    chain: Callable[..., int]
    frombuffer: Callable[..., Any]
    empty: Callable[..., Any]
    uint8: Any
    library: str


_native: _Native | None = None
_status = "not loaded"
_tried = False
_load_lock = threading.Lock()


def _libcrypto_path() -> str | None:
    """The libcrypto this process's ``_hashlib`` is linked to (from /proc/self/maps), else the
    one the dynamic linker would find."""
    import _hashlib  # noqa: F401  (maps its libcrypto if hashlib is OpenSSL-backed)

    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].rstrip("\n").rsplit("/", 1)[-1].startswith("libcrypto.so"):
                    return fields[5].rstrip("\n")
    except OSError:
        pass
    return ctypes.util.find_library("crypto")


def _reference(block: bytes, root: bytes, data: bytes, step: int, n: int) -> bytes:
    """The chain by hashlib, as core_sm computes it (the self-test's reference)."""
    base = hashlib.sha256(block)
    prev, out = root, []
    for i in range(n):
        h = base.copy()
        h.update(prev)
        h.update(data[i * step : (i + 1) * step])
        prev = h.digest()[:16]
        out.append(prev)
    return b"".join(out)


def _self_test(native: _Native) -> str | None:
    """None if ``native`` computes hashlib's digests (random key, root, data), else why not."""
    block = secrets.token_bytes(64)
    batch = _Batch(block, native)
    data = secrets.token_bytes(40 * 1024)
    for root in (b"", secrets.token_bytes(16)):
        for step, n in ((64, 1), (64, 7), (1024, 1), (1024, 40)):
            got = batch(root, data, step, n)
            if got is None or bytes(got) != _reference(block, root, data, step, n):
                return f"its digests differ from hashlib's (root {len(root)} bytes, {n} chunks of {step} bytes)"
    return None


def load(library: str | None = None) -> bool:
    """Make the native chain ready (``library``: a libcrypto path instead of the one found);
    blocks; returns whether it is. Failures are logged once and leave hashlib in use."""
    global _native, _status, _tried
    with _load_lock:
        if _tried:
            return _native is not None
        _tried = True
        try:
            native = _build(library)
            reason = _self_test(native)
        except Exception as exc:  # numba missing, no libcrypto, a symbol absent, a compile error
            native, reason = None, f"{type(exc).__name__}: {exc}"
        if native is None or reason is not None:
            _status = f"hashlib (native chain off: {reason})"
            log.warning("chunk hashing stays on hashlib: the native SHA-256 chain is off (%s)", reason)
            return False
        _native = native
        _status = f"native ({native.library})"
        log.info("chunk hashing: native SHA-256 chain on %s", native.library)
        return True


def _build(library: str | None) -> _Native:
    path = library if library is not None else _libcrypto_path()
    if path is None:
        raise OSError("no libcrypto found")
    lib = ctypes.CDLL(path)
    register(lib)
    import numpy as np

    from mpcache.runtime_zmq import _sha256_chain  # imports numba; compiles or loads the loop

    return _Native(_sha256_chain.base_state, _sha256_chain.chain, np.frombuffer, np.empty, np.uint8, path)


_SYMBOLS = ("SHA256_Init", "SHA256_Update", "SHA256_Final")
_PREFIX = "mpcache_sha256chain_"  # our names for them (_sha256_chain): no clash in LLVM's table


def register(lib: ctypes.CDLL) -> None:
    """Point our names for the SHA-256 functions at ``lib``'s (``AttributeError`` if one is
    missing, before anything compiles): must run before ``_sha256_chain`` is imported."""
    addresses = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in _SYMBOLS]
    import llvmlite.binding as llvm  # type: ignore[import-untyped]

    for name, addr in zip(_SYMBOLS, addresses):
        llvm.add_symbol(_PREFIX + name, addr)


def load_in_background() -> threading.Thread:
    """Start ``load()`` on a thread and return it (the caller joins it when it shuts down)."""
    thread = threading.Thread(target=load, name="mpcache-sha256-chain", daemon=True)
    thread.start()
    return thread


def ready() -> bool:
    """Whether chains built by ``chunk_chain`` hash natively."""
    return _native is not None


def status() -> str:
    """What hashes the chunk chain, for logs and stats: ``native (path)``, or ``hashlib (...)``
    with the reason, or ``not loaded``."""
    return _status


class _Batch:
    """One chain's native batch (``core_sm.chunks.ChainBatch``): the keyed SHA256_CTX, made on
    first use (then the key block is dropped), and the loop. Declines (None) while the native
    chain is not ready."""

    __slots__ = ("_block", "_base", "_fixed")

    def __init__(self, block: bytes, native: _Native | None = None) -> None:
        self._block: bytes | None = block
        self._base: Any = None
        self._fixed = native  # the self-test's own; else the module's once loaded

    def __call__(self, root: bytes, packed: bytes, step: int, n: int) -> memoryview | None:
        native = self._fixed or _native
        if native is None:
            return None
        base = self._base
        if base is None:
            block = self._block
            if block is None:  # pragma: no cover - another thread just made it
                return None
            base = native.base_state(native.frombuffer(block, native.uint8))
            if base.shape[0] == 0:
                return None
            base.setflags(write=False)
            self._base = base
            self._block = None
        if n < 0 or step < 1 or len(packed) < n * step:
            raise ValueError(f"{len(packed)} bytes hold no {n} chunks of {step} bytes")
        u8 = native.uint8
        out = native.empty(n * 16, u8)
        if native.chain(base, native.frombuffer(packed, u8), step, n, native.frombuffer(root, u8),
                        len(root), out) != 1:
            return None  # pragma: no cover - libcrypto's SHA-256 does not fail on valid contexts
        view: memoryview = out.data
        return view


def batch_factory(block: bytes) -> ChainBatch:
    """The ``core_sm.chunks.ChainBatchFactory`` of the native chain."""
    return _Batch(block)


def chunk_chain(key: bytes) -> ChunkChain:
    """``ChunkChain(key)`` hashing natively once ``load()`` succeeded (hashlib until then)."""
    return ChunkChain(key, batch=batch_factory)

