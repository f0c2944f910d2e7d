"""Record a short production run of the connector's machines (``MPCACHE_RECORD``), for
``mpcache.sim.prod_replay`` to replay through the simulator's machines.

A real ``mpcache-server`` (a child process, a small L1 and a disk L2, so a lookup past L1 is
acked without its count and asked for its status) and the connector's own adapters
(``SchedulerAdapter``, one ``WorkerAdapter``: a CPU engine, engine-driven copies), driven by
hand in vLLM's call order:

* ``a``: a miss (the server reads L2: the two-step lookup, LOOKUP then WAIT_PREFETCH_STATUS),
  computed and stored (three whole chunks);
* ``b``: the same prompt: an L1 hit answered in the LOOKUP's ack (one round trip), loaded
  synchronously (a CPU engine's default) into fresh blocks, checked byte for byte;
* ``c``: a prompt that shares only the first chunk: its L1 part hits, the rest goes to L2 (two
  steps again), one chunk loaded;
* ``d``: the first prompt again, a hit that is finished (aborted) before vLLM allocates it: the
  planner ends its session (the server gives back its read leases);
* ``e``: the server is stopped: a lookup while it is down is a miss (the links' heartbeats go
  unanswered, the servers are declared down, the lookup fails typed or is not sent), computed
  and not stored anywhere;
* ``f``: the server is started again on the same port with the same disk L2 (a new epoch, L1
  empty): both links register again, and the first prompt hits from L2 (two steps), loaded
  synchronously and checked byte for byte;
* ``g``: the server is paused (SIGSTOP) for longer than the request timeout: a lookup of a new
  prompt times out (a miss), its store is given up; resumed (SIGCONT), its late replies are
  dropped as stale and the links see it healthy again;
* ``h``: the server is killed, and a new prompt is looked up, computed and stored before it is
  started again on the same address: the sends fail at once (a miss, nothing stored); ``i``, the
  same prompt once the links are back, a miss stored; ``j`` hits and loads it, checked
  byte for byte;
* ``k``: a hit planned (its load in the step's plan) and preempted in the next step before the
  load ran: the worker waits until no copy reads its blocks (the connector's
  ``handle_preemptions``), and the request, matched again, recomputes into new blocks (its
  lookup's hit was spent: the planner's ``recomputed_after_preemption``).

Then a second engine (another ``SchedulerAdapter`` and ``WorkerAdapter``) connects through
``tools/zmq_fault_proxy.py``, a loopback ZMQ proxy the script controls, in front of a second
server (its own disk L2). Production code paths only: the proxy forwards frames unchanged but
for the fault it is told to make.

* ``l``: a miss through the proxy, computed and stored;
* ``m``: the proxy drops the reply to m's lookup, the server alive and its heartbeats answered:
  the link's request deadline fails it typed (``timeout``), a miss;
* ``n``: a miss computed; before its store the proxy holds the heartbeats and instance pings and
  sends to the first server from then on (the server behind the address replaced: another epoch,
  the instance unknown there), so the store is refused ``not_registered`` before any heartbeat
  tells the links (production registers again within milliseconds of seeing a new epoch: only
  holding the heartbeats makes this order certain); the worker's link parks it, registers the
  instance and sends it once more naming the registration; ``n2`` hits what the resend stored.

With ``--gpu`` the engine's KV is on CUDA and the server copies (``--gpu on``, server-driven
transfers after the worker's interprocess event; loads are asynchronous, as a GPU engine's are by
default: the script waits for the worker to report them received).

Usage (from a checkout; needs torch, as the engine's tensors do)::

    python tools/record_production.py tests/data/prod_recording.jsonl
    python tools/record_production.py --gpu tests/data/prod_recording_gpu.jsonl    # on a CUDA host

It overwrites the output file. The recording holds the lines of every machine built: the
scheduler's planner, the worker's transfer client, and both processes' links.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import sys
import tempfile
import time

BLOCK, CHUNK, LAYERS, HEADS, HEAD, NUM_BLOCKS = 16, 32, 1, 1, 4, 128
MODEL = "tiny-recorded"


def main(out: str, gpu: bool = False) -> int:
    import torch

    from mpcache.bench.server_process import ServerProcess
    from mpcache.core_sm.planner import ScheduledRequest
    from mpcache.runtime_zmq.adapters import ConnectorConfig, SchedulerAdapter, WorkerAdapter

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from zmq_fault_proxy import FaultProxy

    tmp = tempfile.mkdtemp(prefix="mpcache-record-")
    record = os.path.join(tmp, "recording.jsonl")
    with socket.socket() as s:  # a fixed port, so the restarted server (f) is the same address
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--port", str(port), "--chunk-size", str(CHUNK), "--l1-size-gb", "0.0625", "--slot-mb", "1",
             "--no-l1-reserve", "--metrics-port", "0", "--l2", f"disk:{tmp}/l2", "--gpu", "on" if gpu else "off"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        other_port = s.getsockname()[1]
    other_flags = [{str(port): str(other_port), f"disk:{tmp}/l2": f"disk:{tmp}/l2-other"}.get(f, f) for f in flags]
    server = ServerProcess(flags, ready_timeout=60.0)
    other_server: ServerProcess | None = None
    os.environ["MPCACHE_RECORD"] = record
    try:
        config = ConnectorConfig(server_urls=server.url, chunk_size=CHUNK)
        scheduler = SchedulerAdapter.connect(config, model_name=MODEL, world_size=1, block_size=BLOCK,
                                             cpu_engine=not gpu)
        worker = WorkerAdapter.connect(config, model_name=MODEL, world_size=1, rank=0, block_size=BLOCK)
        if gpu:  # vLLM's CUDA layout [2, num_blocks, block_size, heads, head_size]
            kv = {f"layers.{i}.attn": torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, HEAD, device="cuda") for i in range(LAYERS)}
        else:  # its CPU layout [num_blocks, heads, block_size, 2 * head_size]
            kv = {f"layers.{i}.attn": torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD) for i in range(LAYERS)}

        def token_slot(cache: "torch.Tensor", block: int, pos: int) -> "torch.Tensor":
            """Every K and V element of one token position of one block."""
            return cache[:, block, pos] if gpu else cache[block, :, pos]
        worker.register_kv_caches(kv)
        next_block = iter(range(1, NUM_BLOCKS))

        def blocks(n: int) -> list[int]:
            return [next(next_block) for _ in range(n)]

        def match(rid: str, prompt: list[int], every: float = 0.05) -> tuple[int, bool]:
            deadline = time.monotonic() + 20  # (e: the request timeout, then the miss)
            while time.monotonic() < deadline:
                tokens, load_async = scheduler.get_num_new_matched_tokens(rid, prompt, len(prompt), 0)
                if tokens is not None:
                    return tokens, load_async
                time.sleep(every)  # (vLLM asks again each step)
            raise RuntimeError(f"{rid}: the lookup never answered")

        def finish(rid: str) -> None:
            assert scheduler.request_finished(rid)
            deadline, ids = time.monotonic() + 5, {rid}
            while time.monotonic() < deadline:
                sending, _ = worker.finished(ids)
                ids = set()
                if rid in sending:
                    return
                time.sleep(0.01)
            raise RuntimeError(f"{rid} never reported finished")

        def write(block_ids: list[int], prompt: list[int]) -> None:
            for cache in kv.values():
                for t, token in enumerate(prompt):
                    token_slot(cache, block_ids[t // BLOCK], t % BLOCK).fill_(float(token))

        def load(rid: str, retrieves: list[object]) -> None:
            """Submit the step's loads; an asynchronous one (a GPU engine's) is done once the
            worker reports it received."""
            worker.submit_retrieves(retrieves)
            deadline = time.monotonic() + 10
            while gpu and time.monotonic() < deadline:
                _, recving = worker.finished(set())
                if rid in recving:
                    break
                time.sleep(0.01)
            else:
                if gpu:
                    raise RuntimeError(f"{rid}: the load never finished")
            if gpu:
                torch.cuda.synchronize()

        rng = random.Random(11)
        prompt = [rng.randrange(1, 1000) for _ in range(3 * CHUNK + 5)]
        n_blocks = -(-len(prompt) // BLOCK)

        # a: a miss (L1 empty, L2 read: two steps); computed, its three whole chunks stored
        assert match("a", prompt) == (0, False)
        source = blocks(n_blocks)
        scheduler.update_state_after_alloc("a", source, 0)
        write(source, prompt)
        plan = scheduler.build_plan([ScheduledRequest("a", 0, len(prompt), source, True)])
        assert [(s.start, s.end) for s in plan.stores] == [(0, 3 * CHUNK)], plan
        worker.submit_retrieves(plan.retrieves)
        worker.submit_stores(plan.stores)
        finish("a")

        # b: the same prompt, an L1 hit in the LOOKUP's ack; a synchronous load into new blocks
        hit = 3 * CHUNK
        assert match("b", prompt) == (hit, gpu)
        target = blocks(n_blocks)
        scheduler.update_state_after_alloc("b", target, hit)
        plan = scheduler.build_plan([ScheduledRequest("b", hit, len(prompt) - hit, target, True)])
        assert [(r.start, r.end) for r in plan.retrieves] == [(0, hit)], plan
        load("b", list(plan.retrieves))
        worker.submit_stores(plan.stores)
        assert worker.load_errors() == set()
        for cache in kv.values():
            for t in range(hit):
                assert bool((token_slot(cache, target[t // BLOCK], t % BLOCK) == float(prompt[t])).all()), t
        finish("b")

        # c: the first chunk shared, the rest new: L1 then L2 (two steps); one chunk loaded
        other = prompt[:CHUNK] + [rng.randrange(1, 1000) for _ in range(CHUNK + 3)]
        assert match("c", other) == (CHUNK, gpu)
        target = blocks(-(-len(other) // BLOCK))
        scheduler.update_state_after_alloc("c", target, CHUNK)
        plan = scheduler.build_plan([ScheduledRequest("c", CHUNK, len(other) - CHUNK, target, True)])
        assert [(r.start, r.end) for r in plan.retrieves] == [(0, CHUNK)], plan
        load("c", list(plan.retrieves))
        worker.submit_stores(plan.stores)
        assert worker.load_errors() == set()
        finish("c")

        # d: a hit that vLLM aborts before allocating it: the planner ends its session
        assert match("d", prompt) == (hit, gpu)
        finish("d")

        # e: the server stops; a lookup while it is down is a miss, and nothing is stored
        time.sleep(0.5)  # (the disk L2 writes of a's chunks land)
        server.stop()
        time.sleep(2.0)  # a few heartbeats go unanswered
        assert match("e", prompt) == (0, False)
        finish("e")

        # f: the same server again (same port and disk L2, a new epoch, L1 empty): the links
        # register again, and the first prompt hits from L2, loaded and checked
        server = ServerProcess(flags, ready_timeout=60.0)
        deadline, attempt, tokens, rid = time.monotonic() + 20, 0, 0, "f"
        while time.monotonic() < deadline:
            rid = f"f{attempt}"
            tokens, _ = match(rid, prompt)
            if tokens:
                break
            finish(rid)  # the link has not seen the server back yet: a miss; a new request asks again
            attempt += 1
            time.sleep(0.2)
        assert tokens == hit, tokens
        target = blocks(n_blocks)
        scheduler.update_state_after_alloc(rid, target, hit)
        plan = scheduler.build_plan([ScheduledRequest(rid, hit, len(prompt) - hit, target, True)])
        assert [(r.start, r.end) for r in plan.retrieves] == [(0, hit)], plan
        load(rid, list(plan.retrieves))
        worker.submit_stores(plan.stores)
        assert worker.load_errors() == set()
        for cache in kv.values():
            for t in range(hit):
                assert bool((token_slot(cache, target[t // BLOCK], t % BLOCK) == float(prompt[t])).all()), t
        finish(rid)

        def compute_and_store(rid: str, tokens_: list[int]) -> list[int]:
            assert match(rid, tokens_) == (0, False)
            source_ = blocks(-(-len(tokens_) // BLOCK))
            scheduler.update_state_after_alloc(rid, source_, 0)
            write(source_, tokens_)
            plan_ = scheduler.build_plan([ScheduledRequest(rid, 0, len(tokens_), source_, True)])
            worker.submit_retrieves(plan_.retrieves)
            worker.submit_stores(plan_.stores)
            return source_

        # g: the server paused past the request timeout: the lookup and the store are given up;
        # resumed, the late replies are stale and the links see the server healthy again
        paused = [rng.randrange(1, 1000) for _ in range(2 * CHUNK + 3)]
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            compute_and_store("g", paused)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        finish("g")
        time.sleep(1.5)  # the late replies land, heartbeats answer again

        # h: killed; a prompt stored before it is started again, the links' connections already
        # closed: its sends fail at once (nothing waits for a timeout), vLLM computed it anyway.
        # Then started again on the same address. (Stored only after the new server is ready, h
        # would race the links' reconnection: a server slow to start, as one initialising CUDA
        # is, would be back before h's sends and store it.)
        server.proc.kill()
        server.stop()
        time.sleep(0.3)  # the connections' close seen (the peer's process is gone: at once)
        fresh = [rng.randrange(1, 1000) for _ in range(2 * CHUNK + 3)]
        compute_and_store("h", fresh)
        finish("h")
        server = ServerProcess(flags, ready_timeout=60.0)
        time.sleep(1.5)  # the links reconnect, see the new epoch, the worker registers again
        # i: the same prompt again, a miss (h stored nothing), computed and stored; j hits and loads it
        compute_and_store("i", fresh)
        finish("i")
        tokens = match("j", fresh)[0]
        assert tokens == 2 * CHUNK, tokens
        target = blocks(-(-len(fresh) // BLOCK))
        scheduler.update_state_after_alloc("j", target, tokens)
        plan = scheduler.build_plan([ScheduledRequest("j", tokens, len(fresh) - tokens, target, True)])
        load("j", list(plan.retrieves))
        worker.submit_stores(plan.stores)
        assert worker.load_errors() == set()
        for cache in kv.values():
            for t in range(tokens):
                assert bool((token_slot(cache, target[t // BLOCK], t % BLOCK) == float(fresh[t])).all()), t
        finish("j")

        # k: preempted with its load planned: vLLM planned k's hit (a load into its blocks), then
        # preempted it in the next step before it ran; the worker waits for no copy to read its
        # blocks, and k, matched again, recomputes (its lookup's hit was spent) into new blocks
        assert match("k", fresh) == (2 * CHUNK, gpu)
        target = blocks(-(-len(fresh) // BLOCK))
        scheduler.update_state_after_alloc("k", target, 2 * CHUNK)
        plan = scheduler.build_plan([ScheduledRequest("k", 2 * CHUNK, len(fresh) - 2 * CHUNK, target, True)])
        assert [(r.start, r.end) for r in plan.retrieves] == [(0, 2 * CHUNK)], plan
        preempting = scheduler.build_plan([], preempted=["k"])
        assert tuple(preempting.preempted) == ("k",), preempting
        load("k", list(plan.retrieves))
        worker.submit_stores(plan.stores)
        worker.wait_for_store_copies()  # (the connector's handle_preemptions)
        assert match("k", fresh) == (0, False)
        again = blocks(-(-len(fresh) // BLOCK))
        scheduler.update_state_after_alloc("k", again, 0)
        write(again, fresh)
        plan = scheduler.build_plan([ScheduledRequest("k", 0, len(fresh), again, True)])
        worker.submit_retrieves(plan.retrieves)
        worker.submit_stores(plan.stores)
        finish("k")
        worker.close()
        scheduler.close()

        # l-n: a second engine, connected through a loopback proxy (tools/zmq_fault_proxy.py)
        # that holds or drops what it is told to, in front of a second server (its own disk L2)
        other_server = ServerProcess(other_flags, ready_timeout=60.0)
        proxy = FaultProxy(other_server.url)
        config = ConnectorConfig(server_urls=proxy.url, chunk_size=CHUNK)
        scheduler = SchedulerAdapter.connect(config, model_name=MODEL, world_size=1, block_size=BLOCK,
                                             cpu_engine=not gpu)
        worker = WorkerAdapter.connect(config, model_name=MODEL, world_size=1, rank=0, block_size=BLOCK)
        worker.register_kv_caches(kv)
        time.sleep(1.5)  # both links healthy, the worker registered

        # l: a miss through the proxy, computed and stored (the second server's first work)
        through = [rng.randrange(1, 1000) for _ in range(2 * CHUNK + 3)]
        compute_and_store("l", through)
        finish("l")
        time.sleep(0.5)

        # m: the server alive, one reply never comes: the proxy drops the reply to m's lookup;
        # the link's request deadline fails it typed (timeout) while heartbeats keep answering
        proxy.drop_next_reply()
        # (asked every half second rather than every step: the recording stays small)
        assert match("m", [rng.randrange(1, 1000) for _ in range(2 * CHUNK + 3)], every=0.5) == (0, False)
        assert proxy.dropped, "the proxy dropped no reply"
        finish("m")

        # n: a miss, computed; before its store the server behind the address is replaced (the
        # proxy sends to the first server from now on: another epoch, the instance unknown there)
        # while the proxy holds the heartbeats and instance pings that would tell the links: the
        # worker's store is refused (not_registered); its link parks it, registers the instance
        # and sends it once more, naming the registration
        replaced = [rng.randrange(1, 1000) for _ in range(2 * CHUNK + 3)]
        assert match("n", replaced) == (0, False)
        source = blocks(-(-len(replaced) // BLOCK))
        scheduler.update_state_after_alloc("n", source, 0)
        write(source, replaced)
        proxy.hold_heartbeats()
        proxy.switch(server.url)
        plan = scheduler.build_plan([ScheduledRequest("n", 0, len(replaced), source, True)])
        worker.submit_retrieves(plan.retrieves)
        worker.submit_stores(plan.stores)
        time.sleep(0.5)  # the refusal, the registration, the resend and its reply
        proxy.release_heartbeats()
        finish("n")
        time.sleep(1.5)  # the heartbeats answer with the other epoch
        tokens = match("n2", replaced)[0]
        assert tokens == 2 * CHUNK, f"n's resent store did not land: {tokens}"
        finish("n2")
        worker.close()
        scheduler.close()
        proxy.close()
    finally:
        del os.environ["MPCACHE_RECORD"]
        server.stop()
        if other_server is not None:
            other_server.stop()
    with open(record, encoding="utf-8") as f:
        text = f.read()
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"{out}: {text.count(chr(10))} lines, {len(text)} bytes")
    return 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--gpu"]
    sys.exit(main(args[0] if args else "tests/data/prod_recording.jsonl", gpu="--gpu" in sys.argv[1:]))
