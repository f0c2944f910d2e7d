"""The disk L2 tier: round trips, atomic replacement, private directory, cap with LRU eviction,
restart, damaged files, concurrent writers and readers."""
from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from mpcache.runtime_zmq.l2 import DiskTier, L2Error, L2Tier, open_tier


def _tier(path: Path, query: str = "") -> DiskTier:
    tier = open_tier(f"disk:{path}{query}")
    assert isinstance(tier, DiskTier)
    return tier


def _object_files(root: Path) -> list[Path]:
    return [p for p in root.glob("??/*") if p.is_file()]


def test_round_trip_and_protocol(tmp_path: Path) -> None:
    tier = _tier(tmp_path / "l2")
    try:
        assert isinstance(tier, L2Tier)
        assert "disk:" in tier.name
        key = bytes(range(40)) + b"\x00\xff"
        assert tier.read(key) is None
        assert not tier.contains(key)
        value = os.urandom(70_000)
        tier.write(key, value)
        assert tier.contains(key)
        assert tier.read(key) == value
        tier.write(key, b"second")  # replace
        assert tier.read(key) == b"second"
        assert tier.objects == 1
        assert tier.read(b"other") is None
        # Empty values and keys that differ in one byte stay apart.
        tier.write(b"k1", b"")
        tier.write(b"k2", b"x")
        assert tier.read(b"k1") == b""
        assert tier.read(b"k2") == b"x"
    finally:
        tier.close()


def test_batched_calls(tmp_path: Path) -> None:
    tier = _tier(tmp_path / "l2")
    try:
        tier.write_many([(b"a", b"1"), (b"b", b"2")])
        assert tier.read_many([b"a", b"missing", b"b"]) == [b"1", None, b"2"]
        assert tier.read_many([]) == []
    finally:
        tier.close()


def test_long_keys_are_hashed_and_checked(tmp_path: Path) -> None:
    tier = _tier(tmp_path / "l2")
    try:
        long_a = b"a" * 500
        long_b = b"a" * 499 + b"b"
        tier.write(long_a, b"A")
        tier.write(long_b, b"B")
        assert tier.read(long_a) == b"A"
        assert tier.read(long_b) == b"B"
        assert all(len(p.name) < 255 for p in _object_files(tmp_path / "l2"))
    finally:
        tier.close()


def test_directory_is_private(tmp_path: Path) -> None:
    root = tmp_path / "new" / "l2"
    tier = _tier(root)
    try:
        tier.write(b"k", b"v")
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        for sub in root.iterdir():
            if sub.is_dir():
                assert stat.S_IMODE(sub.stat().st_mode) & 0o077 == 0, sub
        for f in _object_files(root):
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    finally:
        tier.close()


def test_refuses_a_shared_directory(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(L2Error, match="must not be accessible to group or others"):
        open_tier(f"disk:{shared}")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755  # left as the user had it


def test_one_server_per_directory(tmp_path: Path) -> None:
    tier = _tier(tmp_path / "l2")
    try:
        with pytest.raises(L2Error, match="in use by another mpcache server"):
            _tier(tmp_path / "l2")
    finally:
        tier.close()
    _tier(tmp_path / "l2").close()  # free again once closed


def test_objects_survive_reopen(tmp_path: Path) -> None:
    tier = _tier(tmp_path / "l2")
    tier.write(b"persist", b"value")
    tier.close()
    tier = _tier(tmp_path / "l2")
    try:
        assert tier.contains(b"persist")
        assert tier.read(b"persist") == b"value"
        assert tier.objects == 1
    finally:
        tier.close()


def test_cap_evicts_least_recently_used(tmp_path: Path) -> None:
    # Each object is 1000 B of value plus a header and a 2 B key; the cap holds three.
    tier = _tier(tmp_path / "l2", "?max_bytes=3100")
    try:
        for k in (b"k0", b"k1", b"k2"):
            tier.write(k, b"x" * 1000)
        assert tier.read(b"k0") is not None  # k0 is now the most recently used
        tier.write(b"k3", b"x" * 1000)
        assert not tier.contains(b"k1") and tier.read(b"k1") is None
        assert all(tier.contains(k) for k in (b"k0", b"k2", b"k3"))
        assert tier.bytes_stored <= 3100
        assert len(_object_files(tmp_path / "l2")) == 3
        with pytest.raises(L2Error, match="does not fit"):
            tier.write(b"huge", b"x" * 5000)
    finally:
        tier.close()


def test_cap_applies_at_reopen_oldest_first(tmp_path: Path) -> None:
    root = tmp_path / "l2"
    tier = _tier(root)
    for i in range(5):
        tier.write(b"k%d" % i, b"x" * 1000)
    tier.close()
    # Make the write order unambiguous for the mtime-ordered scan.
    for i in range(5):
        tier_files = {p.name: p for p in _object_files(root)}
        path = tier_files[(b"k%d" % i).hex()]
        os.utime(path, (1_000_000 + i, 1_000_000 + i))
    tier = _tier(root, "?max_gb=0.0000021")  # about 2254 B: two objects
    try:
        assert [tier.contains(b"k%d" % i) for i in range(5)] == [False, False, False, True, True]
    finally:
        tier.close()


def test_damaged_file_reads_as_missing_and_is_dropped(tmp_path: Path) -> None:
    root = tmp_path / "l2"
    tier = _tier(root)
    try:
        tier.write(b"key", b"value" * 100)
        (path,) = _object_files(root)
        path.write_bytes(path.read_bytes()[:-10])  # cut short
        assert tier.read(b"key") is None
        assert not tier.contains(b"key")
        assert not path.exists()
        tier.write(b"key", b"fresh")
        assert tier.read(b"key") == b"fresh"
    finally:
        tier.close()


def test_leftover_temp_files_are_cleared(tmp_path: Path) -> None:
    root = tmp_path / "l2"
    _tier(root).close()
    (root / ".tmp" / "dead-writer.123").write_bytes(b"partial")
    tier = _tier(root)
    try:
        assert list((root / ".tmp").iterdir()) == []
        assert tier.objects == 0
    finally:
        tier.close()


def test_closed_tier_raises(tmp_path: Path) -> None:
    tier = _tier(tmp_path / "l2")
    tier.close()
    tier.close()  # idempotent
    with pytest.raises(L2Error, match="closed"):
        tier.read(b"k")
    with pytest.raises(L2Error, match="closed"):
        tier.write(b"k", b"v")


@pytest.mark.parametrize(
    "url, message",
    [
        ("disk:", "needs a path"),
        ("disk:/x?max_bytes=abc", "max_bytes must be an integer"),
        ("disk:/x?max_bytes=0", "must be positive"),
        ("disk:/x?max_gb=1&max_bytes=2", "not both"),
        ("disk:/x?colour=red", "unknown parameter"),
        ("s3://bucket", "unknown tier"),
        ("nonsense", "unknown tier"),
    ],
)
def test_bad_urls(url: str, message: str) -> None:
    with pytest.raises(L2Error, match=message):
        open_tier(url)


def test_concurrent_writers_and_readers_never_see_partial_values(tmp_path: Path) -> None:
    tier = _tier(tmp_path / "l2", "?max_bytes=400000")
    keys = [b"key-%d" % i for i in range(8)]
    # Each value is one repeated byte, so any torn or mixed value is detectable.
    sizes = (10_000, 30_000, 50_000)
    errors: list[str] = []
    stop = threading.Event()

    def writer(seed: int) -> None:
        n = 0
        while not stop.is_set():
            k = keys[(seed + n) % len(keys)]
            tier.write(k, bytes([(seed * 31 + n) % 251]) * sizes[n % len(sizes)])
            n += 1

    def reader() -> None:
        while not stop.is_set():
            for k in keys:
                v = tier.read(k)
                if v is not None and (len(v) not in sizes or v.count(v[:1]) != len(v)):
                    errors.append(f"torn value for {k!r}: {len(v)} B")

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(3)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    threading.Event().wait(1.0)
    stop.set()
    for t in threads:
        t.join()
    try:
        assert errors == []
        assert tier.bytes_stored <= 400_000
        on_disk = sum(p.stat().st_size for p in _object_files(tmp_path / "l2"))
        assert on_disk == tier.bytes_stored
        assert list((tmp_path / "l2" / ".tmp").iterdir()) == []
    finally:
        tier.close()


def test_stats_for_metrics(tmp_path: Path) -> None:
    tier = _tier(tmp_path / "l2", "?max_bytes=100000")
    try:
        tier.write(b"k", b"x" * 1000)
        st = tier.stats()
        assert st["objects"] == 1 and st["bytes"] == tier.bytes_stored > 1000 and st["max_bytes"] == 100000
    finally:
        tier.close()


def _each(tier: DiskTier, keys: list[bytes], limit: int | None = None) -> list[bytes | None]:
    out: list[bytes | None] = []
    tier.read_each(keys, lambda i, v: out.append(None if v is None else bytes(v)), limit)
    return out


def test_read_each_reads_into_a_reused_buffer_and_refuses_as_read_does(tmp_path: Path) -> None:
    root = tmp_path / "l2"
    tier = _tier(root)
    try:
        big, small = os.urandom(3 << 20), b"small"
        tier.write(b"big", big)
        tier.write(b"small", small)
        seen: list[int] = []
        tier.read_each([b"big", b"absent", b"small", b"big"], lambda i, v: seen.append(-1 if v is None else id(v.obj)))
        assert seen[1] == -1 and seen[0] == seen[2] == seen[3]  # one buffer for every value
        assert _each(tier, [b"big", b"absent", b"small"]) == [big, None, small]
        # larger than the reader's limit: a miss, the file kept and not read
        assert _each(tier, [b"big", b"small"], limit=1 << 20) == [None, small]
        assert tier.contains(b"big") and tier.read(b"big") == big
        # damaged: a miss, dropped (as read does)
        (path,) = [p for p in _object_files(root) if p.stat().st_size < 1000]
        path.write_bytes(path.read_bytes()[:-2])
        assert _each(tier, [b"small", b"big"]) == [None, big]
        assert not tier.contains(b"small") and not path.exists()
    finally:
        tier.close()
