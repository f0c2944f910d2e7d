"""The extension points legacy profiles override (docs/core_sm.md): the defaults are the fixed
behaviour, and one overridden method is enough to change it."""
from __future__ import annotations

from typing import Any

from mpcache.core_sm.effects import Effect, ErrorReply, Reply, SendRequest
from mpcache.core_sm.errors import ErrorKind, ProtocolError
from mpcache.core_sm.lookup_client import LookupClient, LookupClientConfig, PendingLookup
from mpcache.core_sm.messages import (
    CommitTransfer,
    EndRequest,
    EndSession,
    Lookup,
    Ping,
    QueryPrefetchStatus,
    RegisterInstance,
    ReplyReceived,
    ReplyTo,
    SubmitLookup,
    TimerFired,
)
from mpcache.core_sm.server import LookupServer, ServerConfig
from sm_helpers import C, ServerHarness, tokens


def _client(cls: type[LookupClient] = LookupClient, n: int = 2) -> LookupClient:
    return cls(LookupClientConfig(num_servers=n, model_name="m", chunk_size=C))


def _sends(effects: list[Effect], typ: type) -> list[SendRequest]:
    return [e for e in effects if isinstance(e, SendRequest) and isinstance(e.request, typ)]


def _resolved(c: LookupClient, hits: int) -> LookupClient:
    fx = c.handle(SubmitLookup("r", tokens(2)), 0.0)
    queries: list[SendRequest] = []
    for e in _sends(fx, Lookup):
        queries += _sends(c.handle(ReplyReceived(e.server, e.correlation, None), 0.0), QueryPrefetchStatus)
    for q in queries:
        c.handle(ReplyReceived(q.server, q.correlation, hits), 0.0)
    return c


class SilentLeak(LookupClient):
    def _end_pending_lookup(self, pending: PendingLookup, now: float, out: list[Effect]) -> None:
        pass


def test_end_request_while_pending_ends_the_session_unless_the_hook_says_otherwise() -> None:
    c = _client()
    c.handle(SubmitLookup("r", tokens(2)), 0.0)
    ends = _sends(c.handle(EndRequest("r"), 0.0), EndSession)
    assert sorted(e.server for e in ends) == [0, 1]
    assert c.check("r") == 0 and c.stats()["correlations"] == 0
    leak = _client(SilentLeak)
    leak.handle(SubmitLookup("r", tokens(2)), 0.0)
    assert leak.handle(EndRequest("r"), 0.0) == []
    assert leak.check("r") == 0 and leak.stats()["correlations"] == 0
    # the hook is for a pending lookup only: a resolved one still ends its session
    done = _resolved(_client(SilentLeak), 2)
    assert done.check("r") == 2 * C
    assert len(_sends(done.handle(EndRequest("r"), 0.0), EndSession)) == 2


class NoResultCache(LookupClient):
    def _keep_result_after_check(self, pending: PendingLookup) -> bool:
        return False


def test_a_result_is_kept_after_check_unless_the_hook_says_otherwise() -> None:
    c = _resolved(_client(), 2)
    assert c.check("r") == 2 * C and c.check("r") == 2 * C
    assert _sends(c.handle(TimerFired(), 1.0), QueryPrefetchStatus) == []
    legacy = _resolved(_client(NoResultCache), 2)
    assert legacy.check("r") == 2 * C  # delivered once...
    assert legacy.check("r") is None  # ...then asked again
    again = _sends(legacy.handle(TimerFired(), 1.0), QueryPrefetchStatus)
    assert sorted(q.server for q in again) == [0, 1]
    legacy.check_invariants()


class SilentServer(LookupServer):
    def _reply_error(self, out: list[Effect], reply_to: ReplyTo, error: ProtocolError) -> None:
        pass


def test_every_error_reply_goes_through_one_method() -> None:
    h = ServerHarness()
    unregistered = CommitTransfer(12345, True)
    rt = h.send(unregistered)
    (reply,) = h.replies[rt]
    assert isinstance(reply, ErrorReply) and reply.error.kind is ErrorKind.UNKNOWN_TRANSFER
    assert h.server.stats()["errors"] == 1
    silent = ServerHarness(server=SilentServer(ServerConfig(chunk_size=C, num_slots=8, slot_bytes=100)))
    too_big = RegisterInstance(1, "m", 1, 10_000, False)
    for request in (unregistered, too_big, Ping()):
        silent.send(request)
    assert [type(e) for e in silent.log] == [Reply]  # only the Ping was answered
    assert silent.server.stats()["errors"] == 0


class PingCounter(LookupServer):
    pings = 0

    def _on_ping(self, ev: Any, now: float, out: list[Effect]) -> None:
        self.pings += 1
        super()._on_ping(ev, now, out)


def test_a_subclass_overrides_one_handler() -> None:
    h = ServerHarness(server=PingCounter(ServerConfig(chunk_size=C, num_slots=8, slot_bytes=100)))
    assert h.call(Ping()) is True
    assert isinstance(h.server, PingCounter) and h.server.pings == 1
