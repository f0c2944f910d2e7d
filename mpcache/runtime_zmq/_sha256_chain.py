"""The compiled chain loop behind ``mpcache.runtime_zmq.sha256_chain`` (imported only by its
``load()``, so numba is imported and the loop compiled or loaded from numba's cache off the
import path).

The loop calls OpenSSL's low-level SHA-256 (``SHA256_Update`` / ``SHA256_Final``, exported by
libcrypto 1.1 and 3) by symbol name. The names are registered with LLVM (``sha256_chain.register``) before
this module is imported, that is before the functions below compile or load from the cache, so the cached object code binds
to this process's libcrypto at load time; no address is baked into the cache.

``base_state(block) -> ctx``: the SHA256_CTX after ``SHA256_Init`` and one 64-byte block.
``chain(ctx, data, step, n, root, root_len, out) -> ok``: ``out[16i : 16i+16] =
SHA-256(ctx-state || prev || data[i*step : (i+1)*step])[:16]`` for i < n, ``prev`` the root for
the first chunk and the previous digest after; 1 if every libcrypto call returned 1.
"""

from __future__ import annotations

from typing import Any

import llvmlite.binding as llvm  # type: ignore[import-untyped]
import numba
import numpy as np

# sizeof(SHA256_CTX) in OpenSSL's public sha.h (h[8], Nl, Nh, data[16], num, md_len: 28 words),
# the same in 1.1 and 3; base_state checks that SHA256_Init writes nothing past it.
CTX_BYTES = 112
_CTX_ROOM = 256

# The names sha256_chain.register() gave libcrypto's functions in LLVM's symbol table; it runs
# before this module is imported (the functions below compile, or load, at import).
_PREFIX = "mpcache_sha256chain_"

# Without them LLVM would abort the whole process at the first compile or cache load below
# ("Symbol not found"): refuse the import instead.
if llvm.address_of_symbol(_PREFIX + "SHA256_Init") is None:
    raise ImportError("mpcache.runtime_zmq._sha256_chain is loaded by sha256_chain.load(), which registers libcrypto first")


_PTR = numba.types.uintp
_init: Any = numba.types.ExternalFunction(_PREFIX + "SHA256_Init", numba.types.int32(_PTR))
_update: Any = numba.types.ExternalFunction(_PREFIX + "SHA256_Update", numba.types.int32(_PTR, _PTR, numba.types.uintp))
_final: Any = numba.types.ExternalFunction(_PREFIX + "SHA256_Final", numba.types.int32(_PTR, _PTR))

_RO = numba.types.Array(numba.types.uint8, 1, "C", readonly=True)
_RW = numba.types.Array(numba.types.uint8, 1, "C")
_I64 = numba.types.int64


@numba.njit(_RW(_RO), cache=True, nogil=True)
def base_state(block: Any) -> Any:  # pragma: no cover - compiled
    """The SHA256_CTX after one 64-byte ``block``; empty if libcrypto failed or wrote past
    ``CTX_BYTES``."""
    room = np.full(_CTX_ROOM, 0xA5, np.uint8)
    ok = _init(room.ctypes.data)
    ok &= _update(room.ctypes.data, block.ctypes.data, np.uintp(block.shape[0]))
    for i in range(CTX_BYTES, _CTX_ROOM):
        if room[i] != 0xA5:
            ok = 0
    if ok != 1:
        return np.empty(0, np.uint8)
    return room[:CTX_BYTES].copy()


@numba.njit(_I64(_RO, _RO, _I64, _I64, _RO, _I64, _RW), cache=True, nogil=True)
def chain(base: Any, data: Any, step: int, n: int, root: Any, root_len: int, out: Any) -> int:  # pragma: no cover - compiled
    # ctx and the digests move as 64-bit words: numba copies a slice element by element, and
    # 112 byte moves per chunk cost ~1 us per 32 chunks (base and out come from numpy, aligned)
    words = CTX_BYTES // 8
    base64 = base.view(np.uint64)
    out64 = out.view(np.uint64)
    ctx = np.empty(words, np.uint64)
    md = np.empty(4, np.uint64)
    pctx = ctx.ctypes.data
    pmd = md.ctypes.data
    pdata = data.ctypes.data
    pout = out.ctypes.data
    prev = root.ctypes.data
    prev_len = np.uintp(root_len)
    ustep = np.uintp(step)
    ok = 1
    for i in range(n):
        for w in range(words):
            ctx[w] = base64[w]
        ok &= _update(pctx, prev, prev_len)
        ok &= _update(pctx, pdata + np.uintp(i * step), ustep)
        ok &= _final(pmd, pctx)
        out64[2 * i] = md[0]
        out64[2 * i + 1] = md[1]
        prev = pout + np.uintp(i * 16)
        prev_len = np.uintp(16)
    return ok
