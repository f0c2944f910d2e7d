"""The server's HTTP side: ``/metrics``, ``/healthz`` (alias ``/healthcheck``), ``/readyz``, ``/status``; 404 elsewhere.

Stdlib ``ThreadingHTTPServer`` (no HTTP parsing of our own) on ``--metrics-host:--metrics-port``,
served from one thread that ``close()`` joins, with one thread per connection up to
``MAX_CONNECTIONS`` (a connection beyond it is answered 503 and closed, costing no thread). Nothing here touches the loop's state directly:
checks that need it are posted to the loop as a ``LoopCall`` through the completion channel and
waited for with a bound, so a wedged loop answers 503 instead of hanging the probe, and a flood
of probes costs the loop at most one call at a time (concurrent probes share the lock and wait).

* ``/healthz`` — 200 when the process is alive and the loop ran a posted call within
  ``PROBE_TIMEOUT`` (also while stopping: a liveness probe must not kill a draining server);
  503 otherwise. Body: JSON with ``status``, ``version``, ``epoch``, ``uptime_s``.
* ``/healthcheck`` — the same as ``/healthz``, under the path LMCache's tools probe.
* ``/readyz`` — 200 when the server takes traffic: the loop is serving (not starting, not
  stopping), core_sm answers its stats, L1 is usable (the mapped segment reads; before it exists,
  its directory has room for one slot), and with ``--l2-require`` every L2 tier answers a
  ``contains`` within ``PROBE_TIMEOUT``. 503 otherwise, with the failed checks in the body.
* ``/status`` — JSON: version, epoch, url, effective config (no passwords), how many instances
  are registered, L1 and L2 use, lookup totals (by model and ``cache_salt_hash``, never a salt),
  ``requests_answered`` (every request answered, any op).
  The registered instance ids are listed only for a request that carries the admin token
  (``Authorization: Bearer <token of --admin-token-file>``, compared in constant time): an id is
  what a client presents as its own, so the page nobody authenticates must not hand them out.
* ``/metrics`` — the Prometheus exposition (OpenMetrics when the scraper asks for it).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.exposition import choose_encoder

from mpcache.runtime_zmq.config import version
from mpcache.runtime_zmq.metrics import LoopCall, ServerMetrics

log = logging.getLogger("mpcache.http")

PROBE_TIMEOUT = 2.0
_READYZ_KEY = b"mpcache:readyz-probe"
# Connections served at once (one thread each). Beyond it a connection gets a bare 503 and is
# closed at once, so a client opening connections without end costs no thread and no memory.
# Prometheus and the kubelet's probes need a handful; an idle connection holds its slot for at
# most ``_Handler.timeout`` per read.
MAX_CONNECTIONS = 32
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _BoundedHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with at most ``max_connections`` connection threads."""

    daemon_threads = True
    request_queue_size = 128  # listen backlog: a burst past the cap is answered, not left in SYN retries

    def __init__(self, address: tuple[str, int], handler: Any, max_connections: int) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused_connections = 0
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused_connections += 1
            try:
                request.settimeout(0.2)
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class OpsHttpServer:
    """Binds at construction (a busy port raises ``RuntimeError`` with the reason), serves from a
    daemon thread, ``close()`` stops and joins it."""

    def __init__(self, server: Any, host: str, port: int, *, metrics: ServerMetrics | None = None,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.server = server
        self.metrics = metrics if metrics is not None else server.metrics
        self._probe_lock = threading.Lock()
        self._l2_checks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpcache-readyz-l2")
        self._l2_pending: Any = None
        handler = type("Handler", (_Handler,), {"ops": self})
        try:
            self.httpd = _BoundedHTTPServer((host, port), handler, max_connections)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise RuntimeError(f"HTTP port {host}:{port} is in use (--metrics-port; 0 picks a free one, --no-metrics turns it off)") from None
            raise RuntimeError(f"cannot serve HTTP on {host}:{port}: {e.strerror or e}") from None
        bound_host, bound_port = self.httpd.server_address[:2]
        self.url = f"http://{bound_host!s}:{bound_port}"
        self.port = int(bound_port)
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="mpcache-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5.0)
        self._l2_checks.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- checks

    def on_loop(self, fn: Any, timeout: float = PROBE_TIMEOUT) -> tuple[bool, Any]:
        """Run ``fn(server)`` on the loop thread; (answered in time, result or exception)."""
        server = self.server
        if server is None:
            return False, "no server"
        deadline = time.monotonic() + timeout
        if not self._probe_lock.acquire(timeout=timeout):
            return False, "another probe is waiting for the loop"
        try:
            call = LoopCall(fn)
            server.channel.post(call)
            if not call.wait(max(0.0, deadline - time.monotonic())):
                return False, f"the server loop did not answer within {timeout:g} s"
            if call.error is not None:
                return False, f"{type(call.error).__name__}: {call.error}"
            return True, call.result
        finally:
            self._probe_lock.release()

    def healthz(self) -> tuple[int, dict[str, Any]]:
        server = self.server
        ok, answer = self.on_loop(lambda s: True)
        body: dict[str, Any] = {"version": version(), "epoch": getattr(server, "epoch", None),
                                "uptime_s": round(time.time() - getattr(server, "started_at", time.time()), 3)}
        if getattr(server, "stopping", False):
            body["status"] = "stopping"
            return 200, body
        body["status"] = "ok" if ok else "loop not answering"
        if not ok:
            body["reason"] = answer
        return (200 if ok else 503), body

    def readyz(self) -> tuple[int, dict[str, Any]]:
        server = self.server
        checks: dict[str, str] = {}
        if getattr(server, "stopping", False):
            checks["loop"] = "stopping"
        elif not self.metrics.serving:
            checks["loop"] = "starting"
        else:
            ok, answer = self.on_loop(_loop_checks)
            if not ok:
                checks["loop"] = str(answer)
            else:
                checks.update(answer)
        if self.metrics.require_l2:
            checks.update(self._l2_checks_now())
        failed = {k: v for k, v in checks.items() if v != "ok"}
        body = {"ready": not failed, "checks": checks, "version": version()}
        return (200 if not failed else 503), body

    def _l2_checks_now(self) -> dict[str, str]:
        tiers = list(self.server.l2.tiers)
        if not tiers:
            return {}
        if self._l2_pending is not None and not self._l2_pending.done():
            return {"l2": f"the previous L2 check has not finished after {PROBE_TIMEOUT:g} s"}

        def check() -> dict[str, str]:
            out = {}
            for tier in tiers:
                name = f"l2 {getattr(tier, 'name', repr(tier))}"
                try:
                    tier.contains(_READYZ_KEY)
                    out[name] = "ok"
                except Exception as e:
                    out[name] = f"down: {type(e).__name__}: {e}"[:300]
            return out

        self._l2_pending = fut = self._l2_checks.submit(check)
        try:
            return fut.result(PROBE_TIMEOUT)
        except FutureTimeout:
            return {"l2": f"no answer from L2 within {PROBE_TIMEOUT:g} s"}

    def is_admin(self, authorization: str | None) -> bool:
        """Whether an ``Authorization: Bearer <token>`` header carries the server's admin token."""
        from mpcache.runtime_zmq.auth import admin_ok

        if not authorization or not authorization.startswith("Bearer "):
            return False
        return admin_ok(getattr(self.server, "admin_token", None), authorization[len("Bearer "):].strip())

    def status(self, admin: bool = False) -> tuple[int, dict[str, Any]]:
        ok, answer = self.on_loop(lambda server: _status(server, admin))
        if not ok:
            return 503, {"error": str(answer), "version": version()}
        answer["config"] = self.metrics.config
        answer["l2"] = self.metrics.l2_state()
        answer["ready"] = self.metrics.serving and not getattr(self.server, "stopping", False)
        return 200, answer

    def metrics_body(self, accept: str) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept)
        return encoder(self.metrics.registry), content_type


def _loop_checks(server: Any) -> dict[str, str]:
    """On the loop thread: core_sm answers, L1 is usable."""
    checks: dict[str, str] = {}
    stats = server.machine.stats()
    checks["core_sm"] = "ok" if isinstance(stats, dict) else "stats() did not answer a dict"
    pool = server.pool
    if pool.num_slots <= 0:
        checks["l1"] = "L1 has no slot (--l1-size-gb / --slot-mb, or /dev/shm too small)"
    elif getattr(server, "l1_reserving", False):
        checks["l1"] = "starting: L1's pages are being reserved"  # a copy into L1 would wait for it
    elif pool.created:
        pool.read(0, 1)  # the mapping is there and readable
        checks["l1"] = "ok"
    else:
        st = os.statvfs(os.path.dirname(pool.path))
        free = st.f_bavail * st.f_frsize
        checks["l1"] = "ok" if free >= pool.slot_bytes else (
            f"{os.path.dirname(pool.path)} has {free} bytes free, less than one {pool.slot_bytes}-byte slot")
    return checks


def _status(server: Any, admin: bool = False) -> dict[str, Any]:
    """On the loop thread: a JSON-able snapshot (instance ids only for ``admin``)."""
    stats = server.stats()
    metrics = server.metrics
    tokens = [
        {"model_name": model, "cache_salt_hash": salt, "lookups": row[0], "requested_tokens": row[1], "hit_tokens": row[2]}
        for (model, salt), row in metrics.tokens.items()
    ]
    instances: dict[int, int] = server.instance_bytes
    answer: dict[str, Any] = {
        "version": version(),
        "epoch": server.epoch,
        "pid": os.getpid(),
        "uptime_s": round(time.time() - server.started_at, 3),
        "url": server.bound_url,
        "registered_instances": len(instances),
        "l1": metrics.l1_usage(stats),
        "lookups": tokens,
        # one count of requests: every request the server answered (any op, ok or error), as
        # mpcache_requests_total sums; core_sm's own "requests" (the ops it handled) is left out
        "requests_answered": sum(metrics.requests.values()),
        "errors": dict(metrics.errors),
        "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, bool)) and k != "requests"},
    }
    if admin:
        answer["registrations"] = [{"instance_id": iid, "object_bytes": nbytes} for iid, nbytes in sorted(instances.items())]
    return answer


class _Handler(BaseHTTPRequestHandler):
    ops: OpsHttpServer
    server_version = "mpcache"
    timeout = 10.0  # a client that stops sending loses its connection (and thread)

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def _answer(self, send_body: bool) -> None:
        path = self.path.split("?", 1)[0]
        try:
            if path == "/metrics":
                body, ctype = self.ops.metrics_body(self.headers.get("Accept", ""))
                self._send(200, body, ctype, send_body)
                return
            if path == "/status":
                code, obj = self.ops.status(self.ops.is_admin(self.headers.get("Authorization")))
                self._send(code, (json.dumps(obj, default=str, indent=1) + "\n").encode(), "application/json", send_body)
                return
            # /healthcheck: the path LMCache's tools probe, the same answer as /healthz
            handler = {"/healthz": self.ops.healthz, "/healthcheck": self.ops.healthz, "/readyz": self.ops.readyz}.get(path)
            if handler is None:
                self._send(404, b"not found: use /metrics, /healthz (or /healthcheck), /readyz or /status\n", "text/plain; charset=utf-8", send_body)
                return
            code, obj = handler()
            self._send(code, (json.dumps(obj, default=str, indent=1) + "\n").encode(), "application/json", send_body)
        except Exception as e:  # a probe must answer, whatever broke
            log.exception("HTTP %s failed", path)
            self._send(500, f"internal error: {type(e).__name__}\n".encode(), "text/plain; charset=utf-8", send_body)

    def _send(self, code: int, body: bytes, ctype: str, send_body: bool) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib's name)
        log.debug("%s " + format, self.address_string(), *args)
