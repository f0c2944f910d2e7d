"""Redis Cluster / Valkey cluster L2 tier, through redis-py's cluster client.

URL: ``redis+cluster://[USER[:PASSWORD]@]HOST:PORT[,HOST:PORT...][?PARAMS]`` (``rediss+cluster``
for TLS, ``valkey+cluster`` / ``valkeys+cluster`` alike). The hosts are startup nodes: any few
of the cluster's nodes; the client learns the rest (and every slot's master) from them. PARAMS are
the Redis tier's (``ttl``, ``prefix``, ``timeout``, ``pool``, ``password_file``, ``ca``, ``cert``,
``key``); a cluster has database 0 only.

How it behaves:

* Keys are ``prefix + key``; mpcache's object keys carry the chunk hash as a hash tag
  (``mpcache:{<chunk hash>}-<rank>``), so one chunk's objects for every rank live in one slot,
  on one node.
* A batch (``read_many`` / ``contains_many`` / ``write_many``) is split by the master that serves
  each key's slot; each node's share is one pipeline through the cluster client, which follows
  MOVED / ASK redirections and refreshes its slot map after a failover.
* A node that fails (down, hung, failing over) fails only its share: those keys are misses on read
  and not written on write; the other nodes' keys are served. Each node has a circuit breaker
  (``l2_health.Breaker``), so a dead node costs one timeout per backoff period, not one per
  batch. Only when every node of a batch failed does the tier raise ``L2Unavailable`` (then the
  L2 worker's breaker skips the whole tier).
* Opening it does not connect; the first call (or the worker's start ``ping``) does.
"""
from __future__ import annotations

import collections
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

from mpcache.runtime_zmq.l2_common import (
    L2Error,
    L2Unavailable,
    import_redis,
    redact,
    redis_options,
    split_params,
    translate_redis_error,
)
from mpcache.runtime_zmq.l2_health import Breaker

__all__ = ["RedisClusterTier", "parse_cluster_url"]


def parse_cluster_url(url: str) -> tuple[str, list[tuple[str, int]], str | None, str | None, dict[str, str]]:
    """(scheme, startup nodes, username, password, params) of a cluster URL; `L2Error` if bad."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise L2Error(f"L2 URL {redact(url)!r}: not a cluster URL")
    rest, params = split_params(rest)
    netloc, _, path = rest.partition("/")
    if path not in ("", "0"):
        raise L2Error(f"L2 URL {redact(url)!r}: a Redis Cluster has database 0 only")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(pw) if colon else None
    nodes: list[tuple[str, int]] = []
    for hp in hosts.split(","):
        hp = hp.strip()
        if not hp:
            continue
        if hp.startswith("["):  # [IPv6]:port
            host, _, port_s = hp[1:].partition("]:")
        else:
            host, _, port_s = hp.rpartition(":")
        if not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
            raise L2Error(f"L2 URL {redact(url)!r}: {hp!r} is not HOST:PORT")
        nodes.append((host, int(port_s)))
    if not nodes:
        raise L2Error(f"L2 URL {redact(url)!r}: a cluster tier needs at least one HOST:PORT")
    return scheme.lower(), nodes, username, password, params


class RedisClusterTier:
    """Objects in a Redis Cluster, shared by every server that points at it (see module doc)."""

    def __init__(
        self,
        url: str,
        nodes: Sequence[tuple[str, int]],
        *,
        username: str | None = None,
        password: str | None = None,
        tls: bool = False,
        ttl_s: int | None = None,
        prefix: bytes = b"mpcache:",
        timeout_s: float = 2.0,
        pool_size: int = 16,
        connection_kwargs: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._redis = import_redis()
        self._nodes = list(nodes)
        self._ttl_s = ttl_s
        self._prefix = prefix
        self._clock = clock
        kwargs = dict(connection_kwargs or {})
        if password is not None and "password" not in kwargs:
            kwargs["password"] = password
        if username is not None:
            kwargs["username"] = username
        if tls:
            kwargs["ssl"] = True
        self._kwargs = kwargs
        self._timeout_s = timeout_s
        self._pool_size = pool_size
        self._lock = threading.Lock()
        self._client: Any = None
        self._closed = False
        self._breakers: dict[str, Breaker] = {}
        self.node_failures: collections.Counter[str] = collections.Counter()
        ttl = f", ttl {ttl_s} s" if ttl_s is not None else ""
        self.name = f"{redact(url)}{ttl}"

    @classmethod
    def from_url(cls, url: str) -> RedisClusterTier:
        scheme, nodes, username, password, params = parse_cluster_url(url)
        options = redis_options(url, params)
        bare = url.partition("?")[0]
        return cls(bare, nodes, username=username, password=password,
                   tls=scheme.split("+")[0] in ("rediss", "valkeys"), **options)

    # -- the tier API ------------------------------------------------------------------------

    def ping(self) -> None:
        client = self._get()
        try:
            client.ping(target_nodes=client.RANDOM)
        except self._redis.exceptions.RedisError as e:
            raise translate_redis_error(self._redis, self.name, e, "PING") from e

    def read(self, key: bytes) -> bytes | None:
        return self.read_many([key])[0]

    def contains(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def write(self, key: bytes, data: bytes) -> None:
        self.write_many([(key, data)])

    def delete(self, key: bytes) -> None:
        self._run("DEL", [key], lambda pipe, k: pipe.delete(k), None, strict=True)

    def read_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        values = self._run("GET", list(keys), lambda pipe, k: pipe.get(k), None, strict=False)
        return [None if v is None else bytes(v) for v in values]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [bool(v) for v in self._run("EXISTS", list(keys), lambda pipe, k: pipe.exists(k), 0, strict=False)]

    def write_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        values = dict(items)
        self._run("SET", [k for k, _ in items],
                  lambda pipe, k: pipe.set(k, values[k[len(self._prefix):]], ex=self._ttl_s), None, strict=True)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass

    def node_states(self) -> dict[str, str]:
        with self._lock:
            return {name: b.state.value for name, b in sorted(self._breakers.items())}

    def __repr__(self) -> str:
        return f"<RedisClusterTier {self.name}>"

    # -- internals ---------------------------------------------------------------------------

    def _get(self) -> Any:
        with self._lock:
            if self._closed:
                raise L2Error(f"redis cluster tier {self.name}: tier is closed")
            if self._client is not None:
                return self._client
        redis = self._redis
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode, RedisCluster
        from redis.retry import Retry

        try:
            client = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in self._nodes],  # type: ignore[no-untyped-call]
                socket_timeout=self._timeout_s,
                socket_connect_timeout=self._timeout_s,
                max_connections=self._pool_size,
                require_full_coverage=False,  # a node down costs its slots, not the whole tier
                retry=Retry(NoBackoff(), 1),
                **self._kwargs,
            )
        except (redis.exceptions.RedisError, OSError) as e:
            raise L2Unavailable(f"redis cluster tier {self.name}: unreachable (startup nodes): {e}") from e
        with self._lock:
            if self._closed:
                client.close()
                raise L2Error(f"redis cluster tier {self.name}: tier is closed")
            if self._client is None:
                self._client = client
            else:  # another thread won the race
                client.close()
            return self._client

    def _breaker(self, node: str) -> Breaker:
        b = self._breakers.get(node)
        if b is None:
            # a dead node costs one connection attempt per second at most; a failover is seen within ~1 s
            b = self._breakers[node] = Breaker(threshold=1, backoff_s=0.25, backoff_max_s=1.0)
        return b

    def _run(self, what: str, keys: list[bytes], add: Callable[[Any, bytes], Any], missing: Any,
             *, strict: bool) -> list[Any]:
        """Runs one command per key, one pipeline per master. Keys of a failed node get
        ``missing``; ``strict`` (writes) raises `L2Error` after any node failed."""
        if not keys:
            return []
        client = self._get()
        exc = self._redis.exceptions
        full = [self._prefix + k for k in keys]
        groups: dict[str, list[int]] = {}
        unrouted: list[int] = []
        for i, k in enumerate(full):
            try:
                node = client.nodes_manager.get_node_from_slot(client.keyslot(k))
            except (exc.RedisError, IndexError, KeyError):
                unrouted.append(i)
                continue
            groups.setdefault(node.name if node is not None else "?", []).append(i)
        out: list[Any] = [missing] * len(keys)
        failed: list[str] = [f"{len(unrouted)} keys in slots no node serves"] if unrouted else []
        served = 0
        for node, idxs in groups.items():
            with self._lock:
                allowed = self._breaker(node).allow(self._clock())
            if not allowed:
                failed.append(f"{node} skipped (failing)")
                continue
            try:
                pipe = client.pipeline()
                for i in idxs:
                    add(pipe, full[i])
                results = pipe.execute()
            except exc.RedisError as e:
                err = translate_redis_error(self._redis, self.name, e, f"{what} on {node}")
                with self._lock:
                    self._breaker(node).failure(self._clock())
                self.node_failures[node] += 1
                failed.append(str(err))
                if not isinstance(err, L2Unavailable):
                    raise err from e
                continue
            with self._lock:
                self._breaker(node).success()
            served += 1
            for i, r in zip(idxs, results):
                out[i] = r
        if failed and served == 0:
            raise L2Unavailable(f"redis cluster tier {self.name}: {what}: no node answered: {'; '.join(failed)}")
        if failed and strict:
            raise L2Error(f"redis cluster tier {self.name}: {what} failed on part of the cluster: {'; '.join(failed)}")
        return out
