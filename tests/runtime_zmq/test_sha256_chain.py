"""The native keyed chunk chain (runtime_zmq.sha256_chain): hashlib's digests exactly, for any
key, root, length, chunk size and chunk cap; hashlib whenever it is not loaded or cannot be
(no libcrypto, a self-test mismatch), logged once; no GIL held while it hashes; the server's
chain is the native one and equals core_sm's reference."""
from __future__ import annotations

import logging
import os
import random
import tempfile
import threading
import time
from typing import Any

import pytest

from mpcache.core_sm.chunks import ChunkChain, TokenIds
from mpcache.runtime_zmq import sha256_chain


@pytest.fixture(scope="module")
def native() -> None:
    if not sha256_chain.load():
        pytest.fail(f"the native chain did not load on this host: {sha256_chain.status()}")


def _fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module state as before any load() (restored after the test)."""
    monkeypatch.setattr(sha256_chain, "_native", None)
    monkeypatch.setattr(sha256_chain, "_tried", False)
    monkeypatch.setattr(sha256_chain, "_status", "not loaded")


def _pair(rng: random.Random) -> tuple[ChunkChain, ChunkChain]:
    key = rng.randbytes(32)
    return ChunkChain(key), sha256_chain.chunk_chain(key)


@pytest.mark.parametrize("chunk_size", [16, 256, 1024])
def test_digests_equal_hashlibs_for_random_keys_roots_and_lengths(native: None, chunk_size: int) -> None:
    rng = random.Random(chunk_size)
    for trial in range(12):
        ref, fast = _pair(rng)
        root = rng.choice([b"", rng.randbytes(16), ref.root(f"model-{trial}", rng.randint(1, 8), "s")])
        n_tokens = rng.choice([0, 1, chunk_size - 1, chunk_size, chunk_size + 1,
                               rng.randint(2, 40) * chunk_size + rng.randint(0, chunk_size - 1)])
        tokens = TokenIds.from_packed(rng.randbytes(4 * n_tokens))
        for cap in (None, -1, 0, 1, 3, n_tokens // chunk_size, n_tokens // chunk_size + 5):
            want = ref.hashes(tokens, chunk_size, root, cap)
            assert fast.hashes(tokens, chunk_size, root, cap) == want
            assert fast.hashes(tokens.tolist(), chunk_size, root, cap) == want  # list input too
            assert all(type(h) is bytes and len(h) == 16 for h in want)


def test_digests_equal_hashlibs_from_1_to_600_chunks(native: None) -> None:
    rng = random.Random(600)
    ref, fast = _pair(rng)
    root = ref.root("m", 2, "")
    tokens = TokenIds.from_packed(rng.randbytes(4 * 600 * 256))
    for n in [1, 2, 3, 31, 32, 33, 127, 128, 599, 600]:
        assert fast.hashes(tokens[: n * 256], 256, root) == ref.hashes(tokens[: n * 256], 256, root)


def test_chains_with_different_keys_differ(native: None) -> None:
    tokens = TokenIds.from_packed(bytes(4 * 512))
    a, b = sha256_chain.chunk_chain(bytes(32)), sha256_chain.chunk_chain(bytes(31) + b"\x01")
    assert a.hashes(tokens, 256, bytes(16)) != b.hashes(tokens, 256, bytes(16))


def test_invalid_tokens_raise_as_hashlibs_path(native: None) -> None:
    fast = sha256_chain.chunk_chain(bytes(32))
    with pytest.raises((ValueError, OverflowError)):
        fast.hashes([1, 2, -3, 4], 2)
    with pytest.raises(ValueError):
        fast.hashes([1, 2], 0)


def test_not_loaded_declines_and_hashlib_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    _fresh_state(monkeypatch)
    assert not sha256_chain.ready() and sha256_chain.status() == "not loaded"
    key = bytes(range(32))
    batch = sha256_chain.batch_factory(b"\x00" * 64)
    assert batch(b"", bytes(1024), 1024, 1) is None
    tokens = TokenIds.from_packed(bytes(range(256)) * 16)
    assert sha256_chain.chunk_chain(key).hashes(tokens, 16) == ChunkChain(key).hashes(tokens, 16)


def test_no_libcrypto_falls_back_logged_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _fresh_state(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="mpcache.sha256_chain"):
        assert sha256_chain.load(library="/nonexistent/libcrypto.so.3") is False
        assert sha256_chain.load() is False  # tried once: no second attempt, no second log
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "stays on hashlib" in caplog.text and "nonexistent" in caplog.text
    assert sha256_chain.status().startswith("hashlib (native chain off: ")
    key = bytes(32)
    tokens = TokenIds.from_packed(bytes(4 * 512))
    assert sha256_chain.chunk_chain(key).hashes(tokens) == ChunkChain(key).hashes(tokens)


def test_a_library_without_the_symbols_is_refused(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import ctypes.util

    libc = ctypes.util.find_library("c")
    assert libc is not None
    _fresh_state(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="mpcache.sha256_chain"):
        assert sha256_chain.load(library=libc) is False
    assert "SHA256_Init" in caplog.text and not sha256_chain.ready()


def test_self_test_mismatch_keeps_hashlib(native: None, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    real_build = sha256_chain._build

    def wrong_build(library: str | None) -> Any:
        good = real_build(library)

        def chain(*args: Any) -> int:  # one digest bit off: what a wrong library would give
            ok = good.chain(*args)
            args[-1][0] ^= 1
            return ok

        return good._replace(chain=chain)

    _fresh_state(monkeypatch)
    monkeypatch.setattr(sha256_chain, "_build", wrong_build)
    with caplog.at_level(logging.WARNING, logger="mpcache.sha256_chain"):
        assert sha256_chain.load() is False
    assert "differ from hashlib" in caplog.text and not sha256_chain.ready()
    key = bytes(32)
    tokens = TokenIds.from_packed(bytes(4 * 512))
    assert sha256_chain.chunk_chain(key).hashes(tokens) == ChunkChain(key).hashes(tokens)


def test_the_compiled_module_refuses_an_import_before_libcrypto_is_registered() -> None:
    """Imported directly in a fresh process (no sha256_chain.load()), it raises ImportError
    instead of LLVM aborting the process on an unresolved symbol."""
    import subprocess
    import sys

    code = ("try:\n import mpcache.runtime_zmq._sha256_chain\nexcept ImportError as e:\n print('refused', e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    assert done.returncode == 0 and done.stdout.startswith("refused"), (done.stdout, done.stderr[-2000:])


def test_hashing_releases_the_gil(native: None) -> None:
    """While one thread hashes a long input natively, another runs Python code."""
    fast = sha256_chain.chunk_chain(bytes(32))
    tokens = TokenIds.from_packed(bytes(16 << 20))  # 16 MiB: ~10 ms of SHA-256 in one call
    for _attempt in range(5):
        window: list[float] = []
        started = threading.Event()

        def hash_once() -> None:
            started.set()
            t0 = time.perf_counter()
            fast.hashes(tokens, 1024)
            window.extend((t0, time.perf_counter()))

        worker = threading.Thread(target=hash_once)
        ticks: list[float] = []
        worker.start()
        started.wait()
        while worker.is_alive():
            ticks.append(time.perf_counter())
        worker.join()
        t0, t1 = window
        inside = [t for t in ticks if t0 + 0.002 < t < t1 - 0.002]
        if inside:
            return
    pytest.fail("the main thread never ran while the native chain was hashing: the GIL is held")


def test_the_server_hashes_natively_with_its_own_key(native: None) -> None:
    from mpcache.runtime_zmq.server import Server, ServerConfig

    d = tempfile.mkdtemp(prefix="mpcache-sha-")
    key_file = os.path.join(d, "chunk.key")
    server = Server(ServerConfig(url=f"ipc://{d}/s.sock", l1_size_bytes=4 << 20, slot_bytes=1 << 20,
                                 l1_reserve=False, chunk_key_file=key_file))
    loop = threading.Thread(target=server.serve_forever, name="server-loop")
    loop.start()
    try:
        with open(key_file) as f:
            key = bytes.fromhex(f.read().strip())
        chain = server.machine.ctx.chain
        assert chain.fingerprint == ChunkChain(key).fingerprint
        tokens = TokenIds.from_packed(random.Random(1).randbytes(4 * 8192))
        root = chain.root("m", 1, "")
        batch = chain._batch
        assert batch is not None and batch(root, tokens.packed, 1024, 32) is not None  # native, not declined
        assert chain.hashes(tokens, 256, root) == ChunkChain(key).hashes(tokens, 256, root)
        assert server.stats()["native_chunk_hash_ready"] is True
    finally:
        server.stop()
        loop.join(30)  # a first start also compiles the token scanner (numba), once per checkout
        assert not loop.is_alive()
