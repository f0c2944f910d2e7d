"""The server's chunk keys are keyed (mpcache.core_sm.chunks layout v3, docs/security.md "Chunk keys"):
never the public test key, the same on every server sharing an L2 secret, a key file when given."""
from __future__ import annotations

import os
import stat
import tempfile
import threading
from collections.abc import Iterator
from typing import Any
from contextlib import contextmanager

import pytest

from mpcache.core_sm.chunks import PUBLIC_CHAIN, ChunkChain
from mpcache.runtime_zmq.l2 import DiskTier
from mpcache.runtime_zmq.l2_seal import SecretFileError, Sealer
from mpcache.runtime_zmq.l2_worker import L2Options
from mpcache.runtime_zmq.server import Server, ServerConfig


@contextmanager
def running(**kw: object) -> Iterator[Server]:
    d = tempfile.mkdtemp(prefix="mpcache-ckey-")
    tiers = kw.pop("tiers", None)
    server = Server(ServerConfig(url=f"ipc://{d}/s.sock", l1_size_bytes=4 << 20, slot_bytes=1 << 20,
                                 l1_reserve=False, **kw), tiers=tiers)  # type: ignore[arg-type]
    loop = threading.Thread(target=server.serve_forever, name="server-loop")
    loop.start()
    try:
        yield server
    finally:
        server.stop()
        loop.join(10)
        assert not loop.is_alive()


def fingerprint(server: Server) -> str:
    return str(server.machine.ctx.chain.fingerprint)


def test_sealer_derives_one_chain_key_per_secret_and_never_the_secret() -> None:
    a, b = Sealer(bytes(range(32))), Sealer(bytes(32))
    assert a.chain_key() == Sealer(bytes(range(32))).chain_key()
    assert len(a.chain_key()) == 32 and a.chain_key() not in (b.chain_key(), bytes(range(32)))


def test_servers_sharing_an_l2_secret_share_chunk_keys_and_others_do_not() -> None:
    d = tempfile.mkdtemp(prefix="mpcache-ckey-l2-")
    shared = L2Options(secret_file=os.path.join(d, "fleet.secret"))
    other = L2Options(secret_file=os.path.join(d, "other.secret"))
    with running(tiers=[DiskTier(os.path.join(d, "t1"))], l2_options=shared) as s1, \
            running(tiers=[DiskTier(os.path.join(d, "t2"))], l2_options=shared) as s2, \
            running(tiers=[DiskTier(os.path.join(d, "t3"))], l2_options=other) as s3:
        assert fingerprint(s1) == fingerprint(s2) != fingerprint(s3)
        assert fingerprint(s1) != PUBLIC_CHAIN.fingerprint


def test_l1_only_servers_have_their_own_random_key() -> None:
    with running() as s1, running() as s2:
        assert len({fingerprint(s1), fingerprint(s2), PUBLIC_CHAIN.fingerprint}) == 3


def test_chunk_key_file_is_made_private_and_used() -> None:
    d = tempfile.mkdtemp(prefix="mpcache-ckey-file-")
    path = os.path.join(d, "keys", "chunk.key")
    with running(chunk_key_file=path) as s1:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        key = bytes.fromhex(open(path).read())
        assert fingerprint(s1) == ChunkChain(key).fingerprint
    with running(chunk_key_file=path) as s2:  # a restart keeps its keys (and its L2's hits)
        assert fingerprint(s2) == ChunkChain(key).fingerprint
    os.chmod(path, 0o640)
    with pytest.raises(SecretFileError, match="chunk key file"):
        with running(chunk_key_file=path):
            pass


def test_a_trace_never_holds_the_chunk_key_and_a_token_trace_replays_only_with_it(
        start_server: Any, tmp_path: Any, capsys: Any) -> None:
    import random

    from adapter_driver import CHUNK, Engine
    from mpcache.sim.cli import main as sim_main

    key_file = str(tmp_path / "chunk.key")
    key = bytes(range(100, 132))
    with open(os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(key.hex())
    trace = str(tmp_path / "tokens.trace")
    server = start_server("--chunk-size", str(CHUNK), "--l1-size-gb", str(4 / 1024), "--slot-mb", "1",
                          "--trace", trace, "--trace-tokens", "--chunk-key-file", key_file)
    engine = Engine([server.url])
    rng = random.Random(3)
    prompt = [rng.randrange(50_000) for _ in range(2 * CHUNK + 1)]
    try:
        for rid in ("a", "b"):
            engine.add(rid, prompt)
            engine.run_all()
    finally:
        engine.close()
    assert server.terminate() == 0
    text = open(trace).read()
    assert key.hex() not in text and ChunkChain(key).fingerprint in text
    assert sim_main(["replay-trace", trace]) == 2
    assert "chunk key" in capsys.readouterr().out
    assert sim_main(["replay-trace", trace, "--chunk-key-file", key_file]) == 0
    assert "no divergence" in capsys.readouterr().out
