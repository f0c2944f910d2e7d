"""A resend after NOT_REGISTERED, told apart from a network duplicate (core_sm/server_transfers.py).

A server-driven STORE/RETRIEVE with a ``not_after`` is answered at most once per op, and a
refusal is remembered for its duplicates until the ``not_after``. The transport's resend after
the instance registered again repeats the refused request but names the registration it follows
(``registration``: the id that registration's reply gave), so:

* a duplicate of the original (no ``registration``) still gets the original's refusal: no copy;
* a duplicate of the resend joins the resend's copy, or gets its remembered answer: one copy;
* either order of the two is the same; a resend runs only while the registration it names is the
  instance's current one (reaped, unregistered or registered anew since: ``NOT_REGISTERED``).
"""
from __future__ import annotations

import attrs

from mpcache.core_sm.errors import ErrorKind
from mpcache.core_sm.health import (
    HealthConfig,
    HealthMonitor,
    HeartbeatReply,
    InstanceRegistered,
    Register,
    RequestRefused,
    Resend,
    resend_of,
)
from mpcache.core_sm.messages import (
    PrepareRetrieve,
    PrepareStore,
    RegisterInstance,
    Retrieve,
    RetrieveResult,
    Store,
    StoreResult,
    UnregisterInstance,
)
from mpcache.core_sm.server import ServerConfig
from sm_helpers import C, MODEL, ServerHarness, key, tokens

TOKS = tokens(2)
BLOCKS = (10, 11, 12, 13)


def _register(h: ServerHarness, object_bytes: int = 10) -> int:
    registration = h.call(RegisterInstance(1, MODEL, 1, object_bytes))
    assert isinstance(registration, int)
    return registration


def _refused_store(h: ServerHarness) -> Store:
    """A STORE refused NOT_REGISTERED (the instance is not registered): its refusal is kept."""
    original = Store(key("w", TOKS, worker_id=0), 1, BLOCKS, not_after=10.0)
    assert h.error_kind(h.send(original)) is ErrorKind.NOT_REGISTERED
    return original


def test_a_registration_keeps_its_id_when_registered_again_alike_and_gets_a_new_one_otherwise() -> None:
    h = ServerHarness()
    first = _register(h)
    assert _register(h) == first  # the same fields again (a crossing or duplicated registration)
    assert h.server.instances.registration_id(1) == first
    changed = _register(h, object_bytes=20)  # other fields: another registration
    assert changed != first
    assert h.call(UnregisterInstance(1)) is None and h.server.instances.registration_id(1) is None
    again = _register(h, object_bytes=20)
    assert again not in (first, changed)  # a new life after the unregister
    # ids come from the keyed generator: another server (a restart) gives others
    other = ServerHarness(ServerConfig(chunk_size=C, num_slots=64, slot_bytes=100, id_seed=1))
    assert _register(other) != first


def test_a_resend_naming_the_new_registration_runs_although_the_original_was_refused() -> None:
    h = ServerHarness()
    original = _refused_store(h)
    registration = _register(h)
    resend = h.send(resend_of(original, registration))
    assert len(h.transfers) == 1  # a new op: the original's refusal does not answer it
    h.finish_all_transfers()
    assert h.result(resend) == StoreResult(True, 2, 0)
    stats = h.server.stats()
    assert stats["resends_run"] == 1 and stats["resends_refused"] == 0 and stats["objects"] == 2


def test_a_duplicate_of_the_original_gets_its_refusal_and_never_copies_in_either_order() -> None:
    for duplicate_first in (True, False):
        h = ServerHarness()
        original = _refused_store(h)
        registration = _register(h)
        if duplicate_first:
            assert h.error_kind(h.send(original)) is ErrorKind.NOT_REGISTERED and not h.transfers
        resend = h.send(resend_of(original, registration))
        assert len(h.transfers) == 1
        if not duplicate_first:  # while the resend copies: the duplicate neither joins nor copies
            assert h.error_kind(h.send(original)) is ErrorKind.NOT_REGISTERED and len(h.transfers) == 1
        h.finish_all_transfers()
        assert h.result(resend) == StoreResult(True, 2, 0)
        # after the resend's answer (the worker may have freed the blocks): still the refusal
        assert h.error_kind(h.send(original)) is ErrorKind.NOT_REGISTERED and not h.transfers
        assert h.server.stats()["transfers_started"] == 1, duplicate_first


def test_a_duplicate_of_the_resend_shares_its_copy_or_gets_its_answer() -> None:
    h = ServerHarness()
    original = _refused_store(h)
    resend = resend_of(original, _register(h))
    first, dup = h.send(resend), h.send(resend)
    assert len(h.transfers) == 1 and h.reply(dup) is None  # joins the running copy
    h.finish_all_transfers()
    assert h.result(first) == h.result(dup) == StoreResult(True, 2, 0)
    late = h.send(resend)  # after the answer, before not_after: answered, no copy
    assert h.result(late) == StoreResult(True, 2, 0) and not h.transfers
    h.now = 10.5  # after not_after: refused like any late request
    assert h.error_kind(h.send(resend)) is ErrorKind.TIMEOUT and not h.transfers
    assert h.server.stats()["transfers_started"] == 1 and h.server.stats()["duplicate_transfers"] == 2


def test_a_resend_runs_only_under_the_registration_it_names() -> None:
    h = ServerHarness()
    original = _refused_store(h)
    registration = _register(h)
    h.call(UnregisterInstance(1))
    gone = h.send(resend_of(original, registration))  # the instance is not registered
    assert h.error_kind(gone) is ErrorKind.NOT_REGISTERED and not h.transfers
    h2 = ServerHarness()
    original = _refused_store(h2)
    stale = _register(h2)
    h2.call(UnregisterInstance(1))
    _register(h2)  # registered anew: the resend names the registration before
    refused = h2.send(resend_of(original, stale))
    reply = h2.reply(refused)
    assert h2.error_kind(refused) is ErrorKind.NOT_REGISTERED and not h2.transfers
    assert "registered anew" in str(reply)
    assert h2.error_kind(h2.send(resend_of(original, stale))) is ErrorKind.NOT_REGISTERED  # its duplicate too
    assert h2.server.stats()["resends_refused"] == 1 and h2.server.stats()["transfers_started"] == 0
    # a registration that is no id at all names none
    for bogus in (True, "x", -1):
        assert h2.error_kind(h2.send(attrs.evolve(original, registration=bogus, not_after=9.0))) \
            is ErrorKind.NOT_REGISTERED
    assert not h2.transfers


def test_a_retrieve_resend_and_its_original_in_either_order() -> None:
    for original_again_first in (True, False):
        h = ServerHarness()
        writer = _register(h)
        h.store(TOKS, rid="w")  # the chunks are in L1
        h.call(UnregisterInstance(1))  # reaped, say
        original = Retrieve(key("r", TOKS, worker_id=0), 1, BLOCKS, 0, not_after=10.0)
        assert h.error_kind(h.send(original)) is ErrorKind.NOT_REGISTERED
        registration = _register(h)
        assert registration != writer
        if original_again_first:
            assert h.error_kind(h.send(original)) is ErrorKind.NOT_REGISTERED and not h.transfers
        resend = h.send(resend_of(original, registration))
        assert len(h.transfers) == 1
        h.finish_all_transfers()
        assert h.result(resend) == RetrieveResult(True, 2)
        assert h.error_kind(h.send(original)) is ErrorKind.NOT_REGISTERED and not h.transfers
        assert h.server.leases_by_owner() == {}


def test_requests_without_a_registration_are_served_as_before() -> None:
    h = ServerHarness()
    _register(h)
    store = Store(key("w", TOKS, worker_id=0), 1, BLOCKS, not_after=10.0)
    rt = h.send(store)
    h.finish_all_transfers()
    assert h.result(rt) == StoreResult(True, 2, 0) and h.server.stats()["resends_run"] == 0
    # no not_after (LMCache's clients): no record, a resend naming the registration still checked
    plain = Store(key("p", tokens(2, seed=5), worker_id=0), 1, BLOCKS)
    assert h.error_kind(h.send(attrs.evolve(plain, registration=12345))) is ErrorKind.NOT_REGISTERED


# ----------------------------------------------------------------------------- the client side


def test_the_monitor_resends_naming_the_registration_just_acknowledged() -> None:
    m = HealthMonitor(HealthConfig(1, 1.0, 2.5), 0.0)
    m.handle(HeartbeatReply(0, "e1"), 0.0)
    m.handle(InstanceRegistered(0, 7, 111), 0.0)
    assert m.handle(RequestRefused(0, 7, "a", "not_registered"), 1.0) == [Register(0, 7)]
    m.handle(RequestRefused(0, 7, "b", "not_registered"), 1.0)
    assert m.handle(InstanceRegistered(0, 7, 222), 1.1) == [Resend(0, "a", 222), Resend(0, "b", 222)]
    # a server that answers no id (an older one): resent as it was
    m.handle(RequestRefused(0, 7, "c", "not_registered"), 2.0)
    assert m.handle(InstanceRegistered(0, 7), 2.1) == [Resend(0, "c", None)]


def test_resend_of_names_the_registration_on_server_driven_requests_only() -> None:
    k = key("w", TOKS, worker_id=0)
    store, retrieve = Store(k, 1, BLOCKS, not_after=3.0), Retrieve(k, 1, BLOCKS, 4, not_after=3.0)
    assert resend_of(store, 5) == attrs.evolve(store, registration=5)
    assert resend_of(retrieve, 5) == attrs.evolve(retrieve, registration=5)
    for request in (PrepareStore(k, 1, not_after=3.0), PrepareRetrieve(k, 1), RegisterInstance(1, MODEL, 1, 10)):
        assert resend_of(request, 5) is request  # the server keeps no per-op record of these
    assert resend_of(store, None) is store
