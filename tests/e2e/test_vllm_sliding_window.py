"""Real vLLM (CPU) on a sliding-window model through mpcache (``make e2e``).

``MPCacheConnector`` is not SupportsHMA, so vLLM turns its hybrid KV-cache manager off; every
layer of the tiny Mistral has the window (128 tokens), so it runs with one sliding-window
KV-cache group. mpcache stores its prompt chunks on the first run and, on the second, loads the
window before the resume point (core_sm.kv_groups) with the greedy output of a run without
mpcache. The server runs on its default slot sizing:
its L1 slots are cut to the model's objects (``tests/e2e/vllm_swa_driver.py``)."""
from __future__ import annotations

from typing import Any

import pytest
from vllm_run import HERE, build_model, driver_report, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]
DRIVER = str(HERE / "vllm_swa_driver.py")


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work, model = build_model(tmp_path_factory, DRIVER, "swa")
    out: dict[str, Any] = {mode: driver_report(DRIVER, mode, work, model, mode, 900, "--port", str(free_port()))
                           for mode in ("baseline", "connector")}
    out["log"] = (work / "connector.log").read_text(errors="replace")
    print("sliding-window e2e seconds:", {m: out[m]["seconds"] for m in ("baseline", "connector")})
    return out


def test_sliding_window_model_runs_as_one_group(reports: dict[str, Any]) -> None:
    assert "Turning off hybrid kv cache manager" in reports["log"]
    assert "0 external tokens" not in reports["log"]  # one window group is restored


def test_second_run_loads_from_mpcache_with_the_baseline_output(reports: dict[str, Any]) -> None:
    base, phases = reports["baseline"]["results"], reports["connector"]["phases"]
    for name, expected_cached in (("p300", 256), ("p520", 512)):
        assert phases["miss"][name]["output_ids"] == base[name]["output_ids"]
        assert phases["miss"][name]["num_cached_tokens"] == 0
        assert phases["hit"][name]["num_cached_tokens"] == expected_cached
        assert phases["hit"][name]["output_ids"] == base[name]["output_ids"]


def test_l1_slots_follow_the_model(reports: dict[str, Any]) -> None:
    """Default flags: the slots were cut to this model's 256 KiB objects, not 32 MiB."""
    l1 = reports["connector"]["l1"]
    object_bytes = 2 * 2 * 256 * 2 * 32 * 4  # K+V, 2 layers, 256 tokens, 2 heads of 32, float32
    assert l1["slot_bytes"] == object_bytes and l1["num_slots"] * object_bytes >= 0.9 * (64 << 20)
    assert reports["connector"]["objects"] == 3  # p300: 1 chunk, p520: 2 chunks
