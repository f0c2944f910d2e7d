"""The server's chunk keys are keyed (core_sm.chunks layout v3, docs/security.md "Chunk keys"):
never the public test key, the same on every server sharing an L2 secret, a key file when given."""
from __future__ import annotations

import os
import stat
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from core_sm.chunks import PUBLIC_CHAIN, ChunkChain
from runtime_zmq.l2 import DiskTier
from runtime_zmq.l2_seal import SecretFileError, Sealer
from runtime_zmq.l2_worker import L2Options
from runtime_zmq.server import Server, ServerConfig


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
