"""Drive real vLLM (CPU) on the tiny Llama, with or without mpcache, and report as JSON.

Run inside the vLLM venv (``.venv-vllm``, built by ``.ci/e2e``); ``tests/e2e`` calls it and
checks the report. Two modes:

* ``baseline``: no connector, prefix caching off; the greedy outputs every other run must equal.
* ``connector``: starts an mpcache server process, runs vLLM with ``MPCacheConnector`` (prefix
  caching off, so every hit comes from mpcache) through these phases, reading the server's
  stats between them: ``miss`` (first run of each prompt: stores), ``hit`` (the same prompts
  again: loads), ``abort`` (requests aborted while their lookup or load is in flight), ``restart``
  (the server killed and started again, then the prompts twice), and last ``corrupt`` (every L1
  slot overwritten with noise, then a prompt whose chunk is in L1: the output must change).

* ``connector-tp`` (with ``--tp N``): the prompts twice, miss then hit, under tensor parallelism,
  with each worker rank's own connector counters after each phase (``collective_rpc``).

Usage: python tests/e2e/vllm_driver.py MODE --model DIR --out REPORT.json [--port N] [--tp N]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT_SEEDS = {"p300": (300, 1), "p520": (520, 2)}
MAX_TOKENS = 12


def prompts() -> dict[str, list[int]]:
    """Token-id prompts (one token per word of the tiny model's vocabulary, 4 special ids)."""
    import random

    out: dict[str, list[int]] = {}
    for name, (length, seed) in PROMPT_SEEDS.items():
        rng = random.Random(seed)
        out[name] = [4 + rng.randrange(508) for _ in range(length)]
    # Shares its first 256 tokens (one chunk) with p300, then diverges: a partial hit.
    out["p300_tail"] = out["p300"][:256] + [4 + (t * 7 + 3) % 508 for t in out["p300"][256:]]
    return out


def make_llm(model: str, kv_transfer_config: dict[str, Any] | None, tp: int = 1) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=model,
        tokenizer=model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=4,
        seed=0,
        enable_prefix_caching=False,
        tensor_parallel_size=tp,
    )
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config
    return LLM(**kwargs)


def generate(llm: Any, token_ids: list[int]) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    t0 = time.perf_counter()
    (output,) = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return {
        "output_ids": list(output.outputs[0].token_ids),
        "num_cached_tokens": int(output.num_cached_tokens or 0),
        "seconds": round(seconds, 4),
    }


def run_baseline(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    llm = make_llm(args.model, None, args.tp)
    init_s = time.perf_counter() - t0
    results = {name: generate(llm, ids) for name, ids in prompts().items()}
    return {"mode": "baseline", "tp": args.tp, "init_s": round(init_s, 2), "results": results}


def omp_bind_per_rank(tp: int) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``tp`` CPU workers its own share of this
    process's CPUs (``0|1`` on a 2-core box); None if there are fewer CPUs than ranks. vLLM's
    ``auto`` binding wants one NUMA node per rank and refuses TP > 1 on a one-node box."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        return None
    per = len(cpus) // tp
    return "|".join(",".join(str(c) for c in cpus[r * per : (r + 1) * per]) for r in range(tp))


# ------------------------------------------------------------------ connector mode


class ServerProcess:
    """An ``mpcache-server`` child process on a fixed loopback port."""

    def __init__(self, port: int, log_path: Path, trace: bool = False) -> None:
        self.port = port
        self.url = f"tcp://127.0.0.1:{port}"
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        # trace: each start records its core_sm event stream (--trace) to <log>.trace<N>.jsonl
        self.trace = trace
        self.traces: list[str] = []

    def start(self) -> float:
        from mpcache.runtime_zmq.client import MPCacheClient

        exe = Path(sys.executable).with_name("mpcache-server")
        log = open(self.log_path, "ab")
        extra: list[str] = []
        if self.trace:
            path = str(self.log_path.with_suffix(f".trace{len(self.traces)}.jsonl"))
            self.traces.append(path)
            extra = ["--trace", path]
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [str(exe), "--host", "127.0.0.1", "--port", str(self.port), "--chunk-size", "256", "--l1-size-gb", "0.0625",
             "--slot-mb", "1", *extra],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        with MPCacheClient(self.url, request_timeout=2.0, wait_connected=False) as client:
            if not client.wait_healthy(30.0):
                raise RuntimeError(f"mpcache-server did not answer on {self.url}; see {self.log_path}")
        return time.perf_counter() - t0

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def stats(self) -> dict[str, Any]:
        from mpcache.runtime_zmq.client import MPCacheClient

        with MPCacheClient(self.url, request_timeout=5.0) as client:
            return dict(client.stats())

    def l1_info(self) -> dict[str, Any]:
        from mpcache.runtime_zmq.client import MPCacheClient

        with MPCacheClient(self.url, request_timeout=5.0) as client:
            return dict(client.l1_info())


def wait_idle(llm: Any, timeout: float = 60.0) -> list[Any]:
    """Step the engine until no request is left; return the finished outputs."""
    engine = llm.llm_engine
    outputs = []
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError("vLLM still has unfinished requests")
        outputs.extend(o for o in engine.step() if o.finished)
    return outputs


def transfer_config(url: str) -> dict[str, Any]:
    return {
        "kv_connector": "MPCacheConnector",
        "kv_connector_module_path": "mpcache.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "mpcache.server_urls": url,
            "mpcache.request_timeout_s": 5.0,
            "mpcache.chunk_size": 256,
        },
    }


def _rank_stats(worker: Any) -> dict[str, Any]:
    """Runs inside each vLLM worker (``collective_rpc``): its rank and its connector's
    TransferClient counters (stores, retrieves, failures)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    adapter = get_kv_transfer_group()._worker
    return {"rank": adapter.rank, "instance_id": adapter.instance_id, **adapter.machine.stats()}


def run_connector_tp(args: argparse.Namespace) -> dict[str, Any]:
    """Tensor parallel: the prompts twice (miss, then hit), each rank's own counters after
    each phase, and the server's."""
    server = ServerProcess(args.port, Path(args.out).with_suffix(".server.log"))
    report: dict[str, Any] = {"mode": "connector-tp", "tp": args.tp, "phases": {}}
    report["server_start_s"] = round(server.start(), 3)
    phases = report["phases"]
    try:
        t0 = time.perf_counter()
        llm = make_llm(args.model, transfer_config(server.url), args.tp)
        report["init_s"] = round(time.perf_counter() - t0, 2)
        ps = prompts()
        phases["miss"] = {name: generate(llm, ids) for name, ids in ps.items() if name != "p300_tail"}
        phases["miss_ranks"] = llm.collective_rpc(_rank_stats)
        phases["miss_stats"] = server.stats()
        phases["hit"] = {name: generate(llm, ids) for name, ids in ps.items()}
        phases["hit_ranks"] = llm.collective_rpc(_rank_stats)
        phases["hit_stats"] = server.stats()
        del llm
    finally:
        server.stop()
    return report


def run_connector(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams

    server = ServerProcess(args.port, Path(args.out).with_suffix(".server.log"), trace=True)
    report: dict[str, Any] = {"mode": "connector", "phases": {}}
    report["server_start_s"] = round(server.start(), 3)
    phases = report["phases"]
    try:
        t0 = time.perf_counter()
        llm = make_llm(args.model, transfer_config(server.url))
        report["init_s"] = round(time.perf_counter() - t0, 2)
        ps = prompts()

        phases["miss"] = {name: generate(llm, ids) for name, ids in ps.items() if name != "p300_tail"}
        phases["miss_stats"] = server.stats()
        phases["hit"] = {name: generate(llm, ids) for name, ids in ps.items()}
        phases["hit_stats"] = server.stats()

        # Abort: one request aborted right after submission (lookup in flight), one after a
        # few engine steps (its load in flight or done), then the engine drained.
        engine = llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        engine.add_request("abort-at-lookup", {"prompt_token_ids": ps["p520"]}, params)
        engine.step()
        engine.abort_request(["abort-at-lookup"])
        engine.add_request("abort-at-load", {"prompt_token_ids": ps["p300"]}, params)
        for _ in range(3):
            engine.step()
        engine.abort_request(["abort-at-load"])
        wait_idle(llm)
        # The server reaps nothing on its own within this window: leases must already be 0.
        time.sleep(0.5)
        phases["abort_stats"] = server.stats()

        # Server restart under a running engine: kill -9, start again on the same port. The
        # server stays down past the clients' heartbeat timeout (3 s): a restart faster than the
        # heartbeat notices is not re-registered yet (docs/vllm.md, Limits).
        server.kill()
        phases["down"] = {"p300": generate(llm, ps["p300"])}
        time.sleep(4.0)
        report["server_restart_s"] = round(server.start(), 3)
        # The engine finds the new server on its own: each client probes as soon as ZMQ has
        # reconnected (reconnect_ivl_max, 1 s), so both of the engine's clients (scheduler,
        # worker) see it within about 1 s of it listening (`mpcache-bench reconnect`).
        # Nothing outside the engine can observe that (an idle engine registers again on its
        # next call, not before), so the wait is a generous multiple of that bound.
        time.sleep(4.0)
        phases["restart_first"] = {"p300": generate(llm, ps["p300"])}
        phases["restart_first_stats"] = server.stats()
        phases["restart_second"] = {"p300": generate(llm, ps["p300"])}
        phases["restart_stats"] = server.stats()

        # Negative control: overwrite every L1 slot with noise; the load path must change the
        # output (otherwise the hits above proved nothing).
        info = server.l1_info()
        segment = Path(info["segment"])
        size = segment.stat().st_size
        with open(segment, "r+b") as f:
            f.write(os.urandom(size))
        phases["corrupt"] = {"p300": generate(llm, ps["p300"])}
        phases["corrupt_stats"] = server.stats()
        del llm
    finally:
        server.stop()
    # the first server was killed (its trace may end mid-record, without its id seed); the
    # restarted one stopped cleanly: its trace is the recorded production run the simulator replays
    report["traces"] = {"killed": server.traces[:1], "stopped": server.traces[1:]}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("baseline", "connector", "connector-tp"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--port", type=int, default=15555)
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.tp > 1:
        bind = omp_bind_per_rank(args.tp)
        if bind is None:
            raise SystemExit(f"tensor_parallel_size {args.tp} needs at least {args.tp} CPUs")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of _rank_stats
    t0 = time.perf_counter()
    runs = {"baseline": run_baseline, "connector": run_connector, "connector-tp": run_connector_tp}
    report = runs[args.mode](args)
    report["total_s"] = round(time.perf_counter() - t0, 2)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({k: v for k, v in report.items() if k not in ("results", "phases")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
