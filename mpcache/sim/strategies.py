"""Hypothesis strategies for whole simulated worlds.

`scenarios()` draws the same `Scenario` type `draw_scenario(seed)` builds, but from Hypothesis
data, so a failing world shrinks structurally: fewer requests, fewer faults, fewer nodes,
shorter prompts, smaller knobs, and `net_seed` towards 0. Every per-message choice inside the
run (delays, drops, duplicates, copy latencies) comes from `net_seed`, and so does the order
the world's tasks run in (`sim/timeline.py`), so an example replays exactly.
"""
from __future__ import annotations

from hypothesis import strategies as st

from mpcache.sim.net import NetConfig
from mpcache.sim.scenario import FaultSpec, RequestSpec, Scenario, WorldConfig, server_name, sched_name, worker_name


@st.composite
def world_configs(draw: st.DrawFn, faulty: bool = True) -> WorldConfig:
    num_servers = draw(st.integers(1, 2))
    num_engines = draw(st.integers(1, 3))
    tp = draw(st.integers(1, 2))
    chunk_size = draw(st.sampled_from((8, 16)))
    net = NetConfig(
        min_delay=draw(st.sampled_from((0.0005, 0.0002, 0.001))),
        mean_delay=draw(st.sampled_from((0.002, 0.001, 0.01))),
        drop_p=draw(st.sampled_from((0.0, 0.01, 0.05))) if faulty else 0.0,
        dup_p=draw(st.sampled_from((0.0, 0.05, 0.2))) if faulty else 0.0,
        reorder_p=draw(st.sampled_from((0.0, 0.2, 0.5))),
        reorder_delay=draw(st.sampled_from((0.005, 0.05))),
        capacity=draw(st.sampled_from((256, 8))),
    )
    return WorldConfig(
        num_servers=num_servers,
        num_engines=num_engines,
        tp=tp,
        chunk_size=chunk_size,
        block_size=4,
        blocks_per_worker=draw(st.sampled_from((96, 32))),
        l1_slots=draw(st.sampled_from((64, 12))),
        lease_ttl=draw(st.sampled_from((10.0, 2.0))),
        l2_enabled=draw(st.booleans()),
        l2_probe=draw(st.booleans()),
        l2_latency_mean=draw(st.sampled_from((0.005, 0.3))),
        l2_fail_p=draw(st.sampled_from((0.0, 0.3))) if faulty else 0.0,
        copy_latency_mean=draw(st.sampled_from((0.002, 0.05))),
        copy_fail_p=draw(st.sampled_from((0.0, 0.1))) if faulty else 0.0,
        evict_after_prefetch_p=draw(st.sampled_from((0.0, 0.5))) if faulty else 0.0,
        server_workers=draw(st.sampled_from((1, 4))),
        step_interval=draw(st.sampled_from((0.01, 0.005))),
        decode_time=draw(st.sampled_from((0.03, 0.002, 0.2))),
        engine_driven=draw(st.booleans()),
        abandoned_job_ttl=draw(st.sampled_from((10.0, 3.0))),
        net=net,
        safety_duration=draw(st.sampled_from((1.0, 2.0))),
        liveness_bound=10.0,
    )


@st.composite
def scenarios(draw: st.DrawFn, faulty: bool = True, max_requests: int = 8) -> Scenario:
    cfg = draw(world_configs(faulty))
    C = cfg.chunk_size
    docs = draw(st.lists(st.lists(st.integers(1, 50000), min_size=C, max_size=3 * C), min_size=1, max_size=2))
    requests = []
    n = draw(st.integers(1, max_requests))
    for i in range(n):
        doc = tuple(draw(st.sampled_from(docs)))
        shared = draw(st.integers(0, len(doc) // C)) * C
        suffix = tuple(draw(st.lists(st.integers(1, 50000), min_size=0 if shared else C, max_size=2 * C)))
        prompt = doc[:shared] + suffix
        requests.append(RequestSpec(
            engine=draw(st.integers(0, cfg.num_engines - 1)),
            request_id=f"r{i}",
            arrival=draw(st.sampled_from((0.0, 0.05, 0.1, 0.3, 0.6))) + i * 0.01,
            prompt=prompt,
            apc_blocks=draw(st.sampled_from((0, 0, 1, 2, 4))),
            abort_after=draw(st.sampled_from((None, None, 0.001, 0.02, 0.2))),
            preempt=draw(st.booleans()) and draw(st.booleans()),
            cache_salt=draw(st.sampled_from(("", "tenant-a", "bad/salt"))) if draw(st.booleans()) else "",
        ))
    faults: list[FaultSpec] = []
    if faulty:
        nodes = [server_name(s) for s in range(cfg.num_servers)] + [sched_name(e) for e in range(cfg.num_engines)]
        nodes += [worker_name(e, r) for e in range(cfg.num_engines) for r in range(cfg.tp)]
        for _ in range(draw(st.integers(0, 3))):
            at = draw(st.sampled_from((0.05, 0.2, 0.5, 0.9)))
            kind = draw(st.sampled_from(("crash_server", "partition", "clog", "crash_engine", "clear")))
            if kind == "crash_server":
                faults.append(FaultSpec(at, kind, (draw(st.integers(0, cfg.num_servers - 1)),
                                                   draw(st.sampled_from((0.05, 0.5, 3.0))))))
            elif kind in ("partition", "clog"):
                a = server_name(draw(st.integers(0, cfg.num_servers - 1)))
                b = draw(st.sampled_from([x for x in nodes if x != a]))
                faults.append(FaultSpec(at, kind, (b, a, draw(st.booleans()), draw(st.sampled_from((0.05, 0.5))))))
            elif kind == "crash_engine":
                faults.append(FaultSpec(at, kind, (draw(st.integers(0, cfg.num_engines - 1)),)))
            else:
                faults.append(FaultSpec(at, kind, (draw(st.integers(0, cfg.num_servers - 1)),)))
        faults.sort(key=lambda f: f.at)
    net_seed = draw(st.integers(0, 2**32 - 1))
    return Scenario(seed=-1, config=cfg, requests=tuple(requests), faults=tuple(faults), net_seed=net_seed)
