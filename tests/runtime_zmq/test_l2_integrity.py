"""L2 integrity: every value is sealed with its exact size and a keyed checksum; a short, long,
corrupt, forged or moved value read back is a miss (counted, logged once per interval, deleted
where the tier allows), never bytes in an L1 slot."""
from __future__ import annotations

import logging
import os
import stat
import struct
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.effects import ReadL2, WriteL2
from mpcache.core_sm.messages import L2ReadFinished, L2WriteFinished
from mpcache.runtime_zmq.l1_pool import SharedMemoryPool
from mpcache.runtime_zmq.l2 import DiskTier, open_tier
from mpcache.runtime_zmq.l2_seal import HEADER_BYTES, MacAlgorithm, Rejection, Sealer, SecretFileError, load_or_create_secret
from mpcache.runtime_zmq.l2_worker import L2Options, L2Worker, default_secret_file, storage_key

SECRET = bytes(range(32))
KEY = b"{00112233445566778899aabbccddeeff}-0"


@pytest.mark.parametrize("alg", list(MacAlgorithm))
def test_seal_round_trip_and_every_rejection(alg: MacAlgorithm) -> None:
    s = Sealer(SECRET, alg)
    payload = os.urandom(5000)
    blob = s.seal(KEY, payload)
    assert len(blob) == HEADER_BYTES + len(payload)
    assert bytes(s.open(KEY, blob)) == payload  # type: ignore[arg-type]
    assert bytes(s.open(KEY, s.seal(KEY, b""))) == b""  # type: ignore[arg-type]
    assert s.open(KEY, blob[:-1]) is Rejection.SHORT
    assert s.open(KEY, blob[:10]) is Rejection.SHORT
    assert s.open(KEY, b"\x07") is Rejection.SHORT  # the 1-byte value planted in Redis
    assert s.open(KEY, blob + b"\x00") is Rejection.LONG
    flipped = bytearray(blob)
    flipped[HEADER_BYTES + 1234] ^= 0x01
    assert s.open(KEY, bytes(flipped)) is Rejection.FORGED
    assert s.open(b"{ff}-0", blob) is Rejection.FORGED  # a valid object moved under another key
    assert Sealer(bytes(32), alg).open(KEY, blob) is Rejection.FORGED  # sealed without our secret
    assert s.open(KEY, b"MPL2" + blob[4:]) is Rejection.BAD_HEADER  # an old layout
    assert s.open(KEY, b"MPL3" + blob[4:]) is Rejection.BAD_HEADER  # the unkeyed-chain layout
    # a size field rewritten to match a cut value: still caught by the tag
    cut = bytearray(blob[:-100])
    struct.pack_into("<Q", cut, 8, len(payload) - 100)
    assert s.open(KEY, bytes(cut)) is Rejection.FORGED


def test_readers_check_either_algorithm() -> None:
    blob = Sealer(SECRET, MacAlgorithm.BLAKE2B).seal(KEY, b"x" * 100)
    assert bytes(Sealer(SECRET, MacAlgorithm.BLAKE3).open(KEY, blob)) == b"x" * 100  # type: ignore[arg-type]


def test_secret_file_is_made_private_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "state" / "l2.secret"
    secret = load_or_create_secret(str(path))
    assert len(secret) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert load_or_create_secret(str(path)) == secret
    os.chmod(path, 0o644)
    with pytest.raises(SecretFileError, match="chmod 600"):
        load_or_create_secret(str(path))
    os.chmod(path, 0o600)
    path.write_text("not hex\n")
    with pytest.raises(SecretFileError, match="64 hex digits"):
        load_or_create_secret(str(path))


def test_secret_defaults_to_the_disk_tier_directory(tmp_path: Path) -> None:
    tier = open_tier(f"disk:{tmp_path / 'l2'}")
    try:
        assert default_secret_file([tier]) == str(tmp_path / "l2" / ".secret")
    finally:
        tier.close()


# ----------------------------------------------------------------------------------- worker


class Harness:
    def __init__(self, tiers: list[Any], **options: Any) -> None:
        self.dir = tempfile.mkdtemp(prefix="mpcache-l2i-")
        self.pool = SharedMemoryPool(8 << 20, 1 << 20, directory=self.dir)
        self.posted: list[Any] = []
        self.cond = threading.Condition()
        options.setdefault("secret_file", os.path.join(self.dir, "secret"))
        self.worker = L2Worker(tiers, self.pool, self.post, workers=2, options=L2Options(**options))

    def post(self, ev: Any) -> None:
        with self.cond:
            self.posted.append(ev)
            self.cond.notify_all()

    def wait(self, n: int, timeout: float = 10.0) -> list[Any]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.posted) >= n, timeout), self.posted
            return list(self.posted)

    def store(self, key: ObjectKey, slot: int, data: bytes) -> None:
        self.pool.write(slot, data)
        self.worker.note_slot_size(slot, len(data))
        n = len(self.posted)
        self.worker.write(WriteL2(900 + n, ((key, slot),)))
        assert self.wait(n + 1)[-1] == L2WriteFinished(900 + n, True)

    def load(self, key: ObjectKey, slot: int) -> bool:
        n = len(self.posted)
        self.worker.read(ReadL2(100 + n, ((key, slot),)))
        ev = self.wait(n + 1)[-1]
        assert isinstance(ev, L2ReadFinished)
        return bool(ev.loaded[0])

    def close(self) -> None:
        self.worker.close()
        self.pool.close()


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[tuple[Harness, DiskTier]]:
    tier = open_tier(f"disk:{tmp_path / 'l2'}")
    assert isinstance(tier, DiskTier)
    h = Harness([tier], secret_file=None)  # the secret beside the objects
    yield h, tier
    h.close()


def _file_of(tier: DiskTier, key: ObjectKey) -> Path:
    return Path(tier._object_path(tier._file_name(storage_key(key))))


def test_flipped_byte_on_disk_is_a_counted_miss_and_the_file_goes(disk: tuple[Harness, DiskTier],
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    h, tier = disk
    assert stat.S_IMODE(os.stat(os.path.join(tier.root, ".secret")).st_mode) == 0o600
    k = ObjectKey(b"\x11" * 16, 0)
    data = os.urandom(300_000)
    h.store(k, 0, data)
    assert h.load(k, 1) and bytes(h.pool.view(1, len(data))) == data
    path = _file_of(tier, k)
    raw = bytearray(path.read_bytes())
    raw[-5000] ^= 0x40
    path.write_bytes(bytes(raw))
    h.pool.write(2, b"\xee" * len(data))
    with caplog.at_level(logging.WARNING, logger="mpcache.l2"):
        assert not h.load(k, 2)
    assert bytes(h.pool.view(2, len(data))) == b"\xee" * len(data)  # nothing was written to the slot
    s = h.worker.stats()
    assert s["l2_rejected"] == 1 and s["l2_rejected_forged"] == 1
    assert not path.exists() and not tier.contains(storage_key(k))
    assert "rejected" in caplog.text and "1 forged" in caplog.text


def test_planted_short_and_long_values_are_misses_logged_once(disk: tuple[Harness, DiskTier],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    h, tier = disk
    keys = [ObjectKey(bytes([i]) * 16, 0) for i in range(4)]
    h.store(keys[0], 0, b"a" * 1000)
    good = tier.read(storage_key(keys[0]))
    assert good is not None
    tier.write(storage_key(keys[1]), b"\x01")  # a 1-byte value under a key computed offline
    tier.write(storage_key(keys[2]), good[:-10])  # cut short
    tier.write(storage_key(keys[3]), good + b"tail")  # too long
    with caplog.at_level(logging.WARNING, logger="mpcache.l2"):
        assert [h.load(k, 1) for k in keys[1:]] == [False, False, False]
    s = h.worker.stats()
    assert s["l2_rejected"] == 3 and s["l2_rejected_short"] == 2 and s["l2_rejected_long"] == 1
    assert caplog.text.count("L2: rejected objects") == 1  # once per interval, not per object
    assert tier.objects == 1


def test_redis_planted_values_are_misses_and_deleted(tmp_path: Path) -> None:
    redis = pytest.importorskip("redis")
    from redis_server import RedisServer

    try:
        server = RedisServer()
        server.start()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    try:
        tier = open_tier(server.url)
        h = Harness([tier])
        raw = redis.Redis.from_url(server.url)
        try:
            k = ObjectKey(b"\x22" * 16, 3)
            rkey = b"mpcache:" + storage_key(k)
            raw.set(rkey, b"\x01")
            assert not h.load(k, 0)
            assert raw.get(rkey) is None  # deleted
            forged = Sealer(bytes(32)).seal(storage_key(k), b"z" * 4096)  # right shape, wrong secret
            raw.set(rkey, forged)
            assert not h.load(k, 0) and raw.get(rkey) is None
            h.store(k, 1, b"q" * 4096)
            assert h.load(k, 2) and bytes(h.pool.view(2, 4096)) == b"q" * 4096
            assert h.worker.stats()["l2_rejected"] == 2
        finally:
            raw.close()
            h.close()
    finally:
        server.stop()


def test_a_valid_object_of_the_wrong_size_is_a_miss(disk: tuple[Harness, DiskTier]) -> None:
    h, tier = disk
    k = ObjectKey(b"\x33" * 16, 1)
    h.store(k, 0, b"s" * 2048)
    n = len(h.posted)
    h.worker.read(ReadL2(77, ((k, 1),), object_bytes=4096))  # the reader expects 4096-byte objects
    assert h.wait(n + 1)[-1] == L2ReadFinished(77, (False,))
    # a miss, never a deletion: a registration declaring another size cannot destroy the tier
    assert h.worker.stats()["l2_rejected_wrong_size"] == 1 and tier.objects == 1
    n = len(h.posted)
    h.worker.read(ReadL2(76, ((k, 1),), object_bytes=2048))  # its own readers still hit
    assert h.wait(n + 1)[-1] == L2ReadFinished(76, (True,))
    h.store(k, 0, b"t" * 4096)
    n = len(h.posted)
    h.worker.read(ReadL2(78, ((k, 1),), object_bytes=4096))
    assert h.wait(n + 1)[-1] == L2ReadFinished(78, (True,))
