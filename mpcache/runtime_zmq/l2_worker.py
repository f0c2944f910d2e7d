"""Runs core_sm's ``ProbeL2`` / ``ReadL2`` / ``WriteL2`` effects against the L2 tiers.

Contract with core_sm: every effect yields exactly one completion (``L2ProbeFinished`` /
``L2ReadFinished`` / ``L2WriteFinished``) through ``post``, from any thread. core_sm keeps the
effect's L1 slots pinned until it arrives, so the worker bounds how long that takes and never
touches a slot after it reported:

* **Deadline per effect** (``L2Options.deadline_s`` plus the effect's bytes at
  ``min_bytes_per_s``, counted from submission). At the deadline the effect is reported failed
  (reads: nothing loaded) by a watcher thread, whatever the tier is doing. A tier call that
  returns later finds the effect finished and discards its bytes: slot writes happen under the
  effect's lock and only while it is unfinished.
* **Circuit breaker per tier** (``l2_health.Breaker``): unreachable-tier errors and deadline
  expiries count as failures; an open tier is skipped (reads miss, writes are dropped) and pinged
  with a doubling backoff until it answers. A tier that cannot be reached at start is opened the
  same way (the server starts L1-only) unless ``require`` is set, which refuses the start.
* **Bounded queue** (``queue_max`` effects waiting): reads and probes run before writes; when the
  queue is full a write-behind is dropped first (the oldest queued write, or the new one), and
  only a queue full of reads refuses a read. Every drop is reported failed and counted.
* **Batching**: a read is one ``read_into`` / ``read_each`` / ``read_many`` (pipelined GETs)
  per tier for the keys still missing, a probe one ``contains_many``, a write one
  ``write_many``. With ``read_into`` (Redis) a value's payload is read off the socket straight
  into its slot and its MAC is checked piece by piece while the rest arrives; the slot counts as
  loaded only once the whole payload matched.
* **Integrity** (``l2_seal``): values are sealed on write and checked on read; a rejected value is
  a miss, counted per reason, logged at most once per ``reject_log_interval_s``, and deleted from
  the tier where the tier has ``delete``. A value read straight into its slot (``read_into``) may
  leave the bytes that failed the check in that slot: the slot is reported not loaded, so core_sm
  aborts the object it was reserved for and no reader ever sees them.
"""
from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.effects import ProbeL2, ReadL2, WriteL2
from mpcache.core_sm.messages import L2ProbeFinished, L2ReadFinished, L2WriteFinished
from mpcache.runtime_zmq.l1_pool import SharedMemoryPool
from mpcache.runtime_zmq.l2_common import L2Unavailable, redact
from mpcache.runtime_zmq.l2_health import Breaker, BreakerState
from mpcache.runtime_zmq.l2_seal import HEADER_BYTES as SEAL_HEADER_BYTES
from mpcache.runtime_zmq.l2_seal import Rejection, Sealer, load_or_create_secret

log = logging.getLogger("mpcache.l2")

PostFn = Callable[[object], None]

__all__ = ["L2Options", "L2Worker", "storage_key", "default_secret_file"]


@attrs.frozen
class L2Options:
    """How the server runs its L2 tiers (CLI: ``--l2-secret-file``, ``--l2-require``,
    ``--l2-deadline``, ``--l2-queue``)."""

    secret_file: str | None = None  # None: PATH/.secret of the first disk tier, else the state dir
    require: bool = False  # refuse to start when a tier does not answer at start
    deadline_s: float = 5.0
    min_bytes_per_s: float = 200e6  # an effect's deadline grows by its bytes at this rate
    queue_max: int = 256
    breaker_threshold: int = 3
    breaker_backoff_s: float = 0.5
    breaker_backoff_max_s: float = 30.0
    reject_log_interval_s: float = 30.0


def storage_key(key: ObjectKey) -> bytes:
    """The L2 key of an object (stable across processes and servers). The chunk hash is a Redis
    Cluster hash tag (``{...}``), so one chunk's objects for every rank live in one slot."""
    return f"{{{key.chunk_hash.hex()}}}-{key.kv_rank}".encode("ascii")


def default_secret_file(tiers: Sequence[Any]) -> str:
    """Where the secret lives when no ``--l2-secret-file`` is given: beside the first disk tier's
    objects, else in ``$MPCACHE_STATE_DIR`` / ``$XDG_STATE_HOME/mpcache`` / ``~/.local/state/mpcache``."""
    for tier in tiers:
        root = getattr(tier, "root", None)
        if isinstance(root, str):
            return os.path.join(root, ".secret")
    state = os.environ.get("MPCACHE_STATE_DIR")
    if not state:
        xdg = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
        state = os.path.join(xdg, "mpcache")
    return os.path.join(state, "l2.secret")


class _Effect:
    """One queued or running effect; ``finish`` reports it exactly once."""

    __slots__ = ("kind", "effect", "failed", "deadline", "lock", "done", "tier")

    def __init__(self, kind: str, effect: Any, failed: object, deadline: float) -> None:
        self.kind = kind  # "read" | "probe" | "write" | "ping"
        self.effect = effect
        self.failed = failed
        self.deadline = deadline
        self.lock = threading.Lock()
        self.done = False
        self.tier: _Tier | None = None  # the tier it is waiting on (for the breaker)


class _Tier:
    def __init__(self, tier: Any, breaker: Breaker) -> None:
        self.tier = tier
        self.breaker = breaker
        self.ping_queued = False

    def __repr__(self) -> str:
        return repr(self.tier)


class L2Worker:
    """Executes L2 effects in ``workers`` threads (see the module docstring)."""

    def __init__(
        self,
        tiers: Sequence[Any],
        pool: SharedMemoryPool,
        post: PostFn,
        workers: int = 4,
        options: L2Options | None = None,
        *,
        sealer: Sealer | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = options or L2Options()
        self.pool = pool
        self.post = post
        self.clock = clock
        self._slot_nbytes: dict[int, int] = {}
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._urgent: collections.deque[_Effect] = collections.deque()  # reads, probes, pings
        self._writes: collections.deque[_Effect] = collections.deque()
        self._timers: list[tuple[float, int, _Effect]] = []
        self._seq = itertools.count()
        self._closed = False
        self.in_flight = 0
        self.reads = 0
        self.writes = 0
        self.read_hits = 0
        self.errors = 0
        self.counts: collections.Counter[str] = collections.Counter()
        self._rejects_pending: collections.Counter[str] = collections.Counter()
        self._rejects_logged_at = -1e18
        self._drops_pending: collections.Counter[str] = collections.Counter()
        self._drops_logged_at = -1e18
        o = self.options
        self._tiers = [_Tier(t, Breaker(o.breaker_threshold, o.breaker_backoff_s, o.breaker_backoff_max_s))
                       for t in tiers]
        if sealer is None and self._tiers:
            path = o.secret_file or default_secret_file(tiers)
            sealer = Sealer(load_or_create_secret(path))
            log.info("L2 objects are sealed with the secret in %s (%s); servers sharing a tier "
                     "must share this file", path, sealer.algorithm.name)
        self._sealer = sealer
        self._check_reachable()
        self._threads = [threading.Thread(target=self._run, name=f"mpcache-l2-{i}", daemon=True)
                         for i in range(max(1, workers))]
        self._threads.append(threading.Thread(target=self._watch, name="mpcache-l2-deadlines", daemon=True))
        for t in self._threads:
            t.start()

    @property
    def tiers(self) -> list[Any]:
        return [t.tier for t in self._tiers]

    @property
    def chain_key(self) -> bytes | None:
        """The chunk-chain key every server sharing these tiers derives from their secret (None
        without tiers): a prompt then has one key in the whole fleet."""
        return self._sealer.chain_key() if self._sealer is not None and self._tiers else None

    # -- submission (loop thread) ------------------------------------------------------------

    def note_slot_size(self, slot: int, nbytes: int) -> None:
        """How many bytes of ``slot`` hold the object (what a write-behind must copy)."""
        self._slot_nbytes[slot] = nbytes

    def probe(self, effect: ProbeL2) -> None:
        failed = L2ProbeFinished(effect.probe_id, (False,) * len(effect.keys))
        self._submit("probe", effect, failed, 0)

    def read(self, effect: ReadL2) -> None:
        failed = L2ReadFinished(effect.read_id, (False,) * len(effect.items))
        self._submit("read", effect, failed, len(effect.items) * (effect.object_bytes or self.pool.slot_bytes))

    def write(self, effect: WriteL2) -> None:
        # The bytes are copied by the worker thread, later: the slots stay pinned until
        # L2WriteFinished, so no writer races it. Their sizes are the ones known now.
        sizes = [effect.object_bytes or self._slot_nbytes.get(slot, self.pool.slot_bytes) for _, slot in effect.items]
        self._submit("write", (effect, sizes), L2WriteFinished(effect.write_id, False), sum(sizes))

    def _submit(self, kind: str, effect: Any, failed: object, nbytes: int) -> None:
        now = self.clock()
        job = _Effect(kind, effect, failed, now + self.options.deadline_s + nbytes / self.options.min_bytes_per_s)
        dropped: _Effect | None = None
        with self._cond:
            self.in_flight += 1
            if self._closed:
                dropped = job
            elif len(self._urgent) + len(self._writes) >= self.options.queue_max:
                if kind == "write":
                    dropped = job
                    self.counts["l2_writes_dropped"] += 1
                elif self._writes:
                    dropped = self._writes.popleft()
                    self.counts["l2_writes_dropped"] += 1
                else:
                    dropped = job
                    self.counts[f"l2_{kind}s_refused"] += 1
            if dropped is not job:
                (self._writes if kind == "write" else self._urgent).append(job)
                heapq.heappush(self._timers, (job.deadline, next(self._seq), job))
                self._cond.notify_all()
        if dropped is not None:
            if not self._closed:
                self._note_drop(dropped.kind)
            self._finish(dropped, dropped.failed)

    def _note_drop(self, kind: str) -> None:
        now = self.clock()
        with self._lock:
            self._drops_pending[kind] += 1
            if now - self._drops_logged_at < self.options.reject_log_interval_s:
                return
            self._drops_logged_at = now
            summary = ", ".join(f"{n} {k}" for k, n in sorted(self._drops_pending.items()))
            self._drops_pending.clear()
        log.warning("L2 queue full (%d effects waiting): dropped %s (write-behind first; next report "
                    "in %.0f s at most)", self.options.queue_max, summary, self.options.reject_log_interval_s)

    def _finish(self, job: _Effect, event: object) -> bool:
        """Reports ``job`` with ``event`` unless it was reported already."""
        with job.lock:
            if job.done:
                return False
            job.done = True
        with self._lock:
            self.in_flight -= 1
        if job.kind != "ping":
            self.post(event)
        return True

    # -- threads -----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._urgent and not self._writes and not self._closed:
                    self._cond.wait()
                if self._urgent:
                    job = self._urgent.popleft()
                elif self._writes:
                    job = self._writes.popleft()
                else:
                    return  # closed and drained
            if job.done:
                continue
            if self._closed:
                self._finish(job, job.failed)
                continue
            try:
                event = getattr(self, "_do_" + job.kind)(job)
            except Exception:
                log.exception("L2 %s failed", job.kind)
                self.errors += 1
                event = job.failed
            self._finish(job, event)

    def _watch(self) -> None:
        """Fails effects at their deadline; queues pings for tiers whose breaker is due."""
        while True:
            with self._cond:
                if self._closed and not self._timers:
                    return
                now = self.clock()
                expired: list[_Effect] = []
                while self._timers and (self._timers[0][0] <= now or self._timers[0][2].done):
                    expired.append(heapq.heappop(self._timers)[2])
                for t in self._tiers:
                    if not t.ping_queued and t.breaker.due(now) and not self._closed:
                        t.ping_queued = True
                        self.in_flight += 1
                        ping = _Effect("ping", t, None, now + self.options.deadline_s)
                        self._urgent.appendleft(ping)
                        heapq.heappush(self._timers, (ping.deadline, next(self._seq), ping))
                        self._cond.notify_all()
                wait = 0.25
                if self._timers:
                    wait = min(wait, max(0.0, self._timers[0][0] - now))
            for job in expired:
                if job.done:
                    continue
                tier = job.tier
                if self._finish(job, job.failed):
                    self._count("l2_deadline_expired")
                    if job.kind == "ping":
                        assert isinstance(job.effect, _Tier)
                        tier = job.effect
                        tier.ping_queued = False
                    log.warning("L2 %s gave up at its deadline%s", job.kind, f" (waiting on {tier!r})" if tier else "")
                    if tier is not None:
                        self._tier_failed(tier, "deadline")
            if self._closed:
                with self._cond:
                    pending = [j for _, _, j in self._timers]
                    self._timers.clear()
                for j in pending:
                    self._finish(j, j.failed)
                return
            with self._cond:
                if not self._closed:
                    self._cond.wait(wait)

    def _count(self, name: str) -> None:
        with self._lock:
            self.counts[name] += 1

    # -- breaker -----------------------------------------------------------------------------

    def _allowed(self, tier: _Tier) -> bool:
        with self._lock:
            ok = tier.breaker.allow(self.clock())
            if not ok:
                self.counts["l2_tier_skipped"] += 1
        return ok

    def _tier_ok(self, tier: _Tier) -> None:
        with self._lock:
            was = tier.breaker.state
            tier.breaker.success()
        if was is not BreakerState.CLOSED:
            log.warning("L2 tier %r is back", tier)

    def _tier_failed(self, tier: _Tier, why: object) -> None:
        with self._lock:
            opened = tier.breaker.failure(self.clock())
            backoff = tier.breaker.backoff_s
            if opened:
                self.counts["l2_breaker_opened"] += 1
        if opened:
            log.warning("L2 tier %r is failing (%s): skipped for %.1f s, then retried", tier, why, backoff)

    def _call(self, job: _Effect, tier: _Tier, fn: Callable[[], Any], what: str) -> tuple[bool, Any]:
        """Runs one tier call for ``job``; (True, result) or (False, None) after an error."""
        job.tier = tier
        try:
            result = fn()
        except L2Unavailable as e:
            self.errors += 1
            self._tier_failed(tier, e)
            return False, None
        except Exception as e:
            self.errors += 1
            log.warning("L2 %s on %r failed: %s", what, tier, e)
            return False, None
        finally:
            job.tier = None
        self._tier_ok(tier)
        return True, result

    def _check_reachable(self) -> None:
        for t in self._tiers:
            ping = getattr(t.tier, "ping", None)
            if ping is None:
                continue
            try:
                ping()
            except Exception as e:
                if self.options.require:
                    raise L2Unavailable(f"L2 tier {t!r} is required and does not answer: {e}") from e
                t.breaker.open_now(self.clock())
                self.counts["l2_breaker_opened"] += 1
                log.warning("L2 tier %r does not answer (%s): starting L1-only for it, retrying "
                            "with backoff", t, e)

    # -- the work (worker threads) -----------------------------------------------------------

    def _do_ping(self, job: _Effect) -> object:
        tier: _Tier = job.effect
        ping = getattr(tier.tier, "ping", None) or (lambda: tier.tier.contains(b"mpcache-ping"))
        try:
            self._call(job, tier, ping, "ping")
        finally:
            tier.ping_queued = False
        return None

    def _do_probe(self, job: _Effect) -> object:
        effect: ProbeL2 = job.effect
        keys = [storage_key(k) for k in effect.keys]
        present = [False] * len(keys)
        for tier in self._tiers:
            todo = [i for i, p in enumerate(present) if not p]
            if not todo or job.done:
                break
            if not self._allowed(tier):
                continue
            ok, found = self._call(job, tier, lambda: _contains_many(tier.tier, [keys[i] for i in todo]), "probe")
            if ok:
                for i, f in zip(todo, found):
                    present[i] = bool(f)
        return L2ProbeFinished(effect.probe_id, tuple(present))

    def _do_read(self, job: _Effect) -> object:
        effect: ReadL2 = job.effect
        keys = [storage_key(k) for k, _ in effect.items]
        loaded = [False] * len(keys)
        if all(getattr(t.tier, "read_into", None) is not None or getattr(t.tier, "read_each", None) is not None
               for t in self._tiers):
            return self._read_each(job, effect, keys, loaded)
        # In batches of bounded bytes: a read of many large objects never holds them all at once.
        for batch in _batches(len(keys), effect.object_bytes or self.pool.slot_bytes):
            payloads: dict[int, memoryview] = {}
            for tier in self._tiers:
                todo = [i for i in batch if i not in payloads]
                if not todo or job.done:
                    break
                if not self._allowed(tier):
                    continue
                ok, blobs = self._call(job, tier, lambda: _read_many(tier.tier, [keys[i] for i in todo]), "read")
                if not ok:
                    continue
                for i, blob in zip(todo, blobs):
                    if blob is not None:
                        payload = self._open(tier, keys[i], blob, effect.object_bytes)
                        if payload is not None:
                            payloads[i] = payload
            with job.lock:
                if job.done:  # past its deadline: the slots may belong to another object already
                    return job.failed
                for i, payload in payloads.items():
                    slot = effect.items[i][1]
                    self.pool.write(slot, payload)
                    self._slot_nbytes[slot] = len(payload)
                    loaded[i] = True
        self.reads += len(keys)
        self.read_hits += sum(loaded)
        return L2ReadFinished(effect.read_id, tuple(loaded))

    def _read_each(self, job: _Effect, effect: ReadL2, keys: list[bytes], loaded: list[bool]) -> object:
        """``_do_read`` for tiers that hand each value over as it arrives: ``read_into`` (the
        value's payload is read straight into its slot and checked piece by piece as it lands,
        ``_fill_slot``) or ``read_each`` (a value in a reused buffer, checked, then copied into
        its slot). Either runs on the thread that read the value while the other connections
        keep reading; no value is held in a buffer of its own."""
        for tier in self._tiers:
            todo = [i for i, done in enumerate(loaded) if not done]
            if not todo or job.done:
                break
            if not self._allowed(tier):
                continue
            if getattr(tier.tier, "read_into", None) is not None:
                def on_stream(j: int, stream: Any, tier: _Tier = tier, todo: list[int] = todo) -> None:
                    if stream is not None:
                        self._fill_slot(job, effect, tier, todo[j], keys[todo[j]], stream, loaded)

                self._call(job, tier, lambda: self._read_into(job, tier, [keys[i] for i in todo], on_stream), "read")
                continue

            def on_value(j: int, blob: memoryview | None, tier: _Tier = tier, todo: list[int] = todo) -> None:
                if blob is None:
                    return
                i = todo[j]
                payload = self._open(tier, keys[i], blob, effect.object_bytes)
                if payload is None:
                    return
                try:
                    with job.lock:
                        if job.done:  # past its deadline: the slot may belong to another object
                            return
                        slot = effect.items[i][1]
                        self.pool.copy_in(slot, payload)
                        self._slot_nbytes[slot] = len(payload)
                        loaded[i] = True
                finally:
                    payload.release()

            limit = self.pool.slot_bytes + SEAL_HEADER_BYTES  # a larger value is never read whole
            self._call(job, tier, lambda: tier.tier.read_each([keys[i] for i in todo], on_value, limit), "read")
        with job.lock:
            if job.done:
                return job.failed
        self.reads += len(keys)
        self.read_hits += sum(loaded)
        return L2ReadFinished(effect.read_id, tuple(loaded))

    @staticmethod
    def _read_into(job: _Effect, tier: _Tier, keys: list[bytes], on_stream: Any) -> None:
        try:
            tier.tier.read_into(keys, on_stream)
        except Exception:
            if job.done:  # given up at its deadline (``_Abandoned``, or the tier failed since)
                return
            raise

    def _fill_slot(self, job: _Effect, effect: ReadL2, tier: _Tier, i: int, key: bytes, stream: Any,
                   loaded: list[bool]) -> None:
        """Reads one sealed value from ``stream`` into slot ``effect.items[i]``: the header into a
        small buffer (and checked), the payload straight into the slot, its MAC fed piece by
        piece (``READ_PIECE_BYTES``) while the rest arrives. The slot is written only under the
        effect's lock while it is unfinished (waiting for bytes happens outside the lock), and
        counts as loaded only once the whole payload matched its tag: a damaged, cut or forged
        value leaves bytes in a slot that is not loaded (core_sm frees it), never a hit."""
        if stream.size < SEAL_HEADER_BYTES:
            self._reject(tier, key, Rejection.SHORT.value, delete=True)
            return
        header = memoryview(bytearray(SEAL_HEADER_BYTES))
        stream.read_exact(header)
        assert self._sealer is not None
        opening = self._sealer.opening(key, header, stream.size)
        if isinstance(opening, Rejection):
            self._reject(tier, key, opening.value, delete=True)
            return
        size = opening.size
        reason = self._size_refused(size, effect.object_bytes)
        if reason is not None:
            self._reject(tier, key, reason, delete=False)
            return
        slot = effect.items[i][1]
        view = self.pool.view(slot, size)
        try:
            have = hashed = 0
            while have < size:
                stream.wait()  # outside the lock: the deadline watcher is never held up by a socket
                with job.lock:
                    if job.done:  # past its deadline: the slot may belong to another object
                        raise _Abandoned()
                    have += stream.read_some(view[have:])
                if have - hashed >= READ_PIECE_BYTES or have == size:
                    opening.update(view[hashed:have])  # still in cache; other threads run meanwhile
                    hashed = have
            if not opening.verify():
                self._reject(tier, key, Rejection.FORGED.value, delete=True)
                return
            with job.lock:
                if job.done:
                    raise _Abandoned()
                self._slot_nbytes[slot] = size
                loaded[i] = True
        finally:
            view.release()

    def _size_refused(self, size: int, object_bytes: int) -> str | None:
        """Why a sealed payload of ``size`` bytes is not served (None: it is). ``object_bytes``:
        the size core_sm expects, exact when it is below the slot size (core_sm answers the slot
        size when no registered instance tells it the model's object size)."""
        if 0 < object_bytes < self.pool.slot_bytes and size != object_bytes:
            return "wrong_size"
        if size > self.pool.slot_bytes:
            return "too_big"
        return None

    def _open(self, tier: _Tier, key: bytes, blob: bytes | memoryview, object_bytes: int) -> memoryview | None:
        """The payload of a tier's value, or None (a counted rejection)."""
        assert self._sealer is not None
        payload = self._sealer.open(key, blob)
        if isinstance(payload, Rejection):
            self._reject(tier, key, payload.value, delete=True)
            return None
        reason = self._size_refused(len(payload), object_bytes)
        if reason is None:
            return payload
        payload.release()
        self._reject(tier, key, reason, delete=False)
        return None

    def _reject(self, tier: _Tier, key: bytes, reason: str, *, delete: bool) -> None:
        """Counts and logs a refused value. ``delete``: a damaged or forged one is dropped from
        the tier where it allows; one sealed with the secret, only not the size this reader
        expects (another registration of the model, or a forged size), is kept for its own
        readers."""
        self._count("l2_rejected")
        self._count(f"l2_rejected_{reason}")
        self._note_rejection(tier, key, reason)
        if not delete:
            return
        remove = getattr(tier.tier, "delete", None)
        if remove is not None:
            try:
                remove(key)
            except Exception as e:
                log.debug("deleting rejected L2 object %r from %r: %s", key, tier, e)

    def _note_rejection(self, tier: _Tier, key: bytes, reason: str) -> None:
        now = self.clock()
        with self._lock:
            self._rejects_pending[reason] += 1
            if now - self._rejects_logged_at < self.options.reject_log_interval_s:
                return
            self._rejects_logged_at = now
            summary = ", ".join(f"{n} {r}" for r, n in sorted(self._rejects_pending.items()))
            self._rejects_pending.clear()
        log.warning("L2: rejected objects (served as misses; damaged or forged ones deleted where the tier "
                    "allows, those of another size kept): %s; latest %s on %r (next report in %.0f s at most)",
                    summary, key.decode("ascii", "replace"), tier, self.options.reject_log_interval_s)

    def _do_write(self, job: _Effect) -> object:
        """Tiers with ``write_parts`` (Redis) get every object in one call, each sent from its
        slot behind a seal header (``_write_parts``); the others get sealed copies in batches of
        at most ``BATCH_BYTES``, copied out of the slots under the effect's lock."""
        effect, sizes = job.effect
        assert self._sealer is not None
        keys = [storage_key(k) for k, _ in effect.items]
        streamed_ok = True
        copied: list[_Tier] = []
        for tier in self._tiers:
            if getattr(tier.tier, "write_parts", None) is None:
                copied.append(tier)
                continue
            if job.done:
                return job.failed
            if not self._allowed(tier):
                self._count("l2_writes_skipped")
                streamed_ok = False
                continue
            done, _ = self._call(job, tier, lambda: self._write_parts(job, tier, effect, keys, sizes), "write")
            streamed_ok = streamed_ok and done
        ok = streamed_ok
        for batch in _batches(len(sizes), max(sizes, default=0)):
            batch_ok = streamed_ok
            if copied:
                with job.lock:  # copy out of the slots while the effect still pins them
                    if job.done:
                        return job.failed
                    sealed = [(keys[i], self._sealer.seal(keys[i], self.pool.view(effect.items[i][1], sizes[i])))
                              for i in batch]
            for tier in copied:
                if job.done:
                    return job.failed
                if not self._allowed(tier):
                    self._count("l2_writes_skipped")
                    batch_ok = False
                    continue
                done, _ = self._call(job, tier, lambda: _write_many(tier.tier, sealed), "write")
                batch_ok = batch_ok and done
            ok = ok and batch_ok
            # l2_writes: objects every tier took; the others are l2_writes_failed
            if batch_ok:
                self.writes += len(batch)
            else:
                with self._lock:
                    self.counts["l2_writes_failed"] += len(batch)
        with job.lock:
            if job.done:
                return job.failed
        return L2WriteFinished(effect.write_id, ok)

    def _write_parts(self, job: _Effect, tier: _Tier, effect: WriteL2, keys: list[bytes], sizes: list[int]) -> None:
        """One ``write_parts`` of every object of a write: each sealed (its MAC over the slot)
        on the connection's thread just before it is sent, header then the slot's bytes, never
        copied; the slot is read only under the effect's lock while it is unfinished, so a write
        past its deadline stops (its connection dropped, the cut value never stored)."""
        assert self._sealer is not None
        sealer = self._sealer

        @contextlib.contextmanager
        def guard() -> Iterator[None]:
            with job.lock:
                if job.done:
                    raise _Abandoned()
                yield

        def sealed(i: int) -> Callable[[], Sequence[bytes | memoryview]]:
            def make() -> Sequence[bytes | memoryview]:
                with guard():
                    view = self.pool.view(effect.items[i][1], sizes[i])
                    return (sealer.seal_header(keys[i], view), view)
            return make

        try:
            tier.tier.write_parts([(keys[i], sealed(i)) for i in range(len(keys))], guard)
        except Exception:
            if job.done:  # given up at its deadline: reported already
                return
            raise

    # -- observability and shutdown ----------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "l2_in_flight": self.in_flight,
            "l2_queued": len(self._urgent) + len(self._writes),
            "l2_reads": self.reads,
            "l2_read_hits": self.read_hits,
            "l2_writes": self.writes,
            "l2_errors": self.errors,
            "l2_tiers_open": sum(t.breaker.state is not BreakerState.CLOSED for t in self._tiers),
        }
        for name in ("l2_writes_failed", "l2_writes_dropped", "l2_reads_refused", "l2_probes_refused", "l2_deadline_expired",
                     "l2_breaker_opened", "l2_tier_skipped", "l2_writes_skipped", "l2_rejected"):
            out[name] = self.counts.get(name, 0)
        for name, n in self.counts.items():
            if name.startswith("l2_rejected_"):
                out[name] = n
        # files a tier refused before the seal is checked (the disk tier's header and key checks)
        for reason in ("header", "key"):
            out[f"l2_tier_rejected_{reason}"] = 0
        for t in self._tiers:
            rejected = getattr(t.tier, "rejected", None)  # a plain dict: no lock, no I/O on the loop
            if isinstance(rejected, dict):
                for reason in ("header", "key"):
                    count = rejected.get(reason)
                    if isinstance(count, int):
                        out[f"l2_tier_rejected_{reason}"] += count
        return out

    def tier_states(self) -> list[dict[str, Any]]:
        """Per tier: its name and breaker state, and a cluster tier's per-node states (for
        ``health``)."""
        out: list[dict[str, Any]] = []
        for t in self._tiers:
            state: dict[str, Any] = {"tier": redact(repr(t)), "state": t.breaker.state.value}
            nodes = getattr(t.tier, "node_states", None)
            if callable(nodes):  # a cluster tier: each node's breaker too
                state["nodes"] = nodes()
            out.append(state)
        return out

    def close(self) -> None:
        # Close the tiers first: a call stuck in a tier then fails (and is reported) instead of
        # holding the shutdown. Queued effects are reported failed.
        with self._cond:
            if self._closed:
                return
            self._closed = True
            queued = list(self._urgent) + list(self._writes)
            self._urgent.clear()
            self._writes.clear()
            self._cond.notify_all()
        for job in queued:
            self._finish(job, job.failed)
        for t in self._tiers:
            try:
                t.tier.close()
            except Exception:
                log.exception("closing L2 tier %r", t)
        for thread in self._threads:
            thread.join()


# Bytes of objects one tier call moves at most (the batch is at least one object).
BATCH_BYTES = 64 << 20
# A value read into its slot has its MAC fed in pieces of this many bytes, each while it is still
# in the CPU's cache and while the socket keeps filling.
READ_PIECE_BYTES = 1 << 20


class _Abandoned(Exception):
    """A read given up at its deadline while a value was arriving: stop writing its slots."""


def _batches(n: int, item_bytes: int) -> list[list[int]]:
    per = max(1, BATCH_BYTES // max(1, item_bytes))
    return [list(range(i, min(n, i + per))) for i in range(0, n, per)]


def _read_many(tier: Any, keys: list[bytes]) -> list[Any]:
    many = getattr(tier, "read_many", None)
    if many is not None:
        return list(many(keys))
    return [tier.read(k) for k in keys]


def _write_many(tier: Any, items: list[tuple[bytes, bytes]]) -> None:
    many = getattr(tier, "write_many", None)
    if many is not None:
        many(items)
        return
    for k, v in items:
        tier.write(k, v)


def _contains_many(tier: Any, keys: list[bytes]) -> list[bool]:
    many = getattr(tier, "contains_many", None)
    if many is not None:
        return [bool(x) for x in many(keys)]
    return [bool(tier.contains(k)) for k in keys]
