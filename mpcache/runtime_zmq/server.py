"""The mpcache server process: one thread owns core_sm's ``LookupServer`` and the ROUTER socket.

    receive -> EffectInterpreter (decode, core_sm, effects, encode) -> send

This module is the process and its socket loop; what a message means and what the machine's
effects do is ``runtime_zmq.effect_interpreter``'s ``EffectInterpreter``, which the server owns.

* Requests are received frame by frame under a byte and frame budget (an oversized message is
  answered ``too_large`` and its frames dropped as they are read, never joined, big frames freed
  by a thread of their own) and handed to the interpreter. The loop contains no protocol decision.
* Replies are sent ROUTER_MANDATORY and non-blocking (a vanished or full peer costs a counter,
  never a wedge), batched while a receive batch lasts (one wake-up of zmq's I/O thread per batch).
* Worker threads (the ``TransferExecutor``, the ``L2Worker`` threads, the HTTP probes) report
  through the completion channel (a queue plus a wake-up pipe the loop polls); their completions
  are handled on the loop thread like requests.
* One timer: the poll timeout is ``machine.next_deadline()``; at it the loop handles
  ``TimerFired``. Every ``_CHECK_MS`` the loop looks at what zmq holds per connection
  (``runtime_zmq.connections``); once a second it refreshes the gauges the HTTP thread reads.
* Shutdown (``stop()``, SIGTERM/SIGINT in the CLI): stop reading requests, let in-flight L2 work
  and transfers finish for up to ``shutdown_grace`` seconds (their replies go out), answer the
  rest ``shutting_down``, close the socket, the L2 tiers and the L1 segment.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import queue
import secrets
import select
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import zmq

from mpcache.core_sm import messages as m
from mpcache.core_sm.errors import ErrorKind
from mpcache.runtime_zmq import auth, sha256_chain, tokens, wire
from mpcache.runtime_zmq.memory import TrimAfterReap
from mpcache.runtime_zmq.l1_pool import SharedMemoryPool
from mpcache.runtime_zmq.config import version
from mpcache.runtime_zmq.connections import FRAME_OVERHEAD, ConnectionWatch
from mpcache.runtime_zmq.effect_interpreter import EffectInterpreter
from mpcache.runtime_zmq.metrics import ServerMetrics
from mpcache.runtime_zmq.l2_worker import L2Options, L2Worker
from mpcache.runtime_zmq.transfer import NoDeviceExecutor, TransferExecutor

log = logging.getLogger("mpcache.server")

GiB = 1 << 30
MiB = 1 << 20

# the socket calls of the reply and receive paths, without pyzmq's Python-level wrappers
_backend_send = zmq.backend.Socket.send
_backend_recv = zmq.backend.Socket.recv
_backend_get = zmq.backend.Socket.get
_EVENTS = zmq.EVENTS
_SEND_MORE = zmq.NOBLOCK | zmq.SNDMORE
# replies held during one receive batch: at most this many, for at most this long
_REPLY_BATCH = 16
_REPLY_HOLD_S = 0.0005
# How long the socket stays open after the shutdown's last replies. A client socket with
# ZMQ_IMMEDIATE discards the replies it has not read yet when the connection drops (libzmq
# terminates the pipe on reconnect), so a close right after the replies can lose them: the client
# would then see the server as unhealthy seconds later instead of reading ``shutting_down``.
_FAREWELL_S = 0.5
# frames at least this big are released by the frame-freeing thread, not the loop
_BIG_FRAME = 1 << 20
# how often the loop looks at what zmq holds per connection (runtime_zmq.connections)
_CHECK_MS = 100


@attrs.frozen
class ServerConfig:
    url: str = "tcp://127.0.0.1:5555"
    chunk_size: int = 256
    l1_size_bytes: int = 4 * GiB
    slot_bytes: int = 32 * MiB
    # L1's slots follow the objects registered (core_sm.l1_slots); ``slot_bytes`` is then only
    # their size until the first registration. False: ``slot_bytes`` fixed (``--slot-mb``).
    slots_follow_objects: bool = False
    l2_urls: tuple[str, ...] = ()
    lease_ttl: float = 300.0
    job_ttl: float = 60.0
    # a registered instance that sent heartbeats and then none for this long is reaped (None: never)
    instance_ttl: float | None = 60.0
    tombstone_ttl: float = 60.0
    l2_read_timeout: float = 30.0
    l2_probe: bool = True
    limits: wire.Limits = wire.Limits()
    metrics_port: int | None = None
    l2_workers: int = 4
    l2_options: L2Options = L2Options()  # secret file, required tiers, deadlines, queue bound
    shutdown_grace: float = 5.0
    shm_dir: str = "/dev/shm"
    # who may connect and who may clear (runtime_zmq.auth, docs/security.md)
    curve_dir: str | None = None
    ipc_group: str | None = None
    admin_token_file: str | None = None
    # reserve L1's pages at start (posix_fallocate) instead of committing them on first touch
    l1_reserve: bool = True
    # an L1 larger than the host / cgroup / filesystem can give: False refuses to start, True clamps
    l1_clamp: bool = False
    # This server's start id, answered by ``health``: clients that see it change know the server
    # restarted (and forgot every job, lease and registration). None: a random one.
    epoch: int | None = None
    # KV events for routers (runtime_zmq.kv_events): PUB endpoint, replay ROUTER endpoint, topic
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str = ""
    kv_events_tokens: bool = False  # token ids, LoRA name and salts in BlockStored (kv_events.py)
    # store a chunk only once lookups asked for it this many times (core_sm.admission; 0: all)
    store_threshold: int = 0
    # record the core_sm event stream (runtime_zmq.trace_writer): file, keep token ids, size cap
    trace: str | None = None
    trace_tokens: bool = False
    trace_max_bytes: int = 256 << 20
    # the chunk-chain key (core_sm.chunks.ChunkChain): this file's 32 bytes (made 0600 at first
    # start); None: derived from the L2 secret when there are tiers, else random for this start
    chunk_key_file: str | None = None


def chunk_chain_key(config: ServerConfig, l2: L2Worker) -> tuple[bytes, str]:
    """The chunk-chain key and where it came from: ``--chunk-key-file``, else the key servers
    sharing the L2 tiers derive from their secret, else a random one (an L1-only server's keys
    need not match anyone's; they change at each start, as its L1 does)."""
    if config.chunk_key_file:
        from mpcache.runtime_zmq.l2_seal import load_or_create_secret

        return load_or_create_secret(config.chunk_key_file, "chunk key file"), config.chunk_key_file
    derived = l2.chain_key
    if derived is not None:
        return derived, "the L2 secret"
    return secrets.token_bytes(32), "random (L1 only)"


def make_machine(config: ServerConfig, num_slots: int, slot_bytes: int, l2_enabled: bool,
                 chain_key: bytes | None = None, l1_bytes: int = 0) -> Any:
    """Build core_sm's LookupServer for this configuration (``chain_key`` None: a random one)."""
    from mpcache.core_sm.server import LookupServer, ServerConfig as SmConfig

    return LookupServer(
        SmConfig(
            chunk_size=config.chunk_size,
            num_slots=num_slots,
            slot_bytes=slot_bytes,
            lease_ttl=config.lease_ttl,
            abandoned_job_ttl=config.job_ttl,
            instance_ttl=config.instance_ttl,
            tombstone_ttl=config.tombstone_ttl,
            l2_enabled=l2_enabled,
            l2_read_timeout=config.l2_read_timeout,
            l2_probe=l2_enabled and config.l2_probe,
            write_behind=l2_enabled,
            kv_events=bool(config.kv_events),
            id_seed=secrets.randbits(128),  # transfer ids nobody can predict
            store_threshold=config.store_threshold,
            chain_key=chain_key if chain_key is not None else secrets.token_bytes(32),
            ack_first=True,  # EffectInterpreter.handle sends a lookup's ack, then runs its work
            l1_bytes=l1_bytes,  # > 0: L1's slots follow the objects registered (CarveL1)
            slot_align=mmap.PAGESIZE,
        )
    )


def open_l2(url: str) -> Any:
    """An L2 tier from its URL: ``disk:PATH`` / ``redis://...`` (mpcache.runtime_zmq.l2), or
    ``python:MODULE:FACTORY[?ARG]`` for a tier of your own (``FACTORY(ARG)`` returns an object with
    the ``L2Tier`` methods)."""
    if url.startswith("python:"):
        import importlib

        spec, _, arg = url[len("python:") :].partition("?")
        module, _, factory = spec.rpartition(":")
        return getattr(importlib.import_module(module), factory)(arg)
    from mpcache.runtime_zmq.l2 import open_tier

    return open_tier(url)


class CompletionChannel:
    """Worker threads -> loop thread: ``post(event)`` from any thread; the loop polls ``fd``.

    ``wake``/``post`` after ``close`` do nothing (a late completion or a signal arriving while
    the server exits): the pipe's descriptors may already belong to another file."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        # Re-entrant: a signal handler calling wake() may interrupt close() on the same thread.
        self._lock = threading.RLock()
        self._closed = False
        self._collecting = 0  # the thread running drain's collect: what it posts is read in that drain

    @property
    def fd(self) -> int:
        return self._r

    @property
    def wake_fd(self) -> int:
        """The write end: a thread outside Python (a GPU copy lane) writes a byte to wake the loop,
        which then collects what it posted elsewhere (``drain``'s ``collect``)."""
        return self._w

    def post(self, event: object) -> None:
        self._q.put(event)
        if self._collecting != threading.get_ident():  # (no wake-up for the drain that reads it next)
            self.wake()

    def wake(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._w, b"x")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already

    def drain(self, collect: Callable[[], None] | None = None) -> list[object]:
        """The events posted so far. ``collect`` runs after the wake-ups are read and before the
        queue is: what it posts is in this drain, and a wake-up written after it is not lost."""
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass
        if collect is not None:
            self._collecting = threading.get_ident()
            try:
                collect()
            finally:
                self._collecting = 0
        out = []
        while True:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True  # before the descriptors go: a re-entrant wake() sees it
            os.close(self._r)
            os.close(self._w)


class Server:
    def __init__(
        self,
        config: ServerConfig,
        *,
        transfer_executor: TransferExecutor | None = None,
        tiers: list[Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.limits = attrs.evolve(config.limits, chunk_size=config.chunk_size)
        self.admin_token = auth.read_admin_token(config.admin_token_file) if config.admin_token_file else None
        # the HTTP thread reads the snapshot the loop refreshes each second, never live state
        self._stats_snapshot: dict[str, Any] = {}
        self.metrics = ServerMetrics(lambda: self._stats_snapshot)
        self.metrics.attach(self, {})
        self.pool = SharedMemoryPool(config.l1_size_bytes, config.slot_bytes, directory=config.shm_dir,
                                     reserve=config.l1_reserve, clamp=config.l1_clamp,
                                     slots_follow_objects=config.slots_follow_objects)
        if tiers is None:
            tiers = [open_l2(u) for u in config.l2_urls]
        self.channel = CompletionChannel()
        try:
            self.l2 = L2Worker(tiers, self.pool, self.channel.post, workers=config.l2_workers, options=config.l2_options)
        except BaseException:  # a required tier down, a bad secret file: leave nothing behind
            for tier in tiers:
                tier.close()
            self.channel.close()
            self.pool.close()
            raise
        executor = transfer_executor or NoDeviceExecutor()
        # an instance the executor fails by itself is core_sm's to release (registration, plans)
        executor.on_instance_failed = self._post_instance_failed
        self._collect_completions = self._wire_completions(executor)
        try:
            chain_key, chain_source = chunk_chain_key(config, self.l2)
        except BaseException:  # a bad key file: leave nothing behind
            self.l2.close()
            self.channel.close()
            self.pool.close()
            raise
        self.machine = make_machine(config, self.pool.num_slots, self.pool.slot_bytes, bool(tiers), chain_key,
                                    l1_bytes=self.pool.size if config.slots_follow_objects else 0)
        # the same chain (same key, same digests), hashing natively once sha256_chain is loaded
        self.machine.ctx.chain = sha256_chain.chunk_chain(chain_key)
        log.info("chunk keys are keyed by %s (fingerprint %s); servers sharing an L2 must share it",
                 chain_source, self.machine.ctx.chain.fingerprint)
        # replies held during a receive batch (None: outside one, sent at once) and since when
        self._reply_batch: list[list[bytes]] | None = None
        self._reply_batch_since = 0.0
        self._counts = {"wire_requests": 0, "wire_replies": 0, "wire_errors": 0, "malformed": 0, "dropped_replies": 0,
                        "block_allocation_records": 0, "oversized_messages": 0, "connections_cut": 0, "served_ns_store": 0, "served_store": 0, "served_ns_retrieve": 0, "served_retrieve": 0}
        # requests in, core_sm's effects carried out, replies out (runtime_zmq.effect_interpreter)
        self.interpreter = EffectInterpreter(
            machine=self.machine, pool=self.pool, l2=self.l2, executor=executor, metrics=self.metrics,
            clock=clock, limits=self.limits, admin_token=self.admin_token, instance_ttl=config.instance_ttl,
            post=self.channel.post, counts=self._counts, send=self._send, flush_ack=self._flush_lone_ack,
            health=self._health, stats=self.stats)
        self._stopping = False
        self._closed = False
        self.started_at = time.time()  # wall clock, for uptime (status pages)
        self.epoch = config.epoch if config.epoch is not None else secrets.randbits(63)
        # the longest one message kept the loop (wall and the loop thread's CPU), since start
        self._max_message_s = 0.0
        self._max_message_cpu_s = 0.0
        self._last_oversized_log = -1e9
        self._curve_user: str | None = None  # the User-Id of the message being served (CURVE)
        self._frames_to_free: queue.SimpleQueue[zmq.Frame | None] = queue.SimpleQueue()
        self._frame_freer = threading.Thread(target=self._free_frames, name="mpcache-frame-free", daemon=True)
        self._frame_freer.start()
        self._last_gauges = 0.0
        self._trim = TrimAfterReap()  # memory back to the OS once the reaper dropped a burst of jobs
        self.ctx = zmq.Context()
        self.authenticator: auth.CurveServer | None = None
        self._ipc_socket: tuple[str, int, int] | None = None  # path, device, inode: removed at stop
        self._connections: ConnectionWatch | None = None  # the loop's (runtime_zmq.connections)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        # zmq's cap is per frame: a peer sending one frame over twice the codec's limit is
        # disconnected by zmq (nothing is buffered past it); below it the loop answers too_large.
        self.sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.limits.max_frame_bytes)
        # serve_forever reserves the segment's pages (no room is a start-up error, not a SIGBUS
        # in the middle of a copy; l1_pool) on a thread, while the loop already answers
        self._reservation: threading.Thread | None = None
        self._loaders: list[threading.Thread] = []  # the compilers started with the loop
        self._ops_http: Any = None  # an embedded server's OpsHttpServer (ServerConfig.metrics_port)
        self.start_error: BaseException | None = None
        self.loaders_running: list[str] = []  # set by the shutdown: start-up compilers not waited for
        try:
            if config.curve_dir is not None:
                if not config.url.startswith("tcp://"):
                    raise ValueError("CURVE (--curve-dir) is for TCP; an ipc socket is guarded by its directory")
                self.authenticator = auth.CurveServer(self.ctx, config.curve_dir)
                self.authenticator.apply(self.sock)
            self.bound_url = self._bind(config.url)
            # A client that reconnects under its identity gets it back (its requests stay its own)
            # where the identity is no bearer secret: with CURVE (the peer is the key), on ipc (only
            # this uid can connect) and on loopback TCP (only root sees the bytes). On a network
            # without CURVE the routing id travels in the clear: nobody takes over a live
            # connection by it (zmq refuses a second connection under a connected identity).
            self.routing_id_handover = auth.routing_id_handover(self.bound_url, curve=self.authenticator is not None)
            self.sock.setsockopt(zmq.ROUTER_HANDOVER, int(self.routing_id_handover))
            if not self.routing_id_handover:
                log.warning("listening on %s without CURVE: a client's identity is sent in the clear, so a "
                            "connection is not handed over to another under the same identity; use --curve-dir "
                            "beyond one host (docs/security.md)", self.bound_url)
        except BaseException:
            self._close_socket()
            raise
        self.trace: Any = None
        if config.trace:
            from mpcache.runtime_zmq.trace_writer import TraceWriter

            self.trace = TraceWriter(config.trace, self.machine, keep_tokens=config.trace_tokens,
                                     max_bytes=config.trace_max_bytes)
            log.info("tracing core_sm events to %s (%s)", config.trace,
                     "token ids kept" if config.trace_tokens else "token ids as chunk hashes")
        self.interpreter.trace = self.trace
        self.kv_events: Any = None
        if config.kv_events:
            from mpcache.runtime_zmq.kv_events import KvEventPublisher

            self.kv_events = KvEventPublisher(
                config.kv_events, chunk_size=config.chunk_size, replay_endpoint=config.kv_events_replay,
                topic=config.kv_events_topic, private=config.kv_events_tokens, curve=self.authenticator,
            )
            log.info("KV events on %s (replay %s, first seq %d)", self.kv_events.endpoint,
                     self.kv_events.replay_endpoint, self.kv_events.first_seq)
        self.interpreter.kv_events = self.kv_events

    @property
    def executor(self) -> TransferExecutor:
        """The transfer engine the interpreter drives (replaceable before the loop starts)."""
        return self.interpreter.executor

    @executor.setter
    def executor(self, executor: TransferExecutor) -> None:
        self.interpreter.executor = executor
        self._collect_completions = self._wire_completions(executor)

    def _wire_completions(self, executor: TransferExecutor) -> Callable[[], None] | None:
        """An executor whose completions are seen outside Python (GPU copy lanes) wakes the loop
        through the channel's pipe and has the loop collect them (``drain_completions``)."""
        wake_with = getattr(executor, "wake_loop_with", None)
        collect = getattr(executor, "collect_completions", None)
        if callable(wake_with) and callable(collect):
            wake_with(self.channel.wake_fd)
            return collect  # type: ignore[no-any-return]
        return None

    def _bind(self, url: str) -> str:
        if not url.startswith("ipc://"):
            self.sock.bind(url)
            return str(self.sock.getsockopt_string(zmq.LAST_ENDPOINT))
        path = os.path.abspath(url[len("ipc://") :])
        group = auth.prepare_ipc_path(path, self.config.ipc_group)
        self.sock.bind("ipc://" + path)
        auth.restrict_ipc_socket(path, group)
        st = os.lstat(path)
        self._ipc_socket = (path, st.st_dev, st.st_ino)
        return str(self.sock.getsockopt_string(zmq.LAST_ENDPOINT))

    def _remove_ipc_socket(self) -> None:
        """A clean stop leaves no socket file behind -- but only this server's: a server that took
        the path over (a supervisor's replacement) keeps its own socket there."""
        if self._ipc_socket is None:
            return
        path, dev, ino = self._ipc_socket
        self._ipc_socket = None
        try:
            st = os.lstat(path)
            if stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == (dev, ino):
                os.unlink(path)
        except OSError:
            pass  # gone already, or not ours to remove

    def _stop_frame_freer(self) -> None:
        self._frames_to_free.put(None)
        self._frame_freer.join(10.0)

    def _close_socket(self) -> None:
        # start-up failed after the worker threads started: stop them, leave nothing behind
        self.sock.close(linger=0)
        self._remove_ipc_socket()
        self.interpreter.close()
        self._stop_frame_freer()
        self.l2.close()
        self.executor.close()
        if self.authenticator is not None:
            self.authenticator.stop()
        self.pool.close()
        self.channel.close()
        self.ctx.term()

    # ------------------------------------------------------------------ public

    def stop(self) -> None:
        """Ask the loop to shut down (any thread, or a signal handler). Idempotent: a call
        during or after the shutdown does nothing."""
        if self._stopping:
            return
        self._stopping = True
        self.channel.wake()

    def serve_forever(self, ready: Callable[[str], None] | None = None) -> None:
        """Serve until ``stop()``. Raises what made the start fail after the socket was bound
        (``l1_pool.ReservationError``: no room for L1), once the shutdown is done."""
        if self.config.l1_reserve and not self.pool.created:
            # the kernel zero-fills the pages (about 0.4 s per GiB): not before the first reply
            self._reservation = self.pool.reserve_in_background(self._reservation_failed)
        # the list-form token scanner compiles or loads (numba) while the loop already answers
        self._loaders = [tokens.load_in_background(),
                         sha256_chain.load_in_background()]  # so does the native chunk chain
        if self.config.metrics_port:
            # /metrics and the probes of an embedded server, from a daemon thread (the CLI builds
            # its own OpsHttpServer, with its --metrics-host)
            from mpcache.runtime_zmq.http import OpsHttpServer

            self._ops_http = OpsHttpServer(self, "127.0.0.1", self.config.metrics_port, metrics=self.metrics)
        log.info("mpcache-server listening on %s (epoch %d)", self.bound_url, self.epoch)
        if ready is not None:
            ready(self.bound_url)
        try:
            self._loop()
        finally:
            self.close()
        if self.start_error is not None:
            raise self.start_error

    @property
    def l1_reserving(self) -> bool:
        """L1's pages are still being reserved (start-up; /readyz answers 503 meanwhile)."""
        return self._reservation is not None and self._reservation.is_alive()

    def _reservation_failed(self, error: BaseException) -> None:
        # on the reservation thread: the loop stops as for SIGTERM (requests answered shutting_down)
        log.error("cannot start: %s", error)
        self.start_error = error
        self.stop()

    # ------------------------------------------------------------------ loop

    def _loop(self) -> None:
        sock = self.sock
        # Below zmq (runtime_zmq.connections): without CURVE a connection whose routing id zmq
        # made (no explicit identity: LMCache's client) is a peer that cannot come back: when it
        # closes, its instances are released (PeerGone), so the client, reconnected as a new peer,
        # registers them again. And a connection for which zmq holds more than four messages'
        # worth of frames (a message that never ends) is cut. Made by the loop (its monitor socket
        # is the loop's; a Server never served has none to close).
        connections = self._connections = ConnectionWatch(
            sock, limit_bytes=4 * self.limits.max_message_bytes, anonymous_peers=self.authenticator is None)
        # The loop sleeps in poll(2) on three descriptors, not in zmq_poll: zmq_poll over the two
        # zmq sockets costs six system calls a turn (a zero-timeout poll, then the sleeping one,
        # each followed by a ZMQ_EVENTS read per socket, and each of those a poll of its own);
        # this costs two (the router's ZMQ_EVENTS before sleeping, the sleep). A zmq socket's
        # descriptor is edge-triggered: it becomes readable when its mailbox gets a command, and
        # any call on the socket (a send too) may read that command. So the router's ZMQ_EVENTS is
        # read right before sleeping (a message already queued never waits on the descriptor).
        # The monitor is only ever read by ``connections.events()``, which drains it, so its
        # descriptor stays readable while anything is left; it is drained again at each
        # connection check all the same (a missed edge then costs at most _CHECK_MS).
        router_fd = int(sock.getsockopt(zmq.FD))
        monitor_fd = int(connections.monitor.getsockopt(zmq.FD))
        channel_fd = self.channel.fd
        waiter = select.poll()
        for fd in (router_fd, channel_fd, monitor_fd):
            waiter.register(fd, select.POLLIN)
        wait = waiter.poll
        last_check = 0.0
        while not self._stopping:
            now = self.clock()
            deadline = self.machine.next_deadline()
            if deadline is not None and deadline <= now:
                self.interpreter.handle(m.TimerFired(), now, None)
                deadline = self.machine.next_deadline()
                if deadline is not None and deadline <= now:
                    # a deadline that handling did not move: never spin on it, keep serving
                    deadline = now + 0.001
            # the connections are checked every _CHECK_MS (zmq may be filling with a message the
            # loop will never see)
            timeout_ms = 1000 if deadline is None else min(1000, max(0, math.ceil((deadline - now) * 1000.0)))
            # a message waiting: look at the other descriptors without sleeping
            queued = bool(int(_backend_get(sock, _EVENTS)) & zmq.POLLIN)
            ready = [fd for fd, _ in wait(0 if queued else min(timeout_ms, _CHECK_MS))]
            if channel_fd in ready:
                self.drain_completions()
            if monitor_fd in ready:
                self._peers_gone(connections)
            if now - last_check >= _CHECK_MS / 1000.0:
                last_check = now
                self._check_connections(connections)
                self._peers_gone(connections)
            if queued or router_fd in ready:
                batch_cpu0 = time.thread_time()
                self._reply_batch = []  # replies wait for the batch's end (_send)
                try:
                    self._receive_batch(sock, batch_cpu0)
                finally:
                    self._flush_replies()
                    self._reply_batch = None
            now = self.clock()
            if now - self._last_gauges >= 1.0:
                self._last_gauges = now
                self._refresh_gauges()
                self.metrics.tick(now)

    @property
    def stopping(self) -> bool:
        """``stop()`` was called: the loop is shutting down (status pages say so)."""
        return self._stopping

    @property
    def instance_bytes(self) -> dict[int, int]:
        """Each registered instance's object size, as core_sm holds them (a copy)."""
        sizes: dict[int, int] = self.machine.instances.object_bytes_by_instance()
        return sizes

    def _post_instance_failed(self, instance_id: int, reason: str) -> None:
        # stamped now: a registration the loop makes before the event is handled is a new one
        self.channel.post(m.InstanceFailed(instance_id, reason, failed_at=self.clock()))

    def _receive_batch(self, sock: zmq.Socket[Any], batch_cpu0: float) -> None:
        """Up to 256 waiting messages (bounded, so completions and timers are never starved by a
        flood), each timed: the longest message's wall time, and a bound on its CPU: the least of
        its wall time and the loop thread's CPU since the batch began (``batch_cpu0``).
        thread_time is a system call (~1.3 us here), so it is read once a batch and again only
        for a message whose wall time could raise the maximum (a message's CPU never exceeds its
        wall time)."""
        perf_counter = time.perf_counter
        for k in range(256):
            # The poll saw a message; after each one, zmq says whether another is waiting (2 us)
            # instead of a receive failing with zmq.Again (5.5 us and an exception): with one
            # request in flight the batch, and the hold on its replies, end right there.
            if k and not int(_backend_get(sock, _EVENTS)) & zmq.POLLIN:
                break
            t0 = perf_counter()
            if self._reply_batch and t0 - self._reply_batch_since >= _REPLY_HOLD_S:
                self._flush_replies()  # held long enough: not behind one more message
            try:
                received = self._receive(sock)
            except zmq.Again:
                break
            if isinstance(received, list):
                self.interpreter.on_message(received, self._curve_user)
            else:
                self.interpreter.on_refused(received)
            wall = perf_counter() - t0
            if wall > self._max_message_s:
                self._max_message_s = wall
            if wall > self._max_message_cpu_s:
                cpu = min(wall, time.thread_time() - batch_cpu0)
                if cpu > self._max_message_cpu_s:
                    self._max_message_cpu_s = cpu

    def _check_connections(self, connections: ConnectionWatch) -> None:
        for what in connections.check():
            self._counts["connections_cut"] += 1
            log.warning("cut %s: a message that does not end, or more than %d MiB of them (4 x --max-message-mb)",
                        what, connections.limit_bytes >> 20)

    def _peers_gone(self, connections: ConnectionWatch) -> None:
        for identity in connections.events():
            log.debug("the connection of anonymous peer %s closed: its instances are released", identity.hex())
            self.interpreter.handle(m.PeerGone(identity), self.clock(), None)

    def drain_completions(self) -> None:
        """Hand core_sm the completions posted so far (copies, L2 operations, probes run on
        the loop): what the loop does when its channel is readable."""
        for ev in self.channel.drain(self._collect_completions):
            if self.metrics.on_completion(ev, self.clock()):
                continue  # an HTTP probe's call, run on this thread
            self.interpreter.completed(ev)

    def _receive(self, sock: zmq.Socket[Any]) -> list[bytes | memoryview] | wire.DecodeError | wire.Unattributable:
        """One message, frame by frame, under ``limits``' frame and byte budget. Past the budget
        the remaining frames are read and dropped one by one (never joined into one message or
        copied into Python); the message is then answered ``too_large`` by its uid, if readable.
        Raises ``zmq.Again`` when no message is waiting."""
        lim = self.limits
        head: list[bytes | memoryview] = []  # identity and uid: they address the reply, even to a refusal
        kept: list[zmq.Frame] = []  # payload frames, not copied until the message is known good
        total = 0  # bytes of the op and payload frames
        over: str | None = None
        count = 0
        wire_bytes = 0  # what the message took on the wire (frames after the routing id)
        fd = -1
        flags: int = zmq.NOBLOCK
        while True:
            frame = _backend_recv(sock, flags, copy=False)
            flags = 0  # the rest of a message is already here: zmq delivers a message whole
            count += 1
            n = len(frame)
            wire_bytes += n
            if count <= 2:
                head.append(frame.bytes if n <= 256 else b"")
                if count == 1:
                    fd = frame.get(zmq.SRCFD)  # the connection's descriptor (connections.py)
                    wire_bytes = 0  # the routing id is the ROUTER's, not on the wire
                    if self.authenticator is not None:
                        # the CURVE key the authenticator admitted: the peer, stable across reconnects
                        user = frame.get("User-Id")
                        self._curve_user = user if isinstance(user, str) else None
            elif over is None:
                total += n
                if count > lim.max_frames + 3:
                    over = f"more than {lim.max_frames} payload frames"
                elif n > lim.max_frame_bytes:
                    over = f"frame of {n} bytes, limit {lim.max_frame_bytes}"
                elif total > lim.max_message_bytes:
                    over = f"message over {lim.max_message_bytes} bytes"
                if over is None:
                    kept.append(frame)
                else:
                    self._discard(kept)  # what was kept goes now, not after the last frame
                    kept = []
            more = frame.more
            if over is not None and n >= _BIG_FRAME:
                self._frames_to_free.put(frame)
            del frame
            if not more:
                break
        if self._connections is not None:
            self._connections.message(fd, head[0], wire_bytes + FRAME_OVERHEAD * (count - 1))  # type: ignore[arg-type]
        if over is None:
            # payloads are decoded straight from zmq's buffers: no copy before msgpack's own
            return head + [f.buffer for f in kept]
        self._counts["oversized_messages"] += 1
        self.metrics.count("oversized_messages")
        now = self.clock()
        if now - self._last_oversized_log >= 1.0:  # a flood costs one line a second
            self._last_oversized_log = now
            log.warning("refused an oversized message (%d frames): %s (%d so far)", count, over,
                        self._counts["oversized_messages"])
        return wire.refusal(head, ErrorKind.TOO_LARGE, over)

    def _discard(self, frames: list[zmq.Frame]) -> None:
        for f in frames:
            if len(f) >= _BIG_FRAME:
                self._frames_to_free.put(f)

    def _free_frames(self) -> None:
        # Releasing a large zmq frame unmaps its pages: tens of milliseconds for a message of
        # hundreds of MiB. This thread does it, so the loop never waits on it.
        while True:
            frame = self._frames_to_free.get()
            if frame is None:
                return
            del frame

    # ------------------------------------------------------------------ replies

    def _send(self, frames: list[bytes]) -> None:
        batch = self._reply_batch
        if batch is None:
            self._send_now(frames)
            return
        # Inside a receive batch replies are held and sent together at its end: a send that
        # finds zmq's I/O thread asleep wakes it (a system call, and on a busy box the loop thread
        # then waits for a core), so one wake-up per batch instead of per reply. Held at most
        # _REPLY_BATCH replies, and past _REPLY_HOLD_S sent before the next message is read (so a
        # reply waits at most that plus one message's handling).
        if not batch:
            self._reply_batch_since = time.perf_counter()
        batch.append(frames)
        if len(batch) >= _REPLY_BATCH or time.perf_counter() - self._reply_batch_since >= _REPLY_HOLD_S:
            self._flush_replies()

    def _flush_replies(self) -> None:
        batch = self._reply_batch
        if batch:
            self._reply_batch = []
            for frames in batch:
                self._send_now(frames)

    def _flush_lone_ack(self) -> None:
        """A lookup's ack, before its deferred work (``EffectInterpreter._run_deferred``): sent at
        once when it is the lone reply held and no other message waits. Under a throughput load --
        other replies already held, or another message waiting -- it stays batched and leaves with
        the batch (at most _REPLY_HOLD_S later), as every reply of a batch does (a flush per lookup
        there wakes zmq's I/O thread per reply: measured, list-form lookups/s fell by a sixth)."""
        batch = self._reply_batch
        if batch is not None and len(batch) == 1:  # the ack alone: not in the middle of a busy batch
            sock = self.sock
            waiting = isinstance(sock, zmq.Socket) and bool(int(_backend_get(sock, _EVENTS)) & zmq.POLLIN)
            if not waiting:
                self._flush_replies()

    def _send_now(self, frames: list[bytes]) -> None:
        sock = self.sock
        try:
            if isinstance(sock, zmq.Socket):
                # pyzmq's send_multipart goes through its Python-level send once per frame
                # (5.5 us for a 4-frame reply on this box); the backend's send, 3 us
                last = len(frames) - 1
                for i in range(last):
                    _backend_send(sock, frames[i], _SEND_MORE)
                _backend_send(sock, frames[last], zmq.NOBLOCK)
            else:  # a stand-in socket (mpcache/bench/bench_serverpath.py)
                sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as e:
            # EHOSTUNREACH: the peer is gone (ROUTER_MANDATORY); EAGAIN: it stopped reading.
            self._counts["dropped_replies"] += 1
            self.metrics.count("dropped_replies")
            log.debug("reply dropped: %s", e)

    def _health(self) -> dict[str, Any]:
        """What the ``health`` request answers."""
        return {
            "status": "stopping" if self._stopping else "ok",
            "version": version(),
            "epoch": self.epoch,
            "pid": os.getpid(),
            "uptime_s": time.time() - self.started_at,
            "url": self.bound_url,
            "chunk_size": self.config.chunk_size,
            "l2": [repr(t) for t in self.l2.tiers],
            "l2_tiers": self.l2.tier_states(),
        }

    def stats(self) -> dict[str, Any]:
        """core_sm's counters plus the runtime's (used by the ``stats`` op and metrics)."""
        out: dict[str, Any] = {}
        try:
            out.update(self.machine.stats())
        except Exception:
            log.exception("stats() failed")
        out.update(self._counts)
        out["outstanding_requests"] = len(self.interpreter.outstanding)
        out["transfers_in_flight"] = self.interpreter.transfers_in_flight
        out.update(self.l2.stats())
        executor_stats = getattr(self.executor, "stats", None)
        if callable(executor_stats):  # the GPU transfer engine's counters, as gpu_*
            out.update({f"gpu_{k}": v for k, v in executor_stats().items()})
        out["l1_num_slots"] = self.pool.num_slots
        out["l1_slot_bytes"] = self.pool.slot_bytes
        out["l1_segment_created"] = self.pool.created
        out["token_scanner_ready"] = tokens.ready()
        out["native_chunk_hash_ready"] = sha256_chain.ready()
        out["loop_max_message_ms"] = self._max_message_s * 1000.0
        out["loop_max_message_cpu_ms"] = self._max_message_cpu_s * 1000.0
        return out

    def _refresh_gauges(self) -> None:
        try:
            snapshot = self.stats()
            self._stats_snapshot = snapshot
            self._trim.update(int(snapshot.get("jobs", 0)))
        except Exception:
            log.exception("metrics refresh failed")

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Finish what is in flight (within the shutdown grace), answer what is still owed
        ``shutting_down``, and release the sockets, L1 and threads. ``serve_forever`` ends with
        it; a server whose loop never ran (one driven message by message, in process) is closed
        by calling it. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        log.info("mpcache-server stopping")
        end = self.clock() + self.config.shutdown_grace
        poller = zmq.Poller()
        poller.register(self.channel.fd, zmq.POLLIN)
        # no new requests are read; finish what worker threads are doing
        interpreter = self.interpreter
        while (interpreter.transfers_in_flight > 0 or self.l2.in_flight > 0) and self.clock() < end:
            if poller.poll(50):
                self.drain_completions()
        farewell = self.clock() + _FAREWELL_S if interpreter.outstanding else None
        for rt in list(interpreter.outstanding):
            interpreter.send_error(rt, ErrorKind.SHUTTING_DOWN.value, "the server is shutting down")
        # Every request has had its one reply. Closing the executor and the tiers ends the work
        # left: each effect still reports its completion (L2 work that never ran: as failed) and
        # core_sm handles it, so its state is whole (no pinned slot) when the loop returns;
        # the replies that handling makes are not sent.
        interpreter.stop_replies()
        for closing in (self.executor.close, self.l2.close):
            try:
                closing()
            except Exception:
                log.exception("closing %r failed", closing)
        self.drain_completions()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.trace is not None:
            self.trace.close()
        if self._ops_http is not None:
            self._ops_http.close()
        if farewell is not None and (left := farewell - self.clock()) > 0:
            time.sleep(left)  # the clients read those replies before their connection drops
        if self._connections is not None:
            self._connections.close()
        self.sock.close(linger=1000)
        self._remove_ipc_socket()
        interpreter.close()
        self._stop_frame_freer()
        if self.authenticator is not None:
            self.authenticator.stop()
        if self._reservation is not None:
            self._reservation.join()  # before the segment is closed under it
        self.pool.close()
        self.channel.close()
        self.ctx.term()
        # The compilers started with the loop (numba: seconds on a first run with no cache, over
        # ten on a loaded box) are waited for within the grace only: a SIGTERM right after a first
        # start must not wait for them. Those still running are named in ``loaders_running``
        # (the CLI then exits without the interpreter's finalization, which must not tear down a
        # daemon thread inside LLVM; numba writes its cache by renaming, never half a file).
        for loader in self._loaders:
            loader.join(max(0.0, end - self.clock()))
        self.loaders_running = [t.name for t in self._loaders if t.is_alive()]
        if self.loaders_running:
            log.info("not waiting for %s (still compiling)", ", ".join(self.loaders_running))
        log.info("mpcache-server stopped")
