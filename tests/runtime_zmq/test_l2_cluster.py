"""Redis Cluster L2 against a real 3-master + 3-replica cluster (`redis-server --cluster-enabled
yes`, joined by `redis-cli --cluster create`): hash-tagged keys, batches split by node, two mpcache
servers sharing it (one stores, the other hits), and a master killed mid-run: its slots are misses
(never an error, never a hang) until its replica takes over, then they hit again.

The tests share one cluster (module scope); the one that kills a master runs last."""
from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (pip install '.[redis]')")

from live_server import ServerProcess, wait_for  # noqa: E402
from redis_cluster import RedisClusterProcesses, redis_cluster  # noqa: E402,F401
from mpcache.runtime_zmq.client import MPCacheClient  # noqa: E402
from mpcache.runtime_zmq.l2 import L2Error, open_tier, split_l2_urls  # noqa: E402
from mpcache.runtime_zmq.l2_cluster import RedisClusterTier, parse_cluster_url  # noqa: E402
from test_server_ops import key, register, store_chunks, tokens  # noqa: E402
from test_tiers_shared import _retrieve_and_check, _written_behind  # noqa: E402

CHUNKS = 8


def test_cluster_urls() -> None:
    scheme, nodes, user, password, params = parse_cluster_url("redis+cluster://u:p%40ss@a:1,[::1]:2,b:3?ttl=5")
    assert (scheme, nodes, user, password, params) == (
        "redis+cluster", [("a", 1), ("::1", 2), ("b", 3)], "u", "p@ss", {"ttl": "5"})
    tier = open_tier("redis+cluster://u:s3cret@127.0.0.1:1,127.0.0.1:2")
    assert isinstance(tier, RedisClusterTier) and "s3cret" not in tier.name and ":***@" in tier.name
    tier.close()
    for bad, msg in [("redis+cluster://", "HOST:PORT"), ("redis+cluster://a:x", "HOST:PORT"),
                     ("redis+cluster://a:1/3", "database 0"), ("redis+cluster://a:1?color=2", "unknown")]:
        with pytest.raises(L2Error, match=msg):
            open_tier(bad)
    assert split_l2_urls("disk:/x,redis+cluster://a:1,b:2") == ["disk:/x", "redis+cluster://a:1,b:2"]


def test_tier_round_trip_and_hash_tags(redis_cluster: RedisClusterProcesses) -> None:  # noqa: F811
    tier = open_tier(redis_cluster.url("timeout=1"))
    assert isinstance(tier, RedisClusterTier)
    try:
        tier.ping()
        # one chunk's objects for every rank share a slot; many chunks spread over every master
        keys = [f"{{{i:032x}}}-{r}".encode() for i in range(30) for r in range(4)]
        values = [os.urandom(100) for _ in keys]
        tier.write_many(list(zip(keys, values)))
        assert tier.read_many(keys + [b"{none}-0"]) == values + [None]
        assert tier.contains_many(keys[:2] + [b"{none}-0"]) == [True, True, False]
        client = tier._get()
        for i in range(30):
            assert len({client.keyslot(b"mpcache:" + k) for k in keys[i * 4:(i + 1) * 4]}) == 1
        masters = {redis_cluster.master_of(b"mpcache:" + k).port for k in keys}
        assert len(masters) == 3
        tier.delete(keys[0])
        assert tier.read(keys[0]) is None
    finally:
        tier.close()


def _keys_on(cluster: RedisClusterProcesses, port: int) -> list[bytes]:
    """The mpcache keys a node holds (KEYS over RESP; a test-sized database)."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"*2\r\n$4\r\nKEYS\r\n$9\r\nmpcache:*\r\n")
        time.sleep(0.05)
        data = s.recv(1 << 20)
    return [line for line in data.split(b"\r\n") if line.startswith(b"mpcache:")]


def test_two_servers_share_the_cluster_and_survive_a_master_kill(
    start_server: Callable[..., ServerProcess], redis_cluster: RedisClusterProcesses  # noqa: F811
) -> None:
    secret = tempfile.mkdtemp(prefix="mpcache-secret-") + "/l2.secret"  # one secret for the fleet
    url = redis_cluster.url("timeout=0.5")
    flags = ("--l2", url, "--l2-secret-file", secret, "--l2-deadline", "2")
    a = start_server(*flags)
    b = start_server(*flags)
    ca = MPCacheClient(a.url, request_timeout=5.0)
    cb = MPCacheClient(b.url, request_timeout=5.0)
    try:
        register(ca, 1)
        register(cb, 2)
        toks = tokens(CHUNKS, seed=51)
        assert store_chunks(ca, toks, "w", iid=1, seed=9)["stored"] == CHUNKS
        assert wait_for(lambda: _written_behind(ca, CHUNKS), timeout=10.0)
        assert ca.stats()["l2_errors"] == 0
        _retrieve_and_check(cb, toks, "r0", 2, seed=9)  # B never saw them: from the cluster

        # a second prompt; then SIGKILL a master that holds some of its objects
        before = {n.port: set(_keys_on(redis_cluster, n.port)) for n in redis_cluster.nodes[:3]}
        toks2 = tokens(CHUNKS, seed=52)
        assert store_chunks(ca, toks2, "w2", iid=1, seed=10)["stored"] == CHUNKS
        assert wait_for(lambda: _written_behind(ca, 2 * CHUNKS), timeout=10.0)
        time.sleep(0.3)  # asynchronous replication to the replicas
        victim = next(n for n in redis_cluster.nodes[:3] if set(_keys_on(redis_cluster, n.port)) - before[n.port])
        # a fresh server C (nothing in L1), started before the kill, looks the prompt up while the
        # master is down (the failover takes ~2 s with cluster-node-timeout 1000)
        c3 = MPCacheClient(start_server(*flags).url, request_timeout=5.0)
        killed_at = time.monotonic()
        victim.kill()
        try:
            register(c3, 3)
            started = time.monotonic()
            c3.lookup(key(toks2, "during")).result(5)
            hits = c3.wait_prefetch_status("during", 10.0).result(12)
            took = time.monotonic() - started
            assert isinstance(hits, int) and hits < CHUNKS, hits  # misses for the dead node's slots
            nodes = c3.health()["l2_tiers"][0]["nodes"]
            assert nodes[f"127.0.0.1:{victim.port}"] in ("open", "half_open"), nodes
            assert took < 3.0, took  # bounded by the deadline, never a hang
            c3.end_session("during").result(5)
            s = c3.stats()
            assert s["pinned_effects"] == 0 and s["quarantined_slots"] == 0

            # after the failover the same server hits every chunk again
            recovered_at = None
            deadline = time.monotonic() + 30
            n = 0
            while time.monotonic() < deadline:
                n += 1
                c3.lookup(key(toks2, f"after{n}")).result(5)
                got = c3.wait_prefetch_status(f"after{n}", 10.0).result(12)
                c3.end_session(f"after{n}").result(5)
                if got == CHUNKS:
                    recovered_at = time.monotonic()
                    break
                time.sleep(0.2)
            assert recovered_at is not None, "no recovery after the failover"
            print(f"\nmaster killed -> mpcache hits again: {recovered_at - killed_at:.2f} s "
                  f"({n} lookups; the lookup during the outage answered {hits}/{CHUNKS} in {took:.2f} s)")
        finally:
            c3.close()
    finally:
        ca.close()
        cb.close()


# The ACL that docs/fleet.md recommends for a cluster (the cluster client also runs COMMAND and
# CLUSTER SLOTS/SHARDS/NODES to learn the topology).
FLEET_ACL = ("user mpcache on >{pw} ~mpcache:* resetchannels -@all +get +set +mget +exists +del +ping "
             "+cluster|slots +cluster|shards +cluster|nodes +readonly +info +command")


def test_cluster_with_the_documented_acl_user() -> None:
    from redis_server import RedisServer

    pw = "fleet-pw-4471"
    node = RedisServer(args=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"],
                       config=[FLEET_ACL.format(pw=pw), "user default off", "user admin on >admin-pw ~* &* +@all"])
    try:
        node.start()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    try:
        with socket.create_connection(("127.0.0.1", node.port), timeout=2) as s:  # a one-node cluster
            s.sendall(b"AUTH admin admin-pw\r\nCLUSTER ADDSLOTSRANGE 0 16383\r\n")
            time.sleep(0.1)
            assert s.recv(100).count(b"+OK") == 2
        pw_file = os.path.join(tempfile.mkdtemp(prefix="mpcache-pw-"), "pw")
        with open(os.open(pw_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(pw)
        tier = open_tier(f"redis+cluster://mpcache@127.0.0.1:{node.port}?password_file={pw_file}&timeout=1")
        try:
            end = time.monotonic() + 10
            while True:
                try:
                    tier.ping()
                    tier.write_many([(b"{a}-0", b"x")])
                    break
                except L2Error:
                    if time.monotonic() > end:
                        raise
                    time.sleep(0.1)
            assert tier.read_many([b"{a}-0", b"{b}-0"]) == [b"x", None] and tier.contains_many([b"{a}-0"]) == [True]
            assert pw not in tier.name
        finally:
            tier.close()
    finally:
        node.stop()
