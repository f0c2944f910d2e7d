"""``mpcache-server --trace FILE``: record the server machine's event stream (mpcache.core_sm.trace).

One JSON line per ``LookupServer.handle`` call (``[now, event, effects]``) after a header line;
token ids are recorded as chunk hashes unless ``--trace-tokens`` (no prompt text by default).
Bounded: past ``max_bytes`` the file is renamed ``FILE.1`` (replacing an older one) and a new
``FILE`` starts with a header saying it begins mid-run, so at most about twice ``max_bytes`` is
on disk. Replay: ``mpcache-sim replay-trace FILE``. A write that fails turns tracing off with one
log line; serving goes on.
"""
from __future__ import annotations

import json
import logging
import os
from typing import IO, Any

from mpcache.core_sm.trace import TraceCodec, header

log = logging.getLogger("mpcache.trace")


class TraceWriter:
    def __init__(self, path: str, machine: Any, *, keep_tokens: bool = False, max_bytes: int = 256 << 20) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._config = machine.config
        self._keep_tokens = keep_tokens
        chunk = machine.config.chunk_size

        def hashes_of(key: Any) -> tuple[bytes, ...]:
            found, _err = machine.ctx.hashes(key, key.end // chunk)
            return tuple(found)

        self._codec = TraceCodec(keep_tokens=keep_tokens, hashes_of=hashes_of)
        self._part = 0
        self._file: IO[str] | None = None
        self._written = 0
        self.records = 0
        self._open()

    def _open(self) -> None:
        self._file = open(self.path, "w", encoding="utf-8")
        os.chmod(self.path, 0o600)
        line = json.dumps(header(self._config, self._keep_tokens, self._part), separators=(",", ":")) + "\n"
        self._file.write(line)
        self._written = len(line)

    def record(self, now: float, event: Any, effects: list[Any]) -> None:
        if self._file is None:
            return
        try:
            line = json.dumps([now, self._codec.encode(event), self._codec.encode(effects)], separators=(",", ":")) + "\n"
            self._file.write(line)
            self._written += len(line)
            self.records += 1
            if self._written >= self.max_bytes:
                self._file.close()
                os.replace(self.path, self.path + ".1")
                self._part += 1
                self._open()
        except Exception:  # tracing is a diagnostic: never let it stop the server
            log.exception("trace %s: writing failed; tracing is off", self.path)
            self.close()

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            finally:
                self._file = None
