"""The compiled scanner behind ``mpcache.runtime_zmq.tokens`` (imported only by ``tokens.load()``, so
numba is imported and the scanner compiled or loaded from numba's cache off the import path).

``scan_key(buf, name) -> (status, start, end, ids)``: walks the msgpack map in ``buf`` (a
read-only uint8 view of the frame); status 0 means ``buf[start:end]`` is the array under the str
key ``name`` and ``ids`` its values as uint32; status 1 means decline (``tokens``' contract)."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

_OK = 0
_FALLBACK = 1

# Frames arrive as immutable bytes: the scanner reads them through a read-only view, no copy.
_FRAME = numba.types.Array(numba.types.uint8, 1, "C", readonly=True)
_I64 = numba.types.int64


@numba.njit(_I64(_FRAME, _I64), cache=True, nogil=True)
def _skip_value(buf: Any, pos: int) -> int:  # pragma: no cover - compiled
    """Position just past the msgpack value starting at ``pos``, or -1 if it is malformed."""
    n = buf.shape[0]
    pending = 1
    while pending > 0:
        if pos >= n or pending > n - pos:
            return -1
        b = buf[pos]
        pos += 1
        pending -= 1
        if b <= 0x7F or b >= 0xE0:
            continue
        if b <= 0x8F:
            pending += 2 * (b & 0x0F)
        elif b <= 0x9F:
            pending += b & 0x0F
        elif b <= 0xBF:
            pos += b & 0x1F
        elif b == 0xC0 or b == 0xC2 or b == 0xC3:
            pass
        elif b == 0xC1:
            return -1
        elif b == 0xC4 or b == 0xD9:
            if pos + 1 > n:
                return -1
            pos += 1 + buf[pos]
        elif b == 0xC5 or b == 0xDA:
            if pos + 2 > n:
                return -1
            pos += 2 + ((np.int64(buf[pos]) << 8) | buf[pos + 1])
        elif b == 0xC6 or b == 0xDB:
            if pos + 4 > n:
                return -1
            pos += 4 + ((np.int64(buf[pos]) << 24) | (np.int64(buf[pos + 1]) << 16)
                        | (np.int64(buf[pos + 2]) << 8) | buf[pos + 3])
        elif b == 0xC7:
            if pos + 1 > n:
                return -1
            pos += 2 + buf[pos]
        elif b == 0xC8:
            if pos + 2 > n:
                return -1
            pos += 3 + ((np.int64(buf[pos]) << 8) | buf[pos + 1])
        elif b == 0xC9:
            if pos + 4 > n:
                return -1
            pos += 5 + ((np.int64(buf[pos]) << 24) | (np.int64(buf[pos + 1]) << 16)
                        | (np.int64(buf[pos + 2]) << 8) | buf[pos + 3])
        elif b == 0xCA or b == 0xCE or b == 0xD2:
            pos += 4
        elif b == 0xCB or b == 0xCF or b == 0xD3:
            pos += 8
        elif b == 0xCC or b == 0xD0:
            pos += 1
        elif b == 0xCD or b == 0xD1:
            pos += 2
        elif b == 0xD4:
            pos += 2
        elif b == 0xD5:
            pos += 3
        elif b == 0xD6:
            pos += 5
        elif b == 0xD7:
            pos += 9
        elif b == 0xD8:
            pos += 17
        elif b == 0xDC or b == 0xDE:
            if pos + 2 > n:
                return -1
            count = (np.int64(buf[pos]) << 8) | buf[pos + 1]
            pos += 2
            pending += 2 * count if b == 0xDE else count
        else:  # 0xDD array32, 0xDF map32
            if pos + 4 > n:
                return -1
            count = ((np.int64(buf[pos]) << 24) | (np.int64(buf[pos + 1]) << 16)
                     | (np.int64(buf[pos + 2]) << 8) | buf[pos + 3])
            pos += 4
            pending += 2 * count if b == 0xDF else count
        if pos > n:
            return -1
    return pos


@numba.njit(_I64(_FRAME, _I64, _I64), cache=True, nogil=True)
def _be(buf: Any, pos: int, width: int) -> int:  # pragma: no cover - compiled
    v = 0
    for i in range(width):
        v = (v << 8) | buf[pos + i]
    return v


@numba.njit(
    numba.types.Tuple((_I64, _I64, _I64, numba.types.uint32[::1]))(_FRAME, _FRAME),
    cache=True,
    nogil=True,
)
def _scan_key(buf: Any, name: Any) -> Any:  # pragma: no cover - compiled
    """(status, start, end, ids): ``buf[start:end]`` is the ``token_ids`` array, ``ids`` its values."""
    empty = np.empty(0, dtype=np.uint32)
    n = buf.shape[0]
    if n == 0:
        return _FALLBACK, 0, 0, empty
    b = buf[0]
    pos = 1
    if 0x80 <= b <= 0x8F:
        entries = int(b & 0x0F)
    elif b == 0xDE and n >= 3:
        entries = _be(buf, 1, 2)
        pos = 3
    elif b == 0xDF and n >= 5:
        entries = _be(buf, 1, 4)
        pos = 5
    else:
        return _FALLBACK, 0, 0, empty
    if 2 * entries > n - pos:
        return _FALLBACK, 0, 0, empty
    found = False
    start = 0
    end = 0
    ids = empty
    klen = name.shape[0]
    for _ in range(entries):
        # key: a str of any msgpack width whose bytes are ``name``; anything else is skipped
        key_end = _skip_value(buf, pos)
        if key_end < 0:
            return _FALLBACK, 0, 0, empty
        kb = buf[pos]
        if 0xA0 <= kb <= 0xBF:
            head = 1
        elif kb == 0xD9:
            head = 2
        elif kb == 0xDA:
            head = 3
        elif kb == 0xDB:
            head = 5
        else:
            head = 0
        match = head > 0 and key_end - pos - head == klen
        if match:
            for i in range(klen):
                if buf[pos + head + i] != name[i]:
                    match = False
                    break
        pos = key_end
        if not match:
            pos = _skip_value(buf, pos)
            if pos < 0:
                return _FALLBACK, 0, 0, empty
            continue
        if found or pos >= n:
            return _FALLBACK, 0, 0, empty
        found = True
        start = pos
        ab = buf[pos]
        if 0x90 <= ab <= 0x9F:
            count = int(ab & 0x0F)
            pos += 1
        elif ab == 0xDC and pos + 3 <= n:
            count = _be(buf, pos + 1, 2)
            pos += 3
        elif ab == 0xDD and pos + 5 <= n:
            count = _be(buf, pos + 1, 4)
            pos += 5
        else:
            return _FALLBACK, 0, 0, empty
        if count > n - pos:
            return _FALLBACK, 0, 0, empty
        ids = np.empty(count, dtype=np.uint32)
        # The common forms (positive fixint, uint8, uint16, uint32) without a data-dependent
        # branch while 5 bytes remain: with real vocabularies the ids mix 3- and 5-byte forms
        # at random, and a branch per id mispredicted about half the time (2-3x slower). The
        # next id's position is the only serial dependency. Anything else stops this loop and
        # the checked loop below takes over at the same id.
        i = 0
        limit = n - 5
        while i < count and pos <= limit:
            t = np.int64(buf[pos])
            fix = t <= 0x7F
            if not fix and (t < 0xCC or t > 0xCE):
                break
            k = (t - 0xCC) & 3  # uint8 / uint16 / uint32: 0 / 1 / 2
            v = ((np.int64(buf[pos + 1]) << 24) | (np.int64(buf[pos + 2]) << 16)
                 | (np.int64(buf[pos + 3]) << 8) | np.int64(buf[pos + 4]))
            ids[i] = t if fix else v >> (24 - 8 * k - 8 * (k >> 1))
            pos += int(1 if fix else 2 + k + (k >> 1))
            i += 1
        for i in range(i, count):
            if pos >= n:
                return _FALLBACK, 0, 0, empty
            # Plain branches in int64 arithmetic measured fastest (a table-driven, branch-free
            # decode lengthens the dependency chain from one id's position to the next).
            t = np.int64(buf[pos])
            if t <= 0x7F:
                ids[i] = t
                pos += 1
                continue
            if pos + 5 <= n:
                if t == 0xCD:
                    ids[i] = (np.int64(buf[pos + 1]) << 8) | np.int64(buf[pos + 2])
                    pos += 3
                    continue
                if t == 0xCE:
                    ids[i] = ((np.int64(buf[pos + 1]) << 24) | (np.int64(buf[pos + 2]) << 16)
                              | (np.int64(buf[pos + 3]) << 8) | np.int64(buf[pos + 4]))
                    pos += 5
                    continue
            # The rarer forms, bounds-checked one by one: uint8, the signed forms other msgpack
            # writers may use for a non-negative id, the 64-bit forms, or not a uint32 at all.
            if t == 0xCC or t == 0xD0:
                w = 1
            elif t == 0xCD or t == 0xD1:
                w = 2
            elif t == 0xCE or t == 0xD2:
                w = 4
            elif t == 0xCF or t == 0xD3:
                w = 8
            else:  # negative fixint, nil, bool, float, str, ...
                return _FALLBACK, 0, 0, empty
            if pos + 1 + w > n or (t >= 0xD0 and buf[pos + 1] >= 0x80):
                return _FALLBACK, 0, 0, empty
            if w == 8:
                if buf[pos + 1] or buf[pos + 2] or buf[pos + 3] or buf[pos + 4]:
                    return _FALLBACK, 0, 0, empty
                ids[i] = _be(buf, pos + 5, 4)
            else:
                ids[i] = _be(buf, pos + 1, w)
            pos += 1 + w
        end = pos
    if not found or pos != n:
        return _FALLBACK, 0, 0, empty
    return _OK, start, end, ids


scan_key = _scan_key  # the entry point runtime_zmq.tokens calls
