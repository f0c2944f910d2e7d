"""Thread-safe mpcache client: one DEALER socket, futures, timeouts, heartbeats, a health flag.

Contract
--------
* ``MPCacheClient(url)`` connects a DEALER to ``url`` (``tcp://host:port`` or ``ipc://path``).
  Any thread may call ``submit(op, *args, timeout=)``: it returns a
  ``concurrent.futures.Future`` at once and never blocks on the network (a full or unconnected
  socket fails the future with ``RemoteError(kind="not_sent")`` instead of blocking: the server
  never saw it).
* The future resolves to the decoded result (``None`` when the reply has no result frame), or
  fails with ``RemoteError(kind, message)`` for a server error reply, ``kind="timeout"`` after the
  per-request timeout, ``kind="unhealthy"`` when the heartbeat declares the server gone (every
  pending future fails at that moment: nothing waits on a dead server), or ``ClientClosed``.
* The caller sends on its own thread under a lock. A thread that blocks in ``result()`` (or
  ``call()``) reads the socket itself while no other thread does, so a blocking call costs no
  thread hop; otherwise one background thread receives replies. That thread also expires
  timeouts and sends heartbeats (``health``), and never holds the socket while a caller reads it.
* Done-callbacks run on whichever thread received the reply, outside the client's locks.
* Health is decided by core_sm's ``HealthMonitor`` (the machine the simulator drives); this
  client only carries its heartbeats and replies and performs its verdicts. ``healthy`` is False
  until the first heartbeat reply, False after ``heartbeat_timeout`` without one, and True again
  on the next reply; when it turns False every pending request fails (``unhealthy``). A
  heartbeat that cannot be sent (no connection at that moment) decides nothing: ZMQ reconnects by
  itself and the server's replies may still come. While unhealthy the server is probed every
  0.1 s, then (once silent for ``heartbeat_timeout``) with a doubling period up to
  ``heartbeat_backoff_max`` (default: the larger of ``heartbeat_interval`` and
  ``reconnect_ivl_max``). ``on_health(healthy)``
  callbacks run on the client thread; use them to feed core_sm's ``ServerHealth`` event. ZMQ
  reconnects by itself (reconnect interval capped at ``reconnect_ivl_max``, 1 s, connect timeout
  5 s). A socket monitor read by the client thread tells the monitor the moment a connection's
  handshake succeeds (``Connected``): an unhealthy server is probed at once, backoff reset, so a
  restarted server is healthy again within about one reconnect interval of listening (not that
  plus a backed-off probe period); a healthy one gets one heartbeat at once, which learns a new
  epoch. A handshake the server refuses (CURVE key not authorized, say) is logged.
* Restarts: the heartbeat is the ``health`` operation, whose reply carries the server's start id
  (``epoch``, random per server process). ``epoch`` is the last one seen; ``on_epoch(epoch)``
  callbacks run on the client thread when the first one arrives and whenever it changes (a server
  that restarted, even between two heartbeats, without the health ever dropping); use them to
  feed core_sm's ``ServerEpoch`` event. Callbacks run in the order the monitor decided: when one
  reply brings both a new epoch and the return of health, the epoch callbacks run first.
* Instances: every ``register_instance`` this client sends is remembered (its payloads); once the
  server acknowledges it, every heartbeat also sends ``ping(instance_id)``, so an idle live engine
  is never reaped by the server's ``--instance-ttl``; ``unregister_instance`` stops that. A
  ``store``/``retrieve``/``prepare_store``/``prepare_retrieve`` refused ``not_registered`` (the
  server reaped or forgot the instance) is not failed at once: the registration is sent again
  (once for all the requests it refuses) and the request is resent once -- a store or retrieve
  naming the registration it follows (the id that registration's reply gave), so the server runs
  it although it remembers the original's refusal; a failed registration,
  a second refusal, or the request's own timeout fails it -- it never hangs. A heartbeat
  ``ping(instance_id)`` refused ``not_registered`` registers again at once, and so do a new (or
  the first) server epoch, a recovery, and a failed registration after its backoff: this client's
  link is the only one that registers an instance again (core_sm's ``ServerLink``).
* ``call(...)`` is ``submit(...).result()``. Typed helpers name the operations.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, cast

import msgpack  # type: ignore[import-untyped]
import zmq
from zmq.utils.monitor import parse_monitor_message

from mpcache.core_sm.health import RESENDABLE_AFTER_NOT_REGISTERED, Connected
from mpcache.core_sm.messages import CacheKey, ServerEpoch, ServerHealth, TimerFired
from mpcache.core_sm.server_link import (
    CLOSED,
    SERVER,
    TIMEOUT,
    Close,
    Completed,
    Failed,
    Heartbeat,
    Role,
    SendFailed,
    ServerLink,
    Submit,
    Transmit,
    client_link_config,
)
from mpcache.core_sm.server_link import Reply as LinkReply
from mpcache.runtime_zmq.recorder import recording
from mpcache.runtime_zmq.wire import ERROR_OP_FRAME, OPS_BY_REQUEST_TYPE, encode_key, resend_payloads, token_ids_for_wire

log = logging.getLogger("mpcache.client")

DEFAULT_URL = "tcp://127.0.0.1:5555"


def server_url(text: str) -> str:
    """A server address as given by a person (the connector's ``mpcache.server_urls``,
    ``mpcache-cli --url``): ``HOST:PORT`` gets ``tcp://``; a URL is kept as it is."""
    text = text.strip()
    return text if "://" in text else f"tcp://{text}"


class RemoteError(Exception):
    """A request that failed: ``kind`` is the wire error kind (or ``timeout``/``unhealthy``)."""

    def __init__(self, kind: str, message: str, op: str | None = None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
        self.op = op


class ClientClosed(Exception):
    pass


def _key_arg(key: CacheKey | dict[str, Any]) -> dict[str, Any]:
    """The key map to send; token ids packed (``wire.pack_token_ids``) when they are a list."""
    if isinstance(key, CacheKey):
        return encode_key(key)
    toks = key.get("token_ids")
    if type(toks) is list or type(toks) is tuple:
        key = dict(key)
        key["token_ids"] = token_ids_for_wire(toks)
    return key


class ReplyFuture(Future[Any]):
    """A ``concurrent.futures.Future`` whose blocking ``result()``/``exception()`` read the
    socket on the calling thread when no other thread is doing so: a blocking call then costs no
    thread hop at all."""

    def __init__(self, client: MPCacheClient) -> None:
        super().__init__()
        self._client = client

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            self._client._wait(self, timeout)
        # after _wait: done, or the timeout has passed (0: raise TimeoutError now)
        return super().result(timeout=None if timeout is None else 0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            self._client._wait(self, timeout)
        return super().exception(timeout=None if timeout is None else 0)


# The payload that names the engine instance (wire codec knowledge: the second one for all of
# them), for the operations core_sm's HealthMonitor allows resending after ``not_registered``.
_INSTANCE_ARG = {OPS_BY_REQUEST_TYPE[t].name: 1 for t in RESENDABLE_AFTER_NOT_REGISTERED}


class _Frames:
    """A caller's request as the link carries it: what the transport sends (again) for it."""

    __slots__ = ("op", "op_frame", "payload")

    def __init__(self, op: str | int, op_frame: bytes, payload: list[bytes]) -> None:
        self.op = op
        self.op_frame = op_frame
        self.payload = payload


class MPCacheClient:
    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        request_timeout: float = 30.0,
        connect_timeout: float = 5.0,
        reconnect_ivl_max: float = 1.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 3.0,
        heartbeat_backoff_max: float | None = None,
        wait_connected: bool = True,
        context: zmq.Context[Any] | None = None,
        curve_dir: str | None = None,
        curve_client: str | None = None,
    ) -> None:
        self.url = url
        self.request_timeout = request_timeout
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self._ctx = context or zmq.Context.instance()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # One random identity for this client's life: the server's ownership of what it creates
        # (request ids, instances, transfers) follows it across reconnects.
        sock.setsockopt(zmq.ROUTING_ID, b"mpc" + secrets.token_bytes(13))
        # Only queue to completed connections: while the server is down, a request fails now
        # instead of sitting in a buffer and reaching a restarted server long after its caller
        # gave up.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(reconnect_ivl_max * 1000))
        sock.setsockopt(zmq.CONNECT_TIMEOUT, int(connect_timeout * 1000))
        # ZMTP heartbeats notice a silently dead TCP peer and force a reconnect.
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_interval * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout * 1000))
        # A server started with --curve-dir admits CURVE clients with an authorized key only
        # (runtime_zmq.auth); MPCACHE_CURVE_DIR / MPCACHE_CURVE_CLIENT reach engines that build
        # their client internally.
        curve_dir = curve_dir or os.environ.get("MPCACHE_CURVE_DIR") or None
        if curve_dir is not None and url.startswith("tcp://"):
            from mpcache.runtime_zmq.auth import client_curve

            client_curve(sock, curve_dir, curve_client or os.environ.get("MPCACHE_CURVE_CLIENT", "client"))
        # Connection events, read (and closed) by the client thread only: set up before connect
        # so the first handshake is seen too.
        self._conn_events = sock.get_monitor_socket(_CONNECTION_EVENTS)
        self._handshake_failed: int | None = None  # the last failed-handshake event, logged once
        sock.connect(url)
        self._sock = sock
        self._fd = sock.getsockopt(zmq.FD)
        self._lock = threading.Lock()
        # held by whichever thread is reading replies off the socket (a blocking call() or the
        # client thread)
        self._recv_lock = threading.Lock()
        self._io_watching = False  # the client thread's poll includes the socket
        self._closed = False
        # Requests, deadlines, heartbeats, registration memory, parking, resend and give-up: the
        # core_sm machine the simulator drives. This client moves its frames and resolves futures.
        built = time.monotonic()
        self.link = ServerLink(client_link_config(
            request_timeout=request_timeout, heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout, heartbeat_backoff_max=heartbeat_backoff_max,
            reconnect_ivl_max=reconnect_ivl_max), built)
        # MPCACHE_RECORD (runtime_zmq.recorder): the link's events and effects, when asked
        self._record = recording("link", built, {"link": self.link.config}, {"url": url})
        self._healthy = False
        self._health_cbs: list[Callable[[bool], None]] = []
        self._health_changed = threading.Condition()
        self._epoch: int | str | None = None
        self._epoch_cbs: list[Callable[[int | str], None]] = []
        # (callbacks, value) in the order the monitor decided; run on the client thread
        self._notices: list[tuple[list[Any], Any]] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="mpcache-client", daemon=True)
        self._thread.start()
        if wait_connected:
            self.wait_healthy(connect_timeout)

    # ------------------------------------------------------------------ public API

    @property
    def healthy(self) -> bool:
        return self._healthy

    def on_health(self, callback: Callable[[bool], None]) -> None:
        """Register ``callback(healthy)``; it runs on the client thread at every change."""
        self._health_cbs.append(callback)

    @property
    def epoch(self) -> int | str | None:
        """The server's start id from the last heartbeat reply (None before the first)."""
        return self._epoch

    @property
    def heartbeat_period(self) -> float:
        """The current heartbeat period: ``heartbeat_interval`` while healthy; while not, the
        probe period, backed off up to ``heartbeat_backoff_max`` (reset when a connection to the
        server is made again)."""
        with self._lock:
            return self.link.period()

    @property
    def heartbeat_at(self) -> float | None:
        """``time.monotonic()`` of the last heartbeat reply (None before the first)."""
        return self.link.heartbeat_at

    def on_epoch(self, callback: Callable[[int | str], None]) -> None:
        """Register ``callback(epoch)``; it runs on the client thread when the server's start id
        is first learned and at every change (the server restarted)."""
        self._epoch_cbs.append(callback)

    def wait_healthy(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        with self._health_changed:
            while not self._healthy and not self._closed:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._health_changed.wait(left)
            return self._healthy

    def submit(self, op: str | int, *args: Any, timeout: float | None = None) -> Future[Any]:
        """Send ``[uid, op, *args]``; the future resolves to the reply's result."""
        return self._submit(op, args, self.request_timeout if timeout is None else timeout)

    def call(self, op: str | int, *args: Any, timeout: float | None = None) -> Any:
        t = self.request_timeout if timeout is None else timeout
        # the future's own timeout fires first; the extra second only guards a wedged client thread
        return self._submit(op, args, t, direct=True).result(t + 1.0)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        self._thread.join(5.0)
        with self._health_changed:
            self._health_changed.notify_all()

    def __enter__(self) -> MPCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # typed helpers (control plane, LMCache names and payloads)
    def noop(self) -> Any:
        return self.call("noop")

    def ping(self, instance_id: int | None = None) -> Any:
        """LMCache's ping; with ``instance_id``, that registered instance's heartbeat."""
        return self.call("ping") if instance_id is None else self.call("ping", instance_id)

    def get_chunk_size(self) -> int:
        return int(self.call("get_chunk_size"))

    def health(self) -> dict[str, Any]:
        return dict(self.call("health"))

    def stats(self) -> dict[str, Any]:
        return dict(self.call("stats"))

    def lookup(self, key: CacheKey | dict[str, Any], tp_size: int = 1, *, timeout: float | None = None) -> Future[Any]:
        return self.submit("lookup", _key_arg(key), tp_size, timeout=timeout)

    def query_prefetch_status(self, request_id: str, *, timeout: float | None = None) -> Future[Any]:
        return self.submit("query_prefetch_status", request_id, timeout=timeout)

    def wait_prefetch_status(self, request_id: str, wait: float, *, timeout: float | None = None) -> Future[Any]:
        t = (wait + self.request_timeout) if timeout is None else timeout
        return self.submit("wait_prefetch_status", request_id, float(wait), timeout=t)

    def free_lookup_locks(self, key: CacheKey | dict[str, Any], tp_size: int = 1) -> Future[Any]:
        return self.submit("free_lookup_locks", _key_arg(key), tp_size)

    def end_session(self, request_id: str) -> Future[Any]:
        return self.submit("end_session", request_id)

    def clear(self, force: bool = False, admin_token: str | None = None) -> Future[Any]:
        """An admin operation: the server refuses it (``forbidden``) without its admin token."""
        if admin_token is None:
            return self.submit("clear", force)
        return self.submit("clear", force, admin_token)

    # data plane (mpcache's own ops; docs/protocol.md)
    def l1_info(self) -> dict[str, Any]:
        return dict(self.call("l1_info"))

    def register_instance(self, instance_id: int, layout: dict[str, Any]) -> Future[Any]:
        return self.submit("register_instance", instance_id, layout)

    def unregister_instance(self, instance_id: int) -> Future[Any]:
        return self.submit("unregister_instance", instance_id)

    def prepare_store(self, key: CacheKey | dict[str, Any], instance_id: int) -> Future[Any]:
        return self.submit("prepare_store", _key_arg(key), instance_id)

    def prepare_retrieve(self, key: CacheKey | dict[str, Any], instance_id: int, skip_first_n_tokens: int = 0) -> Future[Any]:
        return self.submit("prepare_retrieve", _key_arg(key), instance_id, skip_first_n_tokens)

    def commit_store(self, transfer_id: int, ok: bool = True) -> Future[Any]:
        return self.submit("commit_store", transfer_id, ok)

    def commit_retrieve(self, transfer_id: int, ok: bool = True) -> Future[Any]:
        return self.submit("commit_retrieve", transfer_id, ok)

    def store(self, key: CacheKey | dict[str, Any], instance_id: int, block_ids: Sequence[int], event_handle: bytes) -> Future[Any]:
        return self.submit("store", _key_arg(key), instance_id, list(block_ids), event_handle)

    def retrieve(
        self, key: CacheKey | dict[str, Any], instance_id: int, block_ids: Sequence[int], event_handle: bytes, skip_first_n_tokens: int = 0
    ) -> Future[Any]:
        return self.submit("retrieve", _key_arg(key), instance_id, list(block_ids), event_handle, skip_first_n_tokens)

    # ------------------------------------------------------------------ internals

    def _submit(self, op: str | int, args: Sequence[Any], timeout: float, direct: bool = False) -> Future[Any]:
        """Send one request. ``direct``: the caller blocks on the result at once (and so reads
        the socket itself): no need to wake the client thread."""
        fut: Future[Any] = ReplyFuture(self)
        try:
            op_frame = msgpack.packb(op)
            payload = [msgpack.packb(a, use_bin_type=True) for a in args]
        except Exception as e:
            fut.set_exception(RemoteError("undecodable", f"cannot encode request: {e}", str(op)))
            return fut
        submit = Submit(fut, _Frames(op, op_frame, payload), timeout, *_role_of(op, args))
        done: list[tuple[Future[Any], bool, Any]] = []
        with self._lock:
            if self._closed:
                fut.set_exception(ClientClosed("client closed"))
                return fut
            self._handle(submit, done)
            # A send may consume the socket's read notification: drain here so no reply waits
            # for the next timeout of the client thread.
            if self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._drain_locked(done)
            # nobody is reading the socket: make the client thread watch it
            wake = not direct and not self._io_watching and not self._recv_lock.locked()
        if wake:
            self._wake()
        self._finish(done)
        return fut

    # the link: its events in, its effects performed (called with self._lock held) ----------

    def _handle(self, event: Any, done: list[tuple[Future[Any], bool, Any]]) -> None:
        now = time.monotonic()
        effects = self.link.handle(event, now)
        if self._record is not None:
            self._record.step(now, event, effects)
        for effect in effects:
            if isinstance(effect, Transmit):
                self._transmit(effect, event, done)
            elif isinstance(effect, Completed):
                done.append((cast("Future[Any]", effect.token), True, effect.value))
            elif isinstance(effect, Failed):
                done.append((cast("Future[Any]", effect.token), False, _error_of(effect)))
            elif isinstance(effect, ServerHealth):
                self._healthy = effect.healthy
                log.log(logging.INFO if effect.healthy else logging.WARNING, "mpcache server %s is %s", self.url,
                        "answering" if effect.healthy else "not answering")
                self._notice(self._health_cbs, effect.healthy)
            else:  # ServerEpoch
                log.info("mpcache server %s: start id (epoch) %s, was %s", self.url, effect.epoch, self._epoch)
                self._epoch = effect.epoch
                self._notice(self._epoch_cbs, effect.epoch)

    def _transmit(self, t: Transmit, cause: Any, done: list[tuple[Future[Any], bool, Any]]) -> None:
        """Send what the link says under its uid; a frame the socket will not take is the link's
        ``SendFailed`` (no completed connection: IMMEDIATE, or the queue is full)."""
        request = t.request
        if type(request) is _Frames:
            op_frame = request.op_frame
            frames = request.payload if t.registration is None else resend_payloads(request.op, request.payload,
                                                                                     t.registration)
        elif type(request) is Heartbeat:
            # ``health`` rather than LMCache's ``ping``: its reply carries the server's epoch.
            # Replies that arrived meanwhile are read before a send can find the connection gone
            # (a server's last answers come just before it closes).
            op_frame, frames = _HEALTH_FRAME, []
            self._drain_locked(done)
        else:  # InstancePing
            op_frame, frames = _PING_FRAME, [msgpack.packb(request.instance_id)]
        try:
            self._sock.send_multipart([msgpack.packb(t.uid), op_frame, *frames], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if type(request) is Heartbeat:
                self._drain_locked(done)  # what the server sent before it went is delivered first
            why = "server not connected (or its queue is full)" if isinstance(e, zmq.Again) else f"send failed: {e}"
            self._handle(SendFailed(t.uid, why), done)
            return
        if t.resend:
            log.info("mpcache: %s for instance %s sent again after its registration %s", request.op,
                     _instance_of(request), t.registration)
        elif op_frame == _REGISTER_FRAME and type(cause) is not Submit:
            log.warning("mpcache server %s does not know instance %s (reaped or restarted): registering it again",
                        self.url, _instance_of(request))

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except (BlockingIOError, OSError):
            pass

    def _wait(self, fut: Future[Any], timeout: float | None) -> None:
        """Block until ``fut`` is done or ``timeout`` passed, reading replies on this thread when
        no other thread is (else waiting for the thread that is)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        poller: select.poll | None = None
        while not fut.done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            if self._recv_lock.acquire(blocking=False):
                done: list[tuple[Future[Any], bool, Any]] = []
                try:
                    if poller is None:
                        poller = select.poll()
                        poller.register(self._fd, select.POLLIN)
                    with self._lock:
                        if self._closed:
                            return
                        self._drain_locked(done)
                    if not done and not fut.done():
                        # bounded sleep: the client thread may fail the future meanwhile
                        poller.poll(200.0 if left is None else min(left, 0.2) * 1000)
                        with self._lock:
                            if self._closed:
                                return
                            self._drain_locked(done)
                finally:
                    self._recv_lock.release()
                # callbacks run without the receiving role: one that blocks on another future
                # can then take it over instead of deadlocking
                self._finish(done)
                if fut.done():
                    with self._lock:
                        others = self.link.pending_count() > 0
                    if others:
                        self._wake()  # replies for other requests: the client thread reads them
                    return
                continue
            # another thread reads the socket and will resolve fut; re-check now and then in
            # case it stops reading before our reply arrives
            try:
                Future.result(fut, 0.05 if left is None else min(left, 0.05))
            except BaseException:
                pass

    def _drain_locked(self, done: list[tuple[Future[Any], bool, Any]]) -> None:
        sock = self._sock
        # check EVENTS rather than catching zmq.Again: an exception per drain costs more than
        # the reply itself
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            try:
                uid = msgpack.unpackb(frames[0])
            except Exception:
                continue
            if type(uid) is not int:
                continue
            request = self.link.request_of(uid)
            if request is None:
                self._handle(LinkReply(uid, False), done)  # a late reply (counted by the link)
                continue
            ok, value = _decode(_op_frame_of(request), frames)
            self._handle(LinkReply(uid, ok, value, None if ok else value.kind), done)

    @staticmethod
    def _finish(done: list[tuple[Future[Any], bool, Any]]) -> None:
        for fut, ok, value in done:
            if fut.done():
                continue
            try:
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)
            except Exception:  # cancelled by its owner meanwhile
                pass

    def _notice(self, callbacks: list[Any], value: Any) -> None:
        self._notices.append((callbacks, value))
        if threading.current_thread() is not self._thread:
            self._wake()

    def _read_connection_events(self, done: list[tuple[Future[Any], bool, Any]]) -> None:
        """Every socket-monitor event waiting (its FD is edge-triggered: read them all): a
        handshake that succeeded is ``Connected`` for the link; a failed one is logged once
        until a handshake succeeds. Client thread only, with ``self._lock`` held."""
        mon = self._conn_events
        while mon.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                event = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
            except (zmq.Again, ValueError):
                return
            kind = int(event["event"])
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self._handshake_failed is not None:
                    log.info("mpcache server %s: handshake succeeded again", self.url)
                self._handshake_failed = None
                self._handle(Connected(SERVER), done)
            elif kind != self._handshake_failed:
                self._handshake_failed = kind
                log.warning("mpcache server %s refused the connection's handshake (%s, errno %s): check the "
                            "CURVE keys (--curve-dir) and that both ends speak ZMTP 3", self.url,
                            _HANDSHAKE_FAILURES.get(kind, kind), event["value"])

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        wake_only = select.poll()
        wake_only.register(self._wake_r, select.POLLIN)
        conn_fd = self._conn_events.getsockopt(zmq.FD)
        poller.register(conn_fd, select.POLLIN)
        wake_only.register(conn_fd, select.POLLIN)
        try:
            while True:
                now = time.monotonic()
                done: list[tuple[Future[Any], bool, Any]] = []
                # A thread blocked in result() may be reading the socket; then leave the replies
                # to it and do not watch the socket (it wakes us when it stops).
                receiving = self._recv_lock.acquire(blocking=False)
                with self._lock:
                    if self._closed:
                        if receiving:
                            self._recv_lock.release()
                        break
                    if receiving:
                        self._drain_locked(done)
                        self._recv_lock.release()
                    self._io_watching = receiving
                    self._read_connection_events(done)
                    deadline = self.link.next_deadline()
                    if deadline is not None and deadline <= now:
                        self._handle(TimerFired(), done)
                        deadline = self.link.next_deadline()
                    wait_until = now + 1.0 if deadline is None else deadline
                    notices, self._notices = self._notices, []
                self._finish(done)
                for callbacks, value in notices:
                    if callbacks is self._health_cbs:
                        with self._health_changed:
                            self._health_changed.notify_all()
                    for cb in list(callbacks):
                        try:
                            cb(value)
                        except Exception:
                            log.exception("health/epoch callback failed")
                timeout_ms = max(0.0, (wait_until - time.monotonic()) * 1000)
                if receiving:
                    # The FD is edge-triggered; cap the sleep so a lost edge costs at most 50 ms.
                    events = poller.poll(min(timeout_ms, 50.0))
                else:
                    events = wake_only.poll(timeout_ms)
                for fd, _ in events:
                    if fd == self._wake_r:
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
        except Exception:
            log.exception("mpcache client thread failed")
        finally:
            closing: list[tuple[Future[Any], bool, Any]] = []
            with self._lock:
                self._closed = True
                self._handle(Close(), closing)
            self._finish(closing)
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._conn_events.close(0)
            self._sock.close(0)
            os.close(self._wake_r)
            os.close(self._wake_w)


def _role_of(op: str | int, args: Sequence[Any]) -> tuple[Role, int | None]:
    """What a caller's request is to the link, and the engine instance it names (wire codec
    knowledge: where each op carries the instance id)."""
    if op == "register_instance" or op == "unregister_instance":
        instance = args[0] if args and type(args[0]) is int else None
        return (Role.REGISTRATION if op == "register_instance" else Role.UNREGISTRATION), instance
    index = _INSTANCE_ARG.get(op, -1) if isinstance(op, str) else -1
    return Role.REQUEST, (args[index] if 0 <= index < len(args) and type(args[index]) is int else None)


def _instance_of(request: _Frames) -> Any:
    try:
        return msgpack.unpackb(request.payload[_INSTANCE_ARG.get(request.op, 0) if isinstance(request.op, str) else 0])
    except Exception:
        return None


def _op_frame_of(request: Any) -> bytes:
    if isinstance(request, _Frames):
        return request.op_frame
    return _HEALTH_FRAME if type(request) is Heartbeat else _PING_FRAME


def _op_name(request: Any) -> str | None:
    return str(request.op) if type(request) is _Frames else None


def _error_of(failed: Failed) -> BaseException:
    """The exception a caller's future fails with: the server's refusal as received, else the
    link's own verdict (``timeout``, ``unhealthy``, ``not_registered``; ``closed`` is
    ``ClientClosed``)."""
    if isinstance(failed.error, BaseException):
        return failed.error
    if failed.kind == CLOSED:
        return ClientClosed("client closed")
    message = {TIMEOUT: "no reply within the request timeout"}.get(failed.kind, failed.message)
    return RemoteError(failed.kind, message, _op_name(failed.request))


def _decode(op_frame: bytes, frames: list[bytes]) -> tuple[bool, Any]:
    """(True, result) or (False, RemoteError) for one reply to a request sent as ``op_frame``."""
    try:
        if frames[1] == ERROR_OP_FRAME:
            body = msgpack.unpackb(frames[2], raw=False) if len(frames) > 2 else {}
            if not isinstance(body, dict):
                body = {"kind": "internal", "message": repr(body)}
            return False, RemoteError(str(body.get("kind")), str(body.get("message")), body.get("op"))
        if frames[1] != op_frame:
            return False, RemoteError("internal", f"reply op {frames[1]!r} does not match {op_frame!r}")
        if len(frames) > 2:
            return True, msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
        return True, None
    except Exception as e:
        return False, RemoteError("undecodable", f"reply did not decode: {e}")


# A connection's handshake succeeded (the socket has a completed connection: a request can go)
# or failed (logged).
_HANDSHAKE_FAILURES: dict[int, str] = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no detail",
                       zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error",
                       zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication failed"}
_CONNECTION_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | sum(_HANDSHAKE_FAILURES)
_HEALTH_FRAME: bytes = msgpack.packb("health")
_PING_FRAME: bytes = msgpack.packb("ping")
_REGISTER_FRAME: bytes = msgpack.packb("register_instance")
