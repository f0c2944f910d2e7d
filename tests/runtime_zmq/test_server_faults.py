"""Fault tests against real server processes: kill -9 mid-lookup, a client killed while holding
leases, a stalled L2 read, graceful SIGTERM."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from live_server import HERE, REPO, ServerProcess, wait_for
from mpcache.core_sm.effects import SendRequest
from mpcache.core_sm.errors import ErrorKind, ProtocolError
from mpcache.core_sm.lookup_client import LookupClient, LookupClientConfig
from mpcache.core_sm.messages import ReplyReceived, RequestFailed, ServerHealth, SubmitLookup, TimerFired
from mpcache.runtime_zmq.wire import request_to_wire, result_from_wire
from mpcache.runtime_zmq.client import MPCacheClient, RemoteError
from test_server_ops import CHUNK, key, register, store_chunks, tokens

SLOW_L2 = "python:slow_tier:make?delay=60"


class LookupDriver:
    """core_sm's LookupClient wired to one MPCacheClient (what the scheduler adapter does): every
    reply, failure and health change becomes a core_sm event, handled on this thread."""

    def __init__(self, client: MPCacheClient, **cfg: Any) -> None:
        self.client = client
        self.machine = LookupClient(LookupClientConfig(num_servers=1, model_name="m", world_size=1, chunk_size=CHUNK, **cfg))
        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        client.on_health(lambda healthy: self.events.put(ServerHealth(0, healthy)))

    def feed(self, event: Any) -> None:
        for eff in self.machine.handle(event, time.monotonic()):
            assert isinstance(eff, SendRequest)
            op, args = request_to_wire(eff.request)
            fut = self.client.submit(op, *args)
            fut.add_done_callback(lambda f, e=eff: self.events.put(self._outcome(e, f)))

    @staticmethod
    def _outcome(eff: SendRequest, fut: Future[Any]) -> Any:
        exc = fut.exception()
        if exc is None:
            return ReplyReceived(eff.server, eff.correlation, result_from_wire(eff.request, fut.result()))
        kind = ErrorKind(exc.kind) if isinstance(exc, RemoteError) and exc.kind in {k.value for k in ErrorKind} else ErrorKind.INTERNAL
        return RequestFailed(eff.server, eff.correlation, ProtocolError(kind, str(exc)))

    def pump(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                self.feed(self.events.get(timeout=0.01))
            except queue.Empty:
                pass
            d = self.machine.next_deadline()
            if d is not None and d <= time.monotonic():
                self.feed(TimerFired())

    def result(self, rid: str, within: float) -> int | None:
        end = time.monotonic() + within
        while time.monotonic() < end:
            self.pump(0.02)
            r = self.machine.check(rid)
            if r is not None:
                return r
        return self.machine.check(rid)


def test_kill_9_mid_lookup_resolves_zero_then_recovers(start_server: Callable[..., ServerProcess]) -> None:
    sp = start_server("--l2", SLOW_L2, transport="ipc")
    ipc_path = sp.url[len("ipc://") :]
    client = MPCacheClient(sp.url, request_timeout=10.0, heartbeat_interval=0.2, heartbeat_timeout=1.0)
    try:
        drv = LookupDriver(client, lookup_timeout=30.0)
        drv.feed(SubmitLookup("a", tuple(tokens(4))))
        drv.pump(0.5)
        assert drv.machine.check("a") is None  # stuck behind the stalled L2 read
        sp.kill()  # SIGKILL
        t0 = time.monotonic()
        assert drv.result("a", within=5.0) == 0
        assert time.monotonic() - t0 < 5.0
        assert wait_for(lambda: not client.healthy, timeout=5.0)
        # the same address comes back: the client finds it within about a second
        sp2 = ServerProcess(["--ipc", ipc_path, "--l1-size-gb", "0.25", "--slot-mb", "1", "--metrics-port", "0"]).start()
        try:
            assert client.wait_healthy(5.0)
            drv.pump(0.1)
            register(client)
            assert store_chunks(client, tokens(4), "w")["ok"]
            drv.feed(SubmitLookup("b", tuple(tokens(4))))
            assert drv.result("b", within=5.0) == 4 * CHUNK
        finally:
            sp2.kill()
    finally:
        client.close()


def test_killed_client_leases_freed_by_ttl(start_server: Callable[..., ServerProcess]) -> None:
    sp = start_server("--lease-ttl", "1", "--job-ttl", "1")
    c = MPCacheClient(sp.url, request_timeout=5.0)
    try:
        register(c)
        assert store_chunks(c, tokens(4), "w")["ok"]
        script = (
            "import sys, time\n"
            "from mpcache.runtime_zmq.client import MPCacheClient\n"
            "from test_server_ops import key, tokens\n"
            f"c = MPCacheClient({sp.url!r})\n"
            "c.lookup(key(tokens(4), 'victim')).result(5)\n"
            "print('hits', c.query_prefetch_status('victim').result(5), flush=True)\n"
            "time.sleep(60)\n"
        )
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, HERE]))
        victim = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
        try:
            assert victim.stdout is not None
            assert victim.stdout.readline().strip() == "hits 4"
            assert c.stats()["leases_held"] == 4
            victim.kill()
            victim.wait(5)
        finally:
            if victim.poll() is None:
                victim.kill()
        assert wait_for(lambda: c.stats()["leases_held"] == 0, timeout=5.0)
        s = c.stats()
        assert s["leases_released_ttl"] + s["leases_released_reap"] >= 4
        # the objects are still cached, readable by the next request
        c.lookup(key(tokens(4), "next")).result(5)
        assert c.query_prefetch_status("next").result(5) == 4
    finally:
        c.close()


def test_stalled_l2_read(start_server: Callable[..., ServerProcess]) -> None:
    sp = start_server("--l2", SLOW_L2, "--l2-read-timeout", "2")
    c = MPCacheClient(sp.url, request_timeout=5.0)
    try:
        assert c.lookup(key(tokens(3), "slow")).result(5) is None
        assert c.query_prefetch_status("slow").result(5) is None  # in progress
        t0 = time.monotonic()
        assert c.wait_prefetch_status("slow", 0.3).result(5) is None  # the waiter times out cleanly
        assert 0.25 <= time.monotonic() - t0 < 5.0
        assert c.noop() == "OK"  # the loop is not wedged by the stuck read
        s = c.stats()
        assert s["jobs_pending"] == 1 and s["l2_in_flight"] == 1
        # core_sm's L2 read timeout resolves the job with its L1 prefix: no poll-forever (F17)
        assert wait_for(lambda: c.query_prefetch_status("slow").result(5) is not None, timeout=5.0)
        assert c.query_prefetch_status("slow").result(5) == 0
    finally:
        c.close()


def test_sigterm_answers_waiters_and_removes_segment(start_server: Callable[..., ServerProcess]) -> None:
    sp = start_server("--l2", SLOW_L2, "--shutdown-grace", "0.5")
    c = MPCacheClient(sp.url, request_timeout=10.0)
    try:
        segment = c.l1_info()["segment"]
        assert os.path.exists(segment)
        c.lookup(key(tokens(2), "w")).result(5)
        waiter = c.wait_prefetch_status("w", 30.0)
        # The server must hold the waiter before the signal: a request it has not read when
        # the shutdown starts is never read (and this client would time out, not see
        # shutting_down). A fixed sleep was not enough on a loaded box. The scanner loading on
        # its thread at start must be done too, or the shutdown waits for it.
        assert wait_for(lambda: (s := c.stats())["waiters"] == 1 and s["token_scanner_ready"], timeout=30.0, interval=0.05)
        assert not waiter.done()
        assert sp.terminate(timeout=30.0) == 0
        with pytest.raises(RemoteError) as e:
            waiter.result(5)
        assert e.value.kind == "shutting_down"
        assert not os.path.exists(segment)
    finally:
        c.close()


@pytest.mark.parametrize("gap", [0.0, 0.0005, 0.001, 0.002, 0.005])
def test_second_sigterm_right_after_the_first_is_harmless(start_server: Callable[..., ServerProcess], gap: float) -> None:
    # `timeout 5 mpcache-server` under make delivers two SIGTERMs a moment apart; the second one
    # lands anywhere in the shutdown (socket and pipe closing, interpreter exit): never a
    # traceback, never a non-zero exit.
    sp = start_server()
    assert sp.proc is not None
    sp.proc.send_signal(signal.SIGTERM)
    time.sleep(gap)
    if sp.proc.poll() is None:
        sp.proc.send_signal(signal.SIGTERM)
    out = sp.output()
    assert sp.proc.returncode == 0, out
    assert "Traceback" not in out and "Error" not in out, out
    assert "mpcache-server stopped" in out


def test_second_signal_during_a_slow_shutdown_is_logged_and_third_exits_at_once(start_server: Callable[..., ServerProcess]) -> None:
    sp = start_server("--l2", SLOW_L2, "--shutdown-grace", "30")
    assert sp.proc is not None
    c = MPCacheClient(sp.url, request_timeout=10.0)
    try:
        segment = c.l1_info()["segment"]
        c.lookup(key(tokens(2), "w")).result(5)  # an L2 read that stalls: shutdown waits for it
    finally:
        c.close()
    sp.proc.send_signal(signal.SIGTERM)
    assert wait_for(lambda: any("mpcache-server stopping" in line for line in sp.log), timeout=10.0)
    sp.proc.send_signal(signal.SIGINT)
    assert wait_for(lambda: any("already shutting down" in line for line in sp.log), timeout=10.0)
    time.sleep(0.3)
    assert sp.alive  # still waiting for the stalled read, as the grace allows
    t0 = time.monotonic()
    sp.proc.send_signal(signal.SIGTERM)
    out = sp.output(timeout=10.0)
    assert sp.proc.returncode == 128 + signal.SIGTERM, out
    assert time.monotonic() - t0 < 5.0
    assert "exiting at once" in out and "Traceback" not in out, out
    assert not os.path.exists(segment)


_SLOW_COMPILER = """
import sys, threading, time
from mpcache.runtime_zmq import cli, tokens

def compiling() -> threading.Thread:  # a first start on a loaded box: the scanner compiles for a minute
    thread = threading.Thread(target=time.sleep, args=(60,), name="mpcache-token-scanner", daemon=True)
    thread.start()
    return thread

tokens.load_in_background = compiling
sys.exit(cli.main(sys.argv[1:]))
"""


def test_sigterm_right_after_a_first_start_does_not_wait_for_the_compiler(tmp_path: Any) -> None:
    # A first start compiles the token scanner (numba, no cache yet) on a thread: over ten seconds
    # on a loaded box. A SIGTERM then ends the process within the shutdown grace, and says what it
    # did not wait for.
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_COMPILER, "--port", "0", "--l1-size-gb", "0.0625", "--slot-mb", "1",
         "--no-metrics", "--shutdown-grace", "0.5"],
        cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "mpcache-server ready" in line:
                break
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out = "".join(lines) + proc.communicate(timeout=30)[0]
        assert proc.returncode == 0, out
        assert time.monotonic() - t0 < 10.0, out
        # the chunk chain's compiler may still run too on a loaded box: both are named then
        assert any("not waiting for " in line and "mpcache-token-scanner" in line and "(still compiling)" in line
                   for line in out.splitlines()), out
        assert "mpcache-server stopped" in out and "Traceback" not in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
