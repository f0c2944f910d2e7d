"""A simulated vLLM engine: vLLM's scheduler (``mpcache.sim.vllm_scheduler.SchedulerModel``: waiting
queue, block pool, prefix-cache hits, async loads, preemption, recompute, finish -- the model the
adapter tests drive the production connector with) on one scheduler node that runs core_sm's
``StepPlanner`` -- the class ``MPCacheConnector`` drives -- and `tp` worker nodes (one
TransferClient per server each). Every protocol decision (loadable tokens, lease ranges,
retrieve and store ranges, recompute after preemption) is the planner's; this file only calls
it in vLLM's order and checks the outcome. What its machines send travels through each node's
links (``sim/transport.py``: core_sm's ``ServerLink`` per server), which hand the replies back.

Per request, in vLLM's call order (reference/vllm_connector.md)::

    arrive -> waiting; each scheduler step: MatchRequest -> None (ask again next step) | tokens
    allocate blocks (wait while the pool is short; vLLM asks again meanwhile) -> BlocksAllocated
    end of step: StepScheduled -> StepPlan: its retrieves go to the workers, each to its rank's
    server (core_sm's placement, ``client_config.server_for_rank``, as the connector's workers)
    load reported in recving -> verify every loaded block's checksum; load errors are recomputed;
    BlocksAllocated again (vLLM's second update_state_after_alloc) -> compute
    computed: StepScheduled with the request -> its stores go to each rank's server -> decode
    finish: RequestFinished + EngineFinished (or Abort) -> every worker reports it in sending
    -> blocks freed -> done

Aborts (before allocation, while loading, while computing) and preemption (blocks freed,
recompute from scratch) follow the same calls vLLM makes. Worker memory is a dict of block id ->
value, so every copy is checked end to end: a value is a function of (chunk hash, rank, block,
KV-cache group).

Several KV-cache groups (``WorldConfig.kv_groups``, ``sim/groups.py``): the planner runs with
them (and ``cpu_engine``), each group has its own block table in the scheduler model, and a
worker copies each group's blocks of an op (``kv_groups.split_group_blocks``) into or out of
its part of the chunk's object, a retrieve skipping a window's blocks before
``kv_groups.group_retrieve_skip`` as production's worker does. A load failed by request id
(``failed_retrieves``: vLLM cannot map block ids of several groups) recomputes the request.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from mpcache.core_sm.chunks import ChunkChain, ObjectKey
from mpcache.core_sm.client_config import server_for_rank
from mpcache.core_sm.effects import CopyBlocks, SendRequest
from mpcache.core_sm.keys import NO_EXTRAS, KeyExtras
from mpcache.core_sm.kv_groups import several
from mpcache.core_sm.lookup_client import LookupState
from mpcache.core_sm.messages import (
    Abort,
    CopyFinished,
    EngineFinished,
    ServerHealth,
    SubmitRetrieve,
    TransferKind,
)
from mpcache.core_sm.planner import (
    BlocksAllocated,
    MatchAnswer,
    MatchRequest,
    RequestFinished,
    ScheduledRequest,
    StepPlan,
    StepPlanner,
    StepScheduled,
)
from mpcache.runtime_trio import Node
from mpcache.sim import checks
from mpcache.sim.groups import group_copies, partial_restore, unrestorable_hit
from mpcache.sim.ports import WorldPort
from mpcache.sim.scenario import RequestSpec, sched_name, worker_name
from mpcache.sim.transport import EngineTransport
from mpcache.sim.vllm_scheduler import NULL_BLOCK, Admission, QueuedRequest, SchedulerModel

MODEL = "sim-model"
SCHEDULER_CALLS = (MatchRequest, BlocksAllocated, StepScheduled, RequestFinished)
RUNNING = ("loading", "computing", "decoding")  # requests that count against max_running
SYNC = -1  # SimEngine.paused_at: the step's forward waits for its synchronous loads
LOOKUP = "lookup"
GROUP_SHIFT = 62  # a block value's KV-cache group: value + (group << GROUP_SHIFT)


def tc_name(server: int) -> str:
    return f"tc{server}"


@attrs.define
class SimRequest:
    spec: RequestSpec
    rid: str
    tokens: tuple[int, ...]
    hashes: tuple[bytes, ...]
    state: str = "pending"  # pending, waiting, loading, computing, finishing, done
    outcome: str = ""
    done: bool = False
    polls: int = 0
    lm_hit: int | None = None  # the planner's lookup result, for coverage stats
    vllm_hit: int = 0  # the engine's prefix-cache hit (num_computed_tokens at the match)
    external: int = 0  # the tokens the planner said would be loaded
    retrieve: SubmitRetrieve | None = None  # the plan's retrieve, checked when it lands
    retrieves_planned: int = 0
    loads_pending: set[int] = attrs.Factory(set)
    load_errors: set[tuple[int, int]] = attrs.Factory(set)  # (rank, block id)
    q: QueuedRequest | None = None  # the request as the scheduler model tracks it
    compute_done_at: float = 0.0
    preempted: bool = False
    sync: bool = False  # a synchronous load (vLLM schedules it in the step; the forward waits for it)
    abort_armed: bool = False  # the abort timed to an operation in flight is scheduled
    unresolved: bool = False  # the last check() answered None
    # the earliest lease expiry of the hit at its load servers when last seen held, with the
    # servers' incarnations (SimEngine._incarnations) and the world's clear count then
    lease_seen: tuple[float, int, int] | None = None
    arrived_at: float = 0.0
    finished_at: float = 0.0

    @property
    def queued(self) -> QueuedRequest:
        assert self.q is not None
        return self.q

    @property
    def blocks(self) -> list[int] | None:
        """Its blocks (None: it holds none)."""
        return self.queued.blocks or None

    @property
    def finishing(self) -> set[Any]:
        """The (rank, server) pairs yet to report it in sending."""
        return self.queued.unsent


class SimWorker:
    def __init__(self, engine: SimEngine, rank: int) -> None:
        self.engine = engine
        self.rank = rank
        self.name = worker_name(engine.index, rank)
        self.instance_id = engine.index * 16 + rank + 1
        self.node: Node | None = None
        self.blocks: dict[int, int] = {}
        self.alive = True

    # ---- copies (called by the server's transfer executor and by CopyBlocks) -------------
    def copy(self, host: Any, rid: str, kind: TransferKind, start: int, end: int,
             placements: tuple[tuple[int, int], ...], block_ids: tuple[int, ...], skip: int, what: str) -> bool:
        """Run one copy between this worker's blocks and ``host``'s slots, choosing chunks and
        blocks with core_sm's ``chunk_copies``, group by group (``groups.group_copies``, as the
        production copiers do). False: the plan does not match its blocks (production logs it and
        reports the copy failed)."""
        engine = self.engine
        groups = engine.groups
        try:
            # one part per KV-cache group, group after group in the op and in the object
            part_copies = group_copies(groups, kind, start, end, placements, block_ids, skip, engine.C, engine.bs,
                                       engine.world.profile.retrieve_first_group_only)
        except ValueError:
            return False
        if several(groups):  # the blocks copied: a window's null blocks are not the request's
            block_ids = tuple(b for copies in part_copies for copy in copies
                              for b in copy.block_ids[copy.skip_blocks if kind is TransferKind.RETRIEVE else 0:])
        engine.check_blocks(self, rid, block_ids, kind is TransferKind.RETRIEVE, what)
        req = engine.requests.get(rid)
        for chunk, slot in placements:
            if req is not None and chunk < len(req.hashes):
                engine.world.check_slot_target(host, slot, ObjectKey(req.hashes[chunk], self.rank), what)
        per_part = engine.C // engine.bs
        if kind is TransferKind.STORE:
            stored: dict[int, list[int]] = {}
            for copies in part_copies:
                for copy in copies:
                    stored.setdefault(copy.slot, []).extend(self.blocks.get(b, -1) for b in copy.block_ids)
            for copies in part_copies[:1]:
                for copy in copies:
                    host.slots[copy.slot] = tuple(stored[copy.slot])
                    engine.world.note_written(rid, copy.chunk, self.rank)
        else:
            for g, copies in enumerate(part_copies):
                for copy in copies:
                    data = host.slots.get(copy.slot)
                    for j in range(copy.skip_blocks, len(copy.block_ids)):
                        self.blocks[copy.block_ids[j]] = data[g * per_part + j] if data is not None else -3
        return True


class SimEngine:
    def __init__(self, world: WorldPort, index: int) -> None:
        self.world = world
        self.index = index
        cfg = world.config
        self.cfg = cfg
        self.C = cfg.chunk_size
        self.bs = cfg.block_size
        self.tp = cfg.tp
        self.num_servers = cfg.num_servers
        self.sched: Node | None = None
        self.workers = [SimWorker(self, r) for r in range(cfg.tp)]
        self.groups = cfg.kv_groups
        # vLLM sizes its pool by the memory every group's layers take: a block per group
        self.model = SchedulerModel(_PlannerCalls(self), cfg.block_size,
                                    cfg.blocks_per_worker * max(1, len(self.groups)) + several(self.groups),
                                    cfg.max_running, self.groups)
        self.requests: dict[str, SimRequest] = {}
        self.order: list[SimRequest] = []
        self.crashed = False
        self.step_scheduled = False
        # vLLM's scheduler blocked inside a step: waiting for a lookup's answer (the planner's
        # lookup_wait; the index of the request to ask again) or for its synchronous loads (SYNC)
        self.paused_at: int | None = None
        self.lookup_wait_until: float | None = None
        self.pause_token = 0
        self.step_wanted = False
        self.sync_waiting: set[str] = set()
        # requests a scripted world keeps waiting (``hold``): the pool is short for them, as when
        # other work holds vLLM's blocks; each step asks the connector again and allocates nothing
        self.held: set[str] = set()
        self.transport = EngineTransport(world, self)  # core_sm's ServerLink per server, on each node
        self.delivered_hits: dict[tuple[str, int], int] = {}
        self.reported: dict[tuple[int, int, str], set[str]] = {}
        self.lookup_results: dict[str, int] = {}
        self.f2_watch: set[str] = set()
        root_cache: dict[str, bytes] = {}
        chain = ChunkChain(cfg.chain_key)  # the world's servers hash with the same key
        for spec in world.scenario.requests:
            if spec.engine != index:
                continue
            salt = spec.cache_salt
            try:
                root = root_cache.setdefault(salt, chain.root(MODEL, self.tp, salt))
            except ValueError:
                root = chain.root(MODEL, self.tp, "")
            hashes = chain.hashes(spec.prompt, self.C, root)
            req = SimRequest(spec, spec.request_id, spec.prompt, hashes)
            req.q = self.model.add(QueuedRequest(spec.request_id, list(spec.prompt), spec.apc_blocks, spec.cache_salt,
                                                 max_load_tokens=spec.max_load_tokens))
            self.requests[spec.request_id] = req
            self.order.append(req)

    # =========================================================================== setup
    async def start(self) -> None:
        w = self.world
        profile = w.profile
        sched = w.make_node(sched_name(self.index), {LOOKUP: profile.make_planner(self.cfg)},
                            self._interpret)
        self.sched = sched
        await w.start_node(sched)
        self.transport.add_node(sched.name, {s: [LOOKUP] for s in range(self.num_servers)})
        for worker in self.workers:
            machines = {tc_name(s): profile.make_transfer_client(self.cfg, worker.rank, worker.instance_id, s)
                        for s in range(self.num_servers)}
            node = w.make_node(worker.name, machines, self._interpret)
            worker.node = node
            await w.start_node(node)
            self.transport.add_node(node.name, {s: [tc_name(s)] for s in range(self.num_servers)})
            for s in range(self.num_servers):
                self.call(node, tc_name(s), ServerHealth(s, True))

    def schedule_workload(self) -> None:
        for req in self.order:
            t = self.world.t0 + req.spec.arrival
            self.world.timeline.at(t, self._arrive, req)
            if req.spec.abort_after is not None:
                self.world.timeline.at(t + req.spec.abort_after, self.abort, req)

    def call(self, node: Node, machine: str, event: Any) -> list[Any]:
        """A synchronous call from vLLM into a machine (as the connector does), then re-arm."""
        effects = node.step(machine, event)
        self.world.arm_timer(node, node.next_deadline())
        return effects

    # =========================================================================== effects
    def _interpret(self, node: Node, machine: str, effect: Any) -> None:
        t = type(effect)
        if t is MatchAnswer or t is StepPlan:
            return  # the planner's answers: read by the caller from the call's effects
        if t is SendRequest:
            self.transport.submit(node, machine, effect)
        elif t is CopyBlocks:
            worker = self.workers[int(node.name.split(".")[1])]
            server = int(machine[2:])
            delay = self.world.latency(self.cfg.copy_latency_mean)
            self.world.timeline.after(delay, self._finish_copy, worker, machine, server,
                                      self.world.servers[server].incarnation, effect)
        else:
            self.world.violation("SAFETY", node.name, f"client emitted an unknown effect {effect!r}")

    def _finish_copy(self, worker: SimWorker, machine: str, server: int, incarnation: int,
                     effect: CopyBlocks) -> None:
        if not worker.alive or worker.node is None:
            return
        host = self.world.servers[server]
        ok = self.world.exec_rng.random() >= self.cfg.copy_fail_p
        if host.incarnation != incarnation or not host.up:
            ok = False  # the shared-memory segment went away with the server
        if ok:
            ok = worker.copy(host, effect.op[0], effect.direction, effect.start, effect.end, effect.placements,
                             effect.block_ids, effect.skip_first_n_tokens, f"engine {effect.direction.value} copy {effect.op}")
        if not ok:
            self.world.stats["copy_fail"] += 1
        worker.node.post(machine, CopyFinished(effect.op, ok))

    def reply_arrived(self, node: Node, machine: str, server: int, about: tuple[str | None, str] | None,
                      result: Any) -> None:
        """F2's bookkeeping as a result reaches a machine (``about``: the request it answers): a
        status answer that reaches a lookup still waiting for this server must count."""
        if about is not None and machine == LOOKUP and about[1] in ("QueryPrefetchStatus", "WaitPrefetchStatus"):
            rid = about[0]
            client = node.machines[LOOKUP].lookups
            pending = client.pending(rid) if rid is not None and client.state(rid) is not LookupState.DONE else None
            leg = pending.legs.get(server) if pending is not None else None
            if (rid is not None and isinstance(result, int) and not isinstance(result, bool)
                    and leg is not None and leg.chunks is None):
                # The answer reached a lookup still waiting for this server: it must count.
                hit_key = (rid, server)
                self.delivered_hits[hit_key] = max(self.delivered_hits.get(hit_key, 0), result)
                self.f2_watch.add(rid)

    def observe(self, node: Node, machine: str, event: Any, effects: list[Any]) -> None:
        machine_obj = node.machines[machine]
        try:
            machine_obj.check_invariants()
        except AssertionError as exc:
            self.world.violation("SAFETY", node.name, f"core_sm {machine} invariant: {exc}")
        if type(event) not in SCHEDULER_CALLS:
            # Something arrived that a step may act on; the scheduler's own calls are made by a
            # step, which acts on their answers itself.
            self._ensure_step()
            if self.paused_at is not None and (machine == LOOKUP) == (self.paused_at != SYNC):
                # the blocked scheduler wakes on it (a lookup reply; a worker's op moving)
                self.world.timeline.after(0.0, self._resume, self.pause_token)
        if machine == LOOKUP and self.f2_watch:
            lookups = machine_obj.lookups
            for rid in sorted(self.f2_watch):
                state = lookups.state(rid)
                if state is LookupState.DONE:
                    self.f2_watch.discard(rid)
                    self._check_resolution(rid, lookups.pending(rid))
                elif state is LookupState.ABSENT:
                    self.f2_watch.discard(rid)

    def stop_heartbeats(self) -> None:
        """The engine shuts down, as the connector's ``close`` does: its transport unregisters each
        live worker's instance at its servers and closes every link (``EngineTransport.shut_down``)."""
        self.transport.shut_down([(w.name, w.instance_id) for w in self.workers if w.alive])

    # =========================================================================== workload
    def _arrive(self, req: SimRequest) -> None:
        if self.crashed:
            return
        req.state = "waiting"
        req.arrived_at = self.world.now()
        self._ensure_step()

    def _ensure_step(self) -> None:
        if self.paused_at is not None:
            self.step_wanted = True  # the scheduler is blocked inside a step: the next one after it
            return
        if not self.step_scheduled and not self.crashed:
            self.step_scheduled = True
            # Steps fall on the engine's step grid, as vLLM's scheduler loop does.
            now = self.world.now()
            grid = self.cfg.step_interval
            self.world.timeline.at((int(now / grid) + 1) * grid, self._step)

    def _step(self) -> None:
        """One scheduler step. Steps are scheduled only after something happened (an event on a
        client machine, an arrival, a finished compute, freed blocks): a step with nothing new to
        see would do nothing, and skipping it keeps seeds cheap."""
        self.step_scheduled = False
        if self.crashed:
            return
        if self.paused_at is not None:
            self.step_wanted = True
            return
        self._collect_worker_reports()
        self._pass(0)

    def _pass(self, start: int) -> None:
        """The scheduling pass of a step from the ``start``-th request on, then its plan."""
        now = self.world.now()
        running = self.model.running()
        for i in range(start, len(self.order)):
            req = self.order[i]
            st = req.state
            if st == "waiting":
                self._note_leases(req)
                self._schedule_waiting(req, running)
                if self.lookup_wait_until is not None:
                    # the connector waits for the lookup's answer, then vLLM asks it again
                    self._pause(i, self.lookup_wait_until)
                    return
                running += req.state in RUNNING
            elif st == "computing" and now >= req.compute_done_at:
                self._compute_and_store(req)
        sync = self._build_plan()
        if sync and self._sync_pending(sync):
            self.sync_waiting = set(sync)
            self._pause(SYNC, None)
            return
        if sync:
            self._sync_landed(sync)  # done already (failed at once): read at the next step's reports
        self._end_pause()

    def _pause(self, at: int, until: float | None) -> None:
        what = "sync_load_waits" if at == SYNC else "lookup_waits"
        self.world.stats[what] = self.world.stats.get(what, 0) + 1
        self.paused_at = at
        self.lookup_wait_until = None
        self.pause_token += 1
        if until is not None:
            self.world.timeline.at(until, self._resume, self.pause_token)

    def _end_pause(self) -> None:
        self.paused_at = None
        if self.step_wanted:
            self.step_wanted = False
            self._ensure_step()

    def _resume(self, token: int) -> None:
        """A reply reached the blocked scheduler, or its wait ran out: go on with the step."""
        if token != self.pause_token or self.paused_at is None or self.crashed:
            return
        at = self.paused_at
        if at == SYNC:
            if self._sync_pending(self.sync_waiting):
                return
            self._sync_landed(self.sync_waiting)
            self.sync_waiting = set()
            self._collect_worker_reports()  # the synchronous loads landed (or failed into load errors)
            self._end_pause()
            return
        self.paused_at = None
        self._pass(at)

    def _sync_pending(self, ids: Iterable[str]) -> bool:
        """Whether a worker's transfer machine still loads one of the step's synchronous loads
        (the worker adapter's wait in ``submit_retrieves``)."""
        ids = tuple(ids)
        return any(w.node.machines[tc_name(s)].loading(ids) for w in self.workers if w.node is not None and w.alive
                   for s in range(self.num_servers))

    def _sync_landed(self, ids: Iterable[str]) -> None:
        """The step's synchronous loads are done on every rank (copied, or failed into load
        errors): vLLM's forward reads them now. No recving reports them."""
        for rid in ids:
            req = self.requests.get(rid)
            if req is not None and req.state == "loading":
                req.loads_pending.clear()

    def planner(self) -> StepPlanner:
        assert self.sched is not None
        machine: StepPlanner = self.sched.machines[LOOKUP]
        return machine

    def _schedule_waiting(self, req: SimRequest, running: int) -> None:
        """vLLM's waiting queue: the scheduler model asks the connector, allocates, tells it."""
        assert self.sched is not None
        admitted = self.model.admit(req.queued, running, short=req.rid in self.held)
        if admitted is Admission.FULL:
            return  # vLLM's scheduler is full: it does not reach the request this step
        if admitted is Admission.PENDING:
            req.polls += 1
            req.unresolved = True
            self._arm_abort_in_flight(req, "lookup")
            return
        req.unresolved = False
        tracker = self.planner().tracker(req.rid)
        if tracker is not None and req.rid not in self.lookup_results and tracker.hit_tokens is not None:
            self.lookup_results[req.rid] = tracker.hit_tokens
            req.lm_hit = tracker.hit_tokens
        if admitted is Admission.NO_BLOCKS:
            return  # vLLM keeps the request waiting and asks again next step
        req.vllm_hit, req.external = req.queued.engine_hit, req.queued.external
        self._compute_blocks(req, 0, req.vllm_hit // self.bs)
        if not req.preempted:  # a resumed request's leases were accounted at its first allocation
            self._check_leases_accounted(req)
        if admitted is Admission.LOADING or admitted is Admission.SYNC_LOAD:
            # WAITING_FOR_REMOTE_KVS: runnable once every rank reported the load in recving; a
            # synchronous one is scheduled in this step, whose forward waits for the load
            req.sync = admitted is Admission.SYNC_LOAD
            req.retrieve = None
            req.loads_pending = {w.rank for w in self.workers}
            req.state = "loading"
            self._arm_abort_in_flight(req, "load")
        else:
            self._start_compute(req)

    def hold(self, req: SimRequest) -> None:
        """A scripted world's choice: from the next step on, ``req`` waits for blocks (vLLM's
        pool short: other requests hold it), asked about at every step, until ``unhold``."""
        self.held.add(req.rid)

    def unhold(self, req: SimRequest) -> None:
        """Blocks for ``req`` again: the next step allocates it if it still waits."""
        self.held.discard(req.rid)
        self._ensure_step()

    def _arm_abort_in_flight(self, req: SimRequest, what: str) -> None:
        """The scenario's abort timed to an operation in flight (``RequestSpec.abort_on``)."""
        if req.spec.abort_on == what and not req.abort_armed:
            req.abort_armed = True
            self.world.timeline.after(req.spec.abort_delay, self.abort, req)

    def _check_leases_accounted(self, req: SimRequest) -> None:
        """F8 at allocation: every token range of the hit is either read by the planned retrieve
        or has its read leases freed at once -- a lease nobody will read must not wait for the
        request's END_SESSION (a long decode, a deep queue)."""
        tracker = self.planner().tracker(req.rid)
        if tracker is None:
            return
        retrieve = tracker.pending_retrieve
        finding = checks.leases_unaccounted(req.rid, tracker.hit_tokens, tracker.leases_freed,
                                            None if retrieve is None else (retrieve.start, retrieve.end))
        if finding is not None:
            assert self.sched is not None
            self.world.violation(finding[0], self.sched.name, finding[1])

    def store_server(self, rank: int) -> int:
        """The server ``rank`` stores to: production's placement (core_sm.client_config)."""
        return server_for_rank(rank, self.tp, self.num_servers)

    def load_server(self, rank: int, req: SimRequest) -> int:
        """The server ``rank`` loads ``req`` from: production's placement, unless a legacy
        profile's rule says otherwise."""
        server: int = self.world.profile.load_server(rank, self.tp, self.num_servers, req.rid)
        return server

    def _incarnations(self) -> int:
        """A number that changes whenever one of the engine's servers restarts (each one's
        incarnation only grows)."""
        return sum(host.incarnation for host in self.world.servers)

    def _leases(self, req: SimRequest, start: int, end: int) -> tuple[float | None, bool] | None:
        """The earliest expiry of ``req``'s read leases on chunks ``[start, end)`` (tokens) of
        every rank at the server it loads that rank from, and whether it holds all of them
        (None: one of those servers is down)."""
        indexes = []
        for rank in range(self.tp):
            host = self.world.servers[self.load_server(rank, req)]
            if not host.up or host.node is None:
                return None
            indexes.append(host.node.machines["server"].index)
        return checks.lease_span(indexes, req.hashes, start // self.C, end // self.C, sched_name(self.index), req.rid)

    def _note_leases(self, req: SimRequest) -> None:
        """Remember when the leases of a waiting request's answered lookup expire (the server
        forgets an expired lease; the F20 check must know it expired)."""
        lookups = self.planner().lookups
        if lookups.state(req.rid) is not LookupState.DONE:
            return
        pending = lookups.pending(req.rid)
        hit = 0 if pending is None else pending.result_tokens or 0
        seen = self._leases(req, 0, hit) if hit else None
        if seen is not None and seen[1] and seen[0] is not None:
            req.lease_seen = (seen[0], self._incarnations(), self.world.stats["clears"])

    def _check_retrieve_leases(self, req: SimRequest, op: SubmitRetrieve) -> None:
        """F20: a planned load reads through read leases its request still holds at the server.
        A request that waited in the queue longer than its leases live must renew them first or
        recompute: once they expired, the objects may be evicted and the hit is a load error."""
        seen = self._leases(req, op.start, op.end)
        if seen is None:
            return
        earliest, held = seen
        now = self.world.now()
        last = req.lease_seen
        last_seen = last[0] if last is not None and (last[1], last[2]) == (
            self._incarnations(), self.world.stats["clears"]) else None
        finding = checks.retrieve_on_expired_leases(req.rid, op.start, op.end, now, now - req.arrived_at,
                                                    self.cfg.lease_ttl, earliest, held, last_seen)
        if finding is not None:
            assert self.sched is not None
            self.world.violation(finding[0], self.sched.name, finding[1])

    def _build_plan(self) -> tuple[str, ...]:
        """vLLM's build_connector_meta at the end of the step; the workers run the plan. Returns
        the plan's synchronous loads."""
        if self.sched is None or not self.sched.alive:
            return ()
        plan = self.model.end_step()
        for op in plan.retrieves:
            req = self.requests.get(op.request_id)
            if req is None or req.state != "loading" or req.retrieve is not None:
                self.world.violation("SAFETY", self.sched.name, f"plan retrieves {op.request_id} in state "
                                     f"{req and req.state}")
                continue
            req.retrieve = op
            req.retrieves_planned += 1
            self._check_retrieve_leases(req, op)
            if req.retrieves_planned > 1:
                # One lookup leases the hit once: the first load used those leases (or the first
                # allocation freed them); a second load reads chunks nothing holds for it.
                again = checks.load_planned_again(op.request_id, op.start, op.end, req.preempted)
                self.world.violation(again[0], self.sched.name, again[1])
            self._check_placement(req)
            for w in self.workers:
                assert w.node is not None
                self.call(w.node, tc_name(self.load_server(w.rank, req)), op)
        for store in plan.stores:
            for w in self.workers:
                assert w.node is not None
                self.call(w.node, tc_name(self.store_server(w.rank)), store)
        for rid in plan.sync_loads:
            req = self.requests.get(rid)
            if req is None or not req.sync:
                self.world.violation("SAFETY", self.sched.name, f"plan loads {rid} synchronously, answered async")
        return plan.sync_loads

    def _check_placement(self, req: SimRequest) -> None:
        """F2: each rank loads its hit from the server that answered it for that rank (the
        lookup's ranks per server, where the hit is leased); loaded from another server, the
        hit is lost (a load error at best, the leases at the right server left to the TTL)."""
        rps = self.planner().lookups.config.ranks_per_server
        for rank in range(self.tp):
            finding = checks.misplaced_load(req.rid, rank, self.load_server(rank, req), rps)
            if finding is not None:
                assert self.sched is not None
                self.world.violation(finding[0], self.sched.name, finding[1])

    def _check_resolution(self, rid: str, pending: Any) -> None:
        """F2: a hit the server answered, received while the client still waited for that server,
        must not turn into less."""
        if rid in self.world.touched:
            return
        message = checks.lost_hit(rid, pending.legs, self.delivered_hits, pending.result_tokens)
        if message is not None:
            self.world.violation("F2", sched_name(self.index), message)

    def _start_compute(self, req: SimRequest) -> None:
        req.state = "computing"
        req.compute_done_at = self.world.now() + self.cfg.compute_time
        self.world.timeline.at(req.compute_done_at, self._ensure_step)

    def _collect_worker_reports(self) -> None:
        for w in self.workers:
            if w.node is None or not w.alive:
                continue
            errors_all: set[int] = set()
            failed: set[str] = set()
            for s in range(self.num_servers):
                tc = w.node.machines[tc_name(s)]
                sending, recving = tc.finished()
                errors = tc.load_errors()
                if several(self.groups):
                    failed |= tc.failed_retrieves()  # vLLM takes them by request id (block ids are per group)
                else:
                    errors_all |= errors
                for rid in sorted(recving):
                    seen = self.reported.setdefault((w.rank, s, "recving"), set())
                    req = self.requests.get(rid)
                    if rid in seen and req is not None and not req.preempted:
                        self.world.violation("F16", w.name, f"{rid} reported in recving twice by {tc_name(s)}")
                    seen.add(rid)
                    if req is None or req.state not in ("loading",):
                        if req is not None and req.state in ("finishing", "done"):
                            self.world.violation("F16", w.name, f"{rid} reported in recving after it finished "
                                                 f"({req.state}): double completion")
                        continue
                    req.loads_pending.discard(w.rank)
                for rid in sorted(sending):
                    seen = self.reported.setdefault((w.rank, s, "sending"), set())
                    if rid in seen:
                        self.world.violation("F16", w.name, f"{rid} reported in sending twice by {tc_name(s)}")
                    seen.add(rid)
                    req = self.requests.get(rid)
                    if req is None or req.state != "finishing":
                        self.world.violation("F16", w.name, f"{rid} reported in sending while {req and req.state}")
                        continue
                    if self.model.sent(req.queued, (w.rank, s)):
                        self._mark_done(req)
                        self._ensure_step()  # waiting requests may fit now
            if errors_all:
                self._recompute_errors(w, errors_all)
            for rid in sorted(failed):
                self._recompute_failed(rid)
        for req in self.order:
            if req.state == "loading" and not req.loads_pending:
                self._verify_load(req)
                if self.sched is not None and req.blocks is not None and not req.sync:
                    # vLLM calls update_state_after_alloc again when an async load lands.
                    self.model.load_landed(req.queued)
                self._start_compute(req)

    def _recompute_errors(self, w: SimWorker, blocks: set[int]) -> None:
        """vLLM recomputes a request with a bad block from that block on, on every rank."""
        for req in self.order:
            if req.blocks is None or req.state != "loading" or not blocks.intersection(req.blocks):
                continue
            kept = self.model.recompute_from(req.queued, blocks)
            for i in range(kept // self.bs, len(req.blocks)):
                for worker in self.workers:
                    req.load_errors.add((worker.rank, req.blocks[i]))
                    worker.blocks[req.blocks[i]] = self.expected_block(req, worker.rank, i)

    def _recompute_failed(self, rid: str) -> None:
        """A load failed by request id (several KV-cache groups): vLLM recomputes the request
        past its prefix-cache hit, in every group."""
        req = self.requests.get(rid)
        if req is None or req.blocks is None or req.state != "loading":
            return
        kept = self.model.recompute_failed_load(req.queued)
        for table in self.model.tables(req.queued):
            for i in range(kept // self.bs, len(table)):
                for worker in self.workers:
                    req.load_errors.add((worker.rank, table[i]))
        self._compute_blocks(req, kept // self.bs, len(req.blocks))

    def _compute_blocks(self, req: SimRequest, first: int, last: int) -> None:
        """The engine computes blocks ``[first, last)`` of ``req`` (its prefix cache, a forward,
        a recompute): every group's block there holds that group's right value."""
        for g, table in enumerate(self.model.tables(req.queued)):
            for i in range(first, min(last, len(table))):
                if g and table[i] == NULL_BLOCK:
                    continue
                for w in self.workers:
                    w.blocks[table[i]] = self.expected_block(req, w.rank, i, g)

    def _verify_load(self, req: SimRequest) -> None:
        """F10: every block the load claimed to write holds exactly what was stored for it;
        F24 (several KV-cache groups): every block vLLM reads for the resumed prefix in the other
        groups holds that group's data."""
        op = req.retrieve
        assert req.blocks is not None and op is not None
        first = (op.start + op.skip_first_n_tokens) // self.bs
        last = op.end // self.bs
        for w in self.workers:
            for i in range(first, last):
                b = req.blocks[i]
                if (w.rank, b) in req.load_errors:
                    continue
                want = self.expected_block(req, w.rank, i)
                got = w.blocks.get(b)
                if got != want:
                    self.world.violation(
                        "F10", w.name, f"{req.rid}: block {i} (id {b}) after a load reported good holds "
                        f"{got} instead of {want}: vLLM would decode over wrong KV")
        if not several(self.groups):
            return
        tables = self.model.tables(req.queued)
        for w in self.workers:

            def wrong(g: int, i: int, w: SimWorker = w) -> str | None:
                b = tables[g][i]
                if (w.rank, b) in req.load_errors:
                    return None
                want, got = self.expected_block(req, w.rank, i, g), w.blocks.get(b)
                return None if got == want else f"{got} instead of {want} (rank {w.rank})"

            finding = partial_restore(req.rid, self.groups, tables, req.queued.computed, self.C, self.bs, NULL_BLOCK,
                                      wrong)
            if finding is not None:
                self.world.violation(finding[0], w.name, finding[1])

    def _compute_and_store(self, req: SimRequest) -> None:
        assert req.blocks is not None
        if req.spec.preempt and not req.preempted:
            # Preempted: blocks back to the pool, recomputed from scratch later.
            req.preempted = True
            self.model.preempt(req.queued)
            req.state = "waiting"
            self._ensure_step()
            return
        self._compute_blocks(req, 0, len(req.blocks))
        # The whole prefill is one scheduled step (the engine's prefix cache and the load gave
        # the rest); the plan's stores leave for the workers at the end of the step.
        self.model.schedule_prefill(req.queued)
        req.state = "decoding"
        self.world.timeline.after(self.cfg.decode_time, self._decoded, req)

    def _decoded(self, req: SimRequest) -> None:
        if self.crashed or req.state != "decoding":
            return
        self._finish(req, "finished")

    def _finish(self, req: SimRequest, outcome: str) -> None:
        """vLLM request_finished: workers are told, the scheduler ends the lookup session."""
        assert self.sched is not None
        req.outcome = outcome
        if not self.model.finish(req.queued, {(w.rank, s) for w in self.workers for s in range(self.num_servers)}):
            self._mark_done(req)
            return
        req.state = "finishing"
        for w in self.workers:
            assert w.node is not None
            for s in range(self.num_servers):
                event = Abort(req.rid) if outcome == "aborted" else EngineFinished((req.rid,))
                self.call(w.node, tc_name(s), event)
        self._ensure_step()

    def check_blocks(self, worker: SimWorker, rid: str, block_ids: tuple[int, ...], writing: bool, what: str) -> None:
        """A copy between engine blocks and L1 touches only blocks its request still holds: vLLM
        freed them only after the request was reported finished, so a copy still running on freed
        blocks reads (STORE: wrong KV stored, F10) or overwrites (RETRIEVE: another request's KV,
        F16) memory that is no longer its own."""
        for b in block_ids:
            owner = self.model.block_owner.get(b)
            if owner != rid:
                code = "F16" if writing else "F10"
                self.world.violation(code, worker.name, f"{what} for {rid} {'writes' if writing else 'reads'} block "
                                     f"{b} after vLLM freed it ({'now held by ' + owner if owner else 'free'})")

    def _mark_done(self, req: SimRequest) -> None:
        req.state = "done"
        req.done = True
        req.finished_at = self.world.now()
        self.world.note_done(req.rid, sched_name(self.index))
        self.world.trace.line(req.finished_at, sched_name(self.index), f"request {req.rid} done ({req.outcome})")

    def abort(self, req: SimRequest) -> None:
        """vLLM aborts ``req`` (a tape's ``abort`` action); nothing once it is finishing or done."""
        if self.crashed or req.state in ("pending", "finishing", "done", "decoding"):
            return
        self.world.trace.line(self.world.now(), sched_name(self.index), f"abort {req.rid} in {req.state}")
        if req.state == "waiting" and req.blocks is None:
            self._finish(req, "aborted")
        else:
            self._finish(req, "aborted")

    # =========================================================================== data
    def expected_block(self, req: SimRequest, rank: int, block_index: int, group: int = 0) -> int:
        token = block_index * self.bs
        chunk = token // self.C
        if chunk >= len(req.hashes):
            return -2 - group  # the partial tail chunk: never stored or loaded
        base = int.from_bytes(req.hashes[chunk][:6], "little") * 8 + rank
        return int(base * 64 + (token - chunk * self.C) // self.bs + (group << GROUP_SHIFT))

    # =========================================================================== faults & phases
    def crash(self) -> None:
        if self.crashed:
            return
        self.crashed = True
        self.world.trace.mark(self.world.now(), sched_name(self.index), "crash", "engine (scheduler + workers)")
        self.transport.crash()
        if self.sched is not None:
            self.sched.crash()
        for w in self.workers:
            w.alive = False
            if w.node is not None:
                w.node.crash()
        for req in self.order:
            if not req.done:
                req.outcome = "abandoned"

    def touch_all_live(self) -> None:
        for req in self.order:
            if not req.done:
                self.world.touched.add(req.rid)

    def begin_liveness(self) -> None:
        if self.crashed:
            return
        self._ensure_step()

    def all_done(self) -> bool:
        return self.crashed or all(r.done for r in self.order)

    def stuck_report(self) -> list[str]:
        if self.crashed:
            return []
        lines = []
        for req in self.order:
            if req.done:
                continue
            if req.state == "waiting" and req.unresolved:
                what = f"lookup unresolved after {req.polls} polls (check() -> None)"
            else:
                what = f"state {req.state}"
                if req.state == "finishing":
                    what += f", waiting for sending from {sorted(req.finishing)}"
                if req.state == "loading":
                    what += f", waiting for recving from ranks {sorted(req.loads_pending)}"
            last = self.world.recent_lines(req.rid)
            lines.append(f"{req.rid}@{sched_name(self.index)}: {what}; last events: {last}")
        return lines


class _PlannerCalls:
    """The scheduler model's connector: vLLM's scheduler calls as events to the scheduler node's
    ``StepPlanner`` (what ``SchedulerAdapter`` does in production), each answer checked."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    def _node(self) -> Node:
        assert self.engine.sched is not None
        return self.engine.sched

    def get_num_new_matched_tokens(
        self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, num_computed_tokens: int,
        cache_salt: str = "", extras: KeyExtras = NO_EXTRAS, *, max_load_tokens: int | None = None,
        max_offload_tokens: int | None = None,
    ) -> tuple[int | None, bool]:
        event = MatchRequest(request_id, token_ids, num_prompt_tokens, num_computed_tokens, cache_salt, extras,
                             max_load_tokens=max_load_tokens, max_offload_tokens=max_offload_tokens)
        tokens, load_async = self._match(event)
        finding = unrestorable_hit(request_id, self.engine.groups, self.engine.cfg.cpu_engine, tokens)
        if finding is not None:
            self.engine.world.violation(finding[0], self._node().name, finding[1])
        return tokens, load_async

    def _match(self, event: MatchRequest) -> tuple[int | None, bool]:
        """One MatchRequest to the planner, its answer checked."""
        node = self._node()
        request_id, num_prompt_tokens = event.request_id, event.num_prompt_tokens
        num_computed_tokens = event.num_computed_tokens
        effects = self.engine.call(node, LOOKUP, event)
        answers = [e for e in effects if type(e) is MatchAnswer]
        if len(answers) != 1:
            self.engine.world.violation("SAFETY", node.name, f"MatchRequest({request_id}) answered {answers!r}")
        answer = answers[0]
        tokens = answer.tokens
        # several KV-cache groups load asynchronously (kv_groups.sync_load_allowed)
        sync_max = -1 if several(self.engine.groups) else self.engine.cfg.sync_load_max_tokens
        now = self.engine.world.now()
        if tokens is None and answer.wait_until is not None and answer.wait_until > now:
            self.engine.lookup_wait_until = answer.wait_until  # the step blocks (SchedulerAdapter's wait)
        if tokens is not None and (tokens < 0 or num_computed_tokens + tokens >= num_prompt_tokens
                                   or (tokens == 0 and answer.load_async)
                                   or (tokens > 0 and answer.load_async != (tokens > sync_max))):
            self.engine.world.violation("SAFETY", node.name, f"MatchRequest({request_id}) answered {answer!r} for "
                                        f"{num_prompt_tokens} tokens, {num_computed_tokens} held by the engine")
        return tokens, answer.load_async

    def update_state_after_alloc(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int,
                                 other_group_block_ids: Sequence[Sequence[int]] = ()) -> None:
        self.engine.call(self._node(), LOOKUP, BlocksAllocated(request_id, tuple(block_ids), num_external_tokens,
                                                               tuple(tuple(g) for g in other_group_block_ids)))

    def build_plan(self, scheduled: Iterable[ScheduledRequest], preempted: Iterable[str] = ()) -> StepPlan:
        node = self._node()
        plans = [e for e in self.engine.call(node, LOOKUP, StepScheduled(tuple(scheduled), tuple(preempted)))
                 if type(e) is StepPlan]
        if len(plans) != 1:
            self.engine.world.violation("SAFETY", node.name, f"StepScheduled answered {plans!r}")
        plan: StepPlan = plans[0]
        return plan

    def request_finished(self, request_id: str) -> bool:
        self.engine.call(self._node(), LOOKUP, RequestFinished(request_id))
        return True
