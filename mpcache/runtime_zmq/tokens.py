"""Fast decoding of LMCache's list-form token ids: one compiled pass over the msgpack frame.

LMCache's client sends a key's ``token_ids`` as a msgpack array of ints. Decoding that with
``msgpack.unpackb`` builds one Python int per token (8,192 of them for an 8k prompt), then
packing them into ``TokenIds`` walks them again; on the lookup path that was most of the server's
CPU (docs/benchmarks.md, "Lookup path profile"). ``decode_key_frame`` instead walks the frame's
msgpack structure in a numba-compiled scanner, writes the ids straight into a uint32 buffer, and
lets msgpack decode only the rest of the map (a few short fields).

Contract:

* ``decode_key_frame(frame)`` returns the key map exactly as ``msgpack.unpackb(frame,
  raw=False, strict_map_key=False)`` would, except that ``token_ids`` is the ids' packed
  little-endian uint32 ``bytes`` (what ``TokenIds.from_packed`` takes) instead of a list.
* It returns ``None`` whenever it does not take the fast path, and then the caller decodes the
  frame the ordinary way and gets the ordinary result or error: the frame is not a map, has no
  ``token_ids`` or more than one, ``token_ids`` is not an array (mpcache's packed ``bin`` form
  is already cheap), an element is not an int in ``[0, 2**32)`` (so the ordinary path reports
  the bad id), or the frame is malformed anywhere (truncated, trailing bytes, reserved byte).
  So taking the fast path never changes what a request means or which error it gets.
* Work and memory are bounded by the frame: the scanner never allocates more than one uint32
  per remaining frame byte and never loops more than once per byte.

Loading: ``load()`` compiles the scanner (numba, ``cache=True``, explicit signatures), about
1.5-2 s the first time and 0.3 s from the cache, most of it importing numba. The server calls
``load_in_background()`` when it starts, so its first reply does not wait for that; until the
scanner is ready, ``decode_key_frame`` returns ``None`` (the ordinary path). No request ever pays
numba's compile time. If the scanner cannot load (numba or numpy not installed, a compile error),
the background load logs one warning and the server keeps decoding list-form ids with msgpack:
correct, but an 8k-token list-form lookup cycle then costs the server about 2.3 times the CPU
(``mpcache-bench serverpath``; packed ids do not go through this module).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import msgpack  # type: ignore[import-untyped]

_OK = 0  # the scanner's status for "took the fast path" (runtime_zmq._tokens_scan)


# frame -> (status, start, end, ids); None until load() has run
_scan_frame: Callable[[bytes | memoryview], Any] | None = None
_load_lock = threading.Lock()
log = logging.getLogger("mpcache.tokens")


def load() -> None:
    """Compile (or load from numba's cache) the scanner; blocks; thread-safe and idempotent.
    numpy is imported here too, not with this module: the server's start-up path (which imports
    this module through the codec) never waits for it."""
    global _scan_frame
    with _load_lock:
        if _scan_frame is None:
            import numpy as np

            from mpcache.runtime_zmq import _tokens_scan  # imports numba; compiles or loads the scanner

            scan_key = _tokens_scan.scan_key
            token_ids_key = np.frombuffer(b"token_ids", dtype=np.uint8)
            frombuffer, uint8 = np.frombuffer, np.uint8

            def scan_frame(frame: bytes | memoryview) -> Any:
                return scan_key(frombuffer(frame, dtype=uint8), token_ids_key)

            # the first call costs ~8 ms more (numba's dispatch warming up): pay it here, on the
            # loading thread, not on the server loop's first list-form key
            scan_frame(msgpack.packb({"token_ids": [1, 2]}))
            _scan_frame = scan_frame


def _load_or_warn() -> None:
    try:
        load()
    except Exception as exc:  # numba or numpy missing, a compile error: the ordinary path stays
        log.warning("list-form token ids are decoded by msgpack: the compiled scanner is off (%s: %s)",
                    type(exc).__name__, exc)


def load_in_background() -> threading.Thread:
    """Start ``load()`` on a thread and return it (the caller joins it when it shuts down). A
    scanner that cannot load is one warning, never an exception on that thread."""
    thread = threading.Thread(target=_load_or_warn, name="mpcache-token-scanner", daemon=True)
    thread.start()
    return thread


def ready() -> bool:
    """Whether ``decode_key_frame`` takes the fast path."""
    return _scan_frame is not None


_NIL = b"\xc0"
_BIG_ENDIAN = sys.byteorder != "little"


def decode_key_frame(frame: bytes | memoryview, unpack: Callable[[bytes], Any] | None = None) -> dict[Any, Any] | None:
    """The key map of ``frame`` with ``token_ids`` as packed little-endian uint32 bytes, or
    ``None`` to decode it the ordinary way (see the module docstring). Never raises for a
    frame the scanner declines; a frame whose other fields are not valid msgpack raises what
    ``msgpack.unpackb`` raises, as the ordinary path would. ``unpack`` decodes the rest of the
    map (default ``msgpack.unpackb``; the server passes one with its per-payload limits)."""
    scan = _scan_frame
    if scan is None:
        return None
    status, start, end, ids = scan(frame)
    if status != _OK:
        return None
    remainder = bytes(frame[:start]) + _NIL + bytes(frame[end:])
    if unpack is not None:
        rest = unpack(remainder)
    else:
        rest = msgpack.unpackb(remainder, raw=False, strict_map_key=False, use_list=True)
    if type(rest) is not dict:  # pragma: no cover - the scanner only accepts a map
        return None
    if _BIG_ENDIAN:  # pragma: no cover - little-endian hosts only in CI
        ids = ids.byteswap()
    rest["token_ids"] = ids.tobytes()
    return rest
