"""The server's requests and core_sm's effects: what the loop (``runtime_zmq.server``) hands a
message to, and what turns the machine's decisions into replies and work.

    decode -> core_sm event -> handle(event, now) -> interpret effects -> encode

* A request is decoded by the ``wire`` codec table into a core_sm event and handled by
  ``LookupServer``. Nothing here decides the protocol: what to reply, when, with which leases, is
  the machine's. The only requests answered here are the ones with no protocol state: ``noop``,
  ``health``, ``stats``, ``l1_info``, ``report_block_allocation`` (counted).
* Effects: ``Reply``/``ErrorReply`` are encoded and handed to the loop's ``send`` (which batches
  them and sends them without blocking). ``StartTransfer`` goes to the ``TransferExecutor``;
  ``ProbeL2``/``ReadL2``/``WriteL2`` to the ``L2Worker`` threads; registrations, scrubs and L1's
  carving to the executor and the L1 pool; chunk events to the KV event publisher. Their
  completions come back through the loop's completion channel (``completed``).
* Every attributable request gets exactly one reply: the requests handed to the machine and not
  yet answered are ``outstanding``; an exception inside ``handle`` answers that request INTERNAL;
  at shutdown the loop answers what is left ``shutting_down`` (``send_error``), then
  ``stop_replies`` drops the replies of the work that still ends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import attrs

from mpcache.core_sm import effects as fx
from mpcache.core_sm import messages as m
from mpcache.core_sm.errors import ErrorKind, ProtocolError
from mpcache.runtime_zmq import auth, wire
from mpcache.runtime_zmq.l1_pool import SharedMemoryPool
from mpcache.runtime_zmq.l2_worker import L2Worker
from mpcache.runtime_zmq.metrics import ServerMetrics
from mpcache.runtime_zmq.transfer import TransferExecutor

# the server's logger: these lines are the server's, as they always were
log = logging.getLogger("mpcache.server")

# Operations answered by the runtime: no protocol state involved.
_LOCAL_OPS = frozenset({"noop", "health", "stats", "l1_info", "report_block_allocation"})
# Effects whose start the metrics time (L2 and copy latency histograms).
_TIMED_EFFECTS = (fx.StartTransfer, fx.ReadL2, fx.WriteL2, fx.ProbeL2)
# results sent as they are (no result_to_wire conversion)
_PLAIN_RESULTS = frozenset({bool, int, str})
_TRANSFER_OPS = frozenset({"store", "retrieve"})
ReplyTo = tuple[bytes, bytes, bytes, str, float]  # identity, uid frame, op frame, op, received at


class _RepeatsAtDebug(logging.Filter):
    """While ``quiet``, this logger's INFO lines are DEBUG: a registration repeated with the same
    fields (the client's transport and machine both register again after a reconnect or restart;
    it keeps its registration id) is not a new instance, so one line per registration stays at
    INFO (operators read them) and the repeats go to DEBUG."""

    def __init__(self) -> None:
        super().__init__()
        self.quiet = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.quiet or record.levelno != logging.INFO:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return log.isEnabledFor(logging.DEBUG)


class EffectInterpreter:
    """Serves decoded requests through core_sm's machine and carries out its effects, on the loop
    thread. The loop gives it the parts it drives and four callables of its own: ``send`` (a
    reply's frames), ``flush_ack`` (send a lone held ack now, see ``_run_deferred``), ``health``
    and ``stats`` (what those requests answer). ``counts`` is the loop's counter dict, shared so
    that ``stats`` keeps one table."""

    def __init__(
        self,
        *,
        machine: Any,
        pool: SharedMemoryPool,
        l2: L2Worker,
        executor: TransferExecutor,
        metrics: ServerMetrics,
        clock: Callable[[], float],
        limits: wire.Limits,
        admin_token: bytes | None,
        instance_ttl: float | None,
        post: Callable[[object], None],
        counts: dict[str, int],
        send: Callable[[list[bytes]], None],
        flush_ack: Callable[[], None],
        health: Callable[[], dict[str, Any]],
        stats: Callable[[], dict[str, Any]],
    ) -> None:
        self.machine = machine
        self.pool = pool
        self.l2 = l2
        self.executor = executor
        self.metrics = metrics
        self.clock = clock
        self.limits = limits
        self.admin_token = admin_token
        self.instance_ttl = instance_ttl
        self._post = post
        self._counts = counts
        self._send = send
        self._flush_ack = flush_ack
        self._health = health
        self._stats = stats
        self.trace: Any = None  # the server's TraceWriter (--trace), set by the server
        self.kv_events: Any = None  # the server's KvEventPublisher (--kv-events), set by the server
        # the requests handed to the machine and not yet answered
        self.outstanding: dict[ReplyTo, None] = {}
        self.transfers_in_flight = 0
        self._event_handles: dict[ReplyTo, bytes] = {}
        self._registering_layout: Any = None  # the registration core_sm is handling (AttachInstance)
        # the registration being handled and the id its instance had before (a repeat keeps it)
        self._prior_registration: tuple[ReplyTo, int | None] | None = None
        self._repeats_at_debug = _RepeatsAtDebug()
        log.addFilter(self._repeats_at_debug)
        self._last_answered: Any = None  # the last request answered (to never answer twice)
        self._replies_closed = False  # shutdown: every request was answered; send nothing more
        self._last_work_failure_log = -1e9

    def stop_replies(self) -> None:
        """Every request has had its one reply (shutdown): the replies of what still ends are not sent."""
        self._replies_closed = True

    def close(self) -> None:
        log.removeFilter(self._repeats_at_debug)

    # ------------------------------------------------------------------ requests

    def on_refused(self, req: wire.DecodeError | wire.Unattributable) -> None:
        if isinstance(req, wire.DecodeError):
            self._counts["wire_requests"] += 1
            self.send_error((req.identity, req.uid_frame, b"", req.op or "?", self.clock()), req.kind.value, req.message)
        else:
            self._counts["malformed"] += 1
            self.metrics.count("malformed_messages")
            log.debug("unattributable message: %s", req.reason)

    def on_message(self, frames: list[bytes | memoryview], curve_user: str | None = None) -> None:
        """One received message; ``curve_user``: the CURVE key the authenticator admitted it under."""
        req = wire.decode_request(frames, self.limits)
        if isinstance(req, wire.Request):
            self._counts["wire_requests"] += 1
            now = self.clock()
            reply_to: ReplyTo = (req.identity, req.uid_frame, req.op_frame, req.op, now)
            try:
                self._serve(req, reply_to, now, curve_user)
            except Exception as e:  # a runtime bug (or an executor's): answer, log, keep serving
                log.exception("serving %s failed", req.op)
                # answer unless it was answered or the machine holds it (it will answer)
                if not self._answered(reply_to) and reply_to not in self.outstanding:
                    self.send_error(reply_to, ErrorKind.INTERNAL.value, f"{type(e).__name__}: {e}"[:500])
        else:
            self.on_refused(req)

    def completed(self, ev: object) -> None:
        """A worker's completion (L2, transfer engine), from the loop's completion channel."""
        if isinstance(ev, m.TransferFinished):
            self.transfers_in_flight -= 1
        elif isinstance(ev, m.InstanceFailed):
            log.error("instance %s failed by the transfer engine (%s): its registration and plans are released "
                      "(it must register again); its copies are reported failed as they end",
                      ev.instance_id, ev.reason)
        elif isinstance(ev, m.L2ReadFinished):
            self.metrics.count("l2_hits", sum(ev.loaded))
            self.metrics.count("l2_objects_read", len(ev.loaded))
        self.handle(ev, self.clock(), None)

    @staticmethod
    def _peer(req: wire.Request, curve_user: str | None) -> Any:
        """Who sent ``req``, for core_sm's ownership checks: the CURVE public key the
        authenticator admitted, else the connection's ROUTER identity (mpcache's client keeps one
        random identity across reconnects; the socket hands it over to the new connection)."""
        if curve_user is not None:
            return ("curve", curve_user)
        return req.identity

    def _answered(self, rt: ReplyTo) -> bool:
        return self._last_answered is rt

    def _serve(self, req: wire.Request, reply_to: ReplyTo, now: float, curve_user: str | None) -> None:
        self.metrics.on_request(req, reply_to)
        if req.op in _LOCAL_OPS:
            self._local(req, reply_to)
            return
        try:
            event = wire.to_event(req, reply_to, now, self.limits, peer=self._peer(req, curve_user))
        except (wire.BadRequest, TypeError, ValueError) as e:
            self.send_error(reply_to, ErrorKind.UNDECODABLE.value, str(e)[:500])
            return
        if type(event) is m.Clear:
            # core_sm refuses a clear not marked admin: the mark is the admin token's check
            admin = auth.admin_ok(self.admin_token, req.args[1] if len(req.args) > 1 else None)
            if not admin:
                log.warning("clear without the admin token (%s): refused",
                            "none is configured: --admin-token-file" if self.admin_token is None else "wrong or missing")
            event = attrs.evolve(event, admin=admin)
        if req.op in ("store", "retrieve"):
            self._event_handles[reply_to] = req.args[3]
        if type(event) is not m.RegisterInstance:
            self.handle(event, now, reply_to)
            return
        # core_sm decides; only a registration it accepts reaches the transfer engine
        # (AttachInstance, carried out with this layout while the event is handled)
        self._registering_layout = req.args[1]
        self._prior_registration = (reply_to, self.machine.instances.registration_id(event.instance_id))
        try:
            self.handle(event, now, reply_to)
        finally:
            self._registering_layout = None
            self._prior_registration = None
        nbytes = event.object_bytes
        registered = self.machine.instances.registration(event.instance_id)
        if registered is not None and registered.object_bytes == nbytes and 0 < nbytes * 4 <= self.pool.slot_bytes:
            # fixed-size slots: small objects in large slots cap L1 at num_slots objects
            log.warning(
                "instance %s stores %d-byte objects in %d-byte slots: L1 holds at most %d of "
                "them; --slot-mb %.3f would hold %d",
                event.instance_id, nbytes, self.pool.slot_bytes, self.pool.num_slots,
                nbytes / (1 << 20), self.pool.size // max(nbytes, 1),
            )

    # ------------------------------------------------------------------ the machine

    def handle(self, event: object, now: float, reply_to: ReplyTo | None) -> None:
        """Hand ``event`` to core_sm and carry out its effects (``reply_to``: the request it answers)."""
        if reply_to is not None:
            self.outstanding[reply_to] = None
        machine = self.machine
        try:
            effects = machine.handle(event, now)
            deferred = machine.deferred_work
            if self.trace is not None and not deferred:
                self.trace.record(now, event, effects)
        except Exception as e:  # a core_sm bug: answer, log, keep serving
            log.exception("core_sm raised on %s", type(event).__name__)
            if reply_to is not None:
                self.send_error(reply_to, ErrorKind.INTERNAL.value, f"{type(e).__name__}: {e}"[:500])
            return
        for eff in effects:
            try:
                self._interpret(eff)
            except Exception:
                log.exception("carrying out %s failed", type(eff).__name__)
        if deferred:
            self._run_deferred(now, event, effects)

    def _run_deferred(self, now: float, event: object, effects: list[Any]) -> None:
        """core_sm acknowledged a lookup before its work (``ack_first``): send the ack, then do
        the work (hashes, leases, L2 start) while the client's next request is on its way. The
        loop sends the ack now only when it is the lone reply held and no other message waits
        (``flush_ack``); under a throughput load it leaves with its batch."""
        self._flush_ack()
        later = self.machine.run_deferred()  # never raises
        if self.trace is not None:
            self.trace.record(now, event, effects + later)  # one record per event, as replay runs it
        for eff in later:
            try:
                self._interpret(eff)
            except Exception:
                log.exception("carrying out %s failed", type(eff).__name__)

    def _interpret(self, eff: object) -> None:
        t = type(eff)
        if t is fx.Reply:  # the commonest effect, and not a timed one
            self._send_result(eff.reply_to, eff.result)  # type: ignore[attr-defined]
            return
        if t in _TIMED_EFFECTS:
            self.metrics.started(eff, self.clock())
        if t is fx.ErrorReply:
            err = eff.error  # type: ignore[attr-defined]
            self.send_error(eff.reply_to, err.kind.value, err.message)  # type: ignore[attr-defined]
        elif t is fx.StartTransfer:
            self._start_transfer(eff)  # type: ignore[arg-type]
        elif t is fx.ReadL2:
            self.l2.read(eff)  # type: ignore[arg-type]
        elif t is fx.WriteL2:
            self.l2.write(eff)  # type: ignore[arg-type]
        elif t is fx.ProbeL2:
            self.l2.probe(eff)  # type: ignore[arg-type]
        elif t is fx.InstanceReaped:  # no heartbeat for instance_ttl: drop its GPU mappings
            log.warning("instance %s sent no heartbeat for %g s: reaped (its registration, plans, leases and "
                        "GPU mappings are released; it must register again)",
                        eff.instance_id, self.instance_ttl)  # type: ignore[attr-defined]
            self.executor.unregister_instance(eff.instance_id)  # type: ignore[attr-defined]
        elif t is fx.AttachInstance:
            self._attach(eff)  # type: ignore[arg-type]
        elif t is fx.DetachInstance:
            self.executor.unregister_instance(eff.instance_id)  # type: ignore[attr-defined]
        elif t is fx.ScrubSlots:  # before the plan's reply: a commit never serves a slot's old bytes
            self.pool.zero(eff.slots, eff.nbytes)  # type: ignore[attr-defined]
        elif t is fx.CarveL1:  # L1 holds nothing: its slots now fit the objects registered
            self.pool.recarve(eff.slot_bytes, eff.num_slots)  # type: ignore[attr-defined]
        elif t is fx.LookupWorkFailed:  # a server fault after the ack: the job answers 0 hits
            now = self.clock()  # counted by core_sm (stats()["lookup_work_failures"])
            if now - self._last_work_failure_log >= 1.0:  # a fault on every lookup: a line a second
                self._last_work_failure_log = now
                log.error("the work of acknowledged lookup %r failed (%s): it answers 0 hits",
                          eff.request_id, eff.reason)  # type: ignore[attr-defined]
        elif t is fx.ChunksStored or t is fx.ChunksRemoved or t is fx.AllChunksCleared:
            if self.kv_events is not None:
                self.kv_events.publish((eff,))
        else:
            log.error("unknown effect %r", eff)

    def _start_transfer(self, st: fx.StartTransfer) -> None:
        # core_sm keeps the transfer's slots pinned until it handles TransferFinished, even
        # after it expired the transfer: exactly one is posted, whatever the executor does
        # (raises, reports twice or under another id).
        self.transfers_in_flight += 1
        post = self._post
        transfer_id = st.transfer_id
        reported = threading.Lock()

        def done(_transfer_id: int, ok: bool) -> None:
            if not reported.acquire(blocking=False):
                log.warning("transfer %d reported finished more than once", transfer_id)
                return
            post(m.TransferFinished(transfer_id, bool(ok)))

        try:
            nbytes = st.object_bytes
            if st.kind is m.TransferKind.STORE and nbytes > 0:
                for _chunk, slot in st.placements:
                    self.l2.note_slot_size(slot, nbytes)
            handle = self._event_handles.get(st.reply_to, b"")  # type: ignore[call-overload]
            self.executor.start(st, handle, done)
        except Exception:
            log.exception("transfer executor failed to start transfer %d", st.transfer_id)
            done(transfer_id, False)

    def _attach(self, eff: fx.AttachInstance) -> None:
        """core_sm accepted a server-driven registration: open its KV memory now and hand core_sm
        the outcome at once (it answers the registration)."""
        layout = self._registering_layout
        error: ProtocolError | None = None
        try:
            if layout is None:  # only a registration being handled asks it
                raise RuntimeError("AttachInstance outside a registration")
            reason = self.executor.register_instance(eff.instance_id, layout, self.pool)
            if reason is not None:
                error = ProtocolError(ErrorKind.VALIDATION, reason)
        except Exception as e:  # the transfer engine's bug: the registration is answered internal
            log.exception("attaching instance %s failed", eff.instance_id)
            error = ProtocolError(ErrorKind.INTERNAL, f"{type(e).__name__}: {e}"[:500])
        self.handle(m.InstanceAttached(eff.instance_id, eff.registration_id, error, reply_to=eff.reply_to),
                    self.clock(), None)

    # ------------------------------------------------------------------ replies

    def _send_result(self, rt: Any, result: Any) -> None:
        if type(rt) is not tuple or len(rt) != 5:
            log.error("reply with a routing token this runtime did not make: %r", rt)
            return
        identity, uid_frame, op_frame, op, t0 = rt
        self.outstanding.pop(rt, None)
        # only store/retrieve requests have a handle: most replies skip the lookup
        handle = self._event_handles.pop(rt, b"") if self._event_handles else b""
        if self._replies_closed:
            return
        if result is not None and type(result) not in _PLAIN_RESULTS:
            if isinstance(result, m.TransferPlan) and result.ok:
                self._note_plan(result)
            result = wire.result_to_wire(op, result, event_handle=handle, segment=self.pool.path, slot_bytes=self.pool.slot_bytes)
        try:
            frames = wire.encode_reply(identity, uid_frame, op_frame, result)
        except Exception as e:
            log.exception("cannot encode the result of %s", op)
            self.send_error(rt, ErrorKind.INTERNAL.value, f"cannot encode result: {e}")
            return
        self._send(frames)
        self._last_answered = rt
        self._counts["wire_replies"] += 1
        served = self.clock() - t0
        if op in _TRANSFER_OPS:  # receipt (decoded) to reply handed to zmq: the GPU benchmark's split
            self._counts[f"served_ns_{op}"] += int(served * 1e9)
            self._counts[f"served_{op}"] += 1
        self.metrics.request(op, "ok", served)
        prior = self._prior_registration
        if prior is None or prior[0] is not rt or prior[1] is None or result != prior[1]:
            self.metrics.on_reply(rt, op, result)
            return
        self._repeats_at_debug.quiet = True  # a repeated registration logs at DEBUG
        try:
            self.metrics.on_reply(rt, op, result)
        finally:
            self._repeats_at_debug.quiet = False

    def send_error(self, rt: Any, kind: str, message: str) -> None:
        """Answer request ``rt`` with an error of ``kind`` (an ``ErrorKind`` value)."""
        identity, uid_frame, _op_frame, op, t0 = rt
        self.outstanding.pop(rt, None)
        self._event_handles.pop(rt, None)
        if self._replies_closed:
            return
        self._send(wire.encode_error(identity, uid_frame, op, kind, message))
        self._last_answered = rt
        self._counts["wire_errors"] += 1
        self.metrics.request(op, "error", self.clock() - t0)
        self.metrics.error(kind)
        self.metrics.on_error(rt, op, kind, message)

    def _note_plan(self, plan: m.TransferPlan) -> None:
        # The engine will map the segment: create it now.
        self.pool.ensure()
        nbytes = plan.object_bytes
        if plan.kind is m.TransferKind.STORE and nbytes > 0:
            for _chunk, slot in plan.placements:
                self.l2.note_slot_size(slot, nbytes)

    # ------------------------------------------------------------------ local ops

    def _local(self, req: wire.Request, rt: ReplyTo) -> None:
        op = req.op
        if op == "noop":
            result: Any = "OK"
        elif op == "health":
            result = self._health()
        elif op == "stats":
            result = self._stats()
            # which thread is which, for per-thread CPU from /proc (the kernel knows only the ids)
            result["threads"] = {str(t.native_id): t.name for t in threading.enumerate() if t.native_id is not None}
        elif op == "l1_info":
            result = {"segment": self.pool.ensure(), "slot_bytes": self.pool.slot_bytes, "num_slots": self.pool.num_slots}
        else:  # report_block_allocation: accepted, counted (observability only)
            records = req.args[-1] if req.args else []
            n = len(records) if isinstance(records, list) else 0
            self._counts["block_allocation_records"] += n
            self.metrics.count("block_allocation_reports", n)
            result = None
        self._send_result(rt, result)
