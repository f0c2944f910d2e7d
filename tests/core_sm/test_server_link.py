"""ServerLink, the one machine per client-server connection: correlation, deadlines, heartbeats,
registration memory, parking after not_registered, one resend naming the registration, give-up."""
from __future__ import annotations

from typing import Any

from mpcache.core_sm.health import Connected, HealthConfig
from mpcache.core_sm.messages import ServerEpoch, ServerHealth, TimerFired
from mpcache.core_sm.server_link import (
    Close,
    Completed,
    Failed,
    Heartbeat,
    InstancePing,
    Reply,
    Role,
    SendFailed,
    ServerLink,
    ServerLinkConfig,
    Submit,
    Transmit,
)


def link(now: float = 0.0) -> ServerLink:
    return ServerLink(ServerLinkConfig(HealthConfig(1, 1.0, 3.0, probe_interval=0.1, fail_pending=True),
                                       request_timeout=5.0), now)


def transmits(effects: list[Any]) -> list[Transmit]:
    return [e for e in effects if type(e) is Transmit]


def healthy(sl: ServerLink, now: float = 0.0) -> None:
    """Probe, answer it with epoch 7: the link is healthy."""
    [hb] = transmits(sl.handle(TimerFired(), now))
    assert hb.request == Heartbeat()
    out = sl.handle(Reply(hb.uid, True, {"epoch": 7}), now)
    assert out == [ServerEpoch(0, 7), ServerHealth(0, True)]


def test_reply_is_correlated_by_uid_and_late_ones_are_counted() -> None:
    sl = link()
    healthy(sl)
    [a] = transmits(sl.handle(Submit("A", "req-a"), 0.1))
    [b] = transmits(sl.handle(Submit("B", "req-b"), 0.1))
    assert a.uid != b.uid and sl.request_of(a.uid) == "req-a"
    assert sl.handle(Reply(b.uid, True, 2), 0.2) == [Completed("B", 2)]
    assert sl.handle(Reply(a.uid, False, "boom", "internal"), 0.2) == [Failed("A", "internal", "", "boom", "req-a")]
    assert sl.handle(Reply(a.uid, True, 1), 0.3) == []
    assert sl.stats()["late_replies"] == 1


def test_a_request_past_its_deadline_fails_timeout_once() -> None:
    sl = link()
    healthy(sl)
    [t] = transmits(sl.handle(Submit("A", "r", timeout=0.5), 0.0))
    assert (sl.next_deadline() or 1.0) <= 0.5
    out = sl.handle(TimerFired(), 0.5)
    assert [e for e in out if type(e) is Failed] == [Failed("A", "timeout", "no reply within the request timeout",
                                                             None, "r")]
    assert sl.handle(Reply(t.uid, True, 1), 0.6) == []


def test_send_failure_fails_the_request_and_a_heartbeat_unsent_decides_nothing() -> None:
    sl = link()
    [t] = transmits(sl.handle(Submit("A", "r"), 0.0))
    # not_sent, not unhealthy: the frame never left, so a server-driven copy needs no fence
    assert sl.handle(SendFailed(t.uid), 0.0) == [Failed("A", "not_sent", "server not connected", None, "r")]
    [hb] = transmits(sl.handle(TimerFired(), 0.0))
    assert sl.handle(SendFailed(hb.uid), 0.0) == []
    assert sl.monitor.stats()["heartbeats_unsent"] == 1


def test_unhealthy_fails_everything_pending() -> None:
    sl = link()
    healthy(sl)
    sl.handle(Submit("A", "r", timeout=100.0), 0.1)
    sl.handle(Submit("B", "s", timeout=100.0), 0.1)
    out: list[Any] = []
    now = 0.0
    while not any(type(e) is ServerHealth for e in out):
        now = sl.next_deadline() or now + 1
        out = sl.handle(TimerFired(), now)
    assert ServerHealth(0, False) in out
    assert sorted(e.token for e in out if type(e) is Failed and e.kind == "unhealthy") == ["A", "B"]
    assert sl.pending_count() <= 1  # the probe


def test_not_registered_parks_registers_the_remembered_request_and_resends_naming_it() -> None:
    sl = link()
    healthy(sl)
    [reg] = transmits(sl.handle(Submit("R", "register-1", role=Role.REGISTRATION, instance=1), 0.1))
    assert sl.handle(Reply(reg.uid, True, 41), 0.1) == [Completed("R", 41)]
    [st] = transmits(sl.handle(Submit("S", "store", instance=1), 0.2))
    out = sl.handle(Reply(st.uid, False, "refused", "not_registered"), 0.2)
    [again] = transmits(out)
    assert again.request == "register-1" and not any(type(e) in (Failed, Completed) for e in out)
    # a second parked request does not register twice
    [st2] = transmits(sl.handle(Submit("T", "store2", instance=1), 0.2))
    assert transmits(sl.handle(Reply(st2.uid, False, "refused", "not_registered"), 0.2)) == []
    out = sl.handle(Reply(again.uid, True, 42), 0.3)
    resent = transmits(out)
    assert [(t.request, t.registration, t.resend) for t in resent] == [("store", 42, True), ("store2", 42, True)]
    assert sl.handle(Reply(resent[0].uid, True, "ok"), 0.4) == [Completed("S", "ok")]
    # a second refusal after the resend gives up with the server's error
    assert sl.handle(Reply(resent[1].uid, False, "again", "not_registered"), 0.4) == [
        Failed("T", "not_registered", "", "again", "store2")]


def test_a_failed_re_registration_gives_every_parked_request_up() -> None:
    sl = link()
    healthy(sl)
    [reg] = transmits(sl.handle(Submit("R", "register-1", role=Role.REGISTRATION, instance=1), 0.1))
    sl.handle(Reply(reg.uid, True, 41), 0.1)
    [st] = transmits(sl.handle(Submit("S", "store", instance=1), 0.2))
    [again] = transmits(sl.handle(Reply(st.uid, False, "refused", "not_registered"), 0.2))
    assert sl.handle(SendFailed(again.uid), 0.2) == [Failed("S", "not_registered", "", "refused", "store")]


def test_a_parked_request_still_times_out_with_its_refusal() -> None:
    sl = link()
    healthy(sl)
    [reg] = transmits(sl.handle(Submit("R", "register-1", role=Role.REGISTRATION, instance=1), 0.1))
    sl.handle(Reply(reg.uid, True, 41), 0.1)
    [st] = transmits(sl.handle(Submit("S", "store", timeout=0.5, instance=1), 0.2))
    sl.handle(Reply(st.uid, False, "refused", "not_registered"), 0.3)
    out = sl.handle(TimerFired(), 0.7)
    assert Failed("S", "not_registered", "", "refused", "store") in out


def test_registered_instances_are_pinged_and_a_refused_ping_registers_again() -> None:
    sl = link()
    healthy(sl)
    [reg] = transmits(sl.handle(Submit("R", "register-1", role=Role.REGISTRATION, instance=1), 0.1))
    sl.handle(Reply(reg.uid, True, 41), 0.1)
    sent = transmits(sl.handle(TimerFired(), 1.0))
    assert [t.request for t in sent] == [Heartbeat(), InstancePing(1)]
    ping = sent[1]
    [again] = transmits(sl.handle(Reply(ping.uid, False, "gone", "not_registered"), 1.0))
    assert again.request == "register-1"
    # unregistering forgets the registration and stops the pings
    sl.handle(Reply(again.uid, True, 43), 1.1)
    sl.handle(Submit("U", "unregister-1", role=Role.UNREGISTRATION, instance=1), 1.2)
    assert sl.registration(1) is None
    assert [t.request for t in transmits(sl.handle(TimerFired(), 2.0))] == [Heartbeat()]


def test_connected_probes_at_once_and_close_fails_what_is_pending() -> None:
    sl = link()
    assert [t.request for t in transmits(sl.handle(Connected(0), 0.0))] == [Heartbeat()]
    sl.handle(Submit("A", "r"), 0.0)
    assert [e for e in sl.handle(Close(), 0.0) if type(e) is Failed] == [Failed("A", "closed", "client closed",
                                                                                None, "r")]
    assert sl.stats()["internal_errors"] == 0


def test_a_duplicate_of_a_refusal_is_dropped_while_the_request_is_parked() -> None:
    """A network that duplicates frames delivers the refusal twice: the second must neither
    reach the caller (the request waits for its resend) nor ask the monitor again."""
    sl = link()
    healthy(sl)
    [reg] = transmits(sl.handle(Submit("R", "register-1", role=Role.REGISTRATION, instance=1), 0.1))
    sl.handle(Reply(reg.uid, True, 41), 0.1)
    [st] = transmits(sl.handle(Submit("S", "store", instance=1), 0.2))
    [again] = transmits(sl.handle(Reply(st.uid, False, "refused", "not_registered"), 0.2))
    assert sl.parked(st.uid) and sl.parked_uids() == [st.uid]
    assert sl.handle(Reply(st.uid, False, "refused", "not_registered"), 0.25) == []
    assert sl.stats()["late_replies"] == 1 and sl.monitor.stats()["reregistrations"] == 1
    [resent] = transmits(sl.handle(Reply(again.uid, True, 42), 0.3))
    assert not sl.parked(st.uid) and resent.request == "store"
    assert sl.handle(Reply(resent.uid, True, "ok"), 0.4) == [Completed("S", "ok")]


def test_the_link_alone_registers_again_on_a_new_epoch_and_retries_a_failed_registration() -> None:
    """Its one registration submitted, the node's machine sends none again: the link sends the
    remembered one on a new epoch, and a failed one again after its backoff while healthy."""
    sl = link()
    healthy(sl)  # epoch 7
    [reg] = transmits(sl.handle(Submit("R", "register-1", role=Role.REGISTRATION, instance=1), 0.1))
    sl.handle(Reply(reg.uid, True, 41), 0.1)
    [hb, _ping] = transmits(sl.handle(TimerFired(), 1.0))
    out = sl.handle(Reply(hb.uid, True, {"epoch": 8}), 1.0)  # restarted between two heartbeats
    assert out[0] == ServerEpoch(0, 8) and [t.request for t in transmits(out)] == ["register-1"]
    [again] = transmits(out)
    assert sl.handle(Reply(again.uid, False, "busy", "internal"), 1.1) == []  # the link's own: no caller
    assert sl.next_deadline() == 1.1 + 0.5  # registration_retry
    [retry] = transmits(sl.handle(TimerFired(), 1.6))
    assert retry.request == "register-1" and sl.monitor.stats()["registration_retries"] == 1
    sl.handle(Reply(retry.uid, True, 44), 1.7)
    assert [t.request for t in transmits(sl.handle(TimerFired(), 2.0))] == [Heartbeat(), InstancePing(1)]


def test_an_answered_requests_deadline_is_still_named_and_fires_as_nothing() -> None:
    """The deadline heap is core_sm's ``TimerHeap``: an answered request's entry goes stale and
    stays until due, and ``next_deadline`` names it (as it always has), so the shell wakes once
    for nothing; ``request_deadlines`` lists only the pending ones."""
    sl = ServerLink(ServerLinkConfig(HealthConfig(1, 10.0, 30.0, backoff_max=10.0, probe_interval=0.1)), 0.0)
    healthy(sl)
    [hb] = transmits(sl.handle(TimerFired(), 0.1))  # the first heartbeat: the next is at 10.1
    assert sl.handle(Reply(hb.uid, True, {"epoch": 7}), 0.1) == []
    [a] = transmits(sl.handle(Submit("A", "r", timeout=0.5), 1.0))
    [b] = transmits(sl.handle(Submit("B", "r", timeout=2.0), 1.0))
    assert sl.handle(Reply(a.uid, True, 1), 1.1) == [Completed("A", 1)]
    assert sl.next_deadline() == 1.5 and sl.request_deadlines() == [(3.0, b.uid)]
    before = sl.deadline_entries()
    assert sl.handle(TimerFired(), 1.5) == [] and sl.deadline_entries() == before - 1
    assert sl.stats()["timeouts"] == 0 and sl.next_deadline() == 3.0
    out = sl.handle(TimerFired(), 3.0)
    assert out == [Failed("B", "timeout", "no reply within the request timeout", None, "r")]
    assert sl.next_deadline() == 10.1  # the answered heartbeats' entries (30.0, 30.1) wait behind it


def test_memory_stays_bounded_under_many_answered_requests() -> None:
    """Every answered request leaves a stale deadline entry until its (long) timeout; the heap is
    rebuilt from the pending ones whenever it holds more than twice them plus DEADLINE_SLACK, so
    it stays bounded and the requests still pending time out as ever."""
    from mpcache.core_sm.server_link import DEADLINE_SLACK
    sl = link()
    healthy(sl)
    waiting = [t.uid for i in range(5) for t in transmits(sl.handle(Submit(("W", i), "w", timeout=300.0), 0.0))]
    now = 0.0
    for i in range(20 * DEADLINE_SLACK):
        now += 1e-5
        [t] = transmits(sl.handle(Submit(i, "r", timeout=300.0), now))
        assert sl.handle(Reply(t.uid, True, i), now) == [Completed(i, i)]
        assert sl.deadline_entries() <= 2 * (sl.pending_count() + 1) + DEADLINE_SLACK + 1
    assert sl.pending_count() == 5 and sl._deadlines.compactions >= 10
    assert [u for _d, u in sl.request_deadlines()] == waiting
    out = sl.handle(TimerFired(), 300.0)
    assert sorted(e.token for e in out if type(e) is Failed and e.kind == "timeout") == [("W", i) for i in range(5)]
