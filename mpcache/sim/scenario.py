"""One root seed draws a whole world: topology, knobs, fault rates, workload and fault schedule.

A `Scenario` is plain data. `draw_scenario(seed)` builds it from `random.Random(seed)` (swarm
testing: fault rates, TTLs, capacities and latencies are themselves drawn per seed);
`mpcache.sim.strategies` builds the same type from Hypothesis, so failures shrink to fewer requests,
fewer faults and smaller knobs. The scenario also carries `net_seed`, which seeds every
per-message decision (delays, drops, duplicates, copy latencies) and the order the world's tasks run in.
"""
from __future__ import annotations

import hashlib
import random
from typing import Any

import attrs

from mpcache.core_sm.kv_groups import GroupKind, KVGroup
from mpcache.sim.net import NetConfig


@attrs.frozen
class WorldConfig:
    num_servers: int = 1
    num_engines: int = 1
    tp: int = 1  # KV ranks (workers) per engine
    chunk_size: int = 16
    block_size: int = 4
    blocks_per_worker: int = 64
    l1_slots: int = 64
    lease_ttl: float = 30.0
    l2_enabled: bool = False
    l2_probe: bool = False  # two-phase prefetch: ProbeL2 before ReadL2
    l2_latency_min: float = 0.001
    l2_latency_mean: float = 0.005
    l2_fail_p: float = 0.0
    # a share of L2 reads stalls for L2_STALL s (a Redis hiccup): longer than a status wait, so
    # a waiter's own deadline answers it (drawn from its own stream)
    l2_stall_p: float = 0.0
    tier_nodes: int = 0  # >0: L2 is a cluster tier of this many nodes (sim.fleet; not drawn)
    copy_latency_mean: float = 0.002
    copy_fail_p: float = 0.0
    evict_after_prefetch_p: float = 0.0
    server_workers: int = 1  # >1: handlers may run out of arrival order
    server_handler_jitter: float = 0.003
    step_interval: float = 0.01
    compute_time: float = 0.01
    decode_time: float = 0.05
    # vLLM's max_num_seqs: at most this many requests hold blocks at once; the rest wait in the
    # queue, unmatched once the scheduler is full (None: no cap). A small cap and long decodes
    # make deep queues, where a matched request waits longer than its hit's read leases live.
    max_running: int | None = None
    # The connector's planner as production runs it (PlannerConfig): the scheduler may wait up to
    # ``lookup_wait`` s for a new request's lookup answer (production default 5 ms), and loads of
    # at most ``sync_load_max_tokens`` tokens are synchronous (a CPU engine's default: all);
    # ``lookup_wait_idle`` s while the engine is idle (production default 50 ms).
    lookup_wait: float = 0.0
    lookup_wait_idle: float = 0.0
    sync_load_max_tokens: int = 0
    # The connector's lookup_answer_in_ack (ConnectorSettings): each LOOKUP asks for its hit count
    # in the ack, so an L1 hit takes one round trip (drawn: both paths run across the seeds).
    lookup_answer_in_ack: bool = False
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 2.5
    engine_driven: bool = False
    adversary: bool = False  # an adversarial client node (sim/adversary.py)
    store_threshold: int = 0  # core_sm.admission (not drawn: set by the tests that want it)
    abandoned_job_ttl: float = 10.0
    lookup_timeout: float = 5.0
    # a request's deadline at its node's link: the connector's request_timeout_s default
    request_timeout: float = 5.0
    net: NetConfig = attrs.field(factory=NetConfig)
    safety_duration: float = 4.0
    liveness_bound: float = 30.0
    chain_seed: int = 0  # seeds the world's chunk-chain key (chain_key); draw_scenario: the seed
    # The engine's KV-cache groups (vLLM's hybrid KV-cache manager; sim/groups.py): () is one
    # full-attention group (the plain path); else group 0 is full attention and the others
    # sliding windows (maybe a recurrent state), every chunk's object holding them all; the
    # planner runs with them (PlannerConfig.kv_groups). ``cpu_engine``: the workers' KV is in host
    # memory (PlannerConfig.cpu_engine: several groups are restored only there).
    kv_groups: tuple[KVGroup, ...] = ()
    cpu_engine: bool = False

    @property
    def chain_key(self) -> bytes:
        """The world's chunk-chain key (mpcache.core_sm.chunks.ChunkChain), a function of ``chain_seed``:
        the servers and the engine model hash alike, and a seed replays byte for byte."""
        return hashlib.sha256(b"mpcache-sim-chain/" + str(self.chain_seed).encode()).digest()


@attrs.frozen
class RequestSpec:
    engine: int
    request_id: str
    arrival: float
    prompt: tuple[int, ...]
    apc_blocks: int = 0  # blocks the engine's own prefix cache already holds
    abort_after: float | None = None  # abort this long after arrival
    preempt: bool = False
    cache_salt: str = ""
    # vLLM kv_transfer_params max_load_tokens (None: no cap): at most this many tokens loaded
    # beyond the engine's own hit.
    max_load_tokens: int | None = None
    # abort while a connector operation is in flight: "lookup" (the lookup sent, not answered
    # yet) or "load" (the retrieve planned, not landed), ``abort_delay`` after it started
    abort_on: str | None = None
    abort_delay: float = 0.0


@attrs.frozen
class FaultSpec:
    """A timed fault. kind: crash_server(s, down_for) | partition(a, b, one_way, for_) |
    clog(a, b, for_) | crash_engine(e) | clear(s)."""

    at: float
    kind: str
    args: tuple[Any, ...] = ()


@attrs.frozen
class Scenario:
    seed: int
    config: WorldConfig
    requests: tuple[RequestSpec, ...]
    faults: tuple[FaultSpec, ...]
    net_seed: int


# of the worlds whose planner waits for lookups and loads synchronously, as production does
CONNECTOR_DEFAULTS_SHARE = 0.5
ANSWER_IN_ACK_SHARE = 0.5  # of the worlds whose lookups ask for the hit count in the ack
DEEP_QUEUE_SHARE = 0.5  # of the worlds without the adversary whose drawn lease TTL is not the short one


GROUPED_SHARE = 0.5  # of the worlds whose engine has several KV-cache groups


def draw_groups(seed: int, chunk_size: int, block_size: int) -> dict[str, Any]:
    """The engine's KV-cache groups, from a stream of their own (the other draws of a seed stay
    as they were): half of the worlds keep one full-attention group; the others add one or two
    sliding windows (each window in tokens drawn), on a CPU engine mostly (restored); a fifth of
    them a recurrent state too, and the GPU engines, cannot be restored (every request a miss)."""
    rng = random.Random(f"{seed}:groups")
    if rng.random() >= GROUPED_SHARE:
        return {}
    groups = [KVGroup(GroupKind.FULL, block_size, name="full")]
    window = rng.randint(1, 3 * chunk_size)
    groups.append(KVGroup(GroupKind.SLIDING_WINDOW, block_size, window=window, name="window0"))
    if rng.random() < 0.2:  # a second window size (vLLM keeps one group per window size)
        groups.append(KVGroup(GroupKind.SLIDING_WINDOW, block_size, window=window + rng.randint(1, chunk_size),
                              name="window1"))
    if rng.random() < 0.2:
        groups.append(KVGroup(GroupKind.RECURRENT, block_size, name="recurrent"))
    return {"kv_groups": tuple(groups), "cpu_engine": rng.random() < 0.85}


def make_prompt(rng: random.Random, documents: list[tuple[int, ...]], chunk_size: int) -> tuple[int, ...]:
    """A prompt = (often) a shared document prefix + a private suffix (+ a partial chunk)."""
    prefix: tuple[int, ...] = ()
    if documents and rng.random() < 0.8:
        doc = rng.choice(documents)
        prefix = doc[: chunk_size * rng.randint(1, len(doc) // chunk_size)]
    suffix_chunks = rng.randint(0 if prefix else 1, 2)
    suffix = tuple(rng.randrange(1, 50000) for _ in range(suffix_chunks * chunk_size + rng.randrange(chunk_size)))
    return prefix + suffix


def server_name(i: int) -> str:
    return f"server{i}"


def sched_name(e: int) -> str:
    return f"sched{e}"


def worker_name(e: int, r: int) -> str:
    return f"worker{e}.{r}"


def _abort_in_flight(rng: random.Random, net: NetConfig) -> dict[str, Any]:
    """An abort timed to land while the request's lookup (or load) is in flight: after about a
    one-way delay the server has leased the hit, and the answer is not back yet."""
    if rng.random() >= 0.15:
        return {}
    on = rng.choice(("lookup", "lookup", "load"))
    return {"abort_on": on, "abort_delay": round(net.min_delay + rng.uniform(0.5, 2.0) * net.mean_delay, 6)}


def draw_scenario(seed: int) -> Scenario:
    rng = random.Random(seed)
    num_servers = rng.choice((1, 1, 2, 3))
    num_engines = rng.choice((1, 2, 2, 3, 4))
    tp = rng.choice((1, 1, 2)) if num_engines <= 2 else 1
    chunk_size = rng.choice((8, 16))
    block_size = rng.choice((4, 8)) if chunk_size == 16 else 4
    faulty = rng.random() < 0.8
    net = NetConfig(
        min_delay=rng.choice((0.0002, 0.001)),
        mean_delay=rng.choice((0.001, 0.003, 0.01)),
        drop_p=rng.choice((0.0, 0.0, 0.005, 0.02)) if faulty else 0.0,
        dup_p=rng.choice((0.0, 0.01, 0.05)) if faulty else 0.0,
        reorder_p=rng.choice((0.0, 0.05, 0.2)),
        reorder_delay=rng.choice((0.005, 0.05)),
        capacity=rng.choice((8, 32, 256)),
    )
    config = WorldConfig(
        num_servers=num_servers,
        num_engines=num_engines,
        tp=tp,
        chunk_size=chunk_size,
        block_size=block_size,
        blocks_per_worker=rng.choice((48, 96, 192)),
        l1_slots=rng.choice((12, 24, 64, 256)),
        lease_ttl=rng.choice((2.0, 10.0, 60.0)),
        l2_enabled=rng.random() < 0.5,
        engine_driven=rng.random() < 0.3,
        l2_probe=rng.random() < 0.3,
        abandoned_job_ttl=rng.choice((3.0, 10.0)),
        l2_latency_min=rng.choice((0.0005, 0.002)),
        l2_latency_mean=rng.choice((0.002, 0.02, 0.3)),
        l2_fail_p=rng.choice((0.0, 0.0, 0.05, 0.3)) if faulty else 0.0,
        copy_latency_mean=rng.choice((0.001, 0.005, 0.05)),
        copy_fail_p=rng.choice((0.0, 0.0, 0.02)) if faulty else 0.0,
        evict_after_prefetch_p=rng.choice((0.0, 0.0, 0.3)) if faulty else 0.0,
        server_workers=rng.choice((1, 1, 2, 4)),
        server_handler_jitter=rng.choice((0.001, 0.005)),
        step_interval=rng.choice((0.005, 0.01, 0.02)),
        compute_time=rng.choice((0.005, 0.02)),
        decode_time=rng.choice((0.002, 0.03, 0.2)),
        net=net,
        safety_duration=rng.choice((1.0, 2.0, 3.0)),
        # its own stream: every other draw of a seed stays as it was
        adversary=random.Random(f"{seed}:adversary").random() < 0.4,
        chain_seed=seed,
    )
    queue = random.Random(f"{seed}:queue")  # deep queues: their own stream too
    max_running = queue.choice((None, 1, 2))
    # Deep queues (F20), only without the adversary: its requests and the legacy over-release
    # profiles race for the first violation, and each profile must show its own. Worlds whose
    # drawn lease TTL is the short one queue as drawn; a share of the others gets a queue whose
    # waits (a decode of 1 to 1.5 lease TTLs per running request) outlast the leases of a hit
    # matched behind a full scheduler. The rest keep their timing as drawn.
    if max_running is not None and not config.adversary and config.lease_ttl <= 2.0:
        config = attrs.evolve(config, max_running=max_running, decode_time=queue.choice((0.5, 1.0)),
                              lease_ttl=1.0)
    elif not config.adversary and queue.random() < DEEP_QUEUE_SHARE:
        config = attrs.evolve(config, max_running=queue.choice((1, 1, 2)), decode_time=queue.choice((1.0, 1.5)),
                              lease_ttl=1.0)
    connector = random.Random(f"{seed}:connector")  # its own stream: other draws stay as they were
    if connector.random() < CONNECTOR_DEFAULTS_SHARE:
        config = attrs.evolve(config, lookup_wait=connector.choice((0.005, 0.005, 0.02)),
                              sync_load_max_tokens=connector.choice((0, 1 << 40, 2 * chunk_size)))
        config = attrs.evolve(config, lookup_wait_idle=connector.choice((0.0, 0.05)))  # drawn last: the rest stay
    config = attrs.evolve(config, **draw_groups(seed, chunk_size, block_size))
    one_trip = random.Random(f"{seed}:answer-in-ack")  # its own stream: other draws stay as they were
    config = attrs.evolve(config, lookup_answer_in_ack=one_trip.random() < ANSWER_IN_ACK_SHARE)
    stall = random.Random(f"{seed}:l2-stall")  # its own stream: other draws stay as they were
    if config.l2_enabled and stall.random() < 0.3:
        config = attrs.evolve(config, l2_stall_p=stall.choice((0.05, 0.2)))
    documents = [
        tuple(rng.randrange(1, 50000) for _ in range(chunk_size * rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
    ]
    if config.max_running is not None:
        # A deep queue serves one shared document (a system prompt): what the first request
        # stores, those queued behind it hit, and hold leases while they wait.
        documents = documents[:1]
    requests = []
    # Drawn from their own stream, so that adding them left every other draw of a seed as it was.
    caps = random.Random(seed * 7919 + 17)
    aborts = random.Random(f"{seed}:abort-in-flight")  # and these: aborts timed to an operation
    n_requests = rng.randint(4, 16)
    for i in range(n_requests):
        arrival = rng.uniform(0.0, config.safety_duration * 0.8)
        prompt = make_prompt(rng, documents, chunk_size)
        apc = 0
        if rng.random() < 0.2:
            apc = rng.randint(0, len(prompt) // block_size)
        abort_after = rng.choice((0.001, 0.003, 0.01, 0.05, 0.2)) if rng.random() < 0.25 else None
        engine = rng.randrange(num_engines)  # the draws in their old order: engine, preempt, salt
        preempt = rng.random() < 0.08
        salt = "bad/salt" if rng.random() < 0.03 else rng.choice(("", "", "", "tenant-a"))
        if config.max_running is not None and salt == "tenant-a":
            salt = ""  # one tenant shares the queue's document
        cap = caps.choice((0, chunk_size - 1, chunk_size, 2 * chunk_size + 3)) if caps.random() < 0.3 else None
        if config.max_running is not None:
            # Requests queued on one document overlap their leases: some hold part of it in the
            # engine's own prefix cache, some cap their load, so the planner frees ranges of a hit
            # other queued requests lease too (the queue's stream: other worlds draw as before).
            if apc == 0 and queue.random() < 0.3:
                apc = queue.randint(1, max(1, len(prompt) // block_size // 2))
            if cap is None and queue.random() < 0.3:
                cap = queue.choice((chunk_size - 1, chunk_size, 2 * chunk_size + 3))
        requests.append(
            RequestSpec(
                engine=engine,
                request_id=f"r{i}",
                arrival=round(arrival, 6),
                prompt=prompt,
                apc_blocks=apc,
                abort_after=abort_after,
                preempt=preempt,
                cache_salt=salt,
                max_load_tokens=cap,
                **_abort_in_flight(aborts, net),
            )
        )
    faults: list[FaultSpec] = []
    if faulty:
        nodes = [server_name(s) for s in range(num_servers)] + [sched_name(e) for e in range(num_engines)]
        nodes += [worker_name(e, r) for e in range(num_engines) for r in range(tp)]
        for _ in range(rng.randint(0, 4)):
            at = round(rng.uniform(0.0, config.safety_duration), 6)
            kind = rng.choice(("crash_server", "partition", "partition", "clog", "crash_engine", "clear"))
            if kind == "crash_server":
                faults.append(FaultSpec(at, kind, (rng.randrange(num_servers), rng.choice((0.05, 0.5, 2.0)))))
            elif kind in ("partition", "clog"):
                server = server_name(rng.randrange(num_servers))
                other = rng.choice([n for n in nodes if n != server])
                a, b = (server, other) if rng.random() < 0.5 else (other, server)
                dur = rng.choice((0.05, 0.5, 3.0))
                faults.append(FaultSpec(at, kind, (a, b, rng.random() < 0.4, dur)))
            elif kind == "crash_engine":
                if num_engines > 1:
                    faults.append(FaultSpec(at, kind, (rng.randrange(num_engines),)))
            else:
                faults.append(FaultSpec(at, kind, (rng.randrange(num_servers),)))
        faults.sort(key=lambda f: f.at)
    return Scenario(seed, config, tuple(requests), tuple(faults), rng.randrange(2**32))
