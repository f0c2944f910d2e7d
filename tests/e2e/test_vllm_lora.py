"""Real vLLM (CPU) with LoRA through mpcache: two adapters on the same prompt never share KV and
each gets its own hits (``tests/e2e/vllm_lora_driver.py`` drives vLLM and reports JSON; ``make e2e``)."""
from __future__ import annotations

import json
from typing import Any

import pytest
from vllm_run import HERE, free_port, run_driver

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def report(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("lora")
    out = work / "lora.json"
    run_driver([str(HERE / "vllm_lora_driver.py"), "--model", model, "--out", str(out), "--port", str(free_port())],
         work / "lora.log", 900)
    result: dict[str, Any] = json.loads(out.read_text())
    print("e2e lora:", json.dumps({k: v for k, v in result.items() if k != "runs"}))
    return result


def test_two_adapters_never_share_kv_and_each_hits_its_own(report: dict[str, Any]) -> None:
    runs = report["runs"]
    # the adapters change the model: their outputs differ (else this test could prove nothing)
    assert runs["a1"]["output_ids"] != runs["b1"]["output_ids"]
    # same tokens, other adapter / no adapter: a miss each time, and one more chunk stored
    assert [runs[r]["num_cached_tokens"] for r in ("a1", "b1", "base1")] == [0, 0, 0]
    assert [runs[r]["objects"] for r in ("a1", "b1", "base1")] == [1, 2, 3]
    # each adapter again: its own chunk is loaded and reproduces its own output
    assert runs["a2"]["num_cached_tokens"] == 256 and runs["b2"]["num_cached_tokens"] == 256
    assert runs["a2"]["output_ids"] == runs["a1"]["output_ids"]
    assert runs["b2"]["output_ids"] == runs["b1"]["output_ids"]
