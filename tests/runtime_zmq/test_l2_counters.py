"""The disk tier's own rejects are counted and logged, and ``l2_writes`` counts only objects a
tier took (hostile finding 11): a planted file with a bad header or another key's object was a
silent miss, and a write every tier refused still counted as written."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from mpcache.core_sm.effects import WriteL2
from mpcache.core_sm.messages import L2WriteFinished
from mpcache.core_sm.chunks import ObjectKey
from mpcache.runtime_zmq.l2 import DiskTier
from test_l2_integrity import Harness, _file_of, disk  # noqa: F401 (the fixture)


def test_disk_header_and_key_rejects_are_counted_and_logged_once(disk: tuple[Harness, DiskTier],  # noqa: F811
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    h, tier = disk
    a, b, c = (ObjectKey(bytes([i]) * 16, 0) for i in (1, 2, 3))
    h.store(a, 0, b"a" * 1000)
    path_b, path_c = _file_of(tier, b), _file_of(tier, c)
    for p in (path_b, path_c):
        p.parent.mkdir(mode=0o700, exist_ok=True)
    path_b.write_bytes(_file_of(tier, a).read_bytes())  # a's object under b's name: another key
    path_c.write_bytes(b"MPL2" + os.urandom(40))  # lengths that do not add up: a bad header
    with caplog.at_level(logging.WARNING, logger="mpcache.l2"):
        assert [h.load(k, 1) for k in (b, c)] == [False, False]
    s = h.worker.stats()
    assert s["l2_tier_rejected_key"] == 1 and s["l2_tier_rejected_header"] == 1
    assert tier.stats()["rejected_key"] == 1 and tier.stats()["rejected_header"] == 1
    assert caplog.text.count("rejected files") == 1  # once per interval, not per file
    assert "1 key" in caplog.text
    assert not path_b.exists() and not path_c.exists()
    assert h.load(a, 2)  # the real object is untouched


class RefusingTier:
    """An L2 tier whose service refuses every write (a full or read-only store)."""

    name = "refusing"

    def read(self, key: bytes) -> bytes | None:
        return None

    def contains(self, key: bytes) -> bool:
        return False

    def read_many(self, keys: Any) -> list[bytes | None]:
        return [None for _ in keys]

    def write(self, key: bytes, data: bytes) -> None:
        raise OSError("no space left")

    def write_many(self, items: Any) -> None:
        raise OSError("no space left")

    def close(self) -> None:
        pass


def test_l2_writes_counts_only_written_objects(tmp_path: Path) -> None:
    h = Harness([RefusingTier()], secret_file=str(tmp_path / "secret"))
    try:
        h.pool.write(0, b"x" * 100)
        h.worker.note_slot_size(0, 100)
        h.worker.write(WriteL2(7, ((ObjectKey(b"\x05" * 16, 0), 0),)))
        assert h.wait(1)[-1] == L2WriteFinished(7, False)
        s = h.worker.stats()
        assert s["l2_writes"] == 0 and s["l2_writes_failed"] == 1
    finally:
        h.close()
